"""Credentials in what an export writes: found by name (``OPENAI_API_KEY``, ``api_key``, ``token``,
``password``, the variable an ``os.getenv`` default stands in for) or by form (``sk-...``, ``hf_...``,
``ghp_...``, ``AKIA...``, ``Bearer ...``, a URL with a password), and replaced in the script by a read
of an environment variable, redacted in a comment, or left out of a data file. Obvious placeholders
(``api_key="EMPTY"``, ``"ollama"``, ``"sk-no-key-required"``) are kept as written."""

from __future__ import annotations

import ast
import base64
import io
import re
import tokenize
from pathlib import Path


SECRET_ENV_NAMES = frozenset({
    "OPENAI_API_KEY", "ANTHROPIC_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HUGGINGFACE_HUB_TOKEN",
    "WANDB_API_KEY", "COMET_API_KEY", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN", "NEPTUNE_API_TOKEN",
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "GITHUB_TOKEN", "GH_TOKEN",
    "GOOGLE_API_KEY", "GEMINI_API_KEY", "MISTRAL_API_KEY", "COHERE_API_KEY", "GROQ_API_KEY",
    "TOGETHER_API_KEY", "DEEPSEEK_API_KEY", "OPENROUTER_API_KEY", "AZURE_OPENAI_API_KEY",
})
"""Environment variables that hold credentials: a name among them always marks a secret."""

_SECRET_SHAPES = tuple((re.compile(r"(?<![A-Za-z0-9])" + pattern), env) for pattern, env in (
    (r"sk-ant-[A-Za-z0-9_\-]{16,}", "ANTHROPIC_API_KEY"),
    (r"sk-[A-Za-z0-9_\-]{16,}", "OPENAI_API_KEY"),
    (r"hf_[A-Za-z0-9]{20,}", "HF_TOKEN"),
    (r"(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}", "GITHUB_TOKEN"),
    (r"glpat-[A-Za-z0-9_\-]{20,}", "GITLAB_TOKEN"),
    (r"xox[abposr]-[A-Za-z0-9\-]{10,}", "SLACK_TOKEN"),
    (r"(?:AKIA|ASIA)[A-Z0-9]{16}", "AWS_ACCESS_KEY_ID"),
    (r"AIza[0-9A-Za-z_\-]{35}", "GOOGLE_API_KEY"),
))
"""Credentials recognisable by their form, whatever they are called, and the variable that
conventionally holds each."""

_URL_WITH_PASSWORD = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://[^/\s:@]+:[^/\s@]+@")
_PASSWORD_IN_URL = re.compile(r"(?<![A-Za-z0-9+.\-])[A-Za-z][A-Za-z0-9+.\-]*://[^/\s:@]+:(?P<password>[^/\s@]+)@")
_SCHEME = re.compile(r"(?P<scheme>Bearer|Basic|Token)[ \t]+(?P<credential>[^\s\"',;]+)", re.IGNORECASE)
"""An ``Authorization`` value: a scheme word, then the credential."""

_KNOWN_PREFIX = re.compile(r"^(?:sk-ant-|sk-proj-|sk-|hf_|gh[pousr]_|github_pat_|glpat-|xox[abposr]-|AKIA|ASIA|AIza)")
_PLACEHOLDER_MARKS = (
    "no-key", "no_key", "nokey", "not-needed", "not_needed", "notneeded", "not-required", "notrequired", "xxxx",
    "your", "placeholder", "dummy", "empty", "changeme", "change-me", "change_me", "replace-me", "replace_me",
    "redacted", "example", "fake", "abc123", "key-here", "key_here", "...", "***",
)
_PLACEHOLDERS = frozenset({
    "ollama", "lm-studio", "lmstudio", "vllm", "sglang", "local", "localhost", "unused", "anything", "none", "null",
    "nil", "na", "n/a", "test", "testing", "secret", "password", "token", "key", "apikey", "api-key", "api_key",
    "sk-1234", "token-abc123",
})
"""Values that stand in for a credential a local server does not check (``api_key="EMPTY"``, vLLM's
``"token-abc123"``, llama.cpp's ``"sk-no-key-required"``) or that a template leaves to fill in."""

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

_CREDENTIAL_WORDS = frozenset({
    "token", "tokens", "secret", "secrets", "password", "passwd", "pwd", "passphrase", "credential",
    "credentials", "auth", "authorization", "apikey", "bearer",
})
_CREDENTIAL_PAIRS = frozenset({("api", "key"), ("access", "key"), ("private", "key"), ("secret", "key"),
                               ("client", "secret"), ("license", "key")})
