"""Loops over a GRPOSession's stages: ``step()``, ``run(n)``, and ``await arun(n)`` for notebooks.

``run(n)`` trains on the calling thread. In a notebook cell that is the kernel's main thread, which
then answers nothing else until the cell ends, so a reloaded page gets its widgets back only then
(Jupyter restores widgets over the same shell channel the running cell holds). ``await
session.arun(n)`` trains on a worker thread while the cell awaits; ipykernel dispatches widget
messages while an async cell awaits, so the page, its buttons and a reload are answered at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import numbers
import signal
import threading
from collections.abc import Callable

from grpo_lab.config.grpo_config import evaluation_due
from grpo_lab.errors import ArgumentError
from grpo_lab.session.stages import run_next_stage
from grpo_lab.types import RunSummary

ARUN = "a cell (await session.arun)"
STOP_ARUN = (
    "press Stop on the dashboard (it ends between stages; Finish step ends after the current update()), "
    "or interrupt the kernel (it ends between stages)"
)


def check_steps(n, call: str) -> None:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
        raise ArgumentError(
            f"{call}(n) takes a whole number of optimizer steps >= 0, got {n!r}; e.g. session.{call}(3).")


def run_stages(session, n: int, stop_request: Callable[[], str | None],
               on_update: Callable[[dict], None] | None = None) -> tuple[int, str | None]:
    """Run the session's stages until ``n`` optimizer steps are done or ``stop_request()`` says
    where to end: ``"stage"`` before the next stage, ``"step"`` after the next update(). The caller
    holds the session. ``on_update`` hears each step's metrics. With ``eval_strategy="steps"`` the
    session evaluates on the trainer's schedule (and first, with ``eval_on_start``, when nothing has
    trained or been evaluated yet). Returns (steps done, last stage run)."""
    config, engine = session.config, session.engine
    if (config.eval_strategy != "no" or config.eval_on_start) and engine.eval_dataset is None:
        raise ValueError(
            f"eval_strategy={config.eval_strategy!r} (or eval_on_start=True) evaluates while training, but the "
            "session has no eval_dataset: build it with eval_dataset=, or set session.config.eval_strategy = 'no'."
        )
    if config.eval_on_start and session.global_step == 0 and not session.record.evaluations:
        session.evaluate()
    done, last = 0, None
    while done < n and stop_request() != "stage":
        stage, result = run_next_stage(session)
        last = stage
        if stage == "update":
            done += 1
            if on_update is not None:
                on_update(result)
            if evaluation_due(config, session.global_step, engine.total_steps()):
                session.evaluate()
            if stop_request() == "step":
                break
    return done, last


def run(session, n: int, *, progress: bool) -> RunSummary:
    """``session.run(n)``: ``n`` optimizer steps on this thread; an interrupt ends it between stages."""
    from grpo_lab.progress import progress_bar

    check_steps(n, "run")
    record = session.record
    first = len(record.history)
    with session.hold(f"session.run({n})", steps=n), progress_bar(n, enabled=progress) as bar:
        try:
            run_stages(session, n, lambda: None, on_update=bar.advance)
        except KeyboardInterrupt:  # an update it reached has finished (the interrupt waits for it)
            bar.note(f"stopped after {len(record.history) - first} step(s); next stage: {session.next_stage}()")
    return RunSummary([dict(row) for row in record.history[first:]], n, session.next_stage)


async def arun(session, n: int, *, progress: bool) -> RunSummary:
    """``await session.arun(n)``: ``n`` optimizer steps on a worker thread while the cell awaits."""
    from grpo_lab.progress import progress_bar

    check_steps(n, "arun")
    record = session.record
    first, cancelled = len(record.history), []

    def stop_request() -> str | None:
        activity = session.activity
        return "stage" if cancelled else (activity.stop_request if activity is not None else None)

    def train() -> None:
        with session.hold(f"await session.arun({n})", started_by=ARUN, how_to_stop=STOP_ARUN, steps=n,
                          stoppable=True), progress_bar(n, enabled=progress) as bar:
            done, _ = run_stages(session, n, stop_request, on_update=bar.advance)
            if done < n:
                bar.note(f"stopped after {done} step(s); next stage: {session.next_stage}()")

    work = asyncio.ensure_future(asyncio.to_thread(train))
    with _interrupts_request_a_stop(cancelled):
        while not work.done():
            try:
                await asyncio.shield(work)
            except asyncio.CancelledError:  # an interrupt cancels the awaiting cell: the stage running finishes
                cancelled.append(True)
    work.result()  # the worker's own error, if it failed
    return RunSummary([dict(row) for row in record.history[first:]], n, session.next_stage)


_AWAITING: list[list] = []
"""The stop requests of the ``arun`` calls awaiting on the main thread now (one SIGINT handler serves them all)."""
_PREVIOUS_HANDLER: list = []  # the SIGINT handler in place before the first of them


@contextlib.contextmanager
def _interrupts_request_a_stop(requests: list):
    """While ``arun`` awaits on the main thread, a Ctrl-C (a kernel interrupt) asks the worker to stop
    at the next stage boundary, as in ``run``: raised in the event loop instead, it would end the cell
    and leave the worker training. A Ctrl-C stops every ``arun`` awaiting at the time (the cell
    awaits them all); a second one goes to the handler that was in place. Nothing changes off the
    main thread or where SIGINT is ignored."""
    previous = signal.getsignal(signal.SIGINT)
    usable = callable(previous) and previous is not signal.SIG_IGN and previous is not signal.SIG_DFL
    if threading.current_thread() is not threading.main_thread() or not usable:
        yield
        return
    if not _AWAITING:
        _PREVIOUS_HANDLER[:] = [previous]
        signal.signal(signal.SIGINT, _request_stops)
    _AWAITING.append(requests)
    try:
        yield
    finally:
        _AWAITING.remove(requests)
        if not _AWAITING and signal.getsignal(signal.SIGINT) is _request_stops:
            signal.signal(signal.SIGINT, _PREVIOUS_HANDLER.pop())


def _request_stops(signum, frame) -> None:
    if any(_AWAITING):  # pressed again
        handler = _PREVIOUS_HANDLER[0]
        signal.signal(signal.SIGINT, handler)
        handler(signum, frame)
    for requests in _AWAITING:
        requests.append(True)
