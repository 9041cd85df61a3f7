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
import functools
import numbers
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from grpo_lab import notices
from grpo_lab.checkpoint import (
    MODEL_DIR,
    SAVE_ENTRIES,
    check_save_target,
    load_saved_weights,
    load_state,
    own_process_state,
    per_process_states,
    plain_values,
    restore_engine,
    safe_batch,
    save_engine,
)
from grpo_lab.config import GRPOConfig
from grpo_lab.dist import (
    check_savable, full_model_state, full_optimizer_state, full_state, gather_to_main, launched_processes, on_main,
)
from grpo_lab.engine import Engine
from grpo_lab.interrupts import deferred_interrupts
from grpo_lab.live_config import apply_edits, rebuilt_fields
from grpo_lab.models import cast_lm_head_to_fp32, load_causal_lm, load_tokenizer
from grpo_lab.ownership import Activity, OwnerGuard
from grpo_lab.safe_write import atomic_directory_write
from grpo_lab.state import load_session_state_dict, on_device, rng_state, session_state_dict, set_rng_state
from grpo_lab.types import Advantages, LossResult, Rollout, Scores

STAGES = ("generate", "score", "advantages", "loss", "update")



class StageOrderError(RuntimeError):
    """A stage was called before the stage it depends on."""


def _drives_stages(method):
    """Run a session method under the session's owner guard (:mod:`grpo_lab.ownership`): the thread
    that holds the session may nest calls; another thread's call raises SessionBusyError at once."""
    name = method.__name__
    now = f"stage {name}()" if name in STAGES else None

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._owner.hold(_call_text(name, args, kwargs), now=now, finishes_step=name == "update"):
            return method(self, *args, **kwargs)

    return wrapper


def _call_text(name: str, args: tuple, kwargs: dict) -> str:
    """``session.save('run/step-3')``, for messages: an argument too long for one line shows as ``...``."""
    def short(value) -> str:
        text = repr(value)
        return text if len(text) <= 40 and "\n" not in text else "..."

    return f"session.{name}({', '.join([short(a) for a in args] + [f'{k}={short(v)}' for k, v in kwargs.items()])})"


