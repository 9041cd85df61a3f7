"""policy_loss and its parts: per-token objectives, aggregation, KL, VESPO weights, clip diagnostics.

Most tests share one hand example (float64), B = 2 completions, T = 3 positions:

    mask        [[1, 1, 1], [1, 1, 0]]                (row 1 has one padding position)
    logp        [[-0.5, -1.0, -0.2], [-0.7, -1.2, -3.0]]
    d = logp - old_logp  [[0.1, -0.3, ln 1.5], [0, ln 0.5, -2 (padding)]]
    r = exp(d)  [[e^0.1 = 1.10517, e^-0.3 = 0.74082, 1.5], [1, 0.5, e^-2]]
    A           [1, -2]

Clipped surrogate, eps_low = eps_high = 0.2 (clip range [0.8, 1.2]), L = -min(r A, clip(r) A):
    row 0 (A = 1):  min(1.10517, 1.10517) -> -1.10517;  min(0.74082, 0.8) -> -0.74082;  min(1.5, 1.2) -> -1.2
                    row sum S0 = -(e^0.1 + e^-0.3 + 1.2) = -3.04599
    row 1 (A = -2): min(-2, -2) -> 2;  min(-1, -1.6) -> 1.6;  (padding ignored)
                    row sum S1 = 3.6
"""

import math

import pytest
import torch
from torch.testing import assert_close

from grpo_lab.ops import (
    CLIP_LOSSES,
    adapt_entropy_coef,
    aggregate_loss,
    applied_entropy_coef,
    clip_diagnostics,
    entropy_bonus,
    k3_kl,
    log_importance_weights,
    off_policy_mask,
    policy_loss,
    vespo_weights,
)

ALL_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")

MASK_BT = torch.tensor([[1, 1, 1], [1, 1, 0]])
LOGP_BT = torch.tensor([[-0.5, -1.0, -0.2], [-0.7, -1.2, -3.0]], dtype=torch.float64)
D_BT = torch.tensor([[0.1, -0.3, math.log(1.5)], [0.0, math.log(0.5), -2.0]], dtype=torch.float64)
OLD_BT = LOGP_BT - D_BT
ADV_B = torch.tensor([1.0, -2.0], dtype=torch.float64)

R00, R01, R02 = math.exp(0.1), math.exp(-0.3), 1.5
S0 = -(R00 + R01 + 1.2)  # clipped-surrogate row sums, see the module docstring
S1 = 3.6


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def run(loss_type, logp=LOGP_BT, old=OLD_BT, adv=ADV_B, mask=MASK_BT, **kwargs):
    return policy_loss(logp, old, adv, mask, loss_type=loss_type, **kwargs)


def scalar(value):
    return torch.tensor(value, dtype=torch.float64)


# ----------------------------------------------------------------------------------------------
# One hand example per loss type
# ----------------------------------------------------------------------------------------------

def test_grpo_hand_example():
    # Mean per sequence, then over sequences: (S0 / 3 + S1 / 2) / 2 ~= (-1.01533 + 1.8) / 2 = 0.39234
    out = run("grpo", epsilon_low=0.2)
    assert_close(out.loss, scalar((S0 / 3 + S1 / 2) / 2))
    assert out.loss.item() == pytest.approx(0.392335, abs=1e-6)
    assert out.per_token_loss_BT.shape == (2, 3)
    assert_close(out.per_token_loss_BT[:, :2], torch.tensor([[-R00, -R01], [2.0, 1.6]], dtype=torch.float64))
    assert_close(out.ratio_BT, torch.exp(D_BT))
    assert out.kl_BT is None


def test_bnpo_hand_example():
    # All real tokens of the micro-batch: (S0 + S1) / 5 ~= 0.55401 / 5 = 0.11080
    assert_close(run("bnpo").loss, scalar((S0 + S1) / 5))


def test_dr_grpo_hand_example():
    # (S0 + S1) / (B * max_completion_length) = 0.55401 / (2 * 4) ~= 0.06925
    assert_close(run("dr_grpo", max_completion_length=4).loss, scalar((S0 + S1) / 8))


def test_dapo_hand_example_and_num_items_in_batch():
    # Default N = tokens of this micro-batch (5); with num_items_in_batch = 10: 0.55401 / 10.
    assert_close(run("dapo").loss, scalar((S0 + S1) / 5))
    assert_close(run("dapo", num_items_in_batch=10).loss, scalar((S0 + S1) / 10))
    assert_close(run("dapo", num_items_in_batch=torch.tensor(10.0)).loss, scalar((S0 + S1) / 10))


def test_luspo_token_level_hand_example():
    # mean_b sum_t m L = (S0 + S1) / 2 (S_b is already the masked token sum of sequence b)
    assert_close(run("luspo").loss, scalar((S0 + S1) / 2))