_NOT_CREDENTIAL_WORDS = frozenset({
    "pad", "eos", "bos", "unk", "sep", "cls", "mask", "special", "start", "end", "stop", "think", "max", "min",
    "num", "count", "type", "id", "ids", "level", "len", "length", "limit", "size", "path", "file", "dir", "env",
    "var", "name", "names", "url", "uri", "endpoint", "host", "field", "column", "col", "header", "mode", "method",
    "scheme", "kind", "provider", "strategy", "format", "prefix", "suffix", "split", "separator", "delimiter",
    "marker", "tag", "pattern", "regex", "template",
})
"""Words that make a credential-sounding name something else: ``pad_token``, ``max_tokens``,
``TOKEN_ENV``, ``api_key_path``."""


def _name_words(name: str) -> list[str]:
    """``OPENAI_API_KEY``, ``openai-api-key`` and ``openaiApiKey`` -> ``["openai", "api", "key"]``."""
    return [word.lower() for word in re.findall(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])", name)]


def _credential_name(name: str | None) -> str | None:
    """``"strong"`` for a name that says it holds a credential (``api_key``, ``hub_token``,
    ``password``), ``"weak"`` for one that only says ``key`` (``SORT_KEY``: also a column or a sort
    key; its value must look random too), else None."""
    if not name:
        return None
    if name.upper() in SECRET_ENV_NAMES:
        return "strong"
    words = _name_words(name)
    if set(words) & _NOT_CREDENTIAL_WORDS:
        return None
    if set(words) & _CREDENTIAL_WORDS or set(zip(words, words[1:])) & _CREDENTIAL_PAIRS:
        return "strong"
    return "weak" if "key" in words else None


def secret_in(value, name: str | None = None) -> tuple[int, int, str | None] | None:
    """Where in ``value`` (a string, called ``name``) a credential is: (start, end, the variable that
    conventionally holds it, or None); None when it holds none. A value called like a credential
    must look random too (``api_key="EMPTY"`` is kept), and an obvious placeholder of a known form
    (``"sk-no-key-required"``, ``"hf_xxxxxxxxxxxxxxxxxxxx"``) is none."""
    if not isinstance(value, str) or not value.strip():
        return None
    for pattern, env in _SECRET_SHAPES:
        for found in pattern.finditer(value):
            if not _placeholder(found.group()):
                return found.start(), found.end(), env
    if _URL_WITH_PASSWORD.match(value):
        return 0, len(value), None
    scheme = _SCHEME.fullmatch(value.strip())
    if scheme:  # "Bearer <token>", "Basic <base64 of user:password>": the part after the scheme word
        credential = scheme.group("credential")
        if _placeholder(credential) or _not_a_credential(credential):
            return None
        basic = scheme.group("scheme").lower() == "basic" and _basic_credentials(credential)
        if basic or _looks_random(credential):
            start = value.index(credential, value.index(scheme.group("scheme")) + len(scheme.group("scheme")))
            return start, start + len(credential), None
        return None
    kind = _credential_name(name)
    if kind is None or _not_a_credential(value) or _placeholder(value):
        return None
    if kind == "strong":
        return (0, len(value), None) if _looks_random(value) else None
    random_looking = len(value) >= 16 and re.search(r"[0-9]", value) and re.search(r"[A-Za-z]", value)
    return (0, len(value), None) if random_looking else None


def _looks_random(value: str) -> bool:
    """Whether ``value`` reads like a password or a key rather than a word: eight characters or more,
    letters mixed with digits or symbols (``hunter22``, ``x9Yk2mQ7pLw4``), or a long run of mixed
    case like base64."""
    if len(value) < 8 or any(c.isspace() for c in value):
        return False
    letters = [c for c in value if c.isalpha()]
    if letters and re.search(r"[0-9!@#$%^&*+=/?~]", value):
        return True
    upper = sum(c.isupper() for c in letters)
    return (len(value) >= 20 and not re.search(r"[-_.]", value) and 0 < upper < len(letters)
            and upper >= len(letters) / 4)  # camelCase words have one capital in six or so


