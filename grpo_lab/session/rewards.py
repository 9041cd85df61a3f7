"""GRPOSession's reward workbench: ``try_rewards`` scores completions already generated with other
reward functions, without generating and without changing the session (the arithmetic:
:mod:`grpo_lab.session.reward_trial`); ``use_rewards`` makes them the session's, recorded in
``config_changes`` like a config edit.

What the history is re-scored from: the completion log (``session.record.completion_log``, one entry of
columns per logged batch) shows prompts and completions as text, the rewards and the advantage, but
not everything reward functions receive. So each entry also keeps, under :data:`REWARD_INPUTS`, the
rest of what the training call passed, in the smallest form that gives it back exactly (re-deriving
from the dataset would need the rows' indices, which are not logged, and tokenizing the text again
does not always give back the sampled token ids):

- ``prompts``: the prompts as the dataset gave them where any is a list of chat messages (None: the
  ``prompt`` column's text is the prompt);
- ``completions``: only where a rollout function returned completions of its own (None: they are
  the ``completion`` text, wrapped as one assistant message for a conversational prompt);
- ``completion_ids``: each completion's token ids as int32 bytes (4 bytes a token; a list of Python
  ints takes 8 to 36);
- ``columns``: the dataset's columns (``answer``...), None for a column the entry shows already.

A list of ``prompts`` or of a column whose values are equal within each prompt group (the group's
completions are consecutive, as the ``group`` column runs) is kept once per group, as
``{"per_group": [one value per group]}``, and given back one per completion (the group's completions
receive the one object): the completions of a prompt share its prompt and dataset row, and a
checkpoint stores each copy of a repeated object (``plain_values`` rebuilds them), so
``num_generations`` copies would take ``num_generations`` times the room. A list that differs
within a group (an environment's ``reset()`` may vary the prompt) is kept whole. Equal means the
same object, or values of one type that compare equal.

``session.completions_log`` leaves that key out. The entries travel with ``save``/``load``, undo
and fork as the log does (a value a checkpoint cannot store, an image, is kept as its text).
Batches logged without it, by a grpo_lab that did not keep it, are left out with a warning.
Environment instances are live objects and are not kept: a function that reads ``environments=``
can be tried on the held batch only.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from grpo_lab import notices
from grpo_lab.core.build import reward_functions
from grpo_lab.session.reward_trial import AdvantageSettings, RewardTrial, TrialBatch, batch_advantages, run_trial
from grpo_lab.rewards.preparation import check_reward_weights, reward_func_name, weights_tensor
from grpo_lab.rollout.environments import user_reward_funcs
from grpo_lab.rollout.prompts import is_conversational, wrap_completions
from grpo_lab.session.stages import StageOrderError
from grpo_lab.state.run_state import rng_state, set_rng_state
from grpo_lab.types import Advantages, Rollout

REWARD_INPUTS = "reward_inputs"
"""The key of a completion-log entry that holds what reward functions received besides the shown
columns (see the module docstring)."""


def completion_id_lists(rollout: Rollout) -> list[list[int]]:
    """Each completion's token ids without padding, as reward functions receive them."""
    return [  # as Python lists: one indexing call per row would take longer than the rewards
        [token for token, kept in zip(ids, mask) if kept]
        for ids, mask in zip(rollout.completion_ids_BT.tolist(), rollout.completion_mask_BT.tolist())
    ]


def log_entry(advantages: Advantages, step: int) -> dict:
    """A completion-log entry for a batch first trained at ``step``: ``advantages``' columns, the step,
    and under :data:`REWARD_INPUTS` what reward functions receive beyond them."""
    columns = advantages.to_dict()
    rollout = advantages.scores.rollout
    conversational = any(is_conversational(prompt) for prompt in rollout.prompts)
    prompts = list(rollout.prompts) if conversational else None
    own_completions = rollout.completions != wrap_completions(rollout.prompts, rollout.completion_texts)
    runs = group_runs(columns["group"])
    inputs = {
        "prompts": None if prompts is None else once_per_group(prompts, runs),
        "completions": list(rollout.completions) if own_completions else None,
        "completion_ids": [np.asarray(ids, dtype=np.int32).tobytes() for ids in completion_id_lists(rollout)],
        "columns": {name: None if columns.get(name) == list(values) else once_per_group(list(values), runs)
                    for name, values in rollout.columns.items()},
    }
    return {"step": [step] * len(columns["group"]), **columns, REWARD_INPUTS: inputs}


def group_runs(groups: list) -> list[int]:
    """The lengths of the runs of equal consecutive values of a ``group`` column: its prompt groups."""
    runs: list[int] = []
    for position, group in enumerate(groups):
        if position and group == groups[position - 1]:
            runs[-1] += 1
        else:
            runs.append(1)
    return runs


