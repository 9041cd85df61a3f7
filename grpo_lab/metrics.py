"""Step metrics under TRL's names, reduced over processes.

Generation metrics describe the generation batch (all processes): ``reward``, ``reward_std`` (the
batch's sample standard deviation), ``rewards/<fn>/mean|std`` (None rewards excluded),
``frac_reward_zero_std``, ``completions/{mean,min,max}_length``, ``completions/clipped_ratio``
(share truncated), ``completions/{mean,min,max}_terminated_length`` and ``num_tokens`` (prompt and
completion tokens seen so far). Loss metrics describe one optimizer step: ``loss``, ``entropy``,
``kl`` (when beta > 0) and the clip ratios ``clip_ratio/{low_mean,low_min,high_mean,high_max,
region_mean}``: the means over tokens, the min and max over sequences (each sequence's share of
clipped tokens) of every process, as TRL does. With vLLM, the importance-sampling
stats ``sampling/importance_sampling_ratio/{min,mean,max}`` and
``sampling/sampling_logp_difference/{mean,max}`` join the generation metrics.
"""

from __future__ import annotations

import torch

from grpo_lab import dist
from grpo_lab.ops import batch_std


def generation_metrics(accelerator, scores, rewards_BF, stats, *, num_tokens: int, epoch: float) -> dict[str, float]:
    rollout = scores.rollout
    lengths = dist.gather(accelerator, rollout.completion_lengths_B.to(accelerator.device)).float().cpu()
    truncated = dist.gather(accelerator, rollout.is_truncated_B.to(accelerator.device)).bool().cpu()
    terminated = lengths[~truncated]
    metrics = {
        "num_tokens": float(num_tokens),
        "completions/mean_length": float(lengths.mean()),
        "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": float(truncated.float().mean()),
        "completions/mean_terminated_length": float(terminated.mean()) if len(terminated) else 0.0,
        "completions/min_terminated_length": float(terminated.min()) if len(terminated) else 0.0,
        "completions/max_terminated_length": float(terminated.max()) if len(terminated) else 0.0,
    }
    for i, name in enumerate(scores.reward_names):
        column = rewards_BF[:, i]
        present = column[~torch.isnan(column)]
        metrics[f"rewards/{name}/mean"] = float(present.mean()) if len(present) else float("nan")
        metrics[f"rewards/{name}/std"] = float(present.std()) if len(present) > 1 else 0.0
    metrics["reward"] = float(torch.nanmean(stats.rewards_B))
    metrics["reward_std"] = float(batch_std(stats.rewards_B))  # over the whole batch, as TRL 1.16 logs it
    metrics["frac_reward_zero_std"] = float(stats.is_std_zero_B.float().mean())
    metrics["epoch"] = float(epoch)
    for name, values in scores.metrics.items():
        metrics[name] = float(torch.tensor(values).mean())
    return metrics


def _sequence_means(values_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """(B,) each sequence's mean over its counted tokens; NaN for a sequence with none."""
    return (values_BT * mask_BT).sum(dim=1) / mask_BT.sum(dim=1)


def _nan_extreme(values: torch.Tensor, extreme) -> float:
    """``extreme`` (torch.min or torch.max) of the values that are numbers; NaN when none is."""
    numbers = values[~torch.isnan(values)]
    return float(extreme(numbers)) if len(numbers) else float("nan")


def loss_metrics(accelerator, clip, entropies_BT, kl_BT, mask_BT, loss: float) -> dict[str, float]:
    """A step's loss metrics, reduced as TRL 1.16 reduces them: ``loss`` the mean over processes;
    ``entropy``, ``kl`` and the clip ratios' means over every process's counted tokens (a token-
    weighted mean); ``clip_ratio/low_min`` and ``high_max`` over every process's sequences."""
    device = accelerator.device
    mask_BT = mask_BT.float()

    def over_tokens(values_BT: torch.Tensor) -> float:
        local = torch.stack([(values_BT.float() * mask_BT).sum(), mask_BT.sum()]).to(device)
        totals = dist.gather(accelerator, local.reshape(1, 2)).sum(dim=0)
        return float(totals[0] / totals[1].clamp(min=1.0))

    low_per_sequence = dist.gather(accelerator, _sequence_means(clip.is_low_clipped_BT.float(), mask_BT).to(device))
    high_per_sequence = dist.gather(accelerator, _sequence_means(clip.is_high_clipped_BT.float(), mask_BT).to(device))
    metrics = {
        "loss": float(dist.mean(accelerator, torch.tensor(loss, device=device))),
        "entropy": over_tokens(entropies_BT),
        "clip_ratio/low_mean": over_tokens(clip.is_low_clipped_BT),
        "clip_ratio/low_min": _nan_extreme(low_per_sequence.cpu(), torch.min),
        "clip_ratio/high_mean": over_tokens(clip.is_high_clipped_BT),
        "clip_ratio/high_max": _nan_extreme(high_per_sequence.cpu(), torch.max),
        "clip_ratio/region_mean": over_tokens(clip.is_region_clipped_BT),
    }
    if kl_BT is not None:
        metrics["kl"] = over_tokens(kl_BT)
    return metrics


def sampling_metrics(accelerator, stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """The vLLM importance-sampling stats over processes: min of mins, max of maxes, mean of means."""
    metrics = {}
    for name, value in stats.items():
        values = dist.gather(accelerator, value.reshape(1).float().to(accelerator.device)).cpu()
        reduce = torch.min if name.endswith("/min") else torch.max if name.endswith("/max") else torch.mean
        metrics[name] = float(reduce(values))
    return metrics


def tool_metrics(accelerator, columns: dict[str, list]) -> dict[str, float]:
    """TRL's tool-loop metrics, where a rollout counted tool calls (the ``tool_calls`` and
    ``tool_failures`` columns, one count per completion): calls per completion, and failed calls per
    call (0 without calls), over every process."""
    if "tool_calls" not in columns:
        return {}
    failures = columns.get("tool_failures", [0] * len(columns["tool_calls"]))
    counts_B2 = torch.tensor([columns["tool_calls"], failures], dtype=torch.float32).T
    counts_B2 = dist.gather(accelerator, counts_B2.to(accelerator.device)).cpu()
    calls, failed = counts_B2.sum(0).tolist()
    return {"tools/call_frequency": calls / len(counts_B2), "tools/failure_frequency": failed / calls if calls else 0.0}
