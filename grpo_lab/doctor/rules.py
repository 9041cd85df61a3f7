"""The doctor's rules over the probe batch's numbers: completion lengths, rewards, advantages, the
loss and the vLLM log-prob gap. Each rule is a pure function of tensors and settings that returns
a list of :class:`~grpo_lab.doctor.findings.Finding` (empty when all is well), so that it can be
tested on hand-made numbers; the thresholds it compares with come in as a
:class:`~grpo_lab.doctor.thresholds.Thresholds` (the defaults when none is given).

Shapes: B completions of the probe batch, F reward functions.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from grpo_lab.doctor.findings import Finding
from grpo_lab.doctor.thresholds import DEFAULTS, Thresholds

EXAMPLES = 3
"""Example prompts or completions a finding's evidence shows."""


def clipped(text, width: int = 80) -> str:
    """A prompt (text or chat messages: the last message's content) or completion, on one line, cut to ``width``."""
    if isinstance(text, list):
        text = str(text[-1].get("content", "")) if text and isinstance(text[-1], dict) else str(text)
    text = str(text).replace("\n", "\\n")
    return text if len(text) <= width else text[: width - 3] + "..."


def share_text(count: int, total: int) -> str:
    return f"{count} of {total} ({count / max(total, 1):.0%})"


# ---------------------------------------------------------------------------------------- truncation
def suggested_max_completion_length(ended_lengths: list[int], truncated_share: float, current: int,
                                    thresholds: Thresholds = DEFAULTS) -> int:
    """A max_completion_length for the lengths seen: twice ``current`` when nearly every completion
    was cut (``nearly_all_truncated``), else the ``length_percentile`` percentile of the ended
    completions' lengths times ``length_headroom``, at least 25% above ``current`` (the cut ones
    needed more than it); rounded up to a multiple of 8."""
    if truncated_share >= thresholds.nearly_all_truncated or not ended_lengths:
        return 2 * current
    percentile = float(torch.quantile(torch.tensor(ended_lengths, dtype=torch.float64),
                                      thresholds.length_percentile / 100))
    wanted = max(percentile * thresholds.length_headroom, current * 1.25)
    return int(math.ceil(wanted / 8) * 8)


@dataclasses.dataclass(frozen=True)
class LongerLimitTrial:
    """The probe's batch generated again (the same prompts and random draws) with a longer limit,
    for when nearly every completion was cut and the lengths they need are unknown: ``limit``
    the longer limit, ``ended_lengths`` the lengths of the completions that ended within it,
    ``cut_share`` the share still cut at it."""

    limit: int
    ended_lengths: list[int]
    cut_share: float


def _lengths_text(lengths: list[int]) -> str:
    quantiles = torch.quantile(torch.tensor(lengths, dtype=torch.float64), torch.tensor([0.5, 0.9, 1.0],
                                                                                         dtype=torch.float64))
    return "/".join(f"{q:.0f}" for q in quantiles.tolist())


def truncation(lengths_B: torch.Tensor, is_truncated_B: torch.Tensor, completions: list[str], *,
               max_completion_length: int, mask_truncated_completions: bool,
               thresholds: Thresholds = DEFAULTS, longer: LongerLimitTrial | None = None) -> list[Finding]:
    """Completions that hit ``max_completion_length`` without EOS (``completions/clipped_ratio``): a
    warning from ``truncation_warning`` of them, an error above ``truncation_error``. The limit it
    proposes comes from the ended completions' lengths; where nearly all were cut, from those of
    ``longer`` (the batch generated again with a longer limit), else twice the limit."""
    truncated_B = is_truncated_B.bool().cpu()
    count, total = int(truncated_B.sum()), len(truncated_B)
    share = count / max(total, 1)
    if share < thresholds.truncation_warning:
        return []
    ended = lengths_B.cpu()[~truncated_B].tolist()
    evidence = {"truncated": share_text(count, total), "max_completion_length": max_completion_length}
    if ended:
        evidence["ended lengths p50/p90/max"] = _lengths_text(ended)
    else:
        evidence["ended lengths"] = "none ended"
    evidence["truncated completions"] = [clipped(c) for c, cut in zip(completions, truncated_B.tolist()) if cut][
        :EXAMPLES]
    suggested, how = _proposed_limit(ended, share, max_completion_length, thresholds, longer)
    if longer is not None:
        seen = (f"ended lengths p50/p90/max {_lengths_text(longer.ended_lengths)}" if longer.ended_lengths
                else "none ended")
        evidence[f"generated again with max_completion_length={longer.limit}"] = f"{longer.cut_share:.0%} cut; {seen}"
    dropped = (" and mask_truncated_completions=True leaves them out of the loss, so they teach nothing"
               if mask_truncated_completions else ", which the rewards then judge as they stand")
    return [Finding(
        "truncation", "error" if share > thresholds.truncation_error else "warning",
        f"{share:.0%} of the probe's completions reached max_completion_length={max_completion_length} tokens "
        f"without an EOS token: they are cut off mid-answer{dropped}.",
        evidence,
        f"max_completion_length={suggested} ({how}); or, to keep the limit, "
        "mask_truncated_completions=True so that cut completions do not count in the loss.",
    )]


