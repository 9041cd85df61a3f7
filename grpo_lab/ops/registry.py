"""Loss types by name: one row per ``loss_type`` in :data:`LOSSES`, and :class:`LossSettings`, the
hyperparameters every loss reads, built once from the config.

A row names its per-token objective and its aggregation; the functions live in
:mod:`grpo_lab.ops.losses`, registered under those names. As in verl, the objective and the
aggregation are kept apart: grpo, bnpo, dr_grpo, dapo and luspo share the clipped surrogate and
differ only in how they reduce it. This module imports no torch, so that ``GRPOConfig`` checks a
loss type's settings against its row without loading torch.

Adding a loss type is one function in :mod:`grpo_lab.ops.losses` (decorated with
``@register_objective("name")``) and one row here. A loss with a hyperparameter of its own also adds
that field to :class:`LossSettings` and to ``GRPOConfig``, under the same name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

CLIPPINGS: dict[str, tuple[str, ...]] = {
    "surrogate": ("epsilon_high", "delta"),
    "cap": ("epsilon_high",),
    "none": (),
}
"""How a loss bounds the importance ratio r, with the settings that bound reads:

- ``surrogate``: PPO's ``clip(r, 1 - epsilon_low, 1 + epsilon_high)``, the unclipped ratio capped at
  delta when delta is set; the clip ratios count tokens on either side;
