"""The fields of transformers' ``TrainingArguments`` that ``GRPOConfig`` declares for a TRL script's
sake, and what each one does in grpo_lab.

TRL's ``GRPOConfig`` subclasses ``TrainingArguments``, so a TRL script may set any of its fields.
``GRPOConfig`` declares the ones it implements in :mod:`grpo_lab.config.fields`; every other field of
the installed transformers' ``TrainingArguments`` is added by :func:`trainer_argument_fields`, with
transformers' type, default and help, and one of four rules:

- implemented here (:data:`IMPLEMENTED`): read by the trainer, for the values listed;
- no effect in TRL's GRPOTrainer either, or only with a feature that is refused here
  (:data:`WITHOUT_EFFECT_IN_TRL`): accepted silently, as TRL accepts them;
- no effect in grpo_lab (:data:`INERT`, and any field this table does not name, which a newer
  transformers may add): accepted, with a warning, once per field and process, naming the reason;
- refused (:data:`REFUSED`): a value other than the default raises ``NotImplementedError`` with the
  reason, where ignoring it would mislead (a run that silently does not upload or shard).
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import enum
import functools
import importlib.util
import typing
from pathlib import Path

from grpo_lab import notices
from grpo_lab.config.field_rules import FieldRule, rule_of, ruled
from grpo_lab.errors import ConfigError

ACCELERATE = ("processes, sharding and their back ends are set by accelerate: give them to `accelerate launch` "
              "(--config_file, --multi_gpu, --use_fsdp, ...), as docs/guides/scale-out.md explains")

IMPLEMENTED: dict[str, tuple] = {
    "logging_first_step": (True, False),
    "logging_strategy": ("steps", "no"),
    "save_strategy": ("steps", "no"),
    "activation_checkpointing": (None, True, False),
    "activation_checkpointing_kwargs": (),
    "logging_nan_inf_filter": (),
    "eval_strategy": ("no", "steps"),
    "eval_steps": (),
    "eval_delay": (),
    "eval_on_start": (),
    "load_best_model_at_end": (),
    "metric_for_best_model": (),
    "greater_is_better": (),
}
"""Fields the trainer reads, with the values it takes (empty: any value the field's type allows).
``activation_checkpointing`` and its kwargs are transformers 5's names of ``gradient_checkpointing``
and ``gradient_checkpointing_kwargs``, which they set."""

WITHOUT_EFFECT_IN_TRL: frozenset[str] = frozenset({
    "do_train", "do_eval", "do_predict", "resume_from_checkpoint", "local_rank", "label_smoothing_factor",
    "label_names", "length_column_name", "prediction_loss_only", "eval_accumulation_steps",
    "eval_do_concat_batches", "eval_use_gather_object", "include_for_metrics", "batch_eval_metrics",
    "bf16_full_eval", "fp16_full_eval", "hub_private_repo", "hub_model_id", "hub_strategy", "hub_always_push",
    "hub_revision",
})
"""Read by transformers' Trainer only in ways TRL's GRPOTrainer does not use (``do_*``,
``resume_from_checkpoint`` and ``local_rank`` are for scripts and launchers; GRPO computes its own
loss, and evaluation computes no loss or logits), or only with ``push_to_hub``, which is refused."""

INERT: dict[str, str] = {
    "dataloader_drop_last": "prompts are drawn by grpo_lab's sampler, which always drops an incomplete last batch",
    "dataloader_num_workers": "prompts are indexed in the training process; there is no DataLoader",
    "dataloader_pin_memory": "prompts are indexed in the training process; there is no DataLoader",
    "dataloader_persistent_workers": "prompts are indexed in the training process; there is no DataLoader",
    "dataloader_prefetch_factor": "prompts are indexed in the training process; there is no DataLoader",
    "dataloader_multiprocessing_context": "prompts are indexed in the training process; there is no DataLoader",
    "dataloader_in_order": "prompts are indexed in the training process; there is no DataLoader",
    "train_sampling_strategy": "prompts are shuffled by grpo_lab's seeded sampler (shuffle_dataset)",
    "ignore_data_skip": "a resume restores the sampler's position exactly, with nothing to skip",
    "average_tokens_across_devices": "the loss types normalise over processes as TRL's GRPO losses do",
    "use_liger_kernel": "there are no fused Liger kernels here; the loss runs in plain PyTorch",
    "liger_kernel_config": "there are no fused Liger kernels here; the loss runs in plain PyTorch",
    "torch_compile": "the model is not compiled",
    "torch_compile_backend": "the model is not compiled",
    "torch_compile_mode": "the model is not compiled",
    "tf32": "TensorFloat-32 follows torch's own settings (torch.backends.cuda.matmul.fp32_precision)",
    "use_cache": "generation always uses the key/value cache and training passes never do",
    "torch_empty_cache_steps": "the CUDA cache is not emptied between steps",
    "auto_find_batch_size": "batch sizes are taken as given",
    "full_determinism": "set torch.use_deterministic_algorithms(True) yourself; seeds are set from `seed`",
    "include_num_input_tokens_seen": "num_tokens, logged every step, counts the tokens seen",
    "skip_memory_metrics": "memory metrics are not collected",
    "log_level": "grpo_lab's messages are Python warnings; set transformers' verbosity with transformers.logging",
    "log_level_replica": "grpo_lab's messages are Python warnings",
    "log_on_each_node": "the main process logs",
    "save_only_model": "checkpoints always hold what an exact resume needs (optimizer, random states, sampler)",
    "save_on_each_node": "checkpoints are written by the main process: give an output_dir all nodes share",
    "restore_callback_states_from_checkpoint": "callbacks' own states are not kept in checkpoints",
    "enable_jit_checkpoint": "checkpoints are written at save_steps and at the end",
    "debug": "transformers' debug modes are not wired in",
    "ddp_find_unused_parameters": ACCELERATE,
    "ddp_bucket_cap_mb": ACCELERATE,
    "ddp_broadcast_buffers": ACCELERATE,
    "ddp_static_graph": ACCELERATE,
    "ddp_backend": ACCELERATE,
    "ddp_timeout": ACCELERATE,
    "trackio_bucket_id": "trackio gets project, run_name and trackio_space_id",
    "trackio_static_space_id": "trackio gets project, run_name and trackio_space_id",
}
"""Accepted, and warned about once when set to anything but the default: the reason each has no
effect here."""

REFUSED: dict[str, str] = {
    "push_to_hub": ("nothing is uploaded to the Hub; after training, call trainer.model.push_to_hub(repo_id) "
                    "and trainer.session.tokenizer.push_to_hub(repo_id)"),
    "hub_token": ("nothing is uploaded to the Hub, and a token in the config would be written into checkpoints "
                  "and exported scripts; log in with `hf auth login` instead"),
    "neftune_noise_alpha": "NEFTune's noise on the embeddings is not applied",
    "optim_args": "the optimizer takes adam_beta1, adam_beta2, adam_epsilon and weight_decay",
    "optim_target_modules": "the optimizer updates every trainable parameter",
    "deepspeed": ACCELERATE,
    "fsdp": ACCELERATE,
    "fsdp_config": ACCELERATE,
    "accelerator_config": ACCELERATE,
    "parallelism_config": ACCELERATE,
}
"""Raise ``NotImplementedError`` when set to anything but the default, with the reason."""

UNREAD = object()
"""The default of a field whose default is not a literal in transformers' source (``optim``'s)."""

GENERIC_REASON = "grpo_lab's trainer does not read this TrainingArguments field"

_warned: set[str] = set()


def trainer_argument_fields(declared: set[str]) -> list[tuple[str, object, dataclasses.Field]]:
    """``(name, type, field)`` for every ``__init__`` field of the installed ``TrainingArguments``
    that is not in ``declared``, with transformers' default and help, the rule in the help, and
    ``change="live"`` (none of them changes what a live session has built)."""
    table = training_arguments()
    if any(default is UNREAD for name, (_, default, _) in table.items() if name not in declared):
        table = _from_class()
    fields = []
    for name, (annotation, default, help_text) in table.items():
        if name in declared:
            continue
        metadata = {"help": f"{help_text} [grpo_lab: {_rule_text(name)}]".strip()}
        if isinstance(default, (list, dict)):
            made = dataclasses.field(default_factory=lambda value=default: copy.deepcopy(value), metadata=metadata)
        else:
            made = dataclasses.field(default=default, metadata=metadata)
        fields.append((name, annotation, ruled(made, FieldRule("live", trainer_argument=True))))
    return fields


@functools.cache
def training_arguments() -> dict[str, tuple[object, object, str]]:
    """Name -> (type, default, help) of the installed transformers' ``TrainingArguments`` fields.

    Read from transformers' source: importing ``TrainingArguments`` loads torch, seconds that
    building a ``GRPOConfig`` does not otherwise need. Where the source does not read as expected
    (a transformers release that lays it out differently), the class is imported instead."""
    try:
        return _from_source()
    except (OSError, SyntaxError, ValueError, StopIteration, TypeError):
        return _from_class()


@functools.cache
def _source_class(name: str) -> list[ast.stmt]:
    """The body of class ``name`` in the installed transformers' ``training_args.py``."""
    spec = importlib.util.find_spec("transformers")
    tree = ast.parse(Path(spec.submodule_search_locations[0], "training_args.py").read_text())
    return next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == name).body


