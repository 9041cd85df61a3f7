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
from transformers import AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel

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


def reward_func_name(func) -> str:
    if isinstance(func, PreTrainedModel):
        return str(func.config._name_or_path).rstrip("/").split("/")[-1] or type(func).__name__
    return getattr(func, "__name__", type(func).__name__)


CALL_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
"""Keyword arguments every reward function call receives, besides the dataset's other columns."""


def check_reward_signature(func, name: str, columns: list[str]) -> None:
    """Raise a TypeError now, naming the fix, if ``func`` cannot take the keyword arguments every call
    passes (``CALL_KEYWORDS`` and the dataset ``columns``), instead of failing after generation."""
    try:  # the signature of what is called: a decorator's wrapper, not the function it wraps
        parameters = inspect.signature(func, follow_wrapped=False).parameters.values()
    except (TypeError, ValueError):  # builtins and some C callables have no signature to read
        return
    passed = [*CALL_KEYWORDS, *columns]
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        accepted = set(passed)
    else:
        accepted = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    unexpected = [k for k in passed if k not in accepted]
    missing = [
        p.name for p in parameters
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY, p.POSITIONAL_ONLY) and p.default is p.empty
        and (p.name not in passed or p.kind is p.POSITIONAL_ONLY)
    ]
    if not unexpected and not missing:
        return
    problems = []
    if unexpected:
        problems.append(f"does not accept {', '.join(unexpected)}")
    if missing:
        problems.append(f"requires {', '.join(missing)}, which no call passes")
    raise TypeError(
        f"Reward function {name!r} {' and '.join(problems)}. Every call passes the keyword arguments "
        f"{', '.join(passed)}: take the ones you need and end the signature with **kwargs, e.g. "
        f"def {name}(completions, **kwargs)."
    )


def check_column_names(dataset, dataset_name: str) -> None:
    """Refuse a dataset column named like a keyword argument reward functions already receive: the
    column could never reach them."""
    clashing = [column for column in getattr(dataset, "column_names", None) or () if column in CALL_KEYWORDS]
    if clashing:
        renames = "".join(f".rename_column({c!r}, '{c}_column')" for c in clashing)
        raise ValueError(
            f"{dataset_name} has a column named {', '.join(map(repr, clashing))}, a name reward functions "
            f"already receive as a keyword argument ({', '.join(CALL_KEYWORDS)}), so the column cannot reach "
            f"them. Rename it, e.g. {dataset_name} = {dataset_name}{renames}, and read it under that name."
        )


