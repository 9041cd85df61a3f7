"""What building an :class:`grpo_lab.core.engine.Engine` does, as functions that each check or make one part.

``Engine.__init__`` calls them in this module's order, which is the order that matters: the seed
is set before the model, PEFT and the reference copy take random numbers; the model's path (for
colocated vLLM) is read before PEFT wraps it; the reference copy is taken after every change to
the policy (PEFT, the float32 head, dropout, checkpointing) and before ``accelerate`` prepares it.
Each function returns what it makes; none keeps state.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref

import torch
from transformers import PreTrainedModel

from grpo_lab import notices
from grpo_lab.parallel import dist, zero
from grpo_lab.config.grpo_config import GRPOConfig
from grpo_lab.config.trainer_args import record_stream_dispatch
from grpo_lab.parallel.layout import layout_for
from grpo_lab.core.models import (
    cast_lm_head_to_fp32,
    check_model_reference,
    enable_gradient_checkpointing,
    keep_4bit_layers_differentiable,
    load_causal_lm,
    load_tokenizer,
    prepare_tokenizer,
    router_aux_loss_weight,
    with_quantization,
)
from grpo_lab.rewards import prepare_reward_funcs
from grpo_lab.rewards.preparation import check_column_names, check_reward_weights
from grpo_lab.rollout import make_backend
from grpo_lab.rollout.batch import eos_token_ids
from grpo_lab.rollout.custom import check_rollout_func
from grpo_lab.rollout.environments import (
    check_environment_setup, environment_rollout, placeholder_dataset, reward_sources,
)
from grpo_lab.rollout.hf import check_cache_device
from grpo_lab.rollout.prompts import PROMPT_CHECK_ROWS, check_prompt_room, dataset_prompt_tokens
from grpo_lab.rollout.tools import ToolCalling, check_tools
from grpo_lab.rollout.vision import (
    VISION_COUNT_ROWS, check_image_training, dataset_prompt_lengths, image_column, is_vision_model,
    is_vision_processor,
)
from grpo_lab.core.sampler import PromptSampler
from grpo_lab.core.stream_sampler import StreamSampler, first_row, is_stream


def check_dataset(dataset, name: str, *, needs_prompt: bool = True) -> None:
    """Refuse a dataset that is not a non-empty ``datasets.Dataset`` (or stream), or that has no
    'prompt' column where it ``needs_prompt`` (an environment may supply the prompts instead)."""
    if dataset is None:
        raise ValueError(f"{name} is required: give a datasets.Dataset with a 'prompt' column.")
    if isinstance(dataset, dict):  # a DatasetDict or IterableDatasetDict: the splits of a load_dataset() call
        splits = list(dataset)
        raise TypeError(
            f"{name} is a {type(dataset).__name__} of splits ({', '.join(map(repr, splits))}), not one dataset: "
            f"pick the split to train on, e.g. {name}=dataset[{splits[0] if splits else 'train'!r}]."
        )
    if is_stream(dataset):
        check_stream(dataset, name, needs_prompt=needs_prompt)
        return
    if not hasattr(dataset, "column_names") or not hasattr(dataset, "__len__"):
        raise TypeError(
            f"{name} must be a datasets.Dataset (got {type(dataset).__name__}). Build one from rows with "
            "datasets.Dataset.from_list(rows) or from columns with Dataset.from_dict({'prompt': [...], ...})."
        )
    columns = getattr(dataset, "column_names", None)
    if needs_prompt and (columns is None or "prompt" not in columns):
        raise ValueError(
            f"{name} has no 'prompt' column (columns: {columns}). Rename the column holding the prompts "
            "to 'prompt', e.g. dataset.rename_column('question', 'prompt')."
        )
    if len(dataset) == 0:
        raise ValueError(f"{name} is empty: it needs at least one prompt. Check the split, filter or select() "
                         "that built it.")


def check_stream(dataset, name: str, *, needs_prompt: bool = True) -> None:
    """A streamed dataset's checks: a 'prompt' column (from its features, else its first row) where
    it ``needs_prompt``, and a row."""
    row = first_row(dataset)
    if row is None:
        raise ValueError(f"{name} is an empty stream: it needs at least one prompt.")
    columns = dataset.column_names or list(row)
    if needs_prompt and "prompt" not in columns:
        raise ValueError(
            f"{name} has no 'prompt' column (columns: {columns}). Rename the column holding the prompts "
            "to 'prompt', e.g. dataset.rename_column('question', 'prompt')."
        )


def eval_sets(eval_dataset) -> dict[str | None, object]:
    """The eval sets by name: ``{}`` for None, ``{None: dataset}`` for one dataset, and a dict or
    ``DatasetDict`` of named sets as it is (their metrics are logged as ``eval_<name>_...``)."""
    if eval_dataset is None:
        return {}
    if isinstance(eval_dataset, dict):
        return dict(eval_dataset)
    return {None: eval_dataset}


def named_eval_dataset(eval_dataset):
    """The eval set(s) as the engine keeps them: a streamed set read into a ``Dataset`` (an eval set
    is read whole at every evaluation anyway), and a dict of sets as a ``DatasetDict`` (which
    checkpoints save and load as one)."""
    from datasets import Dataset, DatasetDict

    def kept(dataset):
        return Dataset.from_list(list(dataset)) if is_stream(dataset) else dataset

    if isinstance(eval_dataset, dict):
        return DatasetDict({name: kept(dataset) for name, dataset in eval_dataset.items()})
    return None if eval_dataset is None else kept(eval_dataset)


def named_datasets(train_dataset, eval_dataset) -> list[tuple[str, object]]:
    """``(name, dataset)`` of the train dataset and each eval set, named as errors name them."""
    return [("train_dataset", train_dataset)] + [(eval_set_label(n), d) for n, d in eval_sets(eval_dataset).items()]


def eval_set_label(name: str | None) -> str:
    return "eval_dataset" if name is None else f"eval_dataset[{name!r}]"


def checked_config(model, args, train_dataset, eval_dataset, reward_funcs, rollout_func=None,
                   environment_factory=None) -> GRPOConfig:
    """The run's config (``args``, or the defaults with TRL's ``output_dir``, ``<model name>-GRPO``), once
    the datasets, the environment setup and the reward weights are checked (an environment may supply
    the prompts, or all of train_dataset)."""
    if args is not None and not isinstance(args, GRPOConfig):
        raise TypeError(
            f"args must be a grpo_lab GRPOConfig (got {type(args).__name__}). Build one with "
            "GRPOConfig(**settings), or GRPOConfig.from_dict(...) / from_yaml(...)."
        )
    name = str(model) if isinstance(model, (str, os.PathLike)) else getattr(model.config, "_name_or_path", "")
    config = args if args is not None else GRPOConfig(output_dir=f"{name.rstrip('/').split('/')[-1]}-GRPO")
    if environment_factory is not None:
        check_environment_setup(environment_factory, train_dataset=train_dataset, eval_dataset=eval_dataset,
                                rollout_func=rollout_func, max_steps=config.max_steps)
    if train_dataset is not None or environment_factory is None:
        check_dataset(train_dataset, "train_dataset", needs_prompt=environment_factory is None)
        check_column_names(train_dataset, "train_dataset")
    if is_stream(train_dataset) and config.max_steps <= 0:
        raise ValueError(
            "train_dataset is a stream (datasets.IterableDataset), whose length is unknown: set max_steps, as "
            "transformers requires, instead of num_train_epochs."
        )
    if isinstance(eval_dataset, dict) and not eval_dataset:
        raise ValueError("eval_dataset is an empty dict: give named eval sets, e.g. {'easy': easy, 'hard': hard}.")
    for name, dataset in eval_sets(eval_dataset).items():
        check_dataset(dataset, eval_set_label(name), needs_prompt=environment_factory is None)
        check_column_names(dataset, eval_set_label(name))
    check_reward_weights(config.reward_weights, reward_funcs)
    log_setting_notes(config)  # every process, as TRL's are
    record_stream_dispatch(config, train_dataset, eval_dataset)
    return config


def start_accelerator(config: GRPOConfig):
    """The run's ``accelerate.Accelerator``, with the settings that depend on its device made."""
    accelerator = dist.make_accelerator(config.resolved_precision(), use_cpu=config.use_cpu)
    layout_for(accelerator).prepare_settings(config)
    if not config.use_vllm:
        check_cache_device(config.cache_implementation, accelerator.device)
    if config.keep_freed_cpu_memory and accelerator.device.type == "cpu":
        from grpo_lab.accel import host_memory

        host_memory.keep_freed_memory()
    return accelerator


