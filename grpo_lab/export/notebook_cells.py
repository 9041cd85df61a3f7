"""The cells of a notebook that an export takes (the ``export`` tag or a first line ``# export``),
and where a line of their joined code comes from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from grpo_lab.export.errors import ExportError


def _marks(cell: dict) -> tuple[list[str], str]:
    """A cell's tags and its first non-blank line (stripped)."""
    source = "".join(cell.get("source", []))
    first = source.lstrip().splitlines()[0].strip() if source.strip() else ""
    return cell.get("metadata", {}).get("tags", []), first


def is_exported(cell: dict) -> bool:
    if cell.get("cell_type") != "code":
        return False
    tags, first = _marks(cell)
    return "export" in tags or first == "# export"


def nearly_exported(cell: dict) -> bool:
    """A code cell marked for export in another spelling (``#export``, ``# Export``, the tag ``Export``)."""
    if cell.get("cell_type") != "code" or is_exported(cell):
        return False
    tags, first = _marks(cell)
    return "export" in [tag.strip().lower() for tag in tags] or "".join(first.split()).lower() == "#export"


@dataclass
class ExportedCells:
    """The exported cells of a notebook joined into one piece of code, each after a
    ``# --- cell N ---`` line."""

    indices: list[int]
    """The notebook's index of each exported cell, in order."""
    code: str
    starts: list[tuple[int, int, int]]
    """Each cell's (first line in the joined code, cell index, leading blank lines left out)."""

    def where(self, at: int) -> tuple[int, int]:
        """(cell index, line in the cell) of line ``at`` of the joined code."""
        first, index, skipped = max(start for start in self.starts if start[0] <= at)
        return index, at - first + skipped


def exported_cells(notebook, notebook_path: Path) -> ExportedCells:
    """The cells of ``notebook`` marked for export, joined, refused where there are none, where one
    holds IPython magics or shell lines, or where the joined code is not valid Python."""
    chosen = [(i, cell) for i, cell in enumerate(notebook.cells) if is_exported(cell)]
    if not chosen:
        near = [i for i, cell in enumerate(notebook.cells) if nearly_exported(cell)]
        raise ExportError(
            f"{notebook_path} has no exported cells. Tag the cells that define imports, data, reward "
            "functions, config and the session with `export`, or start them with `# export`"
            + (f" (cells {', '.join(map(str, near))} are marked otherwise: the tag and the comment are "
               "lower case, with one space after the #)." if near else ".")
        )
    pieces, starts = [], []
    next_line = 1
    for index, cell in chosen:
        source = cell.source
        if any(line.lstrip().startswith(("%", "!")) for line in source.splitlines()):
            raise ExportError(
                f"Cell {index} is exported but uses IPython magics or shell lines (% or !), which a script cannot "
                "run. Move them to a cell that is not exported, or write them as Python (e.g. subprocess.run)."
            )
        piece = f"# --- cell {index} ---\n{source.strip()}\n"
        starts.append((next_line, index, source[: len(source) - len(source.lstrip())].count("\n")))
        pieces.append(piece)
        next_line += piece.count("\n") + 1
    cells = ExportedCells([index for index, _ in chosen], "\n".join(pieces), starts)
    try:
        compile(cells.code, "<exported cells>", "exec")  # compiled, not run: also refuses a top-level await
    except SyntaxError as error:
        where = ""
        if error.lineno is not None:
            index, line = cells.where(error.lineno)
            where = f" in cell {index}, line {line}"
        hint = ""
        if "'await' outside" in error.msg:
            hint = (" A top-level `await` (such as `await session.arun(n)`) runs only in a notebook: move it to a "
                    "cell that is not exported; the script trains with trainer.train().")
        raise ExportError(f"The exported cells are not valid Python{where}: {error.msg}.{hint}") from error
    return cells
