"""``export_notebook``: the exported cells of a notebook as a training script.

The cells are joined (``notebook_cells``) and checked: every name they read is defined
(``scopes``), the session is built once and used only as the script can follow (``config_edits``).
Then the ``GRPOSession(...)`` call becomes ``GRPOTrainer(...)``, its ``args=`` receives the
command-line overrides, the folded config edits become comments, and the code from the session on
runs under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

from grpo_lab.credentials import Secrets
from grpo_lab.export.config_edits import (
    check_no_alias_edit, check_no_session_use, config_argument, folded_config_edits, session_call,
)
from grpo_lab.export.errors import ExportError, scrubbed_code
from grpo_lab.export.notebook_cells import ExportedCells, exported_cells
from grpo_lab.export.scopes import undefined_names
from grpo_lab.export.script_file import HEADER, check_script_target, writing


def export_notebook(notebook_path: str | Path, path: str | Path) -> Path:
    """Write the exported cells of a notebook as a training script (see :mod:`grpo_lab.export`)."""
    import nbformat

    notebook_path, path = Path(notebook_path), Path(path)
    check_script_target(path, f"give -o {path / 'train.py'}")
    cells = exported_cells(nbformat.read(notebook_path, as_version=4), notebook_path)
    # A string that holds a credential (API_KEY = "sk-...", token="hf_...") becomes a read of the
    # environment, on the same lines: positions in cells stay true.
    secrets = Secrets()
    code = scrubbed_code(secrets, cells.code, lambda at: "cell {}, line {}".format(*cells.where(at)))
    provided = {"os"} if secrets.values else set()  # the script imports os for those reads
    tree = ast.parse(code)
    assign, call = session_call(tree, lambda at: "cell {} line {}".format(*cells.where(at)))
    target = ast.unparse(assign.targets[0])
    config_arg = config_argument(call)
    _check_defined(code, cells, provided)
    # A notebook's config edits become part of the script's config, below the command-line options.
    position = tree.body.index(assign)
    config_edits = folded_config_edits(tree, position, target, provided, cells.where)
    check_no_session_use(tree, position, target, config_edits, cells.where)
    check_no_alias_edit(tree, position, target, config_arg, cells.where)
    before, guarded = _rewritten(code, assign, call, config_arg, config_edits)
    script = _script_lines(
        notebook_path, path, cells.indices, before, guarded, target, imports_os=bool(secrets.values),
    )
    fix = f"give -o a path in a folder you can write to (grpo-lab export {notebook_path.name} -o DIR/{path.name})"
    with writing(path, fix):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(script))
    secrets.warn(path)
    return path


def _check_defined(code: str, cells: ExportedCells, provided: set[str]) -> None:
    """Refuse code that reads a name no exported cell defines: the script would fail with a NameError."""
    undefined = undefined_names(code, lambda at: "" if not at else f", cell {cells.where(at)[0]}", provided)
    if undefined:
        raise ExportError(
            f"The exported cells use names that no exported cell defines: {'; '.join(undefined)}. The script would "
            "fail with a NameError. Tag the cells that define them `export` (or start them with `# export`)."
        )


def _rewritten(code: str, assign: ast.Assign, call: ast.Call, config_arg: ast.keyword,
               config_edits: list[ast.stmt]) -> tuple[list[str], list[str]]:
    """The lines of ``code`` before the session's statement, and from it on with ``GRPOSession``
    made ``GRPOTrainer``, its config read through the command line, and each folded config edit
    made a comment (``pass`` where more code follows it after a ``;``)."""
    edit_values = ", ".join(f"{e.targets[0].attr!r}: {ast.unparse(e.value)}" for e in config_edits)
    config_call = f"_cli_config({ast.unparse(config_arg.value)}" + (f", {{{edit_values}}})" if config_edits else ")")
    lines = code.split("\n")
    edits = [(call.func, "GRPOTrainer"), (config_arg.value, config_call)] + [
        (e, f"# {ast.unparse(e.targets[0])} = {ast.unparse(e.value)}: applied to the config above "
            "(command-line options win)"
         if not lines[e.end_lineno - 1][e.end_col_offset:].lstrip().startswith(";") else "pass")  # `; more` stays code
        for e in config_edits
    ]
    # The trainer is created and trained under the main guard: the code from the session's line on.
    before, guarded = lines[: assign.lineno - 1], lines[assign.lineno - 1:]
    # Edit from the end of the text backwards so earlier positions stay valid.
    for node, text in sorted(edits, key=lambda e: (e[0].lineno, e[0].col_offset), reverse=True):
        _replace(guarded, node, text, first_line=assign.lineno)
    return before, guarded


def _replace(lines: list[str], node: ast.AST, text: str, first_line: int) -> None:
    """Replace the source span of ``node`` in ``lines``, whose first line is line ``first_line`` of the
    parsed code, with ``text``."""
    start, end = node.lineno - first_line, node.end_lineno - first_line
    prefix, suffix = lines[start][: node.col_offset], lines[end][node.end_col_offset:]
    lines[start:end + 1] = (prefix + text + suffix).split("\n")


def _indented(code: str) -> str:
    """``code`` (whole statements) one level deeper, the inside of multi-line strings left as it is."""
    inside_strings = set()
    for token in tokenize.generate_tokens(io.StringIO(code).readline):
        inside_strings.update(range(token.start[0] + 1, token.end[0] + 1))
    return "\n".join(
        line if number in inside_strings or not line.strip() else "    " + line
        for number, line in enumerate(code.split("\n"), start=1)
    )


def _script_lines(notebook_path: Path, path: Path, indices: list[int], before: list[str], guarded: list[str],
                  target: str, *, imports_os: bool) -> list[str]:
    """The lines of the notebook's script: the code before the session, then the rest under the main
    guard, followed by training ``target``."""
    from grpo_lab import __version__

    cells = ", ".join(str(i) for i in indices)
    source = f"{notebook_path.name} (cell{'s' if len(indices) > 1 else ''} {cells})"
    return [
        HEADER.format(version=__version__, source=source, script=path.name),
        *(["import os  # secrets are read from the environment", ""] if imports_os else []),
        "from grpo_lab.export import cli_config as _cli_config_and_resume",
        "from grpo_lab import GRPOTrainer",
        "",
        "_RESUME_FROM = None",
        "",
        "",
        "def _cli_config(base, edits=None):",
        "    global _RESUME_FROM",
        "    config, _RESUME_FROM = _cli_config_and_resume(base, edits=edits)",
        "    return config",
        "",
        "",
        "\n".join(before).rstrip(),
        "",
        "",
        'if __name__ == "__main__":  # processes spawned by vLLM or multiprocessing import this file again',
        _indented("\n".join(guarded).rstrip()),
        "",
        f"    {target}.train(resume_from_checkpoint=_RESUME_FROM)",
        f"    {target}.save_model()",
        f"    {target}.close()  # frees the model and ends the process group of an accelerate launch",
        "",
    ]
