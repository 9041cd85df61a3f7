"""Progress for long runs: a rich bar in a terminal, an updating HTML line in a notebook.

Only IPython's display machinery is used in notebooks (no widget code): the line is re-rendered in
place through a display handle.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager

_SHOWN = ("reward", "loss")


def in_notebook() -> bool:
    shell = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def _summary(row: dict) -> str:
    """The headline numbers of a step: reward, loss, and each reward function's mean."""
    keys = [k for k in _SHOWN if k in row] + [k for k in row if k.startswith("rewards/") and k.endswith("/mean")]
    return "  ".join(f"{key.removeprefix('rewards/').removesuffix('/mean')} {row[key]:.3g}" for key in keys)


class _Silent:
    def advance(self, row: dict) -> None:
        pass

    def note(self, message: str) -> None:
        print(message)


class _NotebookBar:
    def __init__(self, total: int, done: int):
        from IPython.display import HTML, display

        self.total, self.done, self.start = total, done, time.perf_counter()
        self._html = HTML
        self.handle = display(HTML(self._render("")), display_id=True)

    def _render(self, text: str) -> str:
        return (
            f"<progress value='{self.done}' max='{self.total}' style='width:40%'></progress> "
            f"<code>{self.done}/{self.total} steps, {time.perf_counter() - self.start:.0f}s  {text}</code>"
        )

    def advance(self, row: dict) -> None:
        self.done += 1
        self.handle.update(self._html(self._render(_summary(row))))

    def note(self, message: str) -> None:
        self.handle.update(self._html(self._render(message)))


class _RichBar:
    def __init__(self, progress, task):
        self.progress, self.task = progress, task

    def advance(self, row: dict) -> None:
        self.progress.update(self.task, advance=1, metrics=_summary(row))

    def note(self, message: str) -> None:
        self.progress.console.print(message)


@contextmanager
def progress_bar(total: int, *, done: int = 0, enabled: bool = True, description: str = "GRPO"):
    """Yield an object with ``advance(metrics_row)`` and ``note(message)``; the bar starts at
    ``done`` of ``total`` (a resumed run shows the steps it continues from)."""
    if not enabled:
        yield _Silent()
    elif in_notebook():
        yield _NotebookBar(total, done)
    else:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        from rich.table import Column

        # The metrics text takes what is left of the line and is cut, never the bar or the counts.
        columns = (TextColumn("{task.description}"), BarColumn(bar_width=24), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("{task.fields[metrics]}",
                              table_column=Column(no_wrap=True, overflow="ellipsis", ratio=1)))
        with Progress(*columns, transient=False, expand=True) as progress:
            yield _RichBar(progress, progress.add_task(description, total=total, completed=done, metrics=""))
