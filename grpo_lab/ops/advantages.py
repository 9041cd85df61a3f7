"""Group-relative advantages (GRPO, arXiv:2402.03300, section 4.1.2).

Departure from TRL: where every reward being normalized is the same (a group's, or one function's
within a group), the advantages are exactly 0. The float mean of equal values can be off from them
by a rounding step, which dividing by ``std + 1e-4`` turns into an advantage of about 1e-3 in TRL.

Shapes: B completions, laid out as consecutive groups of G = num_generations completions of the
same prompt; F reward functions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

STD_EPSILON = 1e-4
"""Added to the standard deviation before dividing, as TRL does, so that a small spread does not
blow up (a group with no spread at all gets 0, see the module docstring)."""


@dataclass
class AdvantageStats:
    """Advantages with the statistics they came from, one value per completion (B,)."""

    advantages_B: torch.Tensor
    rewards_B: torch.Tensor
    mean_grouped_B: torch.Tensor
    std_B: torch.Tensor
    is_std_zero_B: torch.Tensor


def nanstd(values: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Sample standard deviation (Bessel-corrected) ignoring NaN entries."""
    if dim is None:
        values = values[~torch.isnan(values)]
        return values.std() if values.numel() > 1 else torch.zeros((), dtype=values.dtype)
    count = (~torch.isnan(values)).sum(dim=dim, keepdim=True)
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    squares = torch.nansum((values - mean) ** 2, dim=dim, keepdim=True)
    std = torch.sqrt(squares / (count - 1).clamp(min=1))
    return std if keepdim else std.squeeze(dim)


