"""vllm_importance_weights and importance_sampling_stats."""

import math

import pytest
import torch
from torch.testing import assert_close

from grpo_lab.ops import IS_MODES, importance_sampling_stats, vllm_importance_weights

# d = log pi_old - log pi_sampler per token:
#   row 0: [ln 2, ln 5, -ln 4], all real -> token ratios [2, 5, 0.25], sequence sum ln(2*5/4) = ln 2.5
#   row 1: [ln 1.5, ln 10, ln 10], only the first is real -> token ratios [1.5, 1, 1] (padding d = 0),
#          sequence sum ln 1.5
DIFF_BT = torch.tensor([[math.log(2), math.log(5), -math.log(4)], [math.log(1.5), math.log(10), math.log(10)]],
                       dtype=torch.float64)
SAMPLING_BT = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.0, -1.0]], dtype=torch.float64)
OLD_BT = SAMPLING_BT + DIFF_BT
MASK_BT = torch.tensor([[1, 1, 1], [1, 0, 0]])


def _weights(mode, **bounds):
    return vllm_importance_weights(OLD_BT, SAMPLING_BT, MASK_BT, mode=mode, **bounds)


def _t(rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_token_truncate_caps_at_clip_max():
    # [2, 5, 0.25] -> 5 capped to 3; padding stays 1.
    assert_close(_weights("token_truncate", clip_max=3.0), _t([[2.0, 3.0, 0.25], [1.5, 1.0, 1.0]]))


def test_token_truncate_with_clip_min_raises_small_ratios():
    assert_close(_weights("token_truncate", clip_max=3.0, clip_min=0.5), _t([[2.0, 3.0, 0.5], [1.5, 1.0, 1.0]]))


def test_token_mask_zeroes_ratios_outside_bounds():
    # 5 > 3 -> 0; with clip_min 0.5 also 0.25 < 0.5 -> 0.
    assert_close(_weights("token_mask", clip_max=3.0), _t([[2.0, 0.0, 0.25], [1.5, 1.0, 1.0]]))
    assert_close(_weights("token_mask", clip_max=3.0, clip_min=0.5), _t([[2.0, 0.0, 0.0], [1.5, 1.0, 1.0]]))


def test_no_bounds_gives_raw_ratios():
    assert_close(_weights("token_truncate", clip_max=None), _t([[2.0, 5.0, 0.25], [1.5, 1.0, 1.0]]))
    assert_close(_weights("sequence_mask", clip_max=None), _t([[2.5], [1.5]]))


def test_sequence_truncate_uses_exp_of_masked_sum():
    # Sequence ratios [2.5, 1.5] (row 1's padding diffs ln 10 ignored); cap 2 -> [2, 1.5].
    weights = _weights("sequence_truncate", clip_max=2.0)
    assert weights.shape == (2, 1)
    assert_close(weights, _t([[2.0], [1.5]]))
    # clip_min 2 (no max) -> [2.5, 2].
    assert_close(_weights("sequence_truncate", clip_max=None, clip_min=2.0), _t([[2.5], [2.0]]))


def test_sequence_mask_zeroes_whole_sequences():
    weights = _weights("sequence_mask", clip_max=2.0)
    assert weights.shape == (2, 1)
    assert_close(weights, _t([[0.0], [1.5]]))
    assert_close(_weights("sequence_mask", clip_max=None, clip_min=2.0), _t([[2.5], [0.0]]))


def test_padding_positions_are_ignored():
    # Changing the log-probs at padding positions changes nothing, in every mode.
    noisy_sampling = SAMPLING_BT.clone()
    noisy_sampling[1, 1:] = -30.0
    for mode in IS_MODES:
        assert_close(vllm_importance_weights(OLD_BT, noisy_sampling, MASK_BT, mode=mode), _weights(mode), msg=mode)


def test_default_mode_is_sequence_mask_with_cap_3():
    # Sequence ratios 2.5 and 1.5 are both <= 3 -> kept.
    assert_close(vllm_importance_weights(OLD_BT, SAMPLING_BT, MASK_BT), _t([[2.5], [1.5]]))


def test_unknown_mode_raises():
    with pytest.raises(ValueError):
        vllm_importance_weights(OLD_BT, SAMPLING_BT, MASK_BT, mode="token_clip")


def test_stats_token_mode_by_hand():
    # Real tokens: |d| = [ln 2, ln 5, ln 4, ln 1.5] -> mean ln(2*5*4*1.5)/4 = ln(60)/4, max ln 5.
    # Weights on real tokens (token_truncate, cap 3): [2, 3, 0.25, 1.5] -> min 0.25,
    # mean 6.75 / 4 = 1.6875, max 3 (the padding weights 1 are not counted).
    weights = _weights("token_truncate", clip_max=3.0)
    stats = importance_sampling_stats(weights, OLD_BT, SAMPLING_BT, MASK_BT)
    assert stats["sampling/sampling_logp_difference/mean"].item() == pytest.approx(math.log(60) / 4)
    assert stats["sampling/sampling_logp_difference/max"].item() == pytest.approx(math.log(5))
    assert stats["sampling/importance_sampling_ratio/min"].item() == pytest.approx(0.25)
    assert stats["sampling/importance_sampling_ratio/mean"].item() == pytest.approx(1.6875)
    assert stats["sampling/importance_sampling_ratio/max"].item() == pytest.approx(3.0)


def test_stats_sequence_mode_by_hand():
    # One weight per sequence: [2, 1.5] (sequence_truncate, cap 2) -> min 1.5, mean 1.75, max 2.
    weights = _weights("sequence_truncate", clip_max=2.0)
    stats = importance_sampling_stats(weights, OLD_BT, SAMPLING_BT, MASK_BT)
    assert stats["sampling/importance_sampling_ratio/min"].item() == pytest.approx(1.5)
    assert stats["sampling/importance_sampling_ratio/mean"].item() == pytest.approx(1.75)
    assert stats["sampling/importance_sampling_ratio/max"].item() == pytest.approx(2.0)
    assert stats["sampling/sampling_logp_difference/max"].item() == pytest.approx(math.log(5))


def test_stats_with_no_real_tokens_are_zero_as_trl_reports_them():
    empty_mask = torch.zeros_like(MASK_BT)
    weights = vllm_importance_weights(OLD_BT, SAMPLING_BT, empty_mask, mode="token_truncate")
    stats = importance_sampling_stats(weights, OLD_BT, SAMPLING_BT, empty_mask)
    assert all(value.item() == 0.0 for value in stats.values())
