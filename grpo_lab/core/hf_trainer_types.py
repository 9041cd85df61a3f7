"""transformers' trainer types that TRL's contracts hand around: ``TrainerState`` (what reward functions
receive as ``trainer_state``), the callback classes, ``TrainOutput``, ``speed_metrics`` and
``set_seed``, imported in this one place.

Importing ``transformers.trainer_utils`` imports peft when it is installed, and peft imports
bitsandbytes, whose CPU backend looks for an optional kernel through the ``kernels`` package as it
is imported, and logs a notice when it finds none (bitsandbytes' logger) or cannot check the
kernel's publisher offline (``kernels``' logger). A run that uses neither asked for neither, so
those notices are held back here (only while these types are imported, and only those loggers'
warnings); ``import bitsandbytes`` before grpo_lab to see them.
"""

from __future__ import annotations

import logging

_QUIET = [logging.getLogger(name) for name in ("bitsandbytes.backends.cpu.ops", "kernels")]
_levels = [logger.level for logger in _QUIET]
for _logger in _QUIET:
    _logger.setLevel(logging.ERROR)
try:
    from transformers.trainer_callback import (  # noqa: E402
        CallbackHandler,
        DefaultFlowCallback,
        TrainerControl,
        TrainerState,
    )
    from transformers.trainer_utils import SchedulerType, TrainOutput, set_seed, speed_metrics  # noqa: E402
finally:
    for _logger, _level in zip(_QUIET, _levels):
        _logger.setLevel(_level)

__all__ = ["CallbackHandler", "DefaultFlowCallback", "SchedulerType", "TrainOutput", "TrainerControl", "TrainerState",
           "set_seed", "speed_metrics"]