def tokenizer_for(model, processing_class, config: GRPOConfig):
    """``(tokenizer, processor, name)``: the prepared tokenizer (``processing_class``, a tokenizer or
    its path, or the model's own; a vision-language model's processor's tokenizer), the processor
    where it takes images (else None), and the model's path or hub id (None for a model object
    without one)."""
    if isinstance(model, (str, os.PathLike)):
        name = str(model)
        # before its tokenizer is read from it: a directory that holds no model fails there without saying why
        check_model_reference(name, subfolder=config.model_kwargs().get("subfolder"))
    else:
        name = getattr(getattr(model, "config", None), "_name_or_path", None)
    remote_code = config.model_kwargs()["trust_remote_code"]
    if processing_class is None:
        if not name:
            raise ValueError("processing_class is required when the model has no name to load a tokenizer from.")
        processing_class = load_tokenizer(name, trust_remote_code=remote_code)
    elif isinstance(processing_class, (str, os.PathLike)):  # a tokenizer's directory or hub id
        processing_class = load_tokenizer(str(processing_class), trust_remote_code=remote_code)
    if is_vision_processor(processing_class):
        return prepare_tokenizer(processing_class.tokenizer), processing_class, name
    return prepare_tokenizer(processing_class), None, name


def load_policy(model, config: GRPOConfig, device: torch.device, quantization_config=None):
    """The model to train on ``device`` (loaded where ``model`` is a path, ``quantization_config`` merged
    in as TRL does; on a CPU with hub kernels off: :func:`without_hub_kernels_on_cpu`)."""
    policy = load_causal_lm(model, with_quantization(model, config.model_kwargs(), quantization_config))
    without_hub_kernels_on_cpu(policy, device)
    return policy


