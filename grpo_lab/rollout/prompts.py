"""Turn dataset prompts (TRL's standard or conversational format) into text, and completions back.

A *standard* prompt is a string; a *conversational* prompt is a list of ``{"role", "content"}``
messages rendered with the tokenizer's chat template (``add_generation_prompt=True``). Completions
are returned in the same format as their prompt: a string, or ``[{"role": "assistant", ...}]``.

A message's content may also be a list of text parts (``[{"type": "text", "text": ...}]``, the
OpenAI format): a chat template written for it renders it itself; for one that prints the content
as it is (``{{ message['content'] }}`` would print the list's Python repr), the parts' texts are
joined with newlines first, as vLLM does for such templates. Other parts (images, audio) are
refused: the policy is a text model.
"""

from __future__ import annotations

import json
import weakref
from typing import Any

from grpo_lab.chat import is_conversational


def prompt_problem(prompt: Any, *, image_parts: bool = False) -> str | None:
    """Why ``prompt`` cannot be rendered and trained on, as the end of a sentence that starts with
    "the prompt", or None when it can: a missing or empty prompt, a user message without content,
    a content part that is not text (``image_parts``: nor an image's placeholder, ``{"type": "image"}``,
    which a vision-language model's processor fills with the row's images), a value of another type."""
    if prompt is None:
        return "is None (a missing value)"
    if isinstance(prompt, str):
        return "is an empty string" if not prompt else None
    if not isinstance(prompt, list):
        return f"has type {type(prompt).__name__}, not a string or a list of chat messages: {str(prompt)[:80]!r}"
    if not prompt:
        return "is an empty list of messages"
    if not is_conversational(prompt):
        return f"is a list but not of chat messages (dicts with 'role' and 'content'): {str(prompt)[:80]!r}"
    for position, message in enumerate(prompt):
        content, role = message["content"], message["role"]
        if content is None or content == "" or content == []:
            if role == "user":  # an assistant message may hold only tool calls
                return f"has a user message (message {position}) with no content ({content!r})"
        elif isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if image_parts and kind == "image":
                    continue
                if kind != "text" or not isinstance(part.get("text"), str):
                    return (
                        f"has a content part of type {kind!r} in message {position} ({role}): only text parts "
                        "({'type': 'text', 'text': ...}) can be given to a text model. Drop the other parts, or "
                        "describe them in text (images go to a vision-language model in an 'image' or 'images' "
                        "column, with its processor as processing_class)"
                    )
        elif not isinstance(content, str):
            return (
                f"has message {position} ({role}) whose content has type {type(content).__name__} "
                f"({str(content)[:40]!r}), not a string or a list of text parts"
            )
    return None


def _template_renders_text_parts(tokenizer, chat_template_kwargs: dict | None, tools: list | None) -> bool:
    """Whether the chat template renders a message whose content is a list of text parts exactly as
    it renders the same text given as a string (templates written for multimodal models do)."""
    def render(content):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True,
            **({"tools": tools} if tools else {}), **(chat_template_kwargs or {}),
        )

    probe = "grpo_lab text part"
    try:
        return render([{"type": "text", "text": probe}]) == render(probe)
    except Exception:  # a template that refuses a list outright: give it strings
        return False


def _joined_text_parts(messages: list[dict]) -> list[dict]:
    """``messages`` with each content given as text parts replaced by their texts, joined with newlines."""
    return [
        {**message, "content": "\n".join(part["text"] for part in message["content"])}
        if isinstance(message["content"], list) else message
        for message in messages
    ]


