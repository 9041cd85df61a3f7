"""A credential given in the config (a Hugging Face token in ``model_init_kwargs``) is written to no
file a run leaves (saves, checkpoints, ``training_args.bin``, metrics) and sent to no tracker; a run
loaded from those files works, and the token given again is no config edit
(grpo_lab/credentials/config_values.py)."""

import warnings

import pytest

from grpo_lab import GRPOSession, GRPOTrainer
from grpo_lab.credentials.config_values import without_secrets
from tests.conftest import SMALL

TOKEN = "hf_aB3dE5gH7jK9mN1pQ3sT5vW7yZ9bD1fH3j"


def _files_holding(folder, text: str) -> list[str]:
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*")
                  if path.is_file() and text.encode() in path.read_bytes())


def test_credentials_are_left_out_by_name_and_by_form_and_the_rest_is_kept():
    values = {"model_init_kwargs": {"token": TOKEN, "dtype": "float32", "revision": "main"},
              "run_name": "plain", "reward_weights": [1.0, 2.0],
              "generation_kwargs": {"headers": {"Authorization": f"Bearer {TOKEN}"}, "stop": [TOKEN, "\n"]},
              "hub_model_id": TOKEN}
    clean, dropped = without_secrets(values)
    assert clean == {"model_init_kwargs": {"dtype": "float32", "revision": "main"}, "run_name": "plain",
                     "reward_weights": [1.0, 2.0], "generation_kwargs": {"headers": {}, "stop": ["\n"]},
                     "hub_model_id": None}
    assert dropped == ["model_init_kwargs['token']", "generation_kwargs['headers']['Authorization']",
                       "generation_kwargs['stop'][0]", "hub_model_id"]
    assert values["model_init_kwargs"]["token"] == TOKEN  # the given values are not touched
    # a placeholder and a token given as True (the cached login) are no credentials
    assert without_secrets({"model_init_kwargs": {"token": True, "api_key": "EMPTY"}})[1] == []


def test_a_token_in_model_init_kwargs_reaches_no_file_and_a_loaded_run_needs_it_again(
        task, tmp_path, offline_wandb, mlflow_store):
    args = task.config(**{**SMALL, "output_dir": str(tmp_path / "run"), "max_steps": 2, "save_steps": 1,
                          "model_init_kwargs": {"token": TOKEN, "dtype": "float32"}, "log_completions": True,
                          "report_to": ["wandb", "mlflow", "tensorboard"]})
    trainer = GRPOTrainer(task.model, task.reward_funcs, args=args, train_dataset=task.train_dataset)
    with pytest.warns(UserWarning, match=r"model_init_kwargs\['token'\] holds a credential.*HF_TOKEN"):
        trainer.train()
    trainer.save_model(tmp_path / "run" / "final")
    trainer.session.save(tmp_path / "notebook")
    with pytest.warns(UserWarning, match="train.py holds no secrets"):
        trainer.session.export_script(tmp_path / "export" / "train.py")
    assert trainer.args.model_init_kwargs["token"] == TOKEN  # the run keeps what it was given
    trainer.close()
    offline_wandb.finish()  # the run transformers' callback left open, ended and its files flushed
    offline_wandb.teardown()
    # every file the run wrote: checkpoints, the saved model, the session save, the export and its data,
    # and the trackers' own files (wandb offline, the MLflow file store, TensorBoard's events)
    for written in ("run/checkpoint-2/config.yaml", "run/final/training_args.bin", "export/train.py",
                    "export/train.data/train", "mlruns"):
        assert (tmp_path / written).exists(), written
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert list((tmp_path / "run" / "runs").rglob("events.out.tfevents.*"))
    assert _files_holding(tmp_path, TOKEN) == [] and _files_holding(tmp_path, TOKEN[3:]) == []
    loaded = GRPOSession.load(tmp_path / "notebook", reward_funcs=task.reward_funcs)
    assert loaded.config.model_init_kwargs == {"dtype": "float32"}
    args.max_steps = 3
    again = GRPOSession.load(tmp_path / "notebook", reward_funcs=task.reward_funcs, args=args)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*model_init_kwargs")  # the token given again is no edit
        again.step()
    assert "model_init_kwargs" not in [change["field"] for change in again.config_changes]
    assert again.config.model_init_kwargs["token"] == TOKEN
