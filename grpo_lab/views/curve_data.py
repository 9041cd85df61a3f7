"""Pure data for the curves view: the session's history -> panels of series. No widgets, no plotly.

A panel is one small plot: its series share the x-axis (optimizer step) and a y-axis with a unit;
a panel may draw one series as a band (centre ± spread), put one series on a right-hand axis, and
carry a note that explains what it shows. Panels whose every series is constant over the history
are not drawn: they are listed in one summary line instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

LEARNING_SIGNAL = "learning signal"
NONZERO_ADVANTAGE = "completions with A ≠ 0"
SHARE_RANGE = (-0.05, 1.05)  # shares of a batch, drawn on the whole of [0, 1]
LOGGED = "logged metrics"


def _reward_means(columns: list[str]) -> list[str]:
    return [c for c in columns if c.startswith("rewards/") and c.endswith("/mean")]


_DIAGNOSTIC_NAMES = ("entropy_coef", "aux_loss", "vespo/phi_seq_mean")
_DIAGNOSTIC_PREFIXES = ("off_policy_mask/", "sampling/", "tools/")


def _diagnostics(columns: list[str]) -> list[str]:
    return [c for c in columns if c in _DIAGNOSTIC_NAMES or c.startswith(_DIAGNOSTIC_PREFIXES)]


DYNAMIC_SAMPLING_SHARES = ("dynamic_sampling/frac_groups_dropped_too_easy",
                           "dynamic_sampling/frac_groups_dropped_too_hard", "dynamic_sampling/frac_groups_filled")
"""With dynamic_sampling: which groups the rounds dropped, and how much of the batch was filled, beside
the share of groups with equal rewards."""


@dataclass(frozen=True)
class PanelSpec:
    title: str
    unit: str
    columns: tuple[str, ...] = ()
    band: tuple[str, str] | None = None  # (centre, spread): draw centre ± spread as a band
    right: tuple[str, str] | None = None  # (column, unit) drawn on a right-hand y-axis
    pick: Callable[[list[str]], list[str]] | None = None  # chooses its columns from the history's
    y_range: tuple[float, float] | None = None  # a fixed range, e.g. for shares


CURVE_PANELS: tuple[PanelSpec, ...] = (
    PanelSpec("reward", "reward (mean)", ("reward",), band=("reward", "reward_std")),
    PanelSpec("reward per function", "reward (mean)", pick=_reward_means),
    PanelSpec(LEARNING_SIGNAL, "share", ("frac_reward_zero_std", NONZERO_ADVANTAGE, *DYNAMIC_SAMPLING_SHARES),
              right=("grad_norm", "grad norm"), y_range=SHARE_RANGE),
    PanelSpec("dynamic sampling", "rounds per batch", ("dynamic_sampling/rounds",),
              right=("dynamic_sampling/tokens_per_kept_group", "tokens per kept group")),
    PanelSpec("generation ahead", "seconds per step",
              ("async_generation/trainer_wait", "async_generation/generator_idle"),
              right=("async_generation/staleness", "staleness (optimizer steps)")),
    PanelSpec("completion length", "tokens",
              ("completions/mean_length", "completions/min_length", "completions/max_length")),
    PanelSpec("truncated share", "share of completions", ("completions/clipped_ratio",)),
    PanelSpec("entropy", "nats per token", ("entropy",)),
    PanelSpec("kl", "nats per token", ("kl",)),
    PanelSpec("clip ratios", "share of tokens",
              ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "cispo_clip_ratio")),
    PanelSpec("loss", "loss", ("loss", "policy_loss")),
    PanelSpec("learning rate", "learning rate", ("learning_rate",)),
    PanelSpec("engine diagnostics", "value", pick=_diagnostics),
    PanelSpec(LOGGED, "value"),
)
"""Panels of the curves view. "reward per function" takes every ``rewards/<fn>/mean`` column,
"engine diagnostics" what the engine logs for some settings (the adaptive entropy weight, a MoE
router's auxiliary loss, vespo's sequence weight, off-policy masking, vLLM sampling statistics, tool calls), and "logged
metrics" every column no grpo_lab metric claims: those reward functions added with ``log_metric``."""

