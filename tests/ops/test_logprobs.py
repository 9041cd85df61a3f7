"""selective_log_softmax and entropy_from_logits."""

import math

import pytest
import torch
from torch.testing import assert_close

from grpo_lab.ops import entropy_from_logits, selective_log_softmax


def _reference_logprobs(logits_BTV, index_BT):
    # float64 stays float64; half precision is widened to float32.
    logits_BTV = logits_BTV.double() if logits_BTV.dtype == torch.float64 else logits_BTV.float()
    return torch.log_softmax(logits_BTV, dim=-1).gather(-1, index_BT.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize(
    ("dtype", "atol"),
    [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 5e-2)],
)
def test_selective_log_softmax_matches_log_softmax_then_gather(dtype, atol):
    generator = torch.Generator().manual_seed(0)
    logits_BTV = (3 * torch.randn(3, 5, 11, generator=generator)).to(dtype)
    index_BT = torch.randint(0, 11, (3, 5), generator=generator)

    logprobs_BT = selective_log_softmax(logits_BTV, index_BT)

    assert logprobs_BT.shape == (3, 5)
    assert logprobs_BT.dtype == dtype
    # The reference sees the *same* (already rounded) logits, in float32 or float64.
    reference_BT = _reference_logprobs(logits_BTV, index_BT)
    assert_close(logprobs_BT.to(reference_BT.dtype), reference_BT, atol=atol, rtol=0)


def test_selective_log_softmax_hand_example():
    # softmax([0, ln 3]) = [1, 3] / (1 + 3) = [1/4, 3/4]
    logits_BTV = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]], dtype=torch.float64)
    index_BT = torch.tensor([[0, 1]])
    expected = torch.tensor([[math.log(0.25), math.log(0.75)]], dtype=torch.float64)
    assert_close(selective_log_softmax(logits_BTV, index_BT), expected)


def test_entropy_of_uniform_distribution_is_log_vocab_size():
    # All logits equal -> p_v = 1/V -> H = -sum_v (1/V) log(1/V) = log V.
    logits_BTV = torch.full((2, 3, 7), 1.5)
    entropies_BT = entropy_from_logits(logits_BTV)
    assert entropies_BT.dtype == torch.float32
    assert_close(entropies_BT, torch.full((2, 3), math.log(7.0)))


def test_entropy_of_nearly_one_hot_distribution_is_zero():
    logits_BTV = torch.zeros(1, 2, 5)
    logits_BTV[..., 2] = 100.0  # p = (1, e^-100, ...) up to rounding
    assert_close(entropy_from_logits(logits_BTV), torch.zeros(1, 2), atol=1e-6, rtol=0)


def test_entropy_hand_two_way_example():
    # logits [0, ln 3] -> p = [1/4, 3/4];
    # H = -(1/4 ln(1/4) + 3/4 ln(3/4)) = (1/4) ln 4 + (3/4) ln(4/3) = ln 4 - (3/4) ln 3 ~= 0.562335
    logits_BTV = torch.tensor([[[0.0, math.log(3.0)]]])
    expected = math.log(4.0) - 0.75 * math.log(3.0)
    assert entropy_from_logits(logits_BTV).item() == pytest.approx(expected, abs=1e-6)
    assert expected == pytest.approx(0.562335, abs=1e-6)


@pytest.mark.parametrize("max_elements", [1, 20, 36, 72, 100])
def test_chunking_does_not_change_results_or_gradients(max_elements):
    # Each sequence holds 4 x 9 = 36 logits: chunks of 1 position, 2 positions, then of 1, 2 and 2
    # whole sequences (3 sequences in all).
    generator = torch.Generator().manual_seed(1)
    logits_BTV = torch.randn(3, 4, 9, generator=generator, dtype=torch.float64, requires_grad=True)
    index_BT = torch.randint(0, 9, (3, 4), generator=generator)
    assert_close(entropy_from_logits(logits_BTV, max_elements), entropy_from_logits(logits_BTV))
    (chunked_grad,) = torch.autograd.grad(selective_log_softmax(logits_BTV, index_BT, max_elements).sum(), logits_BTV)
    (whole_grad,) = torch.autograd.grad(selective_log_softmax(logits_BTV, index_BT).sum(), logits_BTV)
    assert_close(chunked_grad, whole_grad)
    # d/dz_v sum_t log p_t(x_t) = onehot(x_t)_v - p_t,v
    expected_grad = torch.nn.functional.one_hot(index_BT, 9).double() - torch.softmax(logits_BTV.detach(), -1)
    assert_close(chunked_grad, expected_grad)
    half_BTV = logits_BTV.detach().bfloat16()
    assert_close(selective_log_softmax(half_BTV, index_BT, max_elements), selective_log_softmax(half_BTV, index_BT))


def test_empty_inputs_have_the_right_shapes():
    assert entropy_from_logits(torch.zeros(2, 0, 4)).shape == (2, 0)
    assert entropy_from_logits(torch.zeros(0, 3, 4)).shape == (0, 3)
    assert selective_log_softmax(torch.zeros(0, 3, 4), torch.zeros(0, 3, dtype=torch.long)).shape == (0, 3)