def test_luspo_ignores_padding_width():
    # per-token losses [[1, 1], [2, 2]], all real: (1 + 1 + 2 + 2) / 2 = 3; two padding columns change nothing
    loss_BT, mask_BT = torch.tensor([[1.0, 1.0], [2.0, 2.0]], dtype=torch.float64), torch.ones(2, 2)
    padded_BT, padded_mask_BT = torch.cat([loss_BT, torch.zeros(2, 2)], 1), torch.cat([mask_BT, torch.zeros(2, 2)], 1)
    assert_close(aggregate_loss(loss_BT, mask_BT, loss_type="luspo"), scalar(3.0))
    assert_close(aggregate_loss(padded_BT, padded_mask_BT, loss_type="luspo"), scalar(3.0))


def test_cispo_hand_example():
    # epsilon_high = 1.2 is an absolute cap: w = min(r, 1.2) = [[e^0.1, e^-0.3, 1.2], [1, 0.5, -]].
    # L = -w A logp:  row 0 (A = 1):  e^0.1 * 0.5 + e^-0.3 * 1.0 + 1.2 * 0.2 ~= 1.53340
    #                 row 1 (A = -2): -(1 * 2 * 0.7) - (0.5 * 2 * 1.2) = -1.4 - 1.2 = -2.6
    # normalised by the 5 tokens: (1.53340 - 2.6) / 5 ~= -0.21332
    row0 = 0.5 * R00 + 1.0 * R01 + 0.24
    out = run("cispo", epsilon_high=1.2)
    assert_close(out.loss, scalar((row0 - 2.6) / 5))
    assert out.loss.item() == pytest.approx(-0.213319, abs=1e-6)


def test_sapo_hand_example():
    # L = -(4 / tau) sigmoid(tau (r - 1)) A, tau = 1 for A > 0 and 1.05 for A < 0; grpo aggregation.
    # row 0: -4 [sigmoid(e^0.1 - 1) + sigmoid(e^-0.3 - 1) + sigmoid(0.5)] / 3
    # row 1: +2 (4 / 1.05) [sigmoid(0) + sigmoid(1.05 * -0.5)] / 2
    row0 = -4 * (sigmoid(R00 - 1) + sigmoid(R01 - 1) + sigmoid(0.5)) / 3
    row1 = 2 * (4 / 1.05) * (sigmoid(0.0) + sigmoid(-0.525)) / 2
    out = run("sapo")
    assert_close(out.loss, scalar((row0 + row1) / 2), rtol=1e-6, atol=1e-9)
    assert out.loss.item() == pytest.approx(0.604155, abs=1e-6)


