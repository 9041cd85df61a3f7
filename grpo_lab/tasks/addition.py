"""The embedded task: two-digit addition with a checkable answer.

Why addition: the answer is verifiable exactly (a reward function needs no model), problems can be
generated without limit from a seed, and a model a few hundred thousand parameters large can learn
the column algorithm in a couple of minutes on a laptop CPU.

Why GRPO has something to improve: the shipped model is warmed up by supervised learning on a
*noisy teacher* that writes the correct sum only part of the time and otherwise makes the classic
slip of dropping every carry (``27 + 15 -> 32``, ``75 + 48 -> 13``). The model learns both
behaviours, so its greedy answer is usually the slip on problems that carry, while sampling finds
the correct sum often: greedy accuracy is low and pass@k is high. Reinforcement learning with a
correctness reward then shifts probability from the slip to the correct sum, which raises greedy
accuracy quickly. This mirrors the usual finding that RL mostly sharpens what a model can already
sample.

Completions have the form ``<answer>42</answer>``; the format reward checks that shape.
"""

from __future__ import annotations

import random
import re

from datasets import Dataset

OPERAND_RANGE = (10, 99)
"""Both operands are drawn uniformly from this inclusive range."""

_ANSWER_RE = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")
_STRICT_FORMAT_RE = re.compile(r"\s*<answer>\d+</answer>\s*")


def no_carry_sum(a: int, b: int) -> int:
    """The sum written column by column with every carry dropped (the teacher's slip).

    >>> no_carry_sum(27, 15), no_carry_sum(75, 48), no_carry_sum(21, 34)
    (32, 13, 55)
    """
    digits, place = 0, 1
    while a or b:
        digits += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return digits


def standard_prompt(a: int, b: int) -> str:
    """Plain-text prompt (TRL's "standard" format).

    Prompts are kept terse on purpose: every prompt token costs compute in each GRPO step, and the
    model learns the answer format from its warm-up rather than from an instruction.
    """
    return f"{a}+{b}="


def conversational_prompt(a: int, b: int) -> list[dict[str, str]]:
    """Chat-message prompt (TRL's "conversational" format)."""
    return [{"role": "user", "content": standard_prompt(a, b)}]


def all_problems() -> list[tuple[int, int]]:
    low, high = OPERAND_RANGE
    return [(a, b) for a in range(low, high + 1) for b in range(low, high + 1)]


def split_problems(seed: int = 0, eval_size: int = 500) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Shuffle every (a, b) pair with ``seed`` and cut off a held-out set that training never sees.

    ``a + b`` and ``b + a`` are treated as the same problem so that no held-out question is a mere
    reordering of a training one.
    """
    canonical = sorted({(min(a, b), max(a, b)) for a, b in all_problems()})
    random.Random(seed).shuffle(canonical)
    held_out = set(canonical[:eval_size])
    train, evaluation = [], []
    for a, b in all_problems():
        (evaluation if (min(a, b), max(a, b)) in held_out else train).append((a, b))
    random.Random(seed + 1).shuffle(train)
    random.Random(seed + 2).shuffle(evaluation)
    return train, evaluation


def make_dataset(problems: list[tuple[int, int]], *, conversational: bool = True) -> Dataset:
    """A dataset with a ``prompt`` column (either TRL format) and an ``answer`` column (a string)."""
    make_prompt = conversational_prompt if conversational else standard_prompt
    return Dataset.from_dict(
        {
            "prompt": [make_prompt(a, b) for a, b in problems],
            "answer": [str(a + b) for a, b in problems],
        }
    )


def completion_text(completion) -> str:
    """The text of a completion in either format: a string, or a list of chat messages."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content") or "")
    return ""


def extract_answer(text: str) -> int | None:
    """The integer inside the last ``<answer>...</answer>``, or None.

    >>> extract_answer("<answer>42</answer>"), extract_answer("<answer>4</answer><answer>5</answer>")
    (42, 5)
    >>> extract_answer("42") is None, extract_answer("<answer>x</answer>") is None
    (True, True)
    """
    matches = _ANSWER_RE.findall(text)
    if not matches:
        return None
    try:
        return int(matches[-1])
    except ValueError:
        return None


def correctness_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the number in ``<answer>...</answer>`` equals the reference answer, else 0.0.

    Works for plain-text and conversational completions; anything unparsable scores 0.0.

    >>> correctness_reward(["<answer>42</answer>", "<answer>41</answer>", "garbage"], ["42"] * 3)
    [1.0, 0.0, 0.0]
    >>> correctness_reward([[{"role": "assistant", "content": "<answer>7</answer>"}]], ["7"])
    [1.0]
    """
    rewards = []
    for completion, reference in zip(completions, answer, strict=True):
        predicted = extract_answer(completion_text(completion))
        rewards.append(1.0 if predicted is not None and str(predicted) == str(reference).strip() else 0.0)
    return rewards


def format_reward(completions, **kwargs) -> list[float]:
    """1.0 when the completion is exactly ``<answer>digits</answer>`` (surrounding spaces allowed).

    >>> format_reward(["<answer>42</answer>", "The answer is <answer>42</answer>", ""])
    [1.0, 0.0, 0.0]
    """
    return [1.0 if _STRICT_FORMAT_RE.fullmatch(completion_text(c)) else 0.0 for c in completions]
