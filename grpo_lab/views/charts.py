"""Static SVG charts: of one batch, the rewards of every group (a strip chart) and a histogram; of
a run, a picture of the curves (what a notebook shows where its live curves cannot be drawn).

Plain SVG strings: they display in any notebook front end, need no JavaScript, and a refresh
replaces them whole. Hover a mark for its numbers, a line for its name.
"""

from __future__ import annotations

import html
from collections import Counter

import numpy as np

from grpo_lab.views.batch import GroupValues, Histogram
from grpo_lab.views.curve_data import Curves, Panel

_HEIGHT, _TOP, _BOTTOM, _LEFT, _RIGHT = 150, 18, 22, 44, 10
_AXIS = "stroke:#999;stroke-width:1"
_TEXT = "font-size:10px;fill:#444;font-family:sans-serif"


def _frame(width: int, title: str, low: float, high: float, body: str) -> str:
    """An SVG with a title (cut to the width, whole on hover), a y axis from ``low`` to ``high`` and
    ``body`` drawn inside."""
    bottom = _HEIGHT - _BOTTOM
    room = (width - _LEFT) // 6  # characters of 10px sans-serif
    shown = title if len(title) <= room else title[: room - 1] + "…"
    return (
        f"<svg class='grpo-chart' width='{width}' height='{_HEIGHT}' viewBox='0 0 {width} {_HEIGHT}' "
        "xmlns='http://www.w3.org/2000/svg'>"
        f"<text x='{_LEFT}' y='11' "
        f"style='{_TEXT};font-weight:bold'>{html.escape(shown)}<title>{html.escape(title)}</title></text>"
        f"<line x1='{_LEFT}' y1='{_TOP}' x2='{_LEFT}' y2='{bottom}' style='{_AXIS}'/>"
        f"<line x1='{_LEFT}' y1='{bottom}' x2='{width - _RIGHT}' y2='{bottom}' style='{_AXIS}'/>"
        f"<text x='{_LEFT - 3}' y='{_TOP + 4}' text-anchor='end' style='{_TEXT}'>{high:.3g}</text>"
        f"<text x='{_LEFT - 3}' y='{bottom}' text-anchor='end' style='{_TEXT}'>{low:.3g}</text>"
        f"{body}</svg>"
    )


def _y(value: float, low: float, high: float) -> float:
    span = high - low
    return _HEIGHT - _BOTTOM - (value - low) / span * (_HEIGHT - _TOP - _BOTTOM)