def test_vespo_hand_example():
    # log w = masked sum of d: row 0: 0.1 - 0.3 + ln 1.5 ~= 0.20547, w0 = 1.5 e^-0.2 ~= 1.22810;
    #                          row 1: 0 + ln 0.5 (padding dropped), w1 = 0.5.
    # phi(w) = exp(lambda + k log w - lambda w): A >= 0 -> (k, lambda) = (2, 3), A < 0 -> (3, 2)
    #   phi0 = exp(3 + 2 * 0.20547 - 3 * 1.22810) ~= 0.76082;  phi1 = exp(2 + 3 ln 0.5 - 1) = e / 8 ~= 0.33979
    # L = -phi A logp:  row 0: phi0 * (0.5 + 1.0 + 0.2) = 1.7 phi0;  row 1: -2 phi1 (0.7 + 1.2) = -3.8 phi1
    # dapo-style normalisation by 5 tokens.
    log_w0 = -0.2 + math.log(1.5)
    phi0 = math.exp(3 + 2 * log_w0 - 3 * math.exp(log_w0))
    phi1 = math.e / 8
    out = run("vespo")
    # phi is computed in float32, and the two rows nearly cancel (1.7 phi0 ~= 3.8 phi1 ~= 1.29), so the
    # per-token losses are checked relatively and the total absolutely.
    expected_BT = torch.tensor([[0.5 * phi0, 1.0 * phi0, 0.2 * phi0], [-2 * 0.7 * phi1, -2 * 1.2 * phi1, 0.0]],
                               dtype=torch.float64)
    assert_close(out.per_token_loss_BT * MASK_BT, expected_BT, rtol=1e-6, atol=1e-9)
    assert_close(out.loss, scalar((1.7 * phi0 - 3.8 * phi1) / 5), rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# Options: sequence level, asymmetric clipping, delta, KL, entropy mask, vLLM IS ratio
# ----------------------------------------------------------------------------------------------

def test_sequence_level_ratio_is_exp_of_masked_mean_log_ratio():
    # row 0: (0.1 - 0.3 + ln 1.5) / 3;  row 1: (0 + ln 0.5) / 2 (the padding -2 is excluded)
    log_r_B1 = log_importance_weights(LOGP_BT, OLD_BT, MASK_BT, level="sequence")
    assert log_r_B1.shape == (2, 1)
    assert_close(log_r_B1, torch.tensor([[(-0.2 + math.log(1.5)) / 3], [math.log(0.5) / 2]], dtype=torch.float64))


def test_gspo_grpo_and_luspo_hand_example():
    # Sequence ratios: g0 = exp(0.20547 / 3) ~= 1.07089 (inside [0.8, 1.2]); g1 = sqrt(0.5) ~= 0.70711.
    # row 0 (A = 1): L = -g0;  row 1 (A = -2): min(-2 g1, -2 * 0.8) = -1.6 -> L = 1.6.
    # grpo: (-g0 + 1.6) / 2 ~= 0.26456;  luspo: (3 (-g0) + 2 * 1.6) / 2 ~= -0.00633
    g0 = math.exp((-0.2 + math.log(1.5)) / 3)
    out = run("grpo", importance_sampling_level="sequence")
    assert out.ratio_BT.shape == (2, 1)
    assert_close(out.ratio_BT, torch.tensor([[g0], [math.sqrt(0.5)]], dtype=torch.float64))
    assert_close(out.loss, scalar((-g0 + 1.6) / 2))
    assert out.per_token_loss_BT.shape == (2, 3)
    luspo = run("luspo", importance_sampling_level="sequence")
    assert_close(luspo.loss, scalar((-3 * g0 + 2 * 1.6) / 2))


def test_asymmetric_epsilons():
    # Clip range [1 - 0.1, 1 + 0.3] = [0.9, 1.3]:
    # row 0: -(e^0.1 + e^-0.3 + 1.3)  (1.5 now capped at 1.3; e^-0.3 < 0.9 but A > 0 keeps r)
    # row 1: 2 + (-min(-1, 0.9 * -2) = 1.8) = 3.8
    out = run("bnpo", epsilon_low=0.1, epsilon_high=0.3)
    assert_close(out.loss, scalar((-(R00 + R01 + 1.3) + 3.8) / 5))


def test_delta_caps_the_ratio_for_negative_advantages():
    # One completion, A = -1, r = [2.0, 1.1], eps 0.2, bnpo.
    # No delta:  t0: -min(2 * -1, 1.2 * -1) = 2;   t1: -min(-1.1, -1.1) = 1.1 -> (2 + 1.1) / 2 = 1.55
    # delta 1.5: t0: -min(1.5 * -1, -1.2) = 1.5;   t1 unchanged            -> (1.5 + 1.1) / 2 = 1.3
    logp = torch.tensor([[-1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    old = logp.detach() - torch.log(torch.tensor([[2.0, 1.1]], dtype=torch.float64))
    adv = torch.tensor([-1.0], dtype=torch.float64)
    mask = torch.ones(1, 2)
    assert_close(policy_loss(logp, old, adv, mask, loss_type="bnpo").loss, scalar(1.55))
    out = policy_loss(logp, old, adv, mask, loss_type="bnpo", delta=1.5)
    assert_close(out.loss, scalar(1.3))
    # The capped token gets no gradient; the other one -r A / 2 = 1.1 / 2.
    out.loss.backward()
    assert_close(logp.grad, torch.tensor([[0.0, 0.55]], dtype=torch.float64))
    # The ratio is reported before the delta cap.
    assert_close(out.ratio_BT, torch.tensor([[2.0, 1.1]], dtype=torch.float64))


REF_DIFF_BT = torch.tensor([[0.5, -0.5, 0.0], [1.0, 0.2, 3.0]], dtype=torch.float64)  # ref - logp


def _k3(d):
    return math.exp(d) - d - 1


def test_k3_kl_values():
    # k3(d) = e^d - d - 1:  k3(0) = 0, k3(0.5) = 0.14872, k3(-0.5) = 0.10653, k3(1) = e - 2
    kl = k3_kl(torch.zeros(4, dtype=torch.float64), torch.tensor([0.0, 0.5, -0.5, 1.0], dtype=torch.float64))
    assert_close(kl, torch.tensor([0.0, _k3(0.5), _k3(-0.5), math.e - 2], dtype=torch.float64))
    assert _k3(0.5) == pytest.approx(0.148721, abs=1e-6)


def test_beta_adds_k3_kl_penalty():
    # Masked KL sum: k3(0.5) + k3(-0.5) + k3(0) + k3(1) + k3(0.2) ~= 0.14872 + 0.10653 + 0 + 0.71828 + 0.02140
    # bnpo: policy part (S0 + S1) / 5 plus 0.1 * KL sum / 5.
    out = run("bnpo", ref_logprobs_BT=LOGP_BT + REF_DIFF_BT, beta=0.1)
    kl_rows = [[_k3(0.5), _k3(-0.5), _k3(0.0)], [_k3(1.0), _k3(0.2), _k3(3.0)]]
    assert_close(out.kl_BT, torch.tensor(kl_rows, dtype=torch.float64))
    kl_sum = sum(kl_rows[0]) + kl_rows[1][0] + kl_rows[1][1]
    assert_close(out.loss, scalar((S0 + S1) / 5 + 0.1 * kl_sum / 5))


def test_bias_corrected_kl_is_multiplied_by_ratio():
    # kl * r token by token: row 0 r = [e^0.1, e^-0.3, 1.5]; row 1 r = [1, 0.5].
    out = run("bnpo", ref_logprobs_BT=LOGP_BT + REF_DIFF_BT, beta=0.1, use_bias_correction_kl=True)
    kl_sum = _k3(0.5) * R00 + _k3(-0.5) * R01 + 0.0 * R02 + _k3(1.0) * 1.0 + _k3(0.2) * 0.5
    assert_close(out.loss, scalar((S0 + S1) / 5 + 0.1 * kl_sum / 5))
    assert_close(out.kl_BT[0, 0], scalar(_k3(0.5) * R00))


def test_entropy_mask_multiplies_per_token_loss():
    # Drop row 0 token 1 and row 1 token 0: sum = -(e^0.1 + 1.2) + 1.6; the normaliser is still 5 tokens.
    entropy_mask_BT = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]], dtype=torch.float64)
    out = run("bnpo", entropy_mask_BT=entropy_mask_BT)
    assert_close(out.loss, scalar((-(R00 + 1.2) + 1.6) / 5))


def test_off_policy_mask_hand_example():
    # Sampling policy = OLD, so the drift (1/|y|) sum m (log pi_s - log pi) = -(masked mean of D):
    #   row 0: -(0.1 - 0.3 + ln 1.5) / 3 = -0.06849;   row 1: -(0 + ln 0.5) / 2 = +0.34657.
    # Row 1 has A = -2 < 0: masked when delta < 0.34657. Row 0 has A = 1: always kept.
    assert_close(off_policy_mask(ADV_B, LOGP_BT, OLD_BT, MASK_BT, threshold=0.3),
                 torch.tensor([[1.0], [0.0]], dtype=torch.float64))
    assert_close(off_policy_mask(ADV_B, LOGP_BT, OLD_BT, MASK_BT, threshold=0.35),
                 torch.ones(2, 1, dtype=torch.float64))
    # A negative advantage alone is not enough: row 0's drift is below any positive threshold.
    both_negative = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    assert_close(off_policy_mask(both_negative, LOGP_BT, OLD_BT, MASK_BT, threshold=0.3),
                 torch.tensor([[1.0], [0.0]], dtype=torch.float64))
    # The padding position (D = -2) is left out of row 1's mean: counted, the drift would be 0.898.
    assert_close(off_policy_mask(ADV_B, LOGP_BT, OLD_BT, MASK_BT, threshold=0.5), torch.ones(2, 1, dtype=torch.float64))


def test_off_policy_mask_drops_a_sequence_from_the_loss_but_not_from_its_normaliser():
    mask_B1 = off_policy_mask(ADV_B, LOGP_BT, OLD_BT, MASK_BT, threshold=0.3)
    assert_close(run("bnpo", off_policy_mask_B1=mask_B1).loss, scalar(S0 / 5))
    assert_close(run("dapo", off_policy_mask_B1=mask_B1, num_items_in_batch=10).loss, scalar(S0 / 10))
    logp = LOGP_BT.clone().requires_grad_(True)
    run("bnpo", logp=logp, off_policy_mask_B1=mask_B1).loss.backward()
    assert torch.all(logp.grad[1] == 0) and torch.any(logp.grad[0] != 0)


H_BT = torch.tensor([[0.5, 1.0, 2.0], [1.5, 0.5, 9.0]], dtype=torch.float64)  # 9.0 sits on padding
"""Per-token entropies for the entropy-bonus tests: sum over real tokens = 5.5 nats over 5 tokens."""


def test_entropy_bonus_is_the_micro_batchs_mean_token_entropy():
    assert_close(entropy_bonus(H_BT, MASK_BT), scalar(5.5 / 5))
    # With top_entropy_quantile's mask keeping 0.5, 2.0 and 0.5 (3 of 5 tokens): their mean, 1.0.
    entropy_mask_BT = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]], dtype=torch.float64)
    assert_close(entropy_bonus(H_BT, MASK_BT, entropy_mask_BT=entropy_mask_BT), scalar(1.0))