class GRPOSession:
    """Stateful, stage-by-stage GRPO. Same arguments as :class:`grpo_lab.GRPOTrainer`."""

    def __init__(
        self,
        model,
        reward_funcs,
        args: GRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        peft_config=None,
        optimizers=(None, None),
        rollout_func=None,
        tools=None,
    ):
        self.engine = Engine(
            model, reward_funcs, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
            processing_class=processing_class, reward_processing_classes=reward_processing_classes,
            peft_config=peft_config, optimizers=optimizers, rollout_func=rollout_func, tools=tools,
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
        self._completion_log: list[dict[str, list]] = []  # columns of each batch's completions
        self._listeners: list[Callable[[str, object], None]] = []
        self._step_started: float | None = None
        self._last_stage: str | None = None
        self._owner = OwnerGuard(self._notify)  # one thread drives the stages at a time
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
        from grpo_lab.rewards import prepare_reward_funcs

        self.engine.reward_funcs, self.engine.reward_processing_classes, self.engine.reward_names = (
            prepare_reward_funcs(funcs, None, self.config.model_kwargs(), columns=self.engine.reward_columns())
        )

    @property
    def rollout_func(self):
        """The function that generates the completions in place of the backend (None: the backend does)."""
        return self.engine.rollout_func

    @property
    def tools(self) -> list | None:
        """The functions the model may call while it generates (None: no tool calling)."""
        return self.engine.tools

    @property
    def global_step(self) -> int:
        return self.engine.global_step

    @property
    def history(self) -> pd.DataFrame:
        """One row per optimizer step, TRL's metric names as columns."""
        return pd.DataFrame(self._history)

    @property
    def last_metrics(self) -> dict:
        """The metrics of the last optimizer step, as ``step()`` returned them (empty before the first)."""
        return dict(self._history[-1]) if self._history else {}

    @property
    def completions_log(self) -> pd.DataFrame:
        """Every scored completion of every step: step, prompt, completion, rewards, advantage."""
        frames = [pd.DataFrame(columns) for columns in self._completion_log]
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
        """Ask what drives the session from another thread (the dashboard's Run N) to end: ``"stage"``
        between two stages, ``"step"`` after the current update(). Returns whether anything was
        running. A cell's ``session.run()`` is ended by interrupting the kernel instead."""
        return self._owner.request_stop(where)

    def hold(self, description: str, *, started_by: str | None = None, how_to_stop: str | None = None,
             steps: int | None = None):
        """A context manager that holds the session for this thread while several calls drive it (the
        dashboard's Run N loop): the thread's own calls nest inside it, another thread's calls raise
        ``grpo_lab.ownership.SessionBusyError`` naming ``description``, ``started_by`` and
        ``how_to_stop`` (by default: the cell, or background thread, that calls). ``steps``: the
        optimizer steps it will run, for "step 3 of 10" in that message. Every stage, ``step()``,
        ``run()``, ``evaluate()``, ``save()`` and ``discard_batch()`` holds the session this way."""
        return self._owner.hold(description, started_by=started_by, how_to_stop=how_to_stop, steps=steps)

    def on(self, callback: Callable[[str, object], None]) -> Callable[[], None]:
        """Call ``callback(event, payload)`` after every stage and when the session turns busy or idle;
        returns a function that unsubscribes.

        Events: a stage's name (``"generate"``, ``"score"``, ``"advantages"``, ``"loss"``,
        ``"update"``) with its result; ``"busy"`` with an :class:`grpo_lab.ownership.Activity` when a
        caller starts driving the session (once per outermost call: ``run(3)`` is one, not one per
        stage), and ``"idle"`` with None when it ends, error or interrupt included. A callback that
        wants stages only compares the name, as the views do."""
        self._listeners.append(callback)

        def unsubscribe() -> None:
            if callback in self._listeners:
                self._listeners.remove(callback)

        return unsubscribe

    def _emit(self, stage: str, result) -> None:
        self._last_stage = stage
        self._stages_run += 1
        self._notify(stage, result)

    def _notify(self, event: str, payload) -> None:
        for listener in list(self._listeners):
            listener(event, payload)

    def _require(self, stage: str) -> None:
        order = {name: i for i, name in enumerate(STAGES)}
        missing = {"score": self.rollout, "advantages": self.scores, "loss": self.advantages_result}
        if stage in missing and missing[stage] is None:
            needed = STAGES[order[stage] - 1]
            raise StageOrderError(
                f"{stage}() needs the result of {needed}(); the next stage is {self.next_stage}(). "
                f"Call session.{self.next_stage}() first (or session.step() to finish the iteration)."
            )
        if stage == "update" and self.loss_result is None:
            again = " The previous update() already used the last gradients." if self._last_stage == "update" else ""
            raise StageOrderError(
                f"update() needs the gradients of loss().{again} The next stage is {self.next_stage}(): "
                f"call session.{self.next_stage}() first."
            )
        if stage in {"score", "advantages"} and self.batch_step > 0:
            raise StageOrderError(
                f"{stage}() cannot be recomputed after this batch has been trained on "
                f"({self.batch_step} optimizer step(s) used it). Call session.{self.next_stage}()."
            )
        if stage == "generate" and self.rollout is not None:
            raise StageOrderError(
                "generate() would discard the current batch, which still has "
                f"{self.engine.steps_per_batch - self.batch_step} optimizer step(s) to feed. Call "
                f"session.{self.next_stage}(), or session.discard_batch() to drop it."
            )

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
    @_drives_stages
    def generate(self) -> Rollout:
        """Sample ``num_generations`` completions for each prompt of the next generation batch."""
        self._require("generate")
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
        ``max_new_tokens``, by default and at most max_completion_length), the log-probs the tokens were sampled with (vLLM; None with
        transformers) and the completions decoded without special tokens. Draws from the random
        generator as generate() does; no optimizer state changes.
        """
        from grpo_lab.rollout.custom import as_token_ids, outside_vocabulary
        from grpo_lab.rollout.prompts import is_conversational, render_prompts

        self._sync_config()
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("sample() takes a non-empty list of prompts (texts, chat messages or token-id lists).")
        if all(isinstance(p, numbers.Integral) for p in prompts):
            raise ValueError("sample() takes a list of prompts: wrap one prompt's token ids in a list, sample([ids]).")
        as_ids = [None if isinstance(p, str) or is_conversational(p) else as_token_ids(p, allow_empty=False) for p in prompts]
        for index, (prompt, ids) in enumerate(zip(prompts, as_ids, strict=True)):
            if ids is None and not (isinstance(prompt, str) or is_conversational(prompt)):
                raise ValueError(
                    f"sample() takes texts, chat messages or token-id lists (non-empty, ints); prompt {index} is a "
                    f"{type(prompt).__name__}: {str(prompt)[:80]!r}."
                )
            problem = None if ids is None else outside_vocabulary(ids, self.engine.vocab_size())
            if problem is not None:
                raise ValueError(f"sample() got prompt {index}, whose {problem}.")
        if all(ids is not None for ids in as_ids):
            inputs = as_ids
        elif any(ids is not None for ids in as_ids):
            raise ValueError("sample() takes prompts of one kind: all token-id lists, or all texts and chat messages.")
        else:
            inputs = render_prompts(list(prompts), self.tokenizer, self.config.chat_template_kwargs)
        settings = self.config
        if max_new_tokens is not None:
            if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or not 1 <= max_new_tokens <= self.config.max_completion_length:
                raise ValueError(
                    f"max_new_tokens must be an int from 1 to max_completion_length ({self.config.max_completion_length}); "
                    f"got {max_new_tokens!r}."
                )
            settings = copy.copy(self.config)
            settings.max_completion_length = max_new_tokens
        batch = self.engine.rollout_backend.generate(inputs, settings)
        self.engine.check_policy_version(batch)
        prompt_ids = [ids[mask.bool()].tolist() for ids, mask in zip(batch.prompt_ids_BP, batch.prompt_mask_BP, strict=True)]
        kept_BT = batch.completion_mask_BT.bool()
        completion_ids = [ids[mask].tolist() for ids, mask in zip(batch.completion_ids_BT, kept_BT, strict=True)]
        logprobs = None
        if batch.sampling_logprobs_BT is not None:
            logprobs = [values[mask].tolist() for values, mask in zip(batch.sampling_logprobs_BT, kept_BT, strict=True)]
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs, "texts": texts}

    @_drives_stages
    def score(self) -> Scores:
        """Run the reward functions; may be called again after changing ``session.reward_funcs``."""
        self._require("score")
        self._sync_config()
        self.scores = self.engine.score(self.rollout)
        self.advantages_result = self.loss_result = None
        self._emit("score", self.scores)
        return self.scores

    @_drives_stages
    def advantages(self) -> Advantages:
        """Group-relative advantages; may be recomputed after changing scale_rewards or weights."""
        self._require("advantages")
        self._sync_config()
        self.advantages_result = self.engine.advantages(self.scores)
        self.loss_result = None
        self._emit("advantages", self.advantages_result)
        return self.advantages_result

    @_drives_stages
    def loss(self) -> LossResult:
        """Loss and gradients of the next optimizer step; may be recomputed before update()."""
        self._require("loss")
        self._sync_config()
        self.loss_result = self.engine.loss(self.advantages_result, self.batch_step)
        self._emit("loss", self.loss_result)
        return self.loss_result

    @_drives_stages
    def update(self) -> dict[str, float]:
        """Optimizer step; returns the step's metrics (also appended to ``history``)."""
        self._require("update")
        self._sync_config()
        row = None
        try:
            with deferred_interrupts():  # the optimizer, scheduler, counters and history move together
                row = self._update()
                self.engine.publish_weights()  # last: if it fails, the step is recorded and generate() retries it
        finally:  # outside the block: a view's callback must not hold up an interrupt
            if row is not None:
                self._emit("update", row)
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
            columns = self.advantages_result.to_dict()
            self._completion_log.append({"step": [self.global_step] * len(columns["group"]), **columns})
        # The views show the trained batch (tokens, rewards, advantages) after discard_batch() drops it.
        self.last_trained = self.loss_result
        self.loss_result = None
        self.batch_step += 1
        if self.batch_step >= self.engine.steps_per_batch:
            self.discard_batch()
        self._step_started = time.perf_counter()
        return row

    @_drives_stages
    def discard_batch(self) -> None:
        """Drop the current generation batch; the next stage becomes generate()."""
        self.rollout = self.scores = self.advantages_result = self.loss_result = None
        self.batch_step = 0

    @_drives_stages
    def step(self) -> dict[str, float]:
        """Run what is left of the current iteration, up to and including update()."""
        while True:
            stage = self.next_stage
            result = getattr(self, stage)()
            if stage == "update":
                return result

    def run(self, n: int, *, progress: bool = True) -> pd.DataFrame:
        """Run ``n`` optimizer steps; Ctrl-C (interrupting the kernel) ends cleanly between stages, nothing lost."""
        from grpo_lab.progress import progress_bar

        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
            raise ValueError(f"run(n) takes a whole number of optimizer steps >= 0, got {n!r}; e.g. session.run(3).")
        first = len(self._history)
        with self._owner.hold(f"session.run({n})", steps=n), progress_bar(n, enabled=progress) as bar:
            try:
                for _ in range(n):
                    bar.advance(self.step())
            except KeyboardInterrupt:  # an update it reached has finished (the interrupt waits for it)
                bar.note(f"stopped after {len(self._history) - first} step(s); next stage: {self.next_stage}()")
        return pd.DataFrame(self._history[first:])

    @_drives_stages
    def evaluate(self, dataset=None) -> dict[str, float]:
        """Reward metrics of ``num_generations_eval`` completions per prompt of the eval set."""
        return self.engine.evaluate(dataset)

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

    # ------------------------------------------------------------------ views (ipywidgets, imported on demand)
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

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict:
        """Copies of everything this session needs to continue exactly as it would from here:
        weights (or adapter), optimizer, scheduler, random states, sampler position, the half-used
        batch, history and config (see :mod:`grpo_lab.state`). Training on leaves it unchanged."""
        return session_state_dict(self)

    @_drives_stages
    def load_state_dict(self, state: dict) -> None:
        """Return to ``state`` from :meth:`state_dict` of this session (or one built like it); a loss()
        not yet used by update() is dropped, so the next stage is what the saved batch needs next."""
        load_session_state_dict(self, state)

    @_drives_stages
    def save(self, path, *, overwrite: bool = False) -> Path:
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
        """
        self._sync_config()
        engine = self.engine
        accelerator = engine.accelerator
        check_savable(accelerator)
        on_main(accelerator, f"check {path}", lambda: check_save_target(Path(path), overwrite=overwrite))
        pending, unsafe = safe_batch(on_device((self.rollout, self.scores, self.advantages_result), "cpu"))
        if unsafe is not None:
            notices.warn(
                f"The half-used generation batch holds {unsafe} (in its columns or logged extras), which a checkpoint "
                "does not store (loading it would mean unpickling code); the save leaves the batch out, and a run "
                "loaded from it generates a new one. Give reward functions and rollout functions plain values "
                "(numbers, strings, lists, dicts, tensors) to keep it."
            )
            pending = (None, None, None)
        per_process = gather_to_main(accelerator, {"rng": rng_state(), "pending": pending})
        gathered = (  # a sharded (FSDP) model's, optimizer's and reference's whole states, gathered by every process
            full_model_state(accelerator, engine.model, adapter_only=engine.is_peft),
            full_optimizer_state(accelerator, engine.model, engine.optimizer),
            None if engine.ref_model is None else full_state(accelerator, engine.ref_model),
        )
        extra = {
            "history": plain_values(self._history),  # logs: what a checkpoint cannot store is kept as text
            "completion_log": plain_values(self._completion_log),
            "config_changes": plain_values(self.config_changes),
            "applied_config": plain_values(self._applied_config),
            "batch_step": self.batch_step,
            "last_stage": self._last_stage,
            "reward_funcs": _referenced(engine.reward_funcs),
            "rollout_func": _referenced(engine.rollout_func),
            "tools": _referenced(engine.tools),
        }

        def write(directory: Path) -> None:
            from datasets.utils.logging import disable_progress_bar, enable_progress_bar, is_progress_bar_enabled

            save_engine(engine, directory, extra, per_process, gathered)
            shown = is_progress_bar_enabled()
            disable_progress_bar()  # a checkpoint is not worth three progress bars per save
            try:
                engine.train_dataset.save_to_disk(str(directory / "train_dataset"))
                if engine.eval_dataset is not None:
                    engine.eval_dataset.save_to_disk(str(directory / "eval_dataset"))
            finally:
                if shown:
                    enable_progress_bar()

        on_main(accelerator, f"write {path}", lambda: atomic_directory_write(Path(path), write, own_entries=SAVE_ENTRIES,
                                                                     overwrite=overwrite))
        return Path(path)

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
        from datasets import load_from_disk

        directory = Path(path)
        state = load_state(directory)
        extra = state["extra"]
        if reward_funcs is None:
            reward_funcs = _unreferenced(extra["reward_funcs"], directory, "reward functions", "reward_funcs=[...]")
        if "rollout_func" not in kwargs and "tools" not in kwargs:  # else the caller chose how to generate
            kwargs["rollout_func"] = _unreferenced(extra["rollout_func"], directory, "rollout function", "rollout_func=...")
            kwargs["tools"] = _unreferenced(extra["tools"], directory, "tools", "tools=[...]")
        if train_dataset is None:
            train_dataset = load_from_disk(str(directory / "train_dataset"))
        if eval_dataset is None and (directory / "eval_dataset").exists():
            eval_dataset = load_from_disk(str(directory / "eval_dataset"))
        if kwargs.get("args") is None:
            kwargs["args"] = GRPOConfig.from_yaml(directory / "config.yaml")
            if not trust_remote_code:
                kwargs["args"] = _without_remote_code(kwargs["args"], directory)
        own_optimizer, own_scheduler = (part is not None for part in kwargs.get("optimizers", (None, None)))
        saved = per_process_states(state)
        half_used = len(saved) == launched_processes() and saved[0]["pending"][0] is not None  # else it is dropped
        built = rebuilt_fields(
            directory, extra["applied_config"], kwargs["args"].to_dict(), own_optimizer, own_scheduler,
            given_model=model is not None, half_used=half_used,
        )
        model_dir = directory / MODEL_DIR
        config = kwargs["args"]
        adapter = (model_dir / "adapter_config.json").exists()
        if model is None and not adapter and config.cast_lm_head_to_fp32:
            model = load_causal_lm(str(model_dir), config.model_kwargs())  # the saved weights are copied in below
        if model is not None:
            if config.cast_lm_head_to_fp32:  # before the copy: a head in the model's dtype would round the saved one
                cast_lm_head_to_fp32(model)
            load_saved_weights(model, model_dir)
        elif adapter:
            from peft import AutoPeftModelForCausalLM

            model = AutoPeftModelForCausalLM.from_pretrained(str(model_dir), is_trainable=True, **config.model_kwargs())
        else:
            model = str(model_dir)
        remote_code = config.model_kwargs()["trust_remote_code"]
        kwargs.setdefault("processing_class", load_tokenizer(str(model_dir), trust_remote_code=remote_code))
        session = cls(model, reward_funcs, train_dataset=train_dataset, eval_dataset=eval_dataset, **kwargs)
        accelerator = session.engine.accelerator
        own = own_process_state(state, accelerator.process_index, accelerator.num_processes)
        restore_engine(session.engine, state, own["rng"])
        session._history = extra["history"]
        session._completion_log = extra["completion_log"]
        session.config_changes = extra["config_changes"] + [
            {"step": state["global_step"] + 1, "field": name, "old": old, "new": new} for name, (old, new) in built.items()
        ]
        session._applied_config = {**extra["applied_config"], **{name: new for name, (_, new) in built.items()}}
        session.batch_step = extra["batch_step"]
        session._last_stage = extra["last_stage"]
        if own["pending"] is None or own["pending"][0] is None:  # dropped, or saved between batches
            session.discard_batch()
        else:
            session.rollout, session.scores, session.advantages_result = on_device(own["pending"], accelerator.device)
            if session.scores is not None and session.scores.reward_names != session.engine.reward_names:
                notices.warn(
                    f"The saved run stopped inside a generation batch scored by {session.scores.reward_names}; its "
                    f"remaining {session.engine.steps_per_batch - session.batch_step} optimizer step(s) train on those "
                    f"scores, and the reward functions given now ({session.engine.reward_names}) score the batches "
                    "after it; session.discard_batch() drops it instead."
                )
        return session


def _without_remote_code(config: GRPOConfig, directory: Path) -> GRPOConfig:
    """The checkpoint's config without the settings that make loading a model run or fetch code
    (``trust_remote_code``, ``code_revision``, hub kernels): a file in the checkpoint must not be able
    to turn them on; only the caller's own arguments can."""
    init_kwargs = dict(config.model_init_kwargs or {})
    dropped = [name for name in list(init_kwargs) if name in ("trust_remote_code", "code_revision") or "kernel" in name]
    if "/" in str(init_kwargs.get("attn_implementation", "")):  # an attention kernel fetched from the hub
        dropped.append("attn_implementation")
    for name in dropped:
        init_kwargs.pop(name)
    if config.trust_remote_code or dropped:
        settings = ["trust_remote_code"] * bool(config.trust_remote_code) + [f"model_init_kwargs[{n!r}]" for n in dropped]
        notices.warn(
            f"{directory / 'config.yaml'} sets {', '.join(settings)}, which a checkpoint cannot turn on: the model is "
            "loaded without running or fetching code. If you trust the checkpoint, load it with "
            "GRPOSession.load(path, trust_remote_code=True), or pass your own args= with these settings."
        )
        config.trust_remote_code = False
        config.model_init_kwargs = init_kwargs or None
    return config


