"""What every view shares: it subscribes to the session's events, refreshes one thread at a time
(the dashboard's Run N refreshes from its own thread, a slider from the kernel's), and a refresh
that fails shows its error in the view instead of raising into the session (a broken view never
stops training); a later refresh that succeeds clears it.

Refreshes are paced (:class:`Pacer`): an event marks the views that show it stale, and the stale
views of a session refresh together, in a round, at the first event at which the time since the
last round has reached ``Pacer.RATIO`` times what that round took. Within one call (``run(n)``,
``arun(n)``, Run N) refreshing then takes at most 1 / (RATIO + 1) of its wall time, however many
views are open and however cheap a step is; the end of every call that drove the session (its
``"idle"`` event) starts a round at once, so every view is current when a cell's call returns (a
loop of ``step()`` calls in one cell therefore refreshes at every step). Rounds happen between
stages, on the thread that drives the session, where the session's state is whole.
"""

from __future__ import annotations

import functools
import html
import threading
import time
import traceback

import ipywidgets as widgets

from grpo_lab.views.live_note import LiveNote


def guarded(method):
    """Run a refresh under the view's lock; on failure show the error in the view instead of raising
    into the session. The time it takes counts in the view's round (:class:`Pacer`), whatever
    started it: the view's first drawing, a control, or an event."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._refresh_lock:
            started = time.perf_counter()  # after the lock: waiting for another thread's refresh is not its cost
            try:
                result = method(self, *args, **kwargs)
            except Exception as error:  # a broken view must never stop a training run
                self.error.value = (
                    f"<pre style='color:#b00020'>{html.escape(type(self).__name__)} could not update: "
                    f"{html.escape(repr(error))}\n{html.escape(traceback.format_exc(limit=3))}</pre>"
                )
                return None
            finally:
                pacer = getattr(self, "pacer", None)
                if pacer is not None:
                    pacer.spent(started)
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


class Pacer:
    """When the views of one session refresh: in rounds, a round open at an event when the session
    went idle or when the time since the last round ended is at least ``RATIO`` times what it took."""

    RATIO = 39

    def __init__(self):
        # Written from the thread that drives the session and, for a control's refresh, the kernel's,
        # without a lock: a lost addition only moves the next round by one refresh's cost.
        self.round_open = True
        self._round_cost = 0.0  # seconds the views spent refreshing in the current round
        self._last_end = 0.0
        self._next_round = 0.0

    def on_event(self, event: str, _payload) -> None:
        """Heard before any view hears the event: decide whether it opens a round."""
        if self._round_cost:
            self._next_round = self._last_end + self.RATIO * self._round_cost
            self._round_cost = 0.0
        self.round_open = event == "idle" or time.perf_counter() >= self._next_round

    def spent(self, started: float) -> None:
        """A view refreshed, from ``started`` (``time.perf_counter()``) until now: part of this round."""
        self._last_end = time.perf_counter()
        self._round_cost += self._last_end - started


_PACERS: dict[int, list] = {}
"""Per session (by id): [pacer, its unsubscribe, views using it]. An entry goes when the session's last
view closes; a view never closed keeps its session alive anyway (the widget registry holds it)."""


def join_pacer(session) -> Pacer:
    """The session's pacer, made and subscribed when its first view is made (so that it hears each
    event before the views), unsubscribed when its last view leaves (:func:`leave_pacer`)."""
    entry = _PACERS.get(id(session))
    if entry is None:
        pacer = Pacer()
        entry = _PACERS[id(session)] = [pacer, session.on(pacer.on_event), 0]
    entry[2] += 1
    return entry[0]


def leave_pacer(session) -> None:
    entry = _PACERS.get(id(session))
    if entry is not None:
        entry[2] -= 1
        if entry[2] == 0:
            entry[1]()  # unsubscribe
            del _PACERS[id(session)]


class View(widgets.VBox):
    events: tuple[str, ...] = ()
    """The events that make the view stale: it refreshes at the next round (:class:`Pacer`)."""
    immediate: tuple[str, ...] = ()
    """The events that refresh the view at once, outside the rounds (the buttons turning on and off)."""

    def __init__(self, session, children=()):
        self.session = session
        self._refresh_lock = threading.RLock()
        self._stale = False
        self.pacer = join_pacer(session)
        self.error = widgets.HTML()
        self.live = LiveNote(step=session.global_step)
        super().__init__(children=[self.live, *children, self.error])
        self._unsubscribe = session.on(self._on_event)

    def _on_event(self, stage, result) -> None:
        pacer = self.pacer
        if pacer is None:  # closed by another thread while the session was calling its listeners
            return
        if stage in self.events:
            self._stale = True
        if not (stage in self.immediate or pacer.round_open):
            return
        self.live.heard(self.session.global_step)  # the kernel is behind this view, at this step
        if self._stale:
            self._stale = False
            self.refresh()

    def refresh(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        if self.pacer is not None:  # the first close unsubscribes; a second has nothing to undo
            self._unsubscribe()
            leave_pacer(self.session)
            self.pacer = None
        close_tree(self)
