"""A tool-calling format for the shipped model's tokenizer, so that ``tools=`` and
``environment_factory=`` can be tried on the embedded task without a model that ships one.

The shipped chat template (ChatML) renders no tools. :data:`TOOL_CHAT_TEMPLATE` lists the tools in a
system turn and writes a call as ``[name {"arg": value}]``; :data:`TOOL_RESPONSE_TEMPLATE` is the
transformers response-parsing schema that reads such calls back. The shipped model was never taught
to call tools: it trains and steps in this format, and the tests teach it to call ``add``.
"""

from __future__ import annotations

TOOL_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools:{% for tool in tools %} {{ tool['function']['name'] }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message.get('tool_calls') %}{% for call in message['tool_calls'] %}"
    "[{{ call['function']['name'] }} {{ call['function']['arguments'] | tojson }}]{% endfor %}"
    "{% else %}{{ message['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{{ assistant_prefix | default('') }}{% endif %}"
)
"""ChatML with a system turn naming the tools and calls written as ``[name {json arguments}]``."""

TOOL_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open_pattern": r"\s*\[(?P<name>\w+) ", "close": "]", "repeats": True, "content": "json",
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
        "content": {"close_pattern": r"\s*<\|im_end\|>", "content": "text"},
    },
}
"""The response template (transformers' response parsing) that reads :data:`TOOL_CHAT_TEMPLATE`'s calls."""


def tool_calling_tokenizer(path=None):
    """The tokenizer at ``path`` (default: the shipped model's) with :data:`TOOL_CHAT_TEMPLATE` and
    :data:`TOOL_RESPONSE_TEMPLATE` set; pass it as ``processing_class``."""
    from transformers import AutoTokenizer

    from grpo_lab.tasks import TINY_MODEL_DIR

    tokenizer = AutoTokenizer.from_pretrained(path or TINY_MODEL_DIR)
    tokenizer.chat_template, tokenizer.response_template = TOOL_CHAT_TEMPLATE, TOOL_RESPONSE_TEMPLATE
    return tokenizer
