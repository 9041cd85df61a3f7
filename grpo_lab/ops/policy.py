"""The GRPO policy loss of a micro-batch (:func:`policy_loss`), its KL penalty, its entropy bonus, and
clipping diagnostics; the entry points to the functions a loss type is made of
(:func:`per_token_objective`, :func:`aggregate_loss`), which :data:`~grpo_lab.ops.registry.LOSSES`
picks by ``loss_type``.

Shapes: B completions, T completion positions. ``ratio`` is the importance ratio
``pi_theta / pi_old`` per token (B, T), or per sequence (B, 1) with ``importance_sampling_level=
"sequence"``. Losses are to be minimised (the negative of the surrogate objective).

Papers: GRPO arXiv:2402.03300; GSPO (sequence-level ratio) arXiv:2507.18071; the loss types' own
papers are in :mod:`grpo_lab.ops.losses`; k3 KL estimator: J. Schulman, "Approximating KL
divergence" (2020); bias-corrected KL and off-policy sequence masking: DeepSeek-V3.2
(arXiv:2512.02556); entropy bonus: the entropy regulariser of A3C and PPO (arXiv:1602.01783,
arXiv:1707.06347).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_lab.ops.losses import CLIP_MASKS, LOSS_AGGREGATIONS, OBJECTIVES
from grpo_lab.ops.registry import LOSSES, LossSettings, loss_spec


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
    policy_loss: torch.Tensor | None = None
    """Scalar aggregated loss before the entropy bonus (``loss`` itself without one)."""
    sequence_weight_B1: torch.Tensor | None = None
    """(B, 1) the objective's sequence weight (vespo's phi), or None for objectives without one."""


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
    carries no gradient. A token whose sampling log-prob is NaN (one vLLM could not score) adds 0 to
    the sum. Shapes: advantages (B,); logprobs, sampling log-probs, mask (B, T). Returns
    (B, 1) in the log-probs' dtype.
    """
    mask_BT = mask_BT.to(logprobs_BT.dtype)
    # a token the sampler could not score (NaN) is no evidence of drift, as in TRL
    drift_BT = torch.nan_to_num(sampling_logprobs_BT - logprobs_BT.detach(), nan=0.0)
    drift_B = (drift_BT * mask_BT).sum(-1) / mask_BT.sum(-1).clamp(min=1.0)
    keep_B = (advantages_B.reshape(-1) >= 0) | (drift_B <= threshold)
    return keep_B.to(logprobs_BT.dtype).unsqueeze(-1)


def entropy_bonus(
    entropies_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    entropy_mask_BT: torch.Tensor | None = None,
) -> torch.Tensor:
    """The entropy term H of ``L = L_policy - entropy_coef x H / a``: the mean entropy of the kept
    tokens of one micro-batch, ``sum k H / max(sum k, 1)`` with ``k = m x entropy_mask`` (all
    completion tokens without ``top_entropy_quantile``). As in TRL 1.16, the loss type's normaliser
    never scales it: each micro-batch adds its own kept-token mean, divided by the a micro-batches
    of the optimizer step (:func:`policy_loss`).

    Shapes: entropies (B, T) with gradient; masks (B, T). Returns a scalar.
    """
    mask_BT = mask_BT.to(entropies_BT.dtype)
    kept_BT = mask_BT if entropy_mask_BT is None else mask_BT * entropy_mask_BT.to(entropies_BT.dtype)
    return (entropies_BT * kept_BT).sum() / kept_BT.sum().clamp(min=1.0)


def applied_entropy_coef(coef: float, last_entropy: float | None, *, adaptive: bool, target: float) -> float:
    """The entropy weight a step's loss uses. Static: ``coef``. Adaptive: ``coef`` while the previous
    step's mean token entropy is at most ``target`` (and before any step), else 0, so the bonus acts
    only once entropy has fallen to the target."""
    if adaptive and last_entropy is not None and last_entropy > target:
        return 0.0
    return coef


def adapt_entropy_coef(coef: float, entropy: float, *, target: float, delta: float, coef_min: float,
                       coef_max: float) -> float:
    """One step of the adaptive entropy weight, from the step's mean token entropy H:
    ``c' = min(c + delta, c_max)`` if ``H <= target``, else ``max(c - delta, c_min)``."""
    if entropy <= target:
        return min(coef + delta, coef_max)
    return max(coef - delta, coef_min)


def _settings(settings: LossSettings | None, values: dict) -> LossSettings:
    """``settings``, or one made of the fields given as keywords (the form the notebooks use)."""
    if settings is None:
        return LossSettings(**values)
    if values:
        raise TypeError(f"Give settings or its fields ({', '.join(values)}) as keywords, not both.")
    return settings