@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "vespo", "grpo", "bnpo"])
def test_each_micro_batch_adds_its_bonus_over_the_accumulation_steps_whatever_the_normaliser(loss_type):
    # TRL 1.16: loss_k = policy_k - c x H_k / a for each of a micro-batches, H_k the micro-batch's mean
    # token entropy (1.1 here), never scaled by the loss type's normaliser (dapo's step tokens, N = 10).
    # A globally normalised loss type's policy_loss is the micro-batch's share already, so the bonus is
    # divided here; the others' whole loss is divided by a by the caller (the engine), bonus included.
    extra = {"epsilon_high": 5.0} if loss_type == "cispo" else {}
    plain = run(loss_type, num_items_in_batch=10, **extra).loss
    with_bonus = run(loss_type, num_items_in_batch=10, entropies_BT=H_BT, entropy_coef=0.1, accumulation_steps=2,
                     **extra).loss
    divided_here = loss_type in ("dapo", "cispo", "vespo")
    assert_close(plain - with_bonus, scalar(0.1 * 1.1 / (2 if divided_here else 1)))


def test_entropy_coef_subtracts_the_bonus_and_its_gradient_reaches_the_entropies():
    entropies = H_BT.clone().requires_grad_(True)
    out = run("bnpo", entropies_BT=entropies, entropy_coef=0.1)
    assert_close(out.loss, scalar((S0 + S1) / 5 - 0.1 * 1.1))
    assert_close(out.entropy_bonus, scalar(1.1))
    out.loss.backward()
    # d loss / d H = -c m / 5: -0.02 on real tokens, 0 on padding
    assert_close(entropies.grad, -0.02 * MASK_BT.to(torch.float64))
    # With top_entropy_quantile's mask, only the kept tokens count: 0.5 + 2.0 + 0.5 over 3 tokens.
    entropy_mask_BT = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]], dtype=torch.float64)
    out = run("bnpo", entropies_BT=H_BT, entropy_coef=0.1, entropy_mask_BT=entropy_mask_BT)
    assert_close(out.entropy_bonus, scalar(3.0 / 3))
    assert_close(out.loss, scalar((-(R00 + 1.2) + 1.6) / 5 - 0.1 * 1.0))
    with pytest.raises(ValueError, match="needs entropies_BT"):
        run("bnpo", entropy_coef=0.1)


