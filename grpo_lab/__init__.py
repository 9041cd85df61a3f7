"""grpo_lab: notebook-first GRPO for language models.

    from grpo_lab import GRPOConfig, GRPOSession, GRPOTrainer

The heavy modules (torch, transformers) load on first use of a public name.
"""

from __future__ import annotations

import importlib

from grpo_lab.errors import show_usage_errors_briefly

__version__ = "0.1.0"

_EXPORTS = {
    "GRPOConfig": "grpo_lab.config.grpo_config",
    "GRPOTrainer": "grpo_lab.trainer.trainer",
    "GRPOSession": "grpo_lab.session.session",
    "compare": "grpo_lab.views.compare",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'grpo_lab' has no attribute {name!r}")


# Inside IPython a usage error shows as its message, the traceback one %tb away (grpo_lab.errors).
show_usage_errors_briefly()
