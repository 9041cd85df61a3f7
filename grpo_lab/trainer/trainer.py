"""GRPOTrainer: the script loop over the same engine and state machine as GRPOSession.

The trainer adds what a script run needs around the session's ``step()``: a progress bar, metrics
appended to ``<output_dir>/metrics.jsonl`` (and TensorBoard, Weights & Biases, trackio, MLflow or
Comet when ``report_to`` asks), a table of sample completions every ``logging_steps`` when
``log_completions`` is set, atomic checkpoints every ``save_steps`` with ``save_total_limit``, and
exact resumption. Because it calls
the very same ``GRPOSession.step()``, N trainer steps and N session steps from the same seed give
identical metrics and weights.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import shutil
from pathlib import Path

from grpo_lab import notices, ops
from grpo_lab.parallel import dist
from grpo_lab.accel import release_freed_memory
from grpo_lab.state.checkpoint import CHECKPOINT_PREFIX, TRAINER_STATE_FILE, check_complete, trainer_checkpoints
from grpo_lab.config.grpo_config import GRPOConfig, resolved_eval_steps, steps_between
from grpo_lab.parallel.dist import from_main, on_main
from grpo_lab.state.model_card import write_training_files
from grpo_lab.progress import progress_bar
from grpo_lab.trainer.trackers import (
    TrackerArgs,
    end_failed_runs,
    open_tensorboard_writers,
    send_completions,
    tracker_callbacks,
    tracker_names,
    users_tracker_runs,
)
from grpo_lab.state.safe_write import check_writable, first_process, full_disk_named, remove_partial_writes
from grpo_lab.session.session import GRPOSession
from grpo_lab.state.run_logs import drop_rows_after
from grpo_lab.trainer.doctor import FINDINGS_FILE, log_live_findings, preflight, refuse_after_probe
from grpo_lab.trainer.evaluation import TrainerEvaluation
from grpo_lab.trainer.events import TrainerEvents, TrainOutput
from grpo_lab.trainer.results import TrainerResults


class GRPOTrainer(TrainerEvaluation, TrainerResults):
    """Train with GRPO from a script. The arguments are TRL 1.16's ``GRPOTrainer``'s, in its order, and
    :class:`grpo_lab.GRPOSession`'s."""

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
        self.trackers = tracker_names(getattr(args, "report_to", "none"))  # checked before the model loads
        if args is not None and first_process():  # the process that writes checkpoints
            check_writable(Path(args.output_dir), "write the run's output to")
        self._resume_kwargs = dict(
            reward_funcs=reward_funcs, train_dataset=train_dataset, eval_dataset=eval_dataset,
            reward_processing_classes=reward_processing_classes, optimizers=optimizers,
            quantization_config=quantization_config, rollout_func=rollout_func, tools=tools,
            environment_factory=environment_factory,
        )
        self.session = GRPOSession(model, args=args, processing_class=processing_class, peft_config=peft_config,
                                   **self._resume_kwargs)
        self.args = self.session.config
        self.output_dir = Path(self.args.output_dir)
        self._own_checkpoints: set[str] = set()  # the checkpoint-N this run wrote or resumed from: rotation's
        self.session.engine.layout.check_savable()  # the run ends with a checkpoint: refused now, not after training
        # transformers' order: the flow, the report_to trackers, then the user's callbacks
        callbacks = [*tracker_callbacks(self.trackers), *(callbacks or [])]
        self._events = TrainerEvents(self.args, callbacks, is_world_process_zero=self.accelerator.is_main_process,
                                     is_local_process_zero=self.accelerator.is_local_main_process,
                                     tracker_args=TrackerArgs(self.args, self.output_dir))
        self._events.attach(self.session)
        self._check_evaluation()
        self._events.init_end()

    @property
    def accelerator(self):
        return self.session.engine.accelerator

    @property
    def model(self):
        return self.session.model

    @property
    def processing_class(self):
        """The tokenizer, or a vision-language model's processor, as TRL's trainer holds it."""
        return self.session.engine.processing_class

    @property
    def ref_model(self):
        """The reference model (beta > 0; kept in step with the policy by ``sync_ref_model``), else None."""
        return self.session.engine.ref_model

    @property
    def state(self):
        """transformers' ``TrainerState``: ``global_step``, ``epoch``, ``max_steps``, ``log_history``..."""
        return self._events.state

    @property
    def control(self):
        """transformers' ``TrainerControl``, which callbacks set to log, save or stop."""
        return self._events.control

    @property
    def callback_handler(self):
        return self._events.handler

    def add_callback(self, callback) -> None:
        """Add a transformers ``TrainerCallback`` (a class or an instance)."""
        self._events.handler.add_callback(callback)

    def pop_callback(self, callback):
        """Remove a callback (a class: its first instance) and return it."""
        return self._events.handler.pop_callback(callback)

    def remove_callback(self, callback) -> None:
        self._events.handler.remove_callback(callback)

    def train(self, resume_from_checkpoint: str | bool | None = None) -> TrainOutput:
        """Run until ``max_steps`` (or ``num_train_epochs``); returns transformers' ``TrainOutput``
        (``global_step``, ``training_loss``, ``metrics``), as TRL's trainer does. The last step's own
        metrics are ``trainer.session.last_metrics``; the logged rows, ``trainer.state.log_history``.

        ``resume_from_checkpoint``: a checkpoint directory, or True for the newest one in
        ``output_dir``.
        """
        refuse_after_probe()  # grpo-lab doctor SCRIPT: a script that calls train() again trains nothing
        if self.session is None and not resume_from_checkpoint:
            raise RuntimeError(
                "This trainer has no model: it was closed, or it released its model for a resume that failed (see "
                "that error). Call train(resume_from_checkpoint=...), or build a new GRPOTrainer."
            )
        fresh = not resume_from_checkpoint and self.session.global_step == 0  # not this trainer's own run, continued
        if fresh:
            self._check_no_earlier_run()
        if resume_from_checkpoint:
            self._resume(resume_from_checkpoint)
        total = self.session.engine.total_steps()
        if resume_from_checkpoint:
            on_main(self.accelerator, "drop logged rows the resumed steps replace",
                    self._drop_logged_steps_after)
        if self.session.global_step < total:
            preflight(self)  # doctor="warn" or "stop": the probe runs before the first step
            return self._train_steps(total)
        if self.accelerator.is_main_process:
            notices.warn(
                f"Nothing to train: the run is at step {self.session.global_step} of {total}. Raise max_steps "
                "(or num_train_epochs) in trainer.args to train further.",
            )
        self.callback_handler.trackers_quiet = True  # no empty tracker run
        try:
            self._begin_events(total)
            return self._events.train_end(steps_run=0, samples_per_step=0)
        finally:
            self.callback_handler.trackers_quiet = False

    def _begin_events(self, total: int) -> None:
        self._events.attach(self.session)
        logging_steps = steps_between(self.args.logging_steps, total)
        eval_steps = resolved_eval_steps(self.args, total)
        save_steps = steps_between(self.args.save_steps, total)
        self._check_best_model_steps(save_steps, eval_steps)
        failure = None
        try:
            if self.accelerator.is_main_process and not self.callback_handler.trackers_quiet:
                open_tensorboard_writers(self.callback_handler.callbacks, self.args, self.output_dir,
                                         self.session.global_step + 1)
            self._events.train_begin(global_step=self.session.global_step, max_steps=total,
                                     logging_steps=logging_steps, save_steps=save_steps, eval_steps=eval_steps)
        except BaseException as error:  # the trackers open their runs here, on the main process alone
            failure = error
        on_main(self.accelerator, "start the callbacks (the report_to trackers open their runs)",
                lambda: _raise(failure))
        if failure is not None:
            raise failure

    def _check_no_earlier_run(self) -> None:
        """A fresh run never writes over an earlier run's checkpoints: refused, on every process, where
        ``output_dir`` holds some, unless ``overwrite_output_dir``; an earlier ``metrics.jsonl`` is
        appended to, with a warning."""
        checkpoints = from_main(self.accelerator, [p.name for p in trainer_checkpoints(self.output_dir)])
        if checkpoints and not self.args.overwrite_output_dir:
            raise FileExistsError(
                f"{self.output_dir} already holds {', '.join(checkpoints)} from an earlier run, which this fresh run "
                "would replace step by step. To continue that run, pass resume_from_checkpoint=True (a script: "
                "--resume_from with its newest checkpoint-N); to keep it, give a new output_dir; to train a new run "
                "there anyway, set overwrite_output_dir=True (its checkpoints of the same steps are then replaced, "
                "and save_total_limit counts this run's own alone)."
            )
        completions = any((self.output_dir / "completions").glob("completions_*.parquet"))
        earlier = checkpoints + [name for name in ("metrics.jsonl",) if (self.output_dir / name).exists()]
        earlier += ["completions/"] if completions else []
        if earlier and self.accelerator.is_main_process:
            replaced = [*(["checkpoints of the same step (overwrite_output_dir=True)"] if checkpoints else []),
                        *(["the completions files of the steps it logs"] if completions else [])]
            notices.warn(
                f"{self.output_dir} already holds {', '.join(earlier)} from an earlier run: this run appends to "
                "metrics.jsonl" + (f" and replaces {' and '.join(replaced)}" if replaced else "") + ". To continue "
                "that run instead, pass resume_from_checkpoint=True (a script: --resume_from with its newest "
                "checkpoint-N); else give a new output_dir.",
            )

    def _resume(self, resume_from_checkpoint: str | bool) -> None:
        """Replace the session by the one saved in the checkpoint (True: the newest in ``output_dir``)."""
        path = self._latest_checkpoint() if resume_from_checkpoint is True else Path(resume_from_checkpoint)
        check_complete(path)  # a wrong path fails here, with this trainer still whole
        kept = self._release_session() if self.session is not None else None
        try:
            model = None if kept is None else kept.model
            self.session = GRPOSession.load(path, model=model, args=self.args, **self._resume_kwargs)
        except BaseException:
            self.session = kept  # None where the model was released: only a resume can follow
            raise
        self._events.resumed(path / TRAINER_STATE_FILE, self.session)
        if path.parent.resolve() == self.output_dir.resolve():  # the run goes on where it left its checkpoints
            step = int(path.name.removeprefix(CHECKPOINT_PREFIX)) if path.name.startswith(CHECKPOINT_PREFIX) else -1
            self._own_checkpoints |= {p.name for p in trainer_checkpoints(self.output_dir)
                                      if int(p.name.removeprefix(CHECKPOINT_PREFIX)) <= step}

    def _train_steps(self, total: int) -> TrainOutput:
        """Step until ``total`` (or a callback's ``should_training_stop``), logging every step and
        checkpointing every ``save_steps`` and at the end."""
        log_every = steps_between(self.args.logging_steps, total)
        events, first = self._events, self.session.global_step
        main = self.accelerator.is_main_process
        users_runs = users_tracker_runs(self.trackers) if main else set()
        row: dict = {}
        saved_at, saving = None, self.args.save_strategy != "no"
        shown = main and self.args.disable_tqdm is not True
        try:
            self._begin_events(total)  # the trackers' callbacks open their runs
            if self.args.eval_on_start:
                self.evaluate()
            with progress_bar(total, done=self.session.global_step, enabled=shown) as bar:
                while self.session.global_step < total:
                    events.step_begin()
                    row = self.session.step()
                    bar.advance(row)
                    on_main(self.accelerator, f"log step {row['step']}", lambda: self._log(row, log_every))
                    control = events.step_end(row)
                    if control.should_evaluate:
                        self._evaluate_in_training()
                    if control.should_save or (control.should_training_stop and saving):
                        self.save_checkpoint()  # a run that stops is resumable from where it stopped
                        saved_at = row["step"]
                    if self.session.rollout is None and self.session.engine.sampler.next_draw_starts_epoch:
                        events.epoch_end()  # the step used the epoch's last batch
                    if control.should_training_stop:
                        break
            if row and saving and saved_at != row["step"]:
                self.save_checkpoint()
        except BaseException:
            if main:  # what was logged stays in the trackers, in runs marked failed
                end_failed_runs(self.trackers, users_runs, self.callback_handler.callbacks)
            raise
        self._load_best_model()
        samples = self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps
        return events.train_end(steps_run=self.session.global_step - first,
                                samples_per_step=samples * self.accelerator.num_processes)

    def _drop_logged_steps_after(self) -> None:
        """Remove from ``metrics.jsonl`` and ``findings.jsonl`` the rows of steps after the one resumed
        from: a run stopped after logging steps it had not checkpointed yet. The resumed run logs those
        steps again, once (a line cut short by the stop goes too)."""
        step = self.session.global_step
        for name in ("metrics.jsonl", FINDINGS_FILE):
            removed = drop_rows_after(self.output_dir / name, step)
            if removed:
                notices.warn(
                    f"{self.output_dir / name} held {removed} row(s) logged after step {step}, the step this run "
                    "resumes from; they were removed, and the resumed steps are logged in their place."
                )
        later = [path for path in (self.output_dir / "completions").glob("completions_*.parquet")
                 if path.stem.removeprefix("completions_").isdecimal() and int(path.stem[12:]) > step]
        for path in later:
            path.unlink()
        if later:
            notices.warn(
                f"{self.output_dir / 'completions'} held the completions of {len(later)} step(s) logged after step "
                f"{step}, the step this run resumes from; they were removed, and the resumed steps write theirs."
            )

    def _log(self, row: dict, completions_every: int) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        with open(self.output_dir / "metrics.jsonl", "a") as handle:
            handle.write(json.dumps(row) + "\n")
        log_live_findings(self, row)
        if self.args.log_completions and row["step"] % completions_every == 0:
            log = self.session.completions_log
            rows = log[log["step"] == log["step"].max()]
            self._write_completions_file(row["step"], rows)
            if self.args.log_unique_prompts:
                rows = rows.drop_duplicates(subset="prompt")
            if self.args.num_completions_to_print:
                rows = rows.head(self.args.num_completions_to_print)
            self._print_completions(row["step"], rows)
            send_completions(self.trackers, row["step"], rows)

    def _write_completions_file(self, step: int, rows) -> None:
        """``output_dir/completions/completions_<step>.parquet``: the step's scored completions as
        TRL writes them (``step``, ``prompt``, ``completion``, a column per reward function named by
        it, ``advantage``), with grpo_lab's further columns (``group``, ``reward``, ...) after them; a
        function named like one of those keeps its ``rewards/`` prefix."""
        columns = {name: name.removeprefix("rewards/") for name in rows.columns
                   if name.startswith("rewards/") and name.removeprefix("rewards/") not in rows.columns}
        first = ["step", "prompt", "completion", *columns.values(), "advantage"]
        table = rows.rename(columns=columns)
        table = table[first + [name for name in table.columns if name not in first]]
        folder = self.output_dir / "completions"
        folder.mkdir(parents=True, exist_ok=True)
        table.reset_index(drop=True).to_parquet(folder / f"completions_{step:05d}.parquet")

    def _print_completions(self, step: int, rows) -> None:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"completions at step {step}")
        reward_columns = [c for c in rows.columns if c.startswith("rewards/")]
        for column in ["prompt", "completion", *reward_columns, "advantage"]:
            table.add_column(column.removeprefix("rewards/"))
        for _, r in rows.iterrows():
            rewards = [f"{r[c]:.3g}" for c in reward_columns]
            table.add_row(str(r["prompt"]), str(r["completion"]), *rewards, f"{r['advantage']:.3g}")
        console = Console()
        if not (console.is_terminal or console.is_jupyter or "COLUMNS" in os.environ):
            console = Console(width=160)  # a log file: 80 columns would wrap every completion over several lines
        console.print(table)

    def save_checkpoint(self) -> Path:
        """Write ``<output_dir>/checkpoint-<step>`` atomically; keep at most ``save_total_limit``."""
        path = self.output_dir / f"{CHECKPOINT_PREFIX}{self.session.global_step}"
        on_main(self.accelerator, "remove what killed checkpoint writes left",
                lambda: remove_partial_writes(self.output_dir, CHECKPOINT_PREFIX))
        self._note_best_checkpoint(path)
        # every process: each one's random state goes into the checkpoint
        self.session.save(path, trainer_state=self._events.state_json())
        self._own_checkpoints.add(path.name)
        on_main(self.accelerator, "remove checkpoints beyond save_total_limit", self._rotate_checkpoints)
        self._events.saved()
        return path

    def close(self) -> None:
        """Release the model, optimizer and generation backend, then end the process group of an
        ``accelerate launch`` run. A script calls it last (exported scripts and ``grpo-lab train`` do).

        torch's gloo threads (multi-process CPU runs) can otherwise drop their last reference to a
        collective's tensors while the interpreter shuts down, which aborts the process ("terminate
        called without an active exception") after the run has finished: freed here, the process
        group joins its threads while Python still runs.
        """
        if self.session is None:
            return
        accelerator = self.accelerator
        session, self.session = self.session, None
        self._events.detach(session)
        session.close()
        del session
        accelerator.free_memory()  # accelerate keeps the prepared model, which holds the process group
        gc.collect()  # the engine and its generation backend refer to each other
        release_freed_memory()  # what the model and optimizer held
        accelerator.end_training()

    def end(self) -> None:
        """transformers' name (``Trainer.end``, which TRL's scripts call last): :meth:`close`."""
        self.close()

    def _release_session(self):
        """Let go of the session before a checkpoint is loaded, so that its model, optimizer state and
        generation engine (vLLM) are freed rather than held beside the loaded ones. Returns the
        session where an optimizer given in optimizers= holds its model's parameters: the checkpoint
        goes into that model."""
        session, self.session = self.session, None
        self._events.detach(session)
        session.close()
        if not session.engine.optimization.owns_optimizer:
            return session
        del session
        gc.collect()  # the engine and its generation backend refer to each other
        return None

    def _checkpoints(self) -> list[Path]:
        return trainer_checkpoints(self.output_dir)

    def _latest_checkpoint(self) -> Path:
        checkpoints = self._checkpoints()
        if not checkpoints:
            raise FileNotFoundError(f"No {CHECKPOINT_PREFIX}N directory in {self.output_dir} to resume from.")
        return checkpoints[-1]

    def _rotate_checkpoints(self) -> None:
        """Keep at most ``save_total_limit`` of this run's checkpoints (those it wrote, and after a
        resume in the same ``output_dir`` those up to the step it resumed from), the best one always;
        another run's checkpoints in the folder are neither counted nor deleted."""
        limit = self.args.save_total_limit
        if limit:
            best = self.state.best_model_checkpoint  # never deleted; the newest are kept beside it
            others = [p for p in self._checkpoints()
                      if p.name in self._own_checkpoints and (best is None or p.name != Path(best).name)]
            for old in others[:-max(limit - (best is not None), 1)]:
                shutil.rmtree(old, ignore_errors=True)

    def get_high_entropy_mask(self, entropies, mask, threshold: float):
        """TRL's helper: a boolean (B, T) mask of the tokens in ``mask`` whose entropy is at least the
        ``threshold`` quantile of the masked tokens' entropies over every process (TRL passes
        ``1 - top_entropy_quantile``). :func:`grpo_lab.ops.quantile_mask` does the arithmetic."""
        pool = dist.gather_ragged(self.accelerator, entropies[mask.bool()].float())
        return ops.quantile_mask(entropies, mask, level=threshold, pool=pool)

    @staticmethod
    def get_off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold: float):
        """TRL's helper: the (B, 1) off-policy sequence mask of DeepSeek-V3.2, 1.0 to keep and 0.0 to
        drop; :func:`grpo_lab.ops.off_policy_mask` with TRL's argument names."""
        return ops.off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask,
                                   threshold=off_policy_threshold)

    def save_model(self, path: str | None = None, *, merged: bool = False) -> Path:
        """Save the model in Hugging Face format, with its tokenizer, ``training_args.bin`` (the config)
        and a model card (``README.md``), as TRL's trainer leaves them.

        For a PEFT model the adapter alone is saved, or with ``merged=True`` a full model with the
        adapter merged into a copy of the weights (the training model is left as it is).
        """
        refuse_after_probe()  # grpo-lab doctor SCRIPT: no untrained model over the user's saved one
        target = Path(path or self.output_dir)
        layout = self.session.engine.layout
        layout.check_savable()
        model = self.session.model
        merge = merged and hasattr(model, "merge_and_unload")
        if merge and layout.shards_state:
            raise NotImplementedError(
                "save_model(merged=True) cannot merge an adapter whose base weights are sharded over the processes. "
                "Save the adapter (merged=False), then merge it on one process: "
                "PeftModel.from_pretrained(base_model, adapter_dir).merge_and_unload()."
            )
        engine = self.session.engine
        state = layout.full_model_state(engine.model, adapter_only=engine.is_peft)  # every process

        def write() -> None:
            saved = copy.deepcopy(model).merge_and_unload() if merge else model
            with full_disk_named(target):
                saved.save_pretrained(target, state_dict=state)
                engine.processing_class.save_pretrained(target)
                write_training_files(target, self.args, engine.model_reference)

        on_main(self.accelerator, f"save the model to {target}", write)
        return target


def _raise(error: BaseException | None) -> None:
    if error is not None:
        raise error
