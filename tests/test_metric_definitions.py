"""Logged metrics, pinned to their definitions on a real step: the values in ``session.history``
recomputed from the completions the step logged (TRL 1.16's definitions; docs/metrics.md)."""

import math

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
