"""dynamic_sampling (DAPO): generate() fills the batch with groups whose rewards differ, drawing and
scoring further rounds; the dropped groups stay on the batch; runs resume exactly, on one process or
two."""

import json
import os
import signal
import subprocess
import sys

import pandas as pd
import pytest
import torch

from grpo_lab import GRPOConfig, GRPOTrainer, ops
from grpo_lab.core.dynamic_sampling import check_dynamic_sampling
from grpo_lab.errors import ConfigError
from grpo_lab.tasks.addition import completion_text
from tests.conftest import SMALL, launch_two

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
SPREAD = dict(temperature=2.0, dynamic_sampling=True)
"""A temperature at which the shipped model's completions of one prompt differ, with dynamic sampling."""


def parity_reward(completions, answer, **kwargs):
    """The same reward for every completion of a prompt whose answer is even (no signal); a checksum
    of the completion's text otherwise (a spread, mostly)."""
    return [1.0 if int(a) % 2 == 0 else float(sum(map(ord, completion_text(c))) % 7)
            for c, a in zip(completions, answer, strict=True)]


def constant_reward(completions, **kwargs):
    return [0.0] * len(completions)


def test_groups_with_signal_are_those_whose_values_are_not_all_equal():
    values_B = torch.tensor([1.0, 1.0, 1.0,   0.0, 1.0, 0.0,   2.0, float("nan"), 2.0,   float("nan"), 3.0, 4.0,
                             float("nan"), float("nan"), 5.0])
    assert ops.groups_with_signal(values_B, 3).tolist() == [False, True, False, True, False]
    with pytest.raises(ValueError, match="do not split into groups of 4"):
        ops.groups_with_signal(values_B, 4)