@functools.cache
def optimizer_names() -> tuple[str, ...]:
    """The installed transformers' optimizer names (``OptimizerNames``, what ``optim`` takes in TRL),
    read from its source as the fields are."""
    try:
        names = tuple(ast.literal_eval(statement.value) for statement in _source_class("OptimizerNames")
                      if isinstance(statement, ast.Assign))
    except (OSError, SyntaxError, ValueError, StopIteration):
        names = ()
    if not names:
        from transformers.training_args import OptimizerNames

        names = tuple(option.value for option in OptimizerNames)
    return names


def _from_source() -> dict[str, tuple[object, object, str]]:
    body = _source_class("TrainingArguments")
    found = {}
    for statement in body:
        if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
            continue
        value, help_text = statement.value, ""
        if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "field":
            keywords = {keyword.arg: keyword.value for keyword in value.keywords}
            if "init" in keywords and not ast.literal_eval(keywords["init"]):
                continue
            help_text = _help(keywords.get("metadata"))
            if "default_factory" in keywords:
                default = {"list": [], "dict": {}}[ast.unparse(keywords["default_factory"])]
            else:
                default = _literal(keywords["default"])
        else:
            default = _literal(value)
        found[statement.target.id] = (_annotation(statement.annotation), default, " ".join(help_text.split()))
    if not found:
        raise ValueError("no fields found")  # the source read is not a fields block: not a user's error
    return found


