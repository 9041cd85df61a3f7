"""Turn dataset prompts (TRL's standard or conversational format) into text, and completions back.

A *standard* prompt is a string; a *conversational* prompt is a list of ``{"role", "content"}``
messages rendered with the tokenizer's chat template (``add_generation_prompt=True``). Completions
are returned in the same format as their prompt: a string, or ``[{"role": "assistant", ...}]``.
"""

from __future__ import annotations

from typing import Any


def is_conversational(prompt: Any) -> bool:
    """True for a list of chat messages (dicts with ``role`` and ``content``)."""
    return (
        isinstance(prompt, list)
        and len(prompt) > 0
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)
    )


def render_prompts(prompts: list, tokenizer, chat_template_kwargs: dict | None = None, tools: list | None = None) -> list[str]:
    """Prompt texts ready for tokenization; conversational prompts go through the chat template
    (with ``tools``, the functions the model may call, where given).

    A prompt equal to the one before it (the copies of a group) reuses that rendering.
    """
    texts = []
    for position, prompt in enumerate(prompts):
        if position > 0 and prompt == prompts[position - 1]:
            texts.append(texts[-1])
        elif is_conversational(prompt):
            if getattr(tokenizer, "chat_template", None) is None:
                raise ValueError(
                    "The dataset has conversational prompts but the tokenizer has no chat_template. "
                    "Set tokenizer.chat_template, or give plain-text prompts."
                )
            texts.append(
                tokenizer.apply_chat_template(
                    prompt, tokenize=False, add_generation_prompt=True, **({"tools": tools} if tools else {}),
                    **(chat_template_kwargs or {}),
                )
            )
        elif isinstance(prompt, str):
            texts.append(prompt)
        else:
            raise TypeError(
                f"A prompt must be a string or a list of chat messages, got {type(prompt).__name__}: "
                f"{str(prompt)[:80]!r}"
            )
    return texts


def wrap_completions(prompts: list, completion_texts: list[str]) -> list:
    """Completions in the format of their prompts (conversational -> one assistant message)."""
    return [
        [{"role": "assistant", "content": text}] if is_conversational(prompt) else text
        for prompt, text in zip(prompts, completion_texts, strict=True)
    ]
