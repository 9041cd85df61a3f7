"""accuracy_reward, reasoning_accuracy_reward and the cosine scaled reward (math-verify), and the
math extra's absence."""

import math
import sys
import threading

import pytest

from grpo_lab.rewards import (
    accuracy_reward,
    get_cosine_scaled_reward,
    reasoning_accuracy_reward,
    score_completions,
)

HALF = r"\frac{1}{2}"


def as_messages(texts):
    return [[{"role": "assistant", "content": text}] for text in texts]


def test_equivalent_forms_of_an_answer_agree():
    texts = [
        r"The answer is \boxed{\frac{1}{2}}.",
        r"Dividing, I get \boxed{0.5}",  # 0.5 == 1/2
        r"So \boxed{\frac{1}{3}}",  # wrong
        "I have no idea.",  # no answer to parse: 0
    ]
    assert accuracy_reward(texts, [HALF] * 4) == [1.0, 1.0, 0.0, 0.0]
    assert accuracy_reward(as_messages(texts), [HALF] * 4) == [1.0, 1.0, 0.0, 0.0]


def test_an_unparseable_solution_skips_the_sample_and_is_counted():
    metrics, extras = {}, {}
    rewards = accuracy_reward([r"\boxed{2}", r"\boxed{2}", "no answer"], ["2", "not a number at all", "2"],
                              log_extra=lambda name, values: extras.update({name: values}),
                              log_metric=lambda name, value: metrics.update({name: value}))
    assert rewards == [1.0, None, 0.0]
    # one solution and one answer could not be parsed
    assert metrics == {"math_verify/parse_failures": 2, "math_verify/unparseable_solutions": 1}
    assert extras["gold_parsed"][1] == "[unparseable]" and extras["answer_parsed"][2] == "[unparseable]"
    assert extras["solution"] == ["2", "not a number at all", "2"]


def test_reasoning_accuracy_reward_reads_the_answer_after_the_think_block():
    texts = [
        "<think>\nMaybe \\boxed{3}?\nNo: 1 / 2.\n</think>\nThe answer is \\boxed{\\frac{1}{2}}",
        "<think>\nIt is \\boxed{\\frac{1}{2}}\n</think>\nThe answer is \\boxed{3}",  # the final answer is wrong
        "<think>\nIt is \\boxed{\\frac{1}{2}} but I keep thinking",  # unfinished: 0, not None
    ]
    assert reasoning_accuracy_reward(texts, [HALF] * 3) == [1.0, 0.0, 0.0]
    assert reasoning_accuracy_reward(as_messages(texts), [HALF] * 3) == [1.0, 0.0, 0.0]
    # unfinished reasoning gives 0 even where the solution cannot be parsed; finished gives None
    assert reasoning_accuracy_reward(["<think>x", "<think>x</think> \\boxed{1}"], ["?", "?"]) == [0.0, None]
    assert reasoning_accuracy_reward(["Reasoning.</reasoning> \\boxed{1}"], ["1"],
                                     reasoning_delimiters=["</reasoning>"]) == [1.0]


def test_works_outside_the_main_thread():
    outcome = {}

    def score():
        try:
            outcome["rewards"] = accuracy_reward([r"\boxed{\frac{1}{2}}", r"\boxed{0.25}"], [HALF, HALF])
        except BaseException as error:
            outcome["error"] = error

    thread = threading.Thread(target=score)
    thread.start()
    thread.join()
    assert outcome == {"rewards": [1.0, 0.0]}


def test_cosine_scaled_reward_at_the_ends_and_the_middle():
    reward = get_cosine_scaled_reward(max_len=100)
    correct, wrong = r"\boxed{\frac{1}{2}}", r"\boxed{7}"
    lengths = [0, 100, 50, 200]
    completions = [correct] * 4 + [wrong] * 4
    completion_ids = [[1] * n for n in lengths] * 2
    rewards = reward(completions=completions, solution=[HALF] * 8, completion_ids=completion_ids)
    # correct: 0.5 + 0.25 * (1 + cos(pi * L / 100)): 1.0 at 0, 0.5 at 100, 0.75 at 50, 0.5 past the end;
    # wrong: -0.5 - 0.25 * (1 + cos(...)): -1.0 at 0, -0.5 at 100, -0.75 at 50, -0.5 past the end
    assert rewards == pytest.approx([1.0, 0.5, 0.75, 0.5, -1.0, -0.5, -0.75, -0.5])
    custom = get_cosine_scaled_reward(max_len=10, min_value_correct=0.0, max_value_correct=2.0)
    # 0 + 1 * (1 + cos(pi / 2)) = 1 at half the length
    assert custom(completions=[correct], solution=[HALF], completion_ids=[[1] * 5]) == pytest.approx([1.0])
    assert reward(completions=[correct], solution=["no"], completion_ids=[[1]]) == [None]


def test_log_metric_through_the_reward_runner():
    completions = as_messages([r"\boxed{\frac{1}{2}}", "no answer", r"\boxed{2}"])
    rewards_BF, logs = score_completions(
        [accuracy_reward], [None], ["accuracy_reward"],
        prompts=as_messages(["q1", "q2", "q3"]), completions=completions, completion_ids=[[1], [2], [3]],
        columns={"solution": [HALF, HALF, "unparseable gold"]},
    )
    assert rewards_BF[:2, 0].tolist() == [1.0, 0.0] and math.isnan(rewards_BF[2, 0])
    assert logs.metrics == {"math_verify/parse_failures": [2.0], "math_verify/unparseable_solutions": [1.0]}
    assert logs.extras["answer_parsed"][1] == "[unparseable]"


def test_a_missing_extra_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # `import math_verify` now raises ImportError
    for call in (lambda: accuracy_reward(["1"], ["1"]), lambda: reasoning_accuracy_reward(["</think>1"], ["1"]),
                 lambda: get_cosine_scaled_reward(10)(completions=["1"], solution=["1"], completion_ids=[[1]])):
        with pytest.raises(ImportError, match=r"pip install 'grpo_lab\[math\]'"):
            call()
