"""The forward pass of Llama, Qwen2 and Qwen3 models through their own modules, without
transformers' general machinery around them.

A transformers forward call wraps the model's arithmetic in keyword handling, mask building, cache
objects, output recording and output classes. For a small model on a CPU that wrapping costs about
as much as the arithmetic (benchmarks/README.md). Two short functions run the same modules
(embedding, norms, projections, MLPs, rotary embedding, head):

- ``forward``, for generation (``grpo_lab.accel.decoding``): keys and values are kept in one pair
  of (B, K, S, D) buffers per layer that each call writes in place. In a decoding step on a CPU,
  the products of weights of ``WEIGHT_FIRST_MIN_BYTES`` or more are taken weight-first
  (``_linear``), which MKL runs faster for a few rows.
- ``shared_prompt_forward``, for the log-prob passes with a shared prompt
  (``grpo_lab.accel.prefix_sharing``): the distinct prompts and the completion tokens in one pass, with
  only the completion positions whose logits are used going through the projections, MLPs and
  head: the padding after a completion's end, which transformers' forward (and TRL) computes and
  discards, appears only as masked positions inside attention.

Their logits and gradients equal transformers' up to float rounding (tests compare them on the
shipped float32 model on a CPU, and on a model with weights taken weight-first; ``forward``'s
logits bitwise where no product is, as on the shipped model). Because the modules themselves
run, a PEFT model's LoRA layers apply their adapters.

``unsupported_reason`` names what keeps a model on transformers' forward: another architecture (a
subclass included), sliding-window layers, forward hooks on the model or its layers, weights that
are sharded, quantized or dispatched over devices, prompt-learning adapters, or a wrapper such as
DistributedDataParallel (whose own forward must run).

Shapes: B rows, L positions in one call, S positions the buffers hold (or a prompt and its
completion), U distinct prompts of P positions, N completion positions run, M = U x P + N packed
rows, H query heads, K key/value heads, D head size, E hidden size, V vocabulary entries.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, repeat_kv
from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP, Qwen2RMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm


ARCHITECTURES = (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)
"""Model classes whose forward pass ``forward`` reproduces (Qwen2 adds projection biases, which the
modules carry; Qwen3 adds per-head query and key norms). Subclasses are not included: they may
change the forward pass."""


def transformers_model(model):
    """The transformers model that runs: a PEFT model's base model (whose layers apply the adapters),
    None for prompt-learning adapters (which add virtual tokens)."""
    peft_config = getattr(model, "active_peft_config", None)
    if peft_config is not None:
        return None if peft_config.is_prompt_learning else model.get_base_model()
    return model


def unsupported_reason(model) -> str | None:
    """Why ``forward`` cannot stand in for ``model``'s own forward pass, or None when it can."""
    base = transformers_model(model)
    if base is None:
        return "prompt-learning adapters (prefix or prompt tuning) add virtual tokens"
    if getattr(base, "hf_quantizer", None) is not None:
        return "the model's weights are quantized"
    parameters = list(base.parameters())  # before the class: FSDP 2 swaps the model's class for a subclass
    if any(type(p.data) is not torch.Tensor or p.numel() == 0 for p in parameters):
        return "the model's parameters are sharded (FSDP or DeepSpeed ZeRO-3)"
    if type(base) not in ARCHITECTURES:
        names = ", ".join(architecture.__name__ for architecture in ARCHITECTURES)
        return f"{type(base).__module__}.{type(base).__name__} is not one of transformers' {names}"
    inner = base.model
    if len(inner.layers) != base.config.num_hidden_layers:
        return f"the model has {len(inner.layers)} layers, its config num_hidden_layers={base.config.num_hidden_layers}"
    containers = {"the model": base, "model": inner}
    for index, layer in enumerate(inner.layers):
        containers[f"model.layers.{index}"], containers[f"model.layers.{index}.self_attn"] = layer, layer.self_attn
    hooked = [name for name, module in containers.items() if module._forward_hooks or module._forward_pre_hooks]
    if hooked:
        return f"forward hooks on {hooked[0]} would not run (only its submodules are called)"
    if any(kind != "full_attention" for kind in getattr(base.config, "layer_types", None) or []):
        return "the model has sliding-window attention layers"
    devices = {p.device for p in parameters}
    if len(devices) > 1 or any(device.type == "meta" for device in devices) or len(
        set((getattr(base, "hf_device_map", None) or {}).values())
    ) > 1:
        return "the model is dispatched over several devices or offloaded (device_map)"
    return None


_RMS_NORMS = (LlamaRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm)


