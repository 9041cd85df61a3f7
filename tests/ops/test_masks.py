"""completion_mask_from_ids, truncation_mask and entropy_mask."""

import torch
from torch.testing import assert_close

from grpo_lab.ops import completion_mask_from_ids, entropy_mask, truncation_mask

EOS = 9


def test_completion_mask_keeps_tokens_up_to_and_including_first_eos():
    ids_BT = torch.tensor([
        [5, 6, EOS, 1, 1],    # EOS in the middle
        [EOS, 3, 3, 3, 3],    # EOS first: only the EOS token counts
        [4, 4, 4, 4, 4],      # no EOS: all tokens, truncated
        [2, EOS, 7, EOS, 1],  # several EOS: the first one wins
    ])
    mask_BT, is_truncated_B = completion_mask_from_ids(ids_BT, eos_token_id=EOS)
    expected = torch.tensor([
        [1, 1, 1, 0, 0],
        [1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1],
        [1, 1, 0, 0, 0],
    ])
    assert mask_BT.dtype == torch.long
    assert torch.equal(mask_BT, expected)
    assert is_truncated_B.tolist() == [False, False, True, False]


def test_completion_mask_eos_at_last_position_is_not_truncated():
    mask_BT, is_truncated_B = completion_mask_from_ids(torch.tensor([[1, 2, EOS]]), eos_token_id=EOS)
    assert mask_BT.tolist() == [[1, 1, 1]]
    assert is_truncated_B.tolist() == [False]


def test_truncation_mask_drops_truncated_completions():
    mask_BT = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    is_truncated_B = torch.tensor([False, True, False])
    out = truncation_mask(mask_BT, is_truncated_B)
    assert out.dtype == mask_BT.dtype
    assert out.tolist() == [[1, 1, 0], [0, 0, 0], [1, 0, 0]]


def test_truncation_mask_accepts_integer_flags_and_float_mask():
    out = truncation_mask(torch.tensor([[1.0, 0.0], [1.0, 1.0]]), torch.tensor([1, 0]))
    assert_close(out, torch.tensor([[0.0, 0.0], [1.0, 1.0]]))


# Entropies 1, 2, 3, 4 on valid tokens, plus large entropies on padding that must be ignored.
ENTROPIES_BT = torch.tensor([[1.0, 4.0, 50.0], [3.0, 2.0, 60.0]])
MASK_BT = torch.tensor([[1, 1, 0], [1, 1, 0]])


def test_entropy_mask_median_threshold_by_hand():
    # quantile rho = 0.5 -> threshold = Q_{1 - 0.5} = Q_0.5 of the valid values sorted [1, 2, 3, 4].
    # torch.quantile (linear): position = q (n - 1) = 0.5 * 3 = 1.5 -> 2 + 0.5 * (3 - 2) = 2.5.
    # Kept: H >= 2.5 -> the tokens with entropy 3 and 4.
    keep_BT = entropy_mask(ENTROPIES_BT, MASK_BT, quantile=0.5)
    assert keep_BT.dtype == torch.float32
    assert keep_BT.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


def test_entropy_mask_quarter_threshold_by_hand():
    # rho = 0.25 -> Q_0.75: position 0.75 * 3 = 2.25 -> 3 + 0.25 * (4 - 3) = 3.25 -> only entropy 4.
    keep_BT = entropy_mask(ENTROPIES_BT, MASK_BT, quantile=0.25)
    assert keep_BT.tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]


def test_entropy_mask_quantile_one_keeps_every_valid_token():
    # rho = 1 -> Q_0 = min = 1 -> every valid token passes, padding still dropped.
    keep_BT = entropy_mask(ENTROPIES_BT, MASK_BT, quantile=1.0)
    assert_close(keep_BT, MASK_BT.float())


def test_entropy_mask_quantile_zero_keeps_only_the_maximum():
    # rho = 0 -> Q_1 = max over valid tokens = 4 (the padding entropies 50, 60 are not considered).
    keep_BT = entropy_mask(ENTROPIES_BT, MASK_BT, quantile=0.0)
    assert keep_BT.tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]


def test_entropy_mask_never_keeps_padding_even_with_huge_entropy():
    for quantile in (0.0, 0.3, 0.5, 0.8, 1.0):
        keep_BT = entropy_mask(ENTROPIES_BT, MASK_BT, quantile=quantile)
        assert keep_BT[:, 2].sum() == 0


def test_entropy_mask_all_padding_returns_zeros():
    keep_BT = entropy_mask(torch.rand(2, 3), torch.zeros(2, 3, dtype=torch.long), quantile=0.5)
    assert keep_BT.dtype == torch.float32
    assert torch.equal(keep_BT, torch.zeros(2, 3))
