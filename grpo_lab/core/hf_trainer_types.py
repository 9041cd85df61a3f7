"""transformers' trainer types that TRL's contracts hand around: ``TrainerState`` (what reward functions
receive as ``trainer_state``), the callback classes, ``TrainOutput``, ``speed_metrics`` and
``set_seed``, imported in this one place.

Importing ``transformers.trainer_utils`` imports peft when it is installed, and peft imports
bitsandbytes, whose CPU backend logs a notice about an optional kernel package (``kernels``) as it is
imported. A run that uses neither asked for neither, so that notice is held back here (only while
these types are imported, and only that logger's warnings); ``import bitsandbytes`` before grpo_lab
to see it.
"""

from __future__ import annotations

import logging

_BITSANDBYTES_CPU = logging.getLogger("bitsandbytes.backends.cpu.ops")
_level = _BITSANDBYTES_CPU.level
_BITSANDBYTES_CPU.setLevel(logging.ERROR)
try:
    from transformers.trainer_callback import (  # noqa: E402
        CallbackHandler,
        DefaultFlowCallback,
        TrainerControl,
        TrainerState,
    )
    from transformers.trainer_utils import SchedulerType, TrainOutput, set_seed, speed_metrics  # noqa: E402
finally:
    _BITSANDBYTES_CPU.setLevel(_level)

__all__ = ["CallbackHandler", "DefaultFlowCallback", "SchedulerType", "TrainOutput", "TrainerControl", "TrainerState",
           "set_seed", "speed_metrics"]