def _basic_credentials(credential: str) -> bool:
    """Whether ``credential`` is base64 of ``user:password`` (HTTP Basic authentication)."""
    try:
        text = base64.b64decode(credential, validate=True).decode("utf-8")
    except (ValueError, UnicodeDecodeError):
        return False
    return ":" in text and text.isprintable()


def _placeholder(value: str) -> bool:
    """Whether ``value`` is an obvious stand-in for a credential: a placeholder word (``"EMPTY"``,
    ``"ollama"``, ``"token-abc123"``), one that says so (``"sk-no-key-required"``, ``"<your key>"``,
    ``"sk-xxxxxxxxxxxxxxxxxxxx"``), or a run of one character or of the digits in order."""
    lower = value.lower()
    if lower in _PLACEHOLDERS or any(mark in lower for mark in _PLACEHOLDER_MARKS):
        return True
    core = re.sub(r"[^a-z0-9]", "", _KNOWN_PREFIX.sub("", value).lower())
    return len(set(core)) <= 2 or core in "0123456789" * 3


def _not_a_credential(value: str) -> bool:
    """Whether ``value``, though called like a credential, is something else: a variable or constant
    name (``"HF_TOKEN"``), text, markup (``"<think>"``, ``"####"``), a path or address, a setting, a
    template (``"{token}"``, ``"%(key)s"``)."""
    return bool(
        re.fullmatch(r"[A-Z][A-Z0-9_]*", value) or any(c.isspace() for c in value) or value[0] in "<[{$/."
        or not re.search(r"[A-Za-z0-9]", value) or value.startswith(("http://", "https://"))
        or value.lower() in ("none", "null", "true", "false", "auto", "default")
        or re.search(r"\{[^}]*\}|%\(\w+\)|\$\{", value)
    )


def _contains_secret(value, name: str | None = None) -> bool:
    if isinstance(value, dict):
        return any(_contains_secret(v, k if isinstance(k, str) else name) for k, v in value.items())
    if isinstance(value, (list, tuple, set)):
        return any(_contains_secret(v, name) for v in value)
    return secret_in(value, name) is not None