def _equal(a, b) -> bool:
    """The same object, or values of one type that compare equal (an array's elementwise ``==`` is not)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b) is True
    except Exception:  # noqa: BLE001  # e.g. "the truth value of an array is ambiguous"
        return False


def once_per_group(values: list, runs: list[int]):
    """``values`` (one per completion) as ``{"per_group": [...]}`` where each run of ``runs`` holds one
    value (see the module docstring); else the list as it is."""
    firsts, start = [], 0
    for run in runs:
        first = values[start]
        if not all(_equal(first, value) for value in values[start + 1:start + run]):
            return values
        firsts.append(first)
        start += run
    return {"per_group": firsts}


def per_completion(stored, runs: list[int]) -> list:
    """What :func:`once_per_group` kept, one value per completion again."""
    if not isinstance(stored, dict):
        return stored
    return [value for value, run in zip(stored["per_group"], runs, strict=True) for _ in range(run)]


def shown_columns(entry: dict) -> dict:
    """A completion-log entry without :data:`REWARD_INPUTS`: the columns ``completions_log`` shows."""
    return {name: values for name, values in entry.items() if name != REWARD_INPUTS}


def _logged_batch(entry: dict) -> TrialBatch:
    inputs, runs = entry[REWARD_INPUTS], group_runs(entry["group"])
    prompts = list(entry["prompt"]) if inputs["prompts"] is None else per_completion(inputs["prompts"], runs)
    texts = list(entry["completion"])
    return TrialBatch(
        step=int(entry["step"][0]), prompts=prompts,
        completions=wrap_completions(prompts, texts) if inputs["completions"] is None else inputs["completions"],
        completion_ids=[np.frombuffer(ids, dtype=np.int32).tolist() for ids in inputs["completion_ids"]],
        columns={name: list(entry[name]) if values is None else per_completion(values, runs)
                 for name, values in inputs["columns"].items()},
        prompt_texts=list(entry["prompt"]), completion_texts=texts,
        current_B=torch.tensor(entry["reward"], dtype=torch.float32),
        current_advantages_B=torch.tensor(entry["advantage"], dtype=torch.float32),
    )


def _checked_weights(weights, funcs: list) -> list[float] | None:
    """``weights`` as floats, refused unless one finite number per function (or None)."""
    if weights is None:
        return None
    if not isinstance(weights, (list, tuple)) or not all(
            isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) for w in weights):
        raise ValueError(f"weights must be a list of finite numbers, one per reward function; got {weights!r}.")
    check_reward_weights(list(weights), funcs)
    return [float(w) for w in weights]


def try_rewards(session, funcs, on: str, weights: list[float] | None, k: int) -> RewardTrial:
    """``session.try_rewards``: score the held batch or the logged completions with ``funcs``, the
    session's random stream left where it was."""
    if on not in ("batch", "history"):
        raise ValueError(f"try_rewards(on=...) takes 'batch' (the held batch) or 'history' (every logged "
                         f"completion), got {on!r}.")
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ValueError(f"try_rewards(k=...) takes a whole number of examples >= 0, got {k!r}.")
    engine, config = session.engine, session.config
    if engine.accelerator.num_processes > 1:
        raise RuntimeError("try_rewards runs in one process (a notebook); under accelerate launch each process "
                           "holds a share of every batch.")
    batches = _held_batch(session) if on == "batch" else _logged_batches(session.record.completion_log)
    funcs, classes, names = reward_functions(funcs, None, config, list(batches[0].columns), engine.accelerator.device)
    weights = _checked_weights(weights, funcs)
    settings = AdvantageSettings(config.num_generations, config.scale_rewards, config.multi_objective_aggregation)
    random = rng_state()
    try:
        return run_trial(batches, funcs, classes, names, weights, settings=settings, k=k, on=on,
                         trainer_state=engine.trainer_state(), reward_timeout=config.reward_timeout,
                         timeout_sync=config.reward_timeout_sync)
    finally:
        set_rng_state(random)  # a reward function that draws leaves the session's stream where it was


