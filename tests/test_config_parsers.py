"""GRPOConfig under the parsers TRL scripts start with: transformers' ``HfArgumentParser`` and TRL's
``TrlParser``, alone and beside TRL's ``ScriptArguments`` and ``ModelConfig`` (command line, YAML
``--config`` file, ``--help``)."""

import warnings

import pytest
from transformers import HfArgumentParser
from trl import ModelConfig, ScriptArguments, TrlParser

from grpo_lab import GRPOConfig


def test_hf_argument_parser_builds_a_config_with_the_defaults_and_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # its debug=None and include_num_input_tokens_seen=False mean the defaults
        (parsed,) = HfArgumentParser(GRPOConfig).parse_args_into_dataclasses([])
    assert parsed.diff() == {}
    assert (parsed.debug, parsed.include_num_input_tokens_seen) == ("", "no")


def test_hf_argument_parser_reads_trls_command_line():
    (parsed,) = HfArgumentParser(GRPOConfig).parse_args_into_dataclasses([
        "--output_dir", "out", "--learning_rate", "1e-5", "--num-generations", "4", "--beta", "0.04",
        "--use_vllm", "false", "--reward_weights", "1", "0.5", "--model_init_kwargs", '{"dtype": "float32"}',
        "--report_to", "none", "--no_share_prompt_prefix",
    ])
    assert parsed.diff() == {"output_dir": "out", "learning_rate": 1e-5, "num_generations": 4, "beta": 0.04,
                             "reward_weights": [1.0, 0.5], "model_init_kwargs": {"dtype": "float32"},
                             "share_prompt_prefix": False}


def test_trl_parser_reads_a_yaml_config_beside_script_and_model_arguments_and_the_command_line_wins(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model_name_or_path: some/model\ndataset_name: some/data\nlearning_rate: 3.0e-6\n"
                      "num_generations: 4\nlr_scheduler_type: cosine\nenv:\n  GRPO_LAB_TEST_VARIABLE: set\n")
    parser = TrlParser((ScriptArguments, GRPOConfig, ModelConfig))
    script, config, model = parser.parse_args_and_config(
        ["--config", str(recipe), "--output_dir", str(tmp_path / "out"), "--num_generations", "2"])
    assert (script.dataset_name, model.model_name_or_path) == ("some/data", "some/model")
    assert config.diff() == {"output_dir": str(tmp_path / "out"), "learning_rate": 3e-6, "num_generations": 2,
                             "lr_scheduler_type": "cosine"}
    import os

    assert os.environ.pop("GRPO_LAB_TEST_VARIABLE") == "set"


def test_a_bad_value_from_the_parser_is_refused_by_the_config_with_its_fix():
    with pytest.raises(ValueError, match="loss_type"):
        HfArgumentParser(GRPOConfig).parse_args_into_dataclasses(["--loss_type", "nonsense"])


def test_help_lists_every_field_with_its_help():
    text = TrlParser((ScriptArguments, GRPOConfig, ModelConfig)).format_help()
    for name in ("beta", "num_generations", "share_prompt_prefix", "push_to_hub", "model_name_or_path"):
        assert f"--{name}" in text
    assert GRPOConfig.field_help("beta").split(".")[0] in " ".join(text.split())
