"""Answer extraction helpers that the ready-made reward functions compose, and that a reward
function of your own may use: the text of a completion (plain or conversational), the last number,
the content of the last ``\\boxed{...}``, the content of the last ``<tag>...</tag>``.

Each returns None when there is nothing to extract; none of them raises on odd text."""

from __future__ import annotations

import re

__all__ = ["completion_text", "last_boxed", "last_number", "tagged"]


def _content_text(content) -> str:
    """A message's ``content``: a string, None (a message that only calls tools), or a list of parts
    (``{"type": "text", "text": ...}``, images and others), whose text parts are joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text") or "") for part in content
                       if isinstance(part, dict) and part.get("type", "text") == "text")
    return str(content)


def completion_text(completion) -> str:
    """The text of one completion.

    A plain completion is a string and is returned as is. A conversational completion is a list of
    message dicts; its text is the content of its last ``"assistant"`` message (the last message
    when none has that role). For the usual one-message completion that is the message's content,
    the text TRL's reward functions read as ``completion[0]["content"]``; with tool calls it is the
    final reply, where the answer is. A single message dict is read as that message.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return _content_text(completion.get("content"))
    if isinstance(completion, (list, tuple)):
        messages = [m for m in completion if isinstance(m, dict)]
        if not messages:
            return ""
        replies = [m for m in messages if m.get("role") == "assistant"]
        return _content_text((replies or messages)[-1].get("content"))
    return "" if completion is None else str(completion)


# A number: thousands-separated (1,234 or 1,234,567.5, exactly three digits per group), plain
# (42, 3.14) or starting with its decimal point (.5). A point with no digit after it ("42.")
# ends a sentence and is not part of the number.
_NUMBER = re.compile(
    r"(?<![\d.])(?P<sign>[-+\u2212])?"
    r"(?P<digits>\d{1,3}(?:,\d{3})+(?!\d)(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
)


def last_number(text: str) -> str | None:
    """The last number in ``text``, normalised: thousands separators removed (``1,234`` -> ``1234``),
    a leading ``+`` dropped, a minus sign kept (``-3.5``; the Unicode minus becomes ``-``), a bare
    decimal point given its zero (``.5`` -> ``0.5``), a sentence's final period left out (``is 42.``
    -> ``42``). A sign right after a letter, digit or closing bracket is an operator, not a sign
    (``5-3`` -> ``3``). Commas not followed by exactly three digits separate numbers (``1,2,3`` ->
    ``3``). None when ``text`` holds no digit."""
    found = None
    for match in _NUMBER.finditer(text or ""):
        found = match
    if found is None:
        return None
    digits = found["digits"].replace(",", "")
    if digits.startswith("."):
        digits = "0" + digits
    start = found.start()
    before = text[start - 1] if start > 0 else ""
    negative = found["sign"] in ("-", "\u2212") and not (before.isalnum() or before in ")]}")
    return "-" + digits if negative else digits


_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def _braced(text: str, start: int) -> str | None:
    """The content of the brace group opening at ``text[start]`` (``{``), nested groups and escaped
    braces (``\\{``) included; None when it never closes (a truncated completion)."""
    depth, i = 0, start
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2  # an escaped character, \{ and \} included, never opens or closes a group
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1:i]
        i += 1
    return None


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` or ``\\fbox{...}`` in ``text``, stripped, with its
    nested braces (``\\boxed{\\frac{1}{2}}`` -> ``\\frac{1}{2}``). The brace-less form
    ``\\boxed 5`` gives the token after the space. None when there is no box, or when the last one
    never closes (a completion cut off inside its answer is not given an earlier box's answer)."""
    matches = list(_BOX.finditer(text or ""))
    if not matches:
        return None
    end = matches[-1].end()
    rest = text[end:]
    stripped = rest.lstrip()
    if stripped.startswith("{"):
        content = _braced(text, end + len(rest) - len(stripped))
        return None if content is None else content.strip()
    if rest[:1] == " " and stripped:
        return re.split(r"[\s$]", stripped, maxsplit=1)[0]
    return None


def tagged(text: str, tag: str) -> str | None:
    """The content of the last ``<tag>...</tag>`` in ``text``, stripped, newlines included: the text
    between the last closing tag and the last opening tag before it (with nested or repeated tags,
    the innermost last one). None when there is no closing tag, or no opening tag before it."""
    text = text or ""
    end = text.rfind(f"</{tag}>")
    if end < 0:
        return None
    start = text.rfind(f"<{tag}>", 0, end)
    if start < 0:
        return None
    return text[start + len(tag) + 2:end].strip()
