"""Pure data for ``grpo_lab.compare``: several runs -> the curves view's panels with one named series
per run on shared axes, and the table of config fields that differ. No widgets, no plotly.

The panels are the curves view's (:data:`grpo_lab.views.curve_data.CURVE_PANELS`), with these
departures, so that runs drawn over each other stay readable and runs of every kind compare alike:
bands (reward ± reward_std) are left out, as two runs' bands over each other hide both lines; the
share of completions with A ≠ 0 and the evaluations' series are left out, as a trainer's
``metrics.jsonl`` does not hold them. A series is coloured by its run; in a panel of several
metrics, each metric of a run has a line style of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from grpo_lab.views.curve_data import (
    NONZERO_ADVANTAGE, Curves, ForkMark, Panel, PanelSpec, Series, absent_steps, flat_y_range, is_constant,
    level_right_range, panel_columns, smooth,
)

ABSENT = "(not in this config)"
"""A config table's cell for a field that one run's config does not have (saved by another version)."""


@dataclass
class Run:
    """One run of a comparison, whatever it was read from (see :mod:`grpo_lab.views.compare_runs`)."""

    name: str
    rows: list[dict]
    """One per optimizer step: ``step`` and TRL's metric names (``session.history``'s rows)."""
    config: dict | None
    """The config's fields; None where the run saved none (a trainer output_dir without checkpoints)."""
    fork_point: int | None = None
    """The global step this run was forked from another at, marked on every panel."""
    source: str = ""
    """What it was read from, in words: "session", "saved session in <dir>"..."""
    session: object | None = None
    """The live session it follows, read again at every refresh; None for a run read from files."""


def run_names(defaults: list[str | None], names=None) -> list[str]:
    """Each run's name: ``names`` where given (one per run), else its own name, else "run <position>"
    (from 1); a name taken by an earlier run gets " (2)", " (3)"..."""
    if names is not None:
        names = [str(name) for name in names]
        if len(names) != len(defaults):
            raise ValueError(f"names= has {len(names)} name(s) for {len(defaults)} run(s): give one name per run.")
    chosen = names or [name or f"run {position}" for position, name in enumerate(defaults, start=1)]
    unique: list[str] = []
    for name in chosen:
        candidate, count = name, 1
        while candidate in unique:
            count += 1
            candidate = f"{name} ({count})"
        unique.append(candidate)
    return unique


