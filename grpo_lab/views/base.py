"""What every view shares: it subscribes to the session's events, refreshes one thread at a time
(the dashboard's Run N refreshes from its own thread, a slider from the kernel's), and a refresh
that fails shows its error in the view instead of raising into the session (a broken view never
stops training); a later refresh that succeeds clears it."""

from __future__ import annotations

import functools
import html
import threading
import traceback

import ipywidgets as widgets

from grpo_lab.views.live_note import LiveNote


def guarded(method):
    """Run a refresh under the view's lock; on failure show the error in the view instead of raising
    into the session."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._refresh_lock:
            try:
                result = method(self, *args, **kwargs)
            except Exception as error:  # a broken view must never stop a training run
                self.error.value = (
                    f"<pre style='color:#b00020'>{html.escape(type(self).__name__)} could not update: "
                    f"{html.escape(repr(error))}\n{html.escape(traceback.format_exc(limit=3))}</pre>"
                )
                return None
            self.error.value = ""
            return result

    return wrapper


def close_tree(widget: widgets.Widget) -> None:
    """Close ``widget``, its children, and their layout and style models (``Box.close`` closes only
    the box itself, leaving the rest alive in the kernel and the page). Views inside are closed as
    widgets only: close them first (``View.close``) to unsubscribe them from the session."""
    for child in getattr(widget, "children", ()):
        close_tree(child)
    for part in ("layout", "style"):
        model = getattr(widget, part, None)
        if isinstance(model, widgets.Widget):
            model.close()
    widgets.Widget.close(widget)


class View(widgets.VBox):
    events: tuple[str, ...] = ()

    def __init__(self, session, children=()):
        self.session = session
        self._refresh_lock = threading.RLock()
        self.error = widgets.HTML()
        self.live = LiveNote(step=session.global_step)
        super().__init__(children=[self.live, *children, self.error])
        self._unsubscribe = session.on(self._on_event)

    def _on_event(self, stage, result) -> None:
        self.live.heard(self.session.global_step)  # any event: the kernel is behind this view
        if stage in self.events:
            self.refresh()

    def refresh(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._unsubscribe()
        close_tree(self)
