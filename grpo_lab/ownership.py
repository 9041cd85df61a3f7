"""The earlier path of :mod:`grpo_lab.session.ownership`, kept for code that imports it: the same module."""

import sys

from grpo_lab.session import ownership

sys.modules[__name__] = ownership