def drawn_metrics(rows: list[dict]) -> list[str]:
    """The metrics of ``rows`` that a panel draws, in panel order."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    return [name for _, names in panel_columns(columns) for name in names if name != NONZERO_ADVANTAGE]


def check_shared_metrics(runs: list[Run]) -> None:
    """Raise ValueError where two runs that logged steps have no drawn metric in common: there is no
    panel on which they could be compared. A run with no step yet (a live session) is left out."""
    logged = [(run, drawn_metrics(run.rows)) for run in runs if run.rows]
    if len(logged) < 2 or set.intersection(*(set(metrics) for _, metrics in logged)):
        return
    said = "; ".join(f"{run.name} ({run.source}): {', '.join(metrics[:6]) or 'none'}" for run, metrics in logged)
    raise ValueError(
        f"These runs share no metric to draw on shared axes. Metrics logged: {said}. Compare runs that log TRL's "
        "metric names (reward, loss, entropy...), as every GRPOSession and GRPOTrainer does: a metrics.jsonl "
        "written by another tool needs its columns renamed to them first."
    )


def compare_panels(runs: list[Run], smoothing: float = 0.0) -> Curves:
    """The comparison's data: every panel of the curves view that any run has a metric of, with one
    series per run (and metric) at the steps that run logged, on the panel's shared axes.

    A panel's metric that only some runs logged is drawn for those, and the panel's note says so.
    A panel is left out (and named in ``constant``) where every run logged two or more steps and
    each of its metrics is constant and equal across the runs. Runs with a ``fork_point`` get a
    :class:`ForkMark`. Raises ValueError where runs share no metric (:func:`check_shared_metrics`).
    """
    check_shared_metrics(runs)
    histories = [pd.DataFrame(run.rows) for run in runs]
    columns = list(dict.fromkeys(column for history in histories for column in history.columns))
    panels, constant = [], []
    for spec, names in panel_columns(columns):
        names = [name for name in names if name != NONZERO_ADVANTAGE]
        panel = Panel(spec.title, spec.unit, right_unit=spec.right[1] if spec.right else "", y_range=spec.y_range)
        for index, (run, history) in enumerate(zip(runs, histories)):
            absent = absent_steps(run.rows, [name for name in names if name in history])
            for name in names:
                if name in history:
                    panel.series.append(_run_series(history, name, index, run.name, smoothing, spec, absent[name]))
        panel.note = _missing_note(names, runs, histories)
        if not panel.series:
            continue
        if _unchanged(panel, histories):
            first = {series.name: float(series.y[0]) for series in reversed(panel.series)}
            constant.extend(f"{name} = {first[name]:.4g}" for name in names)
            continue
        panel.y_range = panel.y_range or flat_y_range(panel)
        panel.right_range = level_right_range(panel)
        panels.append(panel)
    forks = [ForkMark(int(run.fork_point), index, run.name) for index, run in enumerate(runs)
             if run.fork_point is not None]
    return Curves(panels, constant, [], max((len(history) for history in histories), default=0), forks)


def _run_series(history: pd.DataFrame, name: str, run: int, run_name: str, smoothing: float, spec: PanelSpec,
                absent: np.ndarray) -> Series:
    steps = history["step"].to_numpy(dtype=float)
    y = np.asarray(smooth(history[name].to_numpy(dtype=float), smoothing), dtype=float)
    right = bool(spec.right) and name == spec.right[0]
    return Series(name, steps, y, right=right, absent=absent, run=run, run_name=run_name)


def _missing_note(names: list[str], runs: list[Run], histories: list[pd.DataFrame]) -> str:
    """Which of the panel's metrics only some of the runs that logged steps have, and which runs."""
    logged = [(run, history) for run, history in zip(runs, histories) if len(history)]
    notes = []
    for name in names:
        having = [run.name for run, history in logged if name in history]
        if having and len(having) < len(logged):
            notes.append(f"{name} only in {', '.join(having)}")
    return "; ".join(notes)


def _unchanged(panel: Panel, histories: list[pd.DataFrame]) -> bool:
    """Whether every run logged two or more steps and every metric of the panel is constant, with
    one value across the runs."""
    if panel.note or any(len(history) < 2 for history in histories):
        return False
    values: dict[str, set[float]] = {}
    for series in panel.series:
        if not is_constant(series.y):
            return False
        values.setdefault(series.name, set()).add(float(series.y[0]))
    return all(len(found) == 1 for found in values.values())


def _plain(value):
    return [_plain(item) for item in value] if isinstance(value, (list, tuple)) else value


def config_differences(runs: list[Run]) -> pd.DataFrame:
    """The config fields whose values differ between the runs that have a config: one row per field
    (the index), one column per run, each cell that run's value (:data:`ABSENT` where its config
    lacks the field). Runs without a config are left out; with fewer than two configs, or none that
    differ, the frame is empty."""
    configs = {run.name: run.config for run in runs if run.config is not None}
    if len(configs) < 2:
        return pd.DataFrame()
    fields = list(dict.fromkeys(name for config in configs.values() for name in config))
    differing = [
        name for name in fields
        if len({repr(_plain(config.get(name, ABSENT))) for config in configs.values()}) > 1
    ]
    return pd.DataFrame(
        {run: [config.get(name, ABSENT) for name in differing] for run, config in configs.items()},
        index=pd.Index(differing, name="field"),
    )