_NOT_DRAWN = {
    "step", "step_time", "epoch", "num_tokens", "update_skipped", "backward_skipped_fraction",
    "completions/mean_terminated_length", "completions/min_terminated_length", "completions/max_terminated_length",
    "clip_ratio/low_min", "clip_ratio/high_max",
}
"""grpo_lab's metrics that no panel draws (counters, and statistics a drawn series summarises)."""


_EVALUATED = ("reward", "frac_reward_zero_std", "completions/mean_length", "completions/clipped_ratio", "entropy",
              "kl", "loss")
"""Training metrics whose evaluation twin (``eval_reward``...) is drawn beside them; every
``rewards/<fn>/mean`` too."""


def eval_prefixes(columns) -> list[str]:
    """The prefixes of the evaluations' metric names: ``eval``, a named set's ``eval_<name>``, or a
    ``metric_key_prefix`` (every evaluation reports ``<prefix>_reward``)."""
    return sorted({c[: -len("_reward")] for c in columns if c.endswith("_reward")})


def _grpo_lab_names(columns: list[str]) -> set[str]:
    """The columns grpo_lab itself logs, drawn or not: what is left was logged by reward functions."""
    names = set(_NOT_DRAWN) | {"kl"} | {c for c in columns if c.startswith("rewards/")}
    for spec in CURVE_PANELS:
        names.update(spec.columns)
        names.update(spec.band or ())
        names.update(spec.right[:1] if spec.right else ())
        names.update(spec.pick(columns) if spec.pick else ())
    return names


@dataclass
class Series:
    name: str
    x: np.ndarray
    y: np.ndarray
    spread: np.ndarray | None = None  # a band: y ± spread
    right: bool = False  # drawn on the panel's right-hand axis
    absent: np.ndarray | None = None  # True where the step did not log this metric: a plain gap
    evaluation: str | None = None  # an evaluation's series: its prefix ("eval", "eval_hard")
    run: int | None = None  # in a comparison: the run's position, which picks the series' colour
    run_name: str | None = None  # in a comparison: the run's name, the series' legend text

    def nonfinite_steps(self) -> list[float]:
        """Steps that logged a NaN or infinite value: drawn as a gap with a marker (a step that did
        not log the metric at all is a plain gap)."""
        bad = ~np.isfinite(self.y)
        if self.absent is not None:
            bad &= ~self.absent
        return self.x[bad].tolist()


@dataclass
class Panel:
    title: str
    unit: str
    series: list[Series] = field(default_factory=list)
    right_unit: str = ""
    note: str = ""  # said on the panel, e.g. why a loss is zero
    y_range: tuple[float, float] | None = None  # fixed range; None: follow the data
    right_range: tuple[float, float] | None = None  # the right-hand axis's range, its 0 level with the left's


@dataclass
class ConfigMark:
    """A ``session.config_changes`` entry drawn on the x-axis: the step it took effect at."""

    step: int
    text: str


@dataclass
class ForkMark:
    """In a comparison: the step a run was forked from another at, drawn on the x-axis with its name."""

    step: int
    run: int  # the run's position, which picks the mark's colour
    name: str


@dataclass
class Curves:
    panels: list[Panel]
    constant: list[str]  # "name = value" of the panels left out because nothing in them changed
    marks: list[ConfigMark]
    steps: int
    forks: list[ForkMark] = field(default_factory=list)


def panel_columns(columns) -> list[tuple[PanelSpec, list[str]]]:
    """Which history columns each panel draws (panels with no column are left out). The learning
    signal panel is kept when the history has ``frac_reward_zero_std`` or ``grad_norm``."""
    columns = list(columns)
    layout = []
    for spec in CURVE_PANELS:
        if spec.title == LOGGED:
            ours = _grpo_lab_names(columns)
            chosen = [c for c in columns if c not in ours]
        elif spec.pick is not None:
            chosen = spec.pick(columns)
        else:
            chosen = [n for n in spec.columns
                      if n in columns or n == NONZERO_ADVANTAGE and "frac_reward_zero_std" in columns]
            if spec.right and spec.right[0] in columns:
                chosen.append(spec.right[0])
        if chosen:
            layout.append((spec, chosen))
    return layout


