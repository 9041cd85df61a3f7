"""Evaluation under TRL's names: ``trainer.evaluate()``, evaluation while training, named eval sets,
the best checkpoint; and that evaluating never changes the training run."""

import json
import math

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback

from grpo_lab import GRPOTrainer
from grpo_lab.core.evaluation import _eval_metrics, pass_at_k
from tests.conftest import SMALL


def _trainer(task, tmp_path, eval_dataset="default", callbacks=None, **overrides):
    config = task.config(**{**SMALL, "output_dir": str(tmp_path), "disable_tqdm": True, "save_steps": 100,
                            "per_device_eval_batch_size": 4, "num_generations_eval": 2, **overrides})
    if isinstance(eval_dataset, str):
        eval_dataset = task.eval_dataset.select(range(4))
    return GRPOTrainer(task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset,
                       eval_dataset=eval_dataset, callbacks=callbacks)


def test_eval_metrics_by_hand():
    rewards_BF = torch.tensor([[1.0, 0.0], [1.0, float("nan")], [0.0, 1.0], [2.0, 1.0]])
    lengths_B, truncated_B = torch.tensor([3.0, 5.0, 4.0, 8.0]), torch.tensor([0.0, 0.0, 0.0, 1.0])
    metrics = _eval_metrics(rewards_BF, lengths_B, truncated_B, ["a", "b"], [1.0, 0.5], repeats=2)
    # weighted sums (a NaN adds nothing): 1, 1, 0.5, 2.5 -> mean 1.25, sample std sqrt(2.25/3)
    assert metrics["reward"] == pytest.approx(1.25)
    assert metrics["reward_std"] == pytest.approx(math.sqrt((0.0625 + 0.0625 + 0.5625 + 1.5625) / 3))
    assert metrics["rewards/a/mean"] == pytest.approx(1.0) and metrics["rewards/b/mean"] == pytest.approx(2 / 3)
    assert metrics["frac_reward_zero_std"] == 0.5  # group 1 (1, 1) agrees; group 2 (0.5, 2.5) does not
    assert (metrics["completions/mean_length"], metrics["completions/min_length"],
            metrics["completions/max_length"], metrics["completions/clipped_ratio"]) == (5.0, 3.0, 8.0, 0.25)
    # the 8-token completion was cut: the three that ended have lengths 3, 5, 4
    assert (metrics["completions/mean_terminated_length"], metrics["completions/min_terminated_length"],
            metrics["completions/max_terminated_length"]) == (4.0, 3.0, 5.0)


def _no_time(frame):
    return frame.drop(columns=["step_time"])


