"""Where the trainer sends metrics besides ``output_dir/metrics.jsonl``: TensorBoard, Weights &
Biases, trackio, MLflow and Comet, as ``report_to`` asks, through transformers' own integration
callbacks (``TensorBoardCallback``, ``WandbCallback``, ``TrackioCallback``, ``MLflowCallback``,
``CometCallback``), driven by the trainer's ``TrainerState``/``TrainerControl`` events as TRL's
trainer drives them: their settings (``WANDB_PROJECT``, ``WANDB_LOG_MODEL``, ``MLFLOW_TRACKING_URI``,
``COMET_*``, ``TENSORBOARD_LOGGING_DIR``, ``run_name``, ``project``, ``trackio_space_id``...) and
what they send (``log_history``'s rows every ``logging_steps``, under ``train/`` and ``eval/`` where
the callback names them so) are what a TRL user knows. The callbacks see the config through
:class:`TrackerArgs`: credentials left out.

The completions that ``log_completions`` prints go to wandb and trackio as TRL sends them (a table
under ``completions``), and, beyond TRL, to MLflow and Comet as table files
``completions/step_<N>.json``.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import sys
from pathlib import Path

from grpo_lab import notices
from grpo_lab.config.checks import SUPPORTED_REPORTERS
from grpo_lab.credentials.config_values import without_secrets
from grpo_lab.errors import ConfigError

PACKAGES = {"comet_ml": "comet-ml"}
"""The package to install for a tracker whose module is named otherwise."""


def tracker_names(report_to) -> list[str]:
    """The trackers ``report_to`` (names GRPOConfig accepts) asks for: "all" means every one that is
    installed; one that is not installed is an error now rather than silence later."""
    wanted = [report_to] if isinstance(report_to, str) else list(report_to or [])
    if "all" in wanted:
        return [name for name in SUPPORTED_REPORTERS if importlib.util.find_spec(name) is not None]
    wanted = [name for name in wanted if name != "none"]
    missing = [name for name in wanted if importlib.util.find_spec(name) is None]
    if missing:
        packages = " ".join(PACKAGES.get(name, name) for name in missing)
        raise ImportError(f"report_to={', '.join(missing)} needs its package: pip install {packages}")
    return wanted


def tracker_callbacks(names: list[str]) -> list:
    """One transformers integration callback per tracker in ``names`` (from :func:`tracker_names`),
    made as transformers' Trainer makes them."""
    if not names:
        return []
    if "wandb" in names and os.environ.get("WANDB_LOG_MODEL", "").lower() == "end":
        raise ConfigError(
            "WANDB_LOG_MODEL=end has transformers' WandbCallback build a transformers Trainer to save the model at "
            "the end, which cannot be made from grpo_lab's config. Use WANDB_LOG_MODEL=checkpoint (every checkpoint-N "
            "is a model folder, logged as an artifact when it is saved), or log trainer.save_model()'s folder with "
            "wandb.log_artifact yourself."
        )
    from transformers.integrations import get_reporting_integration_callbacks

    return [kind() for kind in get_reporting_integration_callbacks(names)]


def open_tensorboard_writers(callbacks, config, output_dir, first_step: int) -> None:
    """Give each ``TensorBoardCallback`` among ``callbacks`` that has none its writer (its public
    ``tb_writer``) for a run whose next step is ``first_step``, into ``config.logging_dir``, else
    ``$TENSORBOARD_LOGGING_DIR``, else ``output_dir/runs``: one folder per run directory (where
    transformers makes one per ``train()`` call, ``runs/<time>_<host>``), so that a resumed run goes
    on in the same TensorBoard run, which drops the points it held from ``first_step`` on (logged
    after the checkpoint by the run that stopped, and logged again now). Main process only."""
    for callback in _tensorboard_callbacks(callbacks):
        if callback.tb_writer is None:
            from torch.utils.tensorboard import SummaryWriter

            log_dir = config.logging_dir or os.environ.get("TENSORBOARD_LOGGING_DIR") or str(Path(output_dir) / "runs")
            callback.tb_writer = SummaryWriter(log_dir=log_dir, purge_step=first_step if first_step > 1 else None)


_INTEGRATIONS = "transformers.integrations.integration_utils"


def _integrations():
    """transformers' integrations module where it is imported, else None: then no callback can be one
    of its classes, and a run without trackers does not pay for its import (over a second)."""
    return sys.modules.get(_INTEGRATIONS)


@functools.cache
def _integration_callbacks(module) -> tuple[type, ...]:
    return tuple(module.INTEGRATION_TO_CALLBACK.values())


