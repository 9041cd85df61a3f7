"""GRPOSession: step through GRPO one stage at a time, on the real trainer core.

The session is a small state machine over :class:`grpo_lab.engine.Engine`::

    generate -> score -> advantages -> loss -> update   (one optimizer step)

``score()``, ``advantages()`` and ``loss()`` may be called again before ``update()`` (after editing
reward functions or settings) without regenerating. When a generation batch feeds several optimizer
steps (``num_iterations > 1`` or ``steps_per_generation > gradient_accumulation_steps``), the stage
after ``update()`` is ``loss()`` again until the batch is used up. Views subscribe with
``session.on(callback)``; this module never imports widget code.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import pandas as pd

from grpo_lab import notices
from grpo_lab.config import GRPOConfig
from grpo_lab.engine import Engine
from grpo_lab.interrupts import deferred_interrupts
from grpo_lab.live_config import apply_edits
from grpo_lab.ownership import Activity, OwnerGuard
from grpo_lab.session_doctor import SessionDoctor
from grpo_lab.session_experiments import SessionExperiments
from grpo_lab.session_files import SessionFiles
from grpo_lab.session_loops import SessionLoops
from grpo_lab.session_rewards import SessionRewards, log_entry, shown_columns
from grpo_lab.session_views import SessionViews
from grpo_lab.stages import RANDOM_STATE_LOCK, STAGES, StageOrderError, check_stage_order, drives_stages
from grpo_lab.state import rng_state, set_rng_state
from grpo_lab.types import Advantages, LossResult, Rollout, Scores

__all__ = ["GRPOSession", "STAGES", "StageOrderError"]


class GRPOSession(SessionLoops, SessionFiles, SessionViews, SessionExperiments, SessionDoctor, SessionRewards):
    """Stateful, stage-by-stage GRPO. Same arguments as :class:`grpo_lab.GRPOTrainer`."""

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: GRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
        rollout_func=None,
        environment_factory=None,
    ):
        if callbacks:  # a transformers TrainerCallback's events (on_step_end, on_log, on_save, ...) are a loop's
            raise TypeError("GRPOSession does not run transformers callbacks, whose events come from GRPOTrainer's "
                            "loop: pass callbacks= to GRPOTrainer, or follow its steps with session.on(listener).")
        with RANDOM_STATE_LOCK:  # building seeds the process's generators: not while another session draws
            self.engine = Engine(
                model, reward_funcs, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                processing_class=processing_class, reward_processing_classes=reward_processing_classes,
                optimizers=optimizers, quantization_config=quantization_config, peft_config=peft_config,
                tools=tools, rollout_func=rollout_func, environment_factory=environment_factory,
            )
        self.engine.rollout_owner = self
        self.config = self.engine.config
        self._applied_config = self.config.to_dict()
        self.config_changes: list[dict] = []
        self._stages_run = 0  # stages completed, so that an edit no stage used can be replaced in config_changes
        self._unused_changes: dict[str, tuple[dict, int]] = {}  # field -> (its last change, _stages_run then)
        self.rollout: Rollout | None = None
        self.scores: Scores | None = None
        self.advantages_result: Advantages | None = None
        self.loss_result: LossResult | None = None
        self.batch_step = 0
        self._history: list[dict] = []
        self._evaluations: list[dict] = []
        self._completion_log: list[dict[str, list]] = []  # columns of each batch's completions
        self._listeners: list[Callable[[str, object], None]] = []
        self._step_started: float | None = None
        self._last_stage: str | None = None
        self._owner = OwnerGuard(self._notify)  # one thread drives the stages at a time
        self._rng, self._rng_held = None, False  # its own random state once a stage has run (stages.drives_stages)
        self._made_with_optimizers = any(part is not None for part in optimizers)
        self._given_reward_processing_classes = reward_processing_classes  # what a fork is built with
        self._init_experiments()
        self.last_trained: LossResult | None = None  # the loss() result of the latest update(), for the views

    # ------------------------------------------------------------------ public state
    @property
    def model(self):
        return self.engine.unwrapped_model

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def reward_funcs(self) -> list:
        return self.engine.reward_funcs

    @reward_funcs.setter
    def reward_funcs(self, funcs) -> None:
        """Replace the reward functions; an environment's ``get_reward`` stays, last, whether or not
        ``funcs`` lists it."""
        from grpo_lab.rewards import prepare_reward_funcs
        from grpo_lab.rollout.environments import reward_sources

        environments = self.engine.environments
        if environments is not None and isinstance(funcs, (list, tuple)):
            funcs = environments.user_reward_funcs(funcs)
        self.engine.reward_funcs, self.engine.reward_processing_classes, self.engine.reward_names = (
            prepare_reward_funcs(*reward_sources(funcs, None, environments), self.config.model_kwargs(),
                                 columns=self.engine.reward_columns())
        )

    @property
    def rollout_func(self):
        """The function that generates the completions in place of the backend (None: the backend does)."""
        return self.engine.rollout_func

    @property
    def tools(self) -> list | None:
        """The ``tools=`` functions the model may call while it generates (None: none; an
        environment's methods are its own tools, see ``environment_factory``)."""
        return self.engine.tools

    @property
    def environment_factory(self):
        """What builds the environments the rollouts run in (a callable, or a dict of them), or None."""
        return None if self.engine.environments is None else self.engine.environments.factory

    @property
    def global_step(self) -> int:
        return self.engine.global_step

    @property
    def history(self) -> pd.DataFrame:
        """One row per optimizer step, TRL's metric names as columns."""
        return pd.DataFrame(self._history)

    @property
    def evaluations(self) -> pd.DataFrame:
        """One row per ``evaluate()`` (called, or run by ``eval_strategy="steps"`` in ``run``, ``arun``
        and Run N): the optimizer step it evaluated after, and its ``eval_...`` metrics."""
        return pd.DataFrame(self._evaluations)

    @property
    def last_metrics(self) -> dict:
        """The metrics of the last optimizer step, as ``step()`` returned them (empty before the first)."""
        return dict(self._history[-1]) if self._history else {}

    @property
    def completions_log(self) -> pd.DataFrame:
        """Every scored completion of every step: step, prompt, completion, rewards, advantage."""
        frames = [pd.DataFrame(shown_columns(columns)) for columns in self._completion_log]
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()

    @property
    def next_stage(self) -> str:
        if self.rollout is None:
            return "generate"
        if self.scores is None:
            return "score"
        if self.advantages_result is None:
            return "advantages"
        if self.loss_result is None:
            return "loss"
        return "update"

    @property
    def activity(self) -> Activity | None:
        """What drives the session now (None when idle): what runs, who started it (a cell, the
        dashboard's Run N or Step button), how far it is and how to stop it; ``str()`` says it all."""
        return self._owner.activity

    def request_stop(self, where: str = "stage") -> bool:
        """Ask what drives the session from another thread (the dashboard's Run N, ``arun``) to end: ``"stage"``
        between two stages, ``"step"`` after the current update(). Returns whether anything was
        running. A cell's ``session.run()`` is ended by interrupting the kernel instead."""
        return self._owner.request_stop(where)

    def hold(self, description: str, *, started_by: str | None = None, how_to_stop: str | None = None,
             steps: int | None = None, stoppable: bool = False):
        """A context manager that holds the session for this thread while several calls drive it (the
        dashboard's Run N loop): the thread's own calls nest inside it, another thread's calls raise
        ``grpo_lab.ownership.SessionBusyError`` naming ``description``, ``started_by`` and
        ``how_to_stop`` (by default: the cell, or background thread, that calls). ``steps``: the
        optimizer steps it will run, for "step 3 of 10" in that message; ``stoppable``: the loop reads
        ``session.activity.stop_request``, so the dashboard's Stop buttons turn on. Every stage,
        ``step()``, ``run()``, ``evaluate()``, ``save()`` and ``discard_batch()`` holds the session this way."""
        return self._owner.hold(description, started_by=started_by, how_to_stop=how_to_stop, steps=steps,
                                stoppable=stoppable)

    def on(self, callback: Callable[[str, object], None]) -> Callable[[], None]:
        """Call ``callback(event, payload)`` after every stage and when the session turns busy or idle;
        returns a function that unsubscribes.

        Events: a stage's name (``"generate"``, ``"score"``, ``"advantages"``, ``"loss"``,
        ``"update"``) with its result; ``"busy"`` with an :class:`grpo_lab.ownership.Activity` when a
        caller starts driving the session (once per outermost call: ``run(3)`` is one, not one per
        stage), ``"idle"`` with None when it ends, error or interrupt included, ``"evaluate"`` with
        the metrics of each ``evaluate()``, ``"undo"`` with the step ``undo()`` returned to,
        ``"fork"`` with each new fork and ``"finding"`` with each live finding (after its step's
        ``"update"``). A callback that wants stages only compares the name, as the views do."""
        self._listeners.append(callback)

        def unsubscribe() -> None:
            if callback in self._listeners:
                self._listeners.remove(callback)

        return unsubscribe

    def _emit(self, stage: str, result) -> None:
        self._last_stage = stage
        self._stages_run += 1
        if stage == "update":
            self._take_snapshot()
        self._notify(stage, result)

    def random_state(self) -> dict:
        """This session's random states (Python, numpy, torch, CUDA), which its stages draw from: the
        process's while a stage runs or before the first, else the session's own, kept when its last
        call ended (another session's stages in between do not move it)."""
        return rng_state() if self._rng_held or self._rng is None else copy.deepcopy(self._rng)

    def _notify(self, event: str, payload) -> None:
        for listener in list(self._listeners):
            listener(event, payload)

    def _sync_config(self) -> None:
        """Validate edits to ``session.config``, apply them and record the step at which each took effect
        (each field's rule: :mod:`grpo_lab.live_config`)."""
        if self.config.to_dict() == self._applied_config:
            return
        changed = apply_edits(self.config, self._applied_config, self.engine)
        for name, (old, new) in changed.items():
            self._record_change(name, old, new)
        self._applied_config = self.config.to_dict()

    def _record_change(self, name: str, old, new) -> None:
        """Add an edit to ``config_changes``, or, where no stage has run since the field's last
        change (the stage that would have used it failed, or none was called), replace that change:
        the record holds the values stages ran with."""
        earlier, stages = self._unused_changes.get(name, (None, -1))
        if earlier is not None and stages == self._stages_run and earlier in self.config_changes:
            self.config_changes.remove(earlier)
            old = earlier["old"]
        if old == new:
            self._unused_changes.pop(name, None)
            return
        change = {"step": self.global_step + 1, "field": name, "old": old, "new": new}
        self.config_changes.append(change)
        self._unused_changes[name] = (change, self._stages_run)

    # ------------------------------------------------------------------ stages
    @drives_stages
    def generate(self) -> Rollout:
        """Sample ``num_generations`` completions for each prompt of the next generation batch."""
        check_stage_order(self, "generate")
        self._sync_config()
        self._step_started = time.perf_counter()
        engine = self.engine
        before = rng_state(), engine.sampler.state_dict(), engine.num_input_tokens_seen
        try:
            self.rollout = engine.generate()
        except BaseException:  # an interrupt or error anywhere in it: the next generate() draws the same batch
            set_rng_state(before[0])
            engine.sampler.load_state_dict(before[1])
            engine.num_input_tokens_seen = before[2]
            raise
        self._emit("generate", self.rollout)
        return self.rollout

    def sample(self, prompts: list, max_new_tokens: int | None = None) -> dict[str, list]:
        """One completion per prompt, sampled by the run's generation backend with its sampling
        settings: the building block of a rollout function (``rollout_func``), e.g. for a turn after
        a tool's answer. A prompt is a text, chat messages (rendered with the chat template) or a
        list of token ids (kept as given, so that a multi-turn context is never re-tokenized).

        Returns ``{"prompt_ids", "completion_ids", "logprobs", "texts"}``, lists with one entry per
        prompt: token ids without padding (a completion ends with its EOS unless truncated at
        ``max_new_tokens``, by default and at most max_completion_length), the log-probs the tokens
        were sampled with (vLLM; None with transformers) and the completions decoded without special
        tokens. Draws from the random
        generator as generate() does; no optimizer state changes.
        """
        from grpo_lab.rollout.sampling import sample_prompts

        self._sync_config()
        return sample_prompts(self, prompts, max_new_tokens)

    @drives_stages
    def score(self) -> Scores:
        """Run the reward functions; may be called again after changing ``session.reward_funcs``."""
        check_stage_order(self, "score")
        self._sync_config()
        self.scores = self.engine.score(self.rollout)
        self.advantages_result = self.loss_result = None
        self._emit("score", self.scores)
        return self.scores

    @drives_stages
    def advantages(self) -> Advantages:
        """Group-relative advantages; may be recomputed after changing scale_rewards or weights."""
        check_stage_order(self, "advantages")
        self._sync_config()
        self.advantages_result = self.engine.advantages(self.scores)
        self.loss_result = None
        self._emit("advantages", self.advantages_result)
        return self.advantages_result

    @drives_stages
    def loss(self) -> LossResult:
        """Loss and gradients of the next optimizer step; may be recomputed before update()."""
        check_stage_order(self, "loss")
        self._sync_config()
        self.loss_result = self.engine.loss(self.advantages_result, self.batch_step)
        self._emit("loss", self.loss_result)
        return self.loss_result

    @drives_stages
    def update(self) -> dict[str, float]:
        """Optimizer step; returns the step's metrics (also appended to ``history``)."""
        check_stage_order(self, "update")
        self._sync_config()
        row = None
        try:
            with deferred_interrupts():  # the optimizer, scheduler, counters and history move together
                row = self._update()
                self.engine.publish_weights()  # last: if it fails, the step is recorded and generate() retries it
        finally:  # outside the block: a view's callback must not hold up an interrupt
            if row is not None:
                self._emit("update", row)
                self._diagnose_step()  # after the views' update: a finding is shown beside the step it read
        return row

    def _update(self) -> dict[str, float]:
        update = self.engine.update()
        if update["update_skipped"]:
            notices.warn(
                f"Step {self.global_step}: the gradient is not finite (loss {self.loss_result.loss}); the "
                "update was skipped and the weights are unchanged.",
            )
        total = self.engine.total_steps()
        if self.global_step == total + 1:
            notices.warn(
                f"Step {self.global_step} is past the end of the run (max_steps / num_train_epochs: {total} steps), "
                f"where the {self.config.lr_scheduler_type!r} learning-rate schedule has ended (the rate is now "
                f"{self.engine.optimizer.param_groups[0]['lr']:.3g}). Raise session.config.max_steps to train on "
                "with a schedule.",
            )
        row = {"step": self.global_step, **self.advantages_result.metrics, **self.loss_result.metrics, **update}
        if self._step_started is not None:
            row["step_time"] = time.perf_counter() - self._step_started
        self._history.append(row)
        if self.batch_step == 0:
            self._completion_log.append(log_entry(self.advantages_result, self.global_step))
        # The views show the trained batch (tokens, rewards, advantages) after discard_batch() drops it.
        self.last_trained = self.loss_result
        self.loss_result = None
        self.batch_step += 1
        if self.batch_step >= self.engine.steps_per_batch:
            self.discard_batch()
        self._step_started = time.perf_counter()
        return row

    @drives_stages
    def discard_batch(self) -> None:
        """Drop the current generation batch; the next stage becomes generate()."""
        self.rollout = self.scores = self.advantages_result = self.loss_result = None
        self.batch_step = 0

    @drives_stages
    def evaluate(self, dataset=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Reward, length and loss metrics of ``num_generations_eval`` completions per prompt of the eval
        set (or of ``dataset``; a dict of named sets is reported set by set), as TRL names them
        (``eval_reward``, ``eval_loss``...). The training run is left exactly as it was."""
        metrics = self.engine.evaluate(dataset, metric_key_prefix=metric_key_prefix)
        self._evaluations.append({"step": self.global_step, **metrics})
        self._notify("evaluate", metrics)
        return metrics

    def __repr__(self) -> str:
        return (
            f"GRPOSession(step={self.global_step}, next_stage={self.next_stage!r}, "
            f"loss_type={self.config.loss_type!r}, num_generations={self.config.num_generations}, "
            f"generation={self.engine.rollout_backend.name!r})"
        )

    def close(self) -> None:
        """Release the generation backend (a colocated vLLM engine keeps its memory until then), and
        return to the kernel the free memory ``keep_freed_cpu_memory`` kept."""
        self.engine.close()

