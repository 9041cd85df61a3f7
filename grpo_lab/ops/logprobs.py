"""Per-token log-probabilities and entropies from logits.

Shapes: B sequences, T positions, V vocabulary entries.
"""

from __future__ import annotations

import torch


CHUNK_ELEMENTS = 2**24
"""Logits handled at once by the functions below (64 MiB in float32): whole sequences at a time,
as many as fit, so that small batches take one call and large vocabularies one sequence a call."""


def _sequence_chunks(logits_BTV: torch.Tensor, max_elements: int) -> int:
    """How many sequences go in one chunk of at most ``max_elements`` logits (at least one)."""
    per_sequence = logits_BTV.shape[1] * logits_BTV.shape[2]
    return max(1, max_elements // max(per_sequence, 1))


def selective_log_softmax(logits_BTV: torch.Tensor, index_BT: torch.Tensor, max_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """log softmax(logits)[index] at every position, without a full log-softmax copy of the logits.

    ``log p(x_t) = z_t[x_t] - logsumexp(z_t)``. For float32/float64 logits the logsumexp is taken
    over chunks of whole sequences of at most ``max_elements`` logits, so the extra memory is
    bounded by the chunk rather than O(B x T x V); for half precision (where logsumexp loses
    accuracy) a log-softmax of each chunk is taken instead.

    Args:
        logits_BTV: (B, T, V) logits.
        index_BT: (B, T) token ids to read.
    Returns:
        (B, T) log-probabilities, in the dtype of the logits.
    """
    size = _sequence_chunks(logits_BTV, max_elements)
    if logits_BTV.dtype in (torch.float32, torch.float64):
        picked_BT = torch.gather(logits_BTV, -1, index_BT.unsqueeze(-1)).squeeze(-1)
        normalizer_BT = torch.cat([torch.logsumexp(chunk_CTV, dim=-1) for chunk_CTV in logits_BTV.split(size)])
        return picked_BT - normalizer_BT
    chunks = []
    for chunk_CTV, index_CT in zip(logits_BTV.split(size), index_BT.split(size)):
        logp_CTV = torch.log_softmax(chunk_CTV, dim=-1)
        chunks.append(torch.gather(logp_CTV, -1, index_CT.unsqueeze(-1)).squeeze(-1))
    return torch.cat(chunks)


def entropy_from_logits(logits_BTV: torch.Tensor, max_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """Entropy of the next-token distribution at every position: ``H = -sum_v p_v log p_v``.

    Computed in float32, over chunks of whole sequences of at most ``max_elements`` logits.

    Args:
        logits_BTV: (B, T, V) logits.
    Returns:
        (B, T) entropies in nats, float32.
    """
    parts = []
    for chunk_CTV in logits_BTV.split(_sequence_chunks(logits_BTV, max_elements)):
        logp_CTV = torch.log_softmax(chunk_CTV.float(), dim=-1)
        parts.append(-(logp_CTV.exp() * logp_CTV).sum(-1))
    return torch.cat(parts)