def test_adaptive_entropy_weight_steps_toward_the_target():
    bounds = dict(target=0.5, delta=0.01, coef_min=0.0, coef_max=0.05)
    assert adapt_entropy_coef(0.02, 0.4, **bounds) == pytest.approx(0.03)  # at or below the target: up
    assert adapt_entropy_coef(0.02, 0.5, **bounds) == pytest.approx(0.03)
    assert adapt_entropy_coef(0.02, 0.6, **bounds) == pytest.approx(0.01)  # above: down
    assert adapt_entropy_coef(0.045, 0.1, **bounds) == 0.05  # capped
    assert adapt_entropy_coef(0.005, 0.9, **bounds) == 0.0  # floored
    # The weight applied: static always; adaptive only while the last step's entropy was at most the target.
    assert applied_entropy_coef(0.02, 0.9, adaptive=False, target=0.5) == 0.02
    assert applied_entropy_coef(0.02, None, adaptive=True, target=0.5) == 0.02
    assert applied_entropy_coef(0.02, 0.5, adaptive=True, target=0.5) == 0.02
    assert applied_entropy_coef(0.02, 0.6, adaptive=True, target=0.5) == 0.0


def test_importance_sampling_ratio_multiplies_per_token_loss():
    # Sequence weights [2, 0.5]: (2 S0 + 0.5 S1) / 5;  token weights scale single tokens.
    out = run("bnpo", importance_sampling_ratio_BT=torch.tensor([[2.0], [0.5]], dtype=torch.float64))
    assert_close(out.loss, scalar((2 * S0 + 0.5 * S1) / 5))
    token_is = torch.tensor([[1.0, 3.0, 1.0], [0.5, 1.0, 9.0]], dtype=torch.float64)
    out = run("bnpo", importance_sampling_ratio_BT=token_is)
    assert_close(out.loss, scalar((S0 - 2 * R01 + 0.5 * 2.0 + 1.6) / 5))


