"""The error of an export: what a session or notebook holds that a standalone script cannot
recreate. ``grpo_lab.credentials`` raises it too, for a credential inside an f-string."""

from __future__ import annotations


class ExportError(ValueError):
    """Something in the session or notebook cannot be written into a standalone script."""
