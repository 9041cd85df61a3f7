"""Step metrics under TRL's names, reduced over processes.

Generation metrics describe the generation batch (all processes): ``reward``, ``reward_std`` (the
batch's sample standard deviation), ``rewards/<fn>/mean|std`` (None rewards excluded),
``frac_reward_zero_std``, ``completions/{mean,min,max}_length``, ``completions/clipped_ratio``
(share truncated), ``completions/{mean,min,max}_terminated_length`` and ``num_tokens`` (prompt and
completion tokens seen so far). Loss metrics describe one optimizer step: ``loss``, and the
metrics TRL's ``_compute_loss`` appends per micro-batch (:func:`micro_batch_metrics`: ``entropy``,
``kl``, the clip ratios of the loss type, ``policy_loss``), averaged over the step's micro-batches
as TRL's ``log`` averages them. With vLLM, the importance-sampling stats
``sampling/importance_sampling_ratio/{min,mean,max}`` and ``sampling/sampling_logp_difference/
{mean,max}`` join the generation metrics.
"""

from __future__ import annotations

import math

import torch

from grpo_lab.parallel import dist
from grpo_lab.ops import batch_std
from grpo_lab.ops.losses import CLIP_MASKS


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
        metrics[f"rewards/{name}/std"] = float(batch_std(column))
    metrics["reward"] = float(torch.nanmean(stats.rewards_B))
    metrics["reward_std"] = float(batch_std(stats.rewards_B))  # over the whole batch, as TRL 1.16 logs it
    metrics["frac_reward_zero_std"] = float(stats.is_std_zero_B.float().mean())
    metrics["epoch"] = float(epoch)
    for name, values in scores.metrics.items():
        metrics[name] = float(torch.tensor(values).mean())
    return metrics


def _flag_means(values: torch.Tensor, mask_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum and count that TRL's global mean of a (B, T) or (B, 1) statistic adds up: over the
    counted tokens of a (B, T) one; over every sequence of a (B, 1) one (sequence-level ratios)."""
    if values.shape[-1] == 1:
        return values.float().sum(), torch.tensor(float(values.shape[0]), device=values.device)
    return (values.float() * mask_BT).sum(), mask_BT.sum()


def _per_sequence(values: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """(B,) each sequence's share: its value itself when (B, 1); else the mean over its counted
    tokens, NaN for a sequence with none."""
    if values.shape[-1] == 1:
        return values.float().squeeze(-1)
    return (values.float() * mask_BT).sum(dim=1) / mask_BT.sum(dim=1)


def _nan_extreme(values: torch.Tensor, extreme) -> float:
    """``extreme`` (torch.min or torch.max) of the values that are numbers; NaN when none is."""
    numbers = values[~torch.isnan(values)]
    return float(extreme(numbers)) if len(numbers) else float("nan")


def micro_batch_metrics(accelerator, settings, out, advantages_B, mask_BT, entropies_BT, *,
                        with_policy_loss: bool = False) -> dict[str, float]:
    """One micro-batch's loss metrics, as TRL 1.16's ``_compute_loss`` appends them, each reduced
    over processes:

    - ``entropy``, ``kl`` (beta > 0): sums over every process's counted tokens over their count;
    - by the loss type's clipping: the clipped surrogate logs ``clip_ratio/{low,high,region}_mean``
      (the same kind of mean of the clipped flags; with a (B, 1) sequence-level ratio, over every
      process's sequences) and ``clip_ratio/low_min`` / ``high_max`` (min / max over every
      process's sequences of each one's clipped share, NaN shares left out); cispo's cap logs
      ``cispo_clip_ratio``; sapo and vespo no clip ratio;
    - ``<objective>/phi_seq_mean`` for an objective with a sequence weight (``vespo/phi_seq_mean``):
      the weight's mean over every process's sequences;
    - ``policy_loss`` (``with_policy_loss``, when an entropy bonus is on): the micro-batch's loss
      before the bonus and before gradient accumulation's division, the mean over processes.

    ``out``: the micro-batch's :class:`~grpo_lab.ops.PolicyLossOutput`; shapes: advantages (B,),
    mask and entropies (B, T).
    """
    device = accelerator.device
    mask_BT = mask_BT.float()
    ratio = out.ratio_BT.detach()
    means = {"entropy": _flag_means(entropies_BT.detach(), mask_BT)}
    if out.kl_BT is not None:
        means["kl"] = _flag_means(out.kl_BT.detach(), mask_BT)
    clip_masks = CLIP_MASKS.get(settings.spec.clipping)
    extremes = None
    if clip_masks is not None:
        low, high = clip_masks(ratio, advantages_B.reshape(-1, 1).to(ratio.device), settings.epsilon_low,
                               settings.epsilon_high)
        if settings.spec.clipping == "cap":
            means["cispo_clip_ratio"] = _flag_means(high, mask_BT)
        else:
            for name, flags in (("low", low), ("high", high), ("region", low | high)):
                means[f"clip_ratio/{name}_mean"] = _flag_means(flags, mask_BT)
            extremes = torch.stack([_per_sequence(low, mask_BT), _per_sequence(high, mask_BT)], dim=1)
    if out.sequence_weight_B1 is not None:
        means[f"{settings.spec.objective}/phi_seq_mean"] = _flag_means(out.sequence_weight_B1.detach(), mask_BT)
    if with_policy_loss:
        value = out.policy_loss.detach().float()
        means["policy_loss"] = (torch.nan_to_num(value), (~torch.isnan(value)).float())
    local = torch.stack([torch.stack([s.reshape(()).float(), c.reshape(()).float()]) for s, c in means.values()])
    totals = dist.gather(accelerator, local.to(device).unsqueeze(0)).sum(dim=0)
    metrics = {name: float(totals[i, 0] / totals[i, 1].clamp(min=1.0)) for i, name in enumerate(means)}
    if "policy_loss" in metrics and totals[-1, 1] == 0:
        metrics["policy_loss"] = float("nan")
    if extremes is not None:
        every = dist.gather(accelerator, extremes.to(device)).cpu()
        metrics["clip_ratio/low_min"] = _nan_extreme(every[:, 0], torch.min)
        metrics["clip_ratio/high_max"] = _nan_extreme(every[:, 1], torch.max)
    return metrics


def average_micro_batches(rows: list[dict[str, float]]) -> dict[str, float]:
    """Each metric's mean over the micro-batches that logged a number for it (NaN left out; NaN when
    none did), as TRL's ``log`` averages what its micro-batches appended."""
    averaged = {}
    for name in rows[0]:
        numbers = [row[name] for row in rows if not math.isnan(row[name])]
        averaged[name] = sum(numbers) / len(numbers) if numbers else float("nan")
    return averaged


