"""Pure data for the curves view: the session's history -> panels of series. No widgets, no plotly.

A panel is one small plot: its series share the x-axis (optimizer step) and a y-axis with a unit;
a panel may draw one series as a band (centre ± spread), put one series on a right-hand axis, and
carry a note that explains what it shows. Panels whose every series is constant over the history
are not drawn: they are listed in one summary line instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

LEARNING_SIGNAL = "learning signal"
NONZERO_ADVANTAGE = "completions with A ≠ 0"
SHARE_RANGE = (-0.05, 1.05)  # shares of a batch, drawn on the whole of [0, 1]


@dataclass(frozen=True)
class PanelSpec:
    title: str
    unit: str
    columns: tuple[str, ...] = ()
    band: tuple[str, str] | None = None  # (centre, spread): draw centre ± spread as a band
    right: tuple[str, str] | None = None  # (column, unit) drawn on a right-hand y-axis


CURVE_PANELS: tuple[PanelSpec, ...] = (
    PanelSpec("reward", "reward (mean)", ("reward",), band=("reward", "reward_std")),
    PanelSpec("reward per function", "reward (mean)"),
    PanelSpec(LEARNING_SIGNAL, "share", ("frac_reward_zero_std", NONZERO_ADVANTAGE), right=("grad_norm", "grad norm")),
    PanelSpec("completion length", "tokens",
              ("completions/mean_length", "completions/min_length", "completions/max_length")),
    PanelSpec("truncated share", "share of completions", ("completions/clipped_ratio",)),
    PanelSpec("entropy", "nats per token", ("entropy",)),
    PanelSpec("kl", "nats per token", ("kl",)),
    PanelSpec("clip ratios", "share of tokens", ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")),
    PanelSpec("loss", "loss", ("loss",)),
    PanelSpec("learning rate", "learning rate", ("learning_rate",)),
    PanelSpec("logged metrics", "value"),
)
"""Panels of the curves view. "reward per function" takes every ``rewards/<fn>/mean`` column and
"logged metrics" every column a reward function added with ``log_metric``."""

_BOOKKEEPING = {
    "step", "step_time", "epoch", "num_tokens", "update_skipped", "frac_reward_zero_std", "reward_std",
    "backward_skipped_fraction", "grad_norm",
}
_SHOWN_ELSEWHERE_PREFIXES = ("rewards/", "completions/", "clip_ratio/")


@dataclass
class Series:
    name: str
    x: np.ndarray
    y: np.ndarray
    spread: np.ndarray | None = None  # a band: y ± spread
    right: bool = False  # drawn on the panel's right-hand axis

    def nonfinite_steps(self) -> list[float]:
        """Steps where the value is NaN or infinite: drawn as a gap with a marker."""
        return self.x[~np.isfinite(self.y)].tolist()


@dataclass
class Panel:
    title: str
    unit: str
    series: list[Series] = field(default_factory=list)
    right_unit: str = ""
    note: str = ""  # said on the panel, e.g. why a loss is zero
    y_range: tuple[float, float] | None = None  # fixed range; None: follow the data


@dataclass
class ConfigMark:
    """A ``session.config_changes`` entry drawn on the x-axis: the step it took effect at."""

    step: int
    text: str


@dataclass
class Curves:
    panels: list[Panel]
    constant: list[str]  # "name = value" of the panels left out because nothing in them changed
    marks: list[ConfigMark]
    steps: int


def panel_columns(columns) -> list[tuple[PanelSpec, list[str]]]:
    """Which history columns each panel draws (panels with no column are left out). The learning
    signal panel is kept when the history has ``frac_reward_zero_std`` or ``grad_norm``."""
    columns = list(columns)
    known = {name for spec in CURVE_PANELS for name in spec.columns} | {"kl"}
    per_function = [c for c in columns if c.startswith("rewards/") and c.endswith("/mean")]
    logged = [c for c in columns if c not in known and c not in _BOOKKEEPING and not c.startswith(_SHOWN_ELSEWHERE_PREFIXES)]
    layout = []
    for spec in CURVE_PANELS:
        if spec.title == "reward per function":
            chosen = per_function
        elif spec.title == "logged metrics":
            chosen = logged
        else:
            chosen = [n for n in spec.columns if n in columns or n == NONZERO_ADVANTAGE and "frac_reward_zero_std" in columns]
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
        float(np.mean(np.asarray(batch["advantage"], dtype=float) != 0.0)) for batch in completion_log if len(batch["step"])
    ])
    return steps, shares


def loss_is_zero_by_construction(beta: float, steps_per_batch: int, losses) -> bool:
    """Whether the loss curve is rounding noise around 0: with beta 0 and one optimizer step per
    generated batch, the policy that sampled is the policy trained, every ratio is 1, and the loss
    reduces to minus a weighted mean of group-centred advantages, which is 0 when each completion
    carries the same weight (loss_type "grpo") and small otherwise. The gradient is not zero. Said
    only when every logged loss is below 1e-6 in absolute value."""
    values = np.asarray(losses, dtype=float)
    finite = values[np.isfinite(values)]
    return beta == 0 and steps_per_batch == 1 and len(finite) > 0 and bool(np.all(np.abs(finite) < 1e-6))


LOSS_ZERO_NOTE = (
    "loss ≈ 0 by construction: beta = 0 and one update per batch, so every ratio is 1 and the "
    "group-centred advantages cancel. The gradient is not 0: watch grad norm and reward."
)


def _is_constant(values: np.ndarray) -> bool:
    finite = values[np.isfinite(values)]
    if len(finite) != len(values) or not len(finite):
        return False
    return bool(np.ptp(finite) <= 1e-12 * max(1.0, float(np.max(np.abs(finite)))))


def _y_range(panel: Panel) -> tuple[float, float] | None:
    """An explicit y range for a panel whose left-axis values are all equal (a plotting library
    would centre a constant on an arbitrary span); None lets the axis follow the data."""
    values = np.concatenate([s.y[np.isfinite(s.y)] for s in panel.series if not s.right] or [np.array([])])
    if not len(values) or np.ptp(values) > 1e-12 * max(1.0, float(np.max(np.abs(values)))):
        return None
    centre = float(values[0])
    half = abs(centre) * 0.5 or 1.0
    return (centre - half, centre + half)


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
) -> Curves:
    """The curves view's data: one panel per metric group, x = optimizer step.

    ``nonzero_advantage``: (steps, shares) from :func:`nonzero_advantage_share`, drawn in the
    learning-signal panel. ``loss_zero``: the loss panel says so (see
    :func:`loss_is_zero_by_construction`) on a fixed range instead of magnifying rounding.
    Panels constant over two or more steps are left out and named in ``constant``.
    """
    if history.empty:
        return Curves([], [], config_marks(list(config_changes)), 0)
    steps = history["step"].to_numpy(dtype=float)
    panels, constant = [], []
    for spec, names in panel_columns(history.columns):
        panel = Panel(spec.title, spec.unit, right_unit=spec.right[1] if spec.right else "")
        for name in names:
            if name == NONZERO_ADVANTAGE:
                if nonzero_advantage is not None and len(nonzero_advantage[0]):
                    panel.series.append(Series(name, *map(np.asarray, nonzero_advantage)))
                continue
            y = np.asarray(smooth(history[name].to_numpy(dtype=float), smoothing), dtype=float)
            spread = None
            if spec.band and name == spec.band[0] and spec.band[1] in history:
                spread = history[spec.band[1]].to_numpy(dtype=float)
            panel.series.append(Series(name, steps, y, spread, right=bool(spec.right) and name == spec.right[0]))
        if spec.title == "loss" and loss_zero:
            panel.note, panel.y_range = LOSS_ZERO_NOTE, (-1.0, 1.0)
        if len(steps) >= 2 and not panel.note and all(_is_constant(s.y) for s in panel.series):
            constant.extend(f"{s.name} = {float(s.y[0]):.4g}" for s in panel.series)
            continue
        if spec.title == LEARNING_SIGNAL:
            panel.y_range = SHARE_RANGE
        panel.y_range = panel.y_range or _y_range(panel)
        panels.append(panel)
    return Curves(panels, constant, config_marks(list(config_changes)), len(steps))
