"""Response templates for the tool-call formats of well-known chat templates.

``tools=`` parses each completion with ``tokenizer.parse_response``, which needs the tokenizer's
``response_template`` (transformers' response parsing): where the model's call is framed, how
its arguments are written. Few tokenizers ship one. When a tokenizer has none, its chat template
is read for the markers a tool-call format writes, and the matching template is set (TRL does the
same for the chat templates it knows):

- ChatML with JSON calls (Qwen2.5, Qwen3 and others): ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
  after ``<|im_start|>assistant``, an optional ``<think>`` block first;
- ChatML with XML calls (Qwen3.5 and later): ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...``;
- Llama 3.1 and 3.2: a bare ``{"name": ..., "parameters": ...}`` that ends the turn (``<|eot_id|>``);
- GLM-4-MoE: ``<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>``.

A format is recognised only when every marker it needs is in the chat template; anything else is
left to the user, with the error that names the fix.
"""

from __future__ import annotations

from importlib.metadata import version

from packaging.version import Version

_TYPES_FROM_TOOLS = Version(version("transformers")) >= Version("5.15.0")
# XML formats write a string argument and a number the same way; from transformers 5.15 parse_response
# types the values from the tools' schemas, before that a lenient JSON parse guesses.
_XML_VALUE = {"name": "text"} if _TYPES_FROM_TOOLS else {"name": "json", "args": {"allow_non_json": True}}
_NAMED_CALL = {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}}


def _thinking() -> dict:
    return {"open": "<think>", "close_pattern": r"</think>\s*", "content": "text"}


def _template(anchor: str, calls: dict, end_pattern: str, *, thinking: bool) -> dict:
    fields = {"reasoning_content": _thinking()} if thinking else {}
    fields["tool_calls"] = {"repeats": True, **calls}
    fields["content"] = {"close_pattern": end_pattern, "content": "text"}
    return {"defaults": {"role": "assistant"}, "start_anchor": anchor, "fields": fields}


def _xml_calls(open_pattern: str, close_pattern: str, tag_pattern: str) -> dict:
    return {"open_pattern": open_pattern, "close_pattern": close_pattern, "content": "xml-inline",
            "content_args": {"tag_pattern": tag_pattern, "value_parser": _XML_VALUE}, "transform": _NAMED_CALL}


CHATML_JSON = _template(
    "<|im_start|>assistant\n",
    {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "content": "json",
     "transform": {"type": "function", "function": "{content}"}},
    r"<\|im_end\|>\s*", thinking=True,
)
CHATML_XML = _template(
    "<|im_start|>assistant\n",
    _xml_calls(r"<tool_call>\s*<function=(?P<name>[^\n>]+)>", r"</tool_call>\s*",
               r"<parameter=(?P<key>[^>\n]+)>\s*(?P<value>.*?)\s*</parameter>"),
    r"<\|im_end\|>\s*", thinking=True,
)
LLAMA3_JSON = _template(
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    {"open_pattern": r'\{"name":\s*"(?P<name>[^"]+)",\s*"parameters":\s*', "close_pattern": r"\}<\|eot_id\|>\s*",
     "content": "json", "transform": _NAMED_CALL},
    r"<\|eot_id\|>\s*", thinking=False,
)
GLM4_XML = _template(
    "<|assistant|>",
    _xml_calls(r"<tool_call>(?P<name>[^\s<]+)\s*", r"</tool_call>\s*",
               r"<arg_key>(?P<key>[^<]+)</arg_key>\s*<arg_value>(?P<value>.*?)</arg_value>"),
    r"<\|user\|>\s*|$", thinking=True,
)

FORMATS: tuple[tuple[str, tuple[str, ...], tuple[str, ...], dict], ...] = (
    # name, markers the chat template must hold, markers it must not hold, response template
    ("ChatML with XML tool calls", ("<|im_start|>", "<tool_call>", "<function=", "<parameter="), (), CHATML_XML),
    ("ChatML with JSON tool calls", ("<|im_start|>", "<tool_call>", "</tool_call>"), ("<function=",), CHATML_JSON),
    ("Llama 3 JSON tool calls", ("<|start_header_id|>", "<|eot_id|>", '"parameters"'), (), LLAMA3_JSON),
    ("GLM-4 XML tool calls", ("<|assistant|>", "<tool_call>", "<arg_key>", "<arg_value>"), (), GLM4_XML),
)
"""The recognised formats, most specific first."""


def known_response_template(chat_template: str | None) -> tuple[str, dict] | None:
    """(format name, response template) for the tool-call format ``chat_template`` renders, or
    None when it matches none of :data:`FORMATS`."""
    if not isinstance(chat_template, str):
        return None
    for name, needed, excluded, template in FORMATS:
        if all(marker in chat_template for marker in needed) and not any(m in chat_template for m in excluded):
            return name, template
    return None
