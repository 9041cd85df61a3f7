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
