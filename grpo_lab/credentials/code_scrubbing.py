"""Credentials in Python source that an export copies: each string literal that holds one becomes a
read of an environment variable, each one in a comment is redacted, on as many lines as before (so
that positions in the source stay true).

A string is judged by the name it is given, the nearest first: the variable an
``os.getenv("NAME", ...)`` default stands in for, a dict key, a keyword argument or parameter
default, then an assignment's target.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from typing import Protocol

from grpo_lab.credentials.recognition import (
    PASSWORD_IN_URL, SCHEME, SECRET_SHAPES, credential_name, is_placeholder, secret_in,
)


class CredentialInCodeError(ValueError):
    """Code holds a credential that no read of an environment variable can stand in for (inside an
    f-string); an export reports it as its own ``ExportError``."""


class Secrets(Protocol):
    """What the scrubbing records its replacements in (``grpo_lab.credentials.Secrets``)."""

    found: list[tuple[str, str]]

    def expression(self, value: str, name: str | None, label: str, optional: bool = False) -> str | None: ...

_ENVIRONMENT_READS = frozenset({
    "os.getenv", "getenv", "os.environ.get", "environ.get", "os.environ.setdefault", "environ.setdefault",
    "os.putenv", "putenv",
})
"""Calls whose first argument names the environment variable their default stands in for."""

_COMMENT_NAMED = re.compile(
    r"(?P<name>(?:[A-Za-z_][\w\-]*[ \t]+){0,2}[A-Za-z_][\w\-]*)[\"'\]]{0,2}[ \t]*(?:==?|:)[ \t]*[\"']?"
    r"(?P<value>[A-Za-z0-9_\-+/=.~!@#$%^&*]+)(?=[\"'\s,;)\]}]|$)"
)
"""``api_key="..."``, ``my token: ...`` in a comment."""


def scrub_code(secrets: Secrets, code: str, where) -> str:
    """``code`` with every string literal that holds a credential replaced by a read of an
    environment variable and every credential in a comment redacted, on as many lines as before;
    each is recorded in ``secrets``. ``where(line)`` says where a line of ``code`` comes from (for the
    warning and errors)."""
    tree = ast.parse(code)
    nodes = list(ast.walk(tree))
    names = _string_names(nodes)
    in_fstrings = {id(part) for node in nodes if isinstance(node, ast.JoinedStr) for part in ast.walk(node)}
    lines = code.split("\n")
    _scrub_comments(secrets, code, lines, where)  # a comment ends its line: string positions stay true
    replacements = []
    strings = [node for node in nodes if isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes))]
    for node in sorted(strings, key=lambda node: (node.lineno, node.col_offset)):  # named in the order of the code
        name = names.get(id(node))
        text = _text_of(node)
        if text is None:
            continue
        if id(node) in in_fstrings:
            if secret_in(text, name) is not None:
                raise CredentialInCodeError(
                    f"An f-string ({where(node.lineno)}) holds what looks like a credential, which the script "
                    "must not contain. Assign it to a variable and use the variable in the f-string: the export "
                    "then writes a read of an environment variable in its place."
                )
            continue
        label = f"{name} ({where(node.lineno)})" if name else f"a string in {where(node.lineno)}"
        read = secrets.expression(text, name, label)
        if read is not None:
            replacements.append((node, read if isinstance(node.value, str) else f"{read}.encode()"))
    for node, text in sorted(replacements, key=lambda r: (r[0].lineno, r[0].col_offset), reverse=True):
        _replace_string(lines, node, text)
    return "\n".join(lines)


def _text_of(node: ast.Constant) -> str | None:
    """The text of a string literal, or of a bytes literal that holds UTF-8 text (None: binary data)."""
    if isinstance(node.value, str):
        return node.value
    try:
        return node.value.decode()
    except UnicodeDecodeError:
        return None


def _replace_string(lines: list[str], node: ast.Constant, text: str) -> None:
    """Put ``text`` in place of the string literal ``node`` in ``lines``, on as many lines."""
    first, last = lines[node.lineno - 1], lines[node.end_lineno - 1]
    start = len(first.encode()[: node.col_offset].decode())  # ast offsets count UTF-8 bytes
    end = len(last.encode()[: node.end_col_offset].decode())
    if node.end_lineno > node.lineno:  # the same number of lines, so line numbers stay true
        text = f"({text}" + "\n" * (node.end_lineno - node.lineno) + ")"
    lines[node.lineno - 1: node.end_lineno] = (first[:start] + text + last[end:]).split("\n")


def _string_names(nodes: list[ast.AST]) -> dict[int, str]:
    """The name each string constant among ``nodes`` (every node of a tree) is given, by the id of
    its node; the nearest name wins (see the module docstring)."""
    names: dict[int, str] = {}
    for node in nodes:  # the variable a default stands in for
        variable = _variable_read(node)
        if variable:
            for default in [*node.args[1:2], *(k.value for k in node.keywords if k.arg in ("default", "value"))]:
                _name_values(names, default, variable)
        elif isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):  # os.getenv("NAME") or "..."
            for before, value in zip(node.values, node.values[1:]):
                variable = _variable_read(before) or variable
                if variable:
                    _name_values(names, value, variable)
    for node in nodes:  # a dict key
        if isinstance(node, ast.Dict):
            _name_values(names, node, None)
    for node in nodes:  # an argument
        if isinstance(node, ast.keyword) and node.arg:
            _name_values(names, node.value, node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            positional = [*node.args.posonlyargs, *node.args.args]
            for arg, default in zip(positional[len(positional) - len(node.args.defaults):], node.args.defaults):
                _name_values(names, default, arg.arg)
            for arg, default in zip(node.args.kwonlyargs, node.args.kw_defaults):
                if default is not None:
                    _name_values(names, default, arg.arg)
    for node in nodes:  # an assignment
        if isinstance(node, ast.Assign):
            for target in node.targets:
                _name_values(names, node.value, _target_name(target))
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.NamedExpr)) and node.value is not None:
            _name_values(names, node.value, _target_name(node.target))
    return names


def _name_values(names: dict[int, str], node: ast.AST, name: str | None) -> None:
    """Give ``name`` to the string constants of ``node`` (a string, or a list, tuple, set or dict of
    them, a dict's values named by their string keys) that have none yet."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)):
        names.setdefault(id(node), name)
    elif isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        for element in node.elts:
            _name_values(names, element, name)
    elif isinstance(node, ast.Dict):
        for key, value in zip(node.keys, node.values):
            is_name = isinstance(key, ast.Constant) and isinstance(key.value, str)
            _name_values(names, value, key.value if is_name else name)


def _target_name(target: ast.AST) -> str | None:
    if isinstance(target, ast.Name):
        return target.id
    if isinstance(target, ast.Attribute):
        return target.attr
    if isinstance(target, ast.Subscript) and isinstance(target.slice, ast.Constant):
        return str(target.slice.value)
    return None


def _variable_read(node: ast.AST) -> str | None:
    """The environment variable that ``os.getenv("NAME", ...)`` and the like read, else None."""
    if (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str) and ast.unparse(node.func) in _ENVIRONMENT_READS):
        return node.args[0].value
    return None


