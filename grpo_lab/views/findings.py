"""The findings panel: ``session.findings`` (the last ``doctor()`` and the live findings raised after
each step), most severe first, with cause, evidence and fix."""

from __future__ import annotations

import ipywidgets as widgets

from grpo_lab.views.base import View, guarded

EMPTY = ("<p>No findings: call session.doctor() before training; live findings appear here as the steps "
         "show them (docs/troubleshooting.md).</p>")


class FindingsView(View):
    """The session's findings as one table; refreshed on each live finding and when a call that drives
    the session ends (a ``doctor()`` included)."""

    events = ("finding", "idle")

    def __init__(self, session):
        self.body = widgets.HTML(EMPTY)
        super().__init__(session, [self.body])
        self.add_class("grpo-findings-view")
        self.refresh()

    @guarded
    def refresh(self) -> None:
        findings = self.session.findings
        self.body.value = findings._repr_html_() if findings else EMPTY
