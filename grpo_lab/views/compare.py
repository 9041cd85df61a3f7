"""``grpo_lab.compare(*runs)``: several runs' training curves on shared axes, one coloured, named
series per run, with their fork points marked and a table of the config fields that differ. A live
session in the comparison is followed as it trains (its ``update`` events redraw the view)."""

from __future__ import annotations

import html
import threading

import ipywidgets as widgets

from grpo_lab.views import compare_data, compare_runs
from grpo_lab.views.base import close_tree, guarded
from grpo_lab.views.curve_data import Curves
from grpo_lab.views.live_note import LiveNote
from grpo_lab.views.plot_widget import CurvesWidget
from grpo_lab.views.render import Column, table_html

EMPTY = "No optimizer step yet in any of the runs: the curves start after the first update()."


def compare(*runs, names=None, smoothing: float = 0.0) -> CompareView:
    """A view of ``runs`` side by side: every curves panel that any run has a metric of, with one
    series per run on the panel's shared axes; the step each forked run was forked at
    (``session.fork_point``), marked with its name; and the config fields that differ between them.

    Each run is a :class:`grpo_lab.GRPOSession` (followed live, as ``session.curves()`` is), a
    directory written by ``session.save()`` (a trainer's ``checkpoint-N`` is one), or a
    :class:`grpo_lab.GRPOTrainer` ``output_dir`` holding ``metrics.jsonl`` (with the config of its
    newest checkpoint, if it saved one). Directories are read without building a model.

    ``names``: one legend name per run; by default a session's ``name``, else the directory's name,
    else "run 1", "run 2"... (a repeated name gets " (2)"). ``smoothing``: the slider's start, as in
    the curves view. A metric only some runs log is drawn for those, and its panel says so.

    Raises ValueError where runs that logged steps share no metric, or a path is not a run; TypeError
    for an object that is not one.
    """
    read = compare_runs.read_runs(runs, names)
    compare_data.check_shared_metrics(read)  # raised to the caller, not shown in the view as a refresh's error
    return CompareView(read, smoothing=smoothing)


class CompareView(widgets.VBox):
    """The widget :func:`compare` returns; ``runs`` holds what it draws (read by
    :func:`grpo_lab.views.compare_runs.read_runs`), ``names`` the runs' names."""

    events = ("update", "undo")  # the session events after which a live session's history has changed

    def __init__(self, runs: list[compare_data.Run], smoothing: float = 0.0):
        self._refresh_lock = threading.RLock()
        self.runs = runs
        self.names = [run.name for run in runs]
        self.curves: Curves | None = None
        self.error = widgets.HTML()
        self.smoothing = widgets.FloatSlider(value=smoothing, min=0.0, max=0.99, step=0.01, description="smoothing",
                                             continuous_update=False)
        self.summary = widgets.HTML()
        self.figure = CurvesWidget()
        self.config_table = widgets.HTML()
        sessions = list(dict.fromkeys(run.session for run in self.runs if run.session is not None))
        self.live = LiveNote(step=max((session.global_step for session in sessions), default=0))
        super().__init__([self.live, self.summary, self.smoothing, self.figure, self.config_table, self.error])
        self.add_class("grpo-compare")
        self._unsubscribe = [session.on(self._on_event) for session in sessions]
        self.smoothing.observe(lambda change: self.refresh(), names="value")
        self.refresh()

    def _on_event(self, stage, result) -> None:
        self.live.heard(max(run.session.global_step for run in self.runs if run.session is not None))
        if stage in self.events:
            self.refresh()

    @guarded
    def refresh(self) -> None:
        self.runs = [compare_runs.current(run) for run in self.runs]
        self.curves = compare_data.compare_panels(self.runs, self.smoothing.value)
        self.summary.value = _summary_html(self.runs)
        self.config_table.value = _config_html(self.runs)
        self.figure.show_curves(self.curves, EMPTY)

    def close(self) -> None:
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        close_tree(self)


def _summary_html(runs: list[compare_data.Run]) -> str:
    """One line per run: its name, where it comes from, its steps and its fork point."""
    lines = []
    for run in runs:
        fork = f", forked at step {run.fork_point}" if run.fork_point is not None else ""
        said = f"{html.escape(run.source)}, {len(run.rows)} step(s){fork}"
        lines.append(f"<li><b>{html.escape(run.name)}</b>: {said}</li>")
    return f"<ul class='grpo-compare-runs' style='margin:2px 0'>{''.join(lines)}</ul>"


def _config_html(runs: list[compare_data.Run]) -> str:
    """The table of :func:`grpo_lab.views.compare_data.config_differences`, naming runs with no config."""
    differences = compare_data.config_differences(runs)
    without = [run.name for run in runs if run.config is None]
    note = (f"<p style='margin:2px 0;color:#555'>No config saved: {html.escape(', '.join(without))} (a trainer "
            "output_dir without a checkpoint).</p>" if without else "")
    if differences.empty:
        configs = len(runs) - len(without)
        said = "The configs do not differ." if configs >= 2 else "Fewer than two runs have a config to compare."
        return f"<p style='margin:6px 0 2px'><b>Config differences</b>: {said}</p>{note}"
    frame = differences.map(_text).reset_index(names="config field")
    columns = [Column("config field", "field", "the config field", text=True)] + [
        Column(name, name, f"{name}'s value", text=True) for name in differences.columns
    ]
    return table_html(frame, columns, "Config differences", css_class="grpo-table grpo-compare-config") + note


def _text(value) -> str:
    return value if isinstance(value, str) else repr(value)
