"""The library's TRL-named reward functions give TRL 1.16's values (and log TRL's columns) on the
same one-message completions and token-id lists, and differ where their docstrings say: a completion
of several messages (TRL reads the first, these the last assistant message) and token ids given as
tensors (TRL's repetition penalty then finds no repeats)."""

import random

import pytest

import grpo_lab.rewards as ours

import trl.rewards as trl_rewards

TEXTS = [
    r"The answer is \boxed{\frac{1}{2}}.",
    r"Dividing gives \boxed{0.5}",
    r"So \boxed{\frac{1}{3}}",
    "I have no idea.",
    r"Final answer: $\frac{1}{2}$",
    r"\boxed{2}",
    r"The answer is \boxed{3 \text{ cm}}",
    r"<think>\nI think it is \boxed{7}\n</think>\nSo \boxed{\frac{1}{2}}",
    "<think>\nstep 1\nstep 2\n</think>\nThe answer is 4.",
    "<think>unfinished \\boxed{\\frac{1}{2}}",
    "<think>a</think><think>b</think> \\boxed{2}",
    r" <think>x</think> \boxed{2}",
    r"\boxed{x^2 + 2x + 1}",
    r"\boxed{(x+1)^2}",
    "",
]
SOLUTIONS = [r"\frac{1}{2}"] * 5 + ["2", "3", r"\frac{1}{2}", "4", r"\frac{1}{2}", "2", "not parseable",
                                   r"$(x+1)^2$", r"$x^2+2x+1$", "5"]
COMPLETIONS = [[{"role": "assistant", "content": text}] for text in TEXTS]


def logged(func, *args, **kwargs):
    extras = {}
    values = func(*args, log_extra=lambda name, column: extras.update({name: column}), **kwargs)
    return values, extras


def test_accuracy_reward_matches_trl():
    assert logged(ours.accuracy_reward, COMPLETIONS, SOLUTIONS) == logged(trl_rewards.accuracy_reward, COMPLETIONS,
                                                                          SOLUTIONS)
    assert ours.accuracy_reward(TEXTS, SOLUTIONS) == trl_rewards.accuracy_reward(COMPLETIONS, SOLUTIONS)


@pytest.mark.parametrize("delimiters", [None, ["</think>"], ["</answer>", "</think>"]])
def test_reasoning_accuracy_reward_matches_trl(delimiters):
    mine = logged(ours.reasoning_accuracy_reward, COMPLETIONS, SOLUTIONS, reasoning_delimiters=delimiters)
    theirs = logged(trl_rewards.reasoning_accuracy_reward, COMPLETIONS, SOLUTIONS, reasoning_delimiters=delimiters)
    assert mine == theirs


@pytest.mark.parametrize("options", [{}, dict(min_value_wrong=-2.0, max_value_wrong=0.0, min_value_correct=0.25,
                                              max_value_correct=3.0)])
def test_cosine_scaled_reward_matches_trl(options):
    completion_ids = [[1] * length for length in (0, 1, 10, 25, 49, 50, 51, 75, 99, 100, 101, 150, 3, 60, 80)]
    mine = ours.get_cosine_scaled_reward(100, **options)
    theirs = trl_rewards.get_cosine_scaled_reward(100, **options)
    assert mine.__name__ == theirs.__name__
    kwargs = dict(completions=COMPLETIONS, solution=SOLUTIONS, completion_ids=completion_ids)
    assert mine(**kwargs) == theirs(**kwargs)


def test_think_format_reward_matches_trl():
    texts = TEXTS + ["<think>\n\n</think>", "<think></think>", "</think>", "<think>\na\n</think>\n<think>",
                     "<THINK>a</THINK>", "<think>a\n</think>\nb\n\nc"]
    completions = [[{"role": "assistant", "content": text}] for text in texts]
    assert ours.think_format_reward(completions) == trl_rewards.think_format_reward(completions)
    assert ours.think_format_reward(texts) == trl_rewards.think_format_reward(completions)