def without_hub_kernels_on_cpu(policy, device: torch.device) -> None:
    """Turn transformers' hub kernels off for a policy trained on a CPU. transformers loads a model
    with ``use_kernels`` on wherever the ``kernels`` package is installed (bitsandbytes brings it), and
    then re-kernelizes it at every ``train()`` / ``eval()`` that changes the mode, walking every module:
    about 1.4 ms a flip on the shipped model, two flips a step (generation runs in eval mode). The
    ``kernels`` package has no CPU kernels, so on a CPU every layer runs its own forward either way."""
    if device.type != "cpu":
        return
    for module in policy.modules():  # a PEFT model given as the policy: the transformers model inside it
        if isinstance(module, PreTrainedModel) and module.use_kernels:
            module.use_kernels = False


def check_prompts(policy, tokenizer, config: GRPOConfig, train_dataset, eval_dataset, *, custom_rollout: bool,
                  processor=None):
    """``(context, prompt_tokens, prompt_tokens_source)``: the model's context length, and the train
    dataset's prompt lengths with that dataset (None, None where it is too large to count now).

    Every prompt is rendered and counted now, so that a bad row is named before any step; a dataset
    too large for that is checked a batch at a time, as ``GenerationStage.train_rows`` draws it. With a
    rollout function or tools (``custom_rollout``) the completion's length is not known up front."""
    context = getattr(policy.config.get_text_config(), "max_position_embeddings", None)
    prompt_tokens = prompt_tokens_source = None
    for dataset_name, dataset in named_datasets(train_dataset, eval_dataset):
        tokens = counted_prompts(dataset, dataset_name, tokenizer, processor, config)
        if tokens is None:
            continue
        check_prompt_room(
            tokens, range(len(dataset)), context=context, dataset=dataset_name,
            max_new_tokens=None if custom_rollout else config.max_completion_length,
            chat_template_kwargs=config.chat_template_kwargs,
        )
        if dataset is train_dataset:
            prompt_tokens, prompt_tokens_source = tokens, dataset
    return context, prompt_tokens, prompt_tokens_source


