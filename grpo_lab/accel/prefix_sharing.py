"""The logits that score each completion token, with a group's shared prompt run once.

The G completions of a GRPO group share their prompt, yet a plain forward pass over
``[prompt, completion]`` rows runs that prompt G times. With prefix sharing the prompt rows are
run once per distinct prompt, their keys and values are indexed out to every completion of the
group, and only the completion tokens are run on top of them: ``U x P + B x (T - 1)`` tokens
instead of ``B x (P + T)`` (U distinct prompts, B completions; the last token predicts nothing).
The gradient is the same: indexing the keys/values is differentiable, and the backward pass sums
each completion's contribution into the shared prompt activations. Generation with transformers
does the same for the prompt's pre-fill: ``prompt_cache`` runs each distinct prompt once and hands
the indexed cache to ``model.generate``. For the models ``compact_forward`` supports
(``compact_logits``), a log-prob pass is one call of ``compact_forward.shared_prompt_forward``
instead of two of transformers' forward: the distinct prompts and only the completion positions
whose next token is kept (the padding after each completion's end does not go through the
projections, MLPs and head), with the same logits up to float rounding.

It applies where a model's key/value cache is a plain per-layer concatenation (transformers'
``DynamicCache`` with full-attention layers), its rotary embedding does not depend on the length of
each call (not "dynamic" or "longrope" scaling) and, in training mode, the model neither checkpoints
activations (transformers drops the cache there) nor draws anything random (the copies of a
prompt would share one dropout or router-jitter draw). Anywhere else the plain pass runs
(``grpo_lab.core.policy_forward.pick_path`` decides); a cache that cannot be shared is named in a warning
and in ``PrefixSharing.disabled_reason``. Without
gradients a checkpointing model is not switched to eval mode to share: the old-policy pass must
take the same path as the training pass, so that the first iteration's ratio is exactly 1.

Shapes: B completions, U distinct prompts, P prompt tokens (left padded), T completion tokens
(right padded), V vocabulary entries.
"""

from __future__ import annotations

import torch

from grpo_lab import notices
from grpo_lab.core.model_calls import position_ids, without_router_loss
from grpo_lab.core.models import CACHE, config_settings

__all__ = ["PrefixSharing", "distinct_prompts"]


