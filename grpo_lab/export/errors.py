"""The error of an export: what a session or notebook holds that a standalone script cannot
recreate (a credential inside an f-string among it)."""

from __future__ import annotations

from grpo_lab.errors import UsageError


class ExportError(UsageError, ValueError):
    """Something in the session or notebook cannot be written into a standalone script."""


def scrubbed_code(secrets, code: str, where) -> str:
    """``secrets.scrub_code(code, where)`` (:class:`grpo_lab.credentials.Secrets`), a credential it
    cannot replace reported as an :class:`ExportError`."""
    from grpo_lab.credentials.code_scrubbing import CredentialInCodeError

    try:
        return secrets.scrub_code(code, where)
    except CredentialInCodeError as error:
        raise ExportError(str(error)) from None
