"""``GRPOConfig``: every GRPO setting of TRL's ``GRPOConfig`` plus the training settings a run needs.

Names, defaults and meanings follow TRL 1.16, so a TRL config carries over field for field. Where
grpo_lab differs on purpose, the field's help says so. The fields themselves, each with its ``help``
and its ``change`` rule, are declared in :mod:`grpo_lab.config.fields`. Checks
live in :mod:`grpo_lab.config.checks`, the command line in :mod:`grpo_lab.config.args`. Derived values
(generation batch size, steps per generation) are resolved in one place, :meth:`GRPOConfig.resolve`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import os
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_lab.config import checks as config_checks
from grpo_lab.config.args import config_from_args, function_reference, read_yaml_mapping, stored_value, suggestion
from grpo_lab.config.checks import (
    AGGREGATIONS,
    IMPORTANCE_SAMPLING_LEVELS,
    LOSS_TYPES,
    NOT_YET_IMPLEMENTED,
    OPTIMIZERS,
    REPORTERS,
    SCALE_REWARDS,
    VLLM_IS_MODES,
    VLLM_MODES,
    field_defaults,
)
from grpo_lab.config.fields import REWARD_TIMEOUT, TrainingArgumentsFields, built, setting
from grpo_lab.config.trainer_args import apply_activation_checkpointing
from grpo_lab.config.field_rules import rule_of
from grpo_lab.errors import ConfigError

__all__ = [
    "AGGREGATIONS", "IMPORTANCE_SAMPLING_LEVELS", "LOSS_TYPES", "NOT_YET_IMPLEMENTED", "OPTIMIZERS", "REPORTERS",
    "REWARD_TIMEOUT", "SCALE_REWARDS", "VLLM_IS_MODES", "VLLM_MODES", "Batching", "GRPOConfig", "built",
    "read_yaml_mapping", "setting", "steps_between",
]

@dataclass(frozen=True)
class Batching:
    """Resolved batch geometry for a number of processes (see :meth:`GRPOConfig.resolve`)."""

    num_processes: int
    generation_batch_size: int
    steps_per_generation: int


REMOVED_TRL_FIELDS = {
    "max_prompt_length": (
        "it cut prompts to their last max_prompt_length tokens. grpo_lab keeps every prompt whole, as TRL 1.16 does "
        "(a prompt that leaves no room for max_completion_length in the model's context is refused, naming its "
        "row); to train on shorter prompts, filter the dataset first: from grpo_lab.rollout.prompts import "
        "prompt_token_counts; dataset = dataset.filter(lambda row: prompt_token_counts([row['prompt']], tokenizer)[0] "
        "<= 512) (the tokens generation gives the model, chat template included)."
    ),
    "wandb_log_unique_prompts": "use log_unique_prompts=True, which took its place.",
}
"""Fields of earlier TRL versions' GRPOConfig that TRL 1.16 no longer has, with what to do instead."""


