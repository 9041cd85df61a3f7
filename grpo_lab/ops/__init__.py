"""The GRPO mathematics as pure torch functions: no I/O, no processes, no ``.item()``.

Tensor names end in their shape: B completions, T completion positions, V vocabulary, F reward
functions, G completions per group.

Loss types are registered by name: :data:`LOSSES` (in :mod:`grpo_lab.ops.registry`) gives each
``loss_type`` its objective and aggregation (functions in :mod:`grpo_lab.ops.losses`), and
:class:`LossSettings` carries their hyperparameters. Names load on first use, as in ``grpo_lab``:
the registry imports no torch, so the config reads it without loading torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "advantages": ("AdvantageStats", "batch_std", "compute_advantages", "groups_with_signal", "nanstd"),
    "importance": ("IS_MODES", "importance_sampling_stats", "vllm_importance_weights"),
    "logprobs": ("entropy_from_logits", "selective_log_softmax"),
    "masks": ("completion_mask_from_ids", "entropy_mask", "quantile_mask", "truncation_mask"),
    "registry": ("CLIP_LOSSES", "GLOBAL_NORMALIZER_LOSSES", "LOSSES", "LOSS_TYPES", "LossSettings", "LossSpec"),
    "losses": ("LOSS_AGGREGATIONS", "OBJECTIVES", "register_aggregation", "register_objective", "vespo_weights"),
    "policy": (
        "ClipDiagnostics", "PolicyLossOutput", "adapt_entropy_coef", "aggregate_loss", "applied_entropy_coef",
        "clip_diagnostics", "entropy_bonus", "k3_kl", "log_importance_weights", "off_policy_mask",
        "per_token_objective", "policy_loss",
    ),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = [*_MODULE_OF]


def __getattr__(name: str):
    if name in _MODULE_OF or name in _EXPORTS:
        module = importlib.import_module(f"{__name__}.{_MODULE_OF.get(name, name)}")
        value = globals()[name] = module if name in _EXPORTS else getattr(module, name)
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *_EXPORTS})
