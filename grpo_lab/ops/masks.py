"""Token masks: which completion tokens count in the loss.

Shapes: B completions, T completion positions.
"""

from __future__ import annotations

import torch


def completion_mask_from_ids(ids_BT: torch.Tensor, *, eos_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask of the tokens up to and including the first EOS, and whether a completion has no EOS.

    ``mask[b, t] = 1 if t <= first_eos(b) else 0``; a completion without EOS keeps all T tokens and
    is flagged truncated (it hit the length limit).

    Returns:
        (mask_BT long, is_truncated_B bool)
    """
    is_eos_BT = ids_BT == eos_token_id
    has_eos_B = is_eos_BT.any(dim=1)
    first_eos_B = torch.where(has_eos_B, is_eos_BT.int().argmax(dim=1),
                              torch.full_like(has_eos_B, ids_BT.shape[1], dtype=torch.long))
    positions_BT = torch.arange(ids_BT.shape[1], device=ids_BT.device).expand_as(ids_BT)
    mask_BT = (positions_BT <= first_eos_B.unsqueeze(1)).long()
    return mask_BT, ~has_eos_B


def truncation_mask(mask_BT: torch.Tensor, is_truncated_B: torch.Tensor) -> torch.Tensor:
    """``mask`` with truncated completions removed (DAPO's overlong filtering):
    ``mask'[b, t] = mask[b, t] * (1 - truncated[b])``."""
    return mask_BT * (~is_truncated_B.bool()).unsqueeze(1).to(mask_BT.dtype)


def entropy_mask(entropies_BT: torch.Tensor, mask_BT: torch.Tensor, *, quantile: float,
                 pool: torch.Tensor | None = None) -> torch.Tensor:
    """Keep the top-``quantile`` fraction of tokens by entropy ("Beyond the 80/20 Rule",
    arXiv:2506.01939): ``keep = H >= Q_{1-rho}(H over masked tokens)``.

    The threshold is the (1 - rho) quantile (linear interpolation, as ``torch.quantile``) of the
    entropies of the tokens in ``mask_BT``, or of ``pool``: the masked entropies of every process,
    which gives every process TRL's one threshold. rho = 1 keeps every token, rho = 0 only the
    largest entropy. Padding is never kept.

    Args:
        entropies_BT: (B, T) entropies. mask_BT: (B, T) 0/1 mask. quantile: rho in [0, 1]. pool: (N,) or None.
    Returns:
        (B, T) float mask.
    """
    return quantile_mask(entropies_BT, mask_BT, level=1.0 - quantile, pool=pool).float()


def quantile_mask(values_BT: torch.Tensor, mask_BT: torch.Tensor, *, level: float,
                  pool: torch.Tensor | None = None) -> torch.Tensor:
    """``keep = mask & (v >= Q_level(pool))``: the tokens in ``mask_BT`` whose value is at least the
    ``level`` quantile (linear interpolation, as ``torch.quantile``) of ``pool``, by default the
    values of the tokens in ``mask_BT`` (a pool gathered over processes gives one threshold to all).
    No token is kept when the pool is empty.

    Args:
        values_BT: (B, T). mask_BT: (B, T) 0/1 mask. level: in [0, 1]. pool: (N,) or None.
    Returns:
        (B, T) bool mask.
    """
    valid_BT = mask_BT.bool()
    pool = values_BT[valid_BT].float() if pool is None else pool.float()
    if pool.numel() == 0:
        return torch.zeros_like(valid_BT)
    return (values_BT >= torch.quantile(pool, level)) & valid_BT