def _proposed_limit(ended: list[int], share: float, current: int, thresholds: Thresholds,
                    longer: LongerLimitTrial | None) -> tuple[int, str]:
    """The limit the truncation finding proposes, and how it was found."""
    percentile = (f"{thresholds.length_percentile:g}th percentile of the ended lengths with "
                  f"{thresholds.length_headroom:g}x headroom")
    if share < thresholds.nearly_all_truncated and ended:
        return suggested_max_completion_length(ended, share, current, thresholds), percentile
    if longer is None:
        return 2 * current, "nearly all were cut, so the lengths they need are unknown: twice the limit is a start"
    if longer.cut_share >= thresholds.nearly_all_truncated or not longer.ended_lengths:
        return 2 * longer.limit, (f"nearly all were cut even when the probe's batch was generated again with "
                                  f"max_completion_length={longer.limit}: the model may not end its completions "
                                  "(see the EOS findings); run the doctor again with the new limit")
    # where none was cut at the longer limit, the ended lengths alone decide (with 1.25 x the old limit as floor)
    floor = longer.limit if longer.cut_share > 0 else current
    suggested = suggested_max_completion_length(longer.ended_lengths, longer.cut_share, floor, thresholds)
    return suggested, (f"nearly all were cut, so the probe's batch was generated again with "
                       f"max_completion_length={longer.limit}: the {percentile} there")


# ---------------------------------------------------------------------------------------- rewards
def _values_text(values: torch.Tensor) -> str:
    distinct, counts = torch.unique(values, return_counts=True)
    shown = [f"{v:g} x{c}" for v, c in zip(distinct.tolist(), counts.tolist())]
    return ", ".join(shown[:6]) + (f", ... ({len(shown)} distinct)" if len(shown) > 6 else "")


def _varies_within_groups(values_B: torch.Tensor, group_B: torch.Tensor) -> bool:
    for group in torch.unique(group_B):
        finite = values_B[(group_B == group) & ~torch.isnan(values_B)]
        if len(finite) > 1 and bool((finite != finite[0]).any()):
            return True
    return False


def rewards(rewards_BF: torch.Tensor, group_B: torch.Tensor, names: list[str], prompts: list, *,
            declared_max: dict[str, float | None]) -> list[Finding]:
    """Reward functions that give GRPO nothing to compare (``rewards/<fn>/mean``, ``/std``): always
    None, constant over the batch, varying only between prompts; and those that never reach the
    maximum they declare (a ``max_reward`` attribute on the function)."""
    rewards_BF, group_B = rewards_BF.float().cpu(), group_B.cpu()
    varying = [n for f, n in enumerate(names) if _varies_within_groups(rewards_BF[:, f], group_B)]
    findings = []
    for f, name in enumerate(names):
        values_B = rewards_BF[:, f]
        finite = values_B[~torch.isnan(values_B)]
        if len(finite) == 0:
            findings.append(_always_none(name, len(values_B)))
            continue
        if name not in varying:
            findings.append(_constant(name, finite, values_B, varying)
                            if bool((finite == finite[0]).all())
                            else _between_prompts_only(name, values_B, group_B, prompts, varying))
        maximum = declared_max.get(name)
        if maximum is not None and float(finite.max()) < maximum:
            findings.append(Finding(
                "reward_below_maximum", "info",
                f"Reward function {name!r} declares max_reward={maximum:g}, and no completion of the probe reached "
                f"it: the maximum seen is {float(finite.max()):g}. The policy learns from the better of its tries, "
                "but none shows it what a full score looks like.",
                {"maximum seen": float(finite.max()), "values seen": _values_text(finite), "max_reward": maximum},
                "Check that the reward can reach its maximum on answers this model writes (score a correct answer "
                "by hand); if the task is too hard yet, give partial credit or easier prompts first.",
            ))
    return findings