def test_evaluating_never_changes_the_training_run(task, tmp_path):
    plain = _trainer(task, tmp_path / "plain", eval_dataset=None, max_steps=3)
    plain.train()
    evaluated = _trainer(task, tmp_path / "evaluated", max_steps=3, eval_strategy="steps", eval_steps=1,
                         eval_on_start=True)
    evaluated.train()
    assert sum("eval_reward" in row for row in evaluated.state.log_history) == 4  # at the start and every step
    pd.testing.assert_frame_equal(_no_time(evaluated.session.history), _no_time(plain.session.history))
    for (name, a), (_, b) in zip(plain.model.state_dict().items(), evaluated.model.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


class Evaluations(TrainerCallback):
    def __init__(self):
        self.seen = []

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.seen.append((state.global_step, metrics))


def test_evaluate_logs_trls_eval_metrics_and_runs_on_evaluate(task, tmp_path):
    callback = Evaluations()
    trainer = _trainer(task, tmp_path, callbacks=[callback], max_steps=1)
    metrics = trainer.evaluate()
    names = [f"rewards/{name}/{stat}" for name in ("correctness_reward", "format_reward") for stat in ("mean", "std")]
    expected = {"reward", "reward_std", "frac_reward_zero_std", *names, "completions/mean_length",
                "completions/min_length", "completions/max_length", "completions/clipped_ratio", "runtime",
                "completions/mean_terminated_length", "completions/min_terminated_length",
                "completions/max_terminated_length", "num_tokens", "loss", "entropy", "clip_ratio/low_mean",
                "clip_ratio/low_min", "clip_ratio/high_mean", "clip_ratio/high_max", "clip_ratio/region_mean",
                "samples_per_second", "steps_per_second"}
    assert set(metrics) - {"epoch"} == {f"eval_{key}" for key in expected}  # epoch: as transformers adds it
    assert trainer.state.log_history[-1] == {**metrics, "step": 0}
    assert callback.seen == [(0, metrics)]
    other = trainer.evaluate(task.eval_dataset.select(range(2)), metric_key_prefix="test")
    assert set(other) - {"epoch"} == {f"test_{key}" for key in expected}


def test_named_eval_sets_are_reported_set_by_set_and_survive_a_resume(task, tmp_path):
    sets = {"easy": task.eval_dataset.select(range(2)), "hard": task.eval_dataset.select(range(2, 6))}
    trainer = _trainer(task, tmp_path, eval_dataset=sets, max_steps=2, save_steps=1, eval_strategy="steps",
                       eval_steps=2)
    trainer.train()
    evaluated = [row for row in trainer.state.log_history if "eval_easy_reward" in row]
    assert len(evaluated) == 1 and evaluated[0]["step"] == 2 and "eval_hard_reward" in evaluated[0]
    assert not any("eval_reward" in row for row in trainer.state.log_history)
    resumed = _trainer(task, tmp_path, eval_dataset=None, max_steps=2)
    resumed.train(resume_from_checkpoint=tmp_path / "checkpoint-1")
    assert sorted(resumed.eval_dataset) == ["easy", "hard"]
    assert [len(resumed.eval_dataset[name]) for name in ("easy", "hard")] == [2, 4]


def test_evaluation_follows_eval_steps_and_ends_the_run_evaluated(task, tmp_path):
    trainer = _trainer(task, tmp_path, max_steps=5, eval_strategy="steps", eval_steps=2, logging_steps=100)
    trainer.train()
    assert [row["step"] for row in trainer.state.log_history if "eval_reward" in row] == [2, 4, 5]


def test_an_evaluation_schedule_without_an_eval_set_is_refused(task, tmp_path):
    with pytest.raises(ValueError, match="there is no eval_dataset"):
        _trainer(task, tmp_path, eval_dataset=None, eval_strategy="steps")


def test_the_best_checkpoint_is_kept_and_loaded_at_the_end(task, tmp_path):
    trainer = _trainer(task, tmp_path, max_steps=4, eval_strategy="steps", eval_steps=1, save_steps=1,
                       save_total_limit=1, load_best_model_at_end=True, metric_for_best_model="reward")
    trainer.train()
    scores = [(row["eval_reward"], row["step"]) for row in trainer.state.log_history if "eval_reward" in row]
    best_step = max(scores, key=lambda score: (score[0], -score[1]))[1]  # the first of equal bests
    best = tmp_path / f"checkpoint-{best_step}"
    assert trainer.state.best_model_checkpoint == str(best)
    assert trainer.state.best_metric == max(score for score, _ in scores)
    kept = sorted(p.name for p in tmp_path.glob("checkpoint-*"))
    assert kept == sorted({best.name, "checkpoint-4"})  # save_total_limit=1 never deletes the best
    saved = load_file(str(best / "model.safetensors"))
    for name, tensor in trainer.model.state_dict().items():
        if name in saved:
            torch.testing.assert_close(tensor, saved[name], rtol=0, atol=0, msg=name)
    state = json.loads((tmp_path / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["best_model_checkpoint"] == str(best)


def test_no_best_checkpoint_is_tracked_unless_asked_for(task, tmp_path):
    trainer = _trainer(task, tmp_path, max_steps=3, eval_strategy="steps", eval_steps=1, save_steps=1,
                       save_total_limit=1)
    trainer.train()
    assert trainer.state.best_model_checkpoint is None and trainer.state.best_metric is None
    assert [p.name for p in tmp_path.glob("checkpoint-*")] == ["checkpoint-3"]


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_eval_loss_is_the_on_policy_loss_of_the_eval_completions_by_hand(task, tmp_path, loss_type):
    seen = []

    def length_reward(completion_ids, **kwargs):  # rewards known from the lengths the loss weighs by
        seen.extend(len(ids) for ids in completion_ids)
        return [float(len(ids) % 3) for ids in completion_ids]

    config = task.config(**{**SMALL, "output_dir": str(tmp_path), "per_device_eval_batch_size": 4,
                            "num_generations_eval": 4, "loss_type": loss_type, "temperature": 1.5})
    trainer = GRPOTrainer(task.model, [length_reward], args=config, train_dataset=task.train_dataset,
                          eval_dataset=task.eval_dataset.select(range(4)))
    metrics = trainer.evaluate()
    lengths = torch.tensor(seen, dtype=torch.float32)
    rewards = (lengths % 3).view(4, 4)
    advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).flatten()
    assert advantages.abs().sum() > 0  # the check below can tell a loss from zero
    # ratio 1: each token's objective is -A; dapo averages over every token, grpo over each sequence's first
    expected = -(advantages * lengths).sum() / lengths.sum() if loss_type == "dapo" else -advantages.mean()
    assert metrics["eval_loss"] == pytest.approx(float(expected), abs=1e-5)
    assert metrics["eval_entropy"] > 0 and math.isfinite(metrics["eval_entropy"])
    assert all(metrics[f"eval_clip_ratio/{name}"] == 0.0
               for name in ("low_mean", "low_min", "high_mean", "high_max", "region_mean"))
    assert "eval_kl" not in metrics


def test_pass_at_k_by_hand():
    passed = torch.tensor([[True, False, False, False], [True, True, True, False], [False, False, False, False]])
    # n = 4: c = 1 -> 1 - C(3, 2) / C(4, 2) = 1 - 3/6; c = 3 -> fewer than 2 fail: 1; c = 0 -> 0
    assert pass_at_k(passed, 2) == pytest.approx((0.5 + 1.0 + 0.0) / 3)
    assert pass_at_k(passed, 1) == pytest.approx((0.25 + 0.75 + 0.0) / 3)  # pass@1 is the share passing
    assert pass_at_k(passed, 4) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(passed, 5)


def test_evaluation_reports_pass_at_k_per_reward_function_when_asked(task, tmp_path):
    trainer = _trainer(task, tmp_path, max_steps=1, num_generations_eval=4, eval_pass_at_k=[1, 4])
    metrics = trainer.evaluate()
    for name in ("correctness_reward", "format_reward"):
        # the rewards are 0 or 1: pass@1 is the mean reward, and pass@4 at least pass@1
        assert metrics[f"eval_rewards/{name}/pass@1"] == pytest.approx(metrics[f"eval_rewards/{name}/mean"])
        assert metrics[f"eval_rewards/{name}/pass@4"] >= metrics[f"eval_rewards/{name}/pass@1"]
    assert not any("pass@" in key for key in _trainer(task, tmp_path / "plain", max_steps=1).evaluate())
    with pytest.raises(ValueError, match=r"eval_pass_at_k must be a list of whole numbers k with 1 <= k <= 4"):
        task.config(**{**SMALL, "output_dir": str(tmp_path), "num_generations_eval": 4, "eval_pass_at_k": [8]})
