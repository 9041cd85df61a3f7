"""Evaluation in ``GRPOTrainer``, under transformers' and TRL's names: ``evaluate()``, evaluation
while training (``eval_strategy="steps"``, ``eval_steps``, ``eval_delay``, ``eval_on_start``), the
best checkpoint (``metric_for_best_model``, ``greater_is_better``, ``load_best_model_at_end``) and
``save_total_limit`` that keeps it.

Evaluation samples from the current policy with its own random state (the engine's
``evaluate``), so a run that evaluates trains exactly as one that does not.
"""

from __future__ import annotations

import math
import time

from grpo_lab.core.hf_trainer_types import speed_metrics

from grpo_lab.state.checkpoint import load_saved_weights, saved_model_dir
from grpo_lab.core.build import eval_sets, named_eval_dataset

DEFAULT_BEST_METRIC = "loss"
"""``metric_for_best_model`` when ``load_best_model_at_end`` is set without one, as transformers
picks it: the eval loss (lower is better). For GRPO a reward is usually the better choice: set
``metric_for_best_model="reward"``."""


def best_metric_name(args) -> tuple[str, bool]:
    """The logged name of the metric that picks the best checkpoint, and whether greater is better
    (transformers' rules: ``eval_`` added when missing; greater unless the name ends in ``loss``)."""
    name = args.metric_for_best_model or DEFAULT_BEST_METRIC
    name = name if name.startswith("eval_") else f"eval_{name}"
    greater = args.greater_is_better if args.greater_is_better is not None else not name.endswith("loss")
    return name, greater


class TrainerEvaluation:
    """Methods of :class:`grpo_lab.trainer.trainer.GRPOTrainer`."""

    @property
    def eval_dataset(self):
        """The eval set(s) as given, as TRL's trainer shows them (the engine keeps a streamed set read
        into a dataset once)."""
        return self.session.engine.given_eval_dataset

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Evaluate the policy on ``eval_dataset`` (default: the trainer's; a dict of named sets is
        reported set by set, ``eval_<name>_reward``...), log the metrics to ``state.log_history`` with
        ``eval_runtime`` and the throughput (and, through the callbacks' ``on_log``, to the ``report_to`` trackers),
        run the callbacks' ``on_evaluate``, and return them.
        ``ignore_keys`` is accepted for transformers' signature; nothing is ignored."""
        start = time.time()
        chosen = self.session.engine.eval_dataset if eval_dataset is None else named_eval_dataset(eval_dataset)
        metrics = self.session.evaluate(chosen, metric_key_prefix=metric_key_prefix)
        sets = eval_sets(chosen).values()  # streams read into datasets: they have a length
        per_call = self.args.per_device_eval_batch_size * self.accelerator.num_processes
        metrics.update(speed_metrics(metric_key_prefix, start, num_samples=sum(len(d) for d in sets),
                                     num_steps=sum(math.ceil(len(d) / per_call) for d in sets)))
        self._events.log(metrics)  # the report_to trackers get it through on_log, as transformers' Trainer sends it
        self._events.evaluated(metrics)
        return metrics

    def _check_evaluation(self) -> None:
        """Refuse, before training, an evaluation schedule without an eval set to run on, and loading
        the best checkpoint into a model sharded over the processes."""
        wants = self.args.eval_strategy != "no" or self.args.eval_on_start
        if wants and self.eval_dataset is None:
            raise ValueError(
                f"eval_strategy={self.args.eval_strategy!r} (or eval_on_start=True) evaluates during training, but "
                "there is no eval_dataset: pass eval_dataset= to the trainer, or set eval_strategy='no'."
            )
        if self.args.load_best_model_at_end and self.session.engine.layout.shards_state:
            raise NotImplementedError(
                "load_best_model_at_end=True cannot load a checkpoint into a model sharded over the processes (FSDP) "
                "yet. Leave it off; state.best_model_checkpoint still names the best checkpoint, which "
                "GRPOSession.load() or from_pretrained on its model/ folder reads."
            )

    def _check_best_model_steps(self, save_steps: int, eval_steps: int) -> None:
        """transformers' rule, on the resolved step counts: every evaluated step must be saved."""
        if self.args.load_best_model_at_end and save_steps % eval_steps:
            raise ValueError(
                f"load_best_model_at_end=True needs save_steps to be a multiple of eval_steps; for this run they "
                f"resolve to {save_steps} and {eval_steps} steps. Give both as steps, or as fractions that divide."
            )

    def _evaluate_in_training(self) -> None:
        """An evaluation the schedule (or a callback) asked for, and the best metric it may set."""
        metrics = self.evaluate()
        if self.args.metric_for_best_model is None and not self.args.load_best_model_at_end:
            return  # as in transformers, a best checkpoint is tracked only when asked for
        name, greater = best_metric_name(self.args)
        if name not in metrics:
            raise KeyError(
                f"metric_for_best_model={self.args.metric_for_best_model!r} looks for {name!r}, which the "
                f"evaluation did not report; it reported {', '.join(sorted(metrics))}."
            )
        state, value = self.state, metrics[name]
        if value is None or math.isnan(value):
            return  # no evidence either way (e.g. every reward of the metric was None)
        if state.best_metric is None or (value > state.best_metric if greater else value < state.best_metric):
            state.best_metric, state.best_global_step = value, state.global_step

    def _note_best_checkpoint(self, path) -> None:
        if self.state.best_global_step == self.state.global_step and self.state.best_metric is not None:
            self.state.best_model_checkpoint = str(path)

    def _load_best_model(self) -> None:
        """``load_best_model_at_end``: the best checkpoint's weights into the policy."""
        best = self.state.best_model_checkpoint
        if not (self.args.load_best_model_at_end and best):
            return
        engine = self.session.engine
        load_saved_weights(engine.unwrapped_model, saved_model_dir(best))
        engine.published_version = None  # a generation backend holding weights takes the loaded ones
