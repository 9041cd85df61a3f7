"""The functions loss types are made of, registered under the names the rows of
:data:`grpo_lab.ops.registry.LOSSES` give: per-token objectives (:data:`OBJECTIVES`), aggregations
(:data:`LOSS_AGGREGATIONS`) and the clipping masks of the clip-ratio metrics (:data:`CLIP_MASKS`).

Shapes: B completions, T completion positions. ``ratio`` is the importance ratio ``pi_theta / pi_old``
per token (B, T), or per sequence (B, 1) with ``importance_sampling_level="sequence"``; advantages
are (B, 1). Losses are to be minimised (the negative of the surrogate objective).

Papers: GRPO arXiv:2402.03300; DAPO (decoupled clipping, token-level normalisation) arXiv:2503.14476;
Dr. GRPO arXiv:2503.20783; INTELLECT-2 (two-sided clipping, delta) arXiv:2505.07291; CISPO
(MiniMax-M1) arXiv:2506.13585; SAPO arXiv:2511.20347; LUSPO as in TRL 1.16.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from grpo_lab.ops.registry import STEP_TOKEN_MEAN, LossSettings


@dataclass(frozen=True)
class Objective:
    """A per-token objective, and the sequence weight it needs computed first (if any)."""

    per_token: Callable[..., torch.Tensor]
    """``(logprobs_BT, ratio_BT, advantages_B1, settings, weight_B1) -> loss`` of shape (B, T), or
    (B, 1) for a sequence-level ratio that no per-token term touches."""
    sequence_weight: Callable[..., torch.Tensor] | None = None
    """``(log_ratio_BT, advantages_B, mask_BT, settings, importance_sampling_ratio_BT) -> (B, 1)``
    detached weight, handed to ``per_token`` as ``weight_B1``. It folds in the vLLM
    importance-sampling ratio, so ``policy_loss`` does not multiply the loss by that ratio again."""


OBJECTIVES: dict[str, Objective] = {}
"""Per-token objectives by name (``LossSpec.objective``)."""

LOSS_AGGREGATIONS: dict[str, Callable[..., torch.Tensor]] = {}
"""Reductions by name (``LossSpec.aggregation``): ``(masked_BT, mask_BT, *, loss_type,
max_completion_length, num_items_in_batch) -> scalar``, with ``masked_BT`` the per-token loss times
the mask (a float mask, in the loss's dtype)."""


def register_objective(name: str, *, sequence_weight: Callable[..., torch.Tensor] | None = None):
    """Register the decorated function as the per-token objective ``name`` (see :class:`Objective`)."""
    def register(per_token: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        OBJECTIVES[name] = Objective(per_token, sequence_weight)
        return per_token
    return register


def register_aggregation(name: str):
    """Register the decorated function as the aggregation ``name`` (see :data:`LOSS_AGGREGATIONS`)."""
    def register(aggregate: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        LOSS_AGGREGATIONS[name] = aggregate
        return aggregate
    return register


# ----------------------------------------------------------------------------------------------
# Per-token objectives. A = advantage (B, 1), r = ratio, sg = stop-gradient.
# ----------------------------------------------------------------------------------------------

@register_objective("clipped_surrogate")
def clipped_surrogate(logprobs_BT, ratio_BT, advantages_B1, settings: LossSettings, weight_B1=None) -> torch.Tensor:
    """PPO's clipped surrogate (grpo, bnpo, dr_grpo, dapo, luspo):
    ``-min(min(r, delta) A, clip(r, 1 - eps_low, 1 + eps_high) A)``, with ``min(r, delta)`` only when
    delta is set (INTELLECT-2's two-sided clipping). Returns the ratio's shape."""
    clipped = torch.clamp(ratio_BT, 1 - settings.epsilon_low, 1 + settings.epsilon_high)
    unclipped = ratio_BT if settings.delta is None else torch.clamp(ratio_BT, max=settings.delta)
    return -torch.min(unclipped * advantages_B1, clipped * advantages_B1)


@register_objective("cispo")
def cispo(logprobs_BT, ratio_BT, advantages_B1, settings: LossSettings, weight_B1=None) -> torch.Tensor:
    """CISPO: ``-sg(min(r, eps_high)) A log pi`` (eps_high is an absolute cap, not 1 + eps_high).
    Returns (B, T)."""
    weight = torch.clamp(ratio_BT, max=settings.epsilon_high).detach()
    return -weight * advantages_B1 * logprobs_BT


@register_objective("sapo")
def sapo(logprobs_BT, ratio_BT, advantages_B1, settings: LossSettings, weight_B1=None) -> torch.Tensor:
    """SAPO: ``-(4 / tau) sigmoid(tau (r - 1)) A`` with tau = sapo_temperature_pos if A > 0 else
    sapo_temperature_neg; its gradient is ``-A r sigmoid'(tau (r - 1)) 4 d log pi``, equal to the
    unclipped one at r = 1. Returns the ratio's shape."""
    tau = torch.where(advantages_B1 > 0, settings.sapo_temperature_pos, settings.sapo_temperature_neg)
    tau = tau.to(ratio_BT.dtype)
    gate = torch.sigmoid(tau * (ratio_BT - 1)) * 4 / tau
    return -gate * advantages_B1


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


def _vespo_sequence_weight(log_ratio_BT, advantages_B, mask_BT, settings: LossSettings,
                           importance_sampling_ratio_BT) -> torch.Tensor:
    """:func:`vespo_weights` with the kernel's shape and rate from the settings."""
    return vespo_weights(
        log_ratio_BT, advantages_B, mask_BT, k_pos=settings.vespo_k_pos, lambda_pos=settings.vespo_lambda_pos,
        k_neg=settings.vespo_k_neg, lambda_neg=settings.vespo_lambda_neg,
        importance_sampling_ratio_BT=importance_sampling_ratio_BT,
    )


@register_objective("vespo", sequence_weight=_vespo_sequence_weight)
def vespo(logprobs_BT, ratio_BT, advantages_B1, settings: LossSettings, weight_B1=None) -> torch.Tensor:
    """VESPO: ``-sg(phi(w)) A log pi`` with phi(w) the (B, 1) weight of :func:`vespo_weights`.
    Returns (B, T)."""
    if weight_B1 is None:
        raise ValueError("loss_type='vespo' needs vespo_weight_B1 (see vespo_weights).")
    return -weight_B1 * advantages_B1 * logprobs_BT


# ----------------------------------------------------------------------------------------------
# Aggregations. m = mask, L = per-token loss, |y_b| = sum_t m_bt; masked_BT = m L.
# ----------------------------------------------------------------------------------------------

@register_aggregation("sequence_mean")
def sequence_mean(masked_BT, mask_BT, *, loss_type, max_completion_length, num_items_in_batch) -> torch.Tensor:
    """``mean_b( sum_t m L / max(|y_b|, 1) )``: the per-sequence mean (length-biased; grpo, sapo)."""
    return (masked_BT.sum(-1) / mask_BT.sum(-1).clamp(min=1.0)).mean()


@register_aggregation("token_mean")
def token_mean(masked_BT, mask_BT, *, loss_type, max_completion_length, num_items_in_batch) -> torch.Tensor:
    """``sum m L / max(sum m, 1)``: the mean over this micro-batch's tokens (bnpo)."""
    return masked_BT.sum() / mask_BT.sum().clamp(min=1.0)


@register_aggregation("max_length")
def max_length(masked_BT, mask_BT, *, loss_type, max_completion_length, num_items_in_batch) -> torch.Tensor:
    """``sum m L / (B x max_completion_length)``: a constant normalizer (dr_grpo)."""
    if not max_completion_length:
        raise ValueError(f"loss_type={loss_type!r} needs max_completion_length.")
    return masked_BT.sum() / (mask_BT.shape[0] * max_completion_length)


@register_aggregation(STEP_TOKEN_MEAN)
def step_token_mean(masked_BT, mask_BT, *, loss_type, max_completion_length, num_items_in_batch) -> torch.Tensor:
    """``sum m L / N`` with N = ``num_items_in_batch``, the tokens of the whole optimizer step (the
    caller counts them over processes and micro-batches); None uses this micro-batch's tokens
    (dapo, cispo, vespo)."""
    normalizer = mask_BT.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch)
    return masked_BT.sum() / normalizer.clamp(min=1.0)


@register_aggregation("sequence_sum")
def sequence_sum(masked_BT, mask_BT, *, loss_type, max_completion_length, num_items_in_batch) -> torch.Tensor:
    """``mean_b( sum_t m L )``: the sum over a sequence's tokens, so a per-sequence loss L_b (B, 1)
    is weighted by its length |y_b| (luspo, TRL 1.16)."""
    return masked_BT.sum(-1).mean()


# ----------------------------------------------------------------------------------------------
# Clipping masks, by LossSpec.clipping: (ratio_BT, advantages_B1, epsilon_low, epsilon_high) ->
# boolean (low_BT, high_BT), the tokens whose gradient the clip removed. "none" has none.
# ----------------------------------------------------------------------------------------------

def surrogate_clip_masks(ratio_BT, advantages_B1, epsilon_low: float, epsilon_high: float):
    """low = ``r < 1 - eps_low and A < 0``; high = ``r > 1 + eps_high and A > 0``."""
    low = (ratio_BT < 1 - epsilon_low) & (advantages_B1 < 0)
    high = (ratio_BT > 1 + epsilon_high) & (advantages_B1 > 0)
    return low, high


def cap_clip_masks(ratio_BT, advantages_B1, epsilon_low: float, epsilon_high: float):
    """high = ``r > eps_high and A > 0`` (the weight is capped there); no low side."""
    return torch.zeros_like(ratio_BT, dtype=torch.bool), (ratio_BT > epsilon_high) & (advantages_B1 > 0)


CLIP_MASKS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "surrogate": surrogate_clip_masks,
    "cap": cap_clip_masks,
}
"""Clipping masks by ``LossSpec.clipping`` (a key of ``registry.CLIPPINGS``)."""