def _held_batch(session) -> list[TrialBatch]:
    rollout, engine, scores = session.rollout, session.engine, session.scores
    if rollout is None:
        logged = sum(len(entry["step"]) for entry in session.record.completion_log)
        raise StageOrderError(
            "try_rewards(on='batch') scores the held batch, and there is none: the next stage is generate(). "
            f"Call session.generate() first, or try_rewards(funcs, on='history') for the {logged} completions "
            "logged so far."
        )
    columns = rollout.columns if engine.environments is None else engine.environments.scoring_columns(rollout)
    current = advantages = None
    if scores is not None:
        own = 0 if engine.environments is None else len(engine.environments.reward_funcs)
        config = session.config
        weights_F = weights_tensor(config.reward_weights, scores.reward_names, own)
        settings = AdvantageSettings(config.num_generations, config.scale_rewards, config.multi_objective_aggregation)
        stats = batch_advantages(scores.rewards_BF.cpu(), weights_F, settings)
        current, advantages = stats.rewards_B, stats.advantages_B
    return [TrialBatch(
        step=session.global_step - session.batch_step + 1, prompts=rollout.prompts, completions=rollout.completions,
        completion_ids=completion_id_lists(rollout), columns=columns, prompt_texts=rollout.to_dict()["prompt"],
        completion_texts=list(rollout.completion_texts), current_B=current, current_advantages_B=advantages,
    )]


def _logged_batches(completion_log: list[dict]) -> list[TrialBatch]:
    entries = [entry for entry in completion_log if len(entry["step"])]
    kept = [entry for entry in entries if REWARD_INPUTS in entry]
    if not kept:
        raise StageOrderError(
            "try_rewards(on='history') scores the completions logged so far, and there are none"
            + (" that kept the reward functions' inputs (they were logged by an earlier grpo_lab)" if entries
               else ": the log grows with each optimizer step") + ". Call session.step() first, or try_rewards("
            "funcs, on='batch') on a generated batch."
        )
    if len(kept) < len(entries):
        notices.warn(f"try_rewards(on='history'): {len(entries) - len(kept)} logged batch(es) were logged without "
                     "the reward functions' inputs (by an earlier grpo_lab) and are left out.")
    return [_logged_batch(entry) for entry in kept]


class RewardSwaps:
    """The ``reward_funcs`` records ``use_rewards`` made, so that an ``undo()`` to before one, which
    puts the config back but not the functions (no saved state holds them), is told apart and warned
    about."""

    def __init__(self):
        self._swaps: list[dict] = []

    def use_rewards(self, session, funcs, weights: list[float] | None) -> None:
        """``session.use_rewards``: make ``funcs`` the session's reward functions, weighted by
        ``weights``, recorded as the edits ``reward_funcs`` and ``reward_weights``."""
        listed = list(funcs) if isinstance(funcs, (list, tuple)) else [funcs]
        weights = _checked_weights(weights, listed)
        record = session.record
        old_names = [reward_func_name(func) for func in user_reward_funcs(session.engine)]
        old_weights = record.applied_config.get("reward_weights")
        session.reward_funcs = listed  # checks every function first: a refusal changes nothing
        session.config.reward_weights = weights
        record.applied_config["reward_weights"] = None if weights is None else list(weights)
        step = session.global_step + 1
        new_names = [reward_func_name(func) for func in user_reward_funcs(session.engine)]
        record.record_change("reward_funcs", old_names, new_names, step)
        self._keep(record.config_changes)
        record.record_change("reward_weights", old_weights, weights, step)
        if session.scores is not None and session.batch_step == 0:
            session.scores = session.advantages_result = session.loss_result = None

    def _keep(self, config_changes: list[dict]) -> None:
        """Keep the ``reward_funcs`` record ``use_rewards`` just made (if the names changed)."""
        self._swaps[:] = [swap for swap in self._swaps if swap in config_changes]  # a record replaced before any stage
        last = config_changes[-1] if config_changes else None
        if last is not None and last["field"] == "reward_funcs" and last not in self._swaps:
            self._swaps.append(dict(last))

    def after_undo(self, session, step: int) -> None:
        """After ``undo()`` to ``step``: warn where it went back to before a ``use_rewards`` (see there)."""
        undone = [swap for swap in self._swaps if swap not in session.config_changes]
        if not undone:
            return
        self._swaps[:] = [swap for swap in self._swaps if swap not in undone]
        names, weights, back = ([reward_func_name(f) for f in user_reward_funcs(session.engine)],
                                session.config.reward_weights, undone[0]["old"])
        refused = (f" The next advantages() refuses them: {len(weights)} weights for {len(names)} functions."
                   if weights is not None and len(weights) != len(names) else "")
        notices.warn(
            f"undo() returned to step {step}, before use_rewards() at step {undone[0]['step']}: the config is back "
            f"(reward_weights = {weights!r}, set for {', '.join(back)}) but not the reward functions, which no "
            f"saved state holds: they are still {', '.join(names)}.{refused} To train on the functions of step "
            f"{step} again, call session.use_rewards([{', '.join(back)}], weights={weights!r}); to keep the "
            f"current ones, set session.config.reward_weights to one weight per function ({len(names)}), or None."
        )