class Secrets:
    """What an export found that looks like a credential: each replaced, in the script, by a read of
    an environment variable (or left out of a data file), and named in one warning."""

    def __init__(self):
        self.found: list[tuple[str, str]] = []  # (how the value is named, what the script does instead)
        self.values: dict[str, str] = {}  # environment variable -> the secret it replaces

    def _variable(self, name: str | None, conventional: str | None, secret: str) -> str:
        """The environment variable the script reads: the name itself where it reads like one
        (``OPENAI_API_KEY``), the variable that conventionally holds a credential of this form, the
        Hugging Face token for a ``token``, else the name in capitals; numbered where two
        different secrets would share one."""
        if name and (name.upper() in SECRET_ENV_NAMES
                     or re.fullmatch(r"[A-Z][A-Z0-9_]*", name) and _credential_name(name) is not None):
            env = name.upper()
        elif conventional:
            env = conventional
        elif name and _name_words(name) in (["token"], ["hub", "token"], ["hf", "token"], ["use", "auth", "token"]):
            env = "HF_TOKEN"
        else:
            env = "_".join(_name_words(name or "")).upper() or "SECRET"
        candidate, number = env, 1
        while self.values.get(candidate, secret) != secret:
            number += 1
            candidate = f"{env}_{number}"
        self.values[candidate] = secret
        return candidate

    def expression(self, value: str, name: str | None, label: str, optional: bool = False) -> str | None:
        """Python source that reads the credential in ``value`` from the environment (None when it
        holds none). ``optional``: ``os.environ.get`` (None when the variable is not set) instead of
        ``os.environ[...]`` (a KeyError naming it)."""
        where = secret_in(value, name)
        if where is None:
            return None
        start, end, conventional = where
        env = self._variable(name, conventional, value[start:end])
        self.found.append((label, f"from ${env}"))
        whole = start == 0 and end == len(value)
        read = f'os.environ.get("{env}")' if optional and whole else f'os.environ["{env}"]'
        if whole:
            return read
        return "(" + " + ".join([*([repr(value[:start])] if start else []), read,
                                 *([repr(value[end:])] if end < len(value) else [])]) + ")"

    def render(self, value, name: str | None, label: str, optional: bool = False, context: str = "") -> str:
        """``repr(value)`` (a literal), with every credential inside it read from the environment;
        ``label`` names ``value`` (``config model_init_kwargs``), ``context`` follows the label of
        each credential in it (``HEADERS['Authorization'] (a global that f uses)``)."""
        if not _contains_secret(value, name):
            return repr(value)
        if isinstance(value, str):
            return self.expression(value, name, label + context, optional)
        if isinstance(value, dict):
            return "{" + ", ".join(
                f"{k!r}: {self.render(v, k if isinstance(k, str) else name, f'{label}[{k!r}]', optional, context)}"
                for k, v in value.items()
            ) + "}"
        items = [self.render(v, name, f"{label}[{i}]", optional, context) for i, v in enumerate(value)]
        if isinstance(value, tuple):
            return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
        return ("[{}]" if isinstance(value, list) else "{{{}}}").format(", ".join(items))

    def scrub_code(self, code: str, where) -> str:
        """``code`` with every string literal that holds a credential replaced by a read of an
        environment variable and every credential in a comment redacted, on as many lines as before;
        ``where(line)`` says where a line of ``code`` comes from (for the warning and errors). The
        default of ``os.getenv("NAME", ...)`` (``os.environ.get``, ``setdefault``, ``getenv(...) or
        ...``) is named by ``NAME``."""
        tree = ast.parse(code)
        names: dict[int, str] = {}  # id of a string constant -> the name it is given

        def name_values(node, name):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.setdefault(id(node), name)
            elif isinstance(node, (ast.List, ast.Tuple, ast.Set)):
                for element in node.elts:
                    name_values(element, name)
            elif isinstance(node, ast.Dict):
                for key, value in zip(node.keys, node.values):
                    is_name = isinstance(key, ast.Constant) and isinstance(key.value, str)
                    name_values(value, key.value if is_name else name)

        def target_name(target):
            if isinstance(target, ast.Name):
                return target.id
            if isinstance(target, ast.Attribute):
                return target.attr
            if isinstance(target, ast.Subscript) and isinstance(target.slice, ast.Constant):
                return str(target.slice.value)
            return None

        def variable_read(node):
            """The environment variable that ``os.getenv("NAME", ...)`` and the like read, else None."""
            if (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str) and ast.unparse(node.func) in _ENVIRONMENT_READS):
                return node.args[0].value
            return None

        nodes = list(ast.walk(tree))
        for node in nodes:  # the nearest name first: the variable a default stands in for, a dict key,
            variable = variable_read(node)  # then an argument, then an assignment
            if variable:
                for default in [*node.args[1:2], *(k.value for k in node.keywords if k.arg in ("default", "value"))]:
                    name_values(default, variable)
            elif isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):  # os.getenv("NAME") or "..."
                for before, value in zip(node.values, node.values[1:]):
                    variable = variable_read(before) or variable
                    if variable:
                        name_values(value, variable)
        for node in nodes:
            if isinstance(node, ast.Dict):
                name_values(node, None)
        for node in nodes:
            if isinstance(node, ast.keyword) and node.arg:
                name_values(node.value, node.arg)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                positional = [*node.args.posonlyargs, *node.args.args]
                for arg, default in zip(positional[len(positional) - len(node.args.defaults):], node.args.defaults):
                    name_values(default, arg.arg)
                for arg, default in zip(node.args.kwonlyargs, node.args.kw_defaults):
                    if default is not None:
                        name_values(default, arg.arg)
        for node in nodes:
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    name_values(node.value, target_name(target))
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.NamedExpr)) and node.value is not None:
                name_values(node.value, target_name(node.target))
        in_fstrings = {id(part) for node in nodes if isinstance(node, ast.JoinedStr) for part in ast.walk(node)}
        lines = code.split("\n")
        self._scrub_comments(code, lines, where)  # a comment ends its line: string positions stay true
        replacements = []
        strings = [node for node in nodes if isinstance(node, ast.Constant) and isinstance(node.value, str)]
        for node in sorted(strings, key=lambda node: (node.lineno, node.col_offset)):  # named in the order of the code
            name = names.get(id(node))
            if id(node) in in_fstrings:
                if secret_in(node.value, name) is not None:
                    from grpo_lab.export import ExportError  # the export's own error; export imports this module

                    raise ExportError(
                        f"An f-string ({where(node.lineno)}) holds what looks like a credential, which the script "
                        "must not contain. Assign it to a variable and use the variable in the f-string: the export "
                        "then writes a read of an environment variable in its place."
                    )
                continue
            label = f"{name} ({where(node.lineno)})" if name else f"a string in {where(node.lineno)}"
            text = self.expression(node.value, name, label)
            if text is not None:
                replacements.append((node, text))
        for node, text in sorted(replacements, key=lambda r: (r[0].lineno, r[0].col_offset), reverse=True):
            first, last = lines[node.lineno - 1], lines[node.end_lineno - 1]
            start = len(first.encode()[: node.col_offset].decode())  # ast offsets count UTF-8 bytes
            end = len(last.encode()[: node.end_col_offset].decode())
            if node.end_lineno > node.lineno:  # the same number of lines, so line numbers stay true
                text = f"({text}" + "\n" * (node.end_lineno - node.lineno) + ")"
            lines[node.lineno - 1: node.end_lineno] = (first[:start] + text + last[end:]).split("\n")
        return "\n".join(lines)

    def _scrub_comments(self, code: str, lines: list[str], where) -> None:
        """Replace, in ``lines`` (those of ``code``), every credential in a comment by ``<redacted>``."""
        try:
            comments = [token for token in tokenize.generate_tokens(io.StringIO(code).readline)
                        if token.type == tokenize.COMMENT]
        except (tokenize.TokenError, SyntaxError):
            return
        for token in comments:
            (row, column), text = token.start, token.string
            spans: list[tuple[int, int, str]] = []  # (start, end, what it is) in the comment's text

            def add(start, end, label):
                if end > start and not any(start < e and s < end for s, e, _ in spans):
                    spans.append((start, end, label))

            for found in _COMMENT_NAMED.finditer(text):  # named as the comment names it: "my key: ..."
                name = " ".join(found.group("name").split())
                where_in = secret_in(found.group("value"), name.replace(" ", "_"))
                if where_in is not None and _credential_name(name.replace(" ", "_")) is not None:
                    add(found.start("value") + where_in[0], found.start("value") + where_in[1], name)
            for pattern, env in _SECRET_SHAPES:  # else by its form
                for found in pattern.finditer(text):
                    if not _placeholder(found.group()):
                        add(found.start(), found.end(), env)
            for found in _PASSWORD_IN_URL.finditer(text):
                add(found.start("password"), found.end("password"), "a password in a URL")
            for found in _SCHEME.finditer(text):
                where_in = secret_in(found.group(), None)
                if where_in is not None:
                    add(found.start() + where_in[0], found.start() + where_in[1], f"a {found.group('scheme')} credential")
            if not spans:
                continue
            for start, end, label in sorted(spans):
                self.found.append((f"{label} in a comment ({where(row)})", "redacted"))
            for start, end, _ in sorted(spans, reverse=True):
                text = text[:start] + "<redacted>" + text[end:]
            line = lines[row - 1]
            lines[row - 1] = line[:column] + text + line[column + len(token.string):]

    def scrub_json(self, folder: Path) -> None:
        """Leave out of the JSON files in ``folder`` (a tokenizer's or adapter's files) every entry
        that holds a credential (e.g. an ``api_key`` given to ``from_pretrained``, which a tokenizer
        saves among its init arguments)."""
        import json

        for file in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            try:
                data = json.loads(file.read_text())
            except (UnicodeDecodeError, ValueError):
                continue
            dropped = []

            def clean(value, name, path):
                if isinstance(value, dict):
                    for key in list(value):
                        at = f"{path}[{key!r}]" if path else str(key)
                        if secret_in(value[key], str(key)) is not None:
                            dropped.append(at)
                            del value[key]
                        else:
                            clean(value[key], str(key), at)
                elif isinstance(value, list):
                    for index, item in enumerate(value):
                        if secret_in(item, name) is not None:
                            dropped.append(f"{path}[{index}]")
                            value[index] = None
                        else:
                            clean(item, name, f"{path}[{index}]")

            clean(data, None, "")
            if dropped:
                file.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
                self.found += [(f"{at} in {file.parent.name}/{file.name}", "left out") for at in dropped]

    def warn(self, script: Path) -> None:
        """One warning that names each credential found and what the script does instead (never a value)."""
        from grpo_lab import notices

        if not self.found:
            return
        variables = sorted(self.values)
        notices.warn(
            f"{script.name} holds no secrets: the export replaced what looks like credentials. "
            + "; ".join(f"{label}: {what}" for label, what in self.found) + ". "
            + (f"Set {', '.join(variables)} in the environment where the script runs." if variables else "")
        )
