"""A user's rollout function (TRL's ``rollout_func``): how it is called, and the checks on what it returns.

``rollout_func(prompts, session) -> dict`` takes the place of the generation backend in
``generate()``: multi-turn rollouts, environments, tools. ``prompts`` is this process's share of the
generation batch, one entry per completion (a prompt repeated ``num_generations`` times in a row), as
the dataset holds it (text or chat messages); ``session`` is the :class:`grpo_lab.GRPOSession`, whose
``sample()`` samples with the run's backend and settings. The dict it returns holds, per completion:

- ``prompt_ids``: the prompt's token ids (what the completion is conditioned on);
- ``completion_ids``: every token after the prompt, the model's and any an environment inserted;
- ``logprobs``: the log-prob each completion token was sampled with (finite; 0.0 for tokens an
  environment inserted), or None for the whole batch; read by vLLM's importance-sampling correction
  and by ``off_policy_mask_threshold``;
- ``env_mask`` (optional): 1 where the model generated the token, 0 where an environment or a tool
  inserted it. A 0 token is context for the tokens after it but is not trained on, and completion
  lengths do not count it;
- ``completions`` (optional): the completions as reward functions receive them, e.g. a conversation
  of assistant and tool messages (default: the decoded tokens, as one assistant message for chat
  prompts);
- any other key: one value per completion, passed to the reward functions as a keyword argument;
  ``tool_calls`` and ``tool_failures`` (counts, ints >= 0) are also logged as
  ``tools/call_frequency`` (calls per completion) and ``tools/failure_frequency`` (failed calls per
  call), as TRL logs its tool loop.

Prompt plus completion must fit the model's context (``max_position_embeddings``); a completion may be
longer than max_completion_length (which ``loss_type="dr_grpo"`` divides by).
"""

from __future__ import annotations

import copy
import inspect
import math
import numbers
from typing import NamedTuple

import torch

from grpo_lab import notices
from grpo_lab.rollout.batch import GeneratedBatch, batch_from_token_lists
from grpo_lab.rollout.prompt_tokens import left_pad

REQUIRED_KEYS = ("prompt_ids", "completion_ids", "logprobs")
_OWN_KEYS = (*REQUIRED_KEYS, "env_mask", "completions")


class CustomBatch(NamedTuple):
    """What a rollout function returned, checked: the token tensors, the env mask (or None), the
    extra columns for the reward functions and the completions they receive (or None: decoded)."""

    batch: GeneratedBatch
    env_mask_BT: torch.Tensor | None
    columns: dict[str, list]
    completions: list | None


def check_rollout_func(func) -> None:
    if func is None:
        return
    if not callable(func):
        raise TypeError(
            f"rollout_func must be a function rollout_func(prompts, session) -> dict; got {type(func).__name__}."
        )
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):  # builtins and some C callables have no signature to read
        return
    try:
        signature.bind(None, None)
    except TypeError:
        raise TypeError(
            "rollout_func must take two arguments, (prompts, session); "
            f"{getattr(func, '__name__', 'it')}{signature} does not."
        ) from None


