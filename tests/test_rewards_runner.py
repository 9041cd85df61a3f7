"""The reward runner: each function gets its own copy of the inputs, calls of async functions (and,
with reward_timeout_sync, of plain ones, in a worker thread) are bounded by reward_timeout, and a
failing call is retried once on the whole batch before scoring fails."""

import asyncio
import contextvars
import copy
import sqlite3
import threading
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
    assert "left running" not in message  # a late coroutine is cancelled
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


def test_a_plain_reward_that_hangs_fails_within_reward_timeout_naming_itself_and_the_sample():
    release = threading.Event()
    threads = []

    def stuck_judge(completions, **kwargs):
        threads.append(threading.current_thread())
        release.wait()  # a request without a timeout of its own
        return [1.0] * len(completions)

    started = time.monotonic()
    try:
        with pytest.raises(RewardFunctionError) as raised:
            _score([stuck_judge], _batch(), reward_timeout=0.3, timeout_sync=True)
        assert time.monotonic() - started < 5  # the batch, then sample 0 alone: about 0.6 s
    finally:
        release.set()  # the abandoned calls return, and their threads end
    message = str(raised.value)
    for fragment in ("'stuck_judge' did not finish within reward_timeout=0.3 s scoring samples 0-7",
                     "Called again one sample at a time (the first call still running), it did not finish within "
                     "0.3 s on sample 0: prompt=", "'0+1='", "left running in the background",
                     "daemon threads named 'reward stuck_judge'", "holding none of grpo_lab's locks",
                     "restart the process", "raise reward_timeout", "call session.score()"):
        assert fragment in message, (fragment, message)
    assert len(threads) == 2 and all(t.daemon and t is not threading.current_thread() for t in threads)
    for thread in threads:
        thread.join(5)
        assert not thread.is_alive()


def test_a_plain_reward_that_hangs_on_one_sample_gets_that_sample_named():
    release = threading.Event()

    def picky(completions, answer, **kwargs):
        if "4" in answer:  # sample 3's answer
            release.wait()
        return [1.0] * len(completions)

    try:
        with pytest.raises(RewardFunctionError) as raised:
            _score([picky], _batch(), reward_timeout=0.3, timeout_sync=True)
    finally:
        release.set()
    message = str(raised.value)
    assert "it did not finish within 0.3 s on sample 3: prompt=" in message and "'3+1='" in message, message
    assert "(samples 0-2 finished)" in message


def test_the_one_sample_search_after_a_timeout_stops_once_it_has_taken_reward_timeout():
    def slow_per_sample(completions, **kwargs):  # 0.8 s for the batch, 0.1 s for one sample
        time.sleep(0.1 * len(completions))
        return [1.0] * len(completions)

    started = time.monotonic()
    with pytest.raises(RewardFunctionError, match=r"Called again one sample at a time \(the first call still "
                                                  r"running\), samples 0-\d each finished on their own, and the "
                                                  r"search stopped after 0.3 s"):
        _score([slow_per_sample], _batch(), reward_timeout=0.3, timeout_sync=True)
    assert time.monotonic() - started < 3


REQUEST_ID = contextvars.ContextVar("REQUEST_ID", default=None)


def test_a_slow_plain_reward_that_finishes_in_time_keeps_its_values_logs_context_and_grad_mode():
    seen = {}

    def slow_but_in_time(completions, log_metric, log_extra, **kwargs):
        time.sleep(0.05)
        seen.update(thread=threading.current_thread(), name=threading.current_thread().name,
                    request_id=REQUEST_ID.get(), grad=torch.is_grad_enabled())
        log_metric("slow/calls", 1.0)
        log_extra("slow_note", [f"n{i}" for i in range(len(completions))])
        return [0.5 + i for i in range(len(completions))]

    token = REQUEST_ID.set("step-7")
    try:
        with torch.no_grad():
            rewards_BF, logs = _score([slow_but_in_time], _batch(), reward_timeout=2.0, timeout_sync=True)
    finally:
        REQUEST_ID.reset(token)
    assert rewards_BF[:, 0].tolist() == [0.5 + i for i in range(B)]
    assert logs.metrics == {"slow/calls": [1.0]} and logs.extras == {"slow_note": [f"n{i}" for i in range(B)]}
    assert seen["thread"] is not threading.current_thread() and seen["thread"].daemon
    assert seen["name"] == "reward slow_but_in_time"
    assert seen["request_id"] == "step-7" and seen["grad"] is False  # the caller's context and grad mode