def test_vespo_folds_importance_sampling_ratio_into_its_weight():
    # IS weights [2, 0.5] add their logs to log w: row 0: log w0 + ln 2, w = 2 * 1.5 e^-0.2;
    # row 1: ln 0.5 + ln 0.5 = ln 0.25 -> phi1 = exp(2 + 3 ln 0.25 - 2 * 0.25) = e^1.5 / 64.
    # The loss is NOT multiplied by the IS weight a second time.
    log_w0 = -0.2 + math.log(1.5) + math.log(2)
    phi0 = math.exp(3 + 2 * log_w0 - 3 * math.exp(log_w0))
    phi1 = math.exp(1.5) / 64
    out = run("vespo", importance_sampling_ratio_BT=torch.tensor([[2.0], [0.5]], dtype=torch.float64))
    assert_close(out.loss, scalar((1.7 * phi0 - 3.8 * phi1) / 5), rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# vespo_weights
# ----------------------------------------------------------------------------------------------

def test_vespo_weight_of_ratio_one_is_one():
    # w = 1: phi = exp(lambda + k * 0 - lambda * 1) = 1 for any (k, lambda).
    phi = vespo_weights(torch.zeros(2, 3), torch.tensor([1.0, -1.0]), torch.ones(2, 3),
                        k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0)
    assert phi.shape == (2, 1)
    assert_close(phi, torch.ones(2, 1))


def test_vespo_weight_hand_value():
    # log w = 0.2 + 0.3 = 0.5 (padding 7.0 ignored), k = 2, lambda = 3:
    # phi = exp(3 + 2 * 0.5 - 3 e^0.5) ~= exp(4 - 4.94616) ~= 0.38823
    log_ratio = torch.tensor([[0.2, 0.3, 7.0]], dtype=torch.float64)
    phi = vespo_weights(log_ratio, torch.tensor([0.5]), torch.tensor([[1, 1, 0]]),
                        k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0)
    assert phi.item() == pytest.approx(math.exp(3 + 1 - 3 * math.exp(0.5)), rel=1e-6)
    assert phi.item() == pytest.approx(0.388227, abs=1e-6)


def test_vespo_weight_is_detached():
    log_ratio = torch.zeros(1, 2, requires_grad=True)
    phi = vespo_weights(log_ratio, torch.tensor([1.0]), torch.ones(1, 2),
                        k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0)
    assert not phi.requires_grad


# ----------------------------------------------------------------------------------------------
# Invariants
# ----------------------------------------------------------------------------------------------

def test_on_policy_ratio_one_hand_losses():
    # old_logprobs None -> r = 1 everywhere -> clipped surrogate L = -A per token.
    # grpo: mean_b(-A_b) = -(1 - 2) / 2 = 0.5;  bnpo/dapo: -(3 * 1 + 2 * -2) / 5 = 0.2
    assert_close(run("grpo", old=None).loss, scalar(0.5))
    assert_close(run("bnpo", old=None).loss, scalar(0.2))
    assert_close(run("dapo", old=None).loss, scalar(0.2))
    out = run("grpo", old=None)
    assert_close(out.ratio_BT, torch.ones(2, 3, dtype=torch.float64))
    diagnostics = clip_diagnostics(out.ratio_BT, ADV_B, MASK_BT, epsilon_low=0.2, epsilon_high=0.2, loss_type="grpo")
    assert not diagnostics.is_region_clipped_BT.any()
    assert not diagnostics.is_low_clipped_BT.any()
    assert not diagnostics.is_high_clipped_BT.any()


def _random_inputs(seed, B=4, T=5, full=False):
    g = torch.Generator().manual_seed(seed)
    logp = -3 * torch.rand(B, T, generator=g, dtype=torch.float64)
    old = logp + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    if full:
        mask = torch.ones(B, T, dtype=torch.long)
    else:
        lengths = torch.randint(1, T + 1, (B,), generator=g)
        mask = (torch.arange(T) < lengths.unsqueeze(1)).long()
    return logp, old, adv, mask


def test_grpo_equals_bnpo_when_all_completions_have_equal_length():
    logp, old, adv, _ = _random_inputs(0)
    mask = torch.tensor([[1, 1, 1, 0, 0]] * 4)
    assert_close(run("grpo", logp, old, adv, mask).loss, run("bnpo", logp, old, adv, mask).loss)


def test_dr_grpo_equals_bnpo_when_every_completion_is_full_length():
    logp, old, adv, mask = _random_inputs(1, full=True)
    assert_close(run("dr_grpo", logp, old, adv, mask, max_completion_length=5).loss,
                 run("bnpo", logp, old, adv, mask).loss)


def test_dapo_without_num_items_equals_bnpo():
    logp, old, adv, mask = _random_inputs(2)
    assert_close(run("dapo", logp, old, adv, mask).loss, run("bnpo", logp, old, adv, mask).loss)


def _python_loss(loss_type, logp, old, adv, mask, eps_low=0.2, eps_high=0.28, max_len=5):
    """The loss recomputed token by token with Python floats."""
    B, T = len(logp), len(logp[0])
    per_token = [[0.0] * T for _ in range(B)]
    for b in range(B):
        a = adv[b]
        phi = None
        if loss_type == "vespo":
            log_w = sum(max(-20.0, min(20.0, logp[b][t] - old[b][t])) for t in range(T) if mask[b][t])
            log_w = max(math.log(1e-8), min(20.0, log_w))
            k, lam = (2.0, 3.0) if a >= 0 else (3.0, 2.0)
            phi = math.exp(lam + k * log_w - lam * math.exp(log_w))
        for t in range(T):
            r = math.exp(logp[b][t] - old[b][t])
            if loss_type in CLIP_LOSSES:
                clipped = min(max(r, 1 - eps_low), 1 + eps_high)
                value = -min(r * a, clipped * a)
            elif loss_type == "cispo":
                value = -min(r, eps_high) * a * logp[b][t]
            elif loss_type == "sapo":
                tau = 1.0 if a > 0 else 1.05
                value = -(4 / tau) * sigmoid(tau * (r - 1)) * a
            else:  # vespo
                value = -phi * a * logp[b][t]
            per_token[b][t] = value * mask[b][t]
    lengths = [sum(row) for row in mask]
    total = sum(map(sum, per_token))
    if loss_type in ("grpo", "sapo"):
        return sum(sum(per_token[b]) / max(lengths[b], 1) for b in range(B)) / B
    if loss_type in ("bnpo", "dapo", "cispo", "vespo"):
        return total / max(sum(lengths), 1)
    if loss_type == "dr_grpo":
        return total / (B * max_len)
    return total / B  # luspo: sum over each sequence's tokens, mean over sequences


@pytest.mark.parametrize("loss_type", ALL_LOSSES)
def test_vectorised_loss_matches_python_loop(loss_type):
    for seed in range(3):
        logp, old, adv, mask = _random_inputs(10 + seed)
        eps_high = 1.1 if loss_type == "cispo" else 0.28
        out = run(loss_type, logp, old, adv, mask, epsilon_low=0.2, epsilon_high=eps_high, max_completion_length=5)
        expected = _python_loss(loss_type, logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), eps_high=eps_high)
        # VESPO's weight is computed in float32 and SAPO's temperatures are float32 constants,
        # so those two agree with the float64 loop only to ~1e-7.
        rel = 1e-6 if loss_type in ("sapo", "vespo") else 1e-9
        assert out.loss.item() == pytest.approx(expected, rel=rel, abs=1e-12)


@pytest.mark.parametrize("loss_type", ALL_LOSSES)
def test_all_losses_are_finite_and_differentiable(loss_type):
    logp, old, adv, mask = _random_inputs(5)
    logp.requires_grad_(True)
    out = run(loss_type, logp, old, adv, mask, max_completion_length=5)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert torch.isfinite(logp.grad).all()
    assert (logp.grad[~mask.bool()] == 0).all()  # padding gets no gradient


# ----------------------------------------------------------------------------------------------
# Gradients
# ----------------------------------------------------------------------------------------------

def _grad(loss_type, old=OLD_BT, **kwargs):
    logp = LOGP_BT.clone().requires_grad_(True)
    run(loss_type, logp=logp, old=old, **kwargs).loss.backward()
    return logp.grad


def test_cispo_gradient_does_not_flow_through_the_ratio():
    # d/dlogp of -sg(min(r, eps_high)) A logp / N = -min(r, eps_high) A / N, N = 5 tokens.
    # row 0: -[e^0.1, e^-0.3, 1.2] / 5;  row 1: -[1, 0.5] * -2 / 5 = [0.4, 0.2];  padding 0.
    expected = torch.tensor([[-R00 / 5, -R01 / 5, -1.2 / 5], [0.4, 0.2, 0.0]], dtype=torch.float64)
    assert_close(_grad("cispo", epsilon_high=1.2), expected)


def test_sapo_gradient_formula():
    # d/dlogp of -(4 / tau) sigmoid(x) A with x = tau (r - 1), dr/dlogp = r:
    #   -(4 / tau) sigmoid(x) (1 - sigmoid(x)) tau r A = -4 A r sigmoid(x) (1 - sigmoid(x)),
    # divided by |y_b| B (grpo aggregation): 3 * 2 for row 0, 2 * 2 for row 1.
    def g(r, a, tau, n):
        s = sigmoid(tau * (r - 1))
        return -4 * a * r * s * (1 - s) / (n * 2)

    expected = torch.tensor([
        [g(R00, 1.0, 1.0, 3), g(R01, 1.0, 1.0, 3), g(R02, 1.0, 1.0, 3)],
        [g(1.0, -2.0, 1.05, 2), g(0.5, -2.0, 1.05, 2), 0.0],
    ], dtype=torch.float64)
    assert_close(_grad("sapo"), expected, rtol=1e-6, atol=1e-9)


