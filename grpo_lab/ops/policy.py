"""The per-token GRPO policy objective, its KL penalty, its aggregation, and clipping diagnostics.

Shapes: B completions, T completion positions. ``ratio`` is the importance ratio
``pi_theta / pi_old`` per token (B, T), or per sequence (B, 1) with ``importance_sampling_level=
"sequence"``. Losses are to be minimised (the negative of the surrogate objective).

Papers: GRPO arXiv:2402.03300; DAPO (decoupled clipping, token-level normalisation) arXiv:2503.14476;
Dr. GRPO arXiv:2503.20783; GSPO (sequence-level ratio) arXiv:2507.18071; INTELLECT-2 (two-sided
clipping, delta) arXiv:2505.07291; CISPO (MiniMax-M1) arXiv:2506.13585; SAPO arXiv:2511.20347;
k3 KL estimator: J. Schulman, "Approximating KL divergence" (2020); bias-corrected KL and off-policy
sequence masking: DeepSeek-V3.2 (arXiv:2512.02556); entropy bonus: the entropy regulariser of A3C
and PPO (arXiv:1602.01783, arXiv:1707.06347).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

CLIP_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
"""Loss types with PPO's clipped surrogate ``-min(r A, clip(r, 1-eps_low, 1+eps_high) A)``."""


@dataclass
class PolicyLossOutput:
    loss: torch.Tensor
    """Scalar aggregated loss of the micro-batch."""
    per_token_loss_BT: torch.Tensor
    """(B, T) per-token loss before masking and aggregation (KL term included)."""
    ratio_BT: torch.Tensor
    """(B, T) or (B, 1) importance ratio pi_theta / pi_old (before any clipping)."""
    kl_BT: torch.Tensor | None
    """(B, T) per-token KL estimate (bias-corrected when asked), or None when beta = 0."""
    entropy_bonus: torch.Tensor | None = None
    """Scalar entropy term H subtracted as ``entropy_coef x H`` (:func:`entropy_bonus`), or None."""


@dataclass
class ClipDiagnostics:
    """Where clipping removed the gradient: boolean (B, T) maps, padding excluded."""

    is_low_clipped_BT: torch.Tensor
    is_high_clipped_BT: torch.Tensor
    is_region_clipped_BT: torch.Tensor


