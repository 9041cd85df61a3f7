"""The accelerate glue: what a launch on a machine without a GPU becomes, said out loud."""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from accelerate.utils import DistributedType

from grpo_lab.parallel.layout import layout_for
from grpo_lab.parallel.zero import fill_config
from tests.conftest import launch_two

BUILD = ("from grpo_lab.parallel.dist import make_accelerator; "
         "print(make_accelerator('fp32', use_cpu=True).distributed_type)")


@pytest.mark.parametrize("name", ["FSDP", "DeepSpeed"])
def test_a_sharded_launch_on_cpu_warns_that_it_runs_unsharded(name):
    env = {key: value for key, value in os.environ.items() if not key.startswith("ACCELERATE_USE_")}
    launched = subprocess.run([sys.executable, "-c", BUILD], env={**env, f"ACCELERATE_USE_{name.upper()}": "true"},
                              capture_output=True, text=True, check=True)
    assert f"accelerate launch asked for {name}, which shards the model over GPUs" in launched.stderr
    assert launched.stdout.strip() == "DistributedType.NO"  # one process here; MULTI_CPU under a 2-process launch
    plain = subprocess.run([sys.executable, "-c", BUILD], env=env, capture_output=True, text=True, check=True)
    assert "shards the model" not in plain.stderr


def test_a_deepspeed_config_takes_its_auto_batch_clipping_and_accumulation_from_the_grpo_config():
    config = SimpleNamespace(per_device_train_batch_size=4, max_grad_norm=0.5)
    plugin = SimpleNamespace(deepspeed_config={"train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto",
                                               "zero_optimization": {"stage": 3}})
    fill_config(plugin, config)
    assert plugin.deepspeed_config == {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.5,
                                       "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 3}}
    fill_config(plugin, config)  # the same values again: accepted (a resumed run's second session)
    # grpo_lab accumulates over micro-batches itself: DeepSpeed's own accumulation would divide the loss again
    plugin.deepspeed_config["gradient_accumulation_steps"] = 4
    with pytest.raises(ValueError, match="gradient_accumulation_steps=4.*grpo_lab's config gives 1.*\"auto\""):
        fill_config(plugin, config)
    plugin = SimpleNamespace(deepspeed_config={"gradient_clipping": 1.0})
    with pytest.raises(ValueError, match="gradient_clipping=1.0.*0.5 \\(from max_grad_norm\\)"):
        fill_config(plugin, config)
    fill_config(plugin, SimpleNamespace(per_device_train_batch_size=4, max_grad_norm=1.0))
    # a word or a number in quotes, which DeepSpeed would fail on later or read as something else
    for key, value, kind in [("gradient_clipping", "none", "a number \\(0 for no clipping\\)"),
                             ("train_micro_batch_size_per_gpu", "4", "a whole number"),
                             ("train_micro_batch_size_per_gpu", 4.0, "a whole number"),
                             ("gradient_clipping", True, "a number \\(0 for no clipping\\)")]:
        plugin = SimpleNamespace(deepspeed_config={key: value})
        with pytest.raises(ValueError, match=rf"sets {key}={value!r} \(.*\); it takes \"auto\" or {kind}.*or write "
                                             rf"{kind} there, unquoted"):
            fill_config(plugin, config)


def test_a_zero_1_run_is_refused_up_front_as_only_zero_2_and_3_partitions_are_gathered():
    def launched(stage):
        return SimpleNamespace(distributed_type=DistributedType.DEEPSPEED,
                               state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=stage)))

    with pytest.raises(NotImplementedError, match="ZeRO-2 and ZeRO-3.*asked for ZeRO-1.*zero_stage: 2"):
        layout_for(launched(1)).check_savable()
    for stage in (0, 2, 3):  # stage 0 partitions nothing
        layout_for(launched(stage)).check_savable()
    layout_for(SimpleNamespace(distributed_type=DistributedType.MULTI_CPU)).check_savable()


def test_an_fsdp_1_run_is_refused_up_front_as_only_fsdp_2_shards_are_gathered():
    with pytest.raises(NotImplementedError, match="FSDP 2 only.*fsdp_version: 2"):
        layout_for(SimpleNamespace(distributed_type=DistributedType.FSDP, is_fsdp2=False)).check_savable()
    layout_for(SimpleNamespace(distributed_type=DistributedType.FSDP, is_fsdp2=True)).check_savable()


FAILING_SAVE = """
import sys

import grpo_lab.session.files
from grpo_lab import GRPOConfig, GRPOTrainer
from grpo_lab.tasks import default_task


def disk_full(*args, **kwargs):
    raise OSError(28, "No space left on device")


task = default_task()
config = GRPOConfig(output_dir=sys.argv[1], max_steps=2, save_steps=1, per_device_train_batch_size=4,
                    num_generations=4, max_completion_length=4, disable_tqdm=True)
trainer = GRPOTrainer(task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset)
if trainer.accelerator.is_main_process:
    grpo_lab.session.files.save_engine = disk_full  # the main process alone writes checkpoints
try:
    trainer.train()
except (OSError, RuntimeError) as error:  # each process's own file: the two share one stdout
    rank = trainer.accelerator.process_index
    with open(f"{sys.argv[1]}-error-{rank}.txt", "w") as report:
        report.write(f"process {rank}: {type(error).__name__}: {error}")
trainer.close()
"""


@pytest.mark.slow
def test_a_checkpoint_write_failing_on_the_main_process_stops_every_process_with_its_cause(tmp_path):
    (tmp_path / "run.py").write_text(FAILING_SAVE)
    out = tmp_path / "out"
    launch = launch_two("--multi_gpu", "--mixed_precision", "no", "--dynamo_backend", "no")
    # the other process used to wait at a barrier until gloo lost the main one; the timeout catches a hang
    done = subprocess.run([*launch, str(tmp_path / "run.py"), str(out)], capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    full = f"OSError: [Errno 28] Cannot save to {out / 'checkpoint-1'}: the disk or quota is full"
    main, other = [(tmp_path / f"out-error-{rank}.txt").read_text() for rank in (0, 1)]
    assert main.startswith(f"process 0: {full}"), main
    assert other.startswith(f"process 1: RuntimeError: The main process failed to write {out / 'checkpoint-1'}: {full}")
    assert [p.name for p in out.iterdir() if "checkpoint" in p.name] == []  # no partial checkpoint left
