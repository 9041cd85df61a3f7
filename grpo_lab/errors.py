"""Errors in how grpo_lab is called or configured, and how IPython shows them.

A :class:`UsageError`'s message names the problem and the fix. In a notebook, a traceback of 40-90
lines through grpo_lab's internals pushes that message below the fold and says nothing the message
does not, so inside IPython grpo_lab shows a usage error as its message alone, with the traceback
one ``%tb`` away; scripts and every other exception keep the full traceback. Each subclass is also
the built-in type TRL raises in its place (``ValueError``, ``RuntimeError``), so code that catches
those keeps working.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

_HINT = "(grpo_lab hid the traceback of this usage error: run %tb to see it)"


class UsageError(Exception):
    """A mistake in how grpo_lab was called or configured; the message names the problem and the fix."""


class ConfigError(UsageError, ValueError):
    """A configuration value grpo_lab cannot run with (a ``ValueError``, as TRL raises)."""


class ArgumentError(UsageError, ValueError):
    """An argument of a call that grpo_lab cannot take, e.g. ``session.run(2.5)``."""


_PACKAGE = str(Path(__file__).resolve().parent)


def brief_traceback(error: BaseException, colour: bool = True) -> list[str]:
    """The lines IPython shows for a usage error: its type and message; where it wraps an exception
    of the user's code (a reward function that raised), that exception with the frames of the user's
    own code, which the user needs to fix it; and how to see the whole traceback."""
    name = f"\x1b[0;31m{type(error).__name__}\x1b[0m" if colour else type(error).__name__
    lines = [f"{name}: {error}"]
    cause = error.__cause__
    if cause is not None:
        frames = [frame for frame in traceback.extract_tb(cause.__traceback__)
                  if not frame.filename.startswith(_PACKAGE)]
        lines.append(f"caused by {type(cause).__name__}: {cause}")
        lines.extend(line.rstrip("\n") for line in traceback.format_list(frames))
    lines.append(_HINT)
    return lines


def _show_briefly(shell, etype, value, tb, tb_offset=None):
    # IPython's own path records the exception for %tb and the debugger; this handler replaces it.
    sys.last_type, sys.last_value, sys.last_traceback = etype, value, tb
    if sys.version_info >= (3, 12):
        sys.last_exc = value
    # Shown here: IPython 8 and later display nothing of what a custom handler returns.
    shell._showtraceback(etype, value, brief_traceback(value, colour=getattr(shell, "colors", "") != "NoColor"))


def show_usage_errors_briefly() -> None:
    """Inside IPython, show :class:`UsageError` as its message alone (``%tb`` shows the traceback).

    Does nothing outside IPython, and nothing where the shell already has a custom exception
    handler (the user's own, which is kept)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None or not hasattr(shell, "set_custom_exc") or shell.custom_exceptions:
        return
    shell.set_custom_exc((UsageError,), _show_briefly)
