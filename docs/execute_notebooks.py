"""Runs every notebook of ``notebooks/`` top to bottom in a real kernel and writes the executed copies,
with their outputs and widget state, into a folder (``make docs`` renders the tutorials from it).

    python docs/execute_notebooks.py build/notebooks
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def execute(source: Path, folder: Path) -> nbformat.NotebookNode:
    """``source`` run in a kernel whose working folder is ``folder`` (where what it writes lands), saved
    there under its own name; returns the executed notebook."""
    folder.mkdir(parents=True, exist_ok=True)
    notebook = nbformat.read(source, as_version=4)
    shutil.copy(source, folder / source.name)
    NotebookClient(notebook, timeout=600, kernel_name="python3", store_widget_state=True,
                   resources={"metadata": {"path": str(folder)}}).execute()
    nbformat.write(notebook, folder / source.name)
    return notebook


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python docs/execute_notebooks.py FOLDER")
    for path in NOTEBOOKS:
        print(f"executing {path.name}", flush=True)
        execute(path, Path(sys.argv[1]))
