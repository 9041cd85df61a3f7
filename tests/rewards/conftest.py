"""Fixtures shared by the code-sandbox tests."""

import tempfile

import pytest


@pytest.fixture
def sandboxes(tmp_path, monkeypatch):
    """The folder the sandboxes' temporary folders are made in (checked empty afterwards)."""
    base = tmp_path / "sandboxes"
    base.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    yield base
    assert list(base.iterdir()) == []  # every temporary folder was removed


ISOLATION_OPTIONS = [{"isolation": "python", "network_namespace": False}, {"isolation": "python"}, {"isolation": "os"}]
"""How a sandbox test runs its child: the Python-level guards alone, with the namespaces that work
here, and the operating system's isolation (the default)."""
ISOLATION_IDS = ["python guards alone", "python guards in namespaces", "os isolation"]
