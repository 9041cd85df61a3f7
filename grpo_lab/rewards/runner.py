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
4) Each call of an ``async def`` function must finish within ``reward_timeout`` seconds (None: no limit);
   a late one is cancelled. With ``reward_timeout_sync=True`` the limit also bounds plain functions, each
   call run in a daemon worker thread named after the function (the caller waits), which Python cannot
   stop: a late one is left running in the background, holding none of grpo_lab's locks. The error names
   the function, its samples and the first sample that hangs on its own. Otherwise plain functions and
   reward models run in the calling thread, as in TRL.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Real

import torch

from grpo_lab import notices
from grpo_lab.config.grpo_config import REWARD_TIMEOUT
from grpo_lab.rewards.calls import Outcome, call_all, find_failing_sample, make_call
from grpo_lab.errors import UsageError


class RewardFunctionError(UsageError, RuntimeError):
    """A reward function failed or returned something unusable; the completions are kept."""


@dataclass
class RewardLogs:
    """What reward functions logged during one scoring call."""

    extras: dict[str, list] = field(default_factory=dict)
    metrics: dict[str, list[float]] = field(default_factory=dict)


def _sample_preview(kwargs: dict, index: int) -> str:
    prompt, completion = kwargs["prompts"][index], kwargs["completions"][index]
    return f"sample {index}: prompt={str(prompt)[:200]!r}, completion={str(completion)[:200]!r}"


_KEPT = ("in a session a training batch's completions are kept: set session.reward_funcs again and call "
         "session.score().")


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

    def __init__(self, funcs, processing_classes, names, kwargs: dict, trainer_state, timeout: float | None,
                 threaded: bool):
        self.funcs, self.processing_classes, self.names = funcs, processing_classes, names
        self.kwargs, self.trainer_state, self.timeout, self.threaded = kwargs, trainer_state, timeout, threaded
        self.logs_F = [RewardLogs() for _ in funcs]

    def extras(self, logs: RewardLogs) -> dict:
        """The keyword arguments a call receives besides the inputs: ``trainer_state`` and the two
        callbacks, which log into ``logs``."""

        def log_extra(column: str, values: list) -> None:
            logs.extras[column] = list(values)

        def log_metric(metric: str, value: float) -> None:
            logs.metrics.setdefault(metric, []).append(float(value))

        return dict(trainer_state=self.trainer_state, log_extra=log_extra, log_metric=log_metric)

    def attempt(self, indices) -> dict[int, Outcome]:
        """Call the functions at ``indices``, each on its own copies of the inputs. Each call logs into a
        new ``RewardLogs``, read only once every call has finished in time: a failed call's logs are
        dropped with it, and what an abandoned one writes later reaches nothing that is read."""
        for index in indices:
            self.logs_F[index] = RewardLogs()
        return call_all({i: self.call(i, self.kwargs, self.logs_F[i]) for i in indices}, self.timeout)

    def call(self, index: int, kwargs: dict, logs: RewardLogs):
        """A call of function ``index`` on ``kwargs`` that logs into ``logs`` (``calls.make_call``)."""
        return make_call(self.funcs[index], self.processing_classes[index], kwargs, self.extras(logs),
                         name=self.names[index], timeout=self.timeout, threaded=self.threaded)

    def search(self, index: int, budget: float | None = None) -> tuple[int, Outcome | None]:
        """Function ``index`` called again one sample at a time (``calls.find_failing_sample``); what
        those calls log is dropped."""
        logs = RewardLogs()
        return find_failing_sample(lambda single: self.call(index, single, logs), self.kwargs, self.timeout, budget)

    def timeout_error(self, index: int, first: Outcome) -> RewardFunctionError:
        """The error for function ``index``'s call ``first``, which did not finish in time, after calling it
        again one sample at a time (no new try once the tries took ``reward_timeout``) to find the sample."""
        kwargs, timeout, name, count = self.kwargs, self.timeout, self.names[index], len(self.kwargs["completions"])
        at, found = self.search(index, budget=timeout)
        sample, finished = _sample_preview(kwargs, min(at, count - 1)), f" (samples 0-{at - 1} finished)" if at else ""
        if found is not None and found.timed_out:
            search = f"it did not finish within {timeout:g} s on {sample}{finished}"
        elif found is not None:
            search = f"it raised {type(found.error).__name__}: {found.error} on {sample}{finished}"
        elif at == count:
            search = f"each of the {count} samples finished on its own"
        else:
            search = f"samples 0-{at - 1} each finished on their own, and the search stopped after {timeout:g} s"
        left = (f"Python cannot stop a thread: the calls that hung are left running in the background (daemon "
                f"threads named 'reward {name}', holding none of grpo_lab's locks; what they log is dropped); "
                "restart the process if it must not keep them. ")
        left = left if first.left_running or (found is not None and found.left_running) else ""
        return RewardFunctionError(
            f"Reward function {name!r} did not finish within reward_timeout={timeout:g} s scoring samples "
            f"0-{count - 1} (first: {_sample_preview(kwargs, 0)}). Called again one sample at a time"
            f"{' (the first call still running)' if first.left_running else ''}, {search}. {left}Fix the function "
            f"(e.g. a request without a timeout of its own, an endless loop, or blocking code inside async def), or "
            f"raise reward_timeout (None waits without limit); {_KEPT}"
        )

    def retry(self, failed: dict[int, Exception]) -> dict[int, Outcome]:
        """Call the ``failed`` functions (index -> the first call's error) once more; a second failure
        raises, naming the first sample that fails on its own, a success is warned about."""
        outcomes = {}
        for index, outcome in self.attempt(failed).items():
            name, first = self.names[index], failed[index]
            if outcome.timed_out:
                raise self.timeout_error(index, outcome)
            if outcome.error is not None:
                error = outcome.error
                position, found = self.search(index)
                sample = ("no single sample reproduces the error on its own" if found is None
                          else _sample_preview(self.kwargs, position))
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
    timeout_sync: bool = False,
) -> tuple[torch.Tensor, RewardLogs]:
    """Rewards of shape (B, F), NaN where a function returned None, and what the functions logged.

    Each call gets its own copies of the inputs. A call that raises is made once more, on the whole
    batch (a transient failure, such as a dropped connection, costs one call); a second failure
    raises ``RewardFunctionError`` naming the function and the first sample that fails on its own.
    ``reward_timeout`` (seconds, None for no limit) bounds each call of an ``async def`` function, and
    with ``timeout_sync`` each call of a plain function too, run in a worker thread (module docstring).
    """
    kwargs = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
    scoring = _Scoring(funcs, processing_classes, names, kwargs, trainer_state, reward_timeout, timeout_sync)
    outcomes = scoring.attempt(range(len(funcs)))
    for index, outcome in outcomes.items():
        if outcome.timed_out:
            raise scoring.timeout_error(index, outcome)
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
            f"All reward functions returned None for the following kwargs: {_sample_preview(kwargs, first)} "
            f"({int(all_none.sum())} completion(s) of this batch). Check that at least one reward function returns "
            "a number for every sample."
        )
    return rewards_BF, logs