def reward_strip_svg(values: GroupValues, title: str) -> str:
    """Every completion's value in its group (x: group, y: value); equal values of a group share one
    dot, larger by their count; a dash marks each group's mean."""
    numbers = [v for group in values.values for v in group]
    if not numbers:
        return f"<p class='grpo-chart'>{html.escape(title)}: no values.</p>"
    low, high = min(numbers), max(numbers)
    if low == high:
        low, high = low - 0.5, high + 0.5
    step = 26 if len(values.groups) <= 24 else 12
    width = max(160, _LEFT + _RIGHT + step * len(values.groups) + 10)
    label_every = 1 if len(values.groups) <= 24 else max(1, len(values.groups) // 12)
    marks = []
    for k, (group, group_values) in enumerate(zip(values.groups, values.values, strict=True)):
        x = _LEFT + 10 + step * k + step / 2
        if k % label_every == 0:
            marks.append(f"<text x='{x:.1f}' y='{_HEIGHT - 8}' text-anchor='middle' style='{_TEXT}'>{group}</text>")
        for value, count in sorted(Counter(group_values).items()):
            radius = 3 + 1.5 * (count - 1) ** 0.5
            marks.append(
                f"<circle cx='{x:.1f}' cy='{_y(value, low, high):.1f}' r='{radius:.1f}' fill='rgba(31,119,180,0.6)'>"
                f"<title>group {group}: {value:.3f} × {count}</title></circle>"
            )
        if group_values:
            mean = sum(group_values) / len(group_values)
            y = _y(mean, low, high)
            marks.append(
                f"<line x1='{x - step / 3:.1f}' y1='{y:.1f}' x2='{x + step / 3:.1f}' y2='{y:.1f}' "
                f"style='stroke:#d62728;stroke-width:2'><title>group {group}: mean {mean:.3f}</title></line>"
            )
    missing = f" ({values.missing} None)" if values.missing else ""
    return _frame(width, f"{title}{missing}", low, high, "".join(marks))


def histogram_svg(histogram: Histogram, title: str) -> str:
    """Bars of a histogram, the count of each bin on hover; the x axis labelled at both ends."""
    if not histogram.counts:
        return f"<p class='grpo-chart'>{html.escape(title)}: no values.</p>"
    bar, width = 16, max(160, _LEFT + _RIGHT + 16 * len(histogram.counts))
    top = max(histogram.counts)
    bars = []
    for k, count in enumerate(histogram.counts):
        left, right = histogram.edges[k], histogram.edges[k + 1]
        y = _y(count, 0, top)
        bars.append(
            f"<rect x='{_LEFT + bar * k + 1}' y='{y:.1f}' width='{bar - 2}' height='{_HEIGHT - _BOTTOM - y:.1f}' "
            f"fill='rgba(31,119,180,0.7)'><title>[{left:.3g}, {right:.3g}]: {count}</title></rect>"
        )
    end = _LEFT + bar * len(histogram.counts)
    bars.append(f"<text x='{_LEFT}' y='{_HEIGHT - 8}' style='{_TEXT}'>{histogram.edges[0]:.3g}</text>")
    bars.append(f"<text x='{end}' y='{_HEIGHT - 8}' text-anchor='end' style='{_TEXT}'>{histogram.edges[-1]:.3g}</text>")
    return _frame(width, title, 0, top, "".join(bars))


_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")
_CURVE_WIDTH = 300


def _range(values: np.ndarray, fixed: tuple[float, float] | None) -> tuple[float, float]:
    finite = values[np.isfinite(values)]
    if fixed is not None:
        return fixed
    if not len(finite):
        return -1.0, 1.0
    low, high = float(finite.min()), float(finite.max())
    return (low - 0.5, high + 0.5) if low == high else (low, high)


def curve_points(x: np.ndarray, y: np.ndarray, steps: tuple[float, float], low: float, high: float,
                 width: int = _CURVE_WIDTH) -> list[str]:
    """The ``points`` of one polyline per run of finite values (a NaN, which a step that did not log the
    metric also is in the history's frame, is a gap):
    x from ``steps`` (first, last) across the plot, y from ``low`` to ``high`` up the plot."""
    first, last = steps
    span = (last - first) or 1.0
    lines, current = [], []
    for step, value in zip(x.tolist(), y.tolist()):
        if not np.isfinite(value):
            lines, current = (lines + [current] if current else lines), []
            continue
        px = _LEFT + (step - first) / span * (width - _LEFT - _RIGHT)
        current.append(f"{px:.1f},{_y(value, low, high):.1f}")
    return [" ".join(line) for line in [*lines, current] if line]


def _panel_svg(panel: Panel, steps: tuple[float, float]) -> str:
    left = np.concatenate([s.y for s in panel.series if not s.right] or [np.array([])])
    low, high = _range(left, panel.y_range)
    right = [s for s in panel.series if s.right]
    right_low, right_high = _range(np.concatenate([s.y for s in right]), panel.right_range) if right else (0, 1)
    body, legend = [], []
    for k, series in enumerate(panel.series):
        colour = _COLOURS[k % len(_COLOURS)]
        bounds = (right_low, right_high) if series.right else (low, high)
        for points in curve_points(series.x, series.y, steps, *bounds):
            body.append(f"<polyline points='{points}' fill='none' stroke='{colour}' stroke-width='1.5'>"
                        f"<title>{html.escape(series.name)}</title></polyline>")
        side = f" (right: {right_low:.3g} to {right_high:.3g})" if series.right else ""
        legend.append(f"<span style='color:{colour}'>■</span> {html.escape(series.name)}{side}")
    body.append(f"<text x='{_LEFT}' y='{_HEIGHT - 8}' style='{_TEXT}'>step {steps[0]:g}</text>")
    body.append(f"<text x='{_CURVE_WIDTH - _RIGHT}' y='{_HEIGHT - 8}' text-anchor='end' style='{_TEXT}'>"
                f"{steps[1]:g}</text>")
    chart = _frame(_CURVE_WIDTH, panel.title + (f" [{panel.unit}]" if panel.unit else ""), low, high, "".join(body))
    return (f"<div style='display:inline-block;vertical-align:top;margin:2px 6px 6px 0'>{chart}"
            f"<div style='{_TEXT};max-width:{_CURVE_WIDTH}px'>{' '.join(legend)}</div></div>")


def curves_svg(curves: Curves) -> str:
    """A static picture of the curves view: one small chart per panel, every series a line (its name
    on hover and in the legend under it), the panels left out as constant named after them."""
    if not curves.panels:
        return "<p>No optimizer step yet.</p>"
    x = np.concatenate([s.x for panel in curves.panels for s in panel.series])
    steps = (float(x.min()), float(x.max()))
    constant = (f"<p style='{_TEXT}'>Constant: {html.escape(', '.join(curves.constant))}</p>"
                if curves.constant else "")
    return "<div>" + "".join(_panel_svg(panel, steps) for panel in curves.panels) + f"</div>{constant}"
