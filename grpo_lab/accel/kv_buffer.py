"""A key/value cache layer for generation that writes each step in place instead of concatenating.

transformers' ``DynamicLayer`` concatenates every new token's keys and values onto the cache, so
each decoding step copies the whole cache: O(L^2) copying over a completion of L tokens, a
sizeable share of generation on a CPU (benchmarks/README.md). ``BufferedLayer`` writes each
step's keys and values into buffers with room to spare and hands attention a view of the filled
part: the same values, without the copies. The room grows a block of positions at a time, so a
long ``max_completion_length`` that completions rarely reach reserves no memory up front.

Shapes: B rows, H key/value heads, L cached positions, D head size.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer


GROWTH_BLOCK = 256
"""Positions of room added at a time, at most: one copy of the cache per block of decoding steps,
and never more than a block of unused room."""


class BufferedLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values are views of (B, H, room, D) buffers.

    Each allocation leaves room for ``block`` positions beyond what is needed; a step that would
    overflow it moves the contents to new buffers with room for another ``block``. Anything that
    replaces ``keys`` from outside (``batch_select_indices``, ``crop``, ``reorder_cache``,
    ``offload``) leaves a tensor that is not the handed-out view; the next update copies it into
    fresh buffers. For generation only (no autograd through the in-place writes).
    """

    def __init__(self, block: int):
        super().__init__()
        if block < 1:
            raise ValueError(f"block must be at least 1 position, got {block}.")
        self.block = block
        self._drop_buffers()

    def update(self, key_states, value_states, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        length = self.get_seq_length()
        end = length + key_states.shape[-2]
        if self._keys_buffer is None or self.keys is not self._keys_view or end > self._keys_buffer.shape[-2]:
            self._move_to_buffers(key_states, value_states, room=end + self.block)
        self._keys_buffer[..., length:end, :] = key_states
        self._values_buffer[..., length:end, :] = value_states
        self.keys = self._keys_view = self._keys_buffer[..., :end, :]
        self.values = self._values_buffer[..., :end, :]
        return self.keys, self.values

    def reset(self) -> None:
        self._drop_buffers()
        super().reset()

    def offload(self) -> None:
        self._drop_buffers()  # so that moving the keys and values away frees the device memory
        super().offload()

    def _drop_buffers(self) -> None:
        self._keys_buffer: torch.Tensor | None = None
        self._values_buffer: torch.Tensor | None = None
        self._keys_view: torch.Tensor | None = None

    def _move_to_buffers(self, key_states: torch.Tensor, value_states: torch.Tensor, room: int) -> None:
        length = self.get_seq_length()
        keys = key_states.new_empty((*key_states.shape[:-2], room, key_states.shape[-1]))
        values = value_states.new_empty((*value_states.shape[:-2], room, value_states.shape[-1]))
        if length:
            keys[..., :length, :] = self.keys
            values[..., :length, :] = self.values
        self._keys_buffer, self._values_buffer = keys, values
        self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True


def buffer_cache(cache, new_tokens: int):
    """Turn ``cache``'s plain ``DynamicLayer`` layers into ``BufferedLayer`` layers that grow by
    ``min(new_tokens, GROWTH_BLOCK)`` positions at a time (``new_tokens``: how many the caller will
    add at most), keeping what they hold; other layer kinds are left as they are. Returns the same
    cache object."""
    block = max(1, min(new_tokens, GROWTH_BLOCK))
    for index, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            buffered = BufferedLayer(block)
            buffered.__dict__.update(vars(layer))  # what it holds: keys, values, dtype, device
            cache.layers[index] = buffered
    return cache