def check_reward_weights(reward_weights: list[float] | None, reward_funcs) -> None:
    """Refuse ``reward_weights`` without one weight per reward function, before anything is generated."""
    count = len(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else 1
    if reward_weights is not None and len(reward_weights) != count:
        raise ValueError(
            f"reward_weights has {len(reward_weights)} entries ({reward_weights}) but there are {count} reward "
            "functions. Give one weight per function, in the order of reward_funcs, or None to weight them all by 1."
        )


def prepare_reward_funcs(reward_funcs, reward_processing_classes=None, model_init_kwargs=None, columns=()):
    """Normalise ``reward_funcs`` to a list; load reward models given by path; pair tokenizers; check
    that each function takes the keyword arguments its calls pass (``columns``: the dataset's
    columns besides the prompt).

    Returns ``(funcs, processing_classes, names)``.
    """
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if not funcs:
        raise ValueError("reward_funcs is empty: give at least one reward function or reward model.")
    classes = reward_processing_classes
    if classes is None or not isinstance(classes, (list, tuple)):
        classes = [classes] * len(funcs) if len(funcs) == 1 or classes is None else None
    if classes is None or len(classes) != len(funcs):
        raise ValueError(
            f"reward_processing_classes must have one entry per reward function ({len(funcs)}); "
            "use None for plain functions."
        )
    loaded, tokenizers = [], []
    for func, tokenizer in zip(funcs, classes, strict=True):
        if isinstance(func, str):
            try:
                func = AutoModelForSequenceClassification.from_pretrained(func, num_labels=1, **(model_init_kwargs or {}))
            except OSError as error:
                raise ValueError(
                    f"The reward function {func!r} is a string, which is loaded as a reward model (a local "
                    f"directory or a Hugging Face Hub id), and loading it failed: {error} Pass the function "
                    "itself, not its name, to use a Python function."
                ) from error
        if isinstance(func, PreTrainedModel):
            func.eval().requires_grad_(False)
            if tokenizer is None:
                remote_code = bool((model_init_kwargs or {}).get("trust_remote_code"))  # from config.model_kwargs()
                tokenizer = AutoTokenizer.from_pretrained(func.config._name_or_path, trust_remote_code=remote_code)
            if tokenizer.pad_token is None:
                tokenizer.pad_token = tokenizer.eos_token
            func.config.pad_token_id = tokenizer.pad_token_id
        elif not callable(func):
            raise TypeError(f"A reward function must be callable, a model path or a PreTrainedModel; got {func!r}.")
        loaded.append(func)
        tokenizers.append(tokenizer)
    names = [reward_func_name(f) for f in loaded]
    if len(set(names)) != len(names):
        names = [f"{name}_{i}" if names.count(name) > 1 else name for i, name in enumerate(names)]
    check_reward_signatures(loaded, names, columns)
    return loaded, tokenizers, names


def check_reward_signatures(funcs, names, columns) -> None:
    """:func:`check_reward_signature` for each reward function (models take no keyword arguments);
    nothing while ``columns`` is None (not known yet)."""
    if columns is None:
        return
    for func, name in zip(funcs, names, strict=True):
        if not isinstance(func, PreTrainedModel):
            check_reward_signature(func, name, list(columns))


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
    logs_F = [RewardLogs() for _ in funcs]

    def extras(logs: RewardLogs) -> dict:
        def log_extra(column: str, values: list) -> None:
            logs.extras[column] = list(values)

        def log_metric(metric: str, value: float) -> None:
            logs.metrics.setdefault(metric, []).append(float(value))

        return dict(trainer_state=trainer_state, log_extra=log_extra, log_metric=log_metric)

    def attempt(indices) -> dict[int, _Outcome]:
        for index in indices:
            logs_F[index] = RewardLogs()  # a failed call's logs are dropped with it
        return _call_all({i: _caller(funcs[i], processing_classes[i], kwargs, extras(logs_F[i])) for i in indices},
                         reward_timeout)

    outcomes = attempt(range(len(funcs)))
    for index, outcome in outcomes.items():
        if outcome.timed_out:
            raise _timeout_error(names[index], kwargs, reward_timeout)
    failed = {i: outcome.error for i, outcome in outcomes.items() if outcome.error is not None}
    if failed:
        retried = attempt(failed)
        for index, outcome in retried.items():
            name, first = names[index], failed[index]
            if outcome.timed_out:
                raise _timeout_error(name, kwargs, reward_timeout)
            if outcome.error is not None:
                error = outcome.error
                sample = _find_failing_sample(funcs[index], processing_classes[index], kwargs, extras(RewardLogs()),
                                              reward_timeout)
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
    logs = RewardLogs()
    for part in logs_F:
        logs.extras.update(part.extras)
        for metric, values in part.metrics.items():
            logs.metrics.setdefault(metric, []).extend(values)
    columns_F = [_validate(names[i], outcomes[i].value, kwargs) for i in range(len(funcs))]
    rewards_BF = torch.tensor(columns_F, dtype=torch.float32).T.contiguous()
    all_none = torch.isnan(rewards_BF).all(dim=1)
    if all_none.any():
        first = int(all_none.nonzero()[0])
        notices.warn(
            f"All reward functions returned None for {int(all_none.sum())} completion(s), e.g. "
            f"{_sample_preview(kwargs, first)}. Such completions get no reward signal; check that at "
            "least one reward function applies to every sample.",
        )
    return rewards_BF, logs
