"""Ctrl-C that lands where stopping would tear the run's state apart.

An optimizer step, its scheduler step and the step counter must move together: an interrupt
between them (or between AdamW creating a parameter's ``exp_avg`` and its ``exp_avg_sq``) leaves a
session whose next update differs from the uninterrupted run's, or fails. Inside
:func:`deferred_interrupts` a SIGINT is held until the block ends and delivered then, with the
state whole; a second SIGINT while one is held goes through at once, so that a block that hangs (a
weight sync to an unreachable server) can still be stopped, and the block's ``torn`` callback names
what it left half done (the session then refuses to step on until it is repaired). Other stages are
undone instead (see ``GRPOSession``).
"""

from __future__ import annotations

import contextlib
import signal
import threading

_held = threading.local()


@contextlib.contextmanager
def deferred_interrupts(torn=None):
    """Hold SIGINT (Ctrl-C, a Jupyter kernel interrupt) until the block has run, then hand it to the
    handler that was in place (by default: raise KeyboardInterrupt). A second SIGINT goes through at
    once, after calling ``torn()`` (if given) to mark the state the block was moving as half done.
    Does nothing outside the main thread (Python delivers signals there only), inside another such
    block, or where SIGINT is ignored or handled outside Python."""
    previous = signal.getsignal(signal.SIGINT)
    usable = callable(previous) and previous is not signal.SIG_IGN and previous is not signal.SIG_DFL
    if threading.current_thread() is not threading.main_thread() or getattr(_held, "active", False) or not usable:
        yield
        return
    received = []

    def hold(signum, frame):
        if received:  # pressed again: stop now
            signal.signal(signal.SIGINT, previous)
            if torn is not None:
                torn()
            previous(signum, frame)
        received.append(signum)

    _held.active = True
    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        _held.active = False
    if received:
        previous(signal.SIGINT, None)
