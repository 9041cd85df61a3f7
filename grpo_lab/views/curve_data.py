"""Pure data for the curves view: the session's history -> panels of series. No widgets, no plotly."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pandas as pd

CURVE_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("reward", "reward_std")),
    ("reward per function", ()),
    ("completion length", ("completions/mean_length", "completions/min_length", "completions/max_length")),
    ("truncated share", ("completions/clipped_ratio",)),
    ("entropy", ("entropy",)),
    ("kl", ("kl",)),
    ("clip ratios", ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")),
    ("loss", ("loss",)),
    ("grad_norm", ("grad_norm",)),
    ("learning rate", ("learning_rate",)),
    ("logged metrics", ()),
)
"""Panels of the curves view: title and the history columns drawn in it. "reward per function"
takes every ``rewards/<fn>/mean`` column and "logged metrics" every column a reward function added
with ``log_metric``."""

_BOOKKEEPING = {"step", "step_time", "epoch", "num_tokens", "update_skipped", "frac_reward_zero_std"}


@dataclass
class Series:
    name: str
    x: list[float]
    y: list[float]


@dataclass
class Panel:
    title: str
    series: list[Series] = field(default_factory=list)


def panel_columns(columns) -> list[tuple[str, list[str]]]:
    """Which history columns each panel draws (panels with no column are left out)."""
    columns = list(columns)
    known = {name for _, names in CURVE_PANELS for name in names}
    per_function = [c for c in columns if c.startswith("rewards/") and c.endswith("/mean")]
    logged = [
        c for c in columns
        if c not in known and c not in _BOOKKEEPING and not c.startswith(("rewards/", "completions/", "clip_ratio/"))
    ]
    layout = []
    for title, names in CURVE_PANELS:
        chosen = per_function if title == "reward per function" else logged if title == "logged metrics" else [
            n for n in names if n in columns
        ]
        if chosen:
            layout.append((title, chosen))
    return layout


def smooth(values: list[float], weight: float) -> list[float]:
    """Exponential moving average with start-up bias correction (TensorBoard's smoothing):
    ``s_t = w s_{t-1} + (1 - w) v_t``, shown as ``s_t / (1 - w^n)`` after n finite values.
    ``weight`` 0 returns the values unchanged; NaN values stay NaN and do not enter the average."""
    if not 0 <= weight < 1:
        raise ValueError(f"smoothing weight must be in [0, 1), got {weight!r}.")
    if weight == 0:
        return list(values)
    out, last, count = [], 0.0, 0
    for value in values:
        if value is None or math.isnan(value):
            out.append(float("nan"))
            continue
        last = weight * last + (1 - weight) * value
        count += 1
        out.append(last / (1 - weight**count))
    return out


def curve_panels(history: pd.DataFrame, smoothing: float = 0.0) -> list[Panel]:
    """The curves view's data: one panel per metric group, x = optimizer step."""
    if history.empty:
        return []
    steps = history["step"].astype(float).tolist()
    panels = []
    for title, names in panel_columns(history.columns):
        series = [Series(name, steps, smooth(history[name].astype(float).tolist(), smoothing)) for name in names]
        panels.append(Panel(title, series))
    return panels
