"""A TRL script's config carries over: every field of TRL 1.16's GRPOConfig and of the installed
transformers' TrainingArguments is a GRPOConfig field, implemented, accepted without effect (with a
warning once, where TRL would have acted on it) or refused with the reason."""

import dataclasses
import warnings

import pytest
import yaml
from transformers import TrainingArguments
from transformers.trainer_utils import IntervalStrategy

from grpo_lab import GRPOConfig, GRPOTrainer
from grpo_lab.config import trainer_args as rules
from tests.conftest import SMALL


def _defaults(config_class) -> dict:
    return {f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            for f in dataclasses.fields(config_class) if f.init}


def test_every_field_of_trls_grpo_config_constructs_with_trls_default():
    from trl import GRPOConfig as TRLConfig

    trl_defaults = _defaults(TRLConfig)
    assert len(trl_defaults) > 150
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a TRL default is never worth a warning
        for name, default in trl_defaults.items():
            GRPOConfig(**{name: default})
        GRPOConfig(**trl_defaults)


def test_every_training_arguments_field_of_the_installed_transformers_is_a_field():
    assert set(_defaults(TrainingArguments)) <= {f.name for f in dataclasses.fields(GRPOConfig)}


def test_the_fields_read_from_transformers_source_match_the_class():
    read = rules.training_arguments()
    for field in dataclasses.fields(TrainingArguments):
        if not field.init:
            continue
        _, default, help_text = read[field.name]
        expected = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
        assert default is rules.UNREAD or default == expected, field.name
        assert help_text == " ".join(field.metadata.get("help", "").split()), field.name
    assert read["optim"][1] is rules.UNREAD  # a name in the source, not a literal; GRPOConfig declares optim


def test_import_does_not_load_torch():
    import subprocess
    import sys

    code = "import sys, grpo_lab; grpo_lab.GRPOConfig(eval_steps=3); print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def test_an_inert_field_warns_once_naming_the_reason(monkeypatch):
    monkeypatch.setattr(rules, "_warned", set())
    with pytest.warns(UserWarning, match=r"dataloader_num_workers=4 has no effect in grpo_lab: .*no DataLoader"):
        GRPOConfig(dataloader_num_workers=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GRPOConfig(dataloader_num_workers=2)  # once per field
        GRPOConfig(eval_steps=5, do_eval=True, label_names=["x"])  # no effect in TRL's GRPOTrainer either


@pytest.mark.parametrize(("values", "reason"), [
    ({"eval_strategy": "epoch"}, "it takes 'no', 'steps'"),
    ({"push_to_hub": True}, "nothing is uploaded to the Hub"),
    ({"hub_token": "hf_secret"}, "written into checkpoints and exported scripts"),
    ({"deepspeed": "ds.json"}, "accelerate launch"),
    ({"neftune_noise_alpha": 5.0}, "NEFTune"),
    ({"save_strategy": "epoch"}, "it takes 'steps', 'no'"),
])
def test_a_refused_field_names_the_reason(values, reason):
    with pytest.raises(NotImplementedError, match=reason):
        GRPOConfig(**values)


def test_misspelled_trainer_fields_get_a_suggestion():
    with pytest.raises(TypeError, match="did you mean 'eval_strategy'"):
        GRPOConfig(eval_stratgy="no")


def test_enums_are_stored_as_strings_and_round_trip_through_yaml(tmp_path):
    config = GRPOConfig(logging_strategy=IntervalStrategy.NO)
    assert type(config.logging_strategy) is str and config.logging_strategy == "no"
    assert GRPOConfig(**yaml.safe_load(config.to_yaml())).logging_strategy == "no"


def test_activation_checkpointing_is_transformers_5s_name_for_gradient_checkpointing():
    assert GRPOConfig(activation_checkpointing=False).gradient_checkpointing is False
    kwargs = {"use_reentrant": False}
    assert GRPOConfig(activation_checkpointing_kwargs=kwargs).gradient_checkpointing_kwargs == kwargs
    assert GRPOConfig().gradient_checkpointing is True  # TRL's default, unchanged when the new name is unset


def test_command_line_takes_trainer_fields():
    config = GRPOConfig.from_args(["--logging_first_step", "--include_for_metrics", "inputs,loss"])
    assert config.logging_first_step is True and config.include_for_metrics == ["inputs", "loss"]


def _trainer(task, tmp_path, **overrides):
    config = task.config(**{**SMALL, "output_dir": str(tmp_path), "disable_tqdm": True, **overrides})
    return GRPOTrainer(task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset)


def test_logging_and_save_strategies_and_logging_first_step_drive_the_trainer(task, tmp_path):
    trainer = _trainer(task, tmp_path / "a", max_steps=3, logging_steps=2, logging_first_step=True,
                       save_strategy="no")
    trainer.train()
    assert [row["step"] for row in trainer.state.log_history] == [1, 2, 3]  # step 1, logging_steps, the close
    assert not list((tmp_path / "a").glob("checkpoint-*"))
    quiet = _trainer(task, tmp_path / "b", max_steps=2, logging_steps=1, logging_strategy="no", save_steps=1)
    quiet.train()
    assert [row["step"] for row in quiet.state.log_history] == [2]  # the closing row only
    assert "train_loss" in quiet.state.log_history[0]
    assert sorted(p.name for p in (tmp_path / "b").glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]


def test_activation_checkpointing_is_applied_once_and_a_later_edit_stands():
    config = GRPOConfig(activation_checkpointing=False)
    assert config.activation_checkpointing is None and config.gradient_checkpointing is False
    config.gradient_checkpointing = True
    config.validate()
    assert config.gradient_checkpointing is True


def test_config_files_name_trainer_fields_only_where_set_and_checkpoints_drop_unknown_ones(tmp_path):
    from grpo_lab.session.files import _saved_config

    text = GRPOConfig(logging_first_step=True).to_yaml()
    assert "logging_first_step: true" in text and "dataloader_num_workers" not in text
    path = tmp_path / "config.yaml"
    path.write_text(text + "a_field_of_another_transformers: 3\n")
    with pytest.warns(UserWarning, match="sets a_field_of_another_transformers, which this GRPOConfig does not have"):
        assert _saved_config(path).logging_first_step is True
