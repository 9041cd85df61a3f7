"""The session in exported notebook code: the one ``NAME = GRPOSession(...)`` statement, the
``NAME.config.FIELD = VALUE`` edits that can be folded into the script's config, and the statements
that edit or use the session in ways a script cannot follow."""

from __future__ import annotations

import ast
import builtins

from grpo_lab.export.errors import ExportError
from grpo_lab.export.scopes import MODULE_DUNDERS, bindings, module_reads, symbols, uses


def session_call(tree: ast.Module, cell_of) -> tuple[ast.Assign, ast.Call]:
    """The one ``NAME = GRPOSession(...)`` statement; ``cell_of(line)`` names the cell of a line."""
    found = [
        node for node in tree.body
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, (ast.Name, ast.Attribute))
        and (getattr(node.value.func, "id", None) or getattr(node.value.func, "attr", None)) == "GRPOSession"
    ]
    if len(found) > 1:
        raise ExportError(
            f"The exported cells create {len(found)} sessions ({'; '.join(cell_of(node.lineno) for node in found)}); "
            "a script trains one. Leave the others out of the export (remove their `export` tag or `# export` line)."
        )
    if found:
        return found[0], found[0].value
    raise ExportError(
        "No exported cell creates the session with `NAME = GRPOSession(...)`. Tag that cell `export` "
        "(or start it with `# export`)."
    )


def _stores_into(node: ast.stmt, owner: str) -> bool:
    """Whether the assignment statement ``node`` stores into an attribute or item of ``owner`` (source text)."""
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return any(
        isinstance(part, (ast.Attribute, ast.Subscript)) and ast.unparse(part.value) == owner
        for each in targets for part in ast.walk(each)
    )


def assignments_into(statements: list[ast.stmt], owner: str) -> list[ast.stmt]:
    """The assignment statements, anywhere in ``statements``, that store into ``owner`` (source text)."""
    return [
        node for node in ast.walk(ast.Module(statements, []))
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and _stores_into(node, owner)
    ]


def alias_edits(statements: list[ast.stmt], alias: str) -> list[ast.stmt]:
    """The assignments in ``statements`` (top-level statements, in order) that store into the module's
    ``alias``, in the module or in a function where ``alias`` is not a local name, up to the first
    statement that always binds ``alias`` anew."""
    found = []
    for statement in statements:
        found += [
            node for node in _nodes_that_see(statement, alias)
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and _stores_into(node, alias)
        ]
        if _always_binds(statement, alias):
            break
    return found


def _nodes_that_see(node: ast.AST, name: str):
    """``node`` and the nodes below it where ``name`` means the module's ``name``: the bodies of
    functions that make ``name`` local (a parameter or an assignment) are left out (a lambda's body
    holds no assignment statement, so it does not matter here)."""
    yield node
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        table = symbols(node)
        scope = next(child for child in table.get_children() if child.get_name() == node.name)
        if name in scope.get_identifiers() and scope.lookup(name).is_local():
            return  # its decorators and defaults are expressions: they hold no assignment
    for child in ast.iter_child_nodes(node):
        yield from _nodes_that_see(child, name)


def _always_binds(statement: ast.stmt, name: str) -> bool:
    """Whether the top-level ``statement`` binds (or deletes) ``name`` whenever it runs to its end."""
    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return statement.name == name
    if isinstance(statement, (ast.Import, ast.ImportFrom)):
        return any((alias.asname or alias.name.split(".")[0]) == name for alias in statement.names)
    if isinstance(statement, (ast.Assign, ast.AnnAssign, ast.Delete)):
        if isinstance(statement, ast.AnnAssign):
            targets = [statement.target] * bool(statement.value)
        else:
            targets = statement.targets
        return any(isinstance(n, ast.Name) and n.id == name for target in targets for n in ast.walk(target)
                   if not isinstance(target, (ast.Attribute, ast.Subscript)))
    return False


