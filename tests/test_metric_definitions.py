"""Logged metrics, pinned to their definitions on a real step: the values in ``session.history``
recomputed from the completions the step logged (TRL 1.16's definitions; docs/metrics.md)."""

import math

import pytest
import torch

from grpo_lab.ops.advantages import nanstd


def _step_rows(session):
    log = session.completions_log
    return log[log["step"] == session.global_step]


def test_reward_and_reward_std_are_the_batch_mean_and_sample_std_of_the_weighted_rewards(make_session):
    session = make_session(num_generations=4, per_device_train_batch_size=8, temperature=1.5)
    row = session.step()
    rewards = torch.tensor(_step_rows(session)["reward"].to_numpy(), dtype=torch.float64)
    assert len(rewards) == 8
    # reward_std: the sample std over all 8 completions (not the mean of the two groups' stds)
    assert math.isclose(row["reward"], float(rewards.mean()), rel_tol=1e-6)
    assert math.isclose(row["reward_std"], float(rewards.std()), rel_tol=1e-5, abs_tol=1e-7)


def test_a_completion_no_function_scores_has_no_reward_and_no_advantage(task, make_session):
    calls = []

    def sometimes(completions, **kwargs):
        calls.append(len(completions))
        return [None if i % 4 == 0 else float(len(c[0]["content"]) % 2) for i, c in enumerate(completions)]

    session = make_session(reward_funcs=[sometimes], num_generations=4, per_device_train_batch_size=8)
    row = session.step()
    rows = _step_rows(session)
    unscored = rows.iloc[::4]
    assert unscored["reward"].isna().all() and (unscored["advantage"] == 0.0).all()
    scored = torch.tensor(rows["reward"].dropna().to_numpy(), dtype=torch.float64)
    assert math.isclose(row["reward"], float(scored.mean()), rel_tol=1e-6, abs_tol=1e-9)
    assert math.isclose(row["reward_std"], float(nanstd(scored)), rel_tol=1e-5, abs_tol=1e-7)


def test_clip_ratio_min_and_max_are_over_sequences_and_the_means_over_tokens():
    from accelerate import Accelerator

    from grpo_lab import ops
    from grpo_lab.metrics import loss_metrics

    # 3 sequences, counted tokens 3, 2, 0 (the last has none: left out of the min and max).
    ratio_BT = torch.tensor([[1.5, 1.0, 1.5], [0.5, 1.5, 1.0], [2.0, 2.0, 2.0]])
    mask_BT = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    advantages_B = torch.tensor([1.0, -1.0, 1.0])
    clip = ops.clip_diagnostics(ratio_BT, advantages_B, mask_BT, epsilon_low=0.2, epsilon_high=0.2, loss_type="dapo")
    metrics = loss_metrics(Accelerator(cpu=True), clip, torch.zeros(3, 3), None, mask_BT, 0.0)
    # high (ratio > 1.2, A > 0): sequence 0 has 2 of its 3 tokens; sequence 1 (A < 0) none.
    # low (ratio < 0.8, A < 0): sequence 1 has 1 of its 2 tokens; sequence 0 none.
    assert metrics["clip_ratio/high_max"] == pytest.approx(2 / 3)  # a token mean would give 2/5
    assert metrics["clip_ratio/low_min"] == 0.0
    assert metrics["clip_ratio/high_mean"] == pytest.approx(2 / 5)
    assert metrics["clip_ratio/low_mean"] == pytest.approx(1 / 5)
    assert metrics["clip_ratio/region_mean"] == pytest.approx(3 / 5)