@dataclass(repr=False)
class GRPOConfig(TrainingArgumentsFields):
    """Configuration of a GRPO run, shared by ``GRPOSession`` and ``GRPOTrainer``.

    Construct with keyword arguments (``GRPOConfig(learning_rate=1e-5, loss_type="grpo")``). Bad
    values raise ``ValueError`` at once, naming the field and the fix; unknown names raise
    ``TypeError`` with the closest field name. ``GRPOConfig.field_help("beta")`` explains a field.
    """

    # ------------------------------------------------------------------ construction and checks
    def __new__(cls, *args, **values):
        if args:
            raise TypeError("GRPOConfig takes keyword arguments only, e.g. GRPOConfig(learning_rate=1e-5).")
        for name in values:
            if name in REMOVED_TRL_FIELDS:
                raise TypeError(f"GRPOConfig got {name!r}, a field TRL removed before 1.16: {REMOVED_TRL_FIELDS[name]}")
            if name not in _field_names():
                raise TypeError(f"GRPOConfig got an unknown field {name!r}{suggestion(cls, name)}")
        return super().__new__(cls)

    def __post_init__(self) -> None:
        apply_activation_checkpointing(self)
        self.validate()

    def __setattr__(self, name: str, value) -> None:
        if name not in _field_names():
            raise AttributeError(f"GRPOConfig has no field {name!r}{suggestion(type(self), name)}")
        object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        changed = ", ".join(f"{k}={v!r}" for k, v in self.diff().items())
        return f"GRPOConfig({changed})"

    def validate(self) -> None:
        """Check every field; raise ``ValueError`` (bad value) or ``NotImplementedError`` (a TRL field
        grpo_lab does not support yet set to a non-default value). Normalizes TRL's aliases
        (``scale_rewards`` True/False, JSON strings for dict fields, ``report_to`` lists)."""
        config_checks.validate(self)

    def continuous_batching_config(self):
        """transformers' ``ContinuousBatchingConfig`` from ``transformers_continuous_batching_config``."""
        try:
            from transformers.generation import ContinuousBatchingConfig
        except ImportError:
            raise ImportError(
                "use_transformers_continuous_batching needs transformers' continuous batching engine (transformers "
                ">= 5.8): upgrade transformers, or set use_transformers_continuous_batching=False."
            ) from None
        settings = {"max_memory_percent": 0.5, **(self.transformers_continuous_batching_config or {})}
        try:
            return ContinuousBatchingConfig(**settings)
        except TypeError as error:
            raise ConfigError(f"transformers_continuous_batching_config: {error}. See transformers' "
                             "ContinuousBatchingConfig for its settings.") from None

    # ------------------------------------------------------------------ derived values
    def resolve(self, num_processes: int = 1) -> Batching:
        """Generation batch size and steps per generation for ``num_processes`` processes (TRL's rules).

        Neither set: steps_per_generation = gradient_accumulation_steps and generation_batch_size =
        per_device_train_batch_size x num_processes x steps_per_generation. One set: the other follows.
        The generation batch size must be a multiple of num_generations (whole groups).
        """
        per_step = self.per_device_train_batch_size * num_processes
        if self.generation_batch_size is None:
            steps = self.steps_per_generation or self.gradient_accumulation_steps
            size = per_step * steps
        else:
            size = self.generation_batch_size
            if size % per_step:
                raise ConfigError(
                    f"generation_batch_size ({size}) must be a multiple of per_device_train_batch_size x "
                    f"num_processes ({self.per_device_train_batch_size} x {num_processes} = {per_step}). "
                    f"Try generation_batch_size={per_step * max(1, size // per_step)}."
                )
            steps = size // per_step
        accumulation = self.gradient_accumulation_steps
        if steps % accumulation:
            raise ConfigError(
                f"steps_per_generation ({steps}) must be a multiple of gradient_accumulation_steps "
                f"({self.gradient_accumulation_steps}) so that each optimizer step uses micro-batches of a single "
                f"generation batch. Set steps_per_generation={accumulation * max(1, steps // accumulation)} "
                "or adjust generation_batch_size."
            )
        if size % self.num_generations:
            raise ConfigError(
                f"The generation batch ({size} completions = per_device_train_batch_size "
                f"{self.per_device_train_batch_size} x {num_processes} process(es) x {steps} step(s) per "
                f"generation) must be a multiple of num_generations ({self.num_generations}) so that every "
                "prompt's group is complete. Change per_device_train_batch_size, gradient_accumulation_steps, "
                "steps_per_generation or num_generations."
            )
        return Batching(num_processes=num_processes, generation_batch_size=size, steps_per_generation=steps)

    def pad_multiple(self) -> int | None:
        """What sequences are padded to a multiple of (``pad_to_multiple_of``), None for the longest."""
        return None if self.pad_to_multiple_of in ("auto", None) else self.pad_to_multiple_of

    def model_kwargs(self) -> dict[str, Any]:
        """What ``from_pretrained`` gets for the policy and reward models: ``model_init_kwargs``, with
        ``trust_remote_code`` always given (True when this field or ``model_init_kwargs`` says so), so
        that a checkpoint's code is refused outright rather than asked about on a terminal."""
        kwargs = dict(self.model_init_kwargs or {})
        kwargs["trust_remote_code"] = bool(self.trust_remote_code or kwargs.get("trust_remote_code"))
        return kwargs

    def resolved_precision(self) -> str:
        """``"bf16"``, ``"fp16"`` or ``"fp32"``: what bf16/fp16 mean on this machine."""
        if self.fp16:
            return "fp16"
        if self.bf16 is not None:
            return "bf16" if self.bf16 else "fp32"
        import torch

        if not self.use_cpu and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return "bf16"
        return "fp32"

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        """All fields as plain Python values."""
        return {f.name: _copy(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> GRPOConfig:
        return cls(**values)

    def diff(self) -> dict[str, Any]:
        """The fields whose value differs from the default."""
        defaults = _defaults()
        return {k: v for k, v in self.to_dict().items() if v != defaults[k]}

    def shareable_dict(self) -> dict[str, Any]:
        """:meth:`to_dict` without credentials (:mod:`grpo_lab.credentials.config_values`), as every
        copy that leaves the process is written: saves, checkpoints, trackers. Warns once per entry."""
        from grpo_lab.credentials.config_values import shareable

        # a function (dynamic_sampling_metric) as the text a config file names it by
        return {name: function_reference(value) if callable(value) else value
                for name, value in shareable(self.to_dict()).items()}

    def to_yaml(self, path: str | os.PathLike | None = None) -> str:
        """The full config as YAML, without credentials (:meth:`shareable_dict`); also written to
        ``path`` when given."""
        import yaml

        # transformers' other TrainingArguments fields only where set: they differ between transformers
        # versions, and a file that names none at their default loads under any of them
        defaults = _defaults()
        values = {k: v for k, v in self.shareable_dict().items()
                  if not (rule_of(_fields()[k]).trainer_argument and v == defaults[k])}
        text = yaml.safe_dump(stored_value(values), sort_keys=False)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> GRPOConfig:
        return cls(**read_yaml_mapping(path))

    # ------------------------------------------------------------------ command line and help
    @classmethod
    def from_args(cls, argv: list[str] | None = None, base: GRPOConfig | None = None) -> GRPOConfig:
        """``base`` (default: the defaults) with ``--field value`` overrides from ``argv``.

        Only the fields given change. ``--config FILE.yaml`` loads a YAML file first. Booleans accept
        true/false/yes/no/1/0 (a bare ``--flag`` means true), ``none`` means None, dict and list fields
        take JSON, and list fields also take comma-separated values. ``--help`` prints every field.
        """
        return config_from_args(cls, argv, base)

    @classmethod
    def field_help(cls, name: str) -> str:
        """The documentation of field ``name`` (its ``help``)."""
        if name not in _field_names():
            raise KeyError(f"GRPOConfig has no field {name!r}{suggestion(cls, name)}")
        return _fields()[name].metadata["help"]

    @classmethod
    def help_text(cls, base: GRPOConfig | None = None) -> str:
        """Every field with its value (``base``'s, else the default) and documentation, as ``--help``
        prints them."""
        lines = ["GRPOConfig fields (override any with --name value; --config FILE.yaml loads a file):", ""]
        values = base.to_dict() if base is not None else _defaults()
        for name, default in values.items():
            lines.append(f"  --{name} (default: {default!r})")
            lines.extend(textwrap.wrap(cls.field_help(name), 96, initial_indent="      ", subsequent_indent="      "))
        return "\n".join(lines)


# The keyword checks run in __new__, so that the dataclass's own __init__ runs unchanged; its signature,
# every field with its default, is the one help() and notebooks show.
GRPOConfig.__signature__ = inspect.signature(GRPOConfig.__init__).replace(
    parameters=list(inspect.signature(GRPOConfig.__init__).parameters.values())[1:]
)


# ---------------------------------------------------------------------- helpers
@functools.cache
def _fields() -> dict[str, dataclasses.Field]:
    return {field.name: field for field in dataclasses.fields(GRPOConfig)}


def _field_names():
    return _fields().keys()


def _defaults() -> dict[str, Any]:
    return field_defaults(GRPOConfig)


def steps_between(value: float, total_steps: int) -> int:
    """``logging_steps`` or ``save_steps`` in optimizer steps: a value below 1 is a fraction of the
    run's ``total_steps``, rounded up (as transformers' Trainer reads it)."""
    return max(1, math.ceil(value * total_steps)) if value < 1 else int(value)


def resolved_eval_steps(config, total_steps: int) -> int:
    """``eval_steps`` in optimizer steps (``logging_steps`` when unset, as transformers reads it)."""
    value = config.logging_steps if config.eval_steps is None else config.eval_steps
    return steps_between(value, total_steps)


def evaluation_due(config, global_step: int, total_steps: int) -> bool:
    """Whether ``eval_strategy="steps"`` evaluates after optimizer step ``global_step``: every
    ``eval_steps`` from ``eval_delay`` on, and at the run's last step (transformers' schedule)."""
    if config.eval_strategy != "steps" or global_step < config.eval_delay:
        return False
    return global_step % resolved_eval_steps(config, total_steps) == 0 or global_step == total_steps


def _copy(value):
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value
