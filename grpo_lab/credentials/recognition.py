"""What a credential looks like: by name (``OPENAI_API_KEY``, ``api_key``, ``token``, ``password``)
or by form (``sk-...``, ``hf_...``, ``ghp_...``, ``AKIA...``, ``Bearer ...``, a URL with a password).
A value called like a credential must look random too, and obvious placeholders (``api_key="EMPTY"``,
``"ollama"``, ``"sk-no-key-required"``) are none."""

from __future__ import annotations

import base64
import re


SECRET_ENV_NAMES = frozenset({
    "OPENAI_API_KEY", "ANTHROPIC_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HUGGINGFACE_HUB_TOKEN",
    "WANDB_API_KEY", "COMET_API_KEY", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN", "NEPTUNE_API_TOKEN",
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "GITHUB_TOKEN", "GH_TOKEN",
    "GOOGLE_API_KEY", "GEMINI_API_KEY", "MISTRAL_API_KEY", "COHERE_API_KEY", "GROQ_API_KEY",
    "TOGETHER_API_KEY", "DEEPSEEK_API_KEY", "OPENROUTER_API_KEY", "AZURE_OPENAI_API_KEY",
})
"""Environment variables that hold credentials: a name among them always marks a secret."""

SECRET_SHAPES = tuple((re.compile(r"(?<![A-Za-z0-9])" + pattern), env) for pattern, env in (
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
PASSWORD_IN_URL = re.compile(r"(?<![A-Za-z0-9+.\-])[A-Za-z][A-Za-z0-9+.\-]*://[^/\s:@]+:(?P<password>[^/\s@]+)@")
SCHEME = re.compile(r"(?P<scheme>Bearer|Basic|Token)[ \t]+(?P<credential>[^\s\"',;]+)", re.IGNORECASE)
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


def name_words(name: str) -> list[str]:
    """``OPENAI_API_KEY``, ``openai-api-key`` and ``openaiApiKey`` -> ``["openai", "api", "key"]``."""
    return [word.lower() for word in re.findall(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])", name)]


def credential_name(name: str | None) -> str | None:
    """``"strong"`` for a name that says it holds a credential (``api_key``, ``hub_token``,
    ``password``), ``"weak"`` for one that only says ``key`` (``SORT_KEY``: also a column or a sort
    key; its value must look random too), else None."""
    if not name:
        return None
    if name.upper() in SECRET_ENV_NAMES:
        return "strong"
    words = name_words(name)
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
    for pattern, env in SECRET_SHAPES:
        for found in pattern.finditer(value):
            if not is_placeholder(found.group()):
                return found.start(), found.end(), env
    if _URL_WITH_PASSWORD.match(value):
        return 0, len(value), None
    scheme = SCHEME.fullmatch(value.strip())
    if scheme:  # "Bearer <token>", "Basic <base64 of user:password>": the part after the scheme word
        credential = scheme.group("credential")
        if is_placeholder(credential) or _not_a_credential(credential):
            return None
        basic = scheme.group("scheme").lower() == "basic" and _basic_credentials(credential)
        if basic or _looks_random(credential):
            start = value.index(credential, value.index(scheme.group("scheme")) + len(scheme.group("scheme")))
            return start, start + len(credential), None
        return None
    kind = credential_name(name)
    if kind is None or _not_a_credential(value) or is_placeholder(value):
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


def is_placeholder(value: str) -> bool:
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


def contains_secret(value, name: str | None = None) -> bool:
    """Whether ``value`` (a string, UTF-8 bytes, or a dict, list, tuple or set of them) holds a credential."""
    if isinstance(value, bytes):
        try:
            value = value.decode()
        except UnicodeDecodeError:  # binary data, not text a credential is written in
            return False
    if isinstance(value, dict):
        return any(contains_secret(v, k if isinstance(k, str) else name) for k, v in value.items())
    if isinstance(value, (list, tuple, set)):
        return any(contains_secret(v, name) for v in value)
    return secret_in(value, name) is not None