def _norm(module, hidden):
    """``module(hidden)``: for transformers' RMSNorm classes on float32 tensors and weights, by one
    ``F.rms_norm`` call (the same arithmetic, the same bits on a CPU). In half precision the module
    runs: it rounds before multiplying by the weight, ``F.rms_norm`` after."""
    if type(module) in _RMS_NORMS and hidden.dtype == module.weight.dtype == torch.float32 and not _hooked(module):
        return F.rms_norm(hidden, module.weight.shape, module.weight, module.variance_epsilon)
    return module(hidden)


def _hooked(module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


WEIGHT_FIRST_MIN_BYTES = 1 << 20
"""The smallest weight ``_linear`` takes weight-first. A weight of a MiB or more is read from memory
at every decoding step, and MKL's float32 product of a few rows with it is faster as ``W @ x^T``.
A smaller weight stays in cache, where the transposed view costs more than it saves, so taking
every product weight-first slows the shipped model's generation (figures in benchmarks/README.md,
from ``benchmarks/bench_weight_first.py``)."""


def _linear(module, hidden, *, weight_first: bool):
    """``module(hidden)``. With ``weight_first``, for a plain ``nn.Linear`` without bias or hooks whose
    float32 weight holds at least ``WEIGHT_FIRST_MIN_BYTES``, the product is taken as ``(W @ hidden^T)^T`` (a
    transposed view): the same values up to float rounding."""
    weight = module.weight if type(module) is nn.Linear else None
    if (weight_first and weight is not None and weight.dtype == torch.float32 and module.bias is None
            and not _hooked(module) and weight.numel() * 4 >= WEIGHT_FIRST_MIN_BYTES):
        rows_RE = hidden.reshape(-1, hidden.shape[-1])
        return torch.mm(weight, rows_RE.T).T.reshape(*hidden.shape[:-1], -1)
    return module(hidden)


_MLPS = (LlamaMLP, Qwen2MLP, Qwen3MLP)


def _mlp(module, hidden, *, weight_first: bool):
    """``module(hidden)``: for transformers' gated MLP classes, their ``down(act(gate(x)) * up(x))``
    with each projection taken by ``_linear``."""
    if weight_first and type(module) in _MLPS and not _hooked(module):
        gate, up, down = module.gate_proj, module.up_proj, module.down_proj
        return _linear(down, module.act_fn(_linear(gate, hidden, weight_first=True)) * _linear(
            up, hidden, weight_first=True), weight_first=True)
    return module(hidden)


def _rotary(inner, hidden, positions, *, heads_dim: int):
    """The rotary embedding's cosines and signed sines at ``positions`` (transformers' rotary
    module), with a heads dimension inserted at ``heads_dim`` for ``_rotate``."""
    cos, sin = inner.rotary_emb(hidden, positions)
    half = sin.shape[-1] // 2
    return cos.unsqueeze(heads_dim), torch.cat([-sin[..., :half], sin[..., half:]], dim=-1).unsqueeze(heads_dim)


def _rotate(x, cos, signed_sin):
    """transformers' rotary embedding ``x * cos + rotate_half(x) * sin``, where
    ``rotate_half(x) = [-x2, x1]``: with the sign moved onto the sines, ``[x2, x1]`` is a roll (the
    same products, so the same bits)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def _attention(
    attention, hidden_BLE, cos, sin, mask_B1LS, cache: list, index: int, start: int, size: int, *, weight_first: bool
):
    """One attention block. The L new positions' keys and values are written from ``start`` into the
    layer's (B, K, S, D) buffers ``cache[index]`` (allocated with room for ``size`` positions on
    first use); each position attends to the buffers up to its own, as ``mask_B1LS`` allows."""
    B, L, _ = hidden_BLE.shape
    shape = (B, L, -1, attention.head_dim)
    query, key, value = (
        _linear(projection, hidden_BLE, weight_first=weight_first).view(shape)
        for projection in (attention.q_proj, attention.k_proj, attention.v_proj)
    )
    if hasattr(attention, "q_norm"):  # Qwen3: RMSNorm over each head before the rotation
        query, key = _norm(attention.q_norm, query), _norm(attention.k_norm, key)
    query, key = _rotate(query.transpose(1, 2), cos, sin), _rotate(key.transpose(1, 2), cos, sin)
    if weight_first:
        # A weight-first product leaves the head size strided; the fused CPU attention kernel needs
        # it contiguous, or attention falls back to the math kernel, which also rescales every key.
        query = query.contiguous()
    value = value.transpose(1, 2)
    if cache[index] is None:
        cache[index] = tuple(t.new_empty(B, t.shape[1], size, attention.head_dim) for t in (key, value))
    keys, values = cache[index]
    end = start + L
    keys[:, :, start:end], values[:, :, start:end] = key, value
    # With a mask, transformers repeats shared key/value heads rather than asking attention for
    # grouped queries (which on CUDA falls back to the slowest kernel when a mask is given).
    groups = query.shape[1] // keys.shape[1]
    out = F.scaled_dot_product_attention(
        query, repeat_kv(keys[:, :, :end], groups), repeat_kv(values[:, :, :end], groups), attn_mask=mask_B1LS,
        scale=attention.scaling,
    )
    return _linear(attention.o_proj, out.transpose(1, 2).reshape(B, L, -1), weight_first=weight_first)


def attention_mask(valid_BS: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """(B, 1, L, end) boolean mask for positions ``start:end``: each sees the valid positions up to
    its own. A position that would see none (left padding) sees itself, so that attention over it
    stays finite; its output is never used."""
    key_positions_S = torch.arange(end, device=valid_BS.device)
    query_positions_L1 = torch.arange(start, end, device=valid_BS.device).unsqueeze(1)
    allowed_B1LS = valid_BS[:, None, None, :end] & (key_positions_S <= query_positions_L1)
    alone_B1L1 = ~allowed_B1LS.any(dim=-1, keepdim=True)
    return allowed_B1LS | (alone_B1L1 & (key_positions_S == query_positions_L1))


def forward(model, ids_BL, positions_BL, valid_BS, cache: list, start: int, *, last_only: bool = False) -> torch.Tensor:
    """Logits of ``model`` (B, L, V; (B, V) for the last position with ``last_only``) for tokens
    ``ids_BL`` at positions ``start:start + L`` of the rows, continuing what ``cache`` holds.

    Args:
        model: a model for which ``unsupported_reason`` is None.
        positions_BL: rotary positions of the new tokens (left padding skipped).
        valid_BS: which of the S positions hold a token (False for padding); S is the room of the
            buffers, and what earlier calls wrote stays valid.
        cache: one (keys, values) pair of (B, K, S, D) buffers per layer; from ``new_cache`` (None in
            every entry) the first call allocates them. Calls extend it in place.
    """
    base = transformers_model(model)
    inner = base.model
    hidden_BLE = inner.embed_tokens(ids_BL)
    cos, sin = _rotary(inner, hidden_BLE, positions_BL, heads_dim=1)
    mask_B1LS = attention_mask(valid_BS, start, start + ids_BL.shape[1])
    # A decoding step on a CPU: one position per row, products of a few rows (_linear)
    weight_first = ids_BL.shape[1] == 1 and ids_BL.device.type == "cpu"
    for index, layer in enumerate(inner.layers):  # as many as num_hidden_layers (unsupported_reason)
        hidden_BLE = hidden_BLE + _attention(
            layer.self_attn, _norm(layer.input_layernorm, hidden_BLE), cos, sin, mask_B1LS, cache, index, start,
            valid_BS.shape[1], weight_first=weight_first,
        )
        normed_BLE = _norm(layer.post_attention_layernorm, hidden_BLE)
        hidden_BLE = hidden_BLE + _mlp(layer.mlp, normed_BLE, weight_first=weight_first)
    last = _norm(inner.norm, hidden_BLE[:, -1] if last_only else hidden_BLE)
    return _linear(base.lm_head, last, weight_first=weight_first)


def shared_prompt_forward(
    model, prompt_ids_UP, prompt_positions_UP, prompt_valid_UP, ids_BL, positions_BL, run_BL, inverse_B
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the U distinct prompts' last positions and of the completion positions ``run_BL``
    keeps, in one pass: row b continues prompt ``inverse_B[b]`` with tokens ``ids_BL``.

    Only the kept completion positions are run (padding after a completion's end is skipped): the
    prompt rows (U x P, as they are) and the N kept completion tokens form one (U x P + N, E) matrix
    for the norms, projections and MLPs; attention alone lays them out as (U, P) and (B, L) rows.

    Returns:
        last_UV: (U, V) logits at each prompt's last position.
        logits_NV: (N, V) logits at the kept positions, in the row-major order of ``run_BL``.
    """
    base = transformers_model(model)
    inner = base.model
    U, P = prompt_ids_UP.shape
    B, L = ids_BL.shape
    slots_N = run_BL.flatten().nonzero().squeeze(1)
    ids_M = torch.cat([prompt_ids_UP.flatten(), ids_BL.flatten().index_select(0, slots_N)])
    positions_M = torch.cat([prompt_positions_UP.flatten(), positions_BL.flatten().index_select(0, slots_N)])
    hidden_ME = inner.embed_tokens(ids_M)
    cos, sin = (t[0] for t in _rotary(inner, hidden_ME, positions_M[None], heads_dim=2))
    layout = _Layout(U, P, B, L, slots_N, inverse_B, attention_mask(prompt_valid_UP, 0, P),
                     attention_mask(torch.cat([prompt_valid_UP.index_select(0, inverse_B), run_BL], dim=1), P, P + L))
    for layer in inner.layers:  # as many as num_hidden_layers (unsupported_reason)
        normed_ME = _norm(layer.input_layernorm, hidden_ME)
        hidden_ME = hidden_ME + _packed_attention(layer.self_attn, normed_ME, cos, sin, layout)
        hidden_ME = hidden_ME + layer.mlp(_norm(layer.post_attention_layernorm, hidden_ME))
    prompt_hidden, completion_hidden = hidden_ME.split([U * P, len(slots_N)])
    logits = base.lm_head(_norm(inner.norm, torch.cat([prompt_hidden.view(U, P, -1)[:, -1], completion_hidden])))
    return logits.split([U, len(slots_N)])