def _scrub_comments(secrets: Secrets, code: str, lines: list[str], where) -> None:
    """Replace, in ``lines`` (those of ``code``), every credential in a comment by ``<redacted>``."""
    try:
        comments = [token for token in tokenize.generate_tokens(io.StringIO(code).readline)
                    if token.type == tokenize.COMMENT]
    except (tokenize.TokenError, SyntaxError):
        return
    for token in comments:
        (row, column), text = token.start, token.string
        spans = _comment_spans(text)
        if not spans:
            continue
        for start, end, label in sorted(spans):
            secrets.found.append((f"{label} in a comment ({where(row)})", "redacted"))
        for start, end, _ in sorted(spans, reverse=True):
            text = text[:start] + "<redacted>" + text[end:]
        line = lines[row - 1]
        lines[row - 1] = line[:column] + text + line[column + len(token.string):]


def _comment_spans(text: str) -> list[tuple[int, int, str]]:
    """(start, end, what it is) of each credential in the comment ``text``, none overlapping another."""
    spans: list[tuple[int, int, str]] = []

    def add(start, end, label):
        if end > start and not any(start < e and s < end for s, e, _ in spans):
            spans.append((start, end, label))

    for found in _COMMENT_NAMED.finditer(text):  # named as the comment names it: "my key: ..."
        name = " ".join(found.group("name").split())
        where_in = secret_in(found.group("value"), name.replace(" ", "_"))
        if where_in is not None and credential_name(name.replace(" ", "_")) is not None:
            add(found.start("value") + where_in[0], found.start("value") + where_in[1], name)
    for pattern, env in SECRET_SHAPES:  # else by its form
        for found in pattern.finditer(text):
            if not is_placeholder(found.group()):
                add(found.start(), found.end(), env)
    for found in PASSWORD_IN_URL.finditer(text):
        add(found.start("password"), found.end("password"), "a password in a URL")
    for found in SCHEME.finditer(text):
        where_in = secret_in(found.group(), None)
        if where_in is not None:
            add(found.start() + where_in[0], found.start() + where_in[1], f"a {found.group('scheme')} credential")
    return spans
