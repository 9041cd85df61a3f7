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
- GLM-4-MoE: ``<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>``;
- GPT-OSS (harmony): reasoning in the ``analysis`` channel (read back as ``thinking``), the answer in
  ``final``, a call as a ``commentary`` message to ``functions.NAME`` holding JSON and ended by
  ``<|call|>``, its recipient before the channel (as the chat template writes it) or after it (as
  the models often write it). The template writes one call per turn;
- Gemma 4 (every revision, and DiffusionGemma, whose template writes the same):
  ``<|tool_call>call:NAME{key:VALUE,...}<tool_call|>``, keys bare and strings between ``<|"|>``,
  after an optional ``<|channel>thought ...<channel|>``. Only the latest revision (TRL's
  ``gemma4_v5``) writes a null argument as ``null``; the earlier ones write ``None``, which is not
  JSON, so such a call does not parse;
- LFM2.5, and LFM2 from the revision that writes calls: a turn's calls in one
  ``<|tool_call_start|>[name(key=value, ...), ...]<|tool_call_end|>``, read by transformers'
  ``python-call-list`` parser (unrecognised where the installed transformers lacks it), after an
  optional ``<think>`` block (read back as ``thinking``). LFM2.5's first two revisions (TRL's
  ``lfm2_2_5`` and ``lfm2_2_5_v2``) write strings unescaped: a string holding a quote or a line
  break does not parse, and a backslash in one reads as an escape; the others escape strings;
- DeepSeek-R1-Distill: reasoning and answer only. The prompt opens ``<think>``; the reasoning runs
  to ``</think>``, the answer to ``<｜end▁of▁sentence｜>``. That template renders no tool definitions
  and drops an assistant turn's calls, so the later checks of ``tools=`` refuse it all the same.

