"""GSM8K rows -> GRPO rows, for ``examples/gsm8k/recipe.yaml`` (``map: gsm8k_data:to_grpo_row``).

A GSM8K row has a ``question`` and an ``answer``: worked reasoning with calculator annotations
(``<<3*12=36>>``) and the final number after ``####``. A GRPO row has a conversational ``prompt``
(a system message asking for reasoning in ``<think>`` tags and the answer in ``\\boxed{}``, then the
question) and the ``solution`` that ``grpo_lab.rewards.accuracy_reward`` compares the answer with
(the final number alone; the worked reasoning is not shown to the model).

>>> row = to_grpo_row({"question": "What is 2 + 3?", "answer": "2 + 3 = <<2+3=5>>5\\n#### 5"})
>>> row["solution"], [m["role"] for m in row["prompt"]]
('5', ['system', 'user'])
>>> final_answer("It sells 1250 * 4 = 5000 bottles.\\n#### 5,000")
'5000'
"""

from __future__ import annotations

SYSTEM_PROMPT = (
    "Solve the math problem. First think it through step by step inside <think> and </think>, "
    "then give the final answer as a number in \\boxed{}, for example: "
    "<think>reasoning</think> The answer is \\boxed{42}."
)
"""What the model is asked to write: the shape ``think_format_reward`` and ``accuracy_reward`` score."""


def final_answer(answer: str) -> str:
    """The number after GSM8K's ``####`` marker, without thousands separators (``5,000`` -> ``5000``)."""
    marker = answer.rfind("####")
    if marker < 0:
        raise ValueError(f"A GSM8K answer ends with '#### <number>'; this one has no '####': {answer[-80:]!r}")
    return answer[marker + 4:].strip().replace(",", "")


def to_grpo_row(row: dict) -> dict:
    """``{"prompt": [system, user], "solution": final number}`` from a GSM8K row."""
    return {
        "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": row["question"]}],
        "solution": final_answer(row["answer"]),
    }