def test_a_system_exit_raised_by_a_plain_reward_reaches_the_caller():
    def quits(completions, **kwargs):
        raise SystemExit(3)

    with pytest.raises(SystemExit):
        _score([quits], _batch(), reward_timeout=2.0, timeout_sync=True)


def test_what_an_abandoned_call_logs_later_reaches_no_later_scoring():
    release, written = threading.Event(), threading.Event()
    scoring = {"number": 1}

    def judge(completions, log_metric, log_extra, **kwargs):
        if scoring["number"] == 1:
            if len(completions) > 1:  # the whole batch hangs until the next scoring releases it, then logs
                release.wait()
                log_metric("judge/late", 1.0)
                log_extra("judge_note", ["late"] * len(completions))
                written.set()
            return [0.0] * len(completions)
        release.set()
        assert written.wait(5)  # the abandoned call has logged by now, during this scoring
        log_metric("judge/on_time", 1.0)
        log_extra("judge_note", ["on time"] * len(completions))
        return [1.0] * len(completions)

    try:
        with pytest.raises(RewardFunctionError, match="each of the 8 samples finished on its own"):
            _score([judge], _batch(), reward_timeout=0.3, timeout_sync=True)
        scoring["number"] = 2
        rewards_BF, logs = _score([judge], _batch(), reward_timeout=2.0, timeout_sync=True)
    finally:
        release.set()
    assert rewards_BF.eq(1.0).all()
    assert logs.metrics == {"judge/on_time": [1.0]} and logs.extras == {"judge_note": ["on time"] * B}


def test_without_reward_timeout_plain_functions_run_in_the_calling_thread():
    caller, seen = threading.current_thread(), []

    def here(completions, **kwargs):
        seen.append(threading.current_thread())
        if caller is threading.main_thread():
            assert threading.current_thread() is threading.main_thread()
        return [1.0] * len(completions)

    rewards_BF, _ = _score([here], _batch(), reward_timeout=None, timeout_sync=True)
    assert rewards_BF.eq(1.0).all() and seen == [caller]


def test_by_default_a_plain_function_runs_in_the_calling_thread_even_under_reward_timeout():
    caller, seen = threading.current_thread(), []
    connection = sqlite3.connect(":memory:")  # bound to this thread, as sqlite3 makes it by default

    def here(completions, **kwargs):
        seen.append(threading.current_thread())
        time.sleep(0.3)  # past the limit: plain functions are not bounded without timeout_sync
        (one,) = connection.execute("select 1").fetchone()
        return [float(one)] * len(completions)

    try:
        rewards_BF, _ = _score([here], _batch(), reward_timeout=0.1)
    finally:
        connection.close()
    assert rewards_BF.eq(1.0).all() and seen == [caller]


def test_a_session_with_reward_timeout_sync_fails_score_on_a_hanging_reward_and_keeps_the_batch(make_session, task):
    release, hang_on = threading.Event(), {}

    def hangs_on_one(completions, **kwargs):
        if hang_on.get("completion") in completions:
            release.wait(60)  # a bound of its own: should the limit not apply, the test fails rather than hangs
        return [1.0] * len(completions)

    session = make_session(reward_funcs=[hangs_on_one], reward_timeout=0.5, reward_timeout_sync=True)
    rollout = session.generate()
    hang_on["completion"] = rollout.completions[-1]
    first = rollout.completions.index(hang_on["completion"])  # the search names the first sample that hangs
    try:
        with pytest.raises(RewardFunctionError) as raised:
            session.score()
    finally:
        release.set()
    message = str(raised.value)
    for fragment in ("'hangs_on_one' did not finish within reward_timeout=0.5 s",
                     f"it did not finish within 0.5 s on sample {first}: prompt=", "left running in the background",
                     "set session.reward_funcs again and call session.score()"):
        assert fragment in message, (fragment, message)
    assert session.rollout is rollout and session.next_stage == "score"  # the completions are kept
    session.reward_funcs = task.reward_funcs
    session.score()
    session.step()
    assert session.global_step >= 1