def render_prompts(prompts: list, tokenizer, chat_template_kwargs: dict | None = None,
                   tools: list | None = None) -> list[str]:
    """Prompt texts ready for tokenization; conversational prompts go through the chat template
    (with ``tools``, the functions the model may call, where given).

    A prompt equal to the one before it (the copies of a group) reuses that rendering. A prompt
    :func:`prompt_problem` refuses raises a ValueError naming its position in ``prompts``.
    """
    texts = []
    renders_parts = None  # asked of the template once, at the first content given as parts
    for position, prompt in enumerate(prompts):
        if position > 0 and prompt == prompts[position - 1]:
            texts.append(texts[-1])
            continue
        problem = prompt_problem(prompt)
        if problem is not None:
            wrong_type = not isinstance(prompt, (str, list)) or bool(prompt) and not is_conversational(prompt)
            raise (TypeError if prompt is not None and wrong_type else ValueError)(
                f"Prompt {position} {problem}. Give non-empty strings or lists of chat messages with text content."
            )
        if isinstance(prompt, str):
            texts.append(prompt)
            continue
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                "The dataset has conversational prompts but the tokenizer has no chat_template. "
                "Set tokenizer.chat_template, or give plain-text prompts."
            )
        if any(isinstance(message["content"], list) for message in prompt):
            if renders_parts is None:
                renders_parts = _template_renders_text_parts(tokenizer, chat_template_kwargs, tools)
            if not renders_parts:
                prompt = _joined_text_parts(prompt)
        texts.append(
            tokenizer.apply_chat_template(
                prompt, tokenize=False, add_generation_prompt=True, **({"tools": tools} if tools else {}),
                **(chat_template_kwargs or {}),
            )
        )
    return texts


def prompt_token_counts(prompts: list, tokenizer, chat_template_kwargs: dict | None = None, *,
                        rows: list[int] | None = None, dataset: str = "train_dataset") -> list[int]:
    """The number of tokens of each prompt as generation sees it (rendered, no special tokens added).

    ``rows`` are the prompts' row indices in ``dataset`` (its name; default: their positions), which
    the error for an unusable prompt (see :func:`prompt_problem`) or one the chat template fails on
    names, with the fix.
    """
    rows = list(range(len(prompts))) if rows is None else rows
    bad = [(row, problem) for row, prompt in zip(rows, prompts, strict=True) if (problem := prompt_problem(prompt))]
    if bad:
        row, problem = bad[0]
        raise ValueError(
            f"{dataset} row {row}: the prompt {problem}.{_more_rows([row for row, _ in bad])} "
            + drop_rows_fix(dataset, [row for row, _ in bad], "prompt_problem(row['prompt']) is None",
                            "from grpo_lab.rollout.prompts import prompt_problem")
        )
    try:
        texts = render_prompts(prompts, tokenizer, chat_template_kwargs)
    except Exception:
        for row, prompt in zip(rows, prompts, strict=True):  # find the row the chat template fails on
            try:
                render_prompts([prompt], tokenizer, chat_template_kwargs)
            except Exception as error:
                raise ValueError(
                    f"{dataset} row {row}: the chat template cannot render the prompt ({type(error).__name__}: "
                    f"{error}). {drop_rows_fix(dataset, [row])}"
                ) from error
        raise
    encoded = tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    return [len(ids) for ids in encoded]


PROMPT_CHECK_ROWS = 50_000
"""Datasets up to this many rows have every prompt rendered and counted when the session is built
(about a second per 15,000 chat prompts); larger ones are checked a generation batch at a time."""


_counted: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Each dataset's prompt token counts, by what decides them (see :func:`counting_key`): a session built
again on the same dataset object (a fork, a notebook cell run twice) does not render every prompt again.
A ``datasets.Dataset`` object's rows never change (its transforms make new objects; the counts read
its raw rows, ``with_format(None)``), so only the tokenizer side needs a key."""


def counting_key(tokenizer, chat_template_kwargs: dict | None):
    """What decides a prompt's token count besides the prompt: the tokenizer's rules and vocabulary,
    its special tokens and chat template, and the template's arguments; None for a tokenizer
    without a serialisable backend (a slow tokenizer), whose counts are not kept."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        options = json.dumps(chat_template_kwargs or {}, sort_keys=True)
    except TypeError:  # a template argument that is not JSON (an object): count afresh
        return None
    template = json.dumps(tokenizer.chat_template, sort_keys=True)
    special = json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str)
    return type(tokenizer).__name__, hash(backend.to_str()), template, special, options