def _unreferenced(saved, directory: Path, what: str, argument: str):
    """Functions saved by ``_referenced``, imported by name; a ValueError naming the argument that
    passes them again where they could not be stored, or cannot be found any more (defined in a
    notebook, renamed, moved)."""
    problem = "could not be stored (not importable by module and name, e.g. a lambda or a notebook's function)"
    if not (isinstance(saved, dict) and isinstance(saved.get("functions"), list)):
        saved = None  # nothing this version wrote: never unpickled
    if saved is not None and saved["none"]:
        return None
    if saved is not None:
        try:
            found = [_import_reference(reference, directory) for reference in saved["functions"]]
            return found if saved["is_list"] else found[0]
        except (AttributeError, ImportError, ValueError) as error:
            problem = f"cannot be found in this process ({error}; e.g. defined in a notebook)"
    again = "it" if what == "rollout function" else "them"
    raise ValueError(f"The {what} saved in {directory} {problem}; pass {again} again: GRPOSession.load(path, {argument}).")


def _import_reference(reference: str, directory: Path | None = None):
    """The function a ``module:name`` reference names. A module that would be imported from inside
    the checkpoint ``directory`` is refused: loading must not run code the checkpoint carries."""
    import importlib
    import importlib.util
    import sys

    module_name, _, qualname = reference.partition(":")
    if not module_name or not qualname:
        raise ValueError(f"{reference!r} is not a 'module:name' reference")
    if directory is not None and module_name not in sys.modules:
        spec = importlib.util.find_spec(module_name.partition(".")[0])
        origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
        if origin is not None and Path(directory).resolve() in origin.parents:
            raise ImportError(f"{module_name} would be imported from inside the checkpoint ({origin})")
    found = importlib.import_module(module_name)
    for part in qualname.split("."):
        found = getattr(found, part)
    if not callable(found):
        raise ValueError(f"{reference} is not callable")
    return found


def _referenced(funcs) -> dict | None:
    """Reward functions, tools (or a rollout function) as ``module:name`` references that load
    imports, never unpickles; None where one is not importable under its name (a lambda, a loaded
    reward model: it must then be passed again). No functions at all: ``{"none": True, ...}``."""
    if funcs is None:
        return {"functions": [], "is_list": False, "none": True}
    is_list = isinstance(funcs, (list, tuple))
    references = []
    for func in funcs if is_list else [funcs]:
        module, qualname = getattr(func, "__module__", None), getattr(func, "__qualname__", None)
        if not module or not qualname or "<" in qualname:
            return None
        reference = f"{module}:{qualname}"
        try:
            if _import_reference(reference) is not func:
                return None
        except (AttributeError, ImportError, ValueError):
            return None
        references.append(reference)
    return {"functions": references, "is_list": is_list, "none": False}
