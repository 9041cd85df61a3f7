"""transformers' trainer surface around ``GRPOTrainer``'s loop: ``TrainerState``, ``TrainerControl``,
``TrainerCallback`` events, the rows of ``state.log_history`` and ``train()``'s ``TrainOutput``.

A script written for TRL's GRPOTrainer (a transformers ``Trainer``) reads these, so they keep
transformers' meaning:

- callbacks get ``on_init_end``, ``on_train_begin``, ``on_step_begin``, ``on_step_end``, ``on_log``,
  ``on_evaluate``, ``on_save`` and ``on_train_end`` with ``args``, ``state``, ``control`` and the ``model``,
  ``processing_class``, ``optimizer`` and ``lr_scheduler`` keywords; a callback that sets
  ``control.should_training_stop`` ends the run after the step, ``control.should_save`` writes a
  checkpoint of it, ``control.should_log`` logs it, ``control.should_evaluate`` evaluates;
- a row of ``log_history`` is written every ``logging_steps`` (and at step 1 with
  ``logging_first_step``), as TRL reduces it: the mean over the steps since the last row of every
  metric (NaN values left out, None where none is left), but ``grad_norm``, ``learning_rate``,
  ``num_tokens`` and ``epoch``, which are the last step's; ``step`` is the global step;
- the run's last row holds ``train_runtime``, ``train_samples_per_second``,
  ``train_steps_per_second``, ``total_flos`` (0: not counted), ``train_loss`` (the mean of the steps'
  ``loss`` in this call of ``train()``) and the step metrics of the steps not logged yet, as TRL's
  does; ``TrainOutput.metrics`` is that row (without ``step``), as transformers returns it;
- with ``logging_nan_inf_filter`` (the default), a NaN or infinite loss is left out of ``loss``
  and ``train_loss``, as transformers leaves it out.

``metrics.jsonl`` still gets every step's own row; the ``report_to`` trackers are transformers'
integration callbacks among the others (:mod:`grpo_lab.trainer.trackers`), and get ``log_history``'s
rows as a Trainer sends them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

from grpo_lab.core.hf_trainer_types import (
    CallbackHandler,
    DefaultFlowCallback,
    TrainerControl,
    TrainerState,
    TrainOutput,
    speed_metrics,
)
from grpo_lab.config.grpo_config import evaluation_due
from grpo_lab.trainer.trackers import is_tracker

LAST_STEP_KEYS = frozenset({"grad_norm", "learning_rate", "num_tokens", "epoch"})
"""Logged as the last step's value, not the window's mean: transformers' Trainer logs the last
``grad_norm`` and the current ``learning_rate``; TRL keeps ``num_tokens`` as a running total."""
TRAINER_LOGGED_KEYS = frozenset({"loss", "grad_norm", "learning_rate"})
"""What transformers' Trainer adds to a logged row (the rest are TRL's step metrics)."""


def window_row(rows: list[dict], *, finite_loss: bool = True) -> dict:
    """One ``log_history`` row from the per-step rows of a logging window (see the module's docstring);
    with ``finite_loss`` (``logging_nan_inf_filter``), a step whose loss is NaN or infinite is left
    out of the ``loss`` mean, as transformers leaves it out."""
    keys = dict.fromkeys(key for row in rows for key in row if key != "step")
    logged = {}
    for key in keys:
        values = [row[key] for row in rows if isinstance(row.get(key), (int, float))]
        if key == "loss" and finite_loss:
            values = [value for value in values if math.isfinite(value)]
        if key in LAST_STEP_KEYS:
            logged[key] = values[-1] if values else None
            continue
        valid = [value for value in values if not math.isnan(value)]
        logged[key] = sum(valid) / len(valid) if valid else None
    return logged


class GRPOFlowCallback(DefaultFlowCallback):
    """When to log, save and stop, by grpo_lab's step counts (``logging_steps`` and ``save_steps``
    resolved to optimizer steps): the part transformers' ``DefaultFlowCallback`` plays in a Trainer."""

    def on_step_end(self, args, state, control, **kwargs):
        logging, saving = args.logging_strategy == "steps", args.save_strategy == "steps"
        if (logging and state.global_step % state.logging_steps == 0) or (
                state.global_step == 1 and args.logging_first_step):
            control.should_log = True
        if saving and state.global_step % state.save_steps == 0:
            control.should_save = True
        if evaluation_due(args, state.global_step, state.max_steps):  # a run ends evaluated, as transformers'
            control.should_evaluate = True
        if state.global_step >= state.max_steps:
            control.should_training_stop = True
            control.should_save = saving  # the end of a run is always resumable, unless saving is off
        return control

    def on_epoch_end(self, args, state, control, **kwargs):
        return control


