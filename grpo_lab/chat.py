"""The chat format prompts and completions come in: a list of messages, each a dict with ``role`` and
``content``. Below both generation (which renders prompts) and the reward functions (which receive them)."""

from __future__ import annotations

from typing import Any


def is_conversational(prompt: Any) -> bool:
    """True for a list of chat messages (dicts with ``role`` and ``content``)."""
    return (
        isinstance(prompt, list)
        and len(prompt) > 0
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)
    )