class _Layout(NamedTuple):
    """Where ``shared_prompt_forward``'s packed rows sit in attention's (U, P) and (B, L) layouts."""

    U: int
    P: int
    B: int
    L: int
    slots_N: torch.Tensor  # flat (B x L) index of each kept completion position
    inverse_B: torch.Tensor
    prompt_mask_U1PP: torch.Tensor
    completion_mask_B1LS: torch.Tensor  # S = P + L


def _packed_attention(attention, hidden_ME, cos, sin, layout: _Layout):
    """One attention block over ``shared_prompt_forward``'s packed rows: the prompts attend within
    themselves, each completion to its prompt's keys and values and its own. (Rows are separated
    with ``split``, whose backward joins the gradients, rather than slices, whose backward fills a
    zero tensor per slice.)"""
    U, P, B, L = layout.U, layout.P, layout.B, layout.L
    M, D = hidden_ME.shape[0], attention.head_dim
    query, key = attention.q_proj(hidden_ME).view(M, -1, D), attention.k_proj(hidden_ME).view(M, -1, D)
    if hasattr(attention, "q_norm"):
        query, key = _norm(attention.q_norm, query), _norm(attention.k_norm, key)
    query, key = _rotate(query, cos, sin), _rotate(key, cos, sin)
    value = attention.v_proj(hidden_ME).view(M, -1, D)
    prompts, completions = [], []
    for packed in (query, key, value):  # (M, heads, D) -> (U, heads, P, D) and (B, heads, L, D)
        prompt, completion = packed.split([U * P, M - U * P])
        prompts.append(prompt.view(U, P, -1, D).transpose(1, 2))
        completions.append(
            packed.new_zeros(B * L, packed.shape[1], D).index_copy(0, layout.slots_N, completion)
            .view(B, L, -1, D).transpose(1, 2)
        )
    groups = query.shape[1] // key.shape[1]
    prompt_out = F.scaled_dot_product_attention(
        prompts[0], repeat_kv(prompts[1], groups), repeat_kv(prompts[2], groups),
        attn_mask=layout.prompt_mask_U1PP, scale=attention.scaling,
    )
    keys, values = (
        torch.cat([prompt.index_select(0, layout.inverse_B), completion], dim=2)
        for prompt, completion in zip(prompts[1:], completions[1:])
    )
    completion_out = F.scaled_dot_product_attention(
        completions[0], repeat_kv(keys, groups), repeat_kv(values, groups),
        attn_mask=layout.completion_mask_B1LS, scale=attention.scaling,
    )
    out = torch.cat([
        prompt_out.transpose(1, 2).reshape(U * P, -1),
        completion_out.transpose(1, 2).reshape(B * L, -1).index_select(0, layout.slots_N),
    ])
    return attention.o_proj(out)


def new_cache(model) -> list:
    """An empty cache for ``forward``: one entry per layer, filled by the first call."""
    return [None] * len(transformers_model(model).model.layers)


def select_rows(cache: list, index_B: torch.Tensor) -> list:
    """The cache with every buffer indexed to the rows ``index_B`` (copies, differentiable)."""
    return [tuple(buffer.index_select(0, index_B) for buffer in pair) for pair in cache]
