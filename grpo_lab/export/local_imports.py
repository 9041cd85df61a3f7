"""A warning for an exported script that imports a function from a module only this process finds:
one in its working directory or its running script's folder, where the script is written elsewhere."""

from __future__ import annotations

import importlib.machinery
import os
import sys
import types
from pathlib import Path

from grpo_lab.export.functions import is_importable


def _found_only_locally(module_name: str, script_dir: Path) -> Path | None:
    """The folder from which ``module_name`` was imported, where the script in ``script_dir`` would
    not find it: the working directory or the running script's folder (the first entry of
    ``sys.path``), the module not being importable from any other entry (an installed package).
    None where the script imports it as this process did."""
    module = sys.modules.get(module_name)
    file = getattr(module, "__file__", None)
    if file is None:
        return None
    depth = module_name.count(".") + (2 if Path(file).name == "__init__.py" else 1)
    root = Path(file).resolve().parents[depth - 1]
    local = {Path.cwd().resolve()} | ({Path(sys.path[0]).resolve()} if sys.path and sys.path[0] else set())
    if root not in local or root == script_dir.resolve():
        return None
    elsewhere = [entry for entry in sys.path if entry and Path(entry).resolve() not in local]
    return None if _importable_from(module_name.partition(".")[0], elsewhere) else root


def _importable_from(top: str, path: list[str]) -> bool:
    """Whether the import system finds ``top`` with ``path`` as ``sys.path`` (the finders that do
    not read ``sys.path``, such as an editable install's, answer as they are)."""
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            spec = find(top, path) if finder is importlib.machinery.PathFinder else find(top, None)
        except (ImportError, ValueError, TypeError):
            continue
        if spec is not None:
            return True
    return False


def warn_local_imports(funcs: list, script: Path) -> None:
    """Warn when the script imports a function from a module that only this process's working
    directory (or running script's folder) provides, and the script is written elsewhere."""
    from grpo_lab import notices

    by_module: dict[str, list[str]] = {}
    for func in funcs:
        if isinstance(func, types.FunctionType) and is_importable(func):
            by_module.setdefault(func.__module__, []).append(func.__name__)
    for module_name, names in by_module.items():
        root = _found_only_locally(module_name, script.parent)
        if root is not None:
            top = Path(sys.modules[module_name].__file__).resolve().relative_to(root).parts[0]
            notices.warn(
                f"The exported script imports {', '.join(names)} from {module_name}, which this process finds in "
                f"{root} (its working directory or script folder), a folder the script in "
                f"{script.parent.resolve()} does not search. Copy {top} beside the script, put {root} on PYTHONPATH "
                "where it runs "
                f"(PYTHONPATH={root}{os.pathsep}$PYTHONPATH), or export the script to {root}."
            )