def smooth(values, weight: float) -> list[float]:
    """Exponential moving average with start-up bias correction (TensorBoard's smoothing):
    ``s_t = w s_{t-1} + (1 - w) v_t``, shown as ``s_t / (1 - w^n)`` after n finite values.
    ``weight`` 0 returns the values unchanged; NaN values stay NaN and do not enter the average."""
    if not 0 <= weight < 1:
        raise ValueError(f"smoothing weight must be in [0, 1), got {weight!r}.")
    if weight == 0:
        return list(values)
    out, last, count = [], 0.0, 0
    for value in values:
        if value is None or not math.isfinite(value):
            out.append(float("nan"))
            continue
        last = weight * last + (1 - weight) * value
        count += 1
        out.append(last / (1 - weight**count))
    return out


def nonzero_advantage_share(completion_log: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """Per scored batch: the step it was first trained at, and the share of its completions whose
    advantage is not zero (the completions that move the policy; ``1 - frac_reward_zero_std``
    counts groups instead, and a completion equal to its group's mean has advantage 0 too).
    Returns (steps, shares), both shape (number of batches,)."""
    steps = np.array([float(batch["step"][0]) for batch in completion_log if len(batch["step"])])
    shares = np.array([
        float(np.mean(np.asarray(batch["advantage"], dtype=float) != 0.0))
        for batch in completion_log if len(batch["step"])
    ])
    return steps, shares


def loss_is_zero_by_construction(beta: float, steps_per_batch: int, losses) -> bool:
    """Whether the loss curve is rounding noise around 0: with beta 0 and one optimizer step per
    generated batch, the policy that sampled is the policy trained, every ratio is 1, and the loss
    reduces to minus a weighted mean of group-centred advantages, which is 0 when each completion
    carries the same weight (loss_type "grpo") and small otherwise. Its gradient is the advantage-
    weighted sum of log-prob gradients, which is not 0 unless every advantage is. Said only when
    every logged loss is below 1e-6 in absolute value."""
    values = np.asarray(losses, dtype=float)
    finite = values[np.isfinite(values)]
    return beta == 0 and steps_per_batch == 1 and len(finite) > 0 and bool(np.all(np.abs(finite) < 1e-6))


LOSS_ZERO_WATCHED = ("grad_norm", "reward")
"""What :data:`LOSS_ZERO_NOTE` tells the user to watch: drawn even when constant."""

LOSS_ZERO_NOTE = (
    "loss ≈ 0 by construction: beta = 0 and one update per batch, so every ratio is 1 and the "
    "group-centred advantages cancel in the loss value, not in its gradient: watch grad norm and reward."
)


def _flat(values: np.ndarray) -> bool:
    return bool(np.ptp(values) <= 1e-12 * max(1.0, float(np.max(np.abs(values)))))


def is_constant(values: np.ndarray) -> bool:
    finite = values[np.isfinite(values)]
    return len(finite) == len(values) and len(finite) > 0 and _flat(finite)


def flat_y_range(panel: Panel) -> tuple[float, float] | None:
    """An explicit y range for a panel whose left-axis values (a band's edges included) are all
    equal (a plotting library would centre a constant on an arbitrary span); None lets the axis
    follow the data."""
    parts = []
    for s in panel.series:
        if not s.right:
            parts.append(s.y)
            if s.spread is not None:
                parts += [s.y - s.spread, s.y + s.spread]
    values = np.concatenate(parts or [np.array([])])
    values = values[np.isfinite(values)]
    if not len(values) or not _flat(values):
        return None
    centre = float(values[0])
    half = abs(centre) * 0.5 or 1.0
    return (centre - half, centre + half)


def level_right_range(panel: Panel) -> tuple[float, float] | None:
    """The right-hand axis's range, with the same margins as the left's shares so that both zeros
    are level (a norm of 0, no gradient at all, shows on the shares' 0)."""
    values = np.concatenate([s.y[np.isfinite(s.y)] for s in panel.series if s.right] or [np.array([])])
    if panel.y_range is None or not len(values):
        return None
    top = float(max(values.max(), 0.0)) or 1.0
    low, high = panel.y_range
    return (low * top, high * top)


def _short(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def config_marks(config_changes: list[dict]) -> list[ConfigMark]:
    """One mark per step at which config edits took effect, its text listing each edit."""
    by_step: dict[int, list[str]] = {}
    for change in config_changes:
        by_step.setdefault(int(change["step"]), []).append(
            f"{change['field']}: {_short(change['old'])} → {_short(change['new'])}"
        )
    return [ConfigMark(step, "; ".join(edits)) for step, edits in sorted(by_step.items())]


def curve_panels(
    history: pd.DataFrame,
    smoothing: float = 0.0,
    *,
    nonzero_advantage: tuple[np.ndarray, np.ndarray] | None = None,
    loss_zero: bool = False,
    config_changes: list[dict] = (),
    absent: dict[str, np.ndarray] | None = None,
    evaluations: pd.DataFrame | None = None,
) -> Curves:
    """The curves view's data: one panel per metric group, x = optimizer step.

    ``nonzero_advantage``: (steps, shares) from :func:`nonzero_advantage_share`, drawn in the
    learning-signal panel. ``loss_zero``: the loss panel says so (see
    :func:`loss_is_zero_by_construction`) on a fixed range instead of magnifying rounding.
    ``absent``: per column, True at the steps that did not log it (see :func:`absent_steps`), a
    plain gap rather than a non-finite value. ``evaluations``: ``session.evaluations``; each
    evaluated twin of a drawn metric (``eval_reward`` beside ``reward``, per eval set) is a series
    of its panel, at the steps evaluated. Panels constant over two or more steps are left out and
    named in ``constant``, except, with ``loss_zero``, those of the metrics its note says to watch.
    """
    if history.empty:
        return Curves([], [], config_marks(list(config_changes)), 0)
    steps = history["step"].to_numpy(dtype=float)
    absent = absent or {}
    panels, constant = [], []
    for spec, names in panel_columns(history.columns):
        panel = Panel(spec.title, spec.unit, right_unit=spec.right[1] if spec.right else "", y_range=spec.y_range)
        for name in names:
            if name == NONZERO_ADVANTAGE:
                if nonzero_advantage is not None and len(nonzero_advantage[0]):
                    panel.series.append(Series(name, *map(np.asarray, nonzero_advantage)))
                continue
            y = np.asarray(smooth(history[name].to_numpy(dtype=float), smoothing), dtype=float)
            spread = None
            if spec.band and name == spec.band[0] and spec.band[1] in history:
                spread = history[spec.band[1]].to_numpy(dtype=float)
            right = bool(spec.right) and name == spec.right[0]
            panel.series.append(Series(name, steps, y, spread, right=right, absent=absent.get(name)))
            panel.series.extend(_evaluated(evaluations, name))
        if spec.title == "loss" and loss_zero:
            panel.note, panel.y_range = LOSS_ZERO_NOTE, (-1.0, 1.0)
        watched = loss_zero and any(s.name in LOSS_ZERO_WATCHED for s in panel.series)  # the note says to watch them
        if len(steps) >= 2 and not panel.note and not watched and all(is_constant(s.y) for s in panel.series):
            constant.extend(f"{s.name} = {float(s.y[0]):.4g}" for s in panel.series)
            continue
        panel.y_range = panel.y_range or flat_y_range(panel)
        panel.right_range = level_right_range(panel)
        panels.append(panel)
    return Curves(panels, constant, config_marks(list(config_changes)), len(steps))


def _evaluated(evaluations: pd.DataFrame | None, name: str) -> list[Series]:
    """The series of ``name``'s evaluated twins, one per eval set (none for a metric not evaluated)."""
    if evaluations is None or evaluations.empty or not (
            name in _EVALUATED or name.startswith("rewards/") and name.endswith("/mean")):
        return []
    found = []
    for prefix in eval_prefixes(evaluations.columns):
        column = f"{prefix}_{name}"
        if column in evaluations:
            rows = evaluations[evaluations[column].notna()]
            found.append(Series(column, rows["step"].to_numpy(dtype=float), rows[column].to_numpy(dtype=float),
                                evaluation=prefix))
    return found


def absent_steps(rows: list[dict], columns) -> dict[str, np.ndarray]:
    """Per column, True at the history rows (steps) that did not log it: a metric that starts
    mid-run (a KL term switched on, a reward function added) or that a step left out."""
    return {name: np.fromiter((name not in row for row in rows), dtype=bool, count=len(rows)) for name in columns}