def _literal(node: ast.expr):
    try:
        return ast.literal_eval(node)
    except ValueError:
        return UNREAD


def _help(metadata: ast.expr | None) -> str:
    if not isinstance(metadata, ast.Dict):
        return ""
    for key, value in zip(metadata.keys, metadata.values):
        if isinstance(key, ast.Constant) and key.value == "help":
            return ast.literal_eval(value)
    return ""


_TYPES = {"bool": bool, "int": int, "float": float, "str": str, "dict": dict, "list": list, "Any": typing.Any}


def _annotation(node: ast.expr):
    """An annotation of transformers' source as a type built from builtins and ``typing`` (a class of
    transformers' or accelerate's, such as ``IntervalStrategy``, becomes ``str``: how the command line
    and YAML give it)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return typing.Union[_annotation(node.left), _annotation(node.right)]
    if isinstance(node, ast.Constant):
        return type(None) if node.value is None else str
    if isinstance(node, ast.Subscript):
        base = ast.unparse(node.value).removeprefix("typing.")
        items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if base == "Literal":
            return typing.Literal[tuple(ast.literal_eval(item) for item in items)]
        args = tuple(_annotation(item) for item in items)
        if base == "Optional":
            return typing.Optional[args[0]]
        if base == "Union":
            return typing.Union[args]
        return {"list": list, "dict": dict}.get(base, str)[args if len(args) > 1 else args[0]] \
            if base in ("list", "dict") else str
    name = ast.unparse(node).removeprefix("typing.")
    return _TYPES.get(name, str)


def _from_class() -> dict[str, tuple[object, object, str]]:
    from transformers import TrainingArguments

    found = {}
    for field in dataclasses.fields(TrainingArguments):
        if field.init:
            default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
            found[field.name] = (field.type, default, " ".join(field.metadata.get("help", "").split()))
    return found


def _rule_text(name: str) -> str:
    if name in IMPLEMENTED:
        values = IMPLEMENTED[name]
        return "read by the trainer" + (f" (values {', '.join(map(repr, values))})" if values else "")
    if name in WITHOUT_EFFECT_IN_TRL:
        return "accepted; no effect, as in TRL's GRPOTrainer"
    if name in REFUSED:
        return f"only the default is accepted: {REFUSED[name]}"
    return f"accepted; no effect here ({INERT.get(name, GENERIC_REASON)})"


_SPELLINGS = {
    "include_num_input_tokens_seen": lambda value: ("all" if value else "no") if isinstance(value, bool) else value,
    "debug": lambda value: " ".join(getattr(option, "value", option) for option in value or ())
    if value is None or isinstance(value, list) else value,
}
"""transformers' other spellings of a value, read as its ``TrainingArguments.__post_init__`` reads them.
``HfArgumentParser`` gives these fields another type than their default's: a command line that names
neither gives ``include_num_input_tokens_seen=False`` (transformers' ``"no"``) and ``debug=None``
(its ``""``)."""


def _shown(name: str, value) -> str:
    """``value`` as an error message shows it: a credential (``hub_token="hf_..."``) never in full."""
    from grpo_lab.credentials.recognition import secret_in

    return "<a credential, not shown>" if secret_in(value, name) is not None else repr(value)


def check_trainer_arguments(config, defaults: dict) -> None:
    """Apply the rules to ``config``'s ``TrainingArguments`` fields (see the module's docstring)."""
    added = [field.name for field in dataclasses.fields(config) if rule_of(field).trainer_argument]
    for name in added:
        value = getattr(config, name)
        plain = value.value if isinstance(value, enum.Enum) else _SPELLINGS.get(name, lambda given: given)(value)
        if plain is not value:  # transformers' IntervalStrategy and the like, as YAML stores them
            object.__setattr__(config, name, plain)
        if plain == defaults[name] or name in WITHOUT_EFFECT_IN_TRL or _without_dispatch(name, plain):
            continue
        if name in IMPLEMENTED:
            allowed = IMPLEMENTED[name]
            if allowed and plain not in allowed:
                raise NotImplementedError(
                    f"{name}={plain!r} is not supported by grpo_lab: it takes {', '.join(map(repr, allowed))}."
                )
        elif name in REFUSED:
            raise NotImplementedError(
                f"{name}={_shown(name, plain)} is accepted for compatibility with TRL but not supported by grpo_lab: "
                f"{REFUSED[name]}."
            )
        elif name not in _warned:
            _warned.add(name)
            notices.warn(f"{name}={_shown(name, plain)} has no effect in grpo_lab: {INERT.get(name, GENERIC_REASON)}.")
    _check_best_model(config)


def _check_best_model(config) -> None:
    """transformers' rule: the best checkpoint can only be loaded if one is saved at every evaluation."""
    if not config.load_best_model_at_end:
        return
    if config.eval_strategy == "no" or config.save_strategy != config.eval_strategy:
        raise ConfigError(
            f"load_best_model_at_end=True needs a checkpoint at every evaluation: set eval_strategy='steps' and "
            f"save_strategy='steps' (got eval_strategy={config.eval_strategy!r}, "
            f"save_strategy={config.save_strategy!r})."
        )
    eval_steps = config.logging_steps if config.eval_steps is None else config.eval_steps
    if config.save_steps >= 1 and eval_steps >= 1 and config.save_steps % eval_steps:
        raise ConfigError(
            f"load_best_model_at_end=True needs save_steps ({config.save_steps}) to be a multiple of eval_steps "
            f"({eval_steps}), so that every evaluated step is saved."
        )


