"""Which names exported notebook code binds and reads at the top level of the script, from Python's
own symbol tables (``symtable``): what the script would lack, and what a statement touches."""

from __future__ import annotations

import ast
import builtins
import copy
import symtable


MODULE_DUNDERS = frozenset({
    "__builtins__", "__name__", "__file__", "__doc__", "__cached__", "__loader__", "__package__",
    "__spec__", "__annotations__",
})
"""Names every module has when it runs as a script."""


_ANONYMOUS_SCOPES = frozenset({"lambda", "listcomp", "setcomp", "dictcomp", "genexpr"})
"""Names symtable gives scopes that are not ``def`` functions."""


class _OwnScopes(ast.NodeTransformer):
    """List, set and dict comprehensions rewritten as generator expressions: the same names in the
    same scopes, and a scope of their own in every Python (3.12 inlines the others into the enclosing
    scope, where its symtable shows their variables as that scope's)."""

    def visit_ListComp(self, node):
        self.generic_visit(node)
        return ast.GeneratorExp(node.elt, node.generators)

    visit_SetComp = visit_ListComp

    def visit_DictComp(self, node):
        self.generic_visit(node)
        return ast.GeneratorExp(ast.Dict([node.key], [node.value]), node.generators)


def symbols(node: ast.AST, mode: str = "exec") -> symtable.SymbolTable:
    """The symbol table of the code of ``node`` (a module, statement or ``ast.Expression``), with every
    comprehension in a scope of its own (see ``_OwnScopes``); its line numbers are not the code's."""
    return symtable.symtable(ast.unparse(_OwnScopes().visit(copy.deepcopy(node))), "<exported code>", mode)


def module_bindings(table: symtable.SymbolTable) -> set[str]:
    """Names that the code of ``table`` (a module's symtable) binds in the module namespace: its own
    assignments, imports, functions and classes, plus names a nested scope declares ``global`` and
    assigns, which covers ``:=`` in a module-level comprehension."""
    names = {
        symbol.get_name() for symbol in table.get_symbols()
        if (symbol.is_assigned() or symbol.is_imported() or symbol.is_namespace())
        and (table.get_type() == "module" or symbol.is_declared_global())
    }
    for child in table.get_children():
        names |= module_bindings(child)
    return names


def module_reads(table: symtable.SymbolTable) -> set[str]:
    """Names that the code of ``table`` (a module's symtable), nested scopes included, reads from the
    module namespace."""
    names = {symbol.get_name() for symbol in table.get_symbols() if symbol.is_referenced() and symbol.is_global()}
    for child in table.get_children():
        names |= module_reads(child)
    return names


def uses(statement: ast.stmt) -> set[str]:
    """Module names that ``statement``, run at the top level of a module, reads, binds or deletes."""
    table = symbols(statement)
    return module_reads(table) | module_bindings(table)


def bindings(statements: list[ast.stmt]) -> set[str]:
    """Names that ``statements``, run at the top level of a module, bind there."""
    return module_bindings(symbols(ast.Module(statements, [])))


def undefined_names(code: str, cell_at_line, provided: set[str] = frozenset()) -> list[str]:
    """Names the exported code reads that nothing in it defines (and that are not builtins), as
    'NAME (in WHERE, cell N)' descriptions in the order of the code; empty when the code star-imports
    (names unknowable). WHERE is a top-level function, or the top-level code (which here includes
    classes, lambdas and comprehensions). ``provided``: names the script defines above the code."""
    tree = ast.parse(code)
    if any(isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names) for node in ast.walk(tree)):
        return []
    functions = [node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    first_read: dict[str, int] = {}  # line of the first read outside the top-level functions' bodies
    outside = [node for node in tree.body if node not in functions] + [
        part for function in functions
        for part in [*function.decorator_list, *function.args.defaults, *filter(None, function.args.kw_defaults)]
    ]
    for node in (each for top in outside for each in ast.walk(top)):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            first_read[node.id] = min(first_read.get(node.id, node.lineno), node.lineno)
    def_line = {function.name: function.lineno for function in reversed(functions)}  # the first def of a name
    module = symbols(tree)
    known = module_bindings(module) | set(dir(builtins)) | MODULE_DUNDERS | set(provided)
    found: dict[tuple[str, str], int] = {}

    def visit(table, where: str, at: int | None) -> None:
        """``at``: the line of the top-level function ``where``, None for the top-level code."""
        for child in table.get_children():
            named = table is module and child.get_type() == "function" and child.get_name() not in _ANONYMOUS_SCOPES
            label, line = (f"function {child.get_name()}", def_line[child.get_name()]) if named else (where, at)
            for symbol in child.get_symbols():
                if symbol.is_global() and symbol.is_referenced() and symbol.get_name() not in known:
                    read_at = first_read.get(symbol.get_name(), 0) if line is None else line
                    found.setdefault((symbol.get_name(), label), read_at)
            visit(child, label, line)

    for symbol in module.get_symbols():
        if symbol.is_referenced() and symbol.get_name() not in known:
            found.setdefault((symbol.get_name(), "top-level code"), first_read.get(symbol.get_name(), 0))
    visit(module, "top-level code", None)
    in_order = sorted(found.items(), key=lambda item: item[1])
    return [f"{name} (in {where}{cell_at_line(line)})" for (name, where), line in in_order]