def dataset_prompt_tokens(dataset, tokenizer, chat_template_kwargs: dict | None = None,
                          name: str = "train_dataset") -> list[int]:
    """:func:`prompt_token_counts` of every prompt of ``dataset`` (a ``datasets.Dataset`` called ``name``),
    kept for the next session built on the same dataset object with the same tokenizer (``_counted``)."""
    import datasets

    key = counting_key(tokenizer, chat_template_kwargs) if isinstance(dataset, datasets.Dataset) else None
    kept = None if key is None else _counted.setdefault(dataset, {})
    if kept is not None and key in kept:
        return list(kept[key])
    counts = prompt_token_counts(list(dataset.with_format(None)["prompt"]), tokenizer, chat_template_kwargs,
                                 dataset=name)
    if kept is not None:
        kept[key] = counts
    return list(counts)


def check_prompt_room(tokens: list[int], rows, *, context: int | None, max_new_tokens: int | None,
                      chat_template_kwargs: dict | None = None, dataset: str = "train_dataset") -> None:
    """Refuse prompts (``tokens`` long, rows ``rows`` of ``dataset``) that leave no room in the model's
    ``context`` (its positions; None: unknown, nothing refused).

    Generated by the backend, a prompt plus ``max_new_tokens`` must fit. When ``max_new_tokens`` alone
    does not (the setting is at fault, not the rows: generation says so) or is None (a rollout
    function, whose completions may be cut to fit), a prompt must leave room for one token.
    """
    if context is None:
        return
    fits = max_new_tokens is not None and max_new_tokens < context
    room = context - max_new_tokens if fits else context - 1
    bad = [(row, count) for row, count in zip(rows, tokens, strict=True) if count > room]
    if not bad:
        return
    row, count = bad[0]
    longest = max(count for _, count in bad)
    if count >= context:
        problem = f"is {count} tokens long (rendered), longer than the model's context of {context} positions"
    else:
        problem = (f"is {count} tokens long (rendered), and with max_completion_length={max_new_tokens} it exceeds the "
                   f"model's context of {context} positions")
    template_kwargs = f", {chat_template_kwargs!r}" if chat_template_kwargs else ""
    condition = f"prompt_token_counts([row['prompt']], tokenizer{template_kwargs})[0] <= {room}"
    lower = (f" Or lower max_completion_length to {context - longest} or less." if fits and longest < context else "")
    raise ValueError(
        f"{dataset} row {row}: the prompt {problem}.{_more_rows([row for row, _ in bad])} "
        + drop_rows_fix(dataset, [row for row, _ in bad], condition,
                        "from grpo_lab.rollout.prompts import prompt_token_counts")
        + lower
    )


def _more_rows(rows: list[int]) -> str:
    if len(rows) == 1:
        return ""
    shown = ", ".join(str(row) for row in rows[1:6])
    return (f" {len(rows) - 1} more row{'s' if len(rows) > 2 else ''} cannot be used either "
            f"({shown}{', ...' if len(rows) > 6 else ''}).")


def drop_rows_fix(dataset: str, rows: list[int], condition: str | None = None, imports: str | None = None) -> str:
    """The fix for the unusable ``rows`` of ``dataset`` (its name): repair them, or drop them by index
    (a few rows) or by a ``condition`` on ``row`` that keeps the usable ones (needing ``imports``)."""
    if len(rows) <= 12 or condition is None:
        keep = f"lambda row, index: index not in {{{', '.join(map(str, rows))}}}, with_indices=True"
    else:
        keep = f"lambda row: {condition}"
    before = f"{imports}; " if imports and not keep.endswith("with_indices=True") else ""
    return (
        f"Repair the row{'s' if len(rows) > 1 else ''}, or drop {'them' if len(rows) > 1 else 'it'} before building "
        f"the session: {before}{dataset} = {dataset}.filter({keep})."
    )


def wrap_completions(prompts: list, completion_texts: list[str]) -> list:
    """Completions in the format of their prompts (conversational -> one assistant message)."""
    return [
        [{"role": "assistant", "content": text}] if is_conversational(prompt) else text
        for prompt, text in zip(prompts, completion_texts, strict=True)
    ]
