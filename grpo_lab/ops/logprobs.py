"""Per-token log-probabilities and entropies from logits.

Shapes: B sequences, T positions, V vocabulary entries.
"""

from __future__ import annotations

import torch


CHUNK_ELEMENTS = 2**24
"""Logits handled at once by the functions below (64 MiB in float32): as many whole sequences as
fit, or as many positions of one sequence as fit when a sequence alone is larger."""


def _over_chunks(fn, max_elements: int, logits_BTV: torch.Tensor, *aligned_BT: torch.Tensor) -> torch.Tensor:
    """(B, T) values of ``fn(logits_CV, *aligned_C)`` computed over chunks of at most ``max_elements``
    logits (at least one position), in order; ``aligned_BT`` are split the same way."""
    B, T, V = logits_BTV.shape
    if T * V <= max_elements or B == 0:
        size = max(1, max_elements // max(T * V, 1))
        return torch.cat([fn(*parts) for parts in zip(logits_BTV.split(size), *(a.split(size) for a in aligned_BT))])
    size = max(1, max_elements // V)
    rows = []
    for b in range(B):
        pieces = zip(logits_BTV[b].split(size), *(a[b].split(size) for a in aligned_BT))
        rows.append(torch.cat([fn(*parts) for parts in pieces]))
    return torch.stack(rows)


def selective_log_softmax(logits_BTV: torch.Tensor, index_BT: torch.Tensor,
                          max_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """log softmax(logits)[index] at every position, without a full log-softmax copy of the logits.

    ``log p(x_t) = z_t[x_t] - logsumexp(z_t)``. The logsumexp (for float32/float64 logits) or, for
    half precision (where logsumexp loses accuracy), a log-softmax is taken over chunks of at most
    ``max_elements`` logits, so the extra memory is bounded by the chunk rather than O(B x T x V).

    Args:
        logits_BTV: (B, T, V) logits.
        index_BT: (B, T) token ids to read.
    Returns:
        (B, T) log-probabilities, in the dtype of the logits.
    """
    if logits_BTV.dtype in (torch.float32, torch.float64):
        picked_BT = torch.gather(logits_BTV, -1, index_BT.unsqueeze(-1)).squeeze(-1)
        return picked_BT - _over_chunks(lambda z: torch.logsumexp(z, dim=-1), max_elements, logits_BTV)

    def picked(z, index):
        return torch.gather(torch.log_softmax(z, dim=-1), -1, index.unsqueeze(-1)).squeeze(-1)

    return _over_chunks(picked, max_elements, logits_BTV, index_BT)


def entropy_from_logits(logits_BTV: torch.Tensor, max_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """Entropy of the next-token distribution at every position: ``H = -sum_v p_v log p_v``.

    Computed in float32, over chunks of at most ``max_elements`` logits.

    Args:
        logits_BTV: (B, T, V) logits.
    Returns:
        (B, T) entropies in nats, float32.
    """

    def entropy(z):
        logp = torch.log_softmax(z.float(), dim=-1)
        return -(logp.exp() * logp).sum(-1)

    return _over_chunks(entropy, max_elements, logits_BTV)
