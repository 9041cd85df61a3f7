"""Warnings that point at the caller's line: the first frame outside grpo_lab, however deep inside
the package (session, trainer, engine, backend) the warning is raised; and the warnings TRL gives
through its logger, given through grpo_lab's logger (``logging.getLogger("grpo_lab")``) with TRL's
wording, where TRL users and their tools look for them."""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

_PACKAGE = str(Path(__file__).resolve().parent)


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` with the stack level of the nearest caller outside grpo_lab (and outside
    the wrappers, such as ``torch.no_grad``, that grpo_lab's own calls go through)."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and _inside(frame.f_code.co_filename):
        level, frame = level + 1, frame.f_back
    warnings.warn(message, category, stacklevel=level + 1)


def _inside(filename: str) -> bool:
    return filename.startswith(_PACKAGE) or "/torch/utils/_contextlib.py" in filename.replace("\\", "/")


def log_warning(message: str) -> None:
    """A warning TRL logs, logged the same way (a ``logging`` warning of the ``grpo_lab`` logger)."""
    logging.getLogger("grpo_lab").warning(message)