class GRPOCallbackHandler(CallbackHandler):
    """transformers' ``CallbackHandler``, but for the config its tracker callbacks (transformers'
    integrations) read: :class:`grpo_lab.trainer.trackers.TrackerArgs`, which leaves credentials out
    of what they send; every other callback gets the config itself."""

    def __init__(self, callbacks, tracker_args=None):
        super().__init__(callbacks, None, None, None, None)
        self.tracker_args = tracker_args
        self.trackers_quiet = False  # a train() with nothing to train opens no empty tracker run

    def call_event(self, event, args, state, control, **kwargs):
        for callback in self.callbacks:
            tracker = is_tracker(callback)
            if tracker and self.trackers_quiet:
                continue
            seen = self.tracker_args if tracker and self.tracker_args is not None else args
            result = getattr(callback, event)(
                seen, state, control, model=self.model, processing_class=self.processing_class,
                optimizer=self.optimizer, lr_scheduler=self.lr_scheduler, train_dataloader=self.train_dataloader,
                eval_dataloader=self.eval_dataloader, **kwargs,
            )
            if result is not None:  # a callback that changes nothing may return None
                control = result
        return control


class TrainerEvents:
    """The state, control and callbacks of one trainer, and the rows its loop logs."""

    def __init__(self, args, callbacks, *, is_world_process_zero: bool, is_local_process_zero: bool,
                 tracker_args=None):
        self.state = TrainerState(is_world_process_zero=is_world_process_zero,
                                  is_local_process_zero=is_local_process_zero)
        self.control = TrainerControl()
        self.handler = GRPOCallbackHandler([GRPOFlowCallback(), *(callbacks or [])], tracker_args)
        self.args = args
        self._window: list[dict] = []
        self._losses: list[float] = []
        self._started = 0.0
        self._in_epoch = False  # on_epoch_begin was called and on_epoch_end not yet

    def attach(self, session) -> None:
        """Point the callbacks' keywords at ``session``'s model, tokenizer, optimizer and schedule
        (a resume replaces the session)."""
        self.handler.model = session.model
        self.handler.processing_class = session.engine.processing_class
        self.handler.optimizer = session.engine.optimizer
        self.handler.lr_scheduler = session.engine.scheduler
        session.engine.step_events = self._call
        session.undo_by_default = False  # a script does not undo: no snapshots unless undo_steps asks for them

    def detach(self, session=None) -> None:
        """Let go of the session's model and optimizer (before a resume loads new ones, or at close)."""
        if session is not None:
            session.engine.step_events = None
        handler = self.handler
        handler.model = handler.processing_class = handler.optimizer = handler.lr_scheduler = None

    def _call(self, event: str, **kwargs) -> TrainerControl:
        self.control = getattr(self.handler, event)(self.args, self.state, self.control, **kwargs)
        return self.control

    def init_end(self) -> None:
        self._call("on_init_end")

    def train_begin(self, *, global_step: int, max_steps: int, logging_steps: int, save_steps: int,
                    eval_steps: int) -> None:
        state = self.state
        state.global_step, state.max_steps = global_step, max_steps
        state.logging_steps, state.save_steps, state.eval_steps = logging_steps, save_steps, eval_steps
        state.train_batch_size = self.args.per_device_train_batch_size
        state.num_train_epochs = self.args.num_train_epochs
        self.control.should_training_stop = False
        self._window, self._losses, self._started, self._in_epoch = [], [], time.time(), False
        self._call("on_train_begin")

    def step_begin(self) -> None:
        """Before an optimizer step: ``on_epoch_begin`` first when it is the first step of the run
        or follows the end of an epoch."""
        if not self._in_epoch:
            self._in_epoch = True
            self._call("on_epoch_begin")
        self._call("on_step_begin")

    def epoch_end(self) -> None:
        """``on_epoch_end`` for the epoch open, if any: after the step (and its evaluation and
        checkpoint) that used the epoch's last batch, and when the run ends inside one (as
        transformers' loop ends an epoch that ``max_steps`` cut short)."""
        if self._in_epoch:
            self._in_epoch = False
            self._call("on_epoch_end")

    def step_end(self, row: dict) -> TrainerControl:
        """After an optimizer step: update the state, run ``on_step_end`` and log if asked."""
        self.state.global_step, self.state.epoch = row["step"], row.get("epoch", self.state.epoch)
        self._window.append(row)
        loss = row.get("loss")
        if isinstance(loss, (int, float)) and (math.isfinite(loss) or not self.args.logging_nan_inf_filter):
            self._losses.append(loss)
        self._call("on_step_end")
        if self.control.should_log:
            self.log(window_row(self._window, finite_loss=self.args.logging_nan_inf_filter))
            self._window = []
        return self.control

    def log(self, logs: dict) -> None:
        """Append ``logs`` to ``log_history`` with the epoch and step, and run ``on_log``."""
        if self.state.epoch is not None:
            logs["epoch"] = self.state.epoch
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self._call("on_log", logs=logs)

    def saved(self) -> None:
        self._call("on_save")

    def evaluated(self, metrics: dict) -> None:
        self._call("on_evaluate", metrics=metrics)

    def state_json(self) -> str:
        """The state as a checkpoint keeps it (transformers' ``TrainerState.save_to_json`` layout)."""
        return json.dumps(dataclasses.asdict(self.state), indent=2, sort_keys=True) + "\n"

    def resumed(self, state_file: Path, session) -> None:
        """After a resume: the state the checkpoint kept (log history, best metric and checkpoint), or a
        fresh one for a checkpoint written by ``session.save()``; this process's flags; the session's step."""
        flags = self.state.is_world_process_zero, self.state.is_local_process_zero
        self.state = TrainerState.load_from_json(str(state_file)) if state_file.exists() else TrainerState()
        self.state.is_world_process_zero, self.state.is_local_process_zero = flags
        self.state.global_step = session.global_step
        self.attach(session)

    def train_end(self, *, steps_run: int, samples_per_step: int) -> TrainOutput:
        """The run's closing row, ``on_train_end``, and ``train()``'s result.

        As in TRL, the closing row holds the run's runtime, throughput and ``train_loss``, and the
        means of the steps logged since the last row (without the Trainer's own ``loss``,
        ``grad_norm`` and ``learning_rate``); ``TrainOutput.metrics`` is that row without ``step``, as
        transformers' ``Trainer.train`` returns the dict it logs."""
        train_loss = sum(self._losses) / len(self._losses) if self._losses else 0.0
        logs = speed_metrics("train", self._started, num_samples=steps_run * samples_per_step, num_steps=steps_run)
        logs["total_flos"] = self.state.total_flos
        logs["train_loss"] = train_loss
        leftover = window_row(self._window) if self._window else {}
        logs.update({k: v for k, v in leftover.items() if k not in TRAINER_LOGGED_KEYS})
        self._window = []
        self.epoch_end()
        self.log(logs)
        self._call("on_train_end")
        return TrainOutput(self.state.global_step, train_loss, logs)
