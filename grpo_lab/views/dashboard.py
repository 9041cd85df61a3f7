"""``session.show()``: controls, curves (with its forks overlaid, on request), completions, rewards and
findings of one session, live.

Displayed, a dashboard is two outputs: a static picture of the curves (:func:`charts.curves_svg`)
that says it is not live, then the widget. A live widget hides the picture as it draws (the views'
live note does); where no widget can be drawn (a notebook reopened after its kernel restarted, with
JupyterLab's default of not saving widget state, or a rendered notebook) the picture is what shows,
instead of "Error displaying widget" alone. It is redrawn at the end of every call that moved the
curves, so the notebook saves the last of them.
"""

from __future__ import annotations

import html

import ipywidgets as widgets

from grpo_lab.views import charts
from grpo_lab.views.base import close_tree
from grpo_lab.views.completions import CompletionsView
from grpo_lab.views.controls import Controls
from grpo_lab.views.curves import CurvesView
from grpo_lab.views.findings import FindingsView
from grpo_lab.views.forks import ForksOverlay
from grpo_lab.views.rewards import RewardsView


class Dashboard(widgets.VBox):
    """Controls, curves, completions, rewards and findings of one session, live."""

    def __init__(self, session):
        self.controls = Controls(session)
        self.curves = CurvesView(session)
        self.forks = ForksOverlay(session, self.curves)
        self.completions = CompletionsView(session)
        self.rewards = RewardsView(session)
        self.findings = FindingsView(session)

        def section(title):
            return widgets.HTML(f"<h3 style='margin:8px 0 2px'>{title}</h3>")

        super().__init__([
            section("GRPO session"), self.controls, section("Curves"), self.forks, self.curves,
            section("Completions"), self.completions, section("Rewards"), self.rewards,
            section("Findings"), self.findings,
        ])
        self.add_class("grpo-dashboard")
        self.session = session
        self._pictures = []  # the display handles of the pictures shown beside the widget (one per display)
        self._pictured = None  # the curves they show
        self._unsubscribe = session.on(self._on_event)  # after the views: it hears "idle" once they are current

    def picture_html(self) -> str:
        """The static picture: the curves as of the session's step, and that they are not live. A
        picture that cannot be drawn says why instead (it never stops training or ``show()``)."""
        curves = self.curves.curves
        try:
            drawn = charts.curves_svg(curves) if curves is not None else ""
        except Exception as error:
            drawn = f"<p>No picture of the curves: {html.escape(repr(error))}</p>"
        return (
            "<div class='grpo-static-fallback' style='border:1px solid #e0c080;background:#fffaf0;padding:4px 8px'>"
            "<p style='color:#8a5a00;margin:2px 0;font-size:12px'>"
            f"Not live: a picture of the curves as of step {self.session.global_step}, saved with the notebook. "
            "The live dashboard is drawn when its kernel answers: it is busy running a cell, or it was restarted "
            f"(run the cells again).</p>{drawn}</div>"
        )

    def _ipython_display_(self) -> None:
        from IPython.display import HTML, display

        self._pictured = self.curves.curves
        self._pictures.append(display(HTML(self.picture_html()), display_id=True))
        display(self._repr_mimebundle_(), raw=True)

    def _on_event(self, event: str, payload) -> None:
        if event != "idle" or not self._pictures or self.curves.curves is self._pictured:
            return
        from IPython.display import HTML

        self._pictured = self.curves.curves
        picture = HTML(self.picture_html())
        for handle in self._pictures:
            handle.update(picture)

    def close(self) -> None:
        self._unsubscribe()
        for part in (self.controls, self.forks, self.curves, self.completions, self.rewards, self.findings):
            part.close()  # each unsubscribes from the session
        close_tree(self)
