"""``Secrets``: what one export found that looks like a credential, and what the script does
instead: a read of an environment variable (named after the value's name, or the variable that
conventionally holds a credential of its form), a redaction in a comment, or an entry left out of a
data file; all named in one warning, never with a value."""

from __future__ import annotations

import re
from pathlib import Path

from grpo_lab.credentials.code_scrubbing import scrub_code
from grpo_lab.credentials.recognition import SECRET_ENV_NAMES, contains_secret, credential_name, name_words, secret_in


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
                     or re.fullmatch(r"[A-Z][A-Z0-9_]*", name) and credential_name(name) is not None):
            env = name.upper()
        elif conventional:
            env = conventional
        elif name and name_words(name) in (["token"], ["hub", "token"], ["hf", "token"], ["use", "auth", "token"]):
            env = "HF_TOKEN"
        else:
            env = "_".join(name_words(name or "")).upper() or "SECRET"
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
        if not contains_secret(value, name):
            return repr(value)
        if isinstance(value, str):
            return self.expression(value, name, label + context, optional)
        if isinstance(value, bytes):
            return f"{self.expression(value.decode(), name, label + context)}.encode()"
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
        return scrub_code(self, code, where)

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
