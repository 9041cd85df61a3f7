"""Dynamic sampling (DAPO, arXiv:2503.14476, section 3.2; verl's ``algorithm.filter_groups``): fill a
generation batch with groups whose rewards differ, drawing and scoring further rounds of prompts.

A group whose completions all get the same reward has advantages of exactly 0 and teaches nothing.
With ``GRPOConfig.dynamic_sampling``, ``generate()`` draws a round (a whole generation batch of
prompts, the sampler moving on as for an ordinary batch), scores it with the run's reward functions,
keeps the groups with a signal (:func:`grpo_lab.ops.groups_with_signal` of
``dynamic_sampling_metric``, or the groups a function given there keeps) and drops the others, until
every process holds its batch's number of kept groups or ``dynamic_sampling_max_rounds`` rounds are
drawn. A batch still short then is filled with dropped groups (``dynamic_sampling_fill``). Not with
``environment_factory`` (refused). With ``async_generation`` each round is one prepared batch
(:mod:`grpo_lab.core.generation_ahead`). Kept groups beyond the batch are discarded, as in verl (their
prompts count as drawn).

Each process fills its own share of the batch from its own share of each round's prompts, so that no
completion moves between processes; the rounds are collective (every process draws the same number,
as sharded generation needs), and a process that is full keeps drawing until all are. That is why a
process's generation batch must hold whole groups (checked when the engine is built).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_lab import ops
from grpo_lab.errors import ConfigError
from grpo_lab.parallel import dist
from grpo_lab.rewards.preparation import weights_tensor
from grpo_lab.types import DynamicSampling, Rollout, Scores, prompt_text

def check_dynamic_sampling(config, batching, num_processes: int, reward_names: list[str], environments) -> None:
    """Refuse settings dynamic sampling cannot fill a batch under: a process's generation batch that
    splits a group, a ``dynamic_sampling_metric`` that names no reward function, or
    ``environment_factory`` (whose instances live through one batch's rollout and scoring)."""
    if not config.dynamic_sampling:
        return
    if environments is not None:
        raise ConfigError(
            "dynamic_sampling is not supported with environment_factory yet: an environment instance lives "
            "through one batch's rollout and scoring, and dynamic sampling scores several rounds before the batch "
            "is complete. Turn dynamic_sampling off, or write the environment as a rollout_func."
        )
    local = batching.generation_batch_size // num_processes
    if local % config.num_generations:
        raise ConfigError(
            f"dynamic_sampling fills each process's share of the generation batch with whole groups, but a share "
            f"holds {local} completions, not a multiple of num_generations ({config.num_generations}). Make "
            f"generation_batch_size / num_processes a multiple of {config.num_generations} (e.g. "
            f"per_device_train_batch_size={config.num_generations}), or turn dynamic_sampling off."
        )
    metric = config.dynamic_sampling_metric
    if callable(metric) or metric == "reward" or metric in reward_names:
        return
    stored = ":" in metric and " " not in metric  # the module:name text a save writes for a function
    raise ConfigError(
        f"dynamic_sampling_metric={metric!r} names no reward function of this run ({', '.join(reward_names)}). "
        + ("It reads like a function stored by a save: pass the function itself (dynamic_sampling_metric=f), or "
           "load the save with GRPOSession.load, which imports it." if stored else
           "Give one of those names, 'reward' for the weighted sum the advantages use, or a function that "
           "decides per group.")
    )


@dataclass
class _Round:
    """One generation round of this process: its rollout, scores and the decided-on value per completion."""

    rollout: Rollout
    scores: Scores
    values_B: torch.Tensor
    signal_N: torch.Tensor


def fill_batch(engine, generate_round) -> Rollout:
    """The generation batch of kept groups (this process's share), with its ``dynamic_sampling``
    record; ``generate_round()`` draws and generates one round without the log-prob passes."""
    config, accelerator = engine.config, engine.accelerator
    G = config.num_generations
    needed = engine.batching.generation_batch_size // accelerator.num_processes // G
    check_dynamic_sampling(config, engine.batching, accelerator.num_processes, engine.reward_names,
                           engine.environments)  # settings edited since the engine was built
    rounds, kept, dropped = [], [], []  # kept / dropped: (round, group) pairs in the order drawn
    while True:
        rollout = generate_round()
        scores = engine.score(rollout)
        values_B = decided_values(scores, config)
        signal_N = groups_kept(scores, values_B, config)
        rounds.append(_Round(rollout, scores, values_B, signal_N))
        for group, keep in enumerate(signal_N.tolist()):
            (kept if keep else dropped).append((len(rounds) - 1, group))
        short = torch.tensor(float(len(kept) < needed), device=accelerator.device)
        if float(dist.total(accelerator, short)) == 0 or len(rounds) >= config.dynamic_sampling_max_rounds:
            break
    chosen = kept[:needed]
    filler = dropped[:needed - len(chosen)]
    batch = _assembled(rounds, chosen + filler, G, engine.tokenizer.pad_token_id)
    first_group = dist.local_slice(accelerator, needed * accelerator.num_processes * G).start // G
    batch.group_index_B = torch.arange(needed).repeat_interleave(G) + first_group
    taken = set(chosen + filler)
    batch.dynamic_sampling = _record(engine, rounds, [pair for pair in dropped if pair not in taken], chosen, filler)
    timings = [round_.rollout.async_timing for round_ in rounds if round_.rollout.async_timing is not None]
    if timings:  # async_generation: as stale as its first round, the oldest; the waits over every round
        batch.policy_version = rounds[0].rollout.policy_version
        batch.async_timing = {name: sum(timing[name] for timing in timings) for name in timings[0]}
    return batch


def decided_values(scores: Scores, config) -> torch.Tensor:
    """(B,) the value whose spread keeps a group, and that the dropped groups are shown and sorted by:
    the weighted reward sum the advantages use (``"reward"``, or where a function decides), or one
    reward function's rewards."""
    metric = config.dynamic_sampling_metric
    if not callable(metric) and metric != "reward":
        return scores.rewards_BF[:, scores.reward_names.index(metric)]
    weights = weights_tensor(config.reward_weights, scores.reward_names, 0)
    return ops.compute_advantages(scores.rewards_BF, num_generations=config.num_generations, reward_weights_F=weights,
                                  scale_rewards="none").rewards_B


def groups_kept(scores: Scores, values_B: torch.Tensor, config) -> torch.Tensor:
    """(N,) the groups with a signal: ``values_B`` not all equal in the group; under
    ``multi_objective_aggregation="normalize_then_sum"`` with ``"reward"``, any weighted function's
    rewards not all equal (GDPO normalizes each function within its group, so a tied sum can still
    leave advantages); where ``dynamic_sampling_metric`` is a function, the groups it keeps."""
    G = config.num_generations
    if callable(config.dynamic_sampling_metric):
        return kept_by(config.dynamic_sampling_metric, scores.rewards_BF, values_B, scores.reward_names, G)
    if config.dynamic_sampling_metric != "reward" or config.multi_objective_aggregation != "normalize_then_sum":
        return ops.groups_with_signal(values_B, G)
    weights = weights_tensor(config.reward_weights, scores.reward_names, 0)
    weighted = [f for f in range(len(scores.reward_names)) if weights is None or float(weights[f]) != 0.0]
    return torch.stack([ops.groups_with_signal(scores.rewards_BF[:, f], G) for f in weighted]).any(dim=0)


def kept_by(metric, rewards_BF: torch.Tensor, values_B: torch.Tensor, reward_names: list[str], G: int) -> torch.Tensor:
    """(N,) whether ``metric`` keeps each group of G completions: it is called once per group with
    ``{"reward": (G,) values_B, name: (G,) that function's rewards}`` and returns a truth value (a
    Python bool or a one-element tensor)."""
    kept = []
    for group in range(len(values_B) // G):
        rows = slice(group * G, (group + 1) * G)
        rewards = {"reward": values_B[rows], **{name: rewards_BF[rows, f] for f, name in enumerate(reward_names)}}
        decision = metric(rewards)
        if isinstance(decision, torch.Tensor) and decision.numel() == 1 or type(decision).__module__ == "numpy":
            decision = decision.item()
        if not isinstance(decision, bool | int) or decision not in (0, 1):
            raise TypeError(
                f"dynamic_sampling_metric {getattr(metric, '__name__', metric)!r} returned {decision!r} for a group; "
                "it must return True to keep the group or False to drop it."
            )
        kept.append(bool(decision))
    return torch.tensor(kept, dtype=torch.bool)


def dropped_kind(value: float, highest: float, lowest: float, pass_threshold: float) -> str:
    """Why a group whose completions all have ``value`` was dropped, among the values drawn for the
    batch (every process) from ``lowest`` to ``highest``: "too easy" nearer the highest, "too hard"
    nearer the lowest (or midway); where every value drawn is the same, "too easy" when it reaches
    ``pass_threshold`` (``eval_pass_threshold``), as the doctor's probe decides."""
    if highest == lowest:
        return "too easy" if value >= pass_threshold else "too hard"
    return "too easy" if value - lowest > highest - value else "too hard"


def _assembled(rounds: list[_Round], pairs: list[tuple[int, int]], G: int, pad_token_id: int) -> Rollout:
    """One rollout of the groups ``pairs`` from the rounds, in the order given, each tensor padded to
    the widest round (prompts on the left, completions on the right)."""
    parts = [(rounds[r].rollout, [group * G + i for i in range(G)]) for r, group in pairs]
    width_P = max(rollout.prompt_ids_BP.shape[1] for rollout, _ in parts)
    width_T = max(rollout.completion_ids_BT.shape[1] for rollout, _ in parts)

    def stacked(name: str, width: int, value, left: bool):
        pieces = []
        for rollout, rows in parts:
            tensor = getattr(rollout, name)
            if tensor is None:
                return None
            extra = width - tensor.shape[1]
            pieces.append(torch.nn.functional.pad(tensor[rows], (extra, 0) if left else (0, extra), value=value))
        return torch.cat(pieces)

    def listed(values_of) -> list:
        return [values_of(rollout)[row] for rollout, rows in parts for row in rows]

    first = parts[0][0]
    columns = {name: listed(lambda rollout, name=name: rollout.columns[name]) for name in first.columns}
    environments = None if first.environments is None else listed(lambda rollout: rollout.environments)
    image_inputs = None if first.image_inputs_B is None else listed(lambda rollout: rollout.image_inputs_B)
    return Rollout(
        prompts=listed(lambda rollout: rollout.prompts),
        completions=listed(lambda rollout: rollout.completions),
        completion_texts=listed(lambda rollout: rollout.completion_texts),
        columns=columns,
        prompt_ids_BP=stacked("prompt_ids_BP", width_P, pad_token_id, True),
        prompt_mask_BP=stacked("prompt_mask_BP", width_P, 0, True),
        completion_ids_BT=stacked("completion_ids_BT", width_T, pad_token_id, False),
        completion_mask_BT=stacked("completion_mask_BT", width_T, 0, False),
        is_truncated_B=torch.cat([rollout.is_truncated_B[rows] for rollout, rows in parts]),
        group_index_B=torch.zeros(0, dtype=torch.long),  # numbered by the caller
        step=first.step,
        sampling_logprobs_BT=stacked("sampling_logprobs_BT", width_T, 0.0, False),
        policy_version=first.policy_version,
        env_mask_BT=stacked("env_mask_BT", width_T, 0, False),
        extra_keys=first.extra_keys,
        environments=environments,
        image_inputs_B=image_inputs,
    )


def _record(engine, rounds: list[_Round], dropped: list, chosen: list, filler: list) -> DynamicSampling:
    """The batch's ``dynamic_sampling`` record: its rewards (in the batch's order), the dropped
    groups and the ``dynamic_sampling/*`` metrics over all processes."""
    G = engine.config.num_generations
    taken = chosen + filler
    scores = [(rounds[r].scores, [group * G + i for i in range(G)]) for r, group in taken]
    first = rounds[0].scores
    values_B = torch.cat([round_.values_B for round_ in rounds]).to(engine.accelerator.device)
    drawn_values = dist.gather(engine.accelerator, values_B)
    finite = drawn_values[~torch.isnan(drawn_values)]
    highest, lowest = (float(finite.max()), float(finite.min())) if len(finite) else (0.0, 0.0)
    columns = {"round": [], "group": [], "prompt": [], "completion": [], "value": [], "why": []}
    too_easy = by_metric = 0
    for r, group in dropped:
        round_ = rounds[r]
        values = round_.values_B[group * G:(group + 1) * G]
        value = float(torch.nanmean(values))
        why = dropped_kind(value, highest, lowest, engine.config.eval_pass_threshold)
        if callable(engine.config.dynamic_sampling_metric) and bool(ops.groups_with_signal(values, G)):
            why = "by the metric"  # the function dropped it despite a spread: neither too easy nor too hard
        too_easy += why == "too easy"
        by_metric += why == "by the metric"
        for row in range(group * G, (group + 1) * G):
            columns["round"].append(r)
            columns["group"].append(group)
            columns["prompt"].append(prompt_text(round_.rollout.prompts[row]))
            columns["completion"].append(round_.rollout.completion_texts[row])
            columns["value"].append(float(round_.values_B[row]))
            columns["why"].append(why)
    counts = torch.tensor([
        float(sum(len(round_.signal_N) for round_ in rounds)), float(too_easy),
        float(len(dropped) - too_easy - by_metric),
        float(len(chosen)), float(len(filler)),
        float(sum(int(round_.rollout.completion_lengths_B.sum()) for round_ in rounds)),
    ], device=engine.accelerator.device)
    drawn, easy, hard, kept, filled, tokens = dist.gather(engine.accelerator, counts[None]).sum(0).tolist()
    reward_metrics: dict[str, list[float]] = {}
    for round_ in rounds:
        for name, values in round_.scores.metrics.items():
            reward_metrics.setdefault(name, []).extend(values)
    return DynamicSampling(
        rounds=len(rounds),
        rewards_BF=torch.cat([scores_.rewards_BF[rows] for scores_, rows in scores]),
        reward_names=list(first.reward_names),
        scored_by=engine.reward_funcs_token,
        extras={name: [scores_.extras[name][row] for scores_, rows in scores for row in rows] for name in first.extras},
        reward_metrics=reward_metrics,
        filler_B=torch.tensor([pair in filler for pair in taken]).repeat_interleave(G),
        dropped=columns,
        metrics={
            "dynamic_sampling/rounds": float(len(rounds)),
            "dynamic_sampling/frac_groups_dropped_too_easy": easy / drawn,
            "dynamic_sampling/frac_groups_dropped_too_hard": hard / drawn,
            "dynamic_sampling/frac_groups_filled": filled / (kept + filled),
            "dynamic_sampling/tokens_per_kept_group": tokens / max(kept, 1.0),
        },
    )


def reused_scores(engine, rollout: Rollout) -> Scores | None:
    """The scores ``generate()`` computed for ``rollout`` under dynamic sampling, while the engine's
    reward functions are those that computed them (the same ``reward_funcs_token``: not replaced
    since, not another engine's); None otherwise (score it)."""
    record = rollout.dynamic_sampling
    if record is None or record.scored_by != engine.reward_funcs_token:
        return None
    return Scores(rollout, record.rewards_BF.clone(), list(record.reward_names),
                  {name: list(values) for name, values in record.extras.items()},
                  {name: list(values) for name, values in record.reward_metrics.items()})
