"""Ctrl-C that lands where stopping would tear the run's state apart.

An optimizer step, its scheduler step and the step counter must move together: an interrupt
between them (or between AdamW creating a parameter's ``exp_avg`` and its ``exp_avg_sq``) leaves a
session whose next update differs from the uninterrupted run's, or fails. Inside
:func:`deferred_interrupts` a SIGINT is held until the block ends and raised then, as
KeyboardInterrupt, with the state whole. Other stages are undone instead (see ``GRPOSession``).
"""

from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def deferred_interrupts():
    """Hold SIGINT (Ctrl-C, a Jupyter kernel interrupt) until the block has run, then raise
    KeyboardInterrupt. Outside the main thread, where Python delivers no signals, it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt
