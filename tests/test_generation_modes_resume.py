"""dynamic_sampling and async_generation across processes and crashes: a trainer killed with SIGKILL
resumes to the weights of the uninterrupted run, and two processes train alike and resume exactly (each
mode, and both at once)."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from grpo_lab import GRPOTrainer
from tests.conftest import SMALL, launch_two
from tests.test_dynamic_sampling import SPREAD, parity_reward

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
MODES = {"dynamic_sampling": SPREAD, "async_generation": dict(async_generation=True),
         "both": {**SPREAD, "async_generation": True}}

KILLED_RUN = """
import json, os, signal, sys
from transformers import TrainerCallback
from grpo_lab import GRPOTrainer
from grpo_lab.tasks import default_task
from tests.test_dynamic_sampling import parity_reward
from tests.conftest import SMALL

out, kill_at, mode = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])


class KilledAfterStep(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == kill_at:  # checkpoint-2 is on disk; the process dies without a word
            os.kill(os.getpid(), signal.SIGKILL)


task = default_task(eval_size=16)
config = task.config(**{**SMALL, **mode, "max_steps": 4, "save_steps": 2, "output_dir": out})
trainer = GRPOTrainer(task.model, [parity_reward], args=config, train_dataset=task.train_dataset,
                      callbacks=[KilledAfterStep()])
trainer.train(resume_from_checkpoint=kill_at == 0 and os.path.isdir(out))
trainer.save_model(out + "/final")
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dynamic_sampling", "async_generation"])  # both at once: the 2-process test
def test_a_run_killed_mid_way_resumes_to_the_weights_of_the_uninterrupted_run(task, tmp_path, mode):
    from transformers import AutoModelForCausalLM

    config = task.config(**{**SMALL, **MODES[mode], "max_steps": 4, "save_strategy": "no",
                            "output_dir": str(tmp_path / "whole")})
    whole = GRPOTrainer(task.model, [parity_reward], args=config, train_dataset=task.train_dataset)
    whole.train()
    script = tmp_path / "run.py"
    script.write_text(KILLED_RUN)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    run = [sys.executable, str(script), str(tmp_path / "run")]
    killed = subprocess.run([*run, "3", json.dumps(MODES[mode])], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoint-2" / "COMPLETE").exists() and not (tmp_path / "run" / "final").exists()
    resumed = subprocess.run([*run, "0", json.dumps(MODES[mode])], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final").state_dict()
    for name, value in whole.session.model.state_dict().items():
        assert torch.equal(final[name], value), name


TWO_PROCESSES = """
import json, sys
import torch
from accelerate.state import AcceleratorState, GradientState
from transformers import TrainerCallback
from grpo_lab import GRPOConfig, GRPOTrainer
from grpo_lab.tasks import default_task
from tests.test_dynamic_sampling import parity_reward
from tests.test_generation_modes_resume import MODES

out, resume = sys.argv[1], sys.argv[2] == "resume"
task = default_task()
for name, mode in MODES.items():  # one launch for both: its start-up is most of what a short run costs
    folder = f"{out}/{name}"
    config = GRPOConfig(output_dir=folder, max_steps=4, save_steps=2, num_generations=4, per_device_train_batch_size=4,
                        gradient_accumulation_steps=2, max_completion_length=6, learning_rate=1e-3, seed=0,
                        disable_tqdm=True, **{"temperature": 2.0, **mode})
    batches = []

    class Batches(TrainerCallback):  # after each step: the batch it trained on (a resume builds a new session)
        def on_step_end(self, args, state, control, **kwargs):
            result = trainer.session.last_trained.advantages.scores.rollout
            batches.append([len(result), result.columns["answer"], result.policy_version, result.step,
                            None if result.dynamic_sampling is None else result.dynamic_sampling.rounds,
                            result.group_index_B.tolist()])

    trainer = GRPOTrainer(task.model, [parity_reward], args=config, train_dataset=task.train_dataset,
                          callbacks=[Batches()])
    trainer.train(resume_from_checkpoint=sys.argv[3] + f"/{name}/checkpoint-2" if resume else None)
    rank = trainer.accelerator.process_index
    history = trainer.session.history.drop(columns=["step_time", "async_generation/trainer_wait",
                                                    "async_generation/generator_idle"], errors="ignore")
    with open(f"{folder}/batches-{rank}.json", "w") as report:
        json.dump({"batches": batches, "history": history.to_dict("list")}, report)
    torch.save({n: p.detach().clone() for n, p in trainer.session.model.named_parameters()},
               f"{folder}/weights-{rank}.pt")
    if name == list(MODES)[-1]:
        trainer.close()  # ends the process group too
    else:
        trainer.session.close()
        AcceleratorState._reset_state()  # the next run builds accelerate's state afresh, in the same process group
        GradientState._reset_state()
"""


@pytest.mark.slow
def test_two_processes_train_alike_in_each_mode_and_both_and_resume_exactly(tmp_path):
    (tmp_path / "run.py").write_text(TWO_PROCESSES)
    launch = launch_two("--multi_gpu", "--mixed_precision", "no", "--dynamo_backend", "no")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    for out, resume in (("whole", "no"), ("resumed", "resume")):
        done = subprocess.run([*launch, str(tmp_path / "run.py"), str(tmp_path / out), resume, str(tmp_path / "whole")],
                              capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
        assert done.returncode == 0, done.stderr[-4000:]
    for name in MODES:
        runs = [json.loads((tmp_path / "whole" / name / f"batches-{rank}.json").read_text()) for rank in (0, 1)]
        assert runs[0]["history"] == runs[1]["history"]  # the metrics are over both processes
        history, batches = runs[0]["history"], list(zip(runs[0]["batches"], runs[1]["batches"]))
        for first, second in batches:
            assert first[0] == second[0] == 8 and first[2:5] == second[2:5]  # each its share, at the same versions
            assert first[5] == [0] * 4 + [1] * 4 and second[5] == [2] * 4 + [3] * 4  # numbered over both processes
        for rank in (0, 1):  # the resumed run trains on the batches the uninterrupted one trained at steps 3 and 4
            resumed = json.loads((tmp_path / "resumed" / name / f"batches-{rank}.json").read_text())
            assert resumed["batches"] == runs[rank]["batches"][2:], (name, rank)
        if name != "async_generation":
            assert history["frac_reward_zero_std"] == [0.0] * 4
            assert all(int(a) % 2 == 1 for first, second in batches for a in first[1] + second[1])
            assert first[1] != second[1]  # each process its own prompts
        if name != "dynamic_sampling":  # with both, a batch is as stale as its first round
            assert history["async_generation/staleness"] == [0.0, 1.0, 1.0, 1.0]
            assert [first[2] for first, _ in batches] == [0, 0, 1, 2]
        if name == "both":
            assert any(first[4] > 1 for first, _ in batches)  # rounds taken one after another
        whole = [torch.load(tmp_path / "whole" / name / f"weights-{rank}.pt") for rank in (0, 1)]
        resumed = [torch.load(tmp_path / "resumed" / name / f"weights-{rank}.pt") for rank in (0, 1)]
        for key, value in whole[0].items():
            assert torch.equal(whole[1][key], value), (name, key)
            assert all(torch.equal(copy[key], value) for copy in resumed), (name, key)


def assert_sharded_processes_filled_alike(out) -> None:
    """A dynamic-sampling run of ``tests/sharded_on_cpu.py`` (``"dynamic_sampling": true``) under a
    sharded layout (FSDP, DeepSpeed ZeRO-2 or 3): every process drew as many rounds as the others (the
    rounds are collective; where the weights are sharded, so is each forward pass) and trained on its
    full share of kept groups, numbered over both processes."""
    result = json.loads((out / "result.json").read_text())
    row, runs = result["row"], [json.loads((out / f"batches-{rank}.json").read_text()) for rank in (0, 1)]
    assert row["step"] == 4 and row["frac_reward_zero_std"] == 0.0 and row["dynamic_sampling/frac_groups_filled"] == 0.0
    assert len(runs[0]) == len(runs[1]) == 4  # one generation batch per optimizer step
    assert any(rounds > 1 for _, rounds, _, _ in runs[0])  # rounds drawn together past the first
    for (size, rounds, groups, answers), (other_size, other_rounds, other_groups, other_answers) in zip(*runs):
        assert size == other_size == 8 and rounds == other_rounds
        assert groups == [0] * 4 + [1] * 4 and other_groups == [2] * 4 + [3] * 4
        assert all(int(a) % 2 == 1 for a in answers + other_answers)  # an even answer's group has no signal