def _always_none(name: str, total: int) -> Finding:
    return Finding(
        "reward_always_none", "error",
        f"Reward function {name!r} returned None for every completion of the probe: None means 'does not apply', "
        "so it scores nothing and adds nothing to the advantages.",
        {"None returned": f"{total} of {total}"},
        f"Make {name} return a number (e.g. 0.0 for a wrong answer) where it applies: check the keyword arguments it "
        "reads (dataset columns, completions as chat messages or text) and what it returns on a completion of the "
        "probe.",
    )


def _constant(name, finite, values_B, varying) -> Finding:
    others = f" The run learns from {', '.join(map(repr, varying))} alone." if varying else ""
    return Finding(
        "reward_constant", "info" if varying else "error",
        f"Reward function {name!r} gave every completion of the probe the same value ({float(finite[0]):g}): "
        f"GRPO compares completions of the same prompt, so a constant adds nothing to any advantage.{others}",
        {"value": float(finite[0]), "completions": len(finite), "None returned": int(torch.isnan(values_B).sum())},
        f"Check that {name} tells a good completion from a bad one (score a right and a wrong answer by hand); if "
        "the model already always meets it, drop it or keep it as a guard.",
    )


def _between_prompts_only(name, values_B, group_B, prompts, varying) -> Finding:
    examples, seen = [], set()
    for position, group in enumerate(group_B.tolist()):
        if group not in seen and len(examples) < EXAMPLES:
            seen.add(group)
            examples.append(f"{clipped(prompts[position], 50)} -> {float(values_B[position]):g}")
    means = torch.stack([values_B[group_B == g].nanmean() for g in torch.unique(group_B)])
    others = f" The run learns from {', '.join(map(repr, varying))} alone." if varying else (
        " No reward function varies within a group: every advantage is 0, and so is the gradient (with beta=0).")
    return Finding(
        "reward_between_prompts_only", "warning" if varying else "error",
        f"Reward function {name!r} varies between prompts but never among the completions of one prompt: all of "
        f"its spread is between prompts, which GRPO's group baseline removes, so it gives no learning signal."
        f"{others}",
        {"std of group means": float(means.std()) if len(means) > 1 else 0.0, "std within groups": 0.0,
         "group values (prompt -> reward)": examples},
        f"Make {name} score the completion, not the prompt (it reads only dataset columns, or the prompt): e.g. "
        "compare the completion's answer with the reference column.",
    )


# ---------------------------------------------------------------------------------------- zero-signal groups
_ZERO_KINDS = {
    "groups_too_easy": ("every completion got the highest total reward seen on the probe ({value:g}): the prompts "
                        "are already solved", "Give harder prompts (drop those the model solves every time, or a "
                        "curriculum that moves on), or a reward that still separates good from better answers."),
    "groups_too_hard": ("every completion got the lowest total reward seen on the probe ({value:g}): no try "
                        "succeeds, so there is nothing to reinforce", "Give easier prompts first, raise "
                        "num_generations (more tries per prompt) or temperature, or a reward with partial credit."),
    "groups_tied": ("every completion of the group got the same total reward, between the lowest and highest seen",
                    "A reward with finer steps (partial credit), or more completions per prompt (num_generations)."),
}


