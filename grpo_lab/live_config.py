"""The earlier path of :mod:`grpo_lab.config.live`, kept for code that imports it: the same module."""

import sys

from grpo_lab.config import live

sys.modules[__name__] = live
