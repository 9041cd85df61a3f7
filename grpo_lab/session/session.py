"""GRPOSession: step through GRPO one stage at a time, on the real trainer core.

The session is a small state machine over :class:`grpo_lab.core.engine.Engine`::

    generate -> score -> advantages -> loss -> update   (one optimizer step)

``score()``, ``advantages()`` and ``loss()`` may be called again before ``update()`` (after editing
reward functions or settings) without regenerating. When a generation batch feeds several optimizer
steps (``num_iterations > 1`` or ``steps_per_generation > gradient_accumulation_steps``), the stage
after ``update()`` is ``loss()`` again until the batch is used up. Views subscribe with
``session.on(callback)``; this module never imports widget code.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import torch

from grpo_lab import notices
from grpo_lab.session import files as session_files, loops as session_loops
from grpo_lab.config.grpo_config import GRPOConfig
from grpo_lab.doctor import Findings
from grpo_lab.session.probe import diagnose
from grpo_lab.core.engine import Engine
from grpo_lab.interrupts import deferred_interrupts
from grpo_lab.config.live import apply_edits
from grpo_lab.session.ownership import Activity, OwnerGuard
from grpo_lab.rollout.environments import user_reward_funcs
from grpo_lab.session.run_record import RunRecord
from grpo_lab.session.findings import FindingsRecord
from grpo_lab.session.experiments import Snapshot, UndoRing, apply_fork_edits, check_forkable, model_copy
from grpo_lab.session.experiments import what_if as run_what_if
from grpo_lab.session.rewards import RewardSwaps, log_entry, shown_columns
from grpo_lab.session.rewards import try_rewards as run_try_rewards
from grpo_lab.session.stages import (
    RANDOM_STATE_LOCK, STAGES, OwnRandomState, StageOrderError, StepClock, call_text, check_stage_order,
    run_next_stage,
)
from grpo_lab.state.run_state import rng_state, session_state_dict, load_session_state_dict, set_rng_state
from grpo_lab.types import Advantages, LossResult, Rollout, RunSummary, Scores

__all__ = ["GRPOSession", "STAGES", "StageOrderError"]


class GRPOSession:
    """Stateful, stage-by-stage GRPO. Same arguments as :class:`grpo_lab.GRPOTrainer`.

    A session composes its parts, each owning its state: ``engine`` (the trainer core: model,
    optimizer, generation, rewards), ``record`` (:class:`grpo_lab.session.run_record.RunRecord`: history,
    evaluations, completion log, config edits), the batch in hand (``rollout``, ``scores``,
    ``advantages_result``, ``loss_result``, ``batch_step``), ``undo_ring`` (undo points),
    ``findings_record`` (the doctor's findings), ``own_random`` (the random state its stages draw
    from) and the guard that lets one thread drive it at a time."""

    undo_by_default: bool = True
    """Whether ``undo_steps=None`` keeps undo points; a ``GRPOTrainer`` turns it off for its session."""

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
            built_state = rng_state()  # the session's own from here: another session run before its first
            # call would otherwise move the process's generators it starts from
        self.engine.rollout_owner = self
        self.config = self.engine.config
        self.record = RunRecord(self.config.to_dict())
        self.rollout: Rollout | None = None
        self.scores: Scores | None = None
        self.advantages_result: Advantages | None = None
        self.loss_result: LossResult | None = None
        self.batch_step = 0
        self.last_trained: LossResult | None = None  # the loss() result of the latest update(), for the views
        self.undo_ring = UndoRing()
        self.findings_record = FindingsRecord()
        self.reward_swaps = RewardSwaps()
        self.own_random = OwnRandomState(built_state)
        self.name: str | None = None
        self.fork_point: int | None = None  # the parent's global step a fork started from
        self.branches: list[GRPOSession] = []
        self.made_with_optimizers = any(part is not None for part in optimizers)  # a fork cannot copy them
        self._given_reward_processing_classes = reward_processing_classes  # what a fork is built with
        self._listeners: list[Callable[[str, object], None]] = []
        self.step_clock = StepClock()
        self._owner = OwnerGuard(self._notify)  # one thread drives the stages at a time

    # ------------------------------------------------------------------ public state
    @property
    def model(self):
        return self.engine.unwrapped_model

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def processing_class(self):
        """The tokenizer, or a vision-language model's processor (what the run renders prompts with)."""
        return self.engine.processing_class

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
        self.engine.set_reward_functions(*prepare_reward_funcs(
            *reward_sources(funcs, None, environments), self.config.model_kwargs(),
            columns=self.engine.reward_columns()))

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
        return pd.DataFrame(self.record.history)

    @property
    def evaluations(self) -> pd.DataFrame:
        """One row per ``evaluate()`` (called, or run by ``eval_strategy="steps"`` in ``run``, ``arun``
        and Run N): the optimizer step it evaluated after, and its ``eval_...`` metrics."""
        return pd.DataFrame(self.record.evaluations)

    @property
    def last_metrics(self) -> dict:
        """The metrics of the last optimizer step, as ``step()`` returned them (empty before the first)."""
        history = self.record.history
        return dict(history[-1]) if history else {}

    @property
    def completions_log(self) -> pd.DataFrame:
        """Every scored completion of every step: step, prompt, completion, rewards, advantage."""
        frames = [pd.DataFrame(shown_columns(columns)) for columns in self.record.completion_log]
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()

    @property
    def config_changes(self) -> list[dict]:
        """Every edit of ``config`` (and ``use_rewards``) in the order made: ``{"step", "field", "old",
        "new"}``, ``step`` being the optimizer step it took effect at."""
        return self.record.config_changes

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
        ``grpo_lab.session.ownership.SessionBusyError`` naming ``description``, ``started_by`` and
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
        ``"update"``) with its result; ``"busy"`` with an :class:`grpo_lab.session.ownership.Activity` when a
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
        self._finish_stage(stage)
        self._notify(stage, result)

    def _finish_stage(self, stage: str) -> None:
        """Record ``stage`` as run; after ``update()``, keep the undo point of the new step."""
        self.record.stage_done(stage)
        if stage == "update":
            self.undo_ring.keep(self)

    def random_state(self) -> dict:
        """This session's random states (Python, numpy, torch, CUDA), which its stages draw from: the
        process's while a stage runs or before the first, else the session's own, kept when its last
        call ended (another session's stages in between do not move it)."""
        return self.own_random.current()

    def _notify(self, event: str, payload) -> None:
        for listener in list(self._listeners):
            listener(event, payload)

    @contextlib.contextmanager
    def _driving(self, name: str, *args, **kwargs):
        """Run a call that drives the session (``name`` and its arguments, for messages) under the
        owner guard (:mod:`grpo_lab.session.ownership`): the thread that holds the session may nest calls;
        another thread's call raises SessionBusyError at once. The outermost call swaps in the
        session's own random state and keeps it when it ends (:class:`grpo_lab.session.stages.OwnRandomState`)."""
        now = f"stage {name}()" if name in STAGES else None
        grad_mode = torch.is_grad_enabled()
        try:
            with self._owner.hold(call_text(name, args, kwargs), now=now, finishes_step=name == "update"), \
                    self.own_random.drawing(), self.step_clock.timing() if now else contextlib.nullcontext():
                yield
        finally:  # an interrupt inside torch.no_grad()'s own entry or exit would leave it off process-wide
            torch.set_grad_enabled(grad_mode)

    def _check_whole(self, call: str) -> None:
        """Refuse ``call`` while a second Ctrl-C has left the state torn (``Engine.torn``): stepping on,
        saving, forking or trying settings from it would carry weights, optimizer, schedule and step
        counter that may not agree."""
        if self.engine.torn is None:
            return
        raise RuntimeError(
            f"{call} cannot run now: a second Ctrl-C stopped {self.engine.torn} midway, so the weights, optimizer, "
            "schedule and step counter may not agree. Return to a whole state first: session.undo(n) back to an "
            "undo point kept before it (none are kept with undo_steps=0), or GRPOSession.load(<a checkpoint saved "
            "before it>); then go on."
        )

    def _start_stage(self, stage: str) -> None:
        """What every stage does first: refuse it out of order, keep the undo point of the run's start
        (before the first stage), and apply the config edits made since the last stage."""
        self._check_whole(f"{stage}()")
        check_stage_order(self, stage)
        self.undo_ring.keep_start(self)
        self.apply_config_edits()

    def apply_config_edits(self) -> None:
        """Validate the edits made to ``session.config`` since the last stage, apply them and record
        the step at which each takes effect (each field's rule: :mod:`grpo_lab.config.live`). Every
        stage does this first; call it to have an edit checked at once."""
        record = self.record
        if self.config.to_dict() == record.applied_config:
            return
        changed = apply_edits(self.config, record.applied_config, self.engine)
        for name, (old, new) in changed.items():
            record.record_change(name, old, new, self.global_step + 1)
        record.applied_config = self.config.to_dict()

    # ------------------------------------------------------------------ stages
    def generate(self) -> Rollout:
        """Sample ``num_generations`` completions for each prompt of the next generation batch."""
        with self._driving("generate"):
            self._start_stage("generate")
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

        self.apply_config_edits()
        return sample_prompts(self, prompts, max_new_tokens)

    def score(self) -> Scores:
        """Run the reward functions; may be called again after changing ``session.reward_funcs``."""
        with self._driving("score"):
            self._start_stage("score")
            self.scores = self.engine.score(self.rollout)
            self.advantages_result = self.loss_result = None
            self._emit("score", self.scores)
            return self.scores

    def advantages(self) -> Advantages:
        """Group-relative advantages; may be recomputed after changing scale_rewards or weights."""
        with self._driving("advantages"):
            self._start_stage("advantages")
            self.advantages_result = self.engine.advantages(self.scores)
            self.loss_result = None
            self._emit("advantages", self.advantages_result)
            return self.advantages_result

    def loss(self) -> LossResult:
        """Loss and gradients of the next optimizer step; may be recomputed before update()."""
        with self._driving("loss"):
            self._start_stage("loss")
            self.loss_result = self.engine.loss(self.advantages_result, self.batch_step)
            self._emit("loss", self.loss_result)
            return self.loss_result

    def update(self) -> dict[str, float]:
        """Optimizer step; returns the step's metrics (also appended to ``history``)."""
        with self._driving("update"):
            self._start_stage("update")
            row = None
            moving = ["the optimizer step"]  # what a second Ctrl-C would leave half done
            try:
                # the optimizer, scheduler, counters, history and the undo point move together
                with deferred_interrupts(torn=lambda: self.engine.mark_torn(moving[0])):
                    row = self._update()
                    try:  # last: if it fails, the step is recorded and generate() retries it
                        moving[0] = "the hand-over of the new weights to the generation backend"
                        self.engine.publish_weights()
                    finally:
                        moving[0] = "keeping the undo point of the step"
                        self._finish_stage("update")
            finally:  # outside the block: a view's callback must not hold up an interrupt
                if row is not None:
                    self._notify("update", row)
                    self._read_live_findings()  # after the views' update: a finding is shown beside the step it read
            return row

    def step(self) -> dict[str, float]:
        """Run what is left of the current iteration, up to and including update():
        generate -> score -> advantages -> loss -> update, from the stage the batch needs next."""
        with self._driving("step"):
            while True:
                stage, result = run_next_stage(self)
                if stage == "update":
                    return result

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
        row["step_time"] = self.step_clock.step_time()
        self.record.history.append(row)
        if self.batch_step == 0:
            self.record.completion_log.append(log_entry(self.advantages_result, self.global_step))
        # The views show the trained batch (tokens, rewards, advantages) after discard_batch() drops it.
        self.last_trained = self.loss_result
        self.loss_result = None
        self.batch_step += 1
        if self.batch_step >= self.engine.steps_per_batch:
            self.discard_batch()
        return row

    def _read_live_findings(self) -> None:
        """Read the live doctor rules after an optimizer step and announce each new finding."""
        for finding in self.findings_record.read_step(self.record.history, self.config):
            self._notify("finding", finding)

    def discard_batch(self) -> None:
        """Drop the current generation batch; the next stage becomes generate()."""
        with self._driving("discard_batch"):
            self.rollout = self.scores = self.advantages_result = self.loss_result = None
            self.batch_step = 0

    def evaluate(self, dataset=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Reward, length and loss metrics of ``num_generations_eval`` completions per prompt of the eval
        set (or of ``dataset``; a dict of named sets is reported set by set), as TRL names them
        (``eval_reward``, ``eval_loss``...). The training run is left exactly as it was."""
        with self._driving("evaluate", *(() if dataset is None else (dataset,))):
            metrics = self.engine.evaluate(dataset, metric_key_prefix=metric_key_prefix)
            self.record.evaluations.append({"step": self.global_step, **metrics})
            self._notify("evaluate", metrics)
            return metrics

    # ------------------------------------------------------------------ loops
    def run(self, n: int, *, progress: bool = True) -> RunSummary:
        """Run ``n`` optimizer steps; Ctrl-C (interrupting the kernel) ends cleanly between stages, nothing lost.
        With ``eval_strategy="steps"`` it evaluates as the trainer does (``session.evaluations``).

        In a notebook, ``await session.arun(n)`` does the same while the page stays answered. Returns a
        :class:`~grpo_lab.types.RunSummary` (how the headline metrics moved; every metric in
        ``session.history``)."""
        return session_loops.run(self, n, progress=progress)

    async def arun(self, n: int, *, progress: bool = True) -> RunSummary:
        """``run(n)`` to ``await`` in a notebook cell (``await session.arun(20)``): the steps run on a
        worker thread while the cell awaits, so the kernel keeps answering the page: a reloaded page
        gets its live views back at once, and the dashboard's Stop (between stages) and Finish step
        (after the current update()) end the run. Interrupting the kernel ends it between stages,
        nothing lost, and it returns as ``run`` does (a cancellation does not propagate: the run
        ends cleanly; a stage that never returns is not cut short). Returns the
        :class:`~grpo_lab.types.RunSummary` of the steps it ran, as ``run`` does."""
        return await session_loops.arun(self, n, progress=progress)

    # ------------------------------------------------------------------ state and files
    def state_dict(self) -> dict:
        """Copies of everything this session needs to continue exactly as it would from here:
        weights (or adapter), optimizer, scheduler, random states, sampler position, the half-used
        batch, history and config (see :mod:`grpo_lab.state.run_state`). Training on leaves it unchanged."""
        return session_state_dict(self)

    def load_state_dict(self, state: dict) -> None:
        """Return to ``state`` from :meth:`state_dict` of this session (or one built like it); a loss()
        not yet used by update() is dropped, so the next stage is what the saved batch needs next.
        Undo points taken before it are dropped (``undo`` returns within the loaded run)."""
        with self._driving("load_state_dict"):
            load_session_state_dict(self, state)
            self.undo_ring.forget()

    def save(self, path, *, overwrite: bool = False, trainer_state: str | None = None) -> Path:
        """Write weights (or adapter), optimizer, scheduler, random states, sampler position,
        history, config and any half-finished stage results to ``path``, atomically. Config edits
        made since the last stage are validated first, as the next stage would.

        ``path`` must be new, empty, or an earlier save, which is replaced (the old one stays until
        the new one is complete). A file, or a directory holding anything else, is refused, unless
        ``overwrite=True``, which replaces that directory and everything in it.

        Under ``accelerate launch`` every process calls it (as ``GRPOTrainer`` does): each one's
        random state and share of a half-finished batch are gathered, and the main process writes.
        Under FSDP the shards of the weights, the optimizer state and a reference model are gathered
        too: the checkpoint holds the whole model and loads on any number of processes (DeepSpeed ZeRO
        is refused).

        ``trainer_state``: a transformers ``TrainerState`` as JSON, which ``GRPOTrainer`` keeps in its
        checkpoints as ``trainer_state.json``.
        """
        with self._driving("save", path):
            self._check_whole("save()")
            return session_files.save(self, path, overwrite=overwrite, trainer_state=trainer_state)

    @classmethod
    def load(cls, path, *, model=None, reward_funcs=None, train_dataset=None, eval_dataset=None,
             trust_remote_code: bool = False, **kwargs) -> GRPOSession:
        """Rebuild a saved session; it continues exactly as the original would have.

        Datasets, (importable) reward functions and the config (``args``) come from the checkpoint
        unless given; other keyword arguments go to the constructor. ``model``: a model built like the
        saved one (a PEFT model for a saved adapter) to load the saved weights into, in place of a new
        one, e.g. the model whose parameters an optimizer passed in ``optimizers=`` holds.

        Loading runs no code from the checkpoint: its state is read without unpickling anything but
        tensors and numbers, functions are imported by module and name, and a saved
        ``trust_remote_code`` is ignored unless ``trust_remote_code=True`` is passed here (or in ``args``).
        """
        return session_files.load(cls, path, model=model, reward_funcs=reward_funcs, train_dataset=train_dataset,
                                  eval_dataset=eval_dataset, trust_remote_code=trust_remote_code, kwargs=kwargs)

    # ------------------------------------------------------------------ views
    def show(self):
        """The live dashboard: stage controls, curves, completions and rewards."""
        from grpo_lab.views.dashboard import Dashboard

        return Dashboard(self)

    def completions_view(self):
        """The current batch (or the last trained one) by prompt group, tokens coloured by probability,
        entropy, A x ratio, clipping or (with vLLM) the trainer/vLLM log-prob gap."""
        from grpo_lab.views.completions import CompletionsView

        return CompletionsView(self)

    def rewards_view(self):
        """Per reward function statistics, pass rates, correlations, reward strips per group, the
        advantage histogram and logged extras of the batch shown (marked when older than the session's)."""
        from grpo_lab.views.rewards import RewardsView

        return RewardsView(self)

    def curves(self):
        """Training curves, redrawn from the whole history after every update()."""
        from grpo_lab.views.curves import CurvesView

        return CurvesView(self)

    def controls(self):
        """Buttons for each stage, Step, and Run N with Stop."""
        from grpo_lab.views.controls import Controls

        return Controls(self)

    def export_script(self, path) -> Path:
        """Write a standalone training script with this session's current config, model reference,
        datasets (saved beside it) and reward functions (their source, or an import where a module
        defines them); see :mod:`grpo_lab.export`."""
        from grpo_lab.export import export_session

        return export_session(self, path)

    # ------------------------------------------------------------------ experiments
    @property
    def snapshots(self) -> list[Snapshot]:
        """The undo points kept (oldest first), each with the memory it holds; ``undo_steps`` bounds them."""
        return list(self.undo_ring.snapshots)

    def undo_steps(self) -> int:
        """The steps undo can return over: 0 under FSDP or DeepSpeed ZeRO (each process holds a shard
        of the state) or after a snapshot failed; else ``config.undo_steps``, or where that is None:
        0 in a ``GRPOTrainer`` (a script does not undo), 2 if a snapshot (the trainable weights and two
        optimizer moments) takes at most ``grpo_lab.session.experiments.DEFAULT_UNDO_BUDGET`` bytes, else 0."""
        return self.undo_ring.steps(self)

    def undo(self, n: int = 1) -> int:
        """Return to the state n optimizer steps back: weights (or adapter), optimizer, scheduler,
        random states, sampler position, the pending batch, history and config. Stages run since the
        last step count as the first of the n: ``undo()`` after ``generate()`` drops that batch.
        Returns the global step it returned to. Later undo points are dropped."""
        with self._driving("undo", n):
            step = self.undo_ring.undo(self, n)
            self._notify("undo", step)
            self.reward_swaps.after_undo(self, step)
            return step

    def fork(self, name: str | None = None, **config_edits) -> GRPOSession:
        """An independent session from this one's state, with ``config_edits`` applied as edits to
        its ``config`` (the same rules as editing ``session.config``). Stepped without edits, it
        produces the history and weights this session would. The model is copied (a LoRA model's
        adapter only); reward functions, datasets, tokenizer and tools are shared. The fork is listed
        in ``branches``; its ``fork_point`` is this session's step now."""
        self._check_whole("fork()")
        check_forkable(self)
        name = name or f"{self.name or 'session'}-{len(self.branches) + 1}"
        with self._owner.hold(f"session.fork({name!r})"), RANDOM_STATE_LOCK:
            self.apply_config_edits()
            engine = self.engine
            model = model_copy(engine.unwrapped_model, what=f"session {self.name or ''}".strip(),
                               reference=engine.ref_model)
            state = session_state_dict(self)
            fork = type(self)(
                model, user_reward_funcs(engine), args=copy.deepcopy(self.config), train_dataset=engine.train_dataset,
                eval_dataset=engine.eval_dataset, processing_class=engine.processing_class,
                rollout_func=engine.rollout_func,
                tools=engine.tools, environment_factory=self.environment_factory,
                reward_processing_classes=self._given_reward_processing_classes,
            )
            fork.load_state_dict(state)  # the random state included: the fork draws what this session would
            self.own_random.adopt(state["rng"])  # building the fork drew from the global one
        apply_fork_edits(fork, config_edits)
        fork.name, fork.fork_point = name, self.global_step
        self.branches.append(fork)
        self._notify("fork", fork)
        return fork

    def what_if(self, cases: list[dict] | None = None, /, *, lookahead: bool = False, **settings):
        """The advantages, loss, gradient and loss metrics each setting would give the scored batch,
        and which settings' gradients are equal; the session is left exactly as it was.

        ``session.what_if(loss_type=["dapo", "grpo"], epsilon=[0.2, 0.28])`` tries every combination
        of the lists; ``session.what_if([{"loss_type": "cispo", "epsilon_high": 5.0}, {...}])`` each
        dict. Fields: those the advantages and loss read (``grpo_lab.session.what_if.WHAT_IF_FIELDS``); the
        other fields stay as the session has them. Needs a scored batch (after ``score()``).

        ``lookahead=True``: for each setting, also take the optimizer step its gradient gives and
        report how the log-probability of the positive- and negative-advantage completions moves
        and the KL to the current policy (``lookahead/...`` columns); the weights, optimizer and
        scheduler are put back after each. Returns a :class:`grpo_lab.session.what_if.WhatIf`."""
        with self._driving("what_if"):
            self._check_whole("what_if()")
            return run_what_if(self, cases, settings, lookahead=lookahead)

    # ------------------------------------------------------------------ doctor
    def doctor(self) -> Findings:
        """Run one probe generation batch through generate, score, advantages and one loss pass (no
        update), and return what in it would keep the run from learning: truncated completions,
        reward functions that give no signal, prompt groups too easy or too hard, a chat template or
        EOS token that is wrong, compute spent on zero advantages, a memory shortfall, a vLLM
        log-prob gap; and what the loss will show (``Findings``, most severe first; each with its
        cause, evidence and fix). The rules compare with the thresholds of
        ``config.doctor_thresholds`` (their defaults: docs/troubleshooting.md, "Thresholds").

        The session is left as it was: weights, gradients, optimizer, random states, the sampler's
        position, a half-used batch (and a pending loss()), history and config. Config edits made
        since the last stage are applied first, as the next stage would. With no batch held, the
        probe is the batch the next ``generate()`` will draw. The result is kept in ``findings``.
        Collective: under several processes every process must call it (its stages gather).
        """
        with self._driving("doctor"):
            self.apply_config_edits()
            self.findings_record.preflight = diagnose(self.engine)
            return self.findings_record.preflight

    @property
    def findings(self) -> Findings:
        """The last ``doctor()``'s findings and every live finding raised since the session was built
        (each with the step in its evidence), most severe first; a later ``doctor()`` replaces its
        own part only. Empty before either; ``doctor()``'s very result while no live finding is raised."""
        return self.findings_record.all()

    @property
    def live_findings(self) -> list:
        """The live findings raised since the session was built, in the order raised (those of steps an
        ``undo()`` took back are gone; a checkpoint keeps them)."""
        return list(self.findings_record.live)

    # ------------------------------------------------------------------ rewards
    def try_rewards(self, funcs, on: str = "batch", weights: list[float] | None = None, *, k: int = 5):
        """Score completions already generated with the reward functions ``funcs`` (one, or a list)
        and compare them with the current rewards; nothing in the session changes (weights, random
        state, batch, history, reward functions).

        ``on="batch"``: the held batch (generated, or scored: only a scored one has current rewards
        to compare with); ``on="history"``: every completion logged so far (``completions_log``,
        each batch as it was first trained; see :mod:`grpo_lab.session.rewards` for what is kept).
        The functions are called as training calls them (``grpo_lab.rewards.score_completions``,
        TRL's keyword arguments, one call per batch, ``trainer_state`` at the batch's step) and the
        advantages come from the engine's advantage function with the session's config.
        ``weights``: one per function, for their weighted ``total`` (what ``use_rewards(funcs,
        weights)`` would train on). ``k``: the completions to show per function where the new and
        the current rewards rank them most differently. Returns a
        :class:`grpo_lab.session.reward_trial.RewardTrial` (``to_pandas()``, ``completions``,
        ``disagreements``, ``figure()``)."""
        with self._driving("try_rewards"):
            return run_try_rewards(self, funcs, on, weights, k)

    def use_rewards(self, funcs, weights: list[float] | None = None) -> None:
        """Make ``funcs`` (one, or a list) the session's reward functions, weighted by ``weights`` (one
        per function; None: 1 each), in one edit recorded in ``config_changes`` as ``reward_funcs``
        (old and new: the functions' names) and ``reward_weights``, from the next optimizer step, as
        a config edit is; the dashboard marks it on the curves. A held batch not trained on yet is
        scored again (its scores are dropped: the next stage is score()); a half-used batch keeps
        its rewards. Refused, with nothing changed, where a function cannot be called as training
        calls it or the weights do not match. An environment's ``get_reward`` stays, last. ``undo()``
        to before this call puts back the config (``reward_weights`` included) and its record but not
        the functions, which no saved state holds: it warns, naming the functions of the step it
        returned to and the two fixes (``use_rewards`` with them again, or ``reward_weights`` set for
        the functions kept; with a different number of functions the next ``advantages()`` refuses
        the weights until then)."""
        with self._driving("use_rewards"):
            self.reward_swaps.use_rewards(self, funcs, weights)

    def __repr__(self) -> str:
        named = f"name={self.name!r}, " if self.name else ""  # forks in session.branches told apart
        return (
            f"GRPOSession({named}step={self.global_step}, next_stage={self.next_stage!r}, "
            f"loss_type={self.config.loss_type!r}, num_generations={self.config.num_generations}, "
            f"generation={self.engine.rollout_backend.name!r})"
        )

    def close(self) -> None:
        """Release the generation backend (a colocated vLLM engine keeps its memory until then), and
        return to the kernel the free memory ``keep_freed_cpu_memory`` kept."""
        self.engine.close()

