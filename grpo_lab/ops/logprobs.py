"""Per-token log-probabilities and entropies from logits.

Shapes: B sequences, T positions, V vocabulary entries.
"""

from __future__ import annotations

import torch


def selective_log_softmax(logits_BTV: torch.Tensor, index_BT: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[index] at every position, without a full log-softmax copy of the logits.

    ``log p(x_t) = z_t[x_t] - logsumexp(z_t)``. For float32/float64 logits the logsumexp is taken
    one sequence at a time, so the extra memory is O(T x V) rather than O(B x T x V); for half
    precision (where logsumexp loses accuracy) a per-sequence log-softmax is used instead.

    Args:
        logits_BTV: (B, T, V) logits.
        index_BT: (B, T) token ids to read.
    Returns:
        (B, T) log-probabilities, in the dtype of the logits.
    """
    if logits_BTV.dtype in (torch.float32, torch.float64):
        picked_BT = torch.gather(logits_BTV, -1, index_BT.unsqueeze(-1)).squeeze(-1)
        normalizer_BT = torch.stack([torch.logsumexp(row_TV, dim=-1) for row_TV in logits_BTV])
        return picked_BT - normalizer_BT
    rows = []
    for row_TV, index_T in zip(logits_BTV, index_BT):
        logp_TV = torch.log_softmax(row_TV, dim=-1)
        rows.append(torch.gather(logp_TV, -1, index_T.unsqueeze(-1)).squeeze(-1))
    return torch.stack(rows)


def entropy_from_logits(logits_BTV: torch.Tensor, chunk_size: int = 128) -> torch.Tensor:
    """Entropy of the next-token distribution at every position: ``H = -sum_v p_v log p_v``.

    Computed in float32, ``chunk_size`` positions at a time to bound memory.

    Args:
        logits_BTV: (B, T, V) logits.
    Returns:
        (B, T) entropies in nats, float32.
    """
    flat_NV = logits_BTV.reshape(-1, logits_BTV.shape[-1])
    parts = []
    for chunk_CV in flat_NV.split(chunk_size):
        logp_CV = torch.log_softmax(chunk_CV.float(), dim=-1)
        parts.append(-(logp_CV.exp() * logp_CV).sum(-1))
    if not parts:
        return torch.zeros(logits_BTV.shape[:-1], dtype=torch.float32, device=logits_BTV.device)
    return torch.cat(parts).reshape(logits_BTV.shape[:-1])
