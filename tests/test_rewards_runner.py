"""The reward runner: each function gets its own copy of the inputs, async calls are bounded by
reward_timeout, and a failing call is retried once on the whole batch before scoring fails."""

import asyncio
import copy
import time

import pytest
import torch

from grpo_lab.rewards import RewardFunctionError, score_completions

B = 8


def _batch():
    """B conversational samples: prompts and completions are lists of message dicts."""
    prompts = [[{"role": "user", "content": f"{i}+1="}] for i in range(B)]
    completions = [[{"role": "assistant", "content": str(i + 1)}] for i in range(B)]
    return dict(prompts=prompts, completions=completions, completion_ids=[[i, 1] for i in range(B)],
                columns={"answer": [str(i + 1) for i in range(B)], "meta": [{"tags": ["x"]} for _ in range(B)]})


def _score(funcs, batch, **options):
    names = [f.__name__ for f in funcs]
    return score_completions(funcs, [None] * len(funcs), names, **batch, **options)


def test_a_function_that_edits_its_inputs_changes_nothing_the_others_see():
    batch = _batch()
    before = copy.deepcopy(batch)
    seen = {}

    def vandal(prompts, completions, completion_ids, answer, meta, **kwargs):
        completions[0][0]["content"] = "edited"
        prompts[1].append({"role": "user", "content": "injected"})
        completion_ids[2].append(99)
        meta[3]["tags"].append("y")
        answer.clear()
        completions.clear()
        return [0.0] * B

    def witness(prompts, completions, completion_ids, answer, meta, **kwargs):
        seen.update(prompts=prompts, completions=completions, completion_ids=completion_ids, answer=answer, meta=meta)
        return [1.0] * B

    rewards_BF, _ = _score([vandal, witness], batch)
    assert rewards_BF[:, 1].eq(1.0).all()
    assert batch == before  # the caller's lists (the rollout's) are untouched
    assert seen == {key: before[key] for key in ("prompts", "completions", "completion_ids")} | before["columns"]


def test_a_mutating_reward_function_leaves_the_rollout_and_the_logs_unchanged(make_session, task):
    def vandal(prompts, completions, **kwargs):
        for messages in completions:
            messages[0]["content"] = "edited"
        prompts.reverse()
        completions.clear()
        return [0.0] * len(prompts)

    seen = []

    def witness(completions, **kwargs):
        seen.append(copy.deepcopy(completions))
        return [0.0] * len(completions)

    session = make_session(reward_funcs=[vandal, *task.reward_funcs, witness])
    rollout = session.generate()
    prompts, completions = copy.deepcopy(rollout.prompts), copy.deepcopy(rollout.completions)
    table = rollout.to_dict()  # what the logs and views show of the rollout
    assert completions and isinstance(completions[0], list)  # chat messages: lists of dicts
    scores = session.score()
    assert rollout.prompts == prompts and rollout.completions == completions
    assert seen == [completions]  # what a later function received
    assert rollout.to_dict() == table and "edited" not in str(scores.to_dict())
    for column, func in enumerate(task.reward_funcs, start=1):  # the task's own functions scored the real completions
        expected = func(prompts=prompts, completions=completions, **copy.deepcopy(rollout.columns))
        expected = torch.tensor([float("nan") if r is None else r for r in expected], dtype=torch.float32)
        torch.testing.assert_close(scores.rewards_BF[:, column], expected, equal_nan=True)
    session.advantages()
    session.step()


def test_an_async_reward_that_outlasts_reward_timeout_fails_naming_the_function_and_the_fix():
    async def slow_judge(completions, **kwargs):
        await asyncio.sleep(30)
        return [1.0] * len(completions)

    async def quick(completions, **kwargs):
        return [1.0] * len(completions)

    started = time.monotonic()
    with pytest.raises(RewardFunctionError) as raised:
        _score([quick, slow_judge], _batch(), reward_timeout=0.2)
    assert time.monotonic() - started < 10
    message = str(raised.value)
    for fragment in ("'slow_judge' did not finish within reward_timeout=0.2 s", "samples 0-7", "sample 0: prompt=",
                     "'0+1='", "Fix the function", "raise reward_timeout"):
        assert fragment in message, (fragment, message)
    rewards_BF, _ = _score([quick], _batch(), reward_timeout=0.2)  # a fast one passes under the same limit
    assert rewards_BF.eq(1.0).all()


def test_a_transient_failure_is_retried_as_one_whole_call_and_its_result_kept():
    sizes = []

    def flaky(completions, log_metric, **kwargs):
        sizes.append(len(completions))
        log_metric("flaky/calls", 1.0)
        if len(sizes) == 1:
            raise ConnectionError("connection reset")
        return [float(i) for i in range(len(completions))]

    with pytest.warns(UserWarning, match=r"'flaky' raised ConnectionError: connection reset, "
                                         r"and succeeded when called again"):
        rewards_BF, logs = _score([flaky], _batch())
    assert sizes == [B, B]  # the whole batch again, not one completion at a time
    assert rewards_BF[:, 0].tolist() == [float(i) for i in range(B)]
    assert logs.metrics == {"flaky/calls": [1.0]}  # the failed call's logs are dropped


def test_an_async_transient_failure_is_retried_too():
    sizes = []

    async def flaky(completions, **kwargs):
        sizes.append(len(completions))
        if len(sizes) == 1:
            raise TimeoutError("the judge's own request timed out")
        return [1.0] * len(completions)

    with pytest.warns(UserWarning, match="'flaky' raised TimeoutError"):
        rewards_BF, _ = _score([flaky], _batch())
    assert sizes == [B, B] and rewards_BF.eq(1.0).all()


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_function_that_fails_twice_names_itself_and_the_sample_that_fails(asynchronous):
    sizes = []

    def fragile(completions, answer, **kwargs):
        sizes.append(len(completions))
        return [1.0 / (a != "4") for a in answer]  # sample 3's answer is "4"

    async def fragile_async(completions, answer, **kwargs):
        return fragile(completions, answer)

    with pytest.raises(RewardFunctionError) as raised:
        _score([fragile_async if asynchronous else fragile], _batch())
    name = "fragile_async" if asynchronous else "fragile"
    message = str(raised.value)
    assert f"'{name}' raised ZeroDivisionError" in message and "raised twice on the whole batch" in message
    assert "Offending input: sample 3: prompt=" in message and "call session.score()" in message
    assert sizes == [B, B, 1, 1, 1, 1]  # two whole calls, then one sample at a time up to the failing one