def edit_problem(edit: ast.stmt, tree: ast.Module, target: str, known: set[str], position: int) -> str | None:
    """Why the config edit ``edit`` cannot become part of the script's config, with the fix; None when
    it can. ``known`` holds the names the script has when it builds the config; ``position`` is the
    index of the session statement in ``tree.body``."""
    if edit not in tree.body:
        return "it is inside a compound statement or a function; move the edit to the top level of a cell"
    if tree.body.index(edit) < position:
        return f"it comes before `{target} = GRPOSession(...)`; edit the config before the session is built instead"
    field = ast.unparse(edit.target if isinstance(edit, (ast.AugAssign, ast.AnnAssign)) else edit.targets[0])
    literal = f"write the new value as a literal: `{field} = <new value>`"
    if isinstance(edit, ast.AugAssign):
        return f"it updates the value in place; {literal}"
    plain = (
        isinstance(edit, ast.Assign) and len(edit.targets) == 1 and isinstance(edit.targets[0], ast.Attribute)
        and ast.unparse(edit.targets[0].value) == f"{target}.config"
    )
    if not plain:
        return f"only `{target}.config.FIELD = VALUE` statements are folded; write one such statement per field"
    unread = sorted(module_reads(symbols(ast.Expression(edit.value), "eval")) - known)
    if unread:
        return (
            f"its value reads {', '.join(unread)}, which the script does not have (or has with another value) "
            "when it builds the config; "
            f"{literal}, or compute it before `{target} = GRPOSession(...)`"
        )
    return None


def config_argument(call: ast.Call) -> ast.keyword:
    """The ``args=`` keyword of the ``GRPOSession(...)`` call, which receives the command-line overrides."""
    config_arg = next((k for k in call.keywords if k.arg == "args"), None)
    if config_arg is None:
        raise ExportError(
            "The GRPOSession call in the exported cells has no `args=` config; pass `args=config` so the "
            "script can apply command-line overrides."
        )
    return config_arg


def folded_config_edits(tree: ast.Module, position: int, target: str, provided: set[str], where) -> list[ast.stmt]:
    """The ``TARGET.config.FIELD = VALUE`` statements, each refused (naming its cell and line through
    ``where(line)``) unless it can become part of the script's config. ``position``: the index of the
    session statement in ``tree.body``; ``provided``: names the script defines above the code."""
    known = (bindings(tree.body[:position]) - bindings(tree.body[position:])) | set(dir(builtins)) | MODULE_DUNDERS
    known |= provided
    config_edits = assignments_into(tree.body, f"{target}.config") + [
        node for node in assignments_into(tree.body, target) if ast.unparse(node).startswith(f"{target}.config ")
    ]
    for edit in config_edits:
        problem = edit_problem(edit, tree, target, known, position)
        if problem:
            cell, line = where(edit.lineno)
            raise ExportError(
                f"Cell {cell}, line {line}: `{ast.unparse(edit)}` cannot become part of the script's config: {problem}."
            )
    return config_edits


def check_no_session_use(tree: ast.Module, position: int, target: str, config_edits: list[ast.stmt], where) -> None:
    """Refuse a statement after the session's that uses it (other than a folded config edit): in the
    script the name is a trainer."""
    for statement in tree.body[position + 1:]:
        if statement not in config_edits and target in uses(statement):
            cell, line = where(statement.lineno)
            raise ExportError(
                f"Cell {cell}, line {line}: `{ast.unparse(statement).splitlines()[0]}` uses `{target}` after it is "
                f"built. In the script `{target}` is a GRPOTrainer that trains at the end, so stepping, plotting or "
                "inspecting the session belongs in cells that are not exported: move the line to such a cell."
            )


def check_no_alias_edit(tree: ast.Module, position: int, target: str, config_arg: ast.keyword, where) -> None:
    """Refuse an edit, after the session is built, of the config passed as ``args=`` under its own
    name: the script builds its config from that name before such an edit runs."""
    alias = ast.unparse(config_arg.value)
    for edit in alias_edits(tree.body[position + 1:], alias) if isinstance(config_arg.value, ast.Name) else []:
        cell, line = where(edit.lineno)
        raise ExportError(
            f"Cell {cell}, line {line}: `{ast.unparse(edit)}` edits `{alias}` after `{target} = GRPOSession(...)`. "
            f"In the notebook that is the session's config; the script builds its config from `{alias}` and the "
            f"command line when it creates the trainer, so the edit would be lost. Write it as "
            f"`{target}.config.FIELD = VALUE`."
        )