def counted_prompts(dataset, name: str, tokenizer, processor, config: GRPOConfig) -> list[int] | None:
    """Every prompt's token count of ``dataset`` (called ``name``), or None for a stream or a dataset
    too large to count at build. With a vision-language model's ``processor``, the prompts are
    rendered as generation renders them, through the processor, with their images, so that the counts
    hold the image tokens (up to ``VISION_COUNT_ROWS`` rows with images)."""
    if dataset is None or is_stream(dataset):
        return None
    if processor is not None:
        images = image_column(dataset.column_names) is not None
        if len(dataset) > (VISION_COUNT_ROWS if images else PROMPT_CHECK_ROWS):
            return None
        return dataset_prompt_lengths(processor, dataset, config.chat_template_kwargs, name)
    if len(dataset) > PROMPT_CHECK_ROWS:
        return None
    return dataset_prompt_tokens(dataset, tokenizer, config.chat_template_kwargs, name)


def model_reference(model, name: str | None):
    """How the run names its model (``export`` and the model card write it): ``model`` where it is a path
    or hub id, else the ``name`` of the model object (a PEFT model's is its base model's)."""
    return str(model) if isinstance(model, (str, os.PathLike)) else name


def log_setting_notes(config: GRPOConfig) -> None:
    """The notes TRL logs at its trainer's start about loss types and importance-sampling levels
    that depart from their papers' setups, logged the same way (grpo_lab's logger), each with TRL's
    own phrase in it, which TRL's users and tests search for."""
    level, loss = config.importance_sampling_level, config.loss_type
    if loss == "luspo" and level != "sequence":
        notices.log_warning("loss_type='luspo' with importance_sampling_level='token': the LUSPO paper uses "
                            "importance_sampling_level='sequence' (TRL: `importance_sampling_level` should be set "
                            "to `'sequence'` to mirror the paper's setup).")
    if loss == "vespo" and level != "token":
        notices.log_warning("loss_type='vespo': VESPO computes sequence-level importance weights internally; leave "
                            "importance_sampling_level at 'token' (the default).")
    if level == "sequence" and loss in ("bnpo", "dr_grpo", "dapo", "cispo"):
        notices.log_warning(
            f"importance_sampling_level='sequence' with loss_type={loss!r}: this loss adds up token terms, which "
            "effectively weights each sequence by its completion length instead of counting it once, unlike the "
            "GSPO paper's per-sequence objective; loss_type='grpo' follows the paper."
        )


def check_policy(policy, config: GRPOConfig, processing_class, datasets: tuple, custom: dict) -> None:
    """Refuse what the policy cannot train on, each named with the fix: images it or the processing
    class cannot take, or that the generation settings (``custom``: the rollout function, tools and
    environment factory given) cannot (:func:`grpo_lab.rollout.vision.check_image_training`; in the
    train and eval ``datasets``); tokenizer ids it has no embeddings for; a load-balancing loss weight
    for a model without router logits. Lets 4-bit layers pass gradients on."""
    checked = [(name, dataset, dataset is not None and not is_stream(dataset) and len(dataset) <= PROMPT_CHECK_ROWS)
               for name, dataset in named_datasets(*datasets)]
    check_image_training(processing_class, policy, config, checked, custom)
    tokenizer = processing_class.tokenizer if is_vision_processor(processing_class) else processing_class
    embeddings = policy.get_input_embeddings()
    if embeddings is not None and len(tokenizer) > embeddings.num_embeddings:
        raise ValueError(
            f"The tokenizer has {len(tokenizer)} tokens but the model has embeddings for only "
            f"{embeddings.num_embeddings}: token ids from {embeddings.num_embeddings} on have none. Give the model's "
            "own tokenizer (processing_class), or grow the model's embeddings to the tokenizer before building the "
            "session: model.resize_token_embeddings(len(tokenizer))."
        )
    router_aux_loss_weight(policy, config.router_aux_loss_coef)
    keep_4bit_layers_differentiable(policy)


