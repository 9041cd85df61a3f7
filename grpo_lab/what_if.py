"""The earlier path of :mod:`grpo_lab.session.what_if`, kept for code that imports it: the same module."""

import sys

from grpo_lab.session import what_if

sys.modules[__name__] = what_if
