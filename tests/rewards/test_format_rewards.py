"""think_format_reward and tag_count_reward, on hand-written completions."""

import pickle

import pytest

from grpo_lab.rewards import tag_count_reward, think_format_reward


def as_messages(texts):
    return [[{"role": "assistant", "content": text}] for text in texts]


THINK_CASES = [
    ("<think>\nFirst, 2 + 2.\nThat is 4.\n</think>\nThe answer is 4.", 1.0),  # a block over several lines
    ("<think>short</think>", 1.0),
    ("The answer is 4.", 0.0),  # no tags
    ("<think>\nreasoning that never ends", 0.0),
    (" <think>a</think> b", 0.0),  # must open the completion
    ("<think>a</think>\n<think>b</think>", 0.0),  # a second <think>
    ("Intro <think>a</think>", 0.0),
]


@pytest.mark.parametrize("text, expected", THINK_CASES)
def test_think_format_reward_on_plain_and_conversational_completions(text, expected):
    assert think_format_reward([text]) == [expected]
    assert think_format_reward(as_messages([text])) == [expected]


def test_tag_count_reward_gives_a_quarter_per_marker_seen_once():
    reward = tag_count_reward()
    texts = [
        "<think>\nline 1\nline 2\n</think>\n<answer>\n4\n</answer>",  # all four markers once: 4/4
        "<think>\nonly reasoning\n</think>",  # <think>, </think>: 2/4
        "<think><think>twice</think><answer>4",  # </think>, <answer>: 2/4 (<think> twice earns nothing)
        "<answer>4</answer>",  # 2/4
        "nothing",  # 0/4
    ]
    assert reward(texts) == [1.0, 0.5, 0.5, 0.5, 0.0]
    assert reward(as_messages(texts)) == [1.0, 0.5, 0.5, 0.5, 0.0]


def test_tag_count_reward_with_other_tags():
    reward = tag_count_reward(tags=("reasoning", "answer", "check"))
    # <reasoning>, </reasoning>, <answer>: 3 of 6 markers
    assert reward(["<reasoning>\nx\n</reasoning><answer>5"]) == [0.5]
    assert tag_count_reward(tags="answer")(["<answer>5</answer>"]) == [1.0]
    with pytest.raises(ValueError, match="tags"):
        tag_count_reward(tags=())


def test_tag_count_reward_pickles():
    reward = pickle.loads(pickle.dumps(tag_count_reward()))
    assert reward.__name__ == "tag_count_reward"
    assert reward(["<think>a</think>"]) == [0.5]


def test_tag_count_reward_called_on_completions_says_to_build_it_first():
    with pytest.raises(ValueError, match=r"builds a reward function.*reward_funcs=\[tag_count_reward\(\)\]"):
        tag_count_reward(["<think>a</think>"])
