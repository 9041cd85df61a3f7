"""The Python code blocks of the README and the documentation pages, and a runner for them.

A page's blocks run in order in one fresh interpreter, sharing one namespace (a later block may use
what an earlier one built), in an empty working folder. A block that needs what this machine may not
have says so on the line before its fence: ``<!-- requires: vllm -->`` (run by the vLLM suite) or
``<!-- requires: gpu -->`` (not run by the tests). Every other block runs in the main suite.
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
FENCE = re.compile(r"^(?P<indent> *)```(?P<info>\S*)\s*$")
"""A fence, at the margin or indented under a list item."""

# Each block is compiled under its page and line, so that a traceback names where in the docs it failed.
DRIVER = """
import json, sys
blocks = json.loads(sys.stdin.read())
namespace = {"__name__": "__main__"}
for label, source in blocks:
    exec(compile(source, label, "exec"), namespace)
    print("ran", label, flush=True)
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


def python_blocks(path: Path) -> list[Block]:
    """The page's fenced ``python`` blocks, each with the line of its fence and its marker."""
    page = str(path.relative_to(ROOT))
    lines = path.read_text().splitlines()
    blocks, index = [], 0
    while index < len(lines):
        fence = FENCE.match(lines[index])
        if not fence:
            index += 1
            continue
        end = next(i for i in range(index + 1, len(lines)) if lines[i].strip().startswith("```"))
        if fence["info"] == "python":
            marker = MARKER.match(lines[index - 1]) if index else None
            if lines[index - 1].strip().startswith("<!-- requires") and not marker:
                raise ValueError(f"{page}:{index}: write the marker as <!-- requires: NAME -->")
            need = marker["need"] if marker else None
            if need is not None and need not in REQUIREMENTS:
                raise ValueError(f"{page}:{index}: unknown requirement {need!r}; one of {REQUIREMENTS}")
            source = textwrap.dedent("\n".join(lines[index + 1:end]))
            blocks.append(Block(page, index + 1, source + "\n", need))
        index = end + 1
    return blocks


def run_blocks(blocks: list[Block], folder: Path, python: str = sys.executable, timeout: float = 600) -> str:
    """Runs ``blocks`` in order in one interpreter in ``folder``; the output on success, else an
    AssertionError with the output, whose traceback names the failing block's page and line."""
    env = {**os.environ, "MPLBACKEND": "agg", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([python, "-c", DRIVER], input=json.dumps([(b.label, b.source) for b in blocks]),
                            capture_output=True, text=True, cwd=folder, env=env, timeout=timeout)
    output = result.stdout + result.stderr
    if result.returncode != 0:
        raise AssertionError(f"a documentation block failed:\n{output[-6000:]}")
    return output