def _tied(values: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """Whether all non-NaN ``values`` along ``dim`` are equal (True where none is a number)."""
    nan = torch.isnan(values)
    highest = values.masked_fill(nan, -torch.inf).amax(dim=dim, keepdim=keepdim)
    lowest = values.masked_fill(nan, torch.inf).amin(dim=dim, keepdim=keepdim)
    return (highest == lowest) | (highest < lowest)


def compute_advantages(
    rewards_BF: torch.Tensor,
    *,
    num_generations: int,
    reward_weights_F: torch.Tensor | None = None,
    scale_rewards: str | bool = "group",
    multi_objective_aggregation: str = "sum_then_normalize",
) -> AdvantageStats:
    """Advantages from per-function rewards. NaN marks a reward that does not apply (a function
    returned None) and is left out of that function's sums and statistics.

    ``"sum_then_normalize"`` (TRL's default):
        r_i = sum_f w_f r_if (NaN terms skipped);  A_i = (r_i - mean_g(r)) / (s + 1e-4)
        where s is the group std ("group"), the batch std ("batch"), or no division ("none").
    ``"normalize_then_sum"`` (GDPO):
        z_if = (r_if - nanmean_g(r_f)) / (nanstd_g(r_f) + 1e-4);  r_i = sum_f w_f z_if;
        A_i = (r_i - mean(r)) / (std(r) + 1e-4)   (batch statistics; scale_rewards is not used).

    Standard deviations are sample (Bessel-corrected) ones, as ``torch.std``. Where the values
    being normalized are all equal (a group's r, one function's r_f within a group, GDPO's batch),
    their deviations are 0 exactly, not the rounding error of their float mean.

    A completion no function scored (every r_if NaN) has r_i = NaN: it is left out of every mean
    and standard deviation and its advantage is 0, as in TRL 1.16. ``rewards_B`` is always the
    weighted sum r_i = sum_f w_f r_if (NaN for those completions), under either aggregation.

    Args:
        rewards_BF: (B, F) rewards, B a multiple of num_generations.
        reward_weights_F: (F,) weights; None means all 1.
        scale_rewards: "group", "batch", "none" (True = "group", False = "none").
    """
    if scale_rewards is True:
        scale_rewards = "group"
    elif scale_rewards is False:
        scale_rewards = "none"
    num_completions, num_funcs = rewards_BF.shape
    if num_completions % num_generations:
        raise ValueError(f"{num_completions} completions do not split into groups of {num_generations}.")
    rewards_BF = rewards_BF.float()
    weights_F = torch.ones(num_funcs) if reward_weights_F is None else reward_weights_F.float()
    weights_F = weights_F.to(rewards_BF.device)
    if multi_objective_aggregation == "sum_then_normalize":
        return _sum_then_normalize(rewards_BF, weights_F, num_generations, scale_rewards)
    if multi_objective_aggregation == "normalize_then_sum":
        return _normalize_then_sum(rewards_BF, weights_F, num_generations)
    raise ValueError(
        "multi_objective_aggregation must be 'sum_then_normalize' or 'normalize_then_sum', "
        f"got {multi_objective_aggregation!r}."
    )


def groups_with_signal(values_B: torch.Tensor, num_generations: int) -> torch.Tensor:
    """(N,) True for each group of ``num_generations`` consecutive values that are not all equal
    (NaN entries left out; a group with fewer than two numbers has no signal).

    DAPO's dynamic sampling keeps a group only when 0 < |{o_i : o_i correct}| < G (arXiv:2503.14476,
    eq. 11): a group whose rewards are all equal has advantages of exactly 0 and teaches nothing.
    Here "all equal" is the test :func:`compute_advantages` zeroes a group's advantages by, so that
    a kept group is one whose advantages are not all 0 (before ``scale_rewards="batch"``).

    Args:
        values_B: (B,) one reward per completion, B a multiple of num_generations.
    """
    if values_B.shape[0] % num_generations:
        raise ValueError(f"{values_B.shape[0]} completions do not split into groups of {num_generations}.")
    return ~_tied(values_B.float().view(-1, num_generations), dim=1)


def _mean_and_std(values: torch.Tensor, dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and sample std along ``dim`` (all of ``values`` when None) leaving NaN out; with no NaN,
    exactly ``torch.mean`` and ``torch.std`` (their summation order, so results stay bit for bit)."""
    if not torch.isnan(values).any():
        if dim is None:
            return values.mean(), values.std() if values.numel() > 1 else torch.zeros((), dtype=values.dtype)
        if values.shape[dim] < 2:  # one value (an eval with num_generations_eval=1): no spread
            return values.mean(dim=dim), torch.zeros_like(values.mean(dim=dim))
        return values.mean(dim=dim), values.std(dim=dim)
    return torch.nanmean(values, dim=dim), nanstd(values, dim=dim)


def batch_std(values: torch.Tensor) -> torch.Tensor:
    """The sample std of all of ``values``, NaN left out; NaN for fewer than two numbers (as TRL's
    ``nanstd`` gives it)."""
    return _mean_and_std(values)[1] if (~torch.isnan(values)).sum() > 1 else torch.full((), float("nan"))


def _unscorable(rewards_BF: torch.Tensor) -> torch.Tensor:
    """(B,) True for a completion every reward function returned None for (all NaN): it has no
    reward, stays out of every mean and standard deviation, and gets advantage 0 (TRL's rule)."""
    return torch.isnan(rewards_BF).all(dim=1)


def _weighted_sum(rewards_BF: torch.Tensor, weights_F: torch.Tensor, unscorable_B: torch.Tensor) -> torch.Tensor:
    """sum_f w_f r_if with None (NaN) terms skipped; NaN where no function scored the completion."""
    return torch.nansum(rewards_BF * weights_F, dim=1).masked_fill(unscorable_B, float("nan"))


def _sum_then_normalize(
    rewards_BF: torch.Tensor, weights_F: torch.Tensor, num_generations: int, scale_rewards: str
) -> AdvantageStats:
    """TRL's default: the weighted sum of each completion's rewards, normalized within its group
    (``scale_rewards``: by the group's std, the batch's, or not at all). Means and standard
    deviations leave unscorable completions out."""
    G = num_generations
    unscorable_B = _unscorable(rewards_BF)
    rewards_B = _weighted_sum(rewards_BF, weights_F, unscorable_B)
    grouped_NG = rewards_B.view(-1, G)
    group_mean_N, group_std_N = _mean_and_std(grouped_NG, dim=1)
    mean_grouped_B = group_mean_N.repeat_interleave(G)
    tied_B = _tied(grouped_NG, dim=1).repeat_interleave(G)
    if scale_rewards in ("group", "none"):
        std_B = group_std_N.repeat_interleave(G)
    elif scale_rewards == "batch":
        std_B = _mean_and_std(rewards_B)[1].expand_as(rewards_B)
    else:
        raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none', got {scale_rewards!r}.")
    advantages_B = (rewards_B - mean_grouped_B).masked_fill(tied_B, 0.0)
    if scale_rewards != "none":
        advantages_B = advantages_B / (std_B + STD_EPSILON)
    is_std_zero_B = torch.isclose(std_B, torch.zeros_like(std_B))
    if scale_rewards != "batch":
        is_std_zero_B |= tied_B  # a rounding step's spread is no spread
    return AdvantageStats(torch.nan_to_num(advantages_B, nan=0.0), rewards_B, mean_grouped_B, std_B, is_std_zero_B)


def _normalize_then_sum(rewards_BF: torch.Tensor, weights_F: torch.Tensor, num_generations: int) -> AdvantageStats:
    """GDPO: each function's rewards normalized within the group, weighted and summed, then the sums
    normalized over the batch. ``rewards_B`` holds the plain weighted sums (what ``reward`` logs);
    ``mean_grouped_B`` and ``std_B`` the batch statistics of the normalized sums."""
    num_funcs, G = rewards_BF.shape[1], num_generations
    unscorable_B = _unscorable(rewards_BF)
    grouped_NGF = rewards_BF.view(-1, G, num_funcs)
    mean_N1F = torch.nanmean(grouped_NGF, dim=1, keepdim=True)
    std_N1F = nanstd(grouped_NGF, dim=1, keepdim=True)
    deviations_NGF = (grouped_NGF - mean_N1F).masked_fill(_tied(grouped_NGF, dim=1, keepdim=True), 0.0)
    normalized_BF = (deviations_NGF / (std_N1F + STD_EPSILON)).view(-1, num_funcs)
    sums_B = _weighted_sum(normalized_BF, weights_F, unscorable_B)
    mean, std = _mean_and_std(sums_B)
    mean_grouped_B, std_B = mean.expand_as(sums_B), std.expand_as(sums_B)
    advantages_B = (sums_B - mean_grouped_B).masked_fill(_tied(sums_B, dim=0), 0.0) / (std_B + STD_EPSILON)
    is_std_zero_B = torch.isclose(std_B, torch.zeros_like(std_B))
    return AdvantageStats(torch.nan_to_num(advantages_B, nan=0.0), _weighted_sum(rewards_BF, weights_F, unscorable_B),
                          mean_grouped_B, std_B, is_std_zero_B)