def is_tracker(callback) -> bool:
    """Whether ``callback`` is one of transformers' integration callbacks (given by ``report_to`` or
    added by hand): it sees :class:`TrackerArgs`."""
    module = _integrations()
    return module is not None and isinstance(callback, _integration_callbacks(module))


def _tensorboard_callbacks(callbacks) -> list:
    module = _integrations()
    return [] if module is None else [c for c in callbacks if isinstance(c, module.TensorBoardCallback)]


class TrackerArgs:
    """The config as the tracker callbacks read it, in place of transformers' ``TrainingArguments``:
    every field read through from the config, ``output_dir`` the one the trainer writes to, and
    ``to_dict()``, ``to_sanitized_dict()`` and ``to_json_string()`` (what they send as the run's
    config) without credentials (``GRPOConfig.shareable_dict``)."""

    def __init__(self, config, output_dir: str):
        self.__dict__["_config"] = config
        self.__dict__["output_dir"] = str(output_dir)

    def __getattr__(self, name):
        config = self.__dict__.get("_config")
        if config is None or (name.startswith("__") and name.endswith("__")):  # copying, pickling
            raise AttributeError(name)
        value = getattr(config, name)
        return without_secrets({name: value})[0][name]  # hub_token and the like read as None

    def __setattr__(self, name, value):  # WandbCallback clears run_name between hyperparameter trials
        self.__dict__[name] = value

    def to_dict(self) -> dict:
        return {**self.__dict__["_config"].shareable_dict(), "output_dir": self.output_dir}

    def to_sanitized_dict(self) -> dict:
        return {key: value if isinstance(value, (bool, int, float, str)) else str(value)
                for key, value in self.to_dict().items()}

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)


def send_completions(names: list[str], step: int, completions) -> None:
    """The step's printed completions (a pandas DataFrame) to the trackers in ``names`` that take a
    table: wandb's run and trackio's (as TRL sends them, at the step's ``train/global_step``), and
    MLflow's active run and Comet's running experiment as ``completions/step_<step>.json``. Main
    process only, after the callbacks opened their runs."""
    table = completions.reset_index(drop=True)
    if "wandb" in names:
        import wandb

        if wandb.run is not None:
            wandb.log({"completions": wandb.Table(dataframe=table), "train/global_step": step})
    if "trackio" in names:
        import trackio

        trackio.log({"completions": trackio.Table(dataframe=table), "train/global_step": step})
    if "mlflow" in names:
        import mlflow

        if mlflow.active_run() is not None:
            mlflow.log_table(table, artifact_file=f"completions/step_{step}.json")
    if "comet_ml" in names:
        import comet_ml

        experiment = comet_ml.get_running_experiment()
        if experiment is not None:
            experiment.log_table(f"completions/step_{step}.json", tabular_data=table)


def users_tracker_runs(names: list[str]) -> set[str]:
    """The trackers in ``names`` whose run the user started in this process before training
    (``wandb.init``, ``mlflow.start_run``, ``comet_ml.start``): the trainer logs into them and
    leaves them open, whatever happens."""
    running = set()
    if "wandb" in names:
        import wandb

        running |= {"wandb"} if wandb.run is not None else set()
    if "mlflow" in names:
        import mlflow

        running |= {"mlflow"} if mlflow.active_run() is not None else set()
    if "comet_ml" in names:
        import comet_ml

        running |= {"comet_ml"} if comet_ml.get_running_experiment() is not None else set()
    return running


def end_failed_runs(names: list[str], users_runs: set[str], callbacks) -> None:
    """After a failed ``train()``: end the runs the callbacks opened, marked failed where the tracker
    keeps a status (wandb's exit code 1, MLflow's FAILED), so that what was logged is kept and shown
    as a failed run, and close the TensorBoard writers; the user's own runs (``users_runs``) stay
    open. transformers' callbacks end their runs only at ``on_train_end``, which a failed run never
    reaches."""
    for callback in _tensorboard_callbacks(callbacks):
        if callback.tb_writer is not None:
            callback.tb_writer.close()
            callback.tb_writer = None
    try:
        _end_runs([name for name in names if name not in users_runs])
    except Exception as error:  # the run's own failure is the one to raise; this one is told
        notices.warn(f"Ending the trackers' runs after the failure failed too: {type(error).__name__}: {error}")


def _end_runs(ours: list[str]) -> None:
    if "wandb" in ours:
        import wandb

        if wandb.run is not None:
            wandb.run.finish(exit_code=1)
    if "mlflow" in ours:
        import mlflow

        if mlflow.active_run() is not None:
            mlflow.end_run(status="FAILED")
    if "trackio" in ours:
        import trackio

        trackio.finish()
    if "comet_ml" in ours:
        import comet_ml

        experiment = comet_ml.get_running_experiment()
        if experiment is not None:
            experiment.end()