def loss_metrics(accelerator, rows: list[dict[str, float]], loss: float) -> dict[str, float]:
    """A step's loss metrics: ``loss``, its micro-batches' summed loss, the mean over processes; the
    others :func:`micro_batch_metrics` of each micro-batch, averaged over them."""
    loss_value = float(dist.mean(accelerator, torch.tensor(loss, device=accelerator.device)))
    return {"loss": loss_value} | average_micro_batches(rows)


def sampling_metrics(accelerator, stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """The vLLM importance-sampling stats over processes, as TRL reduces them: the min of the mins
    and max of the maxes (NaN left out), the mean of the ratio means (NaN left out) and of the
    log-prob gap means."""
    metrics = {}
    for name, value in stats.items():
        values = dist.gather(accelerator, value.reshape(1).float().to(accelerator.device)).cpu()
        if name.endswith("/min"):
            metrics[name] = _nan_extreme(values, torch.min)
        elif name.endswith("/max"):
            metrics[name] = _nan_extreme(values, torch.max)
        else:
            metrics[name] = float(values.nanmean() if "importance_sampling_ratio" in name else values.mean())
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


def async_generation_metrics(accelerator, rollout, global_step: int) -> dict[str, float]:
    """With ``async_generation``: the batch's staleness (optimizer steps between the weights that
    generated it and those it trains at ``global_step``), the trainer's wait for it and the
    generator's idle time, the times as the slowest process measured them; {} without."""
    if rollout.async_timing is None:
        return {}
    times = torch.tensor([rollout.async_timing["async_generation/trainer_wait"],
                          rollout.async_timing["async_generation/generator_idle"]], device=accelerator.device)
    wait, idle = dist.gather(accelerator, times[None]).amax(0).tolist()
    return {"async_generation/staleness": float(global_step - rollout.policy_version),
            "async_generation/trainer_wait": wait, "async_generation/generator_idle": idle}
