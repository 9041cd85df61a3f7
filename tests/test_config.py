"""GRPOConfig: TRL's names and defaults, validation with actionable errors, derived values, I/O."""

import pytest
import yaml

from grpo_lab.config.grpo_config import NOT_YET_IMPLEMENTED, GRPOConfig, steps_between

# TRL 1.16's GRPO-specific GRPOConfig fields with their defaults (fields beyond TrainingArguments).
TRL_1_16_GRPO_DEFAULTS = {
    'model_init_kwargs': None,
    'trust_remote_code': False,
    'router_aux_loss_coef': None,
    'disable_dropout': False,
    'cast_lm_head_to_fp32': False,
    'num_generations': 8,
    'num_generations_eval': None,
    'max_completion_length': 512,
    'ds3_gather_for_generation': True,
    'shuffle_dataset': True,
    'pad_to_multiple_of': 'auto',
    'generation_batch_size': None,
    'steps_per_generation': None,
    'temperature': 1.0,
    'top_p': 1.0,
    'top_k': 0,
    'min_p': None,
    'generation_kwargs': None,
    'chat_template_kwargs': None,
    'repetition_penalty': 1.0,
    'cache_implementation': None,
    'use_vllm': False,
    'vllm_mode': 'colocate',
    'vllm_model_impl': 'vllm',
    'vllm_enable_sleep_mode': False,
    'vllm_structured_outputs_regex': None,
    'vllm_server_base_url': None,
    'vllm_server_host': '0.0.0.0',
    'vllm_server_port': 8000,
    'vllm_server_timeout': 240.0,
    'vllm_group_port': 51216,
    'vllm_gpu_memory_utilization': 0.3,
    'vllm_max_model_length': None,
    'vllm_tensor_parallel_size': 1,
    'beta': 0.0,
    'num_iterations': 1,
    'epsilon': 0.2,
    'delta': None,
    'epsilon_high': None,
    'sapo_temperature_neg': 1.05,
    'sapo_temperature_pos': 1.0,
    'vespo_k_pos': 2.0,
    'vespo_lambda_pos': 3.0,
    'vespo_k_neg': 3.0,
    'vespo_lambda_neg': 2.0,
    'importance_sampling_level': 'token',
    'reward_weights': None,
    'multi_objective_aggregation': 'sum_then_normalize',
    'scale_rewards': 'group',
    'loss_type': 'dapo',
    'mask_truncated_completions': False,
    'sync_ref_model': False,
    'ref_model_mixup_alpha': 0.6,
    'ref_model_sync_steps': 512,
    'top_entropy_quantile': 1.0,
    'entropy_coef': 0.0,
    'use_adaptive_entropy': False,
    'entropy_coef_min': 0.0,
    'entropy_coef_max': 1.0,
    'entropy_coef_delta': 0.005,
    'entropy_target': 0.2,
    'max_tool_calling_iterations': None,
    'vllm_importance_sampling_correction': True,
    'vllm_importance_sampling_mode': 'sequence_mask',
    'vllm_importance_sampling_clip_max': 3.0,
    'vllm_importance_sampling_clip_min': None,
    'off_policy_mask_threshold': None,
    'use_bias_correction_kl': True,
    'log_completions': False,
    'log_multimodal': True,
    'num_completions_to_print': None,
    'log_unique_prompts': False,
    'log_completions_hub_repo': None,
    'use_transformers_continuous_batching': False,
    'transformers_continuous_batching_config': None,
    'use_transformers_paged': False,
    'vllm_importance_sampling_cap': None,}
# Training fields whose TRL GRPOConfig default differs from TrainingArguments'.
TRL_1_16_TRAINING_DEFAULTS = {"learning_rate": 1e-06, "gradient_checkpointing": True, "logging_steps": 10, "bf16": None}


def test_at_least_90_percent_of_trl_grpo_fields_are_accepted_with_trl_defaults():
    config = GRPOConfig()
    same = [name for name, default in TRL_1_16_GRPO_DEFAULTS.items()
            if hasattr(config, name) and getattr(config, name) == default]
    missing = sorted(set(TRL_1_16_GRPO_DEFAULTS) - set(same))
    assert len(same) / len(TRL_1_16_GRPO_DEFAULTS) >= 0.9, missing
    for name, default in TRL_1_16_TRAINING_DEFAULTS.items():
        assert getattr(config, name) == default, name


def test_default_config_builds_on_cpu_and_resolves_to_fp32():
    config = GRPOConfig(use_cpu=True)
    assert config.resolved_precision() == "fp32"
    assert GRPOConfig(bf16=True).resolved_precision() == "bf16"
    assert GRPOConfig(bf16=False).resolved_precision() == "fp32"