def zero_signal_groups(rewards_B: torch.Tensor, advantages_B: torch.Tensor, group_B: torch.Tensor, prompts: list, *,
                       pass_threshold: float, thresholds: Thresholds = DEFAULTS,
                       dynamic_sampling: bool = False) -> list[Finding]:
    """Prompt groups whose advantages are all zero (``frac_reward_zero_std``), told apart by the total
    reward they tied at: the highest seen on the probe (too easy), the lowest (too hard) or another.
    Where the whole probe has one reward value, it counts as solved when at least ``pass_threshold``
    (``eval_pass_threshold``) and as failed below it. A warning from ``zero_signal_warning`` of the
    groups, an error when every group is tied, else info."""
    rewards_B, advantages_B, group_B = rewards_B.float().cpu(), advantages_B.float().cpu(), group_B.cpu()
    scored = rewards_B[~torch.isnan(rewards_B)]
    if len(scored) == 0:
        return []
    highest, lowest = float(scored.max()), float(scored.min())
    kinds: dict[str, list[int]] = {code: [] for code in [*_ZERO_KINDS, "groups_unscored"]}
    groups = torch.unique(group_B).tolist()
    for group in groups:
        members = (group_B == group).nonzero().flatten()
        if bool(advantages_B[members].any()):
            continue
        value = rewards_B[members].nanmean()
        if torch.isnan(value):  # no function scored the group: reward_always_none says why
            kinds["groups_unscored"].append(int(members[0]))
        elif highest == lowest:
            kinds["groups_too_easy" if highest >= pass_threshold else "groups_too_hard"].append(int(members[0]))
        elif float(value) == highest:
            kinds["groups_too_easy"].append(int(members[0]))
        elif float(value) == lowest:
            kinds["groups_too_hard"].append(int(members[0]))
        else:
            kinds["groups_tied"].append(int(members[0]))
    zero = sum(len(rows) for rows in kinds.values())
    share = zero / len(groups)
    severity = "error" if zero == len(groups) else "warning" if share >= thresholds.zero_signal_warning else "info"
    gradient = ("Every group is like this: every advantage is 0 and so is the gradient (with beta=0), whatever the "
                "loss." if zero == len(groups) else
                f"Those groups add nothing to the gradient; it comes from the remaining {len(groups) - zero} of "
                f"{len(groups)}.")
    solved = highest >= pass_threshold
    single = (f" (the whole probe has this one value; {'at or above' if solved else 'below'} eval_pass_threshold="
              f"{pass_threshold:g}, it counts as {'solved' if solved else 'failed'})" if highest == lowest else "")
    findings = []
    for code, rows in kinds.items():
        if not rows or code not in _ZERO_KINDS:
            continue
        cause, fix = _ZERO_KINDS[code]
        if severity == "warning" and not dynamic_sampling:
            fix += (" Or dynamic_sampling=True: generate() then draws and scores further prompts until the batch "
                    "holds only groups whose rewards differ (more generation per step).")
        value = float(rewards_B[rows[0]])
        findings.append(Finding(
            code, severity,
            f"In {len(rows)} of the probe's {len(groups)} prompt groups, {cause.format(value=value)}{single}; "
            f"their advantages are all 0. {gradient}",
            {"groups": share_text(len(rows), len(groups)), "groups with zero advantages": share_text(zero, len(groups)),
             "highest / lowest total reward seen": f"{highest:g} / {lowest:g}",
             "example prompts": [clipped(prompts[row]) for row in rows[:EXAMPLES]]},
            fix,
        ))
    return findings


# ---------------------------------------------------------------------------------------- loss and batch geometry
def loss_by_construction(loss: float, grad_norm: float, *, beta: float, steps_per_batch: int, loss_type: str,
                         corrects_sampling: bool, entropy_bonus: bool) -> list[Finding]:
    """Explain a loss that is near 0 by construction (the views' ``loss_is_zero_by_construction``
    rule, on settings): with beta 0 and one optimizer step per generated batch, the policy that
    sampled is the one trained, every ratio is 1, and the loss is minus a weighted mean of
    group-centred advantages; its gradient is not 0."""
    if beta != 0 or steps_per_batch != 1 or corrects_sampling or entropy_bonus:
        return []
    weights = ("each completion weighs the same, so the group-centred advantages cancel to 0"
               if loss_type == "grpo" else f"loss_type={loss_type!r} weighs completions by their lengths, so the "
               "advantages cancel only in part")
    return [Finding(
        "loss_zero_by_construction", "info",
        "The loss value carries no progress signal with these settings: beta=0 and one optimizer step per "
        "generated batch (num_iterations=1, steps_per_generation equal to gradient_accumulation_steps) make every "
        f"importance ratio 1, and the loss is minus a weighted mean of the advantages; {weights}. "
        + ("Its gradient is not 0: the run learns while the loss stays flat." if grad_norm > 0 else
           "Here the gradient is 0 as well, because every advantage is: see the groups_* findings."),
        {"probe loss": loss, "probe grad_norm (before clipping)": grad_norm, "beta": beta,
         "optimizer steps per batch": steps_per_batch, "loss_type": loss_type},
        "Nothing to fix: watch reward (and rewards/<fn>/mean), grad_norm and frac_reward_zero_std instead of loss.",
    )]