- ``cap``: ``min(r, epsilon_high)``, epsilon_high an absolute cap, so the config requires it >= 1;
- ``none``: no hard bound (a soft gate or a sequence weight); the clip ratios stay 0.
"""

STEP_TOKEN_MEAN = "step_token_mean"
"""The aggregation that divides by the tokens of the whole optimizer step (counted over processes
and micro-batches), not of one micro-batch."""


@dataclass(frozen=True)
class LossSpec:
    """What one loss type computes (by function name) and which settings it reads."""

    objective: str
    """Its per-token objective: a key of ``ops.losses.OBJECTIVES``."""
    aggregation: str
    """Its reduction of per-token losses to a scalar: a key of ``ops.losses.LOSS_AGGREGATIONS``."""
    clipping: str = "surrogate"
    """How it bounds the ratio: a key of :data:`CLIPPINGS`."""
    instead_of_clipping: str = ""
    """What it does instead of the clipped surrogate, for the config error that names a setting it
    would ignore ("loss_type='sapo' replaces clipping with a soft gate ..., so delta=4.0 would be
    ignored")."""

    @property
    def normalizes_globally(self) -> bool:
        """Whether it divides by the optimizer step's tokens: the engine then adds up micro-batch
        losses instead of averaging them, and the entropy bonus is weighted the same way."""
        return self.aggregation == STEP_TOKEN_MEAN

    @property
    def reads(self) -> tuple[str, ...]:
        """The clipping settings it reads (of epsilon_high and delta); the config refuses the others."""
        return CLIPPINGS[self.clipping]


LOSSES: dict[str, LossSpec] = {
    "grpo": LossSpec("clipped_surrogate", "sequence_mean"),
    "bnpo": LossSpec("clipped_surrogate", "token_mean"),
    "dr_grpo": LossSpec("clipped_surrogate", "max_length"),
    "dapo": LossSpec("clipped_surrogate", STEP_TOKEN_MEAN),
    "cispo": LossSpec("cispo", STEP_TOKEN_MEAN, clipping="cap",
                      instead_of_clipping="caps the ratio at epsilon_high only"),
    "sapo": LossSpec("sapo", "sequence_mean", clipping="none",
                     instead_of_clipping="replaces clipping with a soft gate (shaped by sapo_temperature_pos and "
                     "sapo_temperature_neg)"),
    "luspo": LossSpec("clipped_surrogate", "sequence_sum"),
    "vespo": LossSpec("vespo", STEP_TOKEN_MEAN, clipping="none",
                      instead_of_clipping="weights sequences with a gamma kernel (shaped by vespo_k_* and "
                      "vespo_lambda_*)"),
}
"""Every loss type by name. ``GRPOConfig.loss_type``'s docstring says what each one is for."""

LOSS_TYPES: tuple[str, ...] = tuple(LOSSES)
"""The names ``loss_type`` accepts."""

CLIP_LOSSES: tuple[str, ...] = tuple(name for name, spec in LOSSES.items() if spec.clipping == "surrogate")
"""Loss types with PPO's clipped surrogate ``-min(r A, clip(r, 1-eps_low, 1+eps_high) A)``."""

GLOBAL_NORMALIZER_LOSSES: frozenset[str] = frozenset(name for name, spec in LOSSES.items() if spec.normalizes_globally)
"""Loss types that divide by the tokens of the whole optimizer step (dapo and the losses built like it)."""


def loss_spec(loss_type: str) -> LossSpec:
    """The row of ``loss_type``; a ValueError for a name :data:`LOSSES` lacks."""
    if loss_type not in LOSSES:
        raise ValueError(f"Unknown loss_type {loss_type!r}.")
    return LOSSES[loss_type]


def default_epsilon_high(epsilon_low: float, epsilon_high: float | None) -> float:
    """``epsilon_high``, or ``epsilon_low`` where it is None: the upper clipping range (cispo's cap)
    of every loss type, as in TRL."""
    return epsilon_low if epsilon_high is None else epsilon_high


@dataclass(frozen=True)
class LossSettings:
    """The hyperparameters of the policy loss, in one object: :func:`~grpo_lab.ops.policy_loss` and
    the functions of a loss type read them from here. The engine builds it once per optimizer step
    with :meth:`from_config`, so that a config edited between steps reaches the next one."""

    loss_type: str = "dapo"
    """A key of :data:`LOSSES`."""
    epsilon_low: float = 0.2
    """The ratio is clipped below at 1 - epsilon_low (``GRPOConfig.epsilon``)."""
    epsilon_high: float | None = None
    """Upper clipping range (1 + epsilon_high), or cispo's absolute cap; None becomes epsilon_low
    (:func:`default_epsilon_high`), so that after construction it is always a number."""
    delta: float | None = None
    """INTELLECT-2's cap on the unclipped ratio (clipped-surrogate losses); None for none."""
    importance_sampling_level: str = "token"
    """``"token"``: a ratio per token (B, T); ``"sequence"``: one per completion (B, 1), GSPO."""
    sapo_temperature_pos: float = 1.0
    """SAPO gate temperature where A > 0."""
    sapo_temperature_neg: float = 1.05
    """SAPO gate temperature where A <= 0."""
    vespo_k_pos: float = 2.0
    """VESPO gamma-kernel shape k where A >= 0."""
    vespo_lambda_pos: float = 3.0
    """VESPO gamma-kernel rate lambda where A >= 0."""
    vespo_k_neg: float = 3.0
    """VESPO gamma-kernel shape k where A < 0."""
    vespo_lambda_neg: float = 2.0
    """VESPO gamma-kernel rate lambda where A < 0."""
    beta: float = 0.0
    """Weight of the k3 KL penalty to the reference policy; 0 for none."""
    use_bias_correction_kl: bool = False
    """Multiply the KL estimate by the importance ratio (DeepSeek-V3.2)."""
    max_completion_length: int | None = None
    """The constant of dr_grpo's normalizer ``B x max_completion_length``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "epsilon_high", default_epsilon_high(self.epsilon_low, self.epsilon_high))

    @property
    def spec(self) -> LossSpec:
        """The row of this loss type (a ValueError for an unknown one)."""
        return loss_spec(self.loss_type)

    @classmethod
    def from_config(cls, config) -> LossSettings:
        """The settings of a ``GRPOConfig``: each field from the config field of the same name, but
        ``epsilon_low``, which is the config's ``epsilon``."""
        names = [field.name for field in dataclasses.fields(cls) if field.name != "epsilon_low"]
        return cls(epsilon_low=config.epsilon, **{name: getattr(config, name) for name in names})