def vllm_model_source(engine, model, policy, config: GRPOConfig):
    """``(source, remove_copy)``: what colocated vLLM loads (None without it), and a call that removes
    the copy made for it. The source is the model's path or hub id; the base model of a PEFT model
    (its adapter follows with every request); or a copy of a model object, saved to a temporary
    directory with the engine's ``processing_class`` (the tokenizer, or a vision-language model's
    processor, which vLLM loads from there too), removed with ``engine``."""
    if not (config.use_vllm and config.vllm_mode == "colocate"):
        return None, lambda: None
    if isinstance(model, (str, os.PathLike)):
        return str(model), lambda: None
    if hasattr(policy, "peft_config"):
        name = next(iter(policy.peft_config.values())).base_model_name_or_path
    elif getattr(policy, "is_quantized", False):
        name = getattr(policy.config, "_name_or_path", "")
    else:
        directory = tempfile.mkdtemp(prefix="grpo_lab_vllm_model_")
        remove_copy = weakref.finalize(engine, shutil.rmtree, directory, True)
        policy.save_pretrained(directory)
        engine.processing_class.save_pretrained(directory)
        return directory, remove_copy
    if not name:
        raise ValueError(
            "use_vllm=True with a quantized or PEFT model object needs its base model's path: pass the "
            "model as a path or hub id (with model_init_kwargs), or set the base model's path in its config."
        )
    return name, lambda: None


def adapt_policy(policy, config: GRPOConfig, peft_config, accelerator):
    """``(policy, is_peft)``: the policy with its PEFT adapter, float32 head, dropout and activation
    checkpointing as the config asks, in training mode (and, for a vision-language model, DDP told to
    look for parameters without gradients)."""
    if peft_config is not None:
        from peft import get_peft_model

        policy = get_peft_model(policy, peft_config)
    is_peft = peft_config is not None or hasattr(policy, "disable_adapter") and hasattr(policy, "peft_config")
    if config.cast_lm_head_to_fp32:
        cast_head_to_fp32(policy, accelerator)  # before the reference copy, which keeps it
    if config.disable_dropout:
        for module in policy.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    if config.gradient_checkpointing:
        enable_gradient_checkpointing(policy, config.gradient_checkpointing_kwargs or {"use_reentrant": False})
        if is_peft:
            policy.enable_input_require_grads()
    if is_vision_model(policy):
        # As TRL: a vision tower has weights no step reaches (the norm after the layer its features are taken
        # from, a pooling head), which DDP must be told to look for; reentrant checkpointing cannot have it.
        if config.gradient_checkpointing and (config.gradient_checkpointing_kwargs or {}).get("use_reentrant"):
            if accelerator.num_processes > 1:
                raise ValueError(
                    "gradient_checkpointing_kwargs={'use_reentrant': True} cannot train a vision-language model on "
                    "several processes: DDP must look for the vision tower's weights no step reaches, which "
                    "reentrant checkpointing does not allow. Set use_reentrant=False (the default)."
                )
        else:
            dist.find_unused_parameters(accelerator)
    # from_pretrained returns a model in eval mode, where transformers skips gradient checkpointing
    # and dropout; the policy trains in training mode (generation switches to eval and back).
    policy.train()
    return policy, is_peft


def cast_head_to_fp32(policy, accelerator) -> None:
    """``cast_lm_head_to_fp32``, refused under FSDP without mixed precision where the other trainable
    weights are not float32."""
    cast_lm_head_to_fp32(policy)
    half = sorted({str(p.dtype) for p in policy.parameters() if p.requires_grad and p.dtype != torch.float32})
    if half and layout_for(accelerator).one_dtype_per_shard and accelerator.mixed_precision == "no":
        raise ValueError(
            f"cast_lm_head_to_fp32=True under FSDP without mixed precision, on {', '.join(half)} weights: FSDP "
            "shards the output layer with the final norm and needs one dtype among the trainable parameters it "
            "shards together. Train with mixed precision (bf16=True: accelerate keeps the weights in float32), "
            "or load the model in float32."
        )


