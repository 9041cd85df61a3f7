"""A key/value cache layer for generation that writes each step into room allocated once.

transformers' ``DynamicLayer`` concatenates every new token's keys and values onto the cache, so
each decoding step copies the whole cache: O(L^2) copying over a completion of L tokens. On a CPU
that copy took a third of a decoding step of the benchmarks' 30M-parameter model and half of one of
the shipped tiny model (benchmarks/README.md). ``BufferedLayer`` holds buffers with room for the
prompt and the whole completion, writes each step's keys and values into them in place, and hands
attention a view of the filled part: the same values, without the copies.

Shapes: B rows, H key/value heads, L cached positions, D head size.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer


class BufferedLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values are views of (B, H, room, D) buffers.

    ``room`` starts at ``capacity`` and doubles past the need when a step would overflow it. Anything
    that replaces ``keys`` from outside (``batch_select_indices``, ``crop``, ``reorder_cache``)
    leaves a tensor that is not the handed-out view; the next update copies it into fresh buffers.
    For generation only (no autograd through the in-place writes).
    """

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self._keys_buffer: torch.Tensor | None = None
        self._values_buffer: torch.Tensor | None = None
        self._keys_view: torch.Tensor | None = None

    def update(self, key_states, value_states, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        length = self.get_seq_length()
        end = length + key_states.shape[-2]
        if self._keys_buffer is None or self.keys is not self._keys_view or end > self._keys_buffer.shape[-2]:
            self._move_to_buffers(key_states, value_states, room=self.capacity if end <= self.capacity else 2 * end)
        self._keys_buffer[..., length:end, :] = key_states
        self._values_buffer[..., length:end, :] = value_states
        self.keys = self._keys_view = self._keys_buffer[..., :end, :]
        self.values = self._values_buffer[..., :end, :]
        return self.keys, self.values

    def _move_to_buffers(self, key_states: torch.Tensor, value_states: torch.Tensor, room: int) -> None:
        length = self.get_seq_length()
        keys = key_states.new_empty((*key_states.shape[:-2], room, key_states.shape[-1]))
        values = value_states.new_empty((*value_states.shape[:-2], room, value_states.shape[-1]))
        if length:
            keys[..., :length, :] = self.keys
            values[..., :length, :] = self.values
        self._keys_buffer, self._values_buffer = keys, values
        self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True


def buffer_cache(cache, capacity: int):
    """Turn ``cache``'s plain ``DynamicLayer`` layers into ``BufferedLayer`` layers of room
    ``capacity`` (positions), keeping what they hold; other layer kinds are left as they are.
    Returns the same cache object."""
    for index, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            buffered = BufferedLayer(capacity)
            buffered.__dict__.update(vars(layer))  # what it holds: keys, values, dtype, device
            cache.layers[index] = buffered
    return cache
