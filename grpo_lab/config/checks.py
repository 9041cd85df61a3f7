"""Checks of ``GRPOConfig`` values, run by :meth:`GRPOConfig.validate` at construction and before each
stage of a session: a bad value raises ``ValueError`` naming the field and the fix.

:func:`validate` normalises first (YAML's and the command line's spellings, TRL's aliases), then runs
small checks in a fixed order, so that the first problem found is always the same one.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import numbers
import os
import types
import warnings
from typing import Any

from grpo_lab.config.args import normalise
from grpo_lab.config.trainer_args import check_trainer_arguments, optimizer_names
from grpo_lab.doctor.thresholds import check_config as check_doctor_thresholds
from grpo_lab.ops.registry import CLIP_LOSSES, LOSS_TYPES, default_epsilon_high, loss_spec
from grpo_lab.errors import ConfigError

SUPPORTED_REPORTERS = ("tensorboard", "wandb", "trackio", "mlflow", "comet_ml")
"""Where the trainer can send metrics besides ``output_dir/metrics.jsonl`` (:mod:`grpo_lab.trainer.trackers`):
every tracker GRPOConfig accepts in ``report_to``."""

SCALE_REWARDS = ("group", "batch", "none")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
VLLM_MODES = ("colocate", "server")
VLLM_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
OPTIMIZERS = optimizer_names()  # transformers' names, as TRL takes them
REPORTERS = ("none", "all", *SUPPORTED_REPORTERS)
DOCTOR_MODES = ("off", "warn", "stop")
DYNAMIC_SAMPLING_FILLS = ("zero_signal", "masked")

_CONTINUOUS_BATCHING_SAMPLING = {"do_sample", "temperature", "top_k", "top_p", "min_p"}
"""The generation_kwargs transformers' continuous batching engine applies as generate() does."""

_VLLM_SAMPLING_NAMES = {
    "max_tokens": "max_completion_length (transformers' max_new_tokens is set from it)",
    "min_tokens": "min_new_tokens",
    "stop": "eos_token_id (stop token ids; stop strings need use_vllm=True)",
    "stop_token_ids": "eos_token_id",
    "n": "num_generations",
    "presence_penalty": "repetition_penalty",
    "frequency_penalty": "repetition_penalty",
    "seed": "seed (the config field)",
}
"""vLLM ``SamplingParams`` names a user may bring to transformers generation, and the setting that
does their job there."""

NOT_YET_IMPLEMENTED = {
    "ds3_gather_for_generation": "generation under DeepSpeed ZeRO-3 always gathers the weights",
    "vllm_group_port": "weights reach the vLLM server over HTTP, not through an NCCL process group",
    "log_completions_hub_repo": "nothing is uploaded to the Hub",
}
"""Fields accepted for compatibility with TRL that raise ``NotImplementedError`` when set to anything
but their default, with the reason (never silently ignored)."""

def validate(config) -> None:
    """Check and normalise every field of ``config``, as :meth:`GRPOConfig.validate` describes."""
    normalise(config)
    _check_choices(config)
    _check_counts(config)
    _check_numbers(config)
    _check_seeds(config)
    _check_loss_settings(config)
    _check_ranges(config)
    _check_reward_weights(config)
    _check_generation(config)
    check_doctor_thresholds(config)
    if config.bf16 and config.fp16:
        raise ConfigError("bf16 and fp16 cannot both be True: choose one mixed precision.")
    if config.fp16 and config.use_cpu:
        raise ConfigError("fp16 needs a GPU but use_cpu=True: set fp16=False.")
    config.resolve(int(os.environ.get("WORLD_SIZE", "1")))
    defaults = field_defaults(type(config))
    for name, reason in NOT_YET_IMPLEMENTED.items():
        if getattr(config, name) != defaults[name]:
            raise NotImplementedError(
                f"{name}={getattr(config, name)!r} is accepted for compatibility with TRL but not supported by "
                f"grpo_lab yet: {reason}. Leave it at its default ({defaults[name]!r})."
            )
    check_trainer_arguments(config, defaults)


@functools.cache
def field_defaults(config_class) -> dict[str, Any]:
    return {field.name: field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
            for field in dataclasses.fields(config_class)}