def reference_copy(policy, config: GRPOConfig, is_peft: bool, device):
    """The frozen reference model of the KL term (beta > 0), or None: with PEFT the base model under
    the adapter is the reference."""
    if config.beta > 0 and not is_peft:
        return zero.whole_copy(policy).eval().requires_grad_(False).to(device)
    return None


def custom_rollout(rollout_func, tools, environment_factory, tokenizer, model, train_dataset, config: GRPOConfig,
                   batching):
    """``(tools, custom_rollout, environments, train_dataset)``: the checked tools; what generates the
    completions in place of the backend (and receives ``rollout_owner``, the GRPOSession): the
    rollout function, the tool loop, or None; the run's environments (None without
    ``environment_factory``); and the train dataset (one generation batch of placeholder prompts
    where an environment supplies them all)."""
    check_rollout_func(rollout_func)
    if tools is not None and rollout_func is not None:
        raise ValueError(
            "Give tools or rollout_func, not both: a rollout function runs its own tools "
            "(grpo_lab.rollout.tools.ToolCalling, the loop behind tools=, is one)."
        )
    if environment_factory is not None:
        if train_dataset is None:
            train_dataset = placeholder_dataset(batching.generation_batch_size // config.num_generations)
        return (*environment_rollout(tools, environment_factory, tokenizer, eos_token_ids(tokenizer, model),
                                     train_dataset, config.chat_template_kwargs), train_dataset)
    if tools is None:
        return None, rollout_func, None, train_dataset
    first = first_row(train_dataset) if is_stream(train_dataset) else train_dataset[0]
    tools = check_tools(tools, tokenizer, first["prompt"], config.chat_template_kwargs)
    loop = ToolCalling(tools, tokenizer, eos_token_ids(tokenizer, model), config.chat_template_kwargs)
    return tools, loop, None, train_dataset


def prompt_sampler(config: GRPOConfig, batching, train_dataset) -> PromptSampler | StreamSampler:
    """The order prompts are drawn in, shared by all processes: seeded shuffling of a dataset, or a
    stream's own order."""
    if is_stream(train_dataset):
        return StreamSampler(train_dataset, batching.generation_batch_size // config.num_generations)
    return PromptSampler(
        dataset_size=len(train_dataset),
        prompts_per_batch=batching.generation_batch_size // config.num_generations,
        seed=config.data_seed if config.data_seed is not None else config.seed,
        shuffle=config.shuffle_dataset is not False,
    )


def reward_functions(reward_funcs, reward_processing_classes, config: GRPOConfig, columns, device, environments=None):
    """``(funcs, processing_classes, names)`` of the reward functions (``reward_funcs``, then the
    environments' ``get_reward``), reward models moved to ``device``."""
    reward_funcs, reward_processing_classes = reward_sources(reward_funcs, reward_processing_classes, environments)
    funcs, classes, names = prepare_reward_funcs(
        reward_funcs, reward_processing_classes, config.model_kwargs(), columns=columns
    )
    for func in funcs:
        if isinstance(func, PreTrainedModel):
            func.to(device)
    return funcs, classes, names


def lora_rank(peft_config, is_peft: bool, model) -> int:
    """The rank of the trained adapter (0: full weights), for vLLM's LoRA slots."""
    rank = int(getattr(peft_config, "r", 0) or 0) if is_peft else 0
    if is_peft and not rank:
        rank = max(int(c.r) for c in model.peft_config.values())
    return rank


def rollout_backend(config: GRPOConfig, *, remove_model_copy, **parts):
    """The generation backend (``rollout.make_backend`` with ``parts``); where building it fails, the
    model copy made for it is removed first."""
    try:
        return make_backend(config, **parts)
    except BaseException:
        remove_model_copy()
        raise