@pytest.mark.parametrize(
    ("kwargs", "error", "fragments"),
    [
        ({"loss_type": "nope"}, ValueError, ["loss_type='nope'", "'dapo'", "'grpo'"]),
        ({"loss_type": "grp"}, ValueError, ["Did you mean 'grpo'"]),
        ({"num_generations": 1}, ValueError, ["num_generations must be at least 2", "num_generations=2"]),
        ({"lerning_rate": 1e-5}, TypeError, ["did you mean 'learning_rate'"]),
        ({"max_prompt_length": 512}, TypeError, ["a field TRL removed before 1.16", "keeps every prompt whole",
                                                 "dataset.filter("]),
        ({"wandb_log_unique_prompts": True}, TypeError, ["use log_unique_prompts=True"]),
        ({"scale_rewards": "batchh"}, ValueError, ["'group', 'batch', 'none'"]),
        ({"importance_sampling_level": "seq"}, ValueError, ["'token', 'sequence'"]),
        ({"epsilon": 0.0}, ValueError, ["epsilon must be > 0"]),
        ({"top_p": 0.0}, ValueError, ["top_p must be in (0, 1]"]),
        ({"top_p": 1.5}, ValueError, ["top_p must be in (0, 1]"]),
        ({"top_entropy_quantile": 1.2}, ValueError, ["top_entropy_quantile must be in [0, 1]"]),
        ({"temperature": 0}, ValueError, ["temperature must be > 0"]),
        ({"beta": -0.1}, ValueError, ["beta must be >= 0"]),
        ({"delta": 1.1}, ValueError, ["delta must be greater than 1 + epsilon_high = 1.2"]),
        ({"generation_batch_size": 16, "steps_per_generation": 2}, ValueError, ["cannot both be set"]),
        ({"per_device_train_batch_size": 6}, ValueError, ["multiple of num_generations (8)"]),
        ({"generation_batch_size": 20, "per_device_train_batch_size": 8, "num_generations": 4}, ValueError,
         ["multiple of per_device_train_batch_size"]),
        ({"bf16": True, "fp16": True}, ValueError, ["cannot both be True"]),
        ({"max_steps": 0}, ValueError, ["max_steps must be a positive number"]),
        ({"reward_weights": [1.0, "a"]}, ValueError, ["reward_weights must be a list of numbers"]),
        ({"generation_kwargs": "{bad"}, ValueError, ["generation_kwargs is not valid JSON"]),
        ({"report_to": "tensorbord"}, ValueError, ["Did you mean 'tensorboard'"]),
        ({"optim": "adamw_8bitt"}, ValueError, ["optim='adamw_8bitt'", "'adamw_torch_fused'", "optimizers=",
                                               "Did you mean 'adamw_8bit'"]),
        ({"cache_implementation": "statc"}, ValueError, ["cache_implementation='statc'", "Did you mean 'static'"]),
        ({"cache_implementation": "static", "use_vllm": True}, ValueError, ["use_vllm=True",
                                                                            "cache_implementation=None"]),
    ],
)
def test_bad_values_raise_at_construction_with_the_fix(kwargs, error, fragments):
    with pytest.raises(error) as raised:
        GRPOConfig(**kwargs)
    for fragment in fragments:
        assert fragment in str(raised.value)


INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize(
    ("kwargs", "fragments"),
    [
        ({"temperature": INF}, ["temperature must be > 0 and finite (got inf)",
                                "Set temperature to a number > 0, e.g. its default 1.0"]),
        ({"temperature": NAN}, ["temperature must be > 0 and finite (got nan)", "Set temperature"]),
        ({"temperature": -0.5}, ["temperature must be > 0", "(got -0.5)", "Set temperature"]),
        ({"learning_rate": INF}, ["learning_rate must be >= 0 and finite (got inf)",
                                  "Set learning_rate to a number >= 0"]),
        ({"learning_rate": NAN}, ["learning_rate must be >= 0 and finite (got nan)", "Set learning_rate"]),
        ({"learning_rate": -1e-5}, ["learning_rate must be >= 0", "(got -1e-05)", "e.g. its default 1e-06"]),
        ({"reward_weights": [1.0, NAN]}, ["reward_weights must be finite numbers, got nan at index 1",
                                          "Give a finite weight to every reward function"]),
        ({"reward_weights": [INF, 1.0]}, ["got inf at index 0"]),
        ({"reward_weights": []}, ["reward_weights is empty", "or None to weight every function by 1"]),
        ({"loss_type": "cispo"}, ["loss_type='cispo' caps the importance ratio at epsilon_high itself",
                                  "epsilon_high is None, which falls back to epsilon: a cap of 0.2",
                                  "Set epsilon_high=5.0"]),
        ({"loss_type": "cispo", "epsilon_high": 0.28}, ["epsilon_high is 0.28", "Set epsilon_high=5.0",
                                                        "any cap >= 1"]),
        ({"loss_type": "sapo", "epsilon_high": 0.28}, ["loss_type='sapo' replaces clipping with a soft gate",
                                                       "epsilon_high=0.28 would be ignored", "Set epsilon_high=None"]),
        ({"loss_type": "sapo", "delta": 4.0}, ["delta=4.0 would be ignored", "Set delta=None",
                                               "choose a clipped loss"]),
        ({"loss_type": "cispo", "epsilon_high": 5.0, "delta": 6.0},
         ["loss_type='cispo' caps the ratio at epsilon_high only", "delta=6.0 would be ignored", "Set delta=None"]),
        ({"generation_kwargs": {"max_tokens": 2}}, ["generation_kwargs has 'max_tokens'", "use_vllm=False",
                                                    "use max_completion_length", "max_new_tokens"]),
        ({"generation_kwargs": {"presence_penalty": 0.5, "top_a": 1}},
         ["'presence_penalty': a vLLM setting; use repetition_penalty",
          "'top_a': not a transformers GenerationConfig setting", "Drop them"]),
        ({"seed": "abc"}, ["seed must be an int", "got 'abc', a str", "Set seed=42"]),
        ({"seed": 1.5}, ["seed must be an int", "got 1.5, a float"]),
        ({"seed": -1}, ["seed must be an int in [0, 2**32 - 1] (got -1)"]),
        ({"data_seed": "7x"}, ["data_seed must be an int", "or None to use seed"]),
        ({"reward_timeout": 0}, ["reward_timeout must be > 0", "or None to wait without limit"]),
        ({"reward_timeout": INF}, ["reward_timeout must be > 0 and finite (got inf)", "None to wait without limit"]),
    ],
    ids=["temperature-inf", "temperature-nan", "temperature-negative", "lr-inf", "lr-nan", "lr-negative",
         "weights-nan", "weights-inf", "weights-empty", "cispo-no-epsilon-high", "cispo-cap-below-1",
         "sapo-epsilon-high", "sapo-delta", "cispo-delta", "vllm-max-tokens", "unknown-generation-keys", "seed-str",
         "seed-float", "seed-negative", "data-seed-str", "timeout-zero", "timeout-inf"],
)
def test_values_that_would_go_wrong_later_are_refused_naming_the_value_and_the_fix(kwargs, fragments):
    with pytest.raises(ValueError) as raised:
        GRPOConfig(**kwargs)
    for fragment in fragments:
        assert fragment in str(raised.value), (fragment, str(raised.value))


def test_the_settings_those_checks_leave_alone_still_work():
    assert GRPOConfig(loss_type="cispo", epsilon_high=5.0).epsilon_high == 5.0
    assert GRPOConfig(loss_type="sapo", sapo_temperature_neg=2.0).loss_type == "sapo"
    assert GRPOConfig(loss_type="grpo", delta=4.0).delta == 4.0
    assert GRPOConfig(max_grad_norm=float("inf")).max_grad_norm == float("inf")  # infinity: no clipping bound
    assert GRPOConfig(reward_weights=[1.0, 0.0, -0.5]).reward_weights == [1.0, 0.0, -0.5]
    config = GRPOConfig(seed=3.0, data_seed=7)  # a whole float (YAML, the command line) is read as an int
    assert (config.seed, config.data_seed) == (3, 7) and type(config.seed) is int
    # vLLM names are vLLM's business under use_vllm=True; transformers names pass with use_vllm=False.
    assert GRPOConfig(use_vllm=True, generation_kwargs={"max_tokens": 2}).generation_kwargs == {"max_tokens": 2}
    GRPOConfig(generation_kwargs={"min_new_tokens": 2, "no_repeat_ngram_size": 3, "suppress_tokens": [1]})
    assert GRPOConfig().reward_timeout == 600.0 and GRPOConfig(reward_timeout=None).reward_timeout is None
    assert "grpo_lab only" in GRPOConfig.field_help("reward_timeout")
    assert "async def" in GRPOConfig.field_help("reward_timeout")
    assert "refuses None" in GRPOConfig.field_help("epsilon_high")


def test_positional_arguments_are_refused():
    with pytest.raises(TypeError, match="keyword arguments only"):
        GRPOConfig("outputs")


