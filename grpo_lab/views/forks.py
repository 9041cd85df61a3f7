"""The dashboard's forks section: once a session has forks, a toggle that draws the session and its
forks over each other (:func:`grpo_lab.views.compare.compare`) in place of its own curves."""

from __future__ import annotations

import ipywidgets as widgets

from grpo_lab.views.compare import compare


class ForksOverlay(widgets.VBox):
    """A toggle, shown from the session's first fork on, and the comparison it opens; ``curves`` is
    the widget the comparison stands in for while it is on. A fork made while it is on joins it."""

    def __init__(self, session, curves: widgets.Widget):
        self.session, self.curves = session, curves
        self.toggle = widgets.ToggleButton(value=False, description="Overlay forks", icon="code-branch",
                                           tooltip="Draw this session and its forks on shared axes")
        self.view = None
        super().__init__([self.toggle])
        self._shown()
        self.toggle.observe(lambda change: self._redraw(), names="value")
        self._unsubscribe = session.on(self._on_event)

    def _shown(self) -> None:
        self.toggle.layout.display = None if self.session.branches else "none"
        self.toggle.description = f"Overlay forks ({len(self.session.branches)})"

    def _on_event(self, event: str, payload) -> None:
        if event == "fork":
            self._shown()
            if self.toggle.value:
                self._redraw()

    def _redraw(self) -> None:
        if self.view is not None:
            self.view.close()
            self.view = None
        if self.toggle.value:
            self.view = compare(self.session, *self.session.branches)
        self.curves.layout.display = "none" if self.toggle.value else None
        self.children = [self.toggle] + ([self.view] if self.view is not None else [])

    def close(self) -> None:
        self._unsubscribe()
        if self.view is not None:
            self.view.close()
        super().close()
