"""The GRPO mathematics as pure torch functions: no I/O, no processes, no ``.item()``.

Tensor names end in their shape: B completions, T completion positions, V vocabulary, F reward
functions, G completions per group.
"""

from grpo_lab.ops.advantages import AdvantageStats, compute_advantages, nanstd
from grpo_lab.ops.importance import IS_MODES, importance_sampling_stats, vllm_importance_weights
from grpo_lab.ops.logprobs import entropy_from_logits, selective_log_softmax
from grpo_lab.ops.masks import completion_mask_from_ids, entropy_mask, truncation_mask
from grpo_lab.ops.policy import (
    CLIP_LOSSES,
    ClipDiagnostics,
    PolicyLossOutput,
    adapt_entropy_coef,
    aggregate_loss,
    applied_entropy_coef,
    clip_diagnostics,
    entropy_bonus,
    k3_kl,
    log_importance_weights,
    off_policy_mask,
    per_token_objective,
    policy_loss,
    vespo_weights,
)

__all__ = [
    "AdvantageStats", "CLIP_LOSSES", "ClipDiagnostics", "IS_MODES", "PolicyLossOutput", "adapt_entropy_coef",
    "aggregate_loss", "applied_entropy_coef", "clip_diagnostics", "completion_mask_from_ids", "compute_advantages",
    "entropy_bonus", "entropy_from_logits", "entropy_mask", "importance_sampling_stats", "k3_kl",
    "log_importance_weights", "nanstd", "off_policy_mask", "per_token_objective", "policy_loss",
    "selective_log_softmax", "truncation_mask", "vespo_weights", "vllm_importance_weights",
]
