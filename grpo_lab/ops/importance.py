"""Importance-sampling correction for completions sampled by an inference engine (vLLM).

The engine samples from pi_sampler, which differs slightly from the trainer's pi_old (other
kernels, precision). Truncated IS (TIS) and masked IS (MIS) reweight the loss by
``pi_old / pi_sampler`` per token or per sequence (Yao et al., "Your efficient RL framework
secretly brings you off-policy RL training", 2025).

Shapes: B completions, T completion positions.
"""

from __future__ import annotations

import torch

IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def vllm_importance_weights(
    old_logprobs_BT: torch.Tensor,
    sampling_logprobs_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    mode: str = "sequence_mask",
    clip_max: float | None = 3.0,
    clip_min: float | None = None,
) -> torch.Tensor:
    """The correction weight, (B, T) in token modes and (B, 1) in sequence modes.

    ``d_t = m_t (log pi_old(y_t) - log pi_sampler(y_t))``; token modes: ``rho_t = exp(d_t)``;
    sequence modes: ``rho = exp(sum_t d_t)``. ``*_truncate``: ``rho <- clamp(rho, clip_min, clip_max)``.
    ``*_mask``: ``rho <- 0`` where ``rho > clip_max`` or ``rho < clip_min``. A bound of None is no bound.
    Padding (m = 0) and tokens the sampler could not score (a NaN log-prob) get d = 0, so weight 1
    in token modes, as in TRL.
    """
    if mode not in IS_MODES:
        raise ValueError(f"mode must be one of {', '.join(IS_MODES)}, got {mode!r}.")
    diff_BT = torch.nan_to_num((old_logprobs_BT - sampling_logprobs_BT) * mask_BT.to(old_logprobs_BT.dtype), nan=0.0)
    if mode.startswith("sequence"):
        diff_BT = diff_BT.sum(-1, keepdim=True)
    ratio = torch.exp(diff_BT)
    if mode.endswith("truncate"):
        if clip_min is None and clip_max is None:
            return ratio
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    outside = torch.zeros_like(ratio, dtype=torch.bool)
    if clip_max is not None:
        outside |= ratio > clip_max
    if clip_min is not None:
        outside |= ratio < clip_min
    return ratio.masked_fill(outside, 0.0)


def importance_sampling_stats(
    weights: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    sampling_logprobs_BT: torch.Tensor,
    mask_BT: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """TRL's sampling metrics, as 0-d tensors: ``sampling/sampling_logp_difference/{mean,max}`` of
    ``|log pi_old - log pi_sampler|`` over the counted tokens (``mask``: the loss's, so truncated
    rows are out under ``mask_truncated_completions``) the sampler could score, and
    ``sampling/importance_sampling_ratio/{min,mean,max}`` of the weights over the counted tokens
    (token modes) or over every sequence (sequence modes, where an uncounted row's weight is 1).
    With nothing to take them over, each is 0, as TRL reports it."""
    valid_BT = mask_BT.bool()
    gap = (old_logprobs_BT - sampling_logprobs_BT).abs()[valid_BT]
    gap = gap[~torch.isnan(gap)]
    values = weights.flatten() if weights.shape[-1] == 1 else weights[valid_BT]
    empty = torch.tensor(0.0)
    return {
        "sampling/sampling_logp_difference/mean": gap.mean() if gap.numel() else empty,
        "sampling/sampling_logp_difference/max": gap.max() if gap.numel() else empty,
        "sampling/importance_sampling_ratio/min": values.min() if values.numel() else empty,
        "sampling/importance_sampling_ratio/mean": values.mean() if values.numel() else empty,
        "sampling/importance_sampling_ratio/max": values.max() if values.numel() else empty,
    }