def test_a_filled_batch_holds_only_groups_with_a_spread_scored_once_and_keeps_the_dropped_ones(make_session):
    calls = []

    def counted_parity(completions, answer, **kwargs):
        calls.append(len(completions))
        return parity_reward(completions, answer)

    session = make_session(reward_funcs=[counted_parity], **SPREAD)
    prompts_per_round = session.engine.sampler.prompts_per_batch
    for _ in range(3):
        position = session.engine.sampler.state_dict()
        calls.clear()
        rollout = session.generate()
        record = rollout.dynamic_sampling
        assert calls == [len(rollout)] * record.rounds  # every round scored once, in generate()
        assert record.rounds < session.config.dynamic_sampling_max_rounds
        scores = session.score()
        assert len(calls) == record.rounds  # score() returns generate()'s rewards
        assert torch.equal(scores.rewards_BF, record.rewards_BF)
        advantages = session.advantages()
        assert advantages.metrics["frac_reward_zero_std"] == 0.0
        assert advantages.metrics["dynamic_sampling/rounds"] == record.rounds
        assert advantages.metrics["dynamic_sampling/frac_groups_filled"] == 0.0
        assert not record.filler_B.any()
        # the batch: whole kept groups, numbered like any batch, each with a spread
        G = session.config.num_generations
        assert len(rollout) == session.engine.batching.generation_batch_size
        assert rollout.group_index_B.tolist() == torch.arange(len(rollout) // G).repeat_interleave(G).tolist()
        rewards_NG = scores.rewards_BF[:, 0].view(-1, G)
        assert all(len(set(group.tolist())) > 1 for group in rewards_NG)
        for answer, group in zip(rollout.columns["answer"][::G], rewards_NG):
            assert int(answer) % 2 == 1  # an even answer's group is all 1.0: never kept
        # the dropped groups: each of one value, the reason given, counted in the metrics
        dropped = record.dropped_frame()
        assert len(dropped) % G == 0 and set(dropped["why"]) <= {"too easy", "too hard"}
        assert all(frame["reward"].nunique() == 1 for _, frame in dropped.groupby(["round", "group"]))
        drawn = record.rounds * prompts_per_round
        dropped_share = (advantages.metrics["dynamic_sampling/frac_groups_dropped_too_easy"]
                         + advantages.metrics["dynamic_sampling/frac_groups_dropped_too_hard"])
        assert dropped_share == pytest.approx(len(dropped) / G / drawn)
        tokens = advantages.metrics["dynamic_sampling/tokens_per_kept_group"]
        assert tokens >= float(rollout.completion_lengths_B.sum()) / (len(rollout) // G)  # the dropped ones count too
        # the sampler moved on by every round's prompts
        sampler = session.engine.sampler
        assert sampler.epoch * sampler.dataset_size + sampler.position == (
            position["epoch"] * sampler.dataset_size + position["position"] + drawn)
        session.loss(), session.update()


def test_when_the_rounds_run_out_dropped_groups_fill_the_batch_trained_on_or_masked(make_session):
    results = {}
    for fill in ("zero_signal", "masked"):
        session = make_session(reward_funcs=[constant_reward], dynamic_sampling=True, dynamic_sampling_max_rounds=3,
                               dynamic_sampling_fill=fill, entropy_coef=0.01)  # a term that trains without advantages
        row = session.step()
        assert row["dynamic_sampling/rounds"] == 3.0
        assert row["dynamic_sampling/frac_groups_filled"] == 1.0 and row["frac_reward_zero_std"] == 1.0
        assert row["dynamic_sampling/frac_groups_dropped_too_hard"] == pytest.approx(2 / 3)  # 3 rounds, one kept as filler
        assert session.last_trained.advantages.scores.rollout.dynamic_sampling.filler_B.all()
        results[fill] = row
    assert results["zero_signal"]["grad_norm"] > 0  # the entropy term of the filled groups
    assert results["masked"]["grad_norm"] == 0.0 and results["masked"]["loss"] == 0.0  # none of their tokens counts


def test_settings_dynamic_sampling_cannot_fill_a_batch_under_are_refused(make_session):
    with pytest.raises(ConfigError, match="dynamic_sampling_fill=.drop. is not supported. Allowed values: .zero_signal., .masked."):
        GRPOConfig(dynamic_sampling_fill="drop")
    with pytest.raises(ConfigError, match="dynamic_sampling_max_rounds must be"):
        GRPOConfig(dynamic_sampling_max_rounds=0)
    with pytest.raises(ConfigError, match=r"dynamic_sampling_metric='accuracy' names no reward function of this run "
                                          r"\(correctness_reward, format_reward\)"):
        make_session(dynamic_sampling=True, dynamic_sampling_metric="accuracy")
    config = GRPOConfig(num_generations=4, per_device_train_batch_size=2, generation_batch_size=4, dynamic_sampling=True)
    with pytest.raises(ConfigError, match="a share holds 2 completions, not a multiple of num_generations"):
        check_dynamic_sampling(config, config.resolve(2), 2, ["reward"], None)
    whole = GRPOConfig(num_generations=4, per_device_train_batch_size=4, dynamic_sampling=True)
    check_dynamic_sampling(whole, whole.resolve(2), 2, ["reward"], None)  # a share of 4 completions: one group
    session = make_session(**SPREAD, dynamic_sampling_metric="format_reward")
    session.config.dynamic_sampling_metric = "missing"  # a live edit is checked at the next generate()
    with pytest.raises(ConfigError, match="names no reward function"):
        session.generate()
    assert session.next_stage == "generate"


def test_a_named_reward_decides_which_groups_are_kept(make_session, task):
    session = make_session(reward_funcs=[parity_reward, constant_reward], **SPREAD,
                           dynamic_sampling_metric="parity_reward")
    session.generate()
    rewards_BF = session.score().rewards_BF
    G = session.config.num_generations
    assert all(len(set(group.tolist())) > 1 for group in rewards_BF[:, 0].view(-1, G))
    assert (rewards_BF[:, 1] == 0).all()  # the constant reward alone would have kept nothing


def _no_time(history: pd.DataFrame) -> pd.DataFrame:
    return history.drop(columns=["step_time"]).reset_index(drop=True)


def test_the_trainer_and_a_session_fill_the_same_batches(make_session, task, tmp_path):
    session = make_session(reward_funcs=[parity_reward], **SPREAD, max_steps=3)
    session.run(3, progress=False)
    config = task.config(**{**SMALL, **SPREAD, "max_steps": 3, "output_dir": str(tmp_path / "trainer"),
                            "save_strategy": "no"})
    trainer = GRPOTrainer(task.model, [parity_reward], args=config, train_dataset=task.train_dataset)
    trainer.train()
    pd.testing.assert_frame_equal(_no_time(trainer.session.history), _no_time(session.history))
    assert (trainer.session.history["frac_reward_zero_std"] == 0).all()


KILLED_RUN = """
import os, signal, sys
from transformers import TrainerCallback
from grpo_lab import GRPOConfig, GRPOTrainer
from grpo_lab.tasks import default_task
from tests.test_dynamic_sampling import SPREAD, parity_reward
from tests.conftest import SMALL

out, kill_at = sys.argv[1], int(sys.argv[2])


class KilledAfterStep(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == kill_at:  # checkpoint-2 is on disk; the process dies without a word
            os.kill(os.getpid(), signal.SIGKILL)


task = default_task(eval_size=16)
config = task.config(**{**SMALL, **SPREAD, "max_steps": 4, "save_steps": 2, "output_dir": out})
trainer = GRPOTrainer(task.model, [parity_reward], args=config, train_dataset=task.train_dataset,
                      callbacks=[KilledAfterStep()])
trainer.train(resume_from_checkpoint=kill_at == 0 and os.path.isdir(out))
trainer.save_model(out + "/final")
"""


@pytest.mark.slow
def test_a_run_killed_mid_way_resumes_to_the_weights_of_the_uninterrupted_run(task, tmp_path):
    from transformers import AutoModelForCausalLM

    config = task.config(**{**SMALL, **SPREAD, "max_steps": 4, "save_strategy": "no",
                            "output_dir": str(tmp_path / "whole")})
    whole = GRPOTrainer(task.model, [parity_reward], args=config, train_dataset=task.train_dataset)
    whole.train()
    script = tmp_path / "run.py"
    script.write_text(KILLED_RUN)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    killed = subprocess.run([sys.executable, str(script), str(tmp_path / "run"), "3"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoint-2" / "COMPLETE").exists() and not (tmp_path / "run" / "final").exists()
    resumed = subprocess.run([sys.executable, str(script), str(tmp_path / "run"), "0"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final").state_dict()
    for name, value in whole.session.model.state_dict().items():
        assert torch.equal(final[name], value), name


TWO_PROCESSES = """
import json, sys
import torch
from grpo_lab import GRPOConfig, GRPOTrainer
from grpo_lab.tasks import default_task
from tests.test_dynamic_sampling import SPREAD, parity_reward

out, resume = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None
task = default_task()
config = GRPOConfig(output_dir=out, max_steps=4, save_steps=2, num_generations=4, per_device_train_batch_size=4,
                    gradient_accumulation_steps=2, max_completion_length=6, learning_rate=1e-3, seed=0,
                    disable_tqdm=True, **SPREAD)
trainer = GRPOTrainer(task.model, [parity_reward], args=config, train_dataset=task.train_dataset)
batches = []
trainer.session.on(lambda stage, result: batches.append(
    [len(result), result.dynamic_sampling.rounds, sorted(set(result.columns["answer"]))]) if stage == "generate" else None)
trainer.train(resume_from_checkpoint=resume)
rank = trainer.accelerator.process_index
with open(f"{out}/batches-{rank}.json", "w") as report:
    json.dump({"batches": batches, "history": trainer.session.history.drop(columns=["step_time"]).to_dict("list")},
              report)
torch.save({n: p.detach().clone() for n, p in trainer.session.model.named_parameters()}, f"{out}/weights-{rank}.pt")
trainer.close()
"""


@pytest.mark.slow
def test_two_processes_fill_their_shares_with_the_same_rounds_and_resume_exactly(tmp_path):
    (tmp_path / "run.py").write_text(TWO_PROCESSES)
    launch = launch_two("--multi_gpu", "--mixed_precision", "no", "--dynamo_backend", "no")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    for out, resume in (("whole", []), ("resumed", [str(tmp_path / "whole" / "checkpoint-2")])):
        done = subprocess.run([*launch, str(tmp_path / "run.py"), str(tmp_path / out), *resume], capture_output=True,
                              text=True, env=env, cwd=ROOT, timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]
    runs = [json.loads((tmp_path / "whole" / f"batches-{rank}.json").read_text()) for rank in (0, 1)]
    assert runs[0]["history"] == runs[1]["history"]  # the metrics are over both processes
    history = runs[0]["history"]
    assert history["frac_reward_zero_std"] == [0.0] * 4
    for (size0, rounds0, answers0), (size1, rounds1, answers1) in zip(runs[0]["batches"], runs[1]["batches"]):
        assert size0 == size1 == 8 and rounds0 == rounds1  # the same rounds, each process its own share
        assert all(int(a) % 2 == 1 for a in answers0 + answers1)
    whole = [torch.load(tmp_path / "whole" / f"weights-{rank}.pt") for rank in (0, 1)]
    resumed = [torch.load(tmp_path / "resumed" / f"weights-{rank}.pt") for rank in (0, 1)]
    for name, value in whole[0].items():
        assert torch.equal(whole[1][name], value) and all(torch.equal(copy[name], value) for copy in resumed), name


def test_a_saved_filled_batch_loads_with_its_record_and_trains_on_as_it_would_have(make_session, tmp_path):
    from grpo_lab import GRPOSession

    original = make_session(reward_funcs=[parity_reward], **SPREAD)
    original.generate()
    original.save(tmp_path / "mid")
    loaded = GRPOSession.load(tmp_path / "mid", reward_funcs=[parity_reward])
    record, saved = loaded.rollout.dynamic_sampling, original.rollout.dynamic_sampling
    assert record.rounds == saved.rounds and record.dropped == saved.dropped
    assert torch.equal(record.rewards_BF, saved.rewards_BF)
    a, b = original.step(), loaded.step()
    assert {k: v for k, v in a.items() if k != "step_time"} == {k: v for k, v in b.items() if k != "step_time"}
