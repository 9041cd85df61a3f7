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


def _micro_batch(ratio, advantages_B, mask_BT, *, loss_type="dapo", entropies_BT=None, with_policy_loss=False,
                 sequence_weight_B1=None, policy_loss=0.0):
    from accelerate import Accelerator

    from grpo_lab import ops
    from grpo_lab.core.metrics import micro_batch_metrics

    settings = ops.LossSettings(loss_type=loss_type, epsilon_low=0.2, epsilon_high=1.3 if loss_type == "cispo" else 0.2)
    out = ops.PolicyLossOutput(loss=torch.tensor(policy_loss), per_token_loss_BT=torch.zeros_like(mask_BT),
                               ratio_BT=ratio, kl_BT=None, policy_loss=torch.tensor(policy_loss),
                               sequence_weight_B1=sequence_weight_B1)
    entropies_BT = torch.zeros_like(mask_BT) if entropies_BT is None else entropies_BT
    return micro_batch_metrics(Accelerator(cpu=True), settings, out, advantages_B, mask_BT, entropies_BT,
                               with_policy_loss=with_policy_loss)


def test_clip_ratio_min_and_max_are_over_sequences_and_the_means_over_tokens():
    # 3 sequences, counted tokens 3, 2, 0 (the last has none: left out of the min and max).
    ratio_BT = torch.tensor([[1.5, 1.0, 1.5], [0.5, 1.5, 1.0], [2.0, 2.0, 2.0]])
    mask_BT = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    metrics = _micro_batch(ratio_BT, torch.tensor([1.0, -1.0, 1.0]), mask_BT)
    # high (ratio > 1.2, A > 0): sequence 0 has 2 of its 3 tokens; sequence 1 (A < 0) none.
    # low (ratio < 0.8, A < 0): sequence 1 has 1 of its 2 tokens; sequence 0 none.
    assert metrics["clip_ratio/high_max"] == pytest.approx(2 / 3)  # a token mean would give 2/5
    assert metrics["clip_ratio/low_min"] == 0.0
    assert metrics["clip_ratio/high_mean"] == pytest.approx(2 / 5)
    assert metrics["clip_ratio/low_mean"] == pytest.approx(1 / 5)
    assert metrics["clip_ratio/region_mean"] == pytest.approx(3 / 5)


def test_a_sequence_level_ratio_counts_sequences_not_tokens():
    # GSPO's (B, 1) ratio: one value per sequence; sequence lengths 3, 1, 2 do not weight it.
    ratio_B1 = torch.tensor([[1.5], [1.0], [0.5]])
    mask_BT = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    metrics = _micro_batch(ratio_B1, torch.tensor([1.0, 1.0, -1.0]), mask_BT)
    # high: sequence 0 only -> 1 of 3 sequences (token-weighted it would be 3 of 6 tokens)
    assert metrics["clip_ratio/high_mean"] == pytest.approx(1 / 3)
    assert metrics["clip_ratio/low_mean"] == pytest.approx(1 / 3)  # sequence 2: 0.5 < 0.8 and A < 0
    assert metrics["clip_ratio/region_mean"] == pytest.approx(2 / 3)
    assert metrics["clip_ratio/high_max"] == 1.0 and metrics["clip_ratio/low_min"] == 0.0


def test_loss_types_log_their_own_clip_statistics():
    ratio_BT = torch.tensor([[1.5, 1.0], [2.0, 1.0]])
    mask_BT = torch.ones(2, 2)
    advantages_B = torch.tensor([1.0, -1.0])
    cispo = _micro_batch(ratio_BT, advantages_B, mask_BT, loss_type="cispo")
    # cispo's cap 1.3: only token (0, 0) is above it with A > 0 -> 1 of 4 tokens
    assert cispo["cispo_clip_ratio"] == pytest.approx(1 / 4)
    assert not any(name.startswith("clip_ratio/") for name in cispo)
    sapo = _micro_batch(ratio_BT, advantages_B, mask_BT, loss_type="sapo")
    assert set(sapo) == {"entropy"}
    phi_B1 = torch.tensor([[0.5], [0.25]])
    vespo = _micro_batch(ratio_BT, advantages_B, mask_BT, loss_type="vespo", sequence_weight_B1=phi_B1)
    assert set(vespo) == {"entropy", "vespo/phi_seq_mean"}
    assert vespo["vespo/phi_seq_mean"] == pytest.approx(0.375)  # (0.5 + 0.25) / 2 sequences


def test_policy_loss_is_logged_with_an_entropy_bonus():
    metrics = _micro_batch(torch.ones(1, 2), torch.ones(1), torch.ones(1, 2), with_policy_loss=True, policy_loss=0.75)
    assert metrics["policy_loss"] == 0.75
    assert "policy_loss" not in _micro_batch(torch.ones(1, 2), torch.ones(1), torch.ones(1, 2))


def test_a_steps_metrics_are_the_mean_of_its_micro_batches():
    from accelerate import Accelerator

    from grpo_lab.core.metrics import loss_metrics

    # micro-batch 1: 1 token of entropy 1.0; micro-batch 2: 3 tokens of entropy 3.0
    first = _micro_batch(torch.ones(1, 3), torch.ones(1), torch.tensor([[1.0, 0.0, 0.0]]),
                         entropies_BT=torch.ones(1, 3))
    second = _micro_batch(torch.ones(1, 3), torch.ones(1), torch.ones(1, 3), entropies_BT=torch.full((1, 3), 3.0))
    first["clip_ratio/low_min"] = float("nan")  # a micro-batch with no number is left out of the mean
    metrics = loss_metrics(Accelerator(cpu=True), [first, second], 0.5)
    assert metrics["entropy"] == pytest.approx((1.0 + 3.0) / 2)  # not token-weighted: (1 + 9) / 4 = 2.5
    assert metrics["clip_ratio/low_min"] == 0.0
    assert metrics["loss"] == 0.5


def test_sampling_stats_leave_masked_truncated_rows_out():
    from grpo_lab import ops

    # row 1 is truncated and masked (mask_truncated_completions): its tokens count nowhere
    old_BT = torch.tensor([[0.0, 0.0], [0.0, 0.0]])
    sampling_BT = torch.tensor([[-0.5, float("nan")], [-2.0, -2.0]])
    mask_BT = ops.truncation_mask(torch.ones(2, 2), torch.tensor([False, True]))
    token = ops.vllm_importance_weights(old_BT, sampling_BT, mask_BT, mode="token_truncate", clip_max=None)
    stats = ops.importance_sampling_stats(token, old_BT, sampling_BT, mask_BT)
    # counted tokens: (0, 0) with gap 0.5 (weight e^0.5); (0, 1) the sampler could not score (weight 1, no gap)
    assert float(stats["sampling/sampling_logp_difference/max"]) == pytest.approx(0.5)
    assert float(stats["sampling/importance_sampling_ratio/mean"]) == pytest.approx((math.exp(0.5) + 1.0) / 2)
    sequence = ops.vllm_importance_weights(old_BT, sampling_BT, mask_BT, mode="sequence_truncate", clip_max=None)
    stats = ops.importance_sampling_stats(sequence, old_BT, sampling_BT, mask_BT)
    # sequence modes take every row: the truncated one with weight exp(0) = 1
    assert float(stats["sampling/importance_sampling_ratio/min"]) == 1.0
    assert float(stats["sampling/importance_sampling_ratio/mean"]) == pytest.approx((math.exp(0.5) + 1.0) / 2)
