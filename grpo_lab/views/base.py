"""What every view shares: it subscribes to the session's stage events, and a refresh that fails
shows its error in the view instead of raising into the session (a broken view never stops training)."""

from __future__ import annotations

import functools
import html
import traceback

import ipywidgets as widgets

from grpo_lab.views.live_note import LiveNote


def guarded(method):
    """Run a refresh; on failure show the error in the view instead of raising into the session."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except Exception as error:  # a broken view must never stop a training run
            self.error.value = (
                f"<pre style='color:#b00020'>{html.escape(type(self).__name__)} could not update: "
                f"{html.escape(repr(error))}\n{html.escape(traceback.format_exc(limit=3))}</pre>"
            )

    return wrapper


class View(widgets.VBox):
    events: tuple[str, ...] = ()

    def __init__(self, session, children=()):
        self.session = session
        self.error = widgets.HTML()
        self.live = LiveNote(step=session.global_step)
        super().__init__(children=[self.live, *children, self.error])
        self._unsubscribe = session.on(self._on_event)

    def _on_event(self, stage, result) -> None:
        if stage in self.events:
            self.live.step = self.session.global_step
            self.refresh()

    def refresh(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._unsubscribe()
        self.live.close()
        super().close()
