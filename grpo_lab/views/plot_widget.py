"""The curves figure as a widget whose synced state is the whole picture.

Every browser view of it draws from the current state when it is created and redraws on each
change, so a view created at any moment (a fresh kernel's first display, a second ``show()``, a
page reload) shows what the kernel holds. plotly's own ``FigureWidget`` instead sends its data and
layout once, at creation, and every later change as a transient message that only the views
listening at that moment receive; a view created later draws the creation-time figure.

plotly.js comes from the installed ``plotly`` package and travels to the browser once per kernel,
in one shared model (:class:`PlotlyLibrary`) that every curves widget refers to.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import anywidget
import ipywidgets as widgets
import numpy as np
import traitlets

from grpo_lab.views.curve_data import Curves

_library: PlotlyLibrary | None = None


class PlotlyLibrary(widgets.Widget):
    """A model with no view that holds plotly.js's source for the browser."""

    source = traitlets.Unicode().tag(sync=True)


def plotly_library() -> PlotlyLibrary:
    """The kernel's one :class:`PlotlyLibrary` (built on first use; rebuilt if it was closed)."""
    global _library
    if _library is None or _library.comm is None:
        source = resources.files("plotly") / "package_data" / "plotly.min.js"
        _library = PlotlyLibrary(source=source.read_text(encoding="utf-8"))
    return _library


class CurvesWidget(anywidget.AnyWidget):
    """Panels of line plots drawn by plotly.js from ``spec`` (JSON) and ``arrays`` (float64
    buffers the spec's series point into); see :func:`curves_state`."""

    _esm = Path(__file__).with_name("curves.js")
    _library = traitlets.Instance(PlotlyLibrary).tag(sync=True, **widgets.widget_serialization)
    spec = traitlets.Dict().tag(sync=True)
    arrays = traitlets.List().tag(sync=True)

    def __init__(self, **kwargs):
        super().__init__(_library=plotly_library(), **kwargs)

    def show_curves(self, curves: Curves, empty_text: str) -> None:
        """Replace the whole picture in one message."""
        spec, arrays = curves_state(curves, empty_text)
        with self.hold_sync():
            self.arrays = arrays
            self.spec = spec


def curves_state(curves: Curves, empty_text: str) -> tuple[dict, list[bytes]]:
    """The widget's state for ``curves``: a JSON spec and the float64 buffers its series index.
    Non-finite values travel as NaN (a gap in the line); the steps where they were are listed so
    that the plot marks them."""
    arrays: list[bytes] = []
    index: dict[int, int] = {}

    def buffer(values: np.ndarray) -> int:
        key = id(values)
        if key not in index:
            clean = np.where(np.isfinite(values), values, np.nan).astype("<f8")
            index[key] = len(arrays)
            arrays.append(clean.tobytes())
        return index[key]

    panels = []
    for panel in curves.panels:
        series = [
            {
                "name": s.name,
                "x": buffer(s.x),
                "y": buffer(s.y),
                "spread": None if s.spread is None else buffer(s.spread),
                "right": s.right,
                "evaluation": s.evaluation,
                "run": s.run,
                "run_name": s.run_name,
                "nonfinite": s.nonfinite_steps(),
            }
            for s in panel.series
        ]
        panels.append({
            "title": panel.title, "unit": panel.unit, "right_unit": panel.right_unit, "note": panel.note,
            "y_range": list(panel.y_range) if panel.y_range else None,
            "right_range": list(panel.right_range) if panel.right_range else None, "series": series,
        })
    spec = {
        "panels": panels,
        "constant": curves.constant,
        "marks": [{"step": m.step, "text": m.text} for m in curves.marks],
        "forks": [{"step": f.step, "run": f.run, "name": f.name} for f in curves.forks],
        "steps": curves.steps,
        "empty_text": empty_text,
    }
    return spec, arrays