@pytest.mark.parametrize("max_len, cache", [(100, 20), (50, 0), (10, 10), (64, 1)])
def test_soft_overlong_punishment_matches_trl(max_len, cache):
    completion_ids = [[3] * length for length in range(0, 2 * max_len + 2)]
    mine = ours.get_soft_overlong_punishment(max_len, cache)
    theirs = trl_rewards.get_soft_overlong_punishment(max_len, cache)
    assert mine.__name__ == theirs.__name__
    assert mine(completion_ids=completion_ids) == theirs(completion_ids=completion_ids)


@pytest.mark.parametrize("ngram_size, max_penalty", [(3, -1.0), (1, -1.0), (2, -0.5), (4, -2.0), (3, 0.0)])
def test_repetition_penalty_matches_trl(ngram_size, max_penalty):
    generator = random.Random(ngram_size)
    completion_ids = [[generator.randrange(vocabulary) for _ in range(length)]
                      for vocabulary in (2, 5, 50) for length in (0, 1, 2, 3, 4, 7, 20, 100)]
    mine = ours.get_repetition_penalty_reward(ngram_size, max_penalty)
    theirs = trl_rewards.get_repetition_penalty_reward(ngram_size, max_penalty)
    assert mine.__name__ == theirs.__name__
    assert mine(completion_ids=completion_ids) == theirs(completion_ids=completion_ids)


# A completion of several messages: a tool call, its result and the final reply (TRL's tool-calling
# completions), and two replies in a row. TRL reads completion[0]["content"]; grpo_lab the last
# assistant message, which holds the answer.
TOOL_CALL = [{"role": "assistant", "content": "I need the calculator.",
              "tool_calls": [{"type": "function", "function": {"name": "divide", "arguments": {"a": 1, "b": 2}}}]},
             {"role": "tool", "name": "divide", "content": "0.5"},
             {"role": "assistant", "content": r"<think>The tool says 0.5.</think> The answer is \boxed{\frac{1}{2}}"}]
TWO_REPLIES = [{"role": "assistant", "content": "Let me check."},
               {"role": "assistant", "content": r"<think>Checked.</think> So \boxed{\frac{1}{2}}"}]


@pytest.mark.parametrize("completion", [TWO_REPLIES, TOOL_CALL])
def test_math_rewards_read_the_last_reply_where_trl_reads_the_first_message(completion):
    solution = [r"\frac{1}{2}"]
    for name in ("accuracy_reward", "reasoning_accuracy_reward"):
        mine, theirs = getattr(ours, name), getattr(trl_rewards, name)
        assert mine([completion], solution) == [1.0]  # the final reply's answer
        assert theirs([completion], solution) == [0.0]  # the first message: no answer, no </think>
        assert mine([completion], solution) == theirs([completion[-1:]], solution)
        assert mine([completion[:1]], solution) == theirs([completion], solution)


@pytest.mark.parametrize("completion", [TWO_REPLIES, TOOL_CALL])
def test_think_format_reward_reads_the_last_reply_where_trl_reads_the_first_message(completion):
    assert ours.think_format_reward([completion]) == [1.0]
    assert trl_rewards.think_format_reward([completion]) == [0.0]
    assert ours.think_format_reward([completion[:1]]) == trl_rewards.think_format_reward([completion])


def test_repetition_penalty_counts_tensor_token_ids_where_trl_finds_no_repeats():
    import numpy
    import torch
    rows = [[5, 5, 5, 5, 5], [1, 2, 3, 1, 2], [1, 2, 3, 4, 5]]
    mine, theirs = ours.get_repetition_penalty_reward(2), trl_rewards.get_repetition_penalty_reward(2)
    assert mine(completion_ids=rows) == theirs(completion_ids=rows) == [-0.75, -0.25, 0.0]
    arrays = [numpy.array(row) for row in rows]
    assert mine(completion_ids=arrays) == theirs(completion_ids=arrays) == [-0.75, -0.25, 0.0]
    for tensors in ([torch.tensor(row) for row in rows], torch.tensor(rows)):
        assert mine(completion_ids=tensors) == [-0.75, -0.25, 0.0]
        assert theirs(completion_ids=tensors) == [0.0, 0.0, 0.0]  # n-grams of 0-d tensors never compare equal
