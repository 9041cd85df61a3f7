"""Format rewards: does the completion lay out its reasoning and answer in the expected tags?

Both read plain and conversational completions (``extraction.completion_text``: the last
assistant message of a conversational one) and look across newlines: a reasoning block almost
always spans several lines, and a pattern whose ``.`` stops at a newline would score every such
completion 0."""

from __future__ import annotations

import re

from collections.abc import Sequence

from grpo_lab.rewards.extraction import completion_text

__all__ = ["tag_count_reward", "think_format_reward"]

_OPEN, _CLOSE = "<think>", "</think>"


def _think_formatted(text: str) -> bool:
    if not text.startswith(_OPEN):
        return False
    rest = text[len(_OPEN):]
    return _OPEN not in rest and _CLOSE in rest


def think_format_reward(completions: list, **kwargs) -> list[float]:
    """1.0 when the completion opens with its reasoning in ``<think>...</think>``, else 0.0.

    Formula: r = 1 if the text starts with ``<think>``, a ``</think>`` follows, and ``<think>``
    occurs nowhere after the first one (anything, newlines included, may sit between the tags and
    after ``</think>``); otherwise r = 0.

    The text is ``extraction.completion_text``: a plain string, or the content of the last assistant
    message of a conversational completion.

    Source: TRL 1.16 ``trl.rewards.think_format_reward``: the same values for a completion of one
    message. TRL reads the first message (``completion[0]["content"]``), so they differ for a
    completion of several messages whose last assistant message is not the first (after a tool
    call, this function checks the final reply, TRL the tool call's text). Unlike TRL's, it also
    takes plain-text completions.
    """
    return [1.0 if _think_formatted(completion_text(c)) else 0.0 for c in completions]


class TagCountReward:
    """Partial credit for each tag of ``tags`` whose opening and closing markers each occur exactly
    once in the completion (see ``tag_count_reward``). A class rather than a closure, so that it
    pickles (a spawned worker process can receive it)."""

    __name__ = "tag_count_reward"

    def __init__(self, tags: Sequence[str]):
        tags = (tags,) if isinstance(tags, str) else tuple(tags)
        if not tags or not all(isinstance(t, str) and t for t in tags):
            raise ValueError(f"tags must be a non-empty sequence of non-empty tag names, got {tags!r}")
        if not all(re.fullmatch(r"[\w.-]+", t) for t in tags):
            raise ValueError(
                f"tag_count_reward(tags) builds a reward function from tag names such as 'think', got {tags!r}: "
                "to score completions, build it first, e.g. reward_funcs=[tag_count_reward()] or "
                "tag_count_reward()(completions)."
            )
        self.tags = tags

    def __call__(self, completions: list, **kwargs) -> list[float]:
        markers = [m for tag in self.tags for m in (f"<{tag}>", f"</{tag}>")]
        rewards = []
        for completion in completions:
            text = completion_text(completion)
            rewards.append(sum(text.count(m) == 1 for m in markers) / len(markers))
        return rewards


def tag_count_reward(tags: Sequence[str] = ("think", "answer")) -> TagCountReward:
    """A reward function giving partial credit for each tag marker that occurs exactly once.

    Formula, for k tags: r = (1 / 2k) * sum over the tags t of ([count("<t>") == 1] +
    [count("</t>") == 1]), in [0, 1]. With the default tags each of ``<think>``, ``</think>``,
    ``<answer>`` and ``</answer>`` is worth 0.25; a marker that is missing or repeated earns nothing.
    Only counts matter, not order or position, so it is a dense shaping signal for learning the
    format, to combine with a stricter format or correctness reward.

    Source: the ``tag_count_reward`` of Hugging Face's open-r1 (0.25 per marker), without its
    requirement of newlines around the markers.
    """
    return TagCountReward(tags)