@pytest.mark.parametrize("name", sorted(NOT_YET_IMPLEMENTED))
def test_unimplemented_trl_fields_are_accepted_at_default_and_refused_otherwise(name):
    default = getattr(GRPOConfig(), name)
    GRPOConfig(**{name: default})
    other = {bool: not default, int: 7, float: 0.5, str: "x", type(None): 7}[type(default)]
    with pytest.raises(NotImplementedError, match=f"{name}=.*not supported by grpo_lab yet"):
        GRPOConfig(**{name: other})


def test_scale_rewards_booleans_are_read_as_in_trl():
    assert GRPOConfig(scale_rewards=True).scale_rewards == "group"
    assert GRPOConfig(scale_rewards=False).scale_rewards == "none"


def test_batch_geometry_follows_trl_rules():
    # Neither set: steps_per_generation = gradient_accumulation_steps = 2; 4 x 3 processes x 2 = 24.
    batching = GRPOConfig(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4).resolve(3)
    assert (batching.generation_batch_size, batching.steps_per_generation) == (24, 2)
    # generation_batch_size 32 over 2 processes x 4 completions = 8 per step -> 4 steps per generation.
    batching = GRPOConfig(per_device_train_batch_size=4, generation_batch_size=32, num_generations=4).resolve(2)
    assert (batching.generation_batch_size, batching.steps_per_generation) == (32, 4)
    # steps_per_generation 3 -> 4 x 1 x 3 = 12 completions.
    batching = GRPOConfig(per_device_train_batch_size=4, steps_per_generation=3, num_generations=4).resolve(1)
    assert (batching.generation_batch_size, batching.steps_per_generation) == (12, 3)
    # A fixed generation batch of 16 fits 1 process x 8 completions, but not 3 processes x 8.
    with pytest.raises(ValueError, match="multiple of per_device_train_batch_size x num_processes"):
        GRPOConfig(per_device_train_batch_size=8, generation_batch_size=16, num_generations=4).resolve(3)


def test_unknown_attribute_assignment_is_refused_with_suggestion():
    config = GRPOConfig()
    config.learning_rate = 1e-5
    assert config.learning_rate == 1e-5
    with pytest.raises(AttributeError, match="did you mean 'learning_rate'"):
        config.learnig_rate = 1e-5


def test_repr_and_diff_show_only_changed_fields():
    config = GRPOConfig(learning_rate=1e-5, loss_type="grpo")
    assert config.diff() == {"learning_rate": 1e-5, "loss_type": "grpo"}
    assert repr(config) == "GRPOConfig(loss_type='grpo', learning_rate=1e-05)"


def test_yaml_and_dict_round_trip(tmp_path):
    config = GRPOConfig(learning_rate=3e-4, reward_weights=[1.0, 0.5], generation_kwargs={"suppress_tokens": [1]})
    path = tmp_path / "config.yaml"
    config.to_yaml(path)
    assert yaml.safe_load(path.read_text())["learning_rate"] == 3e-4
    assert GRPOConfig.from_yaml(path) == config
    assert GRPOConfig.from_dict(config.to_dict()) == config


def test_command_line_overrides_only_the_given_fields(tmp_path):
    base = GRPOConfig(learning_rate=1e-4, num_generations=4, per_device_train_batch_size=8)
    config = GRPOConfig.from_args(
        ["--learning_rate", "1e-5", "--scale_rewards=false", "--reward_weights", "1,0.5", "--bf16",
         "--generation_kwargs", '{"typical_p": 0.9}', "--epsilon_high", "none", "--max-steps", "3"],
        base=base,
    )
    assert config.learning_rate == 1e-5
    assert config.num_generations == 4  # from base, untouched
    assert config.scale_rewards == "none"
    assert config.reward_weights == [1.0, 0.5]
    assert config.bf16 is True
    assert config.generation_kwargs == {"typical_p": 0.9}
    assert config.epsilon_high is None
    assert config.max_steps == 3
    path = tmp_path / "c.yaml"
    GRPOConfig(beta=0.01).to_yaml(path)
    assert GRPOConfig.from_args(["--config", str(path), "--seed", "3"]).diff() == {"beta": 0.01, "seed": 3}


def test_step_counts_that_also_take_a_fraction_read_whole_numbers_as_steps():
    config = GRPOConfig.from_args(["--warmup_steps", "10", "--save_steps", "0.25", "--logging_steps", "5.0"])
    assert (config.warmup_steps, config.save_steps, config.logging_steps) == (10, 0.25, 5)
    assert type(config.warmup_steps) is int and type(config.logging_steps) is int
    assert [steps_between(value, 10) for value in (0.25, 0.01, 3)] == [3, 1, 3]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="a fraction of the run in"):
            GRPOConfig(save_steps=bad)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lerning_rate", "1e-5"], "did you mean --learning_rate"),
        (["--learning_rate", "fast"], "cannot read 'fast' as float"),
        (["--seed"], "--seed needs a value"),
        (["learning_rate"], "give config fields as --name value"),
    ],
)
def test_command_line_errors_name_the_option(argv, message):
    with pytest.raises(ValueError, match=message):
        GRPOConfig.from_args(argv)


