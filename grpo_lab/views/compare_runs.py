"""Reading the runs that ``grpo_lab.compare`` takes: a live GRPOSession, a directory written by
``session.save()`` (a trainer's ``checkpoint-N`` is one), or a GRPOTrainer ``output_dir`` holding
``metrics.jsonl``. Files are read without building a model and without unpickling code: a save's
records through :func:`grpo_lab.state.checkpoint.load_records`, configs as YAML, metrics as JSON lines.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from grpo_lab import notices
from grpo_lab.config.args import function_reference
from grpo_lab.views.compare_data import Run, run_names

ACCEPTED = (
    "a GRPOSession, a directory written by session.save() (a trainer's checkpoint-N is one), or a GRPOTrainer "
    "output_dir holding metrics.jsonl"
)
METRICS_FILE = "metrics.jsonl"


def read_runs(runs, names=None) -> list[Run]:
    """Each of ``runs`` read once (a session's is read again by :func:`current`), named by
    :func:`grpo_lab.views.compare_data.run_names`: ``names``, else a session's ``name`` (a saved
    one's too) or the directory's name, else "run <position>"."""
    if not runs:
        raise ValueError(f"compare() needs at least one run: give {ACCEPTED}.")
    read = [_read(run, position) for position, run in enumerate(runs, start=1)]
    own_names = [run.name or None for run in read]
    return [dataclasses.replace(run, name=name) for run, name in zip(read, run_names(own_names, names))]


def current(run: Run) -> Run:
    """``run`` as it is now: a session's steps, config and fork point read again; a run read from
    files as it was read."""
    if run.session is None:
        return run
    return dataclasses.replace(run, **_session_parts(run.session))


def _read(run, position: int) -> Run:
    from grpo_lab.session.run_record import RunRecord

    if isinstance(getattr(run, "record", None), RunRecord):  # a session (or a fork): it keeps a run record
        return Run(getattr(run, "name", None) or "", source="session", session=run, **_session_parts(run))
    if isinstance(run, (str, os.PathLike)):
        return _read_directory(Path(run))
    raise TypeError(f"Run {position} is a {type(run).__name__}; compare() takes {ACCEPTED}.")


def _session_parts(session) -> dict:
    return {
        "rows": list(session.record.history),  # a copy: a training thread appends to the session's list
        # a function (dynamic_sampling_metric) by its name, as a save of the session holds it
        "config": {name: function_reference(value) if callable(value) else value
                   for name, value in session.config.to_dict().items()},
        "fork_point": getattr(session, "fork_point", None),
    }


def _read_directory(directory: Path) -> Run:
    from grpo_lab.state.checkpoint import STATE_FILE, load_records, trainer_checkpoints

    name = directory.resolve().name
    if (directory / STATE_FILE).exists():
        records = load_records(directory)
        if name.startswith("checkpoint-"):  # a trainer's: the run is its output_dir
            name = f"{directory.resolve().parent.name}/{name}"
        return Run(records.get("name") or name, records["history"], _saved_config(directory),
                   fork_point=records.get("fork_point"), source=f"saved session in {directory}")
    if (directory / METRICS_FILE).exists():
        checkpoints = trainer_checkpoints(directory)
        config = _saved_config(checkpoints[-1]) if checkpoints else None
        return Run(name, _metric_rows(directory / METRICS_FILE), config, source=f"trainer output in {directory}")
    found = "does not exist" if not directory.exists() else (
        "is a file" if not directory.is_dir() else f"holds neither {STATE_FILE} nor {METRICS_FILE}"
    )
    raise ValueError(f"{directory} {found}; compare() takes {ACCEPTED}.")


def _saved_config(directory: Path) -> dict | None:
    """The config saved in a checkpoint directory, every field this version has filled in (a saved
    config leaves out transformers' fields at their defaults); None where there is no config.yaml."""
    from grpo_lab.config.grpo_config import GRPOConfig, read_yaml_mapping

    path = directory / "config.yaml"
    if not path.exists():
        return None
    return {**GRPOConfig().to_dict(), **read_yaml_mapping(path)}


def _metric_rows(path: Path) -> list[dict]:
    """The rows of a trainer's ``metrics.jsonl``. A line that is not a row (cut short by a run stopped
    mid-write, or not written by grpo_lab) is left out, with a warning naming it; where the steps
    start again from a lower one, a fresh run was appended to the file (the trainer warns that it does
    so) and only the last run's rows are kept."""
    rows: list[dict] = []
    skipped: list[int] = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            if line.strip():
                skipped.append(number)
            continue
        if rows and row["step"] <= rows[-1]["step"]:
            rows = []
        rows.append(row)
    if skipped:
        shown = ", ".join(map(str, skipped[:5])) + (f" and {len(skipped) - 5} more" if len(skipped) > 5 else "")
        notices.warn(
            f"{path}: line(s) {shown} are not metric rows (a JSON object with an integer \"step\"): cut short by a "
            "run stopped while writing, or written by something else. They are left out of the comparison."
        )
    return rows