def test_sapo_gradient_at_ratio_one_equals_unclipped_ppo():
    # r = 1: sigmoid(0)(1 - sigmoid(0)) = 1/4 -> gradient -A / (|y_b| B), same as grpo on-policy.
    expected = torch.tensor([[-1 / 6, -1 / 6, -1 / 6], [2 / 4, 2 / 4, 0.0]], dtype=torch.float64)
    assert_close(_grad("sapo", old=None), expected, rtol=1e-6, atol=1e-9)
    assert_close(_grad("grpo", old=None), expected)


def test_clipped_surrogate_has_no_gradient_on_clipped_tokens():
    # bnpo: gradient -r A / 5 where unclipped; 0 at row 0 token 2 (r = 1.5 > 1.2, A > 0) and
    # row 1 token 1 (r = 0.5 < 0.8, A < 0); 0 on padding.
    expected = torch.tensor([[-R00 / 5, -R01 / 5, 0.0], [2.0 / 5, 0.0, 0.0]], dtype=torch.float64)
    assert_close(_grad("bnpo"), expected)


# ----------------------------------------------------------------------------------------------
# clip_diagnostics
# ----------------------------------------------------------------------------------------------

def _diagnostics(loss_type, ratio=None, epsilon_low=0.2, epsilon_high=0.2):
    ratio = torch.exp(D_BT) if ratio is None else ratio
    return clip_diagnostics(ratio, ADV_B, MASK_BT, epsilon_low=epsilon_low, epsilon_high=epsilon_high,
                            loss_type=loss_type)


@pytest.mark.parametrize("loss_type", CLIP_LOSSES)
def test_clip_diagnostics_clipped_surrogate_by_hand(loss_type):
    # low: r < 0.8 and A < 0 -> row 1 token 1 (r = 0.5); the padding (r = e^-2, A < 0) is not counted.
    # high: r > 1.2 and A > 0 -> row 0 token 2 (r = 1.5). Row 0 token 1 (r = 0.74, A > 0) is not low.
    diag = _diagnostics(loss_type)
    assert diag.is_low_clipped_BT.tolist() == [[False, False, False], [False, True, False]]
    assert diag.is_high_clipped_BT.tolist() == [[False, False, True], [False, False, False]]
    assert diag.is_region_clipped_BT.tolist() == [[False, False, True], [False, True, False]]


def test_clip_diagnostics_cispo_uses_absolute_cap():
    # high: r > eps_high = 1.0 and A > 0 -> row 0 tokens 0 (1.105) and 2 (1.5); never low.
    diag = _diagnostics("cispo", epsilon_high=1.0)
    assert diag.is_high_clipped_BT.tolist() == [[True, False, True], [False, False, False]]
    assert not diag.is_low_clipped_BT.any()
    assert diag.is_region_clipped_BT.tolist() == diag.is_high_clipped_BT.tolist()


@pytest.mark.parametrize("loss_type", ["sapo", "vespo"])
def test_clip_diagnostics_soft_losses_never_clip(loss_type):
    diag = _diagnostics(loss_type, ratio=torch.tensor([[5.0, 0.01, 1.0], [5.0, 0.01, 1.0]]))
    assert not diag.is_region_clipped_BT.any()


def test_clip_diagnostics_sequence_ratio_is_broadcast():
    # (B, 1) ratios [1.5, 0.5]: row 0 (A > 0) high on all 3 tokens; row 1 (A < 0) low on its 2 real tokens.
    diag = _diagnostics("grpo", ratio=torch.tensor([[1.5], [0.5]]))
    assert diag.is_high_clipped_BT.tolist() == [[True, True, True], [False, False, False]]
    assert diag.is_low_clipped_BT.tolist() == [[False, False, False], [True, True, False]]


# ----------------------------------------------------------------------------------------------
# aggregate_loss edge cases and argument errors
# ----------------------------------------------------------------------------------------------

def test_aggregate_all_padding_row_does_not_divide_by_zero():
    # Row 1 has no tokens: grpo counts it as 0 -> (6 / 2 + 0) / 2 = 1.5.
    per_token = torch.tensor([[2.0, 4.0], [7.0, 7.0]])
    mask = torch.tensor([[1, 1], [0, 0]])
    assert_close(aggregate_loss(per_token, mask, loss_type="grpo"), torch.tensor(1.5))
    assert_close(aggregate_loss(per_token, mask, loss_type="bnpo"), torch.tensor(3.0))


def test_invalid_arguments_raise():
    with pytest.raises(ValueError):
        run("dr_grpo")  # needs max_completion_length
    with pytest.raises(ValueError):
        run("grpo", beta=0.1)  # needs ref_logprobs_BT
    with pytest.raises(ValueError):
        run("ppo")
    with pytest.raises(ValueError):
        run("grpo", importance_sampling_level="token_mean")