def test_every_field_is_documented_once_as_its_docstring(capsys):
    config = GRPOConfig()
    for name in config.to_dict():
        assert len(GRPOConfig.field_help(name)) > 10, name
    assert "KL penalty" in GRPOConfig.field_help("beta")
    with pytest.raises(SystemExit):
        GRPOConfig.from_args(["--help"])
    assert "--top_entropy_quantile (default: 1.0)" in capsys.readouterr().out


def test_the_configuration_guide_lists_every_unimplemented_field():
    from pathlib import Path

    guide = (Path(__file__).resolve().parents[1] / "docs" / "guides" / "configuration.md").read_text()
    listed = guide.split("Accepted for compatibility but not implemented yet")[1].split("##")[0]
    for name in NOT_YET_IMPLEMENTED:
        assert f"`{name}`" in listed, name


def test_steps_per_generation_must_be_a_multiple_of_gradient_accumulation():
    with pytest.raises(ValueError, match="multiple of gradient_accumulation_steps"):
        GRPOConfig(steps_per_generation=3, gradient_accumulation_steps=2, per_device_train_batch_size=8)


def test_values_are_normalised_so_that_checkpoints_can_write_them(tmp_path):
    import torch

    config = GRPOConfig(model_init_kwargs={"dtype": torch.bfloat16}, output_dir=tmp_path / "out",
                        learning_rate="1e-5", save_steps=500.0, report_to=None, warmup_steps=0.1)
    assert config.model_init_kwargs == {"dtype": "bfloat16"} and config.output_dir == str(tmp_path / "out")
    assert config.learning_rate == 1e-5 and config.save_steps == 500 and config.report_to == "none"
    config.to_yaml(tmp_path / "c.yaml")
    assert GRPOConfig.from_yaml(tmp_path / "c.yaml") == config


def test_a_config_file_is_merged_before_validation_and_may_restore_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("per_device_train_batch_size: 6\nbeta: 0.0\nlearning_rate: 1e-6\n")
    config = GRPOConfig.from_args(["--config", str(path), "--num_generations", "6"],
                                  base=GRPOConfig(beta=0.04, learning_rate=1e-5))
    assert (config.per_device_train_batch_size, config.num_generations) == (6, 6)
    assert (config.beta, config.learning_rate) == (0.0, 1e-6)


@pytest.mark.parametrize("name, message", [("beta", ">= 0"), ("router_aux_loss_coef", ">= 0"), ("entropy_coef", ">= 0"),
                                           ("temperature", "> 0"), ("epsilon", "> 0")])
def test_a_weight_or_scale_that_is_not_a_number_is_refused(name, message):
    with pytest.raises(ValueError, match=f"{name} must be {message} and finite \\(got nan\\)\\. "
                                         f"Set {name} to a number"):
        GRPOConfig(**{name: float("nan")})


def test_pad_to_multiple_of_takes_trls_spellings():
    assert GRPOConfig().pad_multiple() is None and GRPOConfig(pad_to_multiple_of=None).pad_multiple() is None
    assert GRPOConfig(pad_to_multiple_of="64").pad_multiple() == 64
    assert GRPOConfig(pad_to_multiple_of="none").pad_to_multiple_of is None
    for bad in (0, -8, "x", True, 2.5):
        with pytest.raises(ValueError, match="pad_to_multiple_of must be an int >= 1, None or 'auto'"):
            GRPOConfig(pad_to_multiple_of=bad)


def test_objects_set_after_the_checks_are_stored_in_the_yaml_as_from_pretrained_reads_them(tmp_path):
    import torch
    from transformers import BitsAndBytesConfig

    config = GRPOConfig()
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16)
    config.model_init_kwargs = {"dtype": torch.bfloat16, "quantization_config": quantization}  # as TRL's gspo.py
    config.to_yaml(tmp_path / "config.yaml")
    loaded = GRPOConfig.from_yaml(tmp_path / "config.yaml")
    assert loaded.model_init_kwargs["dtype"] == "bfloat16"
    assert loaded.model_init_kwargs["quantization_config"] == quantization.to_dict()
    assert BitsAndBytesConfig.from_dict(loaded.model_init_kwargs["quantization_config"]).load_in_4bit