Not recognised: DeepSeek-V3, whose template renders no tool definitions and cannot render a call's
arguments as an object (TRL has no response template for it either), and the first LFM2 template,
which renders no calls. A format is recognised only when every marker it needs is in the chat
template; anything else is left to the user, with the error that names the fix.
"""

from __future__ import annotations

from importlib.metadata import version

from packaging.version import Version

_TYPES_FROM_TOOLS = Version(version("transformers")) >= Version("5.15.0")
# XML formats write a string argument and a number the same way; from transformers 5.15 parse_response
# types the values from the tools' schemas, before that a lenient JSON parse guesses.
_XML_VALUE = {"name": "text"} if _TYPES_FROM_TOOLS else {"name": "json", "args": {"allow_non_json": True}}
_NAMED_CALL = {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}}


def _parsers_installed(template: dict) -> bool:
    """Whether the installed transformers has every content parser ``template`` reads a field with."""
    try:
        from transformers.utils.chat_parsing.content_parsers import CONTENT_PARSERS
    except ImportError:  # a transformers without response-template parsing: every format fails alike
        return True
    return all(field.get("content", "text") in CONTENT_PARSERS for field in template["fields"].values())


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

# harmony: the recipient stands before the channel in the chat template's rendering, after it in
# what the models write; the content type (``json``, maybe after ``<|constrain|>``) may be left out
_RECIPIENT = r"to=functions\.(?P<name>[^\s<]+)\s*"
_JSON_MESSAGE = r"\s*(?:(?:<\|constrain\|>)?json)?<\|message\|>"
GPT_OSS = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|start|>assistant",
    "fields": {
        "thinking": {"open": "<|channel|>analysis<|message|>", "close_pattern": r"<\|end\|>\s*", "content": "text"},
        "tool_calls": {
            "open_pattern": rf"{_RECIPIENT}<\|channel\|>commentary{_JSON_MESSAGE}"
                            rf"|<\|channel\|>commentary\s+{_RECIPIENT}{_JSON_MESSAGE}",
            "close_pattern": r"<\|call\|>\s*", "repeats": True, "content": "json", "transform": _NAMED_CALL,
        },
        "content": {"open": "<|channel|>final<|message|>", "close_pattern": r"(?:<\|return\|>|<\|end\|>)\s*",
                    "content": "text"},
    },
}
GEMMA4 = {
    "defaults": {"role": "assistant"},
    # a model turn, or the same turn going on after the tool results
    "start_anchor_pattern": r"<\|turn>model\n|<tool_response\|>",
    "fields": {
        "reasoning_content": {"open": "<|channel>thought", "close_pattern": r"<channel\|>\s*", "content": "text"},
        "tool_calls": {
            "open_pattern": r"<\|tool_call>call:(?P<name>[^{\s<]+)", "close_pattern": r"<tool_call\|>\s*",
            "repeats": True, "content": "json",
            "content_args": {"string_delims": [['<|"|>', '<|"|>']], "unquoted_keys": True}, "transform": _NAMED_CALL,
        },
        # a "<|turn>model" header is framing, not answer text: DiffusionGemma's template starts one
        # after the tool results, where Gemma 4's goes on in the same turn
        "content": {"close_pattern": r"(?:<turn\|>|<\|tool_response>|<eos>|<\|turn>model\n)\s*", "content": "text"},
    },
}
LFM2_CALL_LIST = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "thinking": _thinking(),
        # one block holds the turn's calls: the parser reads the list, the transform shapes each call
        "tool_calls": {
            "open": "<|tool_call_start|>", "close_pattern": r"<\|tool_call_end\|>\s*", "content": "python-call-list",
            "transform_each": True,
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{arguments}"}},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}
DEEPSEEK_R1_DISTILL = {
    "defaults": {"role": "assistant"},
    # the prompt ends in "<｜Assistant｜><think>\n", which opens the reasoning before the model writes
    "start_anchor": "<｜Assistant｜>",
    "fields": {
        "reasoning_content": _thinking(),
        "content": {"close_pattern": r"<｜end▁of▁sentence｜>\s*", "content": "text"},
    },
}

FORMATS: tuple[tuple[str, tuple[str, ...], tuple[str, ...], dict], ...] = (
    # name, markers the chat template must hold, markers it must not hold, response template
    ("ChatML with XML tool calls", ("<|im_start|>", "<tool_call>", "<function=", "<parameter="), (), CHATML_XML),
    ("ChatML with JSON tool calls", ("<|im_start|>", "<tool_call>", "</tool_call>"), ("<function=",), CHATML_JSON),
    ("Llama 3 JSON tool calls", ("<|start_header_id|>", "<|eot_id|>", '"parameters"'), (), LLAMA3_JSON),
    ("GLM-4 XML tool calls", ("<|assistant|>", "<tool_call>", "<arg_key>", "<arg_value>"), (), GLM4_XML),
    ("GPT-OSS harmony tool calls",
     ("<|start|>assistant", "<|channel|>analysis", "<|channel|>commentary", "<|call|>"), (), GPT_OSS),
    ("Gemma 4 tool calls", ("<|turn>model", "<|tool_call>call:", "<tool_call|>", '<|"|>'), (), GEMMA4),
    ("LFM2.5 Python-style tool calls", ("<|im_start|>", "<|tool_call_start|>", "<|tool_call_end|>"), (),
     LFM2_CALL_LIST),
    # DeepSeek-V3's template prefills the same "<think>" and writes calls besides (it tests
    # "'tool_calls' in message"): a format left unrecognised
    ("DeepSeek-R1-Distill reasoning (no tool calls)", ("<｜Assistant｜><think>", "</think>", "<｜end▁of▁sentence｜>"),
     ("'tool_calls' in message",), DEEPSEEK_R1_DISTILL),
)
"""The recognised formats, most specific first (one whose content parsers the installed transformers
lacks is passed over)."""


def known_response_template(chat_template: str | None) -> tuple[str, dict] | None:
    """(format name, response template) for the format ``chat_template`` renders, or None when it
    matches none of :data:`FORMATS`."""
    if not isinstance(chat_template, str):
        return None
    for name, needed, excluded, template in FORMATS:
        if all(marker in chat_template for marker in needed) and not any(m in chat_template for m in excluded):
            return (name, template) if _parsers_installed(template) else None
    return None
