"""The doctor's thresholds: every number its rules compare with, defined once, with its default, the
values it takes and what it means; ``GRPOConfig(doctor_thresholds={...})`` overrides any of them.

:data:`TABLE` lists them (docs/troubleshooting.md shows the same table, with the findings each one
governs; a test keeps the two equal). :func:`resolve` turns a config's overrides into a
:class:`Thresholds` (every threshold, the defaults where not overridden), refusing an unknown name or
a value of the wrong type or range with a ``ValueError`` that names the key. The rules take a
``Thresholds`` as an argument (:data:`DEFAULTS` when none is given), so that they stay pure functions.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import numbers
from typing import Any, NamedTuple

WHERE_LISTED = "docs/troubleshooting.md, section 'Thresholds'"
"""Where every threshold is listed, with its default, meaning and the findings it governs."""


class Threshold(NamedTuple):
    """One threshold: its name (a key of ``doctor_thresholds``), default, kind (a key of :data:`KINDS`),
    what it means, and the finding codes it governs."""

    name: str
    default: Any
    kind: str
    meaning: str
    governs: tuple[str, ...]


KINDS = {
    "share": "a number in [0, 1]",
    "steps": "a whole number of steps >= 1",
    "factor": "a number > 0",
    "level": "a number >= 0",
    "percentile": "a number in [0, 100]",
    "names": "a non-empty list of non-empty strings",
}
"""The kinds of threshold and the values each takes."""

_LIVE = ("truncation_in_training", "no_signal_steps", "dynamic_sampling_exhausted", "entropy_collapse", "kl_climbing",
         "clip_ratio_climbing", "importance_ratio_drift", "reward_rising_with_length")
_GROUPS = ("groups_too_easy", "groups_too_hard", "groups_tied")

TABLE = (
    # ---------------------------------------------------------------- session.doctor()'s probe
    Threshold("truncation_warning", 0.10, "share", "share of truncated completions (no EOS within "
              "max_completion_length) from which truncation is raised, as a warning",
              ("truncation", "truncation_in_training", "stop_never_matched")),
    Threshold("truncation_error", 0.50, "share", "truncated share above which truncation is an error: most rewards "
              "then judge unfinished answers", ("truncation", "truncation_in_training")),
    Threshold("nearly_all_truncated", 0.90, "share", "truncated share from which the probe's batch is generated "
              "again with 2x, 4x, 8x max_completion_length until under truncation_warning of it is cut, and the "
              "suggested limit comes from the lengths seen there (the few ended lengths say nothing); twice the "
              "limit where that cannot run", ("truncation",)),
    Threshold("length_percentile", 95, "percentile", "percentile of the ended completions' lengths that the "
              "suggested max_completion_length covers", ("truncation",)),
    Threshold("length_headroom", 1.5, "factor", "headroom on that percentile in the suggested max_completion_length "
              "(which stays at least 25% above the current one)", ("truncation",)),
    Threshold("zero_signal_warning", 0.75, "share", "share of prompt groups with all advantages 0 from which they "
              "are a warning (below it: info; every group: error)", _GROUPS),
    Threshold("zero_micro_batch_warning", 0.5, "share", "share of micro-batches with all advantages 0 from which "
              "the wasted compute is a warning (below it: info)", ("zero_advantage_micro_batches",)),
    Threshold("logp_gap_warning", 0.05, "level", "mean per-token |log-prob trainer - log-prob vLLM| (nats) above "
              "which the two engines disagree", ("vllm_logprob_gap",)),
    # ---------------------------------------------------------------- live rules, after every optimizer step
    Threshold("persistent_steps", 5, "steps", "steps in a row a per-step cause must hold to be raised (one step "
              "of a small batch is noisy)", ("truncation_in_training", "no_signal_steps", "dynamic_sampling_exhausted",
                                               "importance_ratio_drift")),
    Threshold("early_steps", 3, "steps", "the first steps, whose mean is a metric's early value",
              ("entropy_collapse", "reward_rising_with_length")),
    Threshold("recent_steps", 3, "steps", "the latest steps, whose mean is a metric's current value (a climb "
              "compares it with the mean of as many steps before)",
              ("entropy_collapse", "kl_climbing", "clip_ratio_climbing", "reward_rising_with_length")),
    Threshold("entropy_collapse_fraction", 0.25, "share", "entropy below this fraction of its early value has "
              "collapsed", ("entropy_collapse",)),
    Threshold("kl_warning", 0.1, "level", "mean per-token KL to the reference (nats) from which a climbing KL is "
              "raised", ("kl_climbing",)),
    Threshold("clip_ratio_warning", 0.2, "share", "share of clipped tokens (clip_ratio/region_mean) from which a "
              "climbing one is raised", ("clip_ratio_climbing",)),
    Threshold("climb_factor", 1.5, "factor", "a metric climbs when its current value is at least this factor of "
              "the value before", ("kl_climbing", "clip_ratio_climbing")),
    Threshold("importance_ratio_drift", 0.2, "level", "|mean trainer/vLLM importance ratio - 1| above which the "
              "two engines drift apart", ("importance_ratio_drift",)),
    Threshold("length_growth", 1.5, "factor", "completions this factor longer than early on, while the reward "
              "rose, may mean a rewarded length", ("reward_rising_with_length",)),
    Threshold("reward_rise", 0.1, "level", "the least rise over its early value of the total reward (and of a "
              "correctness reward, to count as rising)", ("reward_rising_with_length",)),
    Threshold("correctness_names", ("correct", "accuracy", "answer", "exact", "match", "solve", "pass"), "names",
              "parts of a reward function's name (any case) that mark it as judging correctness",
              ("reward_rising_with_length",)),
    Threshold("repeat_after_steps", 25, "steps", "steps after which a live cause still present is raised again",
              _LIVE),
    Threshold("worsened_by", 1.5, "factor", "growth of a live finding's measure since it was last raised that "
              "raises it again sooner", _LIVE),
)
"""Every threshold, in the order docs/troubleshooting.md lists them."""

BY_NAME = {threshold.name: threshold for threshold in TABLE}


def _checked(name: str, value) -> Any:
    """``value`` as threshold ``name`` takes it (an int for steps, a float for numbers, a tuple for
    names); a ValueError naming the key and the values allowed otherwise."""
    threshold = BY_NAME[name]
    kind = threshold.kind
    if kind == "names":
        if (isinstance(value, (list, tuple)) and value
                and all(isinstance(part, str) and part.strip() for part in value)):
            return tuple(value)
    elif isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value):
        if kind == "steps" and float(value).is_integer() and value >= 1:
            return int(value)
        number = float(value)
        if ((kind == "share" and 0 <= number <= 1) or (kind == "factor" and number > 0)
                or (kind == "level" and number >= 0) or (kind == "percentile" and 0 <= number <= 100)):
            return number
    raise ValueError(
        f"doctor_thresholds[{name!r}] must be {KINDS[kind]} (got {value!r}); its default is "
        f"{_shown(threshold.default)}: {threshold.meaning}."
    )


def _shown(value) -> str:
    return json.dumps(list(value)) if isinstance(value, tuple) else f"{value:g}"


def _check_together(thresholds) -> None:
    if thresholds.truncation_warning > thresholds.truncation_error:
        raise ValueError(
            f"doctor_thresholds: truncation_warning ({thresholds.truncation_warning:g}) is above truncation_error "
            f"({thresholds.truncation_error:g}): a truncated share between them would be an error without first "
            "being a warning. Keep truncation_warning <= truncation_error."
        )


def _post_init(self) -> None:
    for threshold in TABLE:
        object.__setattr__(self, threshold.name, _checked(threshold.name, getattr(self, threshold.name)))
    _check_together(self)


Thresholds = dataclasses.make_dataclass(
    "Thresholds",
    [(threshold.name, Any, dataclasses.field(default=threshold.default)) for threshold in TABLE],
    frozen=True,
    namespace={"__module__": __name__, "__post_init__": _post_init, "__doc__": """The doctor's thresholds in
    force: one attribute per entry of :data:`TABLE` (``thresholds.truncation_warning``), each its default
    unless given; a value of the wrong type or range raises ``ValueError``. Build one from a config's
    ``doctor_thresholds`` with :func:`resolve`."""},
)

DEFAULTS = Thresholds()
"""Every threshold at its default."""


def resolve(overrides: dict | str | None) -> Thresholds:
    """The thresholds in force under ``overrides`` (``GRPOConfig.doctor_thresholds``: threshold name ->
    value, or that dict as a JSON string; None keeps every default). An unknown name raises
    ``ValueError`` with the nearest known one; a bad value, naming the key and the values allowed."""
    if overrides is None:
        return DEFAULTS
    overrides = _as_dict(overrides)
    for key in overrides:
        if key not in BY_NAME:
            raise ValueError(_unknown_message(key))
    return Thresholds(**overrides)


def _as_dict(overrides) -> dict:
    if isinstance(overrides, str):
        try:
            overrides = json.loads(overrides)
        except json.JSONDecodeError as error:
            raise ValueError(f"doctor_thresholds is not valid JSON ({error}): give a dict or a JSON object "
                             "string, e.g. {\"truncation_warning\": 0.2}.") from None
    if not isinstance(overrides, dict):
        raise ValueError(f"doctor_thresholds must be a dict of threshold names to values, e.g. "
                         f"{{'truncation_warning': 0.2, 'persistent_steps': 3}} (got {overrides!r}).")
    return overrides


def _unknown_message(key) -> str:
    close = difflib.get_close_matches(str(key).lower(), list(BY_NAME), n=1, cutoff=0.6)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return (f"doctor_thresholds has an unknown threshold {key!r}.{hint} Every threshold, with its default and "
            f"meaning, is listed in {WHERE_LISTED} (and in grpo_lab.doctor.thresholds.TABLE).")


def check_config(config) -> None:
    """Check ``config.doctor_thresholds`` (as :func:`resolve` does), a JSON string parsed into its dict."""
    if config.doctor_thresholds is None:
        return
    overrides = _as_dict(config.doctor_thresholds)
    object.__setattr__(config, "doctor_thresholds", overrides)
    resolve(overrides)