def distinct_prompts(prompt_ids_BP: torch.Tensor, prompt_mask_BP: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One row per distinct prompt, and for every completion the index of its prompt among them.

    Returns:
        first_U: (U,) the first completion row with each distinct prompt.
        inverse_B: (B,) index into ``first_U`` of each completion's prompt.
    """
    keys_BK = torch.cat([prompt_ids_BP, prompt_mask_BP.to(prompt_ids_BP.dtype)], dim=1)
    _, inverse_B = torch.unique(keys_BK, dim=0, return_inverse=True)
    rows_B = torch.arange(len(inverse_B), device=inverse_B.device)
    first_U = torch.full((int(inverse_B.max()) + 1,), len(inverse_B), device=inverse_B.device)
    return first_U.scatter_reduce(0, inverse_B, rows_B, reduce="amin"), inverse_B


def _plain_cache_reason(cache, prompt_length: int) -> str | None:
    """Why ``cache`` cannot be shared (None when it can): only plain concatenating layers can."""
    try:
        from transformers.cache_utils import DynamicCache, DynamicLayer
    except ImportError:
        return "this transformers version has no per-layer key/value cache"
    if type(cache) is not DynamicCache:
        return f"the model's cache is a {type(cache).__name__}, not a plain DynamicCache"
    kinds = {type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer}
    if kinds:
        return f"the model's cache has {', '.join(sorted(kinds))} layers (sliding-window or recurrent state)"
    if cache.get_seq_length() != prompt_length:
        return "the model did not keep the prompt's keys and values"
    return None


class PrefixSharing:
    """Computes completion logits with each distinct prompt run once; falls back to the plain pass.

    After the first call on a model whose cache cannot be shared, the plain pass is used for that
    model from then on, and ``disabled_reason`` records why.
    """

    def __init__(self):
        self.disabled_reason: dict[int, str] = {}

    def skip_reason(self, model) -> str | None:
        """Why this model's log-prob passes and generation run without sharing, or None."""
        rope = _length_dependent_rope(model)
        if rope is not None:
            return f"{rope} rotary scaling depends on each call's length (a prompt run alone is scaled otherwise)"
        if model.training:
            modules = list(model.modules())
            if any(_checkpoints(module) for module in modules):
                return "gradient checkpointing drops or re-writes the key/value cache in training mode"
            if _random_in_training(modules):
                return "dropout or router jitter in training mode would give a group's copies of the prompt one mask"
        return self.disabled_reason.get(id(model))

    def _prefill(self, model, prompt_ids_UP, prompt_mask_UP, positions_UP):
        """The forward pass over distinct prompts, or None (and the reason kept) if its cache cannot be shared."""
        out = model(
            input_ids=prompt_ids_UP, attention_mask=prompt_mask_UP, position_ids=positions_UP, use_cache=True,
            logits_to_keep=1, **without_router_loss(model),
        )
        reason = _plain_cache_reason(getattr(out, CACHE), prompt_ids_UP.shape[1])
        if reason is not None:
            self.disabled_reason[id(model)] = reason
            notices.warn(f"Prompt prefix sharing is off for this model: {reason}. The plain pass runs.")
            return None
        return out

    def shared_logits(self, model, prompt_ids_BP, prompt_mask_BP, completion_ids_BT, completion_mask_BT):
        """(B, T, V) logits predicting the completion tokens, from two calls of transformers' forward:
        the distinct prompts, then the completion tokens on their keys and values; None (after a
        warning, once per model) where the model's cache cannot be shared. The caller checks
        ``skip_reason`` first."""
        first_U, inverse_B = distinct_prompts(prompt_ids_BP, prompt_mask_BP)
        attention_mask_BL = torch.cat([prompt_mask_BP, completion_mask_BT], dim=1)
        positions_BL = position_ids(attention_mask_BL)
        # Always the same two calls, whatever the batch holds: under DDP, FSDP or ZeRO-3 every process
        # must make as many forward calls as the others (each call may synchronise). The last
        # completion token predicts nothing; it is run only when it is the only one, so that the
        # second call is never empty.
        prompt_length, num_completion_tokens = prompt_ids_BP.shape[1], completion_ids_BT.shape[1]
        end = prompt_length + max(num_completion_tokens - 1, 1)
        prefill = self._prefill(
            model, prompt_ids_BP[first_U], prompt_mask_BP[first_U], positions_BL[first_U, :prompt_length]
        )
        if prefill is None:
            return None
        cache = getattr(prefill, CACHE)
        _select_rows(cache, inverse_B)
        rest_BTV = model(
            input_ids=completion_ids_BT[:, : end - prompt_length], attention_mask=attention_mask_BL[:, :end],
            position_ids=positions_BL[:, prompt_length:end], use_cache=True, **{CACHE: cache},
            **without_router_loss(model),
        ).logits
        return torch.cat([prefill.logits.index_select(0, inverse_B), rest_BTV[:, : num_completion_tokens - 1]], dim=1)

    def compact_logits(self, model, prompt_ids_BP, prompt_mask_BP, completion_ids_BT, completion_mask_BT):
        """``(logits_NV, slots_N)``: the logits of the N completion tokens the mask keeps, from one pass
        of ``compact_forward.shared_prompt_forward`` over the distinct prompts and the positions that
        predict those tokens (the padding after each completion's end does not go through the
        projections, MLPs and head), with ``slots_N`` their flat index into the (B, T) positions.
        Those values are ``full_logits``' up to float rounding. The caller checks ``skip_reason``,
        that ``compact_forward`` supports the model and that the completion mask is right padded
        (every rollout backend makes it so; a mask with a hole takes the two-call pass)."""
        first_U, inverse_B = distinct_prompts(prompt_ids_BP, prompt_mask_BP)
        positions_BL = position_ids(torch.cat([prompt_mask_BP, completion_mask_BT], dim=1))
        rows = (model, prompt_ids_BP, prompt_mask_BP, completion_ids_BT, completion_mask_BT)
        return _packed_logits(*rows, positions_BL, first_U, inverse_B)

    @torch.no_grad()
    def prompt_cache(self, model, prompt_ids_BP: torch.Tensor, prompt_mask_BP: torch.Tensor):
        """A key/value cache of every prompt but its last token, computed once per distinct prompt and
        indexed out to all B rows, for ``model.generate`` to continue; None where
        the cache cannot be shared or the prompts are single tokens."""
        if self.skip_reason(model) is not None or prompt_ids_BP.shape[1] < 2:
            return None
        first_U, inverse_B = distinct_prompts(prompt_ids_BP, prompt_mask_BP)
        ids_UP, mask_UP = prompt_ids_BP[first_U, :-1], prompt_mask_BP[first_U, :-1]
        prefill = self._prefill(model, ids_UP, mask_UP, position_ids(mask_UP))
        if prefill is None:
            return None
        return _select_rows(getattr(prefill, CACHE), inverse_B)


def _packed_logits(
    model, prompt_ids_BP, prompt_mask_BP, completion_ids_BT, completion_mask_BT, positions_BL, first_U, inverse_B
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, V) logits of the kept completion tokens by ``compact_forward.shared_prompt_forward``, and
    their flat (B x T) index: each non-empty row's first token (predicted by its prompt's last
    position), then the tokens predicted by the completion positions run, in row-major order.
    ``completion_mask_BT`` is right padded."""
    from grpo_lab.accel import compact_forward  # on the compact path only: it imports transformers' model classes

    B, T = completion_ids_BT.shape
    P = prompt_ids_BP.shape[1]
    # Position j runs when token j + 1 is kept. One column is kept when T is 1, so that no shape is empty.
    run_BL = completion_mask_BT.new_zeros(B, max(T - 1, 1), dtype=torch.bool)
    run_BL[:, : T - 1] = completion_mask_BT[:, 1:].bool()
    last_UV, logits_NV = compact_forward.shared_prompt_forward(
        model, prompt_ids_BP[first_U], positions_BL[first_U, :P], prompt_mask_BP[first_U].bool(),
        completion_ids_BT[:, : run_BL.shape[1]], positions_BL[:, P : P + run_BL.shape[1]], run_BL, inverse_B,
    )
    non_empty = completion_mask_BT[:, 0].bool().nonzero().squeeze(1)
    starts_B = torch.arange(B, device=completion_ids_BT.device) * T
    run_slots = (starts_B[:, None] + 1 + torch.arange(run_BL.shape[1], device=starts_B.device))[run_BL]
    slots = torch.cat([starts_B.index_select(0, non_empty), run_slots])
    return torch.cat([last_UV.index_select(0, inverse_B.index_select(0, non_empty)), logits_NV]), slots


def _select_rows(cache, index_B: torch.Tensor):
    """Index every layer's keys and values to the rows ``index_B`` (``batch_select_indices`` by
    ``index_select``, whose backward, an index_add, is cheaper on a CPU than the index_put of
    advanced indexing). Returns ``cache``."""
    for layer in cache.layers:
        if layer.keys is not None:  # None: a layer that holds nothing (shared key/values)
            index = index_B.to(layer.keys.device)
            layer.keys, layer.values = layer.keys.index_select(0, index), layer.values.index_select(0, index)
    return cache


def _length_dependent_rope(model) -> str | None:
    """The model's rotary scaling type when it depends on the length a forward call sees ("dynamic"
    NTK, "longrope"): a prompt run alone would get other rotary frequencies than in the whole row."""
    config = getattr(model, "config", None) or getattr(getattr(model, "module", None), "config", None)
    for settings in (getattr(config, "rope_parameters", None), getattr(config, "rope_scaling", None)):
        if isinstance(settings, dict) and settings.get("rope_type", settings.get("type")) in ("dynamic", "longrope"):
            return settings.get("rope_type", settings.get("type"))
    return None


def _checkpoints(module) -> bool:
    """transformers' gradient checkpointing, or torch's checkpoint wrapper (accelerate's FSDP option).
    Read from the instance and class dictionaries: a missing attribute through ``nn.Module.__getattr__``
    raises and catches an exception, and every module is asked at every pass."""
    flag = module.__dict__.get("gradient_checkpointing", getattr(type(module), "gradient_checkpointing", False))
    return bool(flag) or "_checkpoint_wrapped_module" in module._modules


def _random_in_training(modules) -> bool:
    """A dropout layer among ``modules``, or a config of theirs (or one nested in it) that drops out
    inside attention (no module to see) or jitters mixture-of-experts routing in training mode.
    Each distinct config is read once (a model's layers share one)."""
    configs = {}
    for module in modules:
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            return True
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "__dict__"):
            configs[id(config)] = config
    return any(_config_is_random(config) for config in configs.values())


def _config_is_random(config) -> bool:
    return any(
        isinstance(value, float) and value > 0 and name.endswith(("dropout", "pdrop", "jitter_noise", "jitter_eps"))
        for name, value in config_settings(config).items()
    )
