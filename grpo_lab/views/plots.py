"""Plotly figures of the curves view, updated in place (never rebuilt) as steps arrive."""

from __future__ import annotations

import math

import numpy as np

from grpo_lab.views.curve_data import Panel

COLUMNS = 3


def curves_figure(panels: list[Panel]):
    """A ``plotly.graph_objects.FigureWidget`` grid of small plots, one per panel and one trace per
    series, x = optimizer step."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    rows = max(1, math.ceil(len(panels) / COLUMNS))
    figure = make_subplots(
        rows=rows, cols=COLUMNS, subplot_titles=[p.title for p in panels] or ["no steps yet"],
        horizontal_spacing=0.07, vertical_spacing=0.5 / rows,
    )
    for k, panel in enumerate(panels):
        for series in panel.series:
            figure.add_trace(
                go.Scatter(x=np.asarray(series.x, dtype=float), y=np.asarray(series.y, dtype=float), name=series.name, mode="lines+markers",
                           marker={"size": 4}, legendgroup=panel.title, hovertemplate="%{y:.4g}<extra>" + series.name + "</extra>"),
                row=k // COLUMNS + 1, col=k % COLUMNS + 1,
            )
    figure.update_layout(
        height=230 * rows, margin={"l": 40, "r": 10, "t": 30, "b": 20}, showlegend=False,
        template="plotly_white", font={"size": 10},
    )
    figure.update_yaxes(tickformat=".3~g", exponentformat="e")
    _set_ranges(figure, panels)
    figure.update_annotations(font_size=11)
    return go.FigureWidget(figure)


def _y_range(panel: Panel):
    """An explicit y range for a flat panel (plotly would centre a constant on [-1, 1]); else None."""
    values = [v for s in panel.series for v in s.y if math.isfinite(v)]
    if not values or max(values) - min(values) > 1e-12 * max(1.0, abs(max(values))):
        return None
    centre = values[0]
    half = abs(centre) * 0.5 or 1.0
    return [centre - half, centre + half]


def _set_ranges(figure, panels: list[Panel]) -> None:
    for k, panel in enumerate(panels):
        axis = figure.layout["yaxis" if k == 0 else f"yaxis{k + 1}"]
        span = _y_range(panel)
        if span is None:
            axis.autorange = True
        else:
            axis.range = span


def layout_of(panels: list[Panel]) -> list[tuple[str, tuple[str, ...]]]:
    return [(p.title, tuple(s.name for s in p.series)) for p in panels]


def update_curves(figure, panels: list[Panel]) -> None:
    """Replace the x/y data of every trace in one batch (the layout must match ``layout_of``)."""
    series = [s for p in panels for s in p.series]
    with figure.batch_update():
        for trace, item in zip(figure.data, series, strict=True):
            # numpy arrays skip plotly's per-element validation and travel as binary buffers
            trace.x = np.asarray(item.x, dtype=float)
            trace.y = np.asarray(item.y, dtype=float)
        _set_ranges(figure, panels)