def as_token_ids(ids, *, allow_empty: bool) -> list[int] | None:
    """``ids`` as a list of Python ints (given as ints, numpy integers, or a 1-D integer tensor or numpy
    array), or None when it is no such sequence."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.is_floating_point() or ids.dtype == torch.bool:
            return None
        ids = ids.tolist()
    elif hasattr(ids, "ndim") and hasattr(ids, "tolist"):  # a numpy array
        if ids.ndim != 1 or getattr(getattr(ids, "dtype", None), "kind", "") not in ("i", "u"):
            return None
        ids = ids.tolist()
    if not isinstance(ids, (list, tuple)) or not (allow_empty or ids):
        return None
    if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids):
        return None
    return [int(t) for t in ids]


def outside_vocabulary(ids: list[int], vocab_size: int) -> str | None:
    """Where ``ids`` holds an id the model has no embedding for, in words, or None."""
    position = next((i for i, t in enumerate(ids) if not 0 <= t < vocab_size), None)
    if position is None:
        return None
    return f"token id {ids[position]} at position {position} is outside the model's vocabulary [0, {vocab_size})"


def _per_completion(output: dict, key: str, count: int) -> list:
    values = output[key]
    if getattr(values, "ndim", 1) > 1 and key in (*REQUIRED_KEYS, "env_mask"):  # a tensor or a numpy array
        raise ValueError(
            f"rollout_func returned {key!r} as a {values.ndim}-D {type(values).__name__}: return one list per "
            "completion, without padding (a pad token would count as a completion token)."
        )
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    if not isinstance(values, (list, tuple)) or len(values) != count:
        got = f"{len(values)} entries" if isinstance(values, (list, tuple)) else type(values).__name__
        raise ValueError(
            f"rollout_func returned {key!r} with {got}; it must hold one entry per prompt it was given ({count}: "
            "each prompt arrives num_generations times, once per completion)."
        )
    return [value.tolist() if isinstance(value, torch.Tensor) else value for value in values]


def _token_lists(output: dict, key: str, count: int, vocab_size: int, *, allow_empty: bool) -> list[list[int]]:
    lists = []
    for index, entry in enumerate(_per_completion(output, key, count)):
        ids = as_token_ids(entry, allow_empty=allow_empty)
        if ids is None:
            shown = list(entry)[:8] if isinstance(entry, (list, tuple)) else entry
            raise ValueError(
                f"rollout_func returned {key}[{index}] = {shown!r}: each entry must be a "
                f"{'' if allow_empty else 'non-empty '}list of token ids (ints)."
            )
        problem = outside_vocabulary(ids, vocab_size)
        if problem is not None:
            raise ValueError(f"rollout_func returned {key}[{index}], whose {problem}.")
        lists.append(ids)
    return lists


def _aligned(output: dict, key: str, completion_ids: list[list[int]], check) -> list[list]:
    lists = _per_completion(output, key, len(completion_ids))
    for index, (values, ids) in enumerate(zip(lists, completion_ids, strict=True)):
        if not isinstance(values, (list, tuple)) or len(values) != len(ids) or not all(check(v) for v in values):
            raise ValueError(
                f"rollout_func returned {key}[{index}] = {values!r:.80}: it must have one "
                f"{'log-prob (a finite float)' if key == 'logprobs' else 'flag (0 or 1)'} "
                f"per token of completion_ids[{index}] ({len(ids)} tokens)."
            )
    return [list(values) for values in lists]


def call_rollout_func(
    func, prompts: list, session, *, pad_token_id: int, eos_token_ids: set[int], vocab_size: int,
    context: int | None, reserved: set[str], device,
) -> CustomBatch:
    """Call ``func`` and check what it returns.

    ``reserved`` are the names a returned extra column may not take (the dataset's columns and the
    keyword arguments every reward function call receives), ``context`` the model's positions (None:
    unbounded). Every problem raises a ValueError or TypeError that names the key, the entry and what
    was expected. The function gets a copy of ``prompts``: what it changes there stays its own.
    """
    output = _checked_output(func(copy.deepcopy(prompts), session))
    count = len(prompts)
    prompt_ids = _token_lists(output, "prompt_ids", count, vocab_size, allow_empty=False)
    completion_ids = _token_lists(output, "completion_ids", count, vocab_size, allow_empty=True)
    logprobs = None
    if output["logprobs"] is not None:
        logprobs = _aligned(output, "logprobs", completion_ids,
                            lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v))
    env_mask_BT = None if output.get("env_mask") is None else _env_mask(output, completion_ids)
    _check_unpadded(completion_ids, pad_token_id, eos_token_ids)
    _check_context(prompt_ids, completion_ids, context)
    completions = None if output.get("completions") is None else _per_completion(output, "completions", count)
    extra = _extra_columns(output, count, reserved)
    prompt_ids_BP, prompt_mask_BP = left_pad(prompt_ids, pad_token_id)
    batch = batch_from_token_lists(
        prompt_ids_BP.to(device), prompt_mask_BP.to(device), completion_ids, logprobs,
        pad_token_id=pad_token_id, eos_token_ids=eos_token_ids,
    )
    return CustomBatch(batch, None if env_mask_BT is None else env_mask_BT.to(device), extra, completions)


def _checked_output(output) -> dict:
    """``output``, refused unless it is a dict with every required key."""
    if not isinstance(output, dict):
        raise TypeError(
            f"rollout_func must return a dict with the keys {', '.join(REQUIRED_KEYS)}; got {type(output).__name__}."
        )
    missing = [key for key in REQUIRED_KEYS if key not in output]
    if missing:
        raise ValueError(
            f"rollout_func returned no {', '.join(repr(k) for k in missing)}: it must return the keys "
            f"{', '.join(REQUIRED_KEYS)} (logprobs may be None)."
        )
    return output


def _env_mask(output: dict, completion_ids: list[list[int]]) -> torch.Tensor:
    """The returned ``env_mask`` as a (B, T) tensor of 0 and 1, right padded with 0."""
    env_mask = _aligned(output, "env_mask", completion_ids, lambda v: v in (0, 1))
    width = max(1, max(len(ids) for ids in completion_ids))
    env_mask_BT = torch.zeros((len(completion_ids), width), dtype=torch.long)
    for row, flags in enumerate(env_mask):
        env_mask_BT[row, :len(flags)] = torch.tensor(flags, dtype=torch.long)
    if any(completion_ids) and not env_mask_BT.any():
        notices.warn(
            "rollout_func's env_mask marks no token of this batch as the model's (all 0): the batch trains nothing."
        )
    return env_mask_BT


def _check_unpadded(completion_ids: list[list[int]], pad_token_id: int, eos_token_ids: set[int]) -> None:
    padded = next((row for row, ids in enumerate(completion_ids) if ids and ids[-1] == pad_token_id), None)
    if padded is not None and pad_token_id not in eos_token_ids:
        raise ValueError(
            f"rollout_func returned completion_ids[{padded}] ending with the pad token ({pad_token_id}): return each "
            "completion without padding (a pad token would count as a completion token)."
        )


def _check_context(prompt_ids: list[list[int]], completion_ids: list[list[int]], context: int | None) -> None:
    for row, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
        if context is not None and len(prompt) + len(completion) > context:
            raise ValueError(
                f"rollout_func returned a sequence of {len(prompt)} prompt and {len(completion)} completion tokens "
                f"(entry {row}), more than the model's {context} positions. Keep conversations within the context."
            )


def _extra_columns(output: dict, count: int, reserved: set[str]) -> dict[str, list]:
    """The returned keys beyond the rollout's own, one value per completion, for the reward functions."""
    extra = {key: _per_completion(output, key, count) for key in output if key not in _OWN_KEYS}
    for key in ("tool_calls", "tool_failures"):
        bad = [n for n in extra.get(key, []) if not isinstance(n, int) or isinstance(n, bool) or n < 0]
        if bad:
            raise ValueError(
                f"rollout_func returned {key!r} with {bad[0]!r}: "
                "it is a count per completion (an int >= 0), logged as a tools/ metric. Return the calls themselves "
                "under another key."
            )
    clashes = sorted(set(extra) & reserved)
    if clashes:
        raise ValueError(
            f"rollout_func returned {', '.join(repr(k) for k in clashes)}, which reward functions already receive "
            f"(from the dataset or every call: {', '.join(sorted(reserved))}). Rename the key."
        )
    return extra
