"""Making the calls of reward functions for :mod:`grpo_lab.rewards.runner`, each ending in an ``Outcome``.

A call gets its own copies of the inputs (:func:`fresh`). Plain functions and reward models run in the
calling thread; the awaitables that calls return (``async def`` functions) are then awaited together,
each within the timeout (:func:`call_all`), and a late one is cancelled. With ``threaded=True`` (the
``reward_timeout_sync`` setting) a plain function's call runs in a daemon worker thread named after it
while the caller waits at most the timeout; Python cannot stop a thread, so a late call is left running
there, holding none of grpo_lab's locks. :func:`find_failing_sample` calls a function again one sample at
a time to find the input that makes it raise or hang.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import queue
import threading
import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from grpo_lab.chat import is_conversational
from grpo_lab.coroutines import run_coroutines


@torch.no_grad()
def score_with_model(model, tokenizer, prompts, completions) -> list[float]:
    """A sequence-classification reward model's scores of prompt + completion texts."""
    texts = []
    for prompt, completion in zip(prompts, completions, strict=True):
        if is_conversational(prompt):
            texts.append(tokenizer.apply_chat_template(prompt + completion, tokenize=False))
        else:
            texts.append(prompt + completion)
    encoded = tokenizer(texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    encoded = {k: v.to(model.device) for k, v in encoded.items()}
    return model(**encoded).logits[:, 0].float().tolist()


def fresh(value):
    """A copy of the lists, dicts and tuples in ``value`` (chat messages are lists of dicts), so that a
    reward function that edits its inputs in place changes nobody else's; strings, numbers and other
    objects (images) are shared."""
    if type(value) is list:
        return [fresh(v) for v in value]
    if type(value) is dict:
        return {k: fresh(v) for k, v in value.items()}
    if type(value) is tuple:
        return tuple(fresh(v) for v in value)
    return value


@dataclass
class Outcome:
    """How a call ended: its value, its exception, or a timeout (``left_running``: its thread still runs)."""

    value: object = None
    error: Exception | None = None
    timed_out: bool = False
    left_running: bool = False


async def _settle(awaitable, timeout: float | None) -> Outcome:
    async def guarded() -> Outcome:  # the function's own exceptions, TimeoutError included, are its errors
        try:
            return Outcome(value=await awaitable)
        except Exception as error:
            return Outcome(error=error)

    try:
        return await asyncio.wait_for(guarded(), timeout)
    except asyncio.TimeoutError:  # a class of its own before Python 3.11
        return Outcome(timed_out=True)


def _here(run) -> Outcome:
    try:
        return Outcome(value=run())
    except Exception as error:
        return Outcome(error=error)


class _Worker(threading.Thread):
    """A daemon thread making reward calls one at a time, reused while they finish in time (cheaper than
    a thread per call); one whose call is late ends once that call returns, if ever."""

    idle: list[_Worker] = []

    def __init__(self):
        super().__init__(daemon=True)
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.start()

    def run(self) -> None:
        while (job := self.jobs.get()) is not None:
            job()

    @classmethod
    def call(cls, make, name: str, timeout: float) -> Outcome:
        """``make()`` in a worker thread named ``name``, with a copy of the caller's context variables and
        grad mode, waited for at most ``timeout`` seconds, then left running (Python cannot stop a thread).
        KeyboardInterrupt and SystemExit it raises are raised here, as in the calling thread."""
        worker = None
        while cls.idle and worker is None:
            worker = cls.idle.pop()
            worker = worker if worker.is_alive() else None  # a forked child has none of the threads
        worker, ended, finished = worker or cls(), {}, threading.Lock()
        finished.acquire()
        context, grad = contextvars.copy_context(), torch.is_grad_enabled()

        def job() -> None:
            try:
                with torch.set_grad_enabled(grad):
                    ended["outcome"] = _here(lambda: context.run(make))
            except BaseException as error:
                ended["fatal"] = error
            finally:
                finished.release()

        worker.name = name
        worker.jobs.put(job)
        in_time = False
        try:
            in_time = finished.acquire(timeout=min(timeout, threading.TIMEOUT_MAX))
        finally:  # also on a KeyboardInterrupt while waiting
            if in_time:
                worker.name = "reward worker (idle)"
                cls.idle.append(worker)
            else:
                worker.jobs.put(None)  # the thread ends once the call returns
        if in_time and "fatal" in ended:
            raise ended["fatal"]
        return ended["outcome"] if in_time else Outcome(timed_out=True, left_running=True)


def make_call(func, tokenizer, kwargs: dict, extras: dict, *, name: str, timeout: float | None, threaded: bool):
    """A call of ``func`` on its own copies of ``kwargs`` (new ones each time), returning an ``Outcome``: in
    a worker thread for a plain function when ``threaded`` and under a ``timeout``, else in the calling
    thread (reward models always)."""
    if isinstance(func, PreTrainedModel):  # GPU work
        prompts, completions = kwargs["prompts"], kwargs["completions"]
        return lambda: _here(lambda: score_with_model(func, tokenizer, fresh(prompts), fresh(completions)))
    run = lambda: func(**fresh(kwargs), **extras)  # noqa: E731
    if not threaded or timeout is None:
        return lambda: _here(run)
    if any(inspect.iscoroutinefunction(f) for f in (func, getattr(func, "__call__", None))):
        return lambda: _here(run)
    return lambda: _Worker.call(run, f"reward {name}", timeout)


def call_all(calls: dict, timeout: float | None) -> dict[int, Outcome]:
    """Make ``calls`` (index -> a ``make_call``) in turn, then await what they returned concurrently, each
    within ``timeout``."""
    outcomes: dict[int, Outcome] = {}
    pending: dict[int, object] = {}
    for index, call in calls.items():
        outcome = call()
        if outcome.error is None and not outcome.timed_out and inspect.isawaitable(outcome.value):
            pending[index] = outcome.value
        else:
            outcomes[index] = outcome
    if pending:
        settled = run_coroutines([_settle(awaitable, timeout) for awaitable in pending.values()])
        outcomes.update(zip(pending, settled, strict=True))
    return dict(sorted(outcomes.items()))


def find_failing_sample(call_on, kwargs: dict, timeout: float | None,
                        budget: float | None = None) -> tuple[int, Outcome | None]:
    """Call ``call_on(kwargs of one sample)`` (a ``make_call``) one sample at a time, each within
    ``timeout``, up to the first sample that raises or hangs on its own: ``(its index, its outcome)``, else
    ``(samples tried, None)``; with a ``budget`` no try starts once the tries have taken that many seconds."""
    started = time.monotonic()
    for index in range(len(kwargs["completions"])):
        if budget is not None and time.monotonic() - started >= budget:
            return index, None
        single = {k: (v[index:index + 1] if isinstance(v, list) else v) for k, v in kwargs.items()}
        (outcome,) = call_all({0: call_on(single)}, timeout).values()
        if outcome.error is not None or outcome.timed_out:
            return index, outcome
    return len(kwargs["completions"]), None
