"""The embedded task: data splits, prompt formats and reward functions on any text a model may emit."""

import doctest

import pytest

from grpo_lab.tasks import addition


def test_doctests_pass():
    assert doctest.testmod(addition).failed == 0


def test_splits_are_deterministic_disjoint_and_complete():
    train, held_out = addition.split_problems(seed=0)
    assert (train, held_out) == addition.split_problems(seed=0)
    assert addition.split_problems(seed=1)[1] != held_out
    canonical = lambda pairs: {(min(a, b), max(a, b)) for a, b in pairs}  # noqa: E731
    assert not canonical(train) & canonical(held_out)  # not even a + b vs b + a
    assert len(train) + len(held_out) == 90 * 90


def test_datasets_in_both_trl_formats():
    standard = addition.make_dataset([(27, 15)], conversational=False)
    chat = addition.make_dataset([(27, 15)], conversational=True)
    assert standard[0] == {"prompt": "27+15=", "answer": "42"}
    assert chat[0]["prompt"] == [{"role": "user", "content": "27+15="}]
    assert chat[0]["answer"] == "42"


@pytest.mark.parametrize(
    "a, b, expected",
    [(27, 15, 32), (75, 48, 13), (21, 34, 55), (99, 99, 88), (10, 90, 0)],
)
def test_no_carry_sum(a, b, expected):
    # 99 + 99: 9+9=18 -> 8 in both columns; 10 + 90: 1+9=10 -> 0, 0+0=0
    assert addition.no_carry_sum(a, b) == expected


GARBAGE = [
    "",
    "<answer></answer>",
    "<answer>4 2</answer>",
    "<answer>forty-two</answer>",
    "answer>42</answer>",
    "<answer>42",
    "\x00\uffff<answer>\n",
    "<answer>" + "9" * 5000 + "</answer>",
    "x" * 100_000,
]


@pytest.mark.parametrize("conversational", [False, True])
def test_rewards_on_correct_wrong_malformed_empty_and_long(conversational):
    texts = ["<answer>42</answer>", " <answer>42</answer> ", "<answer>41</answer>",
             "so <answer>42</answer>", *GARBAGE]
    completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
    answers = ["42"] * len(texts)
    correct = addition.correctness_reward(prompts=[""] * len(texts), completions=completions, answer=answers)
    fmt = addition.format_reward(prompts=[""] * len(texts), completions=completions, answer=answers)
    assert correct == [1.0, 1.0, 0.0, 1.0] + [0.0] * len(GARBAGE)
    # strict format: only the bare tag with digits; the huge all-digit answer is well formed but wrong
    assert fmt == [1.0, 1.0, 1.0, 0.0] + [0.0] * 7 + [1.0, 0.0]


def test_rewards_ignore_unexpected_completion_objects():
    assert addition.correctness_reward(completions=[None, 42, [{"x": 1}], []], answer=["42"] * 4) == [0.0] * 4