def apply_activation_checkpointing(config) -> None:
    """transformers 5's ``activation_checkpointing`` names, given at construction, set
    ``gradient_checkpointing`` (and its kwargs) and are then cleared, so that a later edit of
    ``gradient_checkpointing`` is not undone by the next check."""
    for new, old in (("activation_checkpointing", "gradient_checkpointing"),
                     ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs")):
        value = getattr(config, new, None)
        if value is not None:
            object.__setattr__(config, old, value)
            object.__setattr__(config, new, None)




def _without_dispatch(name: str, value) -> bool:
    """Whether ``value`` is an ``accelerator_config`` that differs from the default only in
    ``dispatch_batches=False``: what :func:`record_stream_dispatch` sets, and what grpo_lab does."""
    if name != "accelerator_config" or value is None:
        return False
    from transformers.trainer_pt_utils import AcceleratorConfig

    settings = value if isinstance(value, dict) else value.to_dict()
    return {**AcceleratorConfig().to_dict(), "dispatch_batches": False} == {**AcceleratorConfig().to_dict(), **settings}


def record_stream_dispatch(config, train_dataset, eval_dataset) -> None:
    """TRL's rule for iterable (streamed) datasets: ``accelerator_config.dispatch_batches`` is set to
    False (an ``AcceleratorConfig`` made where there is none), and True is refused with TRL's message.
    grpo_lab never dispatches batches (each process draws its own prompts), so this only sets what a
    TRL script reads back from ``trainer.args``."""
    from datasets import IterableDataset

    sets = eval_dataset.values() if isinstance(eval_dataset, dict) else [eval_dataset]
    if not any(isinstance(dataset, IterableDataset) for dataset in (train_dataset, *sets)):
        return
    from transformers.trainer_pt_utils import AcceleratorConfig

    current = config.accelerator_config
    current = AcceleratorConfig(**(current or {})) if not isinstance(current, AcceleratorConfig) else current
    if current.dispatch_batches:
        raise ConfigError("Iterable datasets require `dispatch_batches=False`, but it is set to `True` in "
                         "`accelerator_config`. Please set it to `False`.")
    current.dispatch_batches = False
    object.__setattr__(config, "accelerator_config", current)
