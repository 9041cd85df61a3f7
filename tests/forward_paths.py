"""The logits a forward path gives, for the tests that compare the paths with the plain pass."""

from grpo_lab.accel import SpeedPaths
from grpo_lab.core.policy_forward import completion_logits


def path_logits(sharing, model, prompt_ids_BP, prompt_mask_BP, completion_ids_BT, completion_mask_BT, *,
                enabled: bool = True, compact: bool = False):
    """``grpo_lab.core.policy_forward.completion_logits`` with the ``PrefixSharing`` ``sharing``: ``(logits_BTV,
    None)``, the values of ``full_logits``, or with ``compact``, where ``compact_forward`` supports the
    model, ``compact_logits``' ``(logits_NV, slots_N)``. ``enabled=False`` always runs the plain pass."""
    return completion_logits(
        model, prompt_ids_BP, prompt_mask_BP, completion_ids_BT, completion_mask_BT,
        speed_paths=SpeedPaths(prefix_sharing=sharing), share_prompt_prefix=enabled, compact_forward=compact,
    )[:2]
