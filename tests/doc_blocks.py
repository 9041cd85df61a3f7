"""The Python code blocks of the README and the documentation pages, and a runner for them.

A page's blocks run in order in one namespace of their own (a later block may use what an earlier one
built), in an empty working folder of their own. The pages run one after another in one interpreter
(a fresh one for each page would spend most of the time importing torch and transformers again).
A block that needs what this machine may not have says so on the line before its fence:
``<!-- requires: vllm -->`` (run by the vLLM suite) or ``<!-- requires: gpu -->`` (not run by the tests).
Every other block runs in the main suite.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = ("vllm", "gpu")
"""What a block may be marked as needing."""
MARKER = re.compile(r"^\s*<!-- requires: (?P<need>[a-z]+) -->$")
PYTHON = ("python", "py")
"""The fence tags of a block that runs."""
FENCE = re.compile(r"^(?P<indent> *)```(?P<info>\S*)\s*$")
"""A fence, at the margin or indented under a list item."""

# Each block is compiled under its page and line, so that a traceback names where in the docs it failed.
# A page that fails is recorded with its traceback, and the next page runs.
DRIVER = """
import json, os, sys, traceback
pages, results = json.loads(sys.stdin.read()), {}
for page, folder, blocks in pages:
    os.chdir(folder)
    namespace, ran = {"__name__": "__main__"}, []
    try:
        for label, source in blocks:
            exec(compile(source, label, "exec"), namespace)
            ran.append(label)
        results[page] = {"ran": ran}
    except BaseException:
        results[page] = {"ran": ran, "error": traceback.format_exc()}
    with open(sys.argv[1], "w") as record:
        json.dump(results, record)
"""


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    source: str
    requires: str | None

    @property
    def label(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    """The README and every markdown page of the site."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def python_blocks(path: Path, root: Path = ROOT) -> list[Block]:
    """The page's fenced ``python`` blocks, each with the line of its fence and its marker; the page is
    named relative to ``root``."""
    page = str(path.relative_to(root))
    lines = path.read_text().splitlines()
    blocks, index = [], 0
    while index < len(lines):
        fence = FENCE.match(lines[index])
        if not fence:
            index += 1
            continue
        end = next((i for i in range(index + 1, len(lines)) if lines[i].strip().startswith("```")), None)
        if end is None:
            raise ValueError(f"{page}:{index + 1}: a code fence that is never closed")
        if fence["info"] in PYTHON:
            before = lines[index - 1] if index else ""
            marker = MARKER.match(before)
            if before.strip().startswith("<!-- requires") and not marker:
                raise ValueError(f"{page}:{index}: write the marker as <!-- requires: NAME -->")
            need = marker["need"] if marker else None
            if need is not None and need not in REQUIREMENTS:
                raise ValueError(f"{page}:{index}: unknown requirement {need!r}; one of {REQUIREMENTS}")
            source = textwrap.dedent("\n".join(lines[index + 1:end]))
            blocks.append(Block(page, index + 1, source + "\n", need))
        index = end + 1
    return blocks


def run_pages(pages: dict[str, list[Block]], folder: Path, python: str = sys.executable,
              timeout: float = 1200) -> dict[str, dict]:
    """Runs each page's blocks in order (the pages one after another, in one interpreter, each in its own
    empty folder under ``folder``): {page: {"ran": labels of the blocks that ran to their end, "error":
    the traceback where one failed}}. An AssertionError with the output when the interpreter itself fails."""
    work = []
    for page, blocks in pages.items():
        (folder / page).mkdir(parents=True)
        work.append((page, str(folder / page), [(b.label, b.source) for b in blocks]))
    record = folder / "results.json"
    env = {**os.environ, "MPLBACKEND": "agg", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([python, "-c", DRIVER, str(record)], input=json.dumps(work), capture_output=True,
                            text=True, env=env, timeout=timeout)
    results = json.loads(record.read_text()) if record.exists() else {}
    if result.returncode != 0 or set(results) != set(pages):
        output = (result.stdout + result.stderr)[-6000:]
        raise AssertionError(f"the documentation blocks' interpreter failed:\n{output}")
    return results
