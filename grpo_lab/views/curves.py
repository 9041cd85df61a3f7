"""The training curves view."""

from __future__ import annotations

import ipywidgets as widgets

from grpo_lab.views import curve_data, plots
from grpo_lab.views.base import View, guarded


class CurvesView(View):
    """Training curves, one small plot per metric group, extended in place after every update()."""

    events = ("update",)

    def __init__(self, session):
        self.smoothing = widgets.FloatSlider(value=0.0, min=0.0, max=0.99, step=0.01, description="smoothing",
                                             continuous_update=False)
        self.placeholder = widgets.HTML("<p>No optimizer step yet: the curves start after the first update().</p>")
        self.figure = None
        self._layout = None
        super().__init__(session, [self.smoothing, self.placeholder])
        self.add_class("grpo-curves")
        self.smoothing.observe(lambda change: self.refresh(), names="value")
        self.refresh()

    @guarded
    def refresh(self) -> None:
        panels = curve_data.curve_panels(self.session.history, self.smoothing.value)
        if not panels:
            return
        layout = plots.layout_of(panels)
        if layout == self._layout:
            plots.update_curves(self.figure, panels)
            return
        self.figure, self._layout = plots.curves_figure(panels), layout
        self.children = [self.smoothing, self.figure, self.error]