def _set(config, name: str, value) -> None:
    object.__setattr__(config, name, value)


# ---------------------------------------------------------------------- checks, in the order they run
def _check_choices(config) -> None:
    _one_of("loss_type", config.loss_type, LOSS_TYPES)
    _one_of("scale_rewards", config.scale_rewards, SCALE_REWARDS, extra=" (or True / False)")
    _one_of("importance_sampling_level", config.importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
    _one_of("multi_objective_aggregation", config.multi_objective_aggregation, AGGREGATIONS)
    _one_of("vllm_mode", config.vllm_mode, VLLM_MODES)
    _one_of("optim", config.optim, OPTIMIZERS, extra="; for any other optimizer, pass it to optimizers=")
    _one_of("vllm_importance_sampling_mode", config.vllm_importance_sampling_mode, VLLM_IS_MODES)
    _one_of("doctor", config.doctor, DOCTOR_MODES)
    _one_of("dynamic_sampling_fill", config.dynamic_sampling_fill, DYNAMIC_SAMPLING_FILLS)
    metric = config.dynamic_sampling_metric
    if not isinstance(metric, str | types.FunctionType):  # a function: saves name it by module and name
        raise ConfigError(
            f"dynamic_sampling_metric must be 'reward', a reward function's name or a function (def) that takes a "
            f"group's rewards and returns whether to keep it, got {metric!r}. Wrap a callable object or a "
            "functools.partial in a def."
        )
    if config.report_to is None or (not isinstance(config.report_to, str) and len(config.report_to) == 1):
        _set(config, "report_to", config.report_to[0] if config.report_to else "none")  # --report_to NAME: a list
    reporters = [config.report_to] if isinstance(config.report_to, str) else list(config.report_to)
    for reporter in reporters:
        _one_of("report_to", reporter, REPORTERS)


def _check_counts(config) -> None:
    if not isinstance(config.num_generations, int) or config.num_generations < 2:
        raise ConfigError(
            f"num_generations must be at least 2 (got {config.num_generations!r}): GRPO compares the "
            "completions of one prompt with each other. Set num_generations=2 or more (TRL's default is 8)."
        )
    if config.num_generations_eval is not None:
        _at_least("num_generations_eval", config.num_generations_eval, 1)
    if config.eval_pass_at_k is not None:
        samples = config.num_generations_eval or config.num_generations
        ks = config.eval_pass_at_k
        if not isinstance(ks, (list, tuple)) or not all(isinstance(k, int) and not isinstance(k, bool) and
                                                         1 <= k <= samples for k in ks):
            raise ConfigError(
                f"eval_pass_at_k must be a list of whole numbers k with 1 <= k <= {samples}, the completions per "
                f"prompt in evaluation (num_generations_eval, else num_generations); got {ks!r}. E.g. "
                f"eval_pass_at_k=[1, {samples}]."
            )
    if not _number(config.eval_pass_threshold) or not math.isfinite(config.eval_pass_threshold):
        raise ConfigError(f"eval_pass_threshold must be a finite number, got {config.eval_pass_threshold!r}.")
    for name in ("max_completion_length", "per_device_train_batch_size", "per_device_eval_batch_size",
                 "gradient_accumulation_steps", "num_iterations", "ref_model_sync_steps"):
        _at_least(name, getattr(config, name), 1)
    for name in ("logging_steps", "save_steps"):
        value = getattr(config, name)
        if not _number(value) or value <= 0 or (value > 1 and value != int(value)):
            raise ConfigError(
                f"{name} must be a whole number of steps >= 1, or a fraction of the run in (0, 1) (got {value!r})."
            )
    for name in ("generation_batch_size", "steps_per_generation", "save_total_limit"):
        if getattr(config, name) is not None:
            _at_least(name, getattr(config, name), 1)
    _at_least("top_k", config.top_k, 0, hint=" (0 disables top-k filtering)")
    _at_least("dynamic_sampling_max_rounds", config.dynamic_sampling_max_rounds, 1)
    if config.undo_steps is not None:
        _at_least("undo_steps", config.undo_steps, 0, hint=" (0 turns undo off)")
    warmup = config.warmup_steps
    if not _number(warmup) or warmup < 0 or (isinstance(warmup, float) and warmup >= 1):
        raise ConfigError(
            f"warmup_steps must be a whole number of steps >= 0, or a fraction of the run in [0, 1) "
            f"(got {warmup!r})."
        )


def _check_numbers(config) -> None:
    for name in ("epsilon", "temperature", "repetition_penalty", "sapo_temperature_pos", "sapo_temperature_neg",
                 "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
        _positive(config, name)
    if config.epsilon_high is not None:
        _positive(config, "epsilon_high")
    if config.router_aux_loss_coef is not None:
        _non_negative(config, "router_aux_loss_coef")
    for name in ("beta", "learning_rate", "weight_decay", "adam_epsilon", "entropy_coef", "entropy_coef_min",
                 "entropy_coef_delta", "entropy_target"):
        _non_negative(config, name)
    for name in ("max_grad_norm", "entropy_coef_max"):  # infinity is a meaningful "no bound" here
        _non_negative(config, name, finite=False)
    if config.reward_timeout is not None:
        fix = "Set reward_timeout to a number of seconds, or None to wait without limit."
        _positive(config, "reward_timeout", fix=fix)


def _check_seeds(config) -> None:
    for name in ("seed", "data_seed"):
        value = getattr(config, name)
        if value is None and name == "data_seed":
            continue
        if isinstance(value, numbers.Integral) and not isinstance(value, bool) and 0 <= value < 2**32:
            _set(config, name, int(value))
            continue
        whole = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        kind = "" if whole else f", a {type(value).__name__}"
        raise ConfigError(
            f"{name} must be an int in [0, 2**32 - 1] (got {value!r}{kind}): random number generators take "
            f"whole numbers in that range. Set {name}=42 or another whole number"
            f"{', or None to use seed' if name == 'data_seed' else ''}."
        )


def _check_loss_settings(config) -> None:
    """Refuse settings that the chosen loss_type would ignore or that make it degenerate."""
    loss, spec = config.loss_type, loss_spec(config.loss_type)
    if spec.clipping == "cap" and (config.epsilon_high is None or config.epsilon_high < 1):
        got = "None, which falls back to epsilon" if config.epsilon_high is None else repr(config.epsilon_high)
        cap = default_epsilon_high(config.epsilon, config.epsilon_high)
        raise ConfigError(
            f"loss_type={loss!r} caps the importance ratio at epsilon_high itself (not 1 + epsilon_high), and "
            f"epsilon_high is {got}: a cap of {cap:g}, below the ratio 1 of every on-policy token, would "
            f"scale every token's weight down to {cap:g}. Set epsilon_high=5.0 (the value TRL recommends, "
            "from the ScaleRL paper), or any cap >= 1."
        )
    ignored = [name for name in ("delta", "epsilon_high")
               if name not in spec.reads and getattr(config, name) is not None]
    if ignored:
        settings = " and ".join(f"{n}={getattr(config, n)!r}" for n in ignored)
        raise ConfigError(
            f"loss_type={loss!r} {spec.instead_of_clipping}, so {settings} would be "
            f"ignored (TRL ignores {'it' if len(ignored) == 1 else 'them'} silently). Set "
            f"{' and '.join(f'{n}=None' for n in ignored)}, or choose a clipped loss ({', '.join(CLIP_LOSSES)}) "
            f"to use {' and '.join(ignored)}."
        )


def _check_ranges(config) -> None:
    if config.entropy_coef_min > config.entropy_coef_max:
        raise ConfigError(
            f"entropy_coef_min ({config.entropy_coef_min}) is above entropy_coef_max ({config.entropy_coef_max}): "
            "the adaptive entropy weight would have no room. Lower entropy_coef_min or raise entropy_coef_max."
        )
    if config.off_policy_mask_threshold is not None:
        _positive(config, "off_policy_mask_threshold")
    rounds = config.max_tool_calling_iterations
    if rounds is not None and (not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 0):
        raise ConfigError(f"max_tool_calling_iterations must be an int >= 0, or None for no limit (got {rounds!r}).")
    if not isinstance(config.num_train_epochs, (int, float)) or config.num_train_epochs <= 0:
        raise ConfigError(f"num_train_epochs must be > 0 (got {config.num_train_epochs!r}), or set max_steps.")
    if not isinstance(config.max_steps, int) or (config.max_steps < 1 and config.max_steps != -1):
        raise ConfigError(
            f"max_steps must be a positive number of steps, or -1 to use num_train_epochs (got {config.max_steps!r})."
        )
    _in_unit("top_p", config.top_p, low_open=True)
    for name in ("top_entropy_quantile", "warmup_ratio", "ref_model_mixup_alpha", "adam_beta1", "adam_beta2"):
        _in_unit(name, getattr(config, name))
    if config.min_p is not None:
        _in_unit("min_p", config.min_p)
    if config.delta is not None:
        upper = 1 + default_epsilon_high(config.epsilon, config.epsilon_high)
        if not isinstance(config.delta, (int, float)) or config.delta <= upper:
            raise ConfigError(
                f"delta must be greater than 1 + epsilon_high = {upper:g} (got {config.delta!r}): it caps the "
                "unclipped ratio above the clipping range. INTELLECT-2 uses delta=4; set delta=None to disable."
            )


def _check_reward_weights(config) -> None:
    if config.reward_weights is None:
        return
    if isinstance(config.reward_weights, (int, float)) or not all(
        isinstance(w, (int, float)) and not isinstance(w, bool) for w in config.reward_weights
    ):
        raise ConfigError(
            f"reward_weights must be a list of numbers, one per reward function (got {config.reward_weights!r})."
        )
    _set(config, "reward_weights", [float(w) for w in config.reward_weights])
    if not config.reward_weights:
        raise ConfigError("reward_weights is empty: give one weight per reward function, or None to weight "
                         "every function by 1.")
    bad = [(i, w) for i, w in enumerate(config.reward_weights) if not math.isfinite(w)]
    if bad:
        where = ", ".join(f"{w} at index {i}" for i, w in bad)
        raise ConfigError(
            f"reward_weights must be finite numbers, got {where} (in {config.reward_weights}): a NaN or "
            "infinite weight makes every weighted reward NaN or infinite. Give a finite weight to every "
            "reward function (0 leaves a function out)."
        )


def _check_generation(config) -> None:
    if config.generation_batch_size is not None and config.steps_per_generation is not None:
        raise ConfigError(
            "generation_batch_size and steps_per_generation cannot both be set: each determines the "
            "other. Set one and leave the other None."
        )
    if config.cache_implementation is not None:
        _check_cache_implementation(config.cache_implementation, config.use_vllm)
    if config.generation_kwargs and not config.use_vllm:
        _check_transformers_generation_kwargs(config.generation_kwargs)
    _check_continuous_batching(config)


def _check_cache_implementation(value, use_vllm: bool) -> None:
    try:
        from transformers.generation.configuration_utils import (
            DYNAMIC_CACHE_IMPLEMENTATIONS,
            STATIC_CACHE_IMPLEMENTATIONS,
        )
    except ImportError:  # a transformers release that does not list them: GenerationConfig checks the name
        pass
    else:
        allowed = (*STATIC_CACHE_IMPLEMENTATIONS, *DYNAMIC_CACHE_IMPLEMENTATIONS)
        _one_of("cache_implementation", value, allowed, extra=" (or None for the default)")
    if use_vllm:
        raise ConfigError(
            f"cache_implementation={value!r} applies to transformers generation, but use_vllm=True: vLLM manages "
            "its own cache. Set cache_implementation=None."
        )


@functools.cache
def _generation_config_fields() -> frozenset[str]:
    from transformers import GenerationConfig

    return frozenset(GenerationConfig().to_dict())


def _check_transformers_generation_kwargs(generation_kwargs: dict) -> None:
    """Refuse keys that transformers generation (``GenerationConfig``) would store and never read."""
    unknown = [key for key in generation_kwargs if key not in _generation_config_fields()]
    if not unknown:
        return
    hints = [f"{key!r}: a vLLM setting; use {_VLLM_SAMPLING_NAMES[key]}"
             for key in unknown if key in _VLLM_SAMPLING_NAMES]
    others = [repr(key) for key in unknown if key not in _VLLM_SAMPLING_NAMES]
    if others:
        hints.append(f"{', '.join(others)}: not a transformers GenerationConfig setting")
    raise ConfigError(
        f"generation_kwargs has {', '.join(map(repr, unknown))}, which transformers generation (use_vllm=False) "
        f"would ignore ({'; '.join(hints)}). Drop {'it' if len(unknown) == 1 else 'them'} or use the "
        "transformers name (GenerationConfig's fields); vLLM names apply with use_vllm=True."
    )


def _check_continuous_batching(config) -> None:
    if config.use_transformers_paged:
        warnings.warn("use_transformers_paged is deprecated (as in TRL): it sets use_transformers_continuous_batching, "
                      "which is the name to use.", FutureWarning, stacklevel=7)
        _set(config, "use_transformers_paged", False)
        _set(config, "use_transformers_continuous_batching", True)
    if not config.use_transformers_continuous_batching:
        if config.transformers_continuous_batching_config is not None:
            raise ConfigError(
                "transformers_continuous_batching_config is set but use_transformers_continuous_batching is False, "
                "so nothing would read it. Set use_transformers_continuous_batching=True, or drop the settings."
            )
        return
    if config.use_vllm:
        raise ConfigError(
            "use_transformers_continuous_batching and use_vllm both choose the generation engine: set one of them."
        )
    # Settings the engine would not apply as generate() does (it keeps an unsupported logits
    # processor with a log line, and feeds it the last token only), refused instead.
    unsupported = [f"{name}={getattr(config, name)!r}" for name, default in
                   (("repetition_penalty", 1.0), ("cache_implementation", None)) if getattr(config, name) != default]
    unsupported += [f"generation_kwargs[{key!r}]" for key in (config.generation_kwargs or {})
                    if key not in _CONTINUOUS_BATCHING_SAMPLING]
    if "seed" in (config.transformers_continuous_batching_config or {}):
        unsupported.append("transformers_continuous_batching_config['seed'] (it reseeds the whole process at "
                           "every generation; the run's seed drives sampling)")
    if unsupported:
        raise ConfigError(
            f"use_transformers_continuous_batching cannot apply {', '.join(unsupported)}: its engine applies "
            f"temperature, top_k, top_p and min_p only. Drop them, or generate with generate() "
            "(use_transformers_continuous_batching=False)."
        )
    config.continuous_batching_config()  # a transformers without the engine, or unknown settings, fail here


# ---------------------------------------------------------------------- single-value checks
def _one_of(name: str, value, allowed: tuple[str, ...], extra: str = "") -> None:
    if value not in allowed:
        close = difflib.get_close_matches(str(value), allowed, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        listed = ", ".join(map(repr, allowed))
        raise ConfigError(f"{name}={value!r} is not supported. Allowed values: {listed}{extra}.{hint}")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _at_least(name: str, value, minimum: int, hint: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(
            f"{name} must be an integer >= {minimum}{hint} (got {value!r}). Set {name}={max(minimum, 1)} or more."
        )


def _bound_fix(config, name: str, bound: str) -> str:
    default = field_defaults(type(config))[name]
    example = f", e.g. its default {default!r}" if _number(default) else ", or None"
    return f"Set {name} to a number {bound}{example}."


def _positive(config, name: str, *, fix: str | None = None) -> None:
    value = getattr(config, name)
    if not _number(value) or not value > 0 or not math.isfinite(value):  # NaN too
        raise ConfigError(f"{name} must be > 0 and finite (got {value!r}). {fix or _bound_fix(config, name, '> 0')}")


def _non_negative(config, name: str, *, finite: bool = True) -> None:
    value = getattr(config, name)
    if not _number(value) or not value >= 0 or (finite and not math.isfinite(value)):  # NaN too
        bound = ">= 0 and finite" if finite else ">= 0"
        raise ConfigError(f"{name} must be {bound} (got {value!r}). {_bound_fix(config, name, '>= 0')}")


def _in_unit(name: str, value, low_open: bool = False) -> None:
    if not _number(value) or value > 1 or value < 0 or (low_open and value == 0):
        interval = "(0, 1]" if low_open else "[0, 1]"
        raise ConfigError(f"{name} must be in {interval} (got {value!r}).")
