"""The trainer's line-per-row logs in ``output_dir`` (``metrics.jsonl``, ``findings.jsonl``): on a resume,
the rows of steps after the checkpoint go, since the resumed run logs those steps again."""

from __future__ import annotations

import json
import os
from pathlib import Path


def logged_step(line: str) -> float:
    """The ``step`` of a JSON line; infinity for one that is not a complete row (a write cut short)."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return float("inf")


def drop_rows_after(path: Path, step: int) -> int:
    """Remove from the JSON-lines file ``path`` the rows of steps after ``step`` and any incomplete
    line; the file is replaced whole or not at all. Returns how many lines went (0 for no file)."""
    if not path.exists():
        return 0
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if logged_step(line) <= step]
    if len(kept) < len(lines):
        partial = path.with_name(path.name + ".partial")
        partial.write_text("".join(kept))
        os.replace(partial, path)
    return len(lines) - len(kept)
