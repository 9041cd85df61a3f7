"""One owner at a time: the guard that keeps two callers from driving a GRPOSession at once.

In a notebook a session can be driven from two places: a cell (``session.run(3)``) and the
dashboard, whose Run N trains on a thread of its own. Stages called from two threads would
interleave (one caller's generate() between the other's loss() and update()) and leave the batch,
the optimizer and the counters out of step. So every session call that drives stages runs inside
:meth:`OwnerGuard.hold`: the thread that holds it may nest calls (run -> step -> generate); a call
from any other thread is refused at once with :class:`SessionBusyError`, whose message says what
runs, who started it, where it is and how to stop it. Nothing waits in a queue.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from grpo_lab.errors import UsageError


class SessionBusyError(UsageError, RuntimeError):
    """A call that drives a session's stages while another thread drives them."""


@dataclasses.dataclass(frozen=True)
class Activity:
    """What drives a session now: ``session.activity`` (a snapshot) and the payload of the
    session's ``"busy"`` event."""

    description: str
    """What runs, e.g. ``"session.run(3)"`` or ``"Run N (10 steps)"``."""
    started_by: str
    """Who started it, e.g. ``"a cell"`` or ``"the dashboard's Run N button"``."""
    how_to_stop: str
    """What the user does to end it early, e.g. ``"interrupt the kernel ..."``."""
    thread_id: int
    """``threading.get_ident()`` of the thread that holds the session."""
    steps: int | None = None
    """Optimizer steps it runs in all, where known (``run(n)``, Run N)."""
    steps_done: int = 0
    """Optimizer steps it has finished."""
    now: str | None = None
    """The stage running inside it now, e.g. ``"stage loss()"`` (None: between stages)."""
    stop_request: str | None = None
    """Where it was asked to end (:meth:`OwnerGuard.request_stop`): ``"stage"`` between two
    stages, ``"step"`` after the current update(); None: not asked. A loop that holds the session
    (the dashboard's Run N, ``await session.arun(n)``) reads it; a cell's ``session.run()`` ends on
    an interrupt instead."""
    stoppable: bool = False
    """Whether it reads :attr:`stop_request` (so the dashboard's Stop and Finish step reach it)."""

    @property
    def where(self) -> str:
        """How far it is, e.g. ``"step 3 of 10, stage loss()"`` (empty when there is nothing to say)."""
        parts = [f"step {min(self.steps_done + 1, self.steps)} of {self.steps}"] if self.steps else []
        return ", ".join(parts + ([self.now] if self.now else []))

    def refusal(self, attempt: str) -> str:
        """The message that refuses ``attempt`` (e.g. ``"session.step()"``) while this runs."""
        where = f" ({self.where})" if self.where else ""
        return (
            f"{attempt} cannot run now: {self.description}, started by {self.started_by}, is running{where}. "
            f"A session runs one thing at a time and nothing was queued: wait for it to end, or "
            f"{self.how_to_stop}; then call {attempt} again."
        )

    def __str__(self) -> str:
        where = f": {self.where}" if self.where else ""
        return f"{self.description}, started by {self.started_by}{where}"


def _started_by(thread: threading.Thread) -> str:
    if thread is threading.main_thread():
        return "a cell"
    return f"a background thread ({thread.name})"


def _how_to_stop(thread: threading.Thread) -> str:
    if thread is threading.main_thread():
        return "interrupt the kernel (Kernel > Interrupt; Ctrl-C in a terminal)"
    return "make that thread's code return (an interrupt reaches the main thread only)"


class OwnerGuard:
    """Which thread drives a session, and what it runs. ``notify(event, payload)`` hears
    ``("busy", Activity)`` when an outermost :meth:`hold` starts and ``("idle", None)`` when it ends."""

    def __init__(self, notify: Callable[[str, object], None]):
        self._notify = notify
        self._lock = threading.Lock()  # guards the two fields below, read and written by any thread
        self._activity: Activity | None = None
        self._depth = 0  # nested holds of the owning thread

    @property
    def activity(self) -> Activity | None:
        with self._lock:
            return self._activity

    def request_stop(self, where: str) -> bool:
        """Ask what holds the session to end ``where`` ("stage" or "step"; a stage request is never
        weakened to a step one). Returns whether anything was holding it."""
        if where not in ("stage", "step"):
            raise ValueError("where must be 'stage' (between stages) or 'step' (after the current update()), "
                             f"got {where!r}.")
        with self._lock:
            if self._activity is None:
                return False
            if self._activity.stop_request != "stage":
                self._activity = dataclasses.replace(self._activity, stop_request=where)
            return True

    @contextlib.contextmanager
    def hold(
        self, description: str, *, now: str | None = None, started_by: str | None = None,
        how_to_stop: str | None = None, steps: int | None = None, finishes_step: bool = False,
        stoppable: bool = False,
    ) -> Iterator[None]:
        """Hold the session for this thread while the block runs, or raise :class:`SessionBusyError`
        at once if another thread holds it. Nested holds of the owning thread only set ``now`` (the
        stage running) and, with ``finishes_step``, count an optimizer step when the block succeeds;
        the other arguments describe an outermost hold (``started_by`` and ``how_to_stop`` default
        to the cell, or the background thread, that calls; ``stoppable``: the block reads stop requests)."""
        thread = threading.current_thread()
        with self._lock:
            held = self._activity
            if held is not None and held.thread_id != thread.ident:
                raise SessionBusyError(held.refusal(description))
            outermost = held is None
            if outermost:
                held = Activity(description, started_by or _started_by(thread), how_to_stop or _how_to_stop(thread),
                                thread.ident, steps, stoppable=stoppable)
            outer_now = held.now
            self._activity = dataclasses.replace(held, now=now or outer_now)
            self._depth += 1
        succeeded = False
        try:
            if outermost:
                self._notify("busy", self._activity)
            yield
            succeeded = True
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    self._activity = None
                else:
                    done = self._activity.steps_done + (finishes_step and succeeded)
                    self._activity = dataclasses.replace(self._activity, now=outer_now, steps_done=done)
            if outermost and succeeded:
                self._notify("idle", None)
            elif outermost:
                with contextlib.suppress(Exception):  # the block's own error is the one to see
                    self._notify("idle", None)