def per_token_objective(
    logprobs_BT: torch.Tensor,
    ratio_BT: torch.Tensor,
    advantages_B1: torch.Tensor,
    *,
    settings: LossSettings | None = None,
    vespo_weight_B1: torch.Tensor | None = None,
    **setting_values,
) -> torch.Tensor:
    """Per-token loss (before KL, masks and aggregation) for ``loss_type``, by its objective
    (``LOSSES[loss_type].objective``, a function of :mod:`grpo_lab.ops.losses`). A = advantage,
    r = ratio.

    - clipped surrogate (grpo, bnpo, dr_grpo, dapo, luspo):
      ``-min(min(r, delta) A, clip(r, 1 - eps_low, 1 + eps_high) A)`` (``min(r, delta)`` only when
      delta is set: INTELLECT-2's two-sided clipping);
    - cispo: ``-sg(min(r, eps_high)) A log pi`` (sg = stop-gradient; eps_high is an absolute cap);
    - sapo: ``-(4 / tau) sigmoid(tau (r - 1)) A`` with tau = tau_pos if A > 0 else tau_neg; its
      gradient is ``-A r sigmoid'(tau (r - 1)) 4 d log pi``, equal to the unclipped one at r = 1;
    - vespo: ``-sg(phi(w)) A log pi`` with phi the weight ``vespo_weight_B1`` of :func:`vespo_weights`.

    Settings: ``settings`` (:class:`LossSettings`) or its fields as keywords (``loss_type="grpo",
    epsilon_low=0.2, epsilon_high=0.28``).

    Shapes: logprobs (B, T); ratio (B, T) or (B, 1); advantages (B, 1). Returns (B, T) or (B, 1).
    """
    settings = _settings(settings, setting_values)
    objective = OBJECTIVES[settings.spec.objective]
    return objective.per_token(logprobs_BT, ratio_BT, advantages_B1, settings, vespo_weight_B1)


def aggregate_loss(
    per_token_loss_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    loss_type: str,
    max_completion_length: int | None = None,
    num_items_in_batch: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce per-token losses to a scalar with the loss type's aggregation (``LOSSES[loss_type]
    .aggregation``, a function of :mod:`grpo_lab.ops.losses`); m = mask, L = per-token loss,
    |y_b| = sum_t m_bt:

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
    aggregate = LOSS_AGGREGATIONS[loss_spec(loss_type).aggregation]
    mask_BT = mask_BT.to(per_token_loss_BT.dtype)
    masked_BT = per_token_loss_BT.expand_as(mask_BT) * mask_BT
    return aggregate(masked_BT, mask_BT, loss_type=loss_type, max_completion_length=max_completion_length,
                     num_items_in_batch=num_items_in_batch)


def _policy_term(logprobs_BT, old_logprobs_BT, ratio, advantages_B, mask_BT, settings: LossSettings, *,
                 off_policy_mask_B1, entropy_mask_BT, importance_sampling_ratio_BT):
    """Steps 2 and 3 of :func:`policy_loss`: the loss type's per-token objective (after its sequence
    weight, where it has one), times the off-policy mask, the entropy mask and the vLLM
    importance-sampling ratio, in that order; a sequence weight folds that ratio in instead.
    Returns the per-token loss and the (B, 1) sequence weight (None without one)."""
    objective = OBJECTIVES[settings.spec.objective]
    weight_B1 = None
    if objective.sequence_weight is not None:
        weight_B1 = objective.sequence_weight(
            logprobs_BT - old_logprobs_BT, advantages_B, mask_BT, settings, importance_sampling_ratio_BT,
        ).to(logprobs_BT.dtype)
        importance_sampling_ratio_BT = None
    advantages_B1 = advantages_B.reshape(-1, 1).to(logprobs_BT.dtype)
    per_token = objective.per_token(logprobs_BT, ratio, advantages_B1, settings, weight_B1)
    if off_policy_mask_B1 is not None:
        per_token = per_token * off_policy_mask_B1
    if entropy_mask_BT is not None:
        per_token = per_token * entropy_mask_BT
    if importance_sampling_ratio_BT is not None:
        per_token = per_token * importance_sampling_ratio_BT
    return per_token, weight_B1


def _kl_BT(logprobs_BT, ref_logprobs_BT, ratio, settings: LossSettings) -> torch.Tensor | None:
    """(B, T) k3 KL to the reference policy (times the ratio when bias-corrected); None when beta = 0."""
    if settings.beta == 0.0:
        return None
    if ref_logprobs_BT is None:
        raise ValueError("beta > 0 needs ref_logprobs_BT (log-probs under the reference model).")
    kl_BT = k3_kl(logprobs_BT, ref_logprobs_BT)
    return kl_BT * ratio if settings.use_bias_correction_kl else kl_BT


