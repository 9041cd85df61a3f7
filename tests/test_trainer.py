"""GRPOTrainer runs the session's own steps: same numbers, plus logs, checkpoints and resume."""

import json
import shutil
import warnings
import weakref
from pathlib import Path

import pandas as pd
import pytest
import torch

from grpo_lab.trainer.trainer import GRPOTrainer
from tests.conftest import SMALL


def _trainer(task, tmp_path, reward_funcs=None, eval_dataset=None, **overrides):
    config = task.config(**{**SMALL, "output_dir": str(tmp_path), **overrides})
    return GRPOTrainer(task.model, reward_funcs or task.reward_funcs, args=config, train_dataset=task.train_dataset,
                       eval_dataset=eval_dataset)


def _no_time(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.drop(columns=["step_time"]).reset_index(drop=True)


def test_trainer_and_session_give_identical_metrics_and_weights(make_session, task, tmp_path):
    session = make_session(max_steps=3, num_iterations=2)
    session.run(3, progress=False)
    trainer = _trainer(task, tmp_path / "t", max_steps=3, num_iterations=2)
    trainer.train()
    pd.testing.assert_frame_equal(_no_time(trainer.session.history), _no_time(session.history))
    for (name, a), (_, b) in zip(session.model.state_dict().items(), trainer.model.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_metrics_jsonl_checkpoint_rotation_and_save_model(task, tmp_path, capsys):
    trainer = _trainer(task, tmp_path, max_steps=4, save_steps=2, save_total_limit=1, log_completions=True,
                       num_completions_to_print=2)
    trainer.train()
    last = trainer.session.last_metrics
    printed = capsys.readouterr().out.splitlines()  # a table of 2 completions every logging step
    assert ([line.strip() for line in printed if "completions at step" in line]
            == [f"completions at step {n}" for n in (1, 2, 3, 4)])
    assert sum(line.startswith("│") for line in printed) == 4 * 2
    # every completion of each step in TRL's completions_<step>.parquet, TRL's columns first
    log = trainer.session.completions_log
    names = [f.__name__ for f in task.reward_funcs]
    for step in (1, 2, 3, 4):
        table = pd.read_parquet(tmp_path / "completions" / f"completions_{step:05d}.parquet")
        assert list(table.columns[:3 + len(names) + 1]) == ["step", "prompt", "completion", *names, "advantage"]
        expected = log[log["step"] == step].reset_index(drop=True)
        assert table["completion"].tolist() == expected["completion"].tolist()
        assert table["advantage"].tolist() == expected["advantage"].tolist()
        assert table[names[0]].tolist() == expected[f"rewards/{names[0]}"].tolist()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1] == last
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-4"]
    saved = trainer.save_model(tmp_path / "final")
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(saved)
    torch.testing.assert_close(reloaded.state_dict()["lm_head.weight"], trainer.model.state_dict()["lm_head.weight"])


def test_log_unique_prompts_shows_each_prompt_of_a_step_once_with_its_first_completion(task, tmp_path, capsys,
                                                                                       monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # a table as wide as its cells, whatever terminal runs the tests
    trainer = _trainer(task, tmp_path, max_steps=2, log_completions=True, log_unique_prompts=True)
    trainer.train()
    printed = [line.split("│")[1:3] for line in capsys.readouterr().out.splitlines() if line.startswith("│")]
    log = trainer.session.completions_log
    expected = []
    for step in (1, 2):
        rows = log[log["step"] == step]  # 2 prompts x 4 completions a step
        assert rows["prompt"].nunique() == 2
        expected += [[p, c] for p, c in rows.groupby("prompt", sort=False).first()["completion"].items()]
    assert [[cell.strip() for cell in row] for row in printed] == expected


def test_train_again_on_a_finished_run_does_nothing_until_max_steps_is_raised(task, tmp_path):
    trainer = _trainer(task, tmp_path, max_steps=2, report_to="tensorboard")
    trainer.train()
    last = trainer.session.last_metrics
    files = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    with pytest.warns(UserWarning, match=r"Nothing to train: the run is at step 2 of 2\. Raise max_steps"):
        again = trainer.train()
    assert again.global_step == 2 and trainer.session.last_metrics == last
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file()) == files  # no empty tracker run
    trainer.args.max_steps = 3
    assert trainer.train().global_step == 3
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def _tracked(row: dict, prefix: str = "train/") -> dict:
    """A ``log_history`` row as transformers' callbacks name it (``rewrite_logs``): ``train/<key>``,
    ``eval/<key>`` for ``eval_<key>``; numbers only, without ``step``."""
    named = {(f"eval/{key[5:]}" if key.startswith("eval_") else f"{prefix}{key}"): value
             for key, value in row.items() if key != "step"}
    return {key: value for key, value in named.items() if isinstance(value, (int, float))}


def test_tensorboard_receives_the_logged_rows_through_transformers_callback(task, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers.integrations import TensorBoardCallback

    trainer = _trainer(task, tmp_path, eval_dataset=task.eval_dataset, max_steps=2, report_to="tensorboard",
                       eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=4, num_generations_eval=2)
    assert sum(isinstance(c, TensorBoardCallback) for c in trainer.callback_handler.callbacks) == 1
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(tmp_path / "runs"))
    events.Reload()
    for name in ("reward", "loss", "entropy"):  # logging_steps=1: each logged row is one step's
        logged = [(e.step, e.value) for e in events.Scalars(f"train/{name}")]
        assert logged == [(r["step"], pytest.approx(r[name], rel=1e-6)) for r in rows]
    evaluations = [row for row in trainer.state.log_history if "eval_reward" in row]
    for name in ("reward", "loss"):  # the evaluations while training, at their steps
        logged = [(e.step, e.value) for e in events.Scalars(f"eval/{name}")]
        assert logged == [(r["step"], pytest.approx(r[f"eval_{name}"], rel=1e-6)) for r in evaluations]
        assert len(logged) == 2
    assert "learning_rate" in json.loads(events.Tensors("args/text_summary")[0].tensor_proto.string_val[0])

    # logging_steps=2: a row every second step, each metric the mean over its two steps (as TRL logs)
    windows = _trainer(task, tmp_path / "windows", max_steps=4, logging_steps=2, report_to="tensorboard")
    windows.train()
    steps = windows.session.history
    events = EventAccumulator(str(tmp_path / "windows" / "runs"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/reward")] == [
        (2, pytest.approx(steps["reward"].iloc[:2].mean(), rel=1e-6)),
        (4, pytest.approx(steps["reward"].iloc[2:].mean(), rel=1e-6))]


def _wandb_records(run_file):
    """The records of a .wandb file: a 7-byte header, then LevelDB log blocks of 32 KiB holding
    protobuf records, each in pieces with a 7-byte header (crc32, length, type: 1 whole, 2 first,
    3 middle, 4 last)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, pos, pending, block = run_file.read_bytes(), 7, b"", 32768
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending, pos = pending + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _wandb_history_and_config(run_file) -> tuple[dict, dict]:
    """``{optimizer step: {metric: value}}`` and the run's config, from a .wandb file."""
    history, config = {}, {}
    for record in _wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            if "train/global_step" in items:  # a row the trainer logged
                history.setdefault(items["train/global_step"], {}).update(items)
        if record.WhichOneof("record_type") == "run":
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        if record.WhichOneof("record_type") == "config":  # wandb.config.update after the run started
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
    return history, config


def test_wandb_receives_the_logged_rows_the_config_and_the_printed_completions(task, tmp_path, offline_wandb):
    trainer = _trainer(task, tmp_path / "out", max_steps=2, report_to="wandb", log_completions=True,
                       num_completions_to_print=3)
    trainer.train()
    offline_wandb.finish()  # transformers' callback leaves the run open for what follows train(): the user ends it
    offline_wandb.teardown()
    rows = [row for row in trainer.state.log_history if "reward" in row]
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    history, config = _wandb_history_and_config(run_file)
    assert sorted(history) == [1, 2]
    log = trainer.session.completions_log
    for row in rows:
        logged = history[row["step"]]
        assert {key: logged[key] for key in _tracked(row)} == pytest.approx(_tracked(row))
        table = json.loads((run_file.parent / "files" / logged["completions/path"]).read_text())
        printed = log[log["step"] == row["step"]].head(3)
        assert table["columns"] == list(printed.columns)
        column = table["columns"].index("completion")
        assert [r[column] for r in table["data"]] == printed["completion"].tolist()
    assert config["learning_rate"] == 1e-3 and config["max_steps"] == 2
    assert config["output_dir"] == str(tmp_path / "out")


def test_wandb_logs_into_a_run_the_user_started_and_leaves_it_open(task, tmp_path, offline_wandb):
    run = offline_wandb.init(project="mine", dir=str(tmp_path), config={"note": "kept"})
    for value in range(3):  # the user's own logging first: wandb's step counter is ahead of the trainer's steps
        run.log({"before_training": value})
    try:
        trainer = _trainer(task, tmp_path / "out", max_steps=2, report_to="wandb")
        trainer.train()
        assert offline_wandb.run is run and run.config["note"] == "kept" and run.config["max_steps"] == 2
    finally:
        run.finish()
        offline_wandb.teardown()
    assert not (tmp_path / "out" / "wandb").exists()
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    history, config = _wandb_history_and_config(run_file)
    assert sorted(history) == [1, 2] and history[2]["train/loss"] == trainer.session.history["loss"].iloc[-1]
    assert config["note"] == "kept"


def test_trackio_receives_the_logged_rows_the_config_and_the_printed_completions(task, tmp_path):
    from trackio import SQLiteStorage

    project = f"grpo_lab-{tmp_path.name}"
    trainer = _trainer(task, tmp_path, max_steps=2, report_to="trackio", project=project, run_name="first",
                       log_completions=True, num_completions_to_print=3)
    trainer.train()
    rows = [row for row in trainer.state.log_history if "reward" in row]
    logged = SQLiteStorage.get_logs(project, "first")
    metrics = {entry["train/global_step"]: entry for entry in logged if "train/reward" in entry}
    assert sorted(metrics) == [1, 2]
    for row in rows:
        assert {key: metrics[row["step"]][key] for key in _tracked(row)} == pytest.approx(_tracked(row))
    tables = {entry["train/global_step"]: entry["completions"]["_value"] for entry in logged if "completions" in entry}
    log = trainer.session.completions_log
    assert sorted(tables) == [1, 2]
    for step, table in tables.items():
        assert [r["completion"] for r in table] == log[log["step"] == step].head(3)["completion"].tolist()
    config = SQLiteStorage.get_run_config(project, "first")
    assert config["learning_rate"] == 1e-3 and config["max_steps"] == 2


def test_mlflow_receives_the_logged_rows_the_config_and_the_printed_completions(task, tmp_path, mlflow_store):
    # "<lambda>": not an MLflow name
    funcs = [*task.reward_funcs, lambda completions, **kwargs: [0.5] * len(completions)]
    trainer = _trainer(task, tmp_path / "out", reward_funcs=funcs, max_steps=2, report_to="mlflow", run_name="first",
                       log_completions=True, num_completions_to_print=3)
    trainer.train()
    rows = [row for row in trainer.state.log_history if "reward" in row]
    (run,) = mlflow_store.search_runs([e.experiment_id for e in mlflow_store.search_experiments()])
    assert run.info.run_name == "first" and run.info.status == "FINISHED"
    for name in ("reward", "loss", "entropy", "rewards/correctness_reward/mean", "rewards/<lambda>/mean"):
        history = mlflow_store.get_metric_history(run.info.run_id, name.replace("<lambda>", "_lambda_"))
        assert [(m.step, m.value) for m in history] == [(r["step"], pytest.approx(r[name])) for r in rows]
    assert run.data.params["learning_rate"] == "0.001" and run.data.params["max_steps"] == "2"
    assert len(run.data.params) > 100  # sent in requests of at most 100
    log = trainer.session.completions_log
    for step in (1, 2):
        path = mlflow_store.download_artifacts(run.info.run_id, f"completions/step_{step}.json", str(tmp_path))
        table = json.loads(Path(path).read_text())
        column = table["columns"].index("completion")
        assert [r[column] for r in table["data"]] == log[log["step"] == step].head(3)["completion"].tolist()


def test_mlflow_logs_into_a_run_the_user_started_and_leaves_it_open(task, tmp_path, mlflow_store):
    import mlflow

    with mlflow.start_run(run_name="mine") as run:
        mlflow.log_param("note", "mine")
        _trainer(task, tmp_path / "out", max_steps=2, report_to="mlflow").train()
        assert mlflow.active_run().info.run_id == run.info.run_id  # still open: the user ends it
    finished = mlflow_store.get_run(run.info.run_id)
    assert finished.data.params["note"] == "mine" and finished.data.params["max_steps"] == "2"
    assert finished.info.status == "FINISHED"
    assert [m.step for m in mlflow_store.get_metric_history(run.info.run_id, "loss")] == [1, 2]


def test_comet_receives_the_logged_rows_the_config_and_the_printed_completions(task, tmp_path, monkeypatch):
    import zipfile

    import comet_ml

    monkeypatch.setenv("COMET_START_ONLINE", "false")  # an archive for `comet upload`, no account
    monkeypatch.setenv("COMET_OFFLINE_DIRECTORY", str(tmp_path / "comet"))
    trainer = _trainer(task, tmp_path / "out", max_steps=2, report_to="comet_ml", run_name="first",
                       log_completions=True, num_completions_to_print=3)
    trainer.train()
    comet_ml.get_running_experiment().end()  # as the process's exit ends it: the archive is written then
    rows = [row for row in trainer.state.log_history if "reward" in row]
    (archive,) = (tmp_path / "comet").glob("*.zip")
    with zipfile.ZipFile(archive) as files:
        messages = [json.loads(line) for line in files.read("messages.json").splitlines()]
        tables = [m["payload"] for m in messages
                  if m["type"] == "file_upload" and m["payload"]["upload_type"] == "dataframe"]
        uploads = {t["additional_params"]["fileName"]: json.loads(files.read(t["file_path"])) for t in tables}
    metrics = {(m["payload"]["metric"]["step"], m["payload"]["metric"]["metricName"]):
               m["payload"]["metric"]["metricValue"]
               for m in messages if m["type"] == "metric_msg"}
    for row in rows:
        assert {key: metrics[row["step"], key] for key in _tracked(row)} == pytest.approx(_tracked(row))
    # Comet stores a single value under "param" and a list value (include_for_metrics) under "params"
    params = {p["paramName"]: p["paramValue"] for p in (m["payload"].get("param") or m["payload"]["params"]
                                                         for m in messages if m["type"] == "parameter_msg")}
    assert params["args|learning_rate"] == 1e-3 and params["args|max_steps"] == 2  # flattened by the callback
    names = [m["payload"]["value"] for m in messages if m["type"] == "log_other" and m["payload"]["key"] == "Name"]
    assert names == ["first"]
    log = trainer.session.completions_log
    for step in (1, 2):
        table = uploads[f"completions/step_{step}.json"]
        assert list(table["completion"].values()) == log[log["step"] == step].head(3)["completion"].tolist()


def test_a_tracker_whose_package_is_missing_is_refused_before_the_model_loads(task, tmp_path, monkeypatch, capfd):
    import sys

    monkeypatch.setitem(sys.modules, "comet_ml", None)  # how Python marks a module as not importable
    capfd.readouterr()
    with pytest.raises(ImportError, match=r"report_to=comet_ml needs its package: pip install comet-ml"):
        _trainer(task, tmp_path, report_to=["tensorboard", "comet_ml"])
    assert "Loading weights" not in capfd.readouterr().err


def test_save_and_logging_steps_below_one_are_fractions_of_the_run_rounded_up(task, tmp_path, capsys):
    trainer = _trainer(task, tmp_path, max_steps=4, save_steps=0.5, logging_steps=0.6, log_completions=True,
                       num_completions_to_print=1)
    trainer.train()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    printed = capsys.readouterr().out
    assert [step for step in range(1, 5) if f"completions at step {step}" in printed] == [3]  # ceil(0.6 * 4)
    _trainer(task, tmp_path / "tenth", max_steps=4, save_steps=0.1).train()
    assert len(list((tmp_path / "tenth").glob("checkpoint-*"))) == 4  # ceil(0.1 * 4) = every step


def _as_format_1(checkpoint: Path) -> None:
    """Rewrite a checkpoint in the layout grpo_lab wrote before format version 2: the model's and
    tokenizer's files in model/, the optimizer and schedule inside trainer_state.pt."""
    from grpo_lab.state.checkpoint import STATE_FILE

    state = torch.load(checkpoint / STATE_FILE, weights_only=True)
    state["optimizer"] = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    state["scheduler"] = torch.load(checkpoint / "scheduler.pt", weights_only=True)
    state["format_version"] = 1
    torch.save(state, checkpoint / STATE_FILE)
    (checkpoint / "model").mkdir()
    for entry in list(checkpoint.iterdir()):
        if entry.suffix in {".safetensors", ".jinja"} or entry.name in {"config.json", "generation_config.json"} \
                or entry.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            entry.rename(checkpoint / "model" / entry.name)
        elif entry.name in {"optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin", "README.md"}:
            entry.unlink()
    (checkpoint / "COMPLETE").write_text("ok\n")


def test_a_checkpoint_is_trls_model_folder_with_its_files_and_an_older_layout_resumes_alike(task, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer = _trainer(task, tmp_path / "run", max_steps=3, save_steps=2)
    trainer.train()
    checkpoint = tmp_path / "run" / "checkpoint-2"
    # what TRL's checkpoint-N holds, each readable by the tool a TRL user reads it with
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    AutoTokenizer.from_pretrained(checkpoint)
    optimizer = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert set(optimizer) == {"state", "param_groups"} and len(optimizer["state"]) == len(list(model.parameters()))
    assert torch.load(checkpoint / "scheduler.pt", weights_only=True)["last_epoch"] == 2
    rng = torch.load(checkpoint / "rng_state.pth", weights_only=False)
    assert {"python", "numpy", "cpu"} <= set(rng) and rng["numpy"][0] == "MT19937"
    assert torch.load(checkpoint / "training_args.bin", weights_only=False).max_steps == 3
    assert json.loads((checkpoint / "trainer_state.json").read_text())["global_step"] == 2
    assert (checkpoint / "README.md").read_text().startswith("---")
    listed = json.loads((checkpoint / "COMPLETE").read_text())["entries"]
    assert sorted(listed) == sorted(entry.name for entry in checkpoint.iterdir() if entry.name != "COMPLETE")

    # the same run resumed from this checkpoint and from it rewritten in the format-1 layout: alike
    resumed = _trainer(task, tmp_path / "new", max_steps=3)
    resumed.train(resume_from_checkpoint=checkpoint)
    older = tmp_path / "older" / "checkpoint-2"
    shutil.copytree(checkpoint, older)
    _as_format_1(older)
    from_older = _trainer(task, tmp_path / "older_resumed", max_steps=3)
    from_older.train(resume_from_checkpoint=older)
    pd.testing.assert_frame_equal(_no_time(from_older.session.history), _no_time(resumed.session.history))
    pd.testing.assert_frame_equal(_no_time(resumed.session.history), _no_time(trainer.session.history))
    for name, value in trainer.model.state_dict().items():
        torch.testing.assert_close(from_older.model.state_dict()[name], value, rtol=0, atol=0, msg=name)


def test_a_crashed_run_resumes_from_its_checkpoint_and_finishes_identically(task, tmp_path, capsys, offline_wandb,
                                                                          mlflow_store):
    reference = _trainer(task, tmp_path / "ref", max_steps=4)
    reference.train()

    calls = {"n": 0}

    def crashes_on_third_step(completions, **kwargs):
        calls["n"] += 1
        if 3 <= calls["n"] < 100:  # a failure that a retry of the call meets again
            raise RuntimeError("simulated crash")
        return [0.0] * len(completions)

    funcs = [*task.reward_funcs, crashes_on_third_step]
    crashed = _trainer(task, tmp_path / "run", reward_funcs=funcs, max_steps=4, save_steps=2,
                       report_to=["tensorboard", "wandb", "mlflow"])
    with pytest.raises(RuntimeError, match="simulated crash"):
        crashed.train()
    assert (tmp_path / "run" / "checkpoint-2" / "COMPLETE").exists()
    # the trackers were closed on the way out, and the wandb run is marked as failed
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "runs"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2]
    offline_wandb.teardown()
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    exits = [r.exit.exit_code for r in _wandb_records(run_file) if r.WhichOneof("record_type") == "exit"]
    assert exits == [1] and sorted(_wandb_history_and_config(run_file)[0]) == [1, 2]
    (run,) = mlflow_store.search_runs([e.experiment_id for e in mlflow_store.search_experiments()])
    assert run.info.status == "FAILED"
    assert [m.step for m in mlflow_store.get_metric_history(run.info.run_id, "loss")] == [1, 2]

    calls["n"] = 100  # the crash does not happen again
    resumed = _trainer(task, tmp_path / "run", reward_funcs=funcs, max_steps=4, save_steps=2)
    capsys.readouterr()
    resumed.train(resume_from_checkpoint=True)
    assert " 4/4 " in capsys.readouterr().out  # the bar counts the run's steps, from the two already taken
    history = resumed.session.history.drop(columns=["rewards/crashes_on_third_step/mean",
                                                    "rewards/crashes_on_third_step/std"])
    pd.testing.assert_frame_equal(_no_time(history), _no_time(reference.session.history))


def test_a_resumed_run_logs_the_steps_after_its_checkpoint_once(task, tmp_path):
    # the first run logs steps 1 to 3 and checkpoints steps 2 and 3; resuming from checkpoint-2 is
    # what a run stopped after logging step 3, before checkpointing it, does
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import pandas as pd

    logging = {"report_to": "tensorboard", "log_completions": True, "num_completions_to_print": 0}
    _trainer(task, tmp_path, max_steps=3, save_steps=2, **logging).train()
    rows = lambda: [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    first = rows()
    step_3 = pd.read_parquet(tmp_path / "completions" / "completions_00003.parquet")
    with open(tmp_path / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 4, "loss": 0.')  # a line the stop cut short
    logged_after = r"held 2 row\(s\) logged after step 2, the step this run resumes from"
    with pytest.warns(UserWarning, match=logged_after) as caught:
        _trainer(task, tmp_path, max_steps=3, save_steps=2, **logging).train(
            resume_from_checkpoint=tmp_path / "checkpoint-2")
    assert any("held the completions of 1 step(s) logged after step 2" in str(w.message) for w in caught)
    assert sorted(p.name for p in (tmp_path / "completions").iterdir()) == [
        f"completions_0000{step}.parquet" for step in (1, 2, 3)]
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "completions" / "completions_00003.parquet"), step_3)
    again = rows()
    assert [row["step"] for row in again] == [1, 2, 3]
    without_time = lambda row: {name: value for name, value in row.items() if name != "step_time"}  # noqa: E731
    assert [without_time(row) for row in again] == [without_time(row) for row in first]
    assert len(list((tmp_path / "runs").glob("events.out.tfevents.*"))) == 2  # one file per run
    events = EventAccumulator(str(tmp_path / "runs"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (r["step"], pytest.approx(r["loss"])) for r in again]


@pytest.mark.parametrize("own_scheduler", [False, True])
def test_a_run_with_its_own_optimizer_resumes_into_the_model_that_optimizer_holds(task, tmp_path, own_scheduler):
    """Resumed with a larger max_steps; a scheduler of the caller's own goes on as it is, one built
    by grpo_lab (constant here) is rebuilt for the new length."""
    from transformers import AutoModelForCausalLM

    def trainer(out, max_steps):
        model = AutoModelForCausalLM.from_pretrained(task.model)
        embeddings = list(model.get_input_embeddings().parameters())
        rest = [p for p in model.parameters() if all(p is not e for e in embeddings)]
        optimizer = torch.optim.AdamW([{"params": rest, "lr": 1e-2}, {"params": embeddings, "lr": 1e-3}])
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step) if own_scheduler else None
        config = task.config(**{**SMALL, "output_dir": str(out), "max_steps": max_steps,
                                "lr_scheduler_type": "constant"})
        return GRPOTrainer(model, task.reward_funcs, args=config, train_dataset=task.train_dataset,
                           optimizers=(optimizer, scheduler))

    reference = trainer(tmp_path / "ref", 4)
    reference.train()
    trainer(tmp_path / "run", 2).train()
    resumed = trainer(tmp_path / "run", 4)
    resumed.train(resume_from_checkpoint=tmp_path / "run" / "checkpoint-2")
    pd.testing.assert_frame_equal(_no_time(resumed.session.history), _no_time(reference.session.history))
    for (name, a), (_, b) in zip(reference.model.state_dict().items(), resumed.model.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "checkpoint-2").state_dict()
    assert any(not torch.equal(saved[name], value)
               for name, value in resumed.model.state_dict().items() if name in saved)
    expected = [1e-2 * 0.5**step for step in range(4)] if own_scheduler else [1e-2] * 4
    assert resumed.session.history["learning_rate"].tolist() == pytest.approx(expected, rel=1e-6)
    if own_scheduler:  # a new shape for the caller's scheduler is refused before the run starts
        reshaped = trainer(tmp_path / "run", 4)
        reshaped.args.lr_scheduler_type = "linear"
        with pytest.raises(ValueError, match="lr_scheduler_type='linear'.*"
                                             "saved with lr_scheduler_type='constant'.*would have no effect"):
            reshaped.train(resume_from_checkpoint=tmp_path / "run" / "checkpoint-2")


def test_a_resume_frees_the_model_it_replaces_before_loading_and_a_failed_one_can_be_retried(
    task, tmp_path, monkeypatch
):
    from grpo_lab.session.session import GRPOSession

    reference = _trainer(task, tmp_path / "ref", max_steps=3)
    reference.train()
    _trainer(task, tmp_path / "run", max_steps=2).train()

    trainer = _trainer(task, tmp_path / "run", max_steps=3)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        trainer.train(resume_from_checkpoint=tmp_path / "run" / "checkpoint-9")
    assert trainer.session is not None  # a wrong path is found before anything is released

    replaced, freed_before_load = weakref.ref(trainer.model), []
    load = GRPOSession.load.__func__

    def load_and_note(cls, *args, **kwargs):
        freed_before_load.append(replaced() is None)
        return load(cls, *args, **kwargs)

    monkeypatch.setattr(GRPOSession, "load", classmethod(load_and_note))
    trainer.args.seed = 7  # refused by load, after the old model is gone
    with pytest.raises(ValueError, match="seed=7"):
        trainer.train(resume_from_checkpoint=True)
    assert freed_before_load == [True]
    with pytest.raises(RuntimeError, match=r"released its model for a resume that failed.*"
                                           r"train\(resume_from_checkpoint"):
        trainer.train()
    trainer.args.seed = 0
    trainer.train(resume_from_checkpoint=True)
    pd.testing.assert_frame_equal(_no_time(trainer.session.history), _no_time(reference.session.history))


def test_lora_save_model_writes_the_adapter_or_a_merged_model(task, tmp_path):
    from peft import LoraConfig, PeftModel
    from transformers import AutoModelForCausalLM

    config = task.config(**{**SMALL, "output_dir": str(tmp_path), "max_steps": 2})
    trainer = GRPOTrainer(
        task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    trainer.train()
    adapter = trainer.save_model(tmp_path / "adapter")
    assert (adapter / "adapter_config.json").exists() and not (adapter / "model.safetensors").exists()
    merged = trainer.save_model(tmp_path / "merged", merged=True)
    assert not (merged / "adapter_config.json").exists()
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        expected = trainer.model(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(task.model)
        from_adapter = PeftModel.from_pretrained(base, adapter)(input_ids=ids).logits
        from_merged = AutoModelForCausalLM.from_pretrained(merged)(input_ids=ids).logits
    torch.testing.assert_close(from_adapter, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(from_merged, expected, rtol=1e-4, atol=1e-4)
    assert any("lora_" in name for name, _ in trainer.model.named_parameters())  # training model not merged


def test_the_end_of_training_is_always_checkpointed(task, tmp_path):
    trainer = _trainer(task, tmp_path, max_steps=2, save_steps=50)
    trainer.train()
    trainer.args.max_steps = 3  # the same trainer trains on: its own files are no earlier run
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*from an earlier run")
        trainer.train()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    again = _trainer(task, tmp_path, max_steps=3, save_steps=50)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*from an earlier run")
        again.train(resume_from_checkpoint=True)
    assert again.session.global_step == 3


def test_a_fresh_run_never_replaces_or_rotates_away_another_runs_checkpoints(task, tmp_path):
    earlier = _trainer(task, tmp_path, max_steps=2, save_steps=1)
    earlier.train()
    written = {p.name: (p / "COMPLETE").stat().st_mtime_ns for p in tmp_path.glob("checkpoint-*")}
    assert sorted(written) == ["checkpoint-1", "checkpoint-2"]
    fresh = _trainer(task, tmp_path, max_steps=1)
    with pytest.raises(FileExistsError, match=r"already holds checkpoint-1, checkpoint-2 from an earlier run.*"
                                              r"resume_from_checkpoint=True.*overwrite_output_dir=True"):
        fresh.train()
    assert fresh.session.global_step == 0
    assert {p.name: (p / "COMPLETE").stat().st_mtime_ns for p in tmp_path.glob("checkpoint-*")} == written
    # asked for, a new run trains there: it replaces the steps it saves and rotates its own checkpoints alone,
    # never the earlier run's later one
    foreign = tmp_path / "checkpoint-500"
    (tmp_path / "checkpoint-2").rename(foreign)
    again = _trainer(task, tmp_path, max_steps=3, save_steps=1, save_total_limit=1, overwrite_output_dir=True)
    with pytest.warns(UserWarning, match=r"already holds checkpoint-1, checkpoint-500, metrics.jsonl from an "
                                         r"earlier run.*replaces checkpoints of the same step"):
        again.train()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-500"]
    # resumed in the same folder, the run counts the checkpoints up to the one it resumed from as its own
    resumed = _trainer(task, tmp_path, max_steps=5, save_steps=1, save_total_limit=2)
    resumed.train(resume_from_checkpoint=tmp_path / "checkpoint-3")
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-5", "checkpoint-500"]


def test_close_frees_the_model_optimizer_and_accelerators_references_and_a_closed_trainer_says_so(task, tmp_path):
    trainer = _trainer(task, tmp_path, max_steps=1)
    trainer.train()
    model, accelerator = weakref.ref(trainer.session.engine.model), trainer.accelerator
    assert accelerator._models  # accelerate keeps the prepared model until told otherwise
    trainer.close()
    assert model() is None and accelerator._models == [] and accelerator._optimizers == []
    trainer.close()  # a second close does nothing
    with pytest.raises(RuntimeError, match="has no model: it was closed"):
        trainer.train()


def test_the_trackers_see_the_config_without_credentials_and_refuse_what_they_cannot_do(task, tmp_path, monkeypatch):
    import copy

    from grpo_lab.errors import ConfigError
    from grpo_lab.trainer.trackers import TrackerArgs

    # an entry of its own: the warning that names an entry is said once a process (another test waits for 'token')
    token = "hf_" + "Tr4ckerT0ken" * 3
    config = task.config(**{**SMALL, "output_dir": str(tmp_path)}, model_init_kwargs={"api_key": token,
                                                                                      "dtype": "float32"})
    seen = TrackerArgs(config, tmp_path / "out")
    # read through, credentials left out
    assert seen.model_init_kwargs == {"dtype": "float32"} and seen.learning_rate == config.learning_rate
    assert seen.output_dir == str(tmp_path / "out") and token not in seen.to_json_string()
    assert copy.deepcopy(seen).learning_rate == config.learning_rate  # transformers' callbacks copy it
    assert json.loads(seen.to_json_string())["learning_rate"] == config.learning_rate
    monkeypatch.setenv("WANDB_LOG_MODEL", "end")
    with pytest.raises(ConfigError, match="WANDB_LOG_MODEL=end.*WANDB_LOG_MODEL=checkpoint"):
        _trainer(task, tmp_path, report_to="wandb")
