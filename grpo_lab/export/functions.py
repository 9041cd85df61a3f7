"""Functions copied into an exported script: reward functions, a rollout function, tools.

A function that a module of its own provides is imported by the script; one defined in a notebook
(``__main__``) is copied as source, with the imports, functions and literals it uses from its
globals. A lambda, a closure, or a global that is none of those cannot be recreated and is refused,
naming the fix. A credential in copied code becomes a read of an environment variable.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import sys
import textwrap
import types
from pathlib import Path

from grpo_lab.credentials import Secrets
from grpo_lab.export.errors import ExportError, scrubbed_code


def _literal(value) -> bool:
    try:
        return ast.literal_eval(repr(value)) == value
    except (ValueError, SyntaxError):
        return False


def _check_exportable(func, label: str) -> None:
    """``label``: how errors name the function, e.g. "Reward function #0"."""
    name = getattr(func, "__name__", repr(func))
    if name == "<lambda>":
        example = "my_rollout(prompts, session)" if label.startswith("Rollout") else "my_reward(completions, **kwargs)"
        raise ExportError(
            f"{label} is a lambda, which has no name to export. Define it with `def {example}: ...` "
            "at the top level of a cell or module."
        )
    if func.__closure__:
        captured = ", ".join(func.__code__.co_freevars)
        raise ExportError(
            f"{label.split(' #')[0]} {name!r} is a closure over live objects ({captured}); a script cannot "
            "recreate them. Make them module-level constants or function arguments with defaults, "
            "or move the function into an importable module."
        )


def is_importable(func) -> bool:
    module = sys.modules.get(func.__module__)
    return func.__module__ != "__main__" and module is not None and getattr(module, func.__qualname__, None) is func


def _function_source(func, label: str) -> str:
    _check_exportable(func, label)
    try:
        return textwrap.dedent(inspect.getsource(func))
    except (OSError, TypeError) as error:
        raise ExportError(
            f"The source of {func.__name__!r} ({label}) cannot be found ({error}). Define it in a "
            "notebook cell or a module file, not with exec()."
        ) from error


def _dependencies(func, imports: dict[str, str], definitions: dict[str, str], label: str, secrets: Secrets) -> None:
    """Collect the imports and top-level definitions a ``__main__`` function uses (credentials among
    them read from the environment, see ``Secrets``)."""
    for name in sorted(set(func.__code__.co_names) | _nested_names(func.__code__)):
        if name in definitions or name in imports or hasattr(builtins, name) or name not in func.__globals__:
            continue
        value = func.__globals__[name]
        if isinstance(value, types.ModuleType):
            imports[name] = f"import {value.__name__}" + ("" if value.__name__ == name else f" as {name}")
        elif getattr(value, "__module__", None) not in (None, "__main__") and getattr(value, "__name__", None):
            imports[name] = f"from {value.__module__} import {value.__name__}" + (
                "" if value.__name__ == name else f" as {name}"
            )
        elif isinstance(value, types.FunctionType):
            definitions[name] = _scrubbed_source(value, label, secrets)
            _dependencies(value, imports, definitions, label, secrets)
        elif _literal(value):
            rendered = secrets.render(value, name, name, context=f" (a global that {func.__name__} uses)")
            definitions[name] = f"{name} = {rendered}\n"
        else:
            raise ExportError(
                f"{label} uses the global {name!r} ({type(value).__name__}), which is not "
                "a module, an importable object, a function or a literal. Build it inside the function, "
                "or move it into an importable module."
            )


def _scrubbed_source(func, label: str, secrets: Secrets) -> str:
    """The source of ``func`` with every credential in it read from the environment."""
    return scrubbed_code(secrets, _function_source(func, label), lambda line: f"function {func.__name__}, line {line}")


def _nested_names(code) -> set[str]:
    names = set()
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= set(const.co_names) | _nested_names(const)
    return names


def reward_function_code(funcs: list, kind: str = "Reward function",
                         secrets: Secrets | None = None) -> tuple[list[str], list[str], list[str]]:
    """(import lines, definitions, names) that recreate ``funcs`` in a script; ``kind`` names them in errors.
    A credential in a copied function or a global it uses (``API_KEY = "sk-..."``) becomes a read of
    an environment variable, collected in ``secrets`` (without it, warned about here)."""
    own = secrets is None
    secrets = Secrets() if own else secrets
    imports: dict[str, str] = {}
    definitions: dict[str, str] = {}
    names = []
    for index, func in enumerate(funcs):
        label = kind if kind == "Rollout function" else f"{kind} #{index}"
        if not callable(func) or not isinstance(func, types.FunctionType):
            raise ExportError(
                f"{label} ({type(func).__name__}) is not a plain function; models and callable objects "
                "are not exported yet. Wrap it in a function defined in a module."
            )
        _check_exportable(func, label)
        name = func.__name__
        if is_importable(func):
            imports[name] = f"from {func.__module__} import {name}"
        else:
            definitions[name] = _scrubbed_source(func, label, secrets)
            _dependencies(func, imports, definitions, label, secrets)
        names.append(name)
    if secrets.values:
        imports["os"] = "import os"
    if own:
        secrets.warn(Path("the script"))
    return sorted(set(imports.values())), list(definitions.values()), names