def _with_entropy_bonus(loss, entropies_BT, mask_BT, entropy_mask_BT, entropy_coef: float, divisor: int):
    """Step 6 of :func:`policy_loss`: ``loss - entropy_coef x H / divisor`` and H; ``loss`` and None
    without a bonus."""
    if entropy_coef == 0.0:
        return loss, None
    if entropies_BT is None:
        raise ValueError("entropy_coef != 0 needs entropies_BT (with their gradient).")
    bonus = entropy_bonus(entropies_BT, mask_BT, entropy_mask_BT=entropy_mask_BT)
    return loss - entropy_coef * bonus / divisor, bonus


def policy_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor | None,
    advantages_B: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    settings: LossSettings | None = None,
    ref_logprobs_BT: torch.Tensor | None = None,
    entropy_mask_BT: torch.Tensor | None = None,
    importance_sampling_ratio_BT: torch.Tensor | None = None,
    num_items_in_batch: float | torch.Tensor | None = None,
    off_policy_mask_B1: torch.Tensor | None = None,
    entropies_BT: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    accumulation_steps: int = 1,
    **setting_values,
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
    6. minus ``entropy_coef x H / a`` (:func:`entropy_bonus`; ``entropies`` with their gradient),
       a = ``accumulation_steps`` for dapo, cispo and vespo, whose normaliser counts the step's
       tokens (the caller divides other loss types' whole loss by a), as TRL 1.16 does.

    Settings: ``settings`` (:class:`LossSettings`: loss_type, epsilon_low/high, delta, importance_sampling_level,
    the sapo and vespo shapes, beta, use_bias_correction_kl, max_completion_length), or its fields as keywords.

    Shapes: logprobs, old/ref logprobs, mask, entropy mask, entropies (B, T); advantages (B,);
    importance_sampling_ratio (B, T) or (B, 1); off-policy mask (B, 1).
    """
    settings = _settings(settings, setting_values)
    old_logprobs_BT = logprobs_BT.detach() if old_logprobs_BT is None else old_logprobs_BT
    level = settings.importance_sampling_level
    ratio = torch.exp(log_importance_weights(logprobs_BT, old_logprobs_BT, mask_BT, level=level))
    per_token, weight_B1 = _policy_term(
        logprobs_BT, old_logprobs_BT, ratio, advantages_B, mask_BT, settings, off_policy_mask_B1=off_policy_mask_B1,
        entropy_mask_BT=entropy_mask_BT, importance_sampling_ratio_BT=importance_sampling_ratio_BT,
    )
    kl_BT = _kl_BT(logprobs_BT, ref_logprobs_BT, ratio, settings)
    if kl_BT is not None:
        per_token = per_token + settings.beta * kl_BT
    policy_term = aggregate_loss(per_token, mask_BT, loss_type=settings.loss_type,
                                 max_completion_length=settings.max_completion_length,
                                 num_items_in_batch=num_items_in_batch)
    divisor = accumulation_steps if settings.spec.normalizes_globally else 1
    loss, bonus = _with_entropy_bonus(policy_term, entropies_BT, mask_BT, entropy_mask_BT, entropy_coef, divisor)
    return PolicyLossOutput(
        loss=loss, per_token_loss_BT=per_token.expand_as(logprobs_BT), ratio_BT=ratio, kl_BT=kl_BT, entropy_bonus=bonus,
        policy_loss=policy_term, sequence_weight_B1=weight_B1,
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
    """Tokens whose gradient the clip removed (TRL's clip_ratio metrics), by the loss type's
    clipping (``LOSSES[loss_type].clipping``, masks in :data:`~grpo_lab.ops.losses.CLIP_MASKS`):

    - clipped surrogate: low = ``r < 1 - eps_low and A < 0``; high = ``r > 1 + eps_high and A > 0``;
    - cispo: high = ``r > eps_high and A > 0`` (the weight is capped there); no low side;
    - sapo, vespo: no hard clipping, all False.

    region = low or high. A (B, 1) ratio is broadcast over the tokens; padding is False.
    """
    valid_BT = mask_BT.bool()
    ratio_BT = ratio_BT.expand(valid_BT.shape)
    clip_masks = CLIP_MASKS.get(LOSSES[loss_type].clipping) if loss_type in LOSSES else None
    if clip_masks is None:
        low = high = torch.zeros_like(valid_BT)
    else:
        low, high = clip_masks(ratio_BT, advantages_B.reshape(-1, 1), epsilon_low, epsilon_high)
    low, high = low & valid_BT, high & valid_BT
    return ClipDiagnostics(is_low_clipped_BT=low, is_high_clipped_BT=high, is_region_clipped_BT=low | high)
