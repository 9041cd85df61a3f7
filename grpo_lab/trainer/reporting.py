"""Where the trainer sends metrics besides ``output_dir/metrics.jsonl``: TensorBoard, Weights &
Biases, trackio, MLflow and Comet, as ``report_to`` asks.

A reporter takes each step's metrics row (``log``), the completions of a step that the trainer
prints with ``log_completions`` (``log_completions``, a pandas DataFrame) and ``close(failed)``. The
trainer makes them on the main process only, and closes each one however the run ends.
"""

from __future__ import annotations

import importlib.util
import os
import re
from contextlib import ExitStack, contextmanager
from pathlib import Path

from grpo_lab.config.checks import SUPPORTED_REPORTERS

PACKAGES = {"comet_ml": "comet-ml"}
"""The package to install for a tracker whose module is named otherwise."""


def reporter_names(report_to) -> list[str]:
    """The reporters ``report_to`` (names GRPOConfig accepts) asks for: "all" means every one that is
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


@contextmanager
def open_reporters(names: list[str], config, output_dir: Path, first_step: int = 1):
    """Yield one reporter per name in ``names`` (from :func:`reporter_names`) for a run whose next
    step is ``first_step``; on the way out each is closed, told whether the run failed, even if
    another one fails to open or close."""
    output_dir = Path(output_dir)
    kinds = {
        "tensorboard": lambda: TensorBoardReporter(config, output_dir, first_step),
        "wandb": lambda: WandbReporter(config, output_dir), "trackio": lambda: TrackioReporter(config, output_dir),
        "mlflow": lambda: MLflowReporter(config, output_dir), "comet_ml": lambda: CometReporter(config, output_dir),
    }
    with ExitStack() as stack:
        yield [stack.enter_context(kinds[name]()) for name in names]


class _Reporter:
    """As a context manager, a reporter closes on exit, failed when an exception is on its way."""

    def __enter__(self):
        return self

    def __exit__(self, kind, value, traceback) -> None:
        self.close(failed=kind is not None)

    def close(self, failed: bool = False) -> None:
        raise NotImplementedError


class TensorBoardReporter(_Reporter):
    """Scalars to ``logging_dir`` (default ``output_dir/runs``), one point per step and metric.

    A run that continues from step ``first_step - 1`` (a resume) has TensorBoard drop the points
    the directory holds from ``first_step`` on: those of the run it resumes, logged after the
    checkpoint and logged again now, would otherwise show twice."""

    def __init__(self, config, output_dir: Path, first_step: int = 1):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=config.logging_dir or str(output_dir / "runs"),
                                    purge_step=first_step if first_step > 1 else None)

    def log(self, row: dict) -> None:
        for key, value in row.items():
            if key != "step":
                self.writer.add_scalar(key, value, row["step"])

    def log_completions(self, step: int, completions) -> None:
        """TensorBoard gets scalars only; the completions are printed by the trainer."""

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class WandbReporter(_Reporter):
    """A Weights & Biases run: the config once, each metrics row, and the printed completions as a
    table under ``completions``, all against ``train/global_step`` (the optimizer step).

    Continues a run already started in the process (``wandb.init`` called by the user), else starts
    one in project ``$WANDB_PROJECT`` (default "grpo_lab") with its files under ``$WANDB_DIR`` or
    ``output_dir``; ``WANDB_MODE=offline`` and wandb's other variables apply as usual. The step is a
    logged value, not wandb's own step counter, so a run that already logged (or a resumed run that
    logs earlier steps again) keeps every point.
    """

    STEP = "train/global_step"

    def __init__(self, config, output_dir: Path):
        import wandb

        self.wandb = wandb
        self.owns_run = wandb.run is None
        if self.owns_run:
            directory = Path(os.environ.get("WANDB_DIR") or output_dir)
            directory.mkdir(parents=True, exist_ok=True)
            self.run = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "grpo_lab"), name=config.run_name,
                config=config.shareable_dict(), dir=str(directory),
            )
        else:
            self.run = wandb.run
            self.run.config.update(config.shareable_dict(), allow_val_change=True)
        self.run.define_metric(self.STEP)
        self.run.define_metric("*", step_metric=self.STEP, step_sync=True)

    def log(self, row: dict) -> None:
        self.run.log({self.STEP: row["step"], **{key: value for key, value in row.items() if key != "step"}})

    def log_completions(self, step: int, completions) -> None:
        table = self.wandb.Table(dataframe=completions.reset_index(drop=True))
        self.run.log({self.STEP: step, "completions": table})

    def close(self, failed: bool = False) -> None:
        if self.owns_run:
            self.run.finish(exit_code=1 if failed else None)


class TrackioReporter(_Reporter):
    """A trackio run in project ``config.project``, named ``config.run_name`` (else trackio names it):
    the config once, each metrics row at its optimizer step, and the printed completions as a table
    under ``completions``. Logged locally (``$TRACKIO_DIR``, by default trackio's cache directory;
    ``trackio show`` opens the dashboard) unless ``config.trackio_space_id`` (or ``$TRACKIO_SPACE_ID``)
    names a Hugging Face Space."""

    def __init__(self, config, output_dir: Path):
        import trackio

        self.trackio = trackio
        self.run = trackio.init(
            project=config.project, name=config.run_name, space_id=config.trackio_space_id,
            config=config.shareable_dict(), embed=False,
        )

    def log(self, row: dict) -> None:
        self.run.log({key: value for key, value in row.items() if key != "step"}, step=row["step"])

    def log_completions(self, step: int, completions) -> None:
        self.run.log({"completions": self.trackio.Table(dataframe=completions.reset_index(drop=True))}, step=step)

    def close(self, failed: bool = False) -> None:
        self.run.finish()


class MLflowReporter(_Reporter):
    """An MLflow run: the config as parameters, each metrics row at its optimizer step (names MLflow
    refuses, such as a lambda's ``rewards/<lambda>/mean``, with "_" for the characters it does not
    take), and the printed completions as a table artifact, ``completions/step_<N>.json``.

    Continues the run already active in the process (``mlflow.start_run`` called by the user; its
    parameters are left as they are, since MLflow's cannot change), else starts one named
    ``config.run_name``, which ends FAILED when the training fails. Where runs go is MLflow's own
    setting: ``$MLFLOW_TRACKING_URI`` (a tracking server, or a local store) and
    ``$MLFLOW_EXPERIMENT_NAME``.
    """

    PARAMS_PER_CALL = 100
    """MLflow takes at most 100 parameters in one request."""

    def __init__(self, config, output_dir: Path):
        import mlflow

        self.mlflow = mlflow
        active = mlflow.active_run()
        self.owns_run = active is None
        if active is None:
            try:
                active = mlflow.start_run(run_name=config.run_name)
            except Exception as error:
                raise RuntimeError(
                    f"report_to=mlflow could not start an MLflow run at tracking URI {mlflow.get_tracking_uri()!r}: "
                    f"{error} Set MLFLOW_TRACKING_URI to your tracking server (http://host:5000) or to a local store "
                    "(sqlite:///mlflow.db needs the full mlflow package, not mlflow-skinny)."
                ) from error
            params = [(key, str(value)) for key, value in config.shareable_dict().items()]
            for start in range(0, len(params), self.PARAMS_PER_CALL):
                mlflow.log_params(dict(params[start:start + self.PARAMS_PER_CALL]), run_id=active.info.run_id)
        self.run_id = active.info.run_id

    def log(self, row: dict) -> None:
        metrics = {self.metric_name(key): float(value) for key, value in row.items() if key != "step"}
        self.mlflow.log_metrics(metrics, step=row["step"], run_id=self.run_id)

    @staticmethod
    def metric_name(key: str) -> str:
        """``key`` with every character MLflow refuses in a metric name (it takes letters, digits and
        ``_-. :/``) replaced by "_": a lambda's reward is ``rewards/<lambda>/mean``."""
        return re.sub(r"[^\w\-. :/]", "_", key)

    def log_completions(self, step: int, completions) -> None:
        self.mlflow.log_table(
            completions.reset_index(drop=True), artifact_file=f"completions/step_{step}.json", run_id=self.run_id
        )

    def close(self, failed: bool = False) -> None:
        if self.owns_run:
            self.mlflow.end_run(status="FAILED" if failed else "FINISHED")


class CometReporter(_Reporter):
    """A Comet experiment named ``config.run_name``: the config as parameters, each metrics row at its
    optimizer step, and the printed completions as tables, ``completions/step_<N>.json``.

    Continues the experiment already running in the process (``comet_ml.start`` called by the user),
    else starts one with Comet's own settings: ``$COMET_API_KEY``, ``$COMET_PROJECT_NAME``, and
    ``COMET_START_ONLINE=false`` (with ``$COMET_OFFLINE_DIRECTORY``) to write an archive that
    ``comet upload`` sends later.
    """

    def __init__(self, config, output_dir: Path):
        import comet_ml

        self.experiment = comet_ml.get_running_experiment()
        self.owns_experiment = self.experiment is None
        if self.owns_experiment:
            self.experiment = comet_ml.start(experiment_config=comet_ml.ExperimentConfig(name=config.run_name))
        self.experiment.log_parameters(config.shareable_dict())

    def log(self, row: dict) -> None:
        self.experiment.log_metrics({key: value for key, value in row.items() if key != "step"}, step=row["step"])

    def log_completions(self, step: int, completions) -> None:
        self.experiment.log_table(f"completions/step_{step}.json", tabular_data=completions.reset_index(drop=True))

    def close(self, failed: bool = False) -> None:
        if self.owns_experiment:
            self.experiment.end()
