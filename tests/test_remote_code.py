"""trust_remote_code: a checkpoint that ships its own model code (``auto_map``), loaded only when asked."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

CONFIGURATION = '''
from transformers import LlamaConfig


class CountingConfig(LlamaConfig):
    model_type = "grpo_lab_counting"
'''

MODELING = '''
from transformers import LlamaForCausalLM

from .configuration_counting import CountingConfig


class CountingForCausalLM(LlamaForCausalLM):
    """The shipped Llama, counting its forward passes: proof that this file's code runs."""

    config_class = CountingConfig
    calls = 0

    def forward(self, *args, **kwargs):
        type(self).calls += 1
        return super().forward(*args, **kwargs)
'''

RUN = '''
import sys

from grpo_lab import GRPOSession
from grpo_lab.tasks import default_task

task = default_task()
model_dir, out = sys.argv[1], sys.argv[2]
settings = dict(output_dir=out, num_generations=4, per_device_train_batch_size=8, max_completion_length=8, max_steps=3,
                gradient_checkpointing=False, report_to="none")
try:
    GRPOSession(model_dir, task.reward_funcs, args=task.config(**settings), train_dataset=task.train_dataset)
except ValueError as error:
    print("refused:", "trust_remote_code=True" in str(error))
session = GRPOSession(model_dir, task.reward_funcs, args=task.config(**settings, trust_remote_code=True),
                      train_dataset=task.train_dataset)
session.step()
model = session.engine.unwrapped_model
print("trained:", type(model).__name__, type(model).calls > 0)
session.save(out + "/saved")
calls = type(model).calls
try:
    GRPOSession.load(out + "/saved")  # the saved config's trust_remote_code is not the caller's
except ValueError as error:
    print("reload refused:", "trust_remote_code=True" in str(error), type(model).calls == calls)
loaded = GRPOSession.load(out + "/saved", trust_remote_code=True)
print("reloaded:", type(loaded.engine.unwrapped_model).__name__, loaded.step()["step"])
'''


@pytest.mark.slow
def test_a_checkpoint_with_its_own_model_code_is_refused_unless_trusted_then_trains_and_reloads(task, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = tmp_path / "counting"
    AutoModelForCausalLM.from_pretrained(task.model).save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(task.model).save_pretrained(model_dir)
    (model_dir / "configuration_counting.py").write_text(textwrap.dedent(CONFIGURATION))
    (model_dir / "modeling_counting.py").write_text(textwrap.dedent(MODELING))
    config = json.loads((model_dir / "config.json").read_text())
    config.update(model_type="grpo_lab_counting", architectures=["CountingForCausalLM"], auto_map={
        "AutoConfig": "configuration_counting.CountingConfig",
        "AutoModelForCausalLM": "modeling_counting.CountingForCausalLM",
    })
    (model_dir / "config.json").write_text(json.dumps(config))
    (tmp_path / "run.py").write_text(RUN)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}  # not the user's cache
    done = subprocess.run([sys.executable, str(tmp_path / "run.py"), str(model_dir), str(tmp_path / "out")],
                          capture_output=True, text=True, env=env, timeout=300, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Do you wish to run the custom code?" not in done.stdout  # refused outright, not asked on a terminal
    assert re.findall(r"(refused|trained|reload refused|reloaded): (.*)", done.stdout) == [
        ("refused", "True"), ("trained", "CountingForCausalLM True"), ("reload refused", "True True"),
        ("reloaded", "CountingForCausalLM 2"),
    ]