def zero_advantage_micro_batches(advantages_B: torch.Tensor, *, micro_batch_size: int, skip_backward: bool,
                                 thresholds: Thresholds = DEFAULTS) -> list[Finding]:
    """Micro-batches (``per_device_train_batch_size`` completions in order) whose advantages are all
    zero: their passes compute a zero gradient (``backward_skipped_fraction`` where skipping applies).
    A warning from ``zero_micro_batch_warning`` of the micro-batches, else info."""
    advantages_B = advantages_B.cpu()
    parts = advantages_B.split(micro_batch_size)
    zero = sum(not bool(part.any()) for part in parts)
    if zero == 0:
        return []
    share = zero / len(parts)
    skipped = ("skip_zero_advantage_backward skips their backward pass where it can, not their forward pass"
               if skip_backward else "skip_zero_advantage_backward=False runs their backward pass too")
    return [Finding(
        "zero_advantage_micro_batches", "warning" if share >= thresholds.zero_micro_batch_warning else "info",
        f"{share_text(zero, len(parts))} micro-batches of the probe hold only completions with advantage 0 (their "
        f"groups tied): their forward passes compute nothing that reaches the gradient ({skipped}).",
        {"micro-batches with all advantages 0": share_text(zero, len(parts)), "micro-batch size": micro_batch_size,
         "completions with advantage 0": share_text(int((advantages_B == 0).sum()), len(advantages_B))},
        "Make fewer groups tie (see the groups_too_easy / groups_too_hard findings: prompts of the right difficulty, "
        "more num_generations)" + ("" if skip_backward else ", and set skip_zero_advantage_backward=True") + ".",
    )]


def sampling_gap(mean_gap: float | None, max_gap: float | None, *,
                 thresholds: Thresholds = DEFAULTS) -> list[Finding]:
    """The trainer/vLLM log-prob gap (``sampling/sampling_logp_difference/mean`` and ``max``) over
    ``logp_gap_warning``; nothing without vLLM (``mean_gap`` None)."""
    limit = thresholds.logp_gap_warning
    if mean_gap is None or not mean_gap > limit:
        return []
    return [Finding(
        "vllm_logprob_gap", "warning",
        f"vLLM samples from a different distribution than the trainer computes: the mean per-token |log-prob "
        f"difference| is {mean_gap:.3g} (above {limit:g}). The loss then treats off-policy samples as "
        "on-policy: stale weights in vLLM, another dtype than training's, or sampling settings vLLM applies and the "
        "trainer does not (top_p, top_k, min_p, repetition_penalty).",
        {"sampling/sampling_logp_difference/mean": mean_gap, "sampling/sampling_logp_difference/max": max_gap,
         "threshold": limit},
        "Start the vLLM server with the training precision (--dtype), leave top_p/top_k/min_p at their defaults, and "
        "keep vllm_importance_sampling_correction=True (the default) so that the loss reweights the gap.",
    )]


# ---------------------------------------------------------------------------------------- causes
UPSTREAM = ("truncation", "reward_always_none", "reward_constant", "reward_between_prompts_only")
"""Findings that, as errors, explain the others below them, most upstream first: answers cut before
they end score alike, and a reward that scores nothing, one value, or the prompt alone makes every
group tie."""
DOWNSTREAM = ("groups_too_easy", "groups_too_hard", "groups_tied", "zero_advantage_micro_batches")
"""Findings about tied groups, which a cause upstream accounts for."""


def link_causes(findings: list[Finding]) -> list[Finding]:
    """``findings`` with the root cause named: the most upstream error of :data:`UPSTREAM` becomes the
    ``cause`` of the other upstream findings and of every :data:`DOWNSTREAM` one, whose fix then starts
    from it (e.g. a reward that is always 0 makes every group "too hard": the fix is the reward, not
    easier prompts). Without such an error, the findings as they are."""
    root = next((f for code in UPSTREAM for f in findings if f.code == code and f.severity == "error"), None)
    if root is None:
        return findings
    linked = []
    for finding in findings:
        if finding is not root and finding.code in UPSTREAM + DOWNSTREAM:
            finding = dataclasses.replace(
                finding, cause=root.code,
                fix=f"Fix {root.code} first (above): it explains this finding. If it stays after that: {finding.fix}")
        linked.append(finding)
    return linked