def log_importance_weights(logprobs_BT, old_logprobs_BT, mask_BT, *, level: str = "token") -> torch.Tensor:
    """``log r``. Token level: ``log r_t = log pi(y_t) - log pi_old(y_t)``, shape (B, T).
    Sequence level (GSPO): ``log r = sum_t m_t (log pi - log pi_old) / max(sum_t m_t, 1)``, the
    length-normalised sequence log-ratio, shape (B, 1)."""
    log_ratio_BT = logprobs_BT - old_logprobs_BT
    if level == "token":
        return log_ratio_BT
    if level == "sequence":
        mask_BT = mask_BT.to(log_ratio_BT.dtype)
        return ((log_ratio_BT * mask_BT).sum(-1) / mask_BT.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {level!r}.")


def k3_kl(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi_theta || pi_ref) from samples of pi_theta:
    ``k3 = exp(d) - d - 1`` with ``d = log pi_ref - log pi_theta``. Non-negative, zero iff d = 0."""
    d_BT = ref_logprobs_BT - logprobs_BT
    return torch.exp(d_BT) - d_BT - 1


@torch.no_grad()
def vespo_weights(
    log_ratio_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    k_pos: float,
    lambda_pos: float,
    k_neg: float,
    lambda_neg: float,
    importance_sampling_ratio_BT: torch.Tensor | None = None,
) -> torch.Tensor:
    """VESPO's gamma-kernel weight of the sequence ratio, detached (a gradient scale), shape (B, 1):

    ``log w = clamp(sum_t m_t clamp(log r_t, -20, 20), log 1e-8, 20)``,
    ``phi(w) = exp(lambda + k log w - lambda w) = w^k e^{lambda (1 - w)}`` (so phi(1) = 1),
    with (k, lambda) = (k_pos, lambda_pos) where A >= 0 and (k_neg, lambda_neg) where A < 0.
    A vLLM importance-sampling ratio, when given, is folded into log w (its logs summed over T).
    Non-finite weights become 0.
    """
    floor = math.log(1e-8)
    log_w_B1 = (log_ratio_BT.float().clamp(-20.0, 20.0) * mask_BT.float()).sum(-1, keepdim=True)
    if importance_sampling_ratio_BT is not None:
        log_is = torch.log(importance_sampling_ratio_BT.float()).clamp(floor, 20.0)
        log_w_B1 = log_w_B1 + log_is.sum(-1, keepdim=True)
    log_w_B1 = log_w_B1.clamp(floor, 20.0)
    nonnegative_B1 = advantages_B.reshape(-1, 1) >= 0
    k_B1 = torch.where(nonnegative_B1, k_pos, k_neg)
    lam_B1 = torch.where(nonnegative_B1, lambda_pos, lambda_neg).clamp(min=1e-4)
    phi_B1 = torch.exp(lam_B1 + k_B1 * log_w_B1 - lam_B1 * torch.exp(log_w_B1))
    return phi_B1.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def off_policy_mask(
    advantages_B: torch.Tensor,
    logprobs_BT: torch.Tensor,
    sampling_logprobs_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    threshold: float,
) -> torch.Tensor:
    """Off-policy sequence masking (DeepSeek-V3.2, arXiv:2512.02556, eq. 9): a completion is dropped
    from the policy term when its advantage is negative AND the policy has drifted from the one that
    sampled it by more than ``threshold`` (delta) nats per token on average:

        M_b = 0  if  A_b < 0  and  sum_t m_bt (log pi_s(y_bt) - log pi_theta(y_bt)) / max(|y_b|, 1) > delta
        M_b = 1  otherwise

    pi_s is the sampling policy (vLLM's log-probs, else pi_old); pi_theta is detached, so the mask
    carries no gradient. Shapes: advantages (B,); logprobs, sampling log-probs, mask (B, T). Returns
    (B, 1) in the log-probs' dtype.
    """
    mask_BT = mask_BT.to(logprobs_BT.dtype)
    drift_B = ((sampling_logprobs_BT - logprobs_BT.detach()) * mask_BT).sum(-1) / mask_BT.sum(-1).clamp(min=1.0)
    keep_B = (advantages_B.reshape(-1) >= 0) | (drift_B <= threshold)
    return keep_B.to(logprobs_BT.dtype).unsqueeze(-1)


def entropy_bonus(
    entropies_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    loss_type: str,
    num_items_in_batch: float | torch.Tensor | None = None,
    entropy_mask_BT: torch.Tensor | None = None,
) -> torch.Tensor:
    """The entropy term H of ``L = L_policy - entropy_coef x H``: the mean entropy of the kept tokens
    (``k = m x entropy_mask``, all completion tokens without ``top_entropy_quantile``), weighted so that
    the micro-batches of an optimizer step add up to an average of their kept-token means:

    - dapo, cispo, vespo: ``(sum k H / max(sum k, 1)) x sum m / N`` with N the optimizer step's tokens
      (as in :func:`aggregate_loss`): each micro-batch's kept-token mean weighted by its share of the
      step's tokens (``sum m H / N`` when every token is kept, so over the step exactly the mean token
      entropy; with an entropy mask, the step's kept-token mean when micro-batches keep equal shares);
    - every other loss type: ``sum k H / max(sum k, 1)``, this micro-batch's mean (the caller averages
      micro-batches as it averages their losses).

    Shapes: entropies (B, T) with gradient; masks (B, T). Returns a scalar.
    """
    mask_BT = mask_BT.to(entropies_BT.dtype)
    kept_BT = mask_BT if entropy_mask_BT is None else mask_BT * entropy_mask_BT.to(entropies_BT.dtype)
    mean = (entropies_BT * kept_BT).sum() / kept_BT.sum().clamp(min=1.0)
    if loss_type in ("dapo", "cispo", "vespo") and num_items_in_batch is not None:
        return mean * mask_BT.sum() / torch.as_tensor(num_items_in_batch).clamp(min=1.0)
    return mean


def applied_entropy_coef(coef: float, last_entropy: float | None, *, adaptive: bool, target: float) -> float:
    """The entropy weight a step's loss uses. Static: ``coef``. Adaptive: ``coef`` while the previous
    step's mean token entropy is at most ``target`` (and before any step), else 0, so the bonus acts
    only once entropy has fallen to the target."""
    if adaptive and last_entropy is not None and last_entropy > target:
        return 0.0
    return coef


def adapt_entropy_coef(coef: float, entropy: float, *, target: float, delta: float, coef_min: float, coef_max: float) -> float:
    """One step of the adaptive entropy weight, from the step's mean token entropy H:
    ``c' = min(c + delta, c_max)`` if ``H <= target``, else ``max(c - delta, c_min)``."""
    if entropy <= target:
        return min(coef + delta, coef_max)
    return max(coef - delta, coef_min)


def per_token_objective(
    logprobs_BT: torch.Tensor,
    ratio_BT: torch.Tensor,
    advantages_B1: torch.Tensor,
    *,
    loss_type: str,
    epsilon_low: float,
    epsilon_high: float,
    delta: float | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_weight_B1: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token loss (before KL, masks and aggregation) for ``loss_type``. A = advantage, r = ratio.

    - clipped surrogate (grpo, bnpo, dr_grpo, dapo, luspo):
      ``-min(min(r, delta) A, clip(r, 1 - eps_low, 1 + eps_high) A)`` (``min(r, delta)`` only when
      delta is set: INTELLECT-2's two-sided clipping);
    - cispo: ``-sg(min(r, eps_high)) A log pi`` (sg = stop-gradient; eps_high is an absolute cap);
    - sapo: ``-(4 / tau) sigmoid(tau (r - 1)) A`` with tau = tau_pos if A > 0 else tau_neg; its
      gradient is ``-A r sigmoid'(tau (r - 1)) 4 d log pi``, equal to the unclipped one at r = 1;
    - vespo: ``-sg(phi(w)) A log pi`` with phi from :func:`vespo_weights`.

    Shapes: logprobs (B, T); ratio (B, T) or (B, 1); advantages (B, 1). Returns (B, T) or (B, 1).
    """
    if loss_type in CLIP_LOSSES:
        clipped = torch.clamp(ratio_BT, 1 - epsilon_low, 1 + epsilon_high)
        unclipped = ratio_BT if delta is None else torch.clamp(ratio_BT, max=delta)
        return -torch.min(unclipped * advantages_B1, clipped * advantages_B1)
    if loss_type == "cispo":
        weight = torch.clamp(ratio_BT, max=epsilon_high).detach()
        return -weight * advantages_B1 * logprobs_BT
    if loss_type == "sapo":
        tau = torch.where(advantages_B1 > 0, sapo_temperature_pos, sapo_temperature_neg).to(ratio_BT.dtype)
        gate = torch.sigmoid(tau * (ratio_BT - 1)) * 4 / tau
        return -gate * advantages_B1
    if loss_type == "vespo":
        if vespo_weight_B1 is None:
            raise ValueError("loss_type='vespo' needs vespo_weight_B1 (see vespo_weights).")
        return -vespo_weight_B1 * advantages_B1 * logprobs_BT
    raise ValueError(f"Unknown loss_type {loss_type!r}.")


def aggregate_loss(
    per_token_loss_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    loss_type: str,
    max_completion_length: int | None = None,
    num_items_in_batch: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce per-token losses to a scalar; m = mask, L = per-token loss, |y_b| = sum_t m_bt.

    - grpo, sapo: ``mean_b( sum_t m L / max(|y_b|, 1) )`` (per-sequence mean; length-biased);
    - bnpo: ``sum m L / max(sum m, 1)`` (tokens of this micro-batch);
    - dr_grpo: ``sum m L / (B x max_completion_length)``;
    - dapo, cispo, vespo: ``sum m L / N`` with N = ``num_items_in_batch``, the tokens of the whole
      optimizer step (the caller counts them over processes and micro-batches); None uses this
      micro-batch's tokens;
    - luspo: ``mean_b( sum_t m L )``: the sum over a sequence's tokens, so a per-sequence loss
      L_b (B, 1) is weighted by its length |y_b| (TRL 1.16).

    A (B, 1) loss (sequence-level ratio, no per-token term) is broadcast over the tokens first.
    """
    mask_BT = mask_BT.to(per_token_loss_BT.dtype)
    lengths_B1 = mask_BT.sum(-1, keepdim=True)
    masked_BT = per_token_loss_BT.expand_as(mask_BT) * mask_BT
    if loss_type == "luspo":
        return masked_BT.sum(-1).mean()
    if loss_type in ("grpo", "sapo"):
        return (masked_BT.sum(-1) / lengths_B1.squeeze(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return masked_BT.sum() / mask_BT.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        if not max_completion_length:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length.")
        return masked_BT.sum() / (mask_BT.shape[0] * max_completion_length)
    if loss_type in ("dapo", "cispo", "vespo"):
        normalizer = mask_BT.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch)
        return masked_BT.sum() / normalizer.clamp(min=1.0)
    raise ValueError(f"Unknown loss_type {loss_type!r}.")


def policy_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor | None,
    advantages_B: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    loss_type: str = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    importance_sampling_level: str = "token",
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    ref_logprobs_BT: torch.Tensor | None = None,
    beta: float = 0.0,
    use_bias_correction_kl: bool = False,
    entropy_mask_BT: torch.Tensor | None = None,
    importance_sampling_ratio_BT: torch.Tensor | None = None,
    max_completion_length: int | None = None,
    num_items_in_batch: float | torch.Tensor | None = None,
    off_policy_mask_B1: torch.Tensor | None = None,
    entropies_BT: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> PolicyLossOutput:
    """The GRPO loss of one micro-batch, in TRL's order of operations:

    1. ``r = exp(log_importance_weights(...))``; ``old_logprobs`` None means on-policy (r = 1, the
       gradient is still that of r);
    2. per-token objective for ``loss_type`` (:func:`per_token_objective`);
    3. times the off-policy mask (:func:`off_policy_mask`), then the entropy mask
       (``top_entropy_quantile``), then the vLLM importance-sampling ratio (except vespo, which
       folds it into its weight);
    4. plus ``beta x KL`` with KL = k3 (times r when ``use_bias_correction_kl``);
    5. :func:`aggregate_loss` over ``mask``;
    6. minus ``entropy_coef x H`` (:func:`entropy_bonus`, over the tokens the entropy mask keeps)
       when ``entropy_coef`` is not 0; ``entropies`` must then carry their gradient.

    Shapes: logprobs, old/ref logprobs, mask, entropy mask, entropies (B, T); advantages (B,);
    importance_sampling_ratio (B, T) or (B, 1); off-policy mask (B, 1).
    """
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    old_logprobs_BT = logprobs_BT.detach() if old_logprobs_BT is None else old_logprobs_BT
    advantages_B1 = advantages_B.reshape(-1, 1).to(logprobs_BT.dtype)
    log_ratio_BT = logprobs_BT - old_logprobs_BT
    log_weights = log_importance_weights(logprobs_BT, old_logprobs_BT, mask_BT, level=importance_sampling_level)
    ratio = torch.exp(log_weights)
    vespo_weight_B1 = None
    if loss_type == "vespo":
        vespo_weight_B1 = vespo_weights(
            log_ratio_BT, advantages_B, mask_BT, k_pos=vespo_k_pos, lambda_pos=vespo_lambda_pos,
            k_neg=vespo_k_neg, lambda_neg=vespo_lambda_neg, importance_sampling_ratio_BT=importance_sampling_ratio_BT,
        ).to(logprobs_BT.dtype)
    per_token = per_token_objective(
        logprobs_BT, ratio, advantages_B1, loss_type=loss_type, epsilon_low=epsilon_low,
        epsilon_high=epsilon_high, delta=delta, sapo_temperature_pos=sapo_temperature_pos,
        sapo_temperature_neg=sapo_temperature_neg, vespo_weight_B1=vespo_weight_B1,
    )
    if off_policy_mask_B1 is not None:
        per_token = per_token * off_policy_mask_B1
    if entropy_mask_BT is not None:
        per_token = per_token * entropy_mask_BT
    if importance_sampling_ratio_BT is not None and loss_type != "vespo":
        per_token = per_token * importance_sampling_ratio_BT
    kl_BT = None
    if beta != 0.0:
        if ref_logprobs_BT is None:
            raise ValueError("beta > 0 needs ref_logprobs_BT (log-probs under the reference model).")
        kl_BT = k3_kl(logprobs_BT, ref_logprobs_BT)
        if use_bias_correction_kl:
            kl_BT = kl_BT * ratio
        per_token = per_token + beta * kl_BT
    loss = aggregate_loss(
        per_token, mask_BT, loss_type=loss_type, max_completion_length=max_completion_length,
        num_items_in_batch=num_items_in_batch,
    )
    bonus = None
    if entropy_coef != 0.0:
        if entropies_BT is None:
            raise ValueError("entropy_coef != 0 needs entropies_BT (with their gradient).")
        bonus = entropy_bonus(
            entropies_BT, mask_BT, loss_type=loss_type, num_items_in_batch=num_items_in_batch, entropy_mask_BT=entropy_mask_BT,
        )
        loss = loss - entropy_coef * bonus
    return PolicyLossOutput(
        loss=loss, per_token_loss_BT=per_token.expand_as(logprobs_BT), ratio_BT=ratio, kl_BT=kl_BT, entropy_bonus=bonus,
    )


def clip_diagnostics(
    ratio_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    epsilon_low: float,
    epsilon_high: float,
    loss_type: str,
) -> ClipDiagnostics:
    """Tokens whose gradient the clip removed (TRL's clip_ratio metrics):

    - clipped surrogate: low = ``r < 1 - eps_low and A < 0``; high = ``r > 1 + eps_high and A > 0``;
    - cispo: high = ``r > eps_high and A > 0`` (the weight is capped there); no low side;
    - sapo, vespo: no hard clipping, all False.

    region = low or high. A (B, 1) ratio is broadcast over the tokens; padding is False.
    """
    valid_BT = mask_BT.bool()
    ratio_BT = ratio_BT.expand(valid_BT.shape)
    advantages_B1 = advantages_B.reshape(-1, 1)
    if loss_type in CLIP_LOSSES:
        low = (ratio_BT < 1 - epsilon_low) & (advantages_B1 < 0)
        high = (ratio_BT > 1 + epsilon_high) & (advantages_B1 > 0)
    elif loss_type == "cispo":
        low = torch.zeros_like(valid_BT)
        high = (ratio_BT > epsilon_high) & (advantages_B1 > 0)
    else:
        low = high = torch.zeros_like(valid_BT)
    low, high = low & valid_BT, high & valid_BT
    return ClipDiagnostics(is_low_clipped_BT=low, is_high_clipped_BT=high, is_region_clipped_BT=low | high)
