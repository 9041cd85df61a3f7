"""Live diagnoses: rules read after every optimizer step over the step's metrics row and the rows
before it (``session.history``), each a pure function of those rows, so that the trend arithmetic
can be tested on hand-made rows.

A rule returns :class:`Diagnosis` items: the :class:`~grpo_lab.doctor.findings.Finding` and a
``measure`` (a number that grows as the cause worsens). :class:`LiveWatch` rate-limits them: a code
is raised the first time its rule fires, then again only when its severity rises, when its measure
has grown by ``worsened_by`` since it was last raised, or when ``repeat_after_steps`` steps have
passed with the rule still firing. A per-step cause must hold on each of the last
``persistent_steps`` steps, so that one noisy step of a small batch is not raised. The thresholds
come in as a :class:`~grpo_lab.doctor.thresholds.Thresholds` (the session passes those of
``GRPOConfig.doctor_thresholds``; the defaults when none is given); docs/troubleshooting.md lists
them with each finding.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from grpo_lab.doctor.findings import Finding
from grpo_lab.doctor.thresholds import DEFAULTS, Thresholds


class Diagnosis(NamedTuple):
    """A finding of a live rule and its ``measure``, which grows as the cause worsens."""

    finding: Finding
    measure: float


def _values(history: list[dict], name: str) -> list[float]:
    return [float(row[name]) for row in history if isinstance(row.get(name), (int, float))
            and math.isfinite(float(row[name]))]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _streak(history: list[dict], holds) -> int:
    """How many of the latest rows, in a row, ``holds(row)`` is true of."""
    count = 0
    for row in reversed(history):
        if not holds(row):
            break
        count += 1
    return count


def truncation(history: list[dict], *, max_completion_length: int,
               thresholds: Thresholds = DEFAULTS) -> list[Diagnosis]:
    """The truncated share (``completions/clipped_ratio``) at or above ``truncation_warning`` on each of
    the last ``persistent_steps`` steps; an error where their mean is above ``truncation_error``."""
    steps, warning = thresholds.persistent_steps, thresholds.truncation_warning

    def high(row):
        share = row.get("completions/clipped_ratio")
        return share is not None and share >= warning

    if _streak(history, high) < steps:
        return []
    share = _mean([row["completions/clipped_ratio"] for row in history[-steps:]])
    return [Diagnosis(Finding(
        "truncation_in_training", "error" if share > thresholds.truncation_error else "warning",
        f"{share:.0%} of the completions of the last {steps} steps reached max_completion_length="
        f"{max_completion_length} without an EOS token: the rewards judge answers cut off mid-way.",
        {"step": history[-1]["step"], f"completions/clipped_ratio, mean of {steps} steps": share,
         "completions/mean_length": history[-1].get("completions/mean_length"),
         "max_completion_length": max_completion_length, "threshold": warning},
        f"max_completion_length={2 * max_completion_length} (or more), or mask_truncated_completions=True; "
        "session.doctor() suggests a limit from the lengths of the completions that ended.",
    ), share)]


def zero_signal(history: list[dict], thresholds: Thresholds = DEFAULTS) -> list[Diagnosis]:
    """Every prompt group tied (``frac_reward_zero_std`` == 1) on each of the last ``persistent_steps``
    steps or more: their advantages, and with beta 0 their gradients, were zero."""
    streak = _streak(history, lambda row: row.get("frac_reward_zero_std") == 1)
    if streak < thresholds.persistent_steps:
        return []
    row = history[-1]
    return [Diagnosis(Finding(
        "no_signal_steps", "error",
        f"Every prompt group got one reward for all its completions on each of the last {streak} steps: every "
        "advantage was 0, so those steps learned nothing from their rewards.",
        {"step": row["step"], "frac_reward_zero_std": 1.0, "steps in a row": streak, "reward": row.get("reward")},
        "Prompts of the right difficulty (none solved or failed every time), rewards that tell completions of one "
        "prompt apart, more num_generations or a higher temperature; session.doctor() names which kind of tie.",
    ), float(streak))]


def dynamic_sampling_exhausted(history: list[dict], thresholds: Thresholds = DEFAULTS) -> list[Diagnosis]:
    """Dynamic sampling ran out of rounds (``dynamic_sampling/frac_groups_filled`` > 0) on each of the
    last ``persistent_steps`` steps: the batches were filled with groups that carry no signal."""
    streak = _streak(history, lambda row: (row.get("dynamic_sampling/frac_groups_filled") or 0) > 0)
    if streak < thresholds.persistent_steps:
        return []
    steps = thresholds.persistent_steps
    filled = _mean([row["dynamic_sampling/frac_groups_filled"] for row in history[-steps:]])
    row = history[-1]
    return [Diagnosis(Finding(
        "dynamic_sampling_exhausted", "warning",
        f"dynamic_sampling ran out of rounds on each of the last {streak} steps: {filled:.0%} of those batches' "
        "groups were dropped ones filled in, which carry no signal, after "
        f"{row.get('dynamic_sampling/rounds', 0):g} rounds of generation each.",
        {"step": row["step"], f"dynamic_sampling/frac_groups_filled, mean of {steps} steps": filled,
         "dynamic_sampling/rounds": row.get("dynamic_sampling/rounds"),
         "too easy / too hard": f"{row.get('dynamic_sampling/frac_groups_dropped_too_easy', 0):.0%} / "
                                f"{row.get('dynamic_sampling/frac_groups_dropped_too_hard', 0):.0%}"},
        "Prompts of the right difficulty (the dropped shares say which way), more num_generations or a higher "
        "temperature, or a larger dynamic_sampling_max_rounds (each round costs a generation batch).",
    ), filled)]


def entropy_collapse(history: list[dict], thresholds: Thresholds = DEFAULTS) -> list[Diagnosis]:
    """Entropy (mean over the ``recent_steps`` latest steps) below ``entropy_collapse_fraction`` of its
    early value (the ``early_steps`` first steps)."""
    entropy, first, last = _values(history, "entropy"), thresholds.early_steps, thresholds.recent_steps
    fraction = thresholds.entropy_collapse_fraction
    if len(entropy) < first + last:
        return []
    early, now = _mean(entropy[:first]), _mean(entropy[-last:])
    if not early > 0 or now >= fraction * early:
        return []
    return [Diagnosis(Finding(
        "entropy_collapse", "warning",
        f"The policy's token entropy fell to {now:.3g} nats, {now / early:.0%} of its early {early:.3g}: it samples "
        "nearly the same tokens every time, so the completions of a group stop differing and the advantages vanish.",
        {"step": history[-1]["step"], "entropy early": early, "entropy now": now,
         "threshold": f"{fraction:g} x early"},
        "Lower learning_rate, or keep entropy up: entropy_coef > 0 or use_adaptive_entropy=True with entropy_target "
        "near the early entropy; epsilon_high above epsilon (clip-higher) also slows the collapse.",
    ), early / max(now, 1e-12))]


def _climb(history: list[dict], name: str, level: float, thresholds: Thresholds) -> tuple[float, float] | None:
    """(value before, current value) of ``name`` where the current value (last ``recent_steps`` steps)
    is at least ``level`` and ``climb_factor`` times the value of as many steps before; else None."""
    values, recent = _values(history, name), thresholds.recent_steps
    if len(values) < 2 * recent:
        return None
    now, before = _mean(values[-recent:]), _mean(values[-2 * recent:-recent])
    return (before, now) if now >= level and now >= thresholds.climb_factor * before else None


def kl_climbing(history: list[dict], *, beta: float, thresholds: Thresholds = DEFAULTS) -> list[Diagnosis]:
    """With beta > 0: the KL to the reference climbing past ``kl_warning``."""
    climb = None if beta <= 0 else _climb(history, "kl", thresholds.kl_warning, thresholds)
    if climb is None:
        return []
    before, now = climb
    return [Diagnosis(Finding(
        "kl_climbing", "warning",
        f"The KL to the reference model climbed from {before:.3g} to {now:.3g} nats per token over the last "
        f"{2 * thresholds.recent_steps} steps: the policy moves away faster than beta={beta:g} holds it back.",
        {"step": history[-1]["step"], "kl before": before, "kl now": now, "beta": beta,
         "threshold": thresholds.kl_warning},
        "Lower learning_rate, or raise beta; check the rewards for a shortcut the policy is racing towards.",
    ), now)]


def clip_ratio_climbing(history: list[dict], thresholds: Thresholds = DEFAULTS) -> list[Diagnosis]:
    """The share of clipped tokens (``clip_ratio/region_mean``) climbing past ``clip_ratio_warning``."""
    climb = _climb(history, "clip_ratio/region_mean", thresholds.clip_ratio_warning, thresholds)
    if climb is None:
        return []
    before, now = climb
    return [Diagnosis(Finding(
        "clip_ratio_climbing", "warning",
        f"The share of tokens whose ratio is clipped climbed from {before:.0%} to {now:.0%}: each step moves the "
        "policy further than the clipping range, and the clipped tokens give no gradient.",
        {"step": history[-1]["step"], "clip_ratio/region_mean before": before, "clip_ratio/region_mean now": now,
         "threshold": thresholds.clip_ratio_warning},
        "Lower learning_rate, or fewer optimizer steps per generation batch (num_iterations, steps_per_generation).",
    ), now)]


def importance_ratio_drift(history: list[dict], thresholds: Thresholds = DEFAULTS) -> list[Diagnosis]:
    """With vLLM: the mean trainer/vLLM importance ratio more than ``importance_ratio_drift`` from 1 on
    each of the last ``persistent_steps`` steps."""
    name = "sampling/importance_sampling_ratio/mean"
    drift, steps = thresholds.importance_ratio_drift, thresholds.persistent_steps

    def drifted(row):
        ratio = row.get(name)
        return ratio is not None and math.isfinite(ratio) and abs(ratio - 1) > drift

    if _streak(history, drifted) < steps:
        return []
    row, ratio = history[-1], history[-1][name]
    stale = row.get("async_generation/staleness") or 0
    evidence = {"step": row["step"], name: ratio,
                "sampling/importance_sampling_ratio/min": row.get("sampling/importance_sampling_ratio/min"),
                "sampling/sampling_logp_difference/mean": row.get("sampling/sampling_logp_difference/mean"),
                "threshold": drift}
    if stale:  # async_generation: the batches come from weights `stale` steps old, on purpose
        evidence["async_generation/staleness"] = stale
        return [Diagnosis(Finding(
            "importance_ratio_drift", "warning",
            f"The mean importance ratio between the trainer and vLLM is {ratio:.3g}, more than {drift:g} from 1 for "
            f"{steps} steps or more, with batches generated by weights {stale:g} optimizer step(s) old "
            "(async_generation): each step moves the policy further than the correction should have to cover.",
            evidence,
            "A lower learning_rate (smaller steps between the generating and the training weights), or "
            "async_generation=False; and the checks of the synchronous case: vLLM in the training precision "
            "(--dtype), default top_p/top_k/min_p, vllm_importance_sampling_correction=True.",
        ), abs(ratio - 1))]
    return [Diagnosis(Finding(
        "importance_ratio_drift", "warning",
        f"The mean importance ratio between the trainer and vLLM is {ratio:.3g}, more than "
        f"{drift:g} from 1 for {steps} steps or more: vLLM samples from a policy other "
        "than the one trained (stale weights, another dtype, sampling settings only vLLM applies).",
        evidence,
        "Start vLLM with the training precision (--dtype), leave top_p/top_k/min_p at their defaults, and keep "
        "vllm_importance_sampling_correction=True.",
    ), abs(ratio - 1))]


def _correctness_rewards(row: dict, parts: tuple[str, ...]) -> list[str]:
    names = [key[len("rewards/"):-len("/mean")] for key in row if key.startswith("rewards/") and key.endswith("/mean")]
    return [name for name in names if any(part.lower() in name.lower() for part in parts)]


def length_rewarded(history: list[dict], thresholds: Thresholds = DEFAULTS) -> list[Diagnosis]:
    """The total reward rose by ``reward_rise`` or more and completions grew ``length_growth`` times
    longer than early on, while every correctness reward (by its name: ``correctness_names``) did not
    rise by as much. Only where such a reward is logged: without one, the rows cannot tell a better
    answer from a longer one."""
    first, last, rise = thresholds.early_steps, thresholds.recent_steps, thresholds.reward_rise
    if len(history) < first + last:
        return []
    correctness = _correctness_rewards(history[-1], thresholds.correctness_names)
    names = ["reward", "completions/mean_length", *(f"rewards/{name}/mean" for name in correctness)]
    series = {name: _values(history, name) for name in names}
    if not correctness or any(len(values) < first + last for values in series.values()):
        return []
    early = {name: _mean(values[:first]) for name, values in series.items()}
    now = {name: _mean(values[-last:]) for name, values in series.items()}
    length_early, length_now = early["completions/mean_length"], now["completions/mean_length"]
    correct_rose = any(now[name] - early[name] >= rise for name in names[2:])
    grew = length_now >= thresholds.length_growth * length_early
    if now["reward"] - early["reward"] < rise or not grew or correct_rose:
        return []
    return [Diagnosis(Finding(
        "reward_rising_with_length", "warning",
        f"The reward rose from {early['reward']:.3g} to {now['reward']:.3g} while completions grew from "
        f"{length_early:.3g} to {length_now:.3g} tokens and {', '.join(map(repr, correctness))}, the correctness "
        "reward(s) by name, did not rise: the gain comes from the other reward functions. If one of them grows "
        "with length (a format or reasoning-length reward), the policy may be learning to write more, not better.",
        {"step": history[-1]["step"], "reward early/now": f"{early['reward']:.3g}/{now['reward']:.3g}",
         "completions/mean_length early/now": f"{length_early:.3g}/{length_now:.3g}",
         **{f"{name} early/now": f"{early[name]:.3g}/{now[name]:.3g}" for name in names[2:]}},
        "Read the longest completions (session.completions_view()); cap or normalise a reward that grows with "
        "length, weight the correctness reward up (reward_weights), or lower max_completion_length.",
    ), length_now / max(length_early, 1e-12))]


def diagnose_step(history: list[dict], *, beta: float, max_completion_length: int,
                  thresholds: Thresholds = DEFAULTS) -> list[Diagnosis]:
    """Every live rule over ``history`` (the step's row last), under ``thresholds``."""
    return [*zero_signal(history, thresholds), *dynamic_sampling_exhausted(history, thresholds),
            *truncation(history, max_completion_length=max_completion_length, thresholds=thresholds),
            *entropy_collapse(history, thresholds), *kl_climbing(history, beta=beta, thresholds=thresholds),
            *clip_ratio_climbing(history, thresholds), *importance_ratio_drift(history, thresholds),
            *length_rewarded(history, thresholds)]


class LiveWatch:
    """The rate limit of the live rules: every raise of each code (see the module docstring)."""

    def __init__(self, raises: list[tuple[str, int, int, float]] = ()):
        self.raises = [tuple(entry) for entry in raises]  # (code, step, severity rank, measure), in raise order

    def before(self, step: int) -> LiveWatch:
        """The rate limit as it stood after ``step`` was read: the raises at or before it (an undo to ``step``)."""
        return LiveWatch([entry for entry in self.raises if entry[1] <= step])

    def due(self, diagnosis: Diagnosis, step: int, thresholds: Thresholds = DEFAULTS) -> bool:
        """Whether ``diagnosis`` at ``step`` is raised (``worsened_by``, ``repeat_after_steps``); if so, it
        is recorded as raised."""
        finding = diagnosis.finding
        last = next((entry for entry in reversed(self.raises) if entry[0] == finding.code), None)
        if last is not None:
            _, last_step, rank, measure = last
            if not (finding.rank > rank or diagnosis.measure >= thresholds.worsened_by * measure
                    or step - last_step >= thresholds.repeat_after_steps):
                return False
        self.raises.append((finding.code, step, finding.rank, diagnosis.measure))
        return True

    def new_findings(self, history: list[dict], *, beta: float, max_completion_length: int,
                     thresholds: Thresholds = DEFAULTS) -> list[Finding]:
        """The findings the rules raise over ``history`` under ``thresholds`` that the rate limit lets through."""
        step = history[-1]["step"]
        diagnoses = diagnose_step(history, beta=beta, max_completion_length=max_completion_length,
                                  thresholds=thresholds)
        return [diagnosis.finding for diagnosis in diagnoses if self.due(diagnosis, step, thresholds)]
