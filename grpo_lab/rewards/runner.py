"""Run reward functions over a batch of completions, with TRL's calling convention.

Every function receives keyword arguments ``prompts``, ``completions``, ``completion_ids``, every
extra dataset column (one value per completion), ``trainer_state``, and two callbacks:
``log_extra(name, values)`` adds a per-completion column to the logs, ``log_metric(name, value)``
adds a scalar to the step's metrics. A function returns one number per completion, or None where
it does not apply (stored as NaN and excluded from that function's statistics). ``async def``
functions are awaited concurrently. A ``PreTrainedModel`` entry is a sequence-classification reward
model scored on prompt + completion text with its own tokenizer.

Departures from TRL:

1) NaN or infinite rewards, wrong lengths and non-numbers raise at once with the offending function
   and sample named, instead of surfacing later as a NaN loss.
2) Each call gets its own copies of the prompts, completions and columns (lists and dicts), so a
   function that edits them in place changes neither the other functions' inputs nor the rollout.
3) A call that raises is made once more on the whole batch; a second failure raises, naming the
   function and the first sample that fails on its own.
4) Each call of an ``async def`` function must finish within ``reward_timeout`` seconds.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
from dataclasses import dataclass, field
from numbers import Real

import torch
from transformers import PreTrainedModel

from grpo_lab import notices
from grpo_lab.config import REWARD_TIMEOUT
from grpo_lab.rollout.prompts import is_conversational


class RewardFunctionError(RuntimeError):
    """A reward function failed or returned something unusable; the completions are kept."""


@dataclass
class RewardLogs:
    """What reward functions logged during one scoring call."""

    extras: dict[str, list] = field(default_factory=dict)
    metrics: dict[str, list[float]] = field(default_factory=dict)


@torch.no_grad()
def _score_with_model(model, tokenizer, prompts, completions) -> list[float]:
    texts = []
    for prompt, completion in zip(prompts, completions, strict=True):
        if is_conversational(prompt):
            texts.append(tokenizer.apply_chat_template(prompt + completion, tokenize=False))
        else:
            texts.append(prompt + completion)
    encoded = tokenizer(texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    encoded = {k: v.to(model.device) for k, v in encoded.items()}
    return model(**encoded).logits[:, 0].float().tolist()


def run_coroutines(coroutines):
    """Await coroutines concurrently, also from inside a running event loop (Jupyter)."""

    async def gather():
        return await asyncio.gather(*coroutines)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gather())
    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.update(value=asyncio.run(gather())))
    thread.start()
    thread.join()
    return outcome["value"]


def _sample_preview(kwargs: dict, index: int) -> str:
    prompt = kwargs["prompts"][index]
    completion = kwargs["completions"][index]
    return f"sample {index}: prompt={str(prompt)[:200]!r}, completion={str(completion)[:200]!r}"


def _fresh(value):
    """A copy of the lists, dicts and tuples in ``value`` (chat messages are lists of dicts), so that a
    reward function that edits its inputs in place changes nobody else's; strings, numbers and other
    objects (images) are shared."""
    if type(value) is list:
        return [_fresh(v) for v in value]
    if type(value) is dict:
        return {k: _fresh(v) for k, v in value.items()}
    if type(value) is tuple:
        return tuple(_fresh(v) for v in value)
    return value


@dataclass
class _Outcome:
    """How one call of a reward function ended: its value, the exception it raised, or a timeout."""

    value: object = None
    error: Exception | None = None
    timed_out: bool = False


async def _settle(awaitable, timeout: float | None) -> _Outcome:
    async def guarded() -> _Outcome:  # the function's own exceptions, TimeoutError included, are its errors
        try:
            return _Outcome(value=await awaitable)
        except Exception as error:
            return _Outcome(error=error)

    try:
        return await asyncio.wait_for(guarded(), timeout)
    except asyncio.TimeoutError:  # a class of its own before Python 3.11
        return _Outcome(timed_out=True)


def _call_all(calls: dict, timeout: float | None) -> dict[int, _Outcome]:
    """Run ``calls`` (index -> a function of no arguments): plain ones in turn, then the awaitables they
    return concurrently, each within ``timeout`` seconds."""
    outcomes: dict[int, _Outcome] = {}
    pending: dict[int, object] = {}
    for index, call in calls.items():
        try:
            value = call()
        except Exception as error:
            outcomes[index] = _Outcome(error=error)
            continue
        if inspect.isawaitable(value):
            pending[index] = value
        else:
            outcomes[index] = _Outcome(value=value)
    if pending:
        settled = run_coroutines([_settle(awaitable, timeout) for awaitable in pending.values()])
        outcomes.update(zip(pending, settled, strict=True))
    return dict(sorted(outcomes.items()))


def _caller(func, tokenizer, kwargs: dict, extras: dict):
    """A call of ``func`` on its own copies of ``kwargs`` (each call gets new ones)."""
    if isinstance(func, PreTrainedModel):
        return lambda: _score_with_model(func, tokenizer, _fresh(kwargs["prompts"]), _fresh(kwargs["completions"]))
    return lambda: func(**_fresh(kwargs), **extras)


def _find_failing_sample(func, tokenizer, kwargs: dict, extras: dict, timeout: float | None) -> str:
    """Re-run ``func`` one sample at a time to show which input makes it raise (or hang)."""
    for index in range(len(kwargs["completions"])):
        single = {k: (v[index:index + 1] if isinstance(v, list) else v) for k, v in kwargs.items()}
        (outcome,) = _call_all({0: _caller(func, tokenizer, single, extras)}, timeout).values()
        if outcome.error is not None or outcome.timed_out:
            return _sample_preview(kwargs, index)
    return "no single sample reproduces the error on its own"


_KEPT = ("in a session a training batch's completions are kept: set session.reward_funcs again and call "
         "session.score().")


def _timeout_error(name: str, kwargs: dict, timeout: float) -> RewardFunctionError:
    last = len(kwargs["completions"]) - 1
    return RewardFunctionError(
        f"Reward function {name!r} did not finish within reward_timeout={timeout:g} s scoring samples 0-{last} "
        f"(first: {_sample_preview(kwargs, 0)}). Fix the function (e.g. a request without a timeout of its own, "
        f"or blocking code inside async def), or raise reward_timeout (None waits without limit); {_KEPT}"
    )


def _validate(name: str, values, kwargs: dict) -> list[float]:
    expected = len(kwargs["completions"])
    if not isinstance(values, (list, tuple)) and not (isinstance(values, torch.Tensor) and values.dim() == 1):
        raise RewardFunctionError(
            f"Reward function {name!r} returned {type(values).__name__}; it must return a list with one "
            f"number (or None) per completion ({expected} here)."
        )
    values = values.tolist() if isinstance(values, torch.Tensor) else list(values)
    if len(values) != expected:
        raise RewardFunctionError(
            f"Reward function {name!r} returned {len(values)} values for {expected} completions; it must "
            "return exactly one number (or None) per completion, in order."
        )
    checked = []
    for index, value in enumerate(values):
        if value is None:
            checked.append(math.nan)
            continue
        if isinstance(value, bool) or not isinstance(value, Real):
            raise RewardFunctionError(
                f"Reward function {name!r} returned {value!r} ({type(value).__name__}) for "
                f"{_sample_preview(kwargs, index)}. Return a float, or None where the reward does not apply."
            )
        if not math.isfinite(value):
            raise RewardFunctionError(
                f"Reward function {name!r} returned {value} for {_sample_preview(kwargs, index)}. Rewards "
                "must be finite; return None to skip a sample."
            )
        checked.append(float(value))
    return checked


class _Scoring:
    """One call of ``score_completions``: the functions, the inputs they share, and what each logged
    (``logs_F``, one ``RewardLogs`` per function)."""

    def __init__(self, funcs, processing_classes, names, kwargs: dict, trainer_state, timeout: float | None):
        self.funcs, self.processing_classes, self.names = funcs, processing_classes, names
        self.kwargs, self.trainer_state, self.timeout = kwargs, trainer_state, timeout
        self.logs_F = [RewardLogs() for _ in funcs]

    def extras(self, logs: RewardLogs) -> dict:
        """The keyword arguments a call receives besides the inputs: ``trainer_state`` and the two
        callbacks, which log into ``logs``."""

        def log_extra(column: str, values: list) -> None:
            logs.extras[column] = list(values)

        def log_metric(metric: str, value: float) -> None:
            logs.metrics.setdefault(metric, []).append(float(value))

        return dict(trainer_state=self.trainer_state, log_extra=log_extra, log_metric=log_metric)

    def attempt(self, indices) -> dict[int, _Outcome]:
        """Call the functions at ``indices``, each on its own copies of the inputs."""
        for index in indices:
            self.logs_F[index] = RewardLogs()  # a failed call's logs are dropped with it
        calls = {
            i: _caller(self.funcs[i], self.processing_classes[i], self.kwargs, self.extras(self.logs_F[i]))
            for i in indices
        }
        return _call_all(calls, self.timeout)

    def retry(self, failed: dict[int, Exception]) -> dict[int, _Outcome]:
        """Call the ``failed`` functions (index -> the first call's error) once more; a second failure
        raises, naming the first sample that fails on its own, a success is warned about."""
        outcomes = {}
        for index, outcome in self.attempt(failed).items():
            name, first = self.names[index], failed[index]
            if outcome.timed_out:
                raise _timeout_error(name, self.kwargs, self.timeout)
            if outcome.error is not None:
                error = outcome.error
                sample = _find_failing_sample(self.funcs[index], self.processing_classes[index], self.kwargs,
                                              self.extras(RewardLogs()), self.timeout)
                raise RewardFunctionError(
                    f"Reward function {name!r} raised {type(error).__name__}: {error}. It raised twice on the whole "
                    f"batch (first {type(first).__name__}: {first}). Offending input: {sample}. Fix the function; "
                    f"{_KEPT}"
                ) from error
            notices.warn(
                f"Reward function {name!r} raised {type(first).__name__}: {first}, and succeeded when called again "
                "on the same completions; the second call's rewards are used. If it fails often, make it retry "
                "(or fail) on its own."
            )
            outcomes[index] = outcome
        return outcomes


def score_completions(
    funcs: list,
    processing_classes: list,
    names: list[str],
    *,
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    columns: dict[str, list],
    trainer_state=None,
    reward_timeout: float | None = REWARD_TIMEOUT,
) -> tuple[torch.Tensor, RewardLogs]:
    """Rewards of shape (B, F), NaN where a function returned None, and what the functions logged.

    Each call gets its own copies of the inputs. A call that raises is made once more, on the whole
    batch (a transient failure, such as a dropped connection, costs one call); a second failure
    raises ``RewardFunctionError`` naming the function and the first sample that fails on its own.
    ``reward_timeout`` (seconds, None for no limit) bounds each call of an ``async def`` function;
    plain functions run in this thread, where they cannot be interrupted, and are not bounded.
    """
    kwargs = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
    scoring = _Scoring(funcs, processing_classes, names, kwargs, trainer_state, reward_timeout)
    outcomes = scoring.attempt(range(len(funcs)))
    for index, outcome in outcomes.items():
        if outcome.timed_out:
            raise _timeout_error(names[index], kwargs, reward_timeout)
    failed = {i: outcome.error for i, outcome in outcomes.items() if outcome.error is not None}
    if failed:
        outcomes.update(scoring.retry(failed))
    logs = RewardLogs()
    for part in scoring.logs_F:
        logs.extras.update(part.extras)
        for metric, values in part.metrics.items():
            logs.metrics.setdefault(metric, []).extend(values)
    columns_F = [_validate(names[i], outcomes[i].value, kwargs) for i in range(len(funcs))]
    rewards_BF = torch.tensor(columns_F, dtype=torch.float32).T.contiguous()
    all_none = torch.isnan(rewards_BF).all(dim=1)
    if all_none.any():
        first = int(all_none.nonzero()[0])
        notices.log_warning(
            f"All reward functions returned None for {int(all_none.sum())} completion(s) of this batch, e.g. "
            f"{_sample_preview(kwargs, first)}. Check that at least one reward function returns a number for "
            "every sample."
        )
    return rewards_BF, logs
