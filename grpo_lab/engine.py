"""THE trainer core: one method per GRPO stage over an ``accelerate.Accelerator``.

``GRPOSession`` (stepping in a notebook) and ``GRPOTrainer`` (a script under ``accelerate launch``)
both drive this class, stage by stage, in the same order: ``generate`` -> ``score`` ->
``advantages`` -> ``loss`` -> ``update``. The math lives in :mod:`grpo_lab.ops`; this module wires it
to models, data, reward functions and processes.

Batch bookkeeping follows TRL: one generation batch holds ``steps_per_generation`` micro-batches of
``per_device_train_batch_size`` completions per process; an optimizer step consumes
``gradient_accumulation_steps`` micro-batches; the batch is reused ``num_iterations`` times. Unlike
TRL, ``steps_per_generation`` must be a multiple of ``gradient_accumulation_steps`` so that an
optimizer step never straddles two generation batches (which keeps stage-by-stage stepping
well defined), and micro-batches are taken in order rather than shuffled.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import shutil
import tempfile
import warnings
import weakref
from typing import NamedTuple

import torch
from transformers import PreTrainedModel, TrainerState, get_scheduler, set_seed

from grpo_lab import compact_forward, dist, host_memory, notices, ops
from grpo_lab.config import GRPOConfig
from grpo_lab.models import (
    cast_lm_head_to_fp32,
    check_model_reference,
    enable_gradient_checkpointing,
    keep_4bit_layers_differentiable,
    load_causal_lm,
    load_tokenizer,
    prepare_tokenizer,
    router_aux_loss_weight,
    routes_to_experts,
)
from grpo_lab.prefix_sharing import PrefixSharing, full_forward, unpack
from grpo_lab.metrics import generation_metrics, loss_metrics, sampling_metrics, tool_metrics
from grpo_lab.rewards import check_reward_signatures, prepare_reward_funcs, score_completions
from grpo_lab.rewards.runner import CALL_KEYWORDS, check_column_names, check_reward_weights
from grpo_lab.rollout import make_backend
from grpo_lab.rollout.batch import eos_token_ids, padded_to_multiple
from grpo_lab.rollout.custom import CustomBatch, call_rollout_func, check_rollout_func
from grpo_lab.rollout.prompts import PROMPT_CHECK_ROWS, check_prompt_room, dataset_prompt_tokens, prompt_token_counts
from grpo_lab.rollout.tools import ToolCalling, check_tools
from grpo_lab.rollout.hf import check_cache_device
from grpo_lab.rollout.prompts import render_prompts, wrap_completions
from grpo_lab.sampler import PromptSampler
from grpo_lab.types import Advantages, LossResult, Rollout, Scores, generated_mask

_GLOBAL_NORMALIZER_LOSSES = {"dapo", "cispo", "vespo"}


class _MicroBatch(NamedTuple):
    """One micro-batch's forward pass and loss (``Engine._micro_batch_loss``)."""

    loss: torch.Tensor
    logprobs_BT: torch.Tensor
    entropies_BT: torch.Tensor
    out: ops.PolicyLossOutput
    mask_BT: torch.Tensor
    kept_BT: torch.Tensor  # the tokens the entropy statistic counts
    off_policy_B1: torch.Tensor | None
    aux_loss: torch.Tensor | None  # a mixture-of-experts model's load-balancing loss, when weighted


def _finite_zero_gradient(loss: torch.Tensor, ratio_BT: torch.Tensor, mask_BT: torch.Tensor) -> bool:
    """Whether a zero-advantage micro-batch's backward pass would give a finite (zero) gradient: its
    loss is finite, and so are the importance ratios of its kept tokens (an infinite ratio times a
    zero advantage back-propagates NaN even where the loss is 0)."""
    kept = ratio_BT.expand_as(mask_BT)[mask_BT.bool()]
    return bool(torch.isfinite(loss)) and bool(torch.isfinite(kept).all())


def check_dataset(dataset, name: str) -> None:
    if dataset is None:
        raise ValueError(f"{name} is required: give a datasets.Dataset with a 'prompt' column.")
    if not hasattr(dataset, "column_names") or not hasattr(dataset, "__len__"):
        raise TypeError(
            f"{name} must be a datasets.Dataset (got {type(dataset).__name__}). Build one from rows with "
            "datasets.Dataset.from_list(rows) or from columns with Dataset.from_dict({'prompt': [...], ...})."
        )
    columns = getattr(dataset, "column_names", None)
    if columns is None or "prompt" not in columns:
        raise ValueError(
            f"{name} has no 'prompt' column (columns: {columns}). Rename the column holding the prompts "
            "to 'prompt', e.g. dataset.rename_column('question', 'prompt')."
        )
    if len(dataset) == 0:
        raise ValueError(f"{name} is empty: it needs at least one prompt.")


class Engine:
    """Model, optimizer, data and reward functions, with one method per GRPO stage."""

    def __init__(
        self,
        model,
        reward_funcs,
        args: GRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        peft_config=None,
        optimizers=(None, None),
        rollout_func=None,
        tools=None,
    ):
        if args is not None and not isinstance(args, GRPOConfig):
            raise TypeError(
                f"args must be a grpo_lab GRPOConfig (got {type(args).__name__}). Build one with "
                "GRPOConfig(**settings), or GRPOConfig.from_dict(...) / from_yaml(...)."
            )
        self.config = args if args is not None else GRPOConfig()
        config = self.config
        check_dataset(train_dataset, "train_dataset")
        if eval_dataset is not None:
            check_dataset(eval_dataset, "eval_dataset")
        for dataset_name, dataset in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
            check_column_names(dataset, dataset_name)
        check_reward_weights(config.reward_weights, reward_funcs)
        self.accelerator = dist.make_accelerator(config.resolved_precision(), use_cpu=config.use_cpu)
        if not config.use_vllm:
            check_cache_device(config.cache_implementation, self.accelerator.device)
        if config.keep_freed_cpu_memory and self.accelerator.device.type == "cpu":
            host_memory.keep_freed_memory()
        self.batching = config.resolve(self.accelerator.num_processes)
        spg, ga = self.batching.steps_per_generation, config.gradient_accumulation_steps
        # Prompt order is shared by all processes (the sampler's own generator); sampling differs.
        set_seed(config.seed + self.accelerator.process_index)

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
        self.tokenizer = prepare_tokenizer(processing_class)
        policy = load_causal_lm(model, config.model_kwargs())
        embeddings = policy.get_input_embeddings()
        if embeddings is not None and len(self.tokenizer) > embeddings.num_embeddings:
            raise ValueError(
                f"The tokenizer has {len(self.tokenizer)} tokens but the model has embeddings for only "
                f"{embeddings.num_embeddings}: token ids from {embeddings.num_embeddings} on have none. Give the model's "
                "own tokenizer (processing_class), or grow the model's embeddings to the tokenizer before building the "
                "session: model.resize_token_embeddings(len(tokenizer))."
            )
        # Every prompt rendered and counted now, so that a bad row is named before any step; a dataset too
        # large for that is checked a batch at a time, as _train_rows draws it.
        self._context = getattr(policy.config.get_text_config(), "max_position_embeddings", None)
        self._prompt_tokens = self._prompt_tokens_source = None  # train_dataset's prompt lengths, and that dataset
        for dataset_name, dataset in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
            if dataset is not None and len(dataset) <= PROMPT_CHECK_ROWS:
                tokens = dataset_prompt_tokens(dataset, self.tokenizer, config.chat_template_kwargs, dataset_name)
                check_prompt_room(
                    tokens, range(len(dataset)), context=self._context, dataset=dataset_name,
                    max_new_tokens=None if rollout_func is not None or tools is not None else config.max_completion_length,
                    chat_template_kwargs=config.chat_template_kwargs,
                )
                if dataset is train_dataset:
                    self._prompt_tokens, self._prompt_tokens_source = tokens, dataset
        router_aux_loss_weight(policy, config.router_aux_loss_coef)  # refused here for a model without router logits
        keep_4bit_layers_differentiable(policy)
        self.model_reference = str(model) if not isinstance(model, PreTrainedModel) else name
        self._remove_model_copy = lambda: None
        vllm_model = self._vllm_model_source(model, policy) if config.use_vllm and config.vllm_mode == "colocate" else None
        if peft_config is not None:
            from peft import get_peft_model

            policy = get_peft_model(policy, peft_config)
        self.is_peft = peft_config is not None or hasattr(policy, "disable_adapter") and hasattr(policy, "peft_config")
        if config.cast_lm_head_to_fp32:
            cast_lm_head_to_fp32(policy)  # before the reference copy, which keeps it
            half = sorted({str(p.dtype) for p in policy.parameters() if p.requires_grad and p.dtype != torch.float32})
            if half and dist.sharding(self.accelerator) == "fsdp" and self.accelerator.mixed_precision == "no":
                raise ValueError(
                    f"cast_lm_head_to_fp32=True under FSDP without mixed precision, on {', '.join(half)} weights: FSDP "
                    "shards the output layer with the final norm and needs one dtype among the trainable parameters it "
                    "shards together. Train with mixed precision (bf16=True: accelerate keeps the weights in float32), "
                    "or load the model in float32."
                )
        if config.disable_dropout:
            for module in policy.modules():
                if isinstance(module, torch.nn.Dropout):
                    module.p = 0.0
        if config.gradient_checkpointing:
            enable_gradient_checkpointing(policy, config.gradient_checkpointing_kwargs or {"use_reentrant": False})
            if self.is_peft:
                policy.enable_input_require_grads()
        # from_pretrained returns a model in eval mode, where transformers skips gradient checkpointing
        # and dropout; the policy trains in training mode (generation switches to eval and back).
        policy.train()
        self.prefix_sharing = PrefixSharing()
        self.ref_model = None
        if config.beta > 0 and not self.is_peft:
            self.ref_model = copy.deepcopy(policy).eval().requires_grad_(False).to(self.accelerator.device)

        optimizer, scheduler = optimizers
        self.owns_optimizer = optimizer is None
        if optimizer is None:
            optimizer = torch.optim.AdamW(
                [p for p in policy.parameters() if p.requires_grad],
                lr=config.learning_rate,
                betas=(config.adam_beta1, config.adam_beta2),
                eps=config.adam_epsilon,
                weight_decay=config.weight_decay,
                fused=config.optim == "adamw_torch_fused",
            )
        self.model, self.optimizer = self.accelerator.prepare(policy, optimizer)
        self.unwrapped_model = self.accelerator.unwrap_model(self.model)  # once: each unwrap costs about 0.1 ms
        if self.ref_model is not None:  # FSDP: sharded like the policy, not a whole copy on every process
            self.ref_model = dist.shard_frozen_copy(self.accelerator, self.ref_model)
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        check_rollout_func(rollout_func)
        if tools is not None and rollout_func is not None:
            raise ValueError(
                "Give tools or rollout_func, not both: a rollout function runs its own tools "
                "(grpo_lab.rollout.tools.ToolCalling, the loop behind tools=, is one)."
            )
        self.rollout_func = rollout_func
        self.tools = None if tools is None else check_tools(tools, self.tokenizer, train_dataset[0]["prompt"], config.chat_template_kwargs)
        # What generates the completions in place of the backend (and receives rollout_owner, the GRPOSession).
        self.custom_rollout = rollout_func if tools is None else ToolCalling(
            self.tools, self.tokenizer, eos_token_ids(self.tokenizer, self.unwrapped_model), config.chat_template_kwargs,
        )
        self.rollout_owner = None
        self._in_rollout = False  # while the rollout function runs: generate() from inside it would recurse
        self._rows_source = self._rows_view = None  # a format-free view of train_dataset, see _train_rows
        self.sampler = PromptSampler(
            dataset_size=len(train_dataset),
            prompts_per_batch=self.batching.generation_batch_size // config.num_generations,
            seed=config.data_seed if config.data_seed is not None else config.seed,
            shuffle=config.shuffle_dataset is not False,
        )
        self.steps_per_batch = config.num_iterations * spg // ga
        self.owns_scheduler = scheduler is None
        self.scheduler = self._new_scheduler() if scheduler is None else scheduler
        funcs, classes, names = prepare_reward_funcs(
            reward_funcs, reward_processing_classes, config.model_kwargs(), columns=self.reward_columns()
        )
        self.reward_funcs, self.reward_processing_classes, self.reward_names = funcs, classes, names
        for func in funcs:
            if isinstance(func, PreTrainedModel):
                func.to(self.accelerator.device)
        self.global_step = 0
        self.num_input_tokens_seen = 0
        self.trained_parameter_names: set[str] | None = None  # parameters a backward pass reaches (_complete_gradients)
        self._routes_to_experts = routes_to_experts(self.unwrapped_model)
        # The entropy bonus's weight, and the last optimizer step's mean token entropy, which the
        # adaptive weight (use_adaptive_entropy) follows; both are checkpointed.
        self.entropy_coef = config.entropy_coef
        self.last_step_entropy: float | None = None
        self._pending_step_entropy: float | None = None
        lora_rank = int(getattr(peft_config, "r", 0) or 0) if self.is_peft else 0
        if self.is_peft and not lora_rank:
            lora_rank = max(int(c.r) for c in self.unwrapped_model.peft_config.values())
        try:
            self.rollout_backend = make_backend(
                config, model_fn=lambda: self.unwrapped_model, tokenizer=self.tokenizer, accelerator=self.accelerator,
                vllm_model=vllm_model, lora_rank=lora_rank, prefix_sharing=self.prefix_sharing,
            )
        except BaseException:
            self._remove_model_copy()
            raise
        self.published_version = 0  # a backend starts from the policy it is built with
        reason = compact_forward.unsupported_reason(self.unwrapped_model) if config.compact_forward else None
        if reason is not None and self.accelerator.is_main_process:
            notices.warn(
                f"compact_forward is on, but grpo_lab's compact forward pass cannot run this model, so transformers' "
                f"slower forward pass runs instead: {reason}. Set compact_forward=False to silence this note."
            )

    def _vllm_model_source(self, model, policy) -> str:
        """What colocated vLLM loads: the model's path or hub id; the base model of a PEFT model (its
        adapter follows with every request); or a copy of a model object, saved to a temporary
        directory that is removed with the engine."""
        if isinstance(model, (str, os.PathLike)):
            return str(model)
        if hasattr(policy, "peft_config"):
            name = next(iter(policy.peft_config.values())).base_model_name_or_path
        elif getattr(policy, "is_quantized", False):
            name = getattr(policy.config, "_name_or_path", "")
        else:
            directory = tempfile.mkdtemp(prefix="grpo_lab_vllm_model_")
            self._remove_model_copy = weakref.finalize(self, shutil.rmtree, directory, True)
            policy.save_pretrained(directory)
            self.tokenizer.save_pretrained(directory)
            return directory
        if not name:
            raise ValueError(
                "use_vllm=True with a quantized or PEFT model object needs its base model's path: pass the "
                "model as a path or hub id (with model_init_kwargs), or set the base model's path in its config."
            )
        return name

    def close(self) -> None:
        """Release the generation backend (a vLLM engine holds memory until then), and return the
        free memory that ``keep_freed_cpu_memory`` kept to the kernel."""
        self.rollout_backend.close()
        self._remove_model_copy()
        host_memory.release_freed_memory()

    # ------------------------------------------------------------------ bookkeeping
    def total_steps(self) -> int:
        """Optimizer steps of the whole run: ``max_steps``, or ``num_train_epochs`` worth of batches."""
        if self.config.max_steps > 0:
            return self.config.max_steps
        batches_per_epoch = self.sampler.dataset_size // self.sampler.prompts_per_batch
        return max(1, math.ceil(self.config.num_train_epochs * batches_per_epoch * self.steps_per_batch))

    def trainer_state(self) -> TrainerState:
        """What reward functions receive as ``trainer_state`` (TRL passes transformers' TrainerState)."""
        return TrainerState(
            global_step=self.global_step, max_steps=self.total_steps(), epoch=self.sampler.epoch_progress
        )

    def needs_old_logprobs(self) -> bool:
        """Old log-probs differ from the current ones only when a batch is reused across updates; the
        vLLM importance-sampling correction compares them with the sampling log-probs."""
        return (
            self.config.num_iterations > 1
            or self.batching.steps_per_generation > self.config.gradient_accumulation_steps
            or self.corrects_sampling()
        )

    def corrects_sampling(self) -> bool:
        """Whether completions come from an inference engine and are reweighted (vLLM IS correction)."""
        return self.config.use_vllm and self.config.vllm_importance_sampling_correction

    def apply_adamw_settings(self) -> None:
        """Apply the config's AdamW betas, epsilon and weight decay from the next optimizer step on
        (to the optimizer grpo_lab built; one passed in ``optimizers=`` keeps its own)."""
        if self.owns_optimizer:
            config = self.config
            for group in self.optimizer.param_groups:
                group.update(betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_epsilon,
                             weight_decay=config.weight_decay)

    def _new_scheduler(self):
        """The learning-rate schedule of ``lr_scheduler_type`` over ``total_steps()``, at step 0."""
        config, total = self.config, self.total_steps()
        fraction = config.warmup_steps if 0 < config.warmup_steps < 1 else config.warmup_ratio
        warmup = int(config.warmup_steps) if config.warmup_steps >= 1 else math.ceil(fraction * total)
        return get_scheduler(
            config.lr_scheduler_type, self.optimizer, num_warmup_steps=warmup, num_training_steps=total,
            scheduler_specific_kwargs=config.lr_scheduler_kwargs or {},
        )

    def rebuild_schedule(self) -> None:
        """Rebuild the learning-rate schedule from the config (after ``max_steps``, ``num_train_epochs``,
        ``lr_scheduler_type``, ``lr_scheduler_kwargs``, ``warmup_steps`` or ``warmup_ratio`` changed)
        and move it as far as the old one had gone (skipped updates did not step it), as if the run had
        started with these settings. Only for a schedule grpo_lab built (``owns_scheduler``)."""
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs, strict=True):
            group["initial_lr"] = base  # each group's own base rate
        scheduler = self._new_scheduler()
        with warnings.catch_warnings():  # stepping a fresh schedule forward, not skipping an optimizer step
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            for _ in range(self.scheduler.last_epoch):  # the steps taken: skipped updates did not step it
                scheduler.step()
        self.scheduler = scheduler

    def restart_entropy_weight(self, *, forget_entropy: bool = False) -> None:
        """Restart the entropy bonus's weight from ``entropy_coef``; with ``forget_entropy`` (when
        ``use_adaptive_entropy`` is switched) also drop the last measured step entropy, so that an
        entropy from before the switch does not gate or adapt the weight."""
        self.entropy_coef = self.config.entropy_coef
        if forget_entropy:
            self.last_step_entropy = self._pending_step_entropy = None

    def set_learning_rate(self, value: float, previous: float) -> None:
        """Apply ``learning_rate`` ``value`` (was ``previous``) from now on, keeping the schedule's current
        factor: each parameter group's base rate is scaled by ``value / previous``, so groups given
        their own rates (``optimizers=``) keep their ratios; from a previous rate of 0, every base is
        ``value`` and the factor is read from the schedule (1 for a scheduler without ``lr_lambdas``)."""
        bases = [base * value / previous if previous else value for base in self.scheduler.base_lrs]
        lambdas = getattr(self.scheduler, "lr_lambdas", None)
        for index, (group, base, new) in enumerate(zip(self.optimizer.param_groups, self.scheduler.base_lrs, bases, strict=True)):
            if base:
                factor = group["lr"] / base
            else:
                factor = lambdas[index](self.scheduler.last_epoch) if lambdas else 1.0
            group["lr"] = new * factor
        self.scheduler.base_lrs = bases

    # ------------------------------------------------------------------ log-probs
    def sequence_logprobs(self, model, rollout: Rollout, index_B: torch.Tensor, *, with_entropy: bool,
                          entropy_grad: bool = False):
        """Per-token log-probs (and entropies) of the completions ``index_B`` under ``model``:
        ``(logprobs_BT, entropies_BT or None)``; see ``logprobs_and_aux_loss``."""
        return self.logprobs_and_aux_loss(model, rollout, index_B, with_entropy=with_entropy, entropy_grad=entropy_grad)[:2]

    def logprobs_and_aux_loss(self, model, rollout: Rollout, index_B: torch.Tensor, *, with_entropy: bool,
                              entropy_grad: bool = False, router_aux_loss: bool = False):
        """Per-token log-probs (and entropies, and a mixture-of-experts model's load-balancing loss)
        of the completions ``index_B`` under ``model``: ``(logprobs_BT, entropies_BT or None,
        aux_loss or None)``.

        Logits are divided by the sampling temperature first, so the log-probs are those of the
        distribution the completions were sampled from (as TRL does). A group's shared prompt is
        run once where the model allows it (``share_prompt_prefix``); with ``compact_forward`` only the
        kept tokens are scored, and the (B, T) results hold zeros after each completion's end.
        Entropies carry their gradient only with ``entropy_grad`` (for the entropy bonus). While the
        load-balancing loss is weighted, every pass runs whole sequences, as that loss is over them
        (and the old policy's log-probs then come from the same path as the training pass's).
        """
        completion_ids = rollout.completion_ids_BT[index_B]
        rows = (model, rollout.prompt_ids_BP[index_B], rollout.prompt_mask_BP[index_B], completion_ids,
                rollout.completion_mask_BT[index_B])
        aux_loss = None
        if router_aux_loss:
            output = full_forward(*rows, output_router_logits=True)
            logits, slots_N, aux_loss = output.logits[:, :-1, :], None, getattr(output, "aux_loss", None)
            if not isinstance(aux_loss, torch.Tensor):
                raise ValueError(
                    f"router_aux_loss_coef weights a load-balancing loss ({self.router_aux_loss_weight():g}, "
                    f"{'the model config' if self.config.router_aux_loss_coef is None else 'set'}), but "
                    f"{type(self.unwrapped_model).__name__} returns none with output_router_logits=True. "
                    "Set router_aux_loss_coef=0."
                )
        else:
            logits, slots_N = self.prefix_sharing.logits(
                *rows, enabled=self.config.share_prompt_prefix and (model is not self.model or self.router_aux_loss_weight() == 0.0),
                compact=self.config.compact_forward,
            )
        if slots_N is not None:  # the kept tokens only, as one row
            logits, token_ids = logits.unsqueeze(0), completion_ids.flatten().index_select(0, slots_N).unsqueeze(0)
        else:
            token_ids = completion_ids
        logits = logits.float()
        if self.config.temperature != 1.0:
            logits = logits / self.config.temperature
        logprobs = ops.selective_log_softmax(logits, token_ids)
        entropies = None
        if with_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                entropies = ops.entropy_from_logits(logits)
        if slots_N is None:
            return logprobs, entropies, aux_loss
        spread = lambda values: unpack(values[0], slots_N, *completion_ids.shape)  # noqa: E731
        return spread(logprobs), None if entropies is None else spread(entropies), aux_loss

    @torch.no_grad()
    def _batched_logprobs(self, model, rollout: Rollout) -> torch.Tensor:
        size = self.config.per_device_train_batch_size
        parts = []
        for start in range(0, len(rollout), size):
            index_B = torch.arange(start, min(start + size, len(rollout)))
            parts.append(self.sequence_logprobs(model, rollout, index_B, with_entropy=False)[0])
        return torch.cat(parts)

    # ------------------------------------------------------------------ stages
    def generate(self) -> Rollout:
        """Draw the next generation batch of prompts and sample ``num_generations`` completions each."""
        config = self.config
        if self.published_version != self.global_step:
            self.publish_weights()
        sampler_state = self.sampler.state_dict()
        try:
            indices = self.sampler.next_indices()
            global_rows = [i for i in indices for _ in range(config.num_generations)]
            group_B = [position // config.num_generations for position in range(len(global_rows))]
            local = dist.local_slice(self.accelerator, len(global_rows))
            rows = self._train_rows(global_rows[local])
            prompts = rows.pop("prompt")
            batch, env_mask_BT, extra, completions = self._generate_batch(prompts, list(rows))
            batch, env_mask_BT = padded_to_multiple(batch, env_mask_BT, config.pad_multiple(), pad_token_id=self.tokenizer.pad_token_id)
            rows.update(extra)
            self.check_policy_version(batch)
        except BaseException:
            self.sampler.load_state_dict(sampler_state)
            raise
        completion_texts = self.tokenizer.batch_decode(batch.completion_ids_BT, skip_special_tokens=True)
        rollout = Rollout(
            prompts=prompts,
            completions=wrap_completions(prompts, completion_texts) if completions is None else completions,
            completion_texts=completion_texts,
            columns=rows,
            prompt_ids_BP=batch.prompt_ids_BP,
            prompt_mask_BP=batch.prompt_mask_BP,
            completion_ids_BT=batch.completion_ids_BT,
            completion_mask_BT=batch.completion_mask_BT,
            is_truncated_B=batch.is_truncated_B,
            group_index_B=torch.tensor(group_B[local]),
            step=self.global_step,
            sampling_logprobs_BT=batch.sampling_logprobs_BT,
            policy_version=batch.policy_version,
            env_mask_BT=env_mask_BT,
            extra_keys=tuple(extra),
        )
        with self.accelerator.autocast():
            if self.needs_old_logprobs():
                rollout.old_logprobs_BT = self._batched_logprobs(self.model, rollout)
            if config.beta > 0:
                rollout.ref_logprobs_BT = self._reference_logprobs(rollout)
        if self.corrects_sampling() and rollout.sampling_logprobs_BT is not None:
            self._importance_weights(rollout)
        tokens = batch.prompt_mask_BP.sum() + rollout.completion_lengths_B.sum()
        self.num_input_tokens_seen += int(dist.total(self.accelerator, tokens))
        return rollout

    def check_policy_version(self, batch) -> None:
        """Refuse completions an inference engine generated with another policy than the current one."""
        if batch.policy_version is not None and batch.policy_version != self.global_step:
            raise RuntimeError(
                f"The {self.rollout_backend.name} backend generated with the policy of step {batch.policy_version}, "
                f"but the trainer is at step {self.global_step}: the server was restarted (resume the run from "
                "its last checkpoint, which pushes the policy again) or another run shares it (give each its own)."
            )

    def _generate_batch(self, prompts: list, columns: list[str]) -> CustomBatch:
        """The completions of ``prompts`` (one per completion): from the rollout function or the tool
        loop when there is one, else from the generation backend."""
        if self.custom_rollout is None:
            texts = render_prompts(prompts, self.tokenizer, self.config.chat_template_kwargs)
            return CustomBatch(self.rollout_backend.generate(texts, self.config), None, {}, None)
        if self._in_rollout:
            raise RuntimeError(
                "generate() (or step(), evaluate()) was called from inside the rollout function: sample its "
                "completions with session.sample(prompts) instead."
            )
        self._in_rollout = True
        try:
            return call_rollout_func(
                self.custom_rollout, prompts, self.rollout_owner, pad_token_id=self.tokenizer.pad_token_id,
                eos_token_ids=eos_token_ids(self.tokenizer, self.unwrapped_model), vocab_size=self.vocab_size(),
                context=getattr(self.unwrapped_model.config, "max_position_embeddings", None),
                reserved={"prompt", *CALL_KEYWORDS, *columns}, device=self.accelerator.device,
            )
        finally:
            self._in_rollout = False

    def vocab_size(self) -> int:
        """Token ids the policy has embeddings for."""
        return self.unwrapped_model.get_input_embeddings().num_embeddings

    def reward_columns(self) -> list[str] | None:
        """The training dataset's columns that reward functions receive as keyword arguments; None with
        a rollout function (or tools), whose extra keys are known only once it has run (score() checks then)."""
        if self.custom_rollout is not None:
            return None
        return [name for name in self.train_dataset.column_names if name != "prompt"]

    def _train_rows(self, indices: list[int]) -> dict[str, list]:
        """The training dataset's rows ``indices`` as columns of Python lists, whatever format the
        dataset has (indexing a format-free view by a list is about 6x faster than select().to_dict()).
        Refuses, naming the row, a prompt that cannot be rendered or does not fit the model's context
        with the current ``max_completion_length``."""
        if self._rows_source is not self.train_dataset:
            self._rows_source, self._rows_view = self.train_dataset, self.train_dataset.with_format(None)
        rows = self._rows_view[indices]
        # The drawn prompts must fit the context with the current max_completion_length; raised here,
        # generate() puts the sampler back, and the error names the rows (generation's would not).
        drawn = list(dict.fromkeys(indices))
        if self._prompt_tokens_source is self.train_dataset:  # counted when the session was built
            tokens = [self._prompt_tokens[index] for index in drawn]
        else:  # a dataset too large to count at build, or one swapped in since
            first = {index: position for position, index in reversed(list(enumerate(indices)))}
            tokens = prompt_token_counts([rows["prompt"][first[index]] for index in drawn], self.tokenizer,
                                         self.config.chat_template_kwargs, rows=drawn)
        check_prompt_room(
            tokens, drawn, context=self._context, chat_template_kwargs=self.config.chat_template_kwargs,
            max_new_tokens=None if self.custom_rollout is not None else self.config.max_completion_length,
        )
        return rows

    def _importance_weights(self, rollout: Rollout) -> None:
        """The vLLM importance-sampling weights pi_old / pi_sampler of the batch and their stats."""
        config = self.config
        old_BT = rollout.old_logprobs_BT.float()
        sampling_BT = rollout.sampling_logprobs_BT.to(old_BT.device)
        mask_BT = rollout.generated_mask_BT.to(old_BT.device)
        clip_max = config.vllm_importance_sampling_clip_max
        if config.vllm_importance_sampling_cap is not None:
            clip_max = config.vllm_importance_sampling_cap
        rollout.importance_weights_BT = ops.vllm_importance_weights(
            old_BT, sampling_BT, mask_BT, mode=config.vllm_importance_sampling_mode,
            clip_max=clip_max, clip_min=config.vllm_importance_sampling_clip_min,
        )
        rollout.sampling_stats = ops.importance_sampling_stats(rollout.importance_weights_BT, old_BT, sampling_BT, mask_BT)

    def _reference_logprobs(self, rollout: Rollout) -> torch.Tensor:
        if self.ref_model is not None:
            logprobs = self._batched_logprobs(self.ref_model, rollout)
            dist.reshard(self.ref_model)  # FSDP: back to its shards, as TR-DPO mixing and memory want
            return logprobs
        with self.unwrapped_model.disable_adapter():  # PEFT: the base model is the reference
            return self._batched_logprobs(self.model, rollout)

    def score(self, rollout: Rollout) -> Scores:
        """Call every reward function on the completions (TRL's keyword-argument convention)."""
        completion_ids = [  # as Python lists: one indexing call per row would take longer than the rewards
            [token for token, kept in zip(ids, mask) if kept]
            for ids, mask in zip(rollout.completion_ids_BT.tolist(), rollout.completion_mask_BT.tolist())
        ]
        if self.custom_rollout is not None:
            check_reward_signatures(self.reward_funcs, self.reward_names, list(rollout.columns))
        rewards_BF, logs = score_completions(
            self.reward_funcs, self.reward_processing_classes, self.reward_names,
            prompts=rollout.prompts, completions=rollout.completions, completion_ids=completion_ids,
            columns=rollout.columns, trainer_state=self.trainer_state(), reward_timeout=self.config.reward_timeout,
        )
        return Scores(rollout, rewards_BF, list(self.reward_names), logs.extras, logs.metrics)

    def advantages(self, scores: Scores) -> Advantages:
        """Group-relative advantages from rewards gathered over every process."""
        config = self.config
        rewards_BF = dist.gather(self.accelerator, scores.rewards_BF.to(self.accelerator.device)).cpu()
        weights = torch.tensor(config.reward_weights, dtype=torch.float32) if config.reward_weights else None
        if weights is not None and len(weights) != rewards_BF.shape[1]:
            raise ValueError(
                f"reward_weights has {len(weights)} entries but there are {rewards_BF.shape[1]} reward "
                f"functions ({', '.join(scores.reward_names)}). Give one weight per function."
            )
        stats = ops.compute_advantages(
            rewards_BF, num_generations=config.num_generations, reward_weights_F=weights,
            scale_rewards=config.scale_rewards, multi_objective_aggregation=config.multi_objective_aggregation,
        )
        local = dist.local_slice(self.accelerator, rewards_BF.shape[0])
        return Advantages(
            scores=scores,
            rewards_B=stats.rewards_B[local],
            advantages_B=stats.advantages_B[local],
            group_mean_B=stats.mean_grouped_B[local],
            group_std_B=stats.std_B[local],
            is_std_zero_B=stats.is_std_zero_B[local],
            metrics=generation_metrics(
                self.accelerator, scores, rewards_BF, stats, num_tokens=self.num_input_tokens_seen,
                epoch=self.sampler.epoch_progress,
            ) | sampling_metrics(self.accelerator, scores.rollout.sampling_stats) | tool_metrics(self.accelerator, scores.rollout.columns),
        )

    def step_indices(self, batch_step: int) -> list[torch.Tensor]:
        """Completion indices of each micro-batch that optimizer step ``batch_step`` of a batch uses."""
        size = self.config.per_device_train_batch_size
        ga, spg = self.config.gradient_accumulation_steps, self.batching.steps_per_generation
        micro = [(batch_step * ga + i) % spg for i in range(ga)]
        return [torch.arange(m * size, (m + 1) * size) for m in micro]

    def loss(self, advantages: Advantages, batch_step: int = 0) -> LossResult:
        """Forward and backward passes for optimizer step ``batch_step`` of the current batch.

        Gradients are zeroed first, so calling this again (after changing settings) recomputes them.
        """
        config = self.config
        rollout = advantages.scores.rollout
        if config.beta > 0 and rollout.ref_logprobs_BT is None:  # beta switched on after this batch was sampled
            with self.accelerator.autocast():
                rollout.ref_logprobs_BT = self._reference_logprobs(rollout)
        aux_weight = self.router_aux_loss_weight()  # raises before any gradient is touched
        self.optimizer.zero_grad(set_to_none=True)
        micro_batches = self.step_indices(batch_step)
        step_index = torch.cat(micro_batches)
        loss_mask_BT = rollout.generated_mask_BT.float()
        if config.mask_truncated_completions:
            loss_mask_BT = ops.truncation_mask(loss_mask_BT, rollout.is_truncated_B)
        # dapo-style losses divide by the tokens of the whole optimizer step, counted over all processes;
        # DDP averages gradients over processes, hence the division by their number.
        global_tokens = dist.total(self.accelerator, loss_mask_BT[step_index].sum())
        normalizer = (global_tokens / self.accelerator.num_processes).clamp(min=1.0)
        epsilon_high = config.epsilon_high if config.epsilon_high is not None else config.epsilon
        entropy_coef = ops.applied_entropy_coef(
            self.entropy_coef, self.last_step_entropy, adaptive=config.use_adaptive_entropy, target=config.entropy_target,
        )
        parts, total_loss = [], 0.0
        entropy_stats = []  # per micro-batch: entropy summed over the kept tokens, and their count
        masked_sequences = torch.zeros((), device=loss_mask_BT.device)  # by off_policy_mask_threshold
        zero_K = self._zero_advantage_micro_batches(advantages, micro_batches, entropy_coef, aux_weight)
        skipped, not_finite, aux_losses = 0, False, []
        for k, index_B in enumerate(micro_batches):
            sync = k == len(micro_batches) - 1
            # A micro-batch whose advantages are all zero adds exactly nothing to the gradient: its
            # forward pass runs (for the metrics) without a backward. The last micro-batch of a step
            # always runs one where gradients are averaged or gathered in it (several processes,
            # FSDP), and where no backward pass has run yet that says which parameters it reaches.
            skip = zero_K is not None and zero_K[k] and (
                not sync or (self._whole_model_here() and (skipped < k or self.trained_parameter_names is not None))
            )
            args = (rollout, advantages, index_B, loss_mask_BT, normalizer, epsilon_high, entropy_coef, aux_weight,
                    len(micro_batches))
            with torch.no_grad() if skip else contextlib.nullcontext() if sync else self.accelerator.no_sync(self.model):
                step = self._micro_batch_loss(*args)
                if skip:
                    not_finite |= not _finite_zero_gradient(step.loss, step.out.ratio_BT, step.mask_BT)
                else:
                    self.accelerator.backward(step.loss)
            skipped += skip
            if config.use_adaptive_entropy:
                entropy_stats.append(torch.stack([(step.entropies_BT.detach() * step.kept_BT).sum(), step.kept_BT.sum()]))
            if step.off_policy_B1 is not None:
                masked_sequences += (step.off_policy_B1 == 0).sum().to(masked_sequences.device)
            if step.aux_loss is not None:
                aux_losses.append(step.aux_loss.detach())
            total_loss += float(step.loss.detach())
            parts.append((index_B, step.logprobs_BT.detach(), step.entropies_BT.detach(), step.out, step.mask_BT))
        if zero_K is not None:  # over processes, in one collective: running it would average a NaN into all
            counts = torch.tensor([[float(not_finite), float(skipped), float(len(micro_batches))]], device=self.accelerator.device)
            not_finite_all, skipped_all, micro_batches_all = dist.gather(self.accelerator, counts).sum(0).tolist()
            not_finite = not_finite_all > 0
        self._complete_gradients(none_ran=skipped == len(micro_batches), not_finite=not_finite)
        if config.use_adaptive_entropy:
            entropy_sum, tokens = (dist.total(self.accelerator, value) for value in torch.stack(entropy_stats).sum(0))
            self._pending_step_entropy = float(entropy_sum / tokens.clamp(min=1.0))
        result = self._loss_result(advantages, step_index, parts, total_loss)
        result.micro_batches, result.backward_skipped = len(micro_batches), skipped
        if config.entropy_coef != 0.0 or config.use_adaptive_entropy:
            result.metrics["entropy_coef"] = entropy_coef
        if zero_K is not None:
            result.metrics["backward_skipped_fraction"] = skipped_all / micro_batches_all
        if aux_losses:
            result.metrics["aux_loss"] = float(dist.mean(self.accelerator, torch.stack(aux_losses).mean()))
        if config.off_policy_mask_threshold is not None:
            sequences = dist.total(self.accelerator, torch.tensor(float(len(step_index)), device=masked_sequences.device))
            result.metrics["off_policy_mask/masked_fraction"] = float(dist.total(self.accelerator, masked_sequences) / sequences)
        return result

    def _micro_batch_loss(self, rollout: Rollout, advantages: Advantages, index_B, loss_mask_BT, normalizer,
                          epsilon_high: float, entropy_coef: float, aux_weight: float, micro_batches: int) -> _MicroBatch:
        """One micro-batch's forward pass and loss; a mixture-of-experts model's load-balancing loss
        is added with ``aux_weight`` / ``micro_batches`` (TRL's scaling)."""
        config = self.config
        with self.accelerator.autocast():
            logprobs_BT, entropies_BT, aux_loss = self.logprobs_and_aux_loss(
                self.model, rollout, index_B, with_entropy=True, entropy_grad=entropy_coef != 0.0,
                router_aux_loss=aux_weight != 0.0,
            )
        device = logprobs_BT.device  # the batch's tensors live on the CPU; the passes on the accelerator
        on_device = lambda tensor_BT: None if tensor_BT is None else tensor_BT[index_B].to(device)  # noqa: E731
        mask_BT = on_device(loss_mask_BT)
        entropy_mask_BT = None
        if config.top_entropy_quantile < 1.0:
            entropy_mask_BT = ops.entropy_mask(entropies_BT.detach(), mask_BT, quantile=config.top_entropy_quantile)
        kept_BT = mask_BT if entropy_mask_BT is None else mask_BT * entropy_mask_BT
        off_policy_B1 = self._off_policy_mask(rollout, index_B, advantages, logprobs_BT, mask_BT)
        out = ops.policy_loss(
            logprobs_BT,
            on_device(rollout.old_logprobs_BT),
            on_device(advantages.advantages_B),
            mask_BT,
            loss_type=config.loss_type,
            epsilon_low=config.epsilon,
            epsilon_high=epsilon_high,
            delta=config.delta,
            importance_sampling_level=config.importance_sampling_level,
            sapo_temperature_pos=config.sapo_temperature_pos,
            sapo_temperature_neg=config.sapo_temperature_neg,
            vespo_k_pos=config.vespo_k_pos,
            vespo_lambda_pos=config.vespo_lambda_pos,
            vespo_k_neg=config.vespo_k_neg,
            vespo_lambda_neg=config.vespo_lambda_neg,
            ref_logprobs_BT=on_device(rollout.ref_logprobs_BT),
            beta=config.beta,
            use_bias_correction_kl=config.use_bias_correction_kl,
            entropy_mask_BT=entropy_mask_BT,
            importance_sampling_ratio_BT=on_device(rollout.importance_weights_BT),
            max_completion_length=config.max_completion_length,
            num_items_in_batch=normalizer,
            off_policy_mask_B1=off_policy_B1,
            entropies_BT=entropies_BT,
            entropy_coef=entropy_coef,
        )
        loss = out.loss if config.loss_type in _GLOBAL_NORMALIZER_LOSSES else out.loss / micro_batches
        if aux_loss is not None:
            loss = loss + aux_weight * aux_loss.to(loss.device) / micro_batches
        return _MicroBatch(loss, logprobs_BT, entropies_BT, out, mask_BT, kept_BT, off_policy_B1, aux_loss)

    def _zero_advantage_micro_batches(self, advantages: Advantages, micro_batches: list, entropy_coef: float,
                                      aux_weight: float):
        """For each micro-batch, whether its backward pass may be skipped because its advantages are
        all zero (``skip_zero_advantage_backward``); None when none may. Every policy loss is a
        multiple of the advantage, so such a gradient is exactly zero unless a KL term (beta > 0), an
        entropy bonus or a router load-balancing loss adds one. DeepSpeed counts the backward passes
        of an accumulation itself, so it runs them all; a mixture-of-experts model's backward pass
        gives the experts its tokens reach a (zero) gradient that the optimizer would act on, so it
        runs them all too; under FSDP a backward pass gathers the shards, so a micro-batch is
        skipped only where it is zero on every process."""
        from accelerate.utils import DistributedType

        config = self.config
        if (not config.skip_zero_advantage_backward or config.beta != 0.0 or entropy_coef != 0.0 or aux_weight != 0.0
                or self.accelerator.distributed_type == DistributedType.DEEPSPEED or self._routes_to_experts):
            return None
        zero_K = torch.stack([~advantages.advantages_B[index_B].any() for index_B in micro_batches])
        if dist.sharding(self.accelerator) == "fsdp":
            zero_K = dist.gather(self.accelerator, zero_K.to(self.accelerator.device)).view(-1, len(micro_batches)).all(0)
        return zero_K.tolist()

    def router_aux_loss_weight(self) -> float:
        """The weight of the policy's load-balancing loss now (``models.router_aux_loss_weight``)."""
        return router_aux_loss_weight(self.unwrapped_model, self.config.router_aux_loss_coef)

    def _whole_model_here(self) -> bool:
        """One process holding the whole model, so that a backward pass moves no gradient elsewhere."""
        return self.accelerator.num_processes == 1 and dist.sharding(self.accelerator) != "fsdp"

    def _complete_gradients(self, *, none_ran: bool, not_finite: bool) -> None:
        """Record which parameters a backward pass reaches (once). When no micro-batch of the step ran
        one, give those parameters the zero gradient it would have given, so that the optimizer step
        (momentum, weight decay) is the one it would have been; when a skipped micro-batch's loss or
        ratios were not finite, make the gradient not finite, as its backward pass would have, so
        that ``update`` skips the step."""
        if none_ran:
            for name, parameter in self.unwrapped_model.named_parameters():
                if name in self.trained_parameter_names and parameter.requires_grad and parameter.grad is None:
                    parameter.grad = torch.zeros_like(parameter)
        elif self.trained_parameter_names is None:  # the unwrapped model's names: a checkpoint keeps them for any launch
            self.trained_parameter_names = {name for name, p in self.unwrapped_model.named_parameters() if p.grad is not None}
        if not_finite:
            next(p for p in self.model.parameters() if p.grad is not None).grad.fill_(float("nan"))

    def _off_policy_mask(self, rollout: Rollout, index_B, advantages: Advantages, logprobs_BT, mask_BT):
        """(B, 1) off-policy sequence mask (``off_policy_mask_threshold``) against the sampling policy:
        vLLM's log-probs, else the old policy's; None when off or when the batch is on-policy."""
        threshold = self.config.off_policy_mask_threshold
        sampling_BT = rollout.sampling_logprobs_BT if rollout.sampling_logprobs_BT is not None else rollout.old_logprobs_BT
        if threshold is None or sampling_BT is None:
            return None
        return ops.off_policy_mask(
            advantages.advantages_B[index_B].to(logprobs_BT.device), logprobs_BT,
            sampling_BT[index_B].to(logprobs_BT.device).float(), mask_BT, threshold=threshold,
        )

    def _loss_result(self, advantages, step_index, parts, total_loss) -> LossResult:
        config = self.config
        epsilon_high = config.epsilon_high if config.epsilon_high is not None else config.epsilon
        cat = lambda i: torch.cat([p[i] for p in parts])  # noqa: E731
        logprobs_BT, entropies_BT, mask_BT = cat(1), cat(2), cat(4)
        ratio_BT = torch.cat([p[3].ratio_BT.detach().expand_as(p[1]) for p in parts])
        kl_BT = torch.cat([p[3].kl_BT.detach() for p in parts]) if config.beta > 0 else None
        clip = ops.clip_diagnostics(
            ratio_BT, advantages.advantages_B[step_index].to(ratio_BT.device), mask_BT,
            epsilon_low=config.epsilon, epsilon_high=epsilon_high, loss_type=config.loss_type,
        )
        metrics = loss_metrics(self.accelerator, clip, entropies_BT, kl_BT, mask_BT, total_loss)
        return LossResult(
            advantages=advantages, loss=metrics["loss"], sample_index_B=step_index, logprobs_BT=logprobs_BT,
            entropies_BT=entropies_BT, ratio_BT=ratio_BT, clipped_BT=clip.is_region_clipped_BT, metrics=metrics,
        )

    def update(self) -> dict[str, float]:
        """Clip gradients, take the optimizer and scheduler step; skip it if the gradient is not finite.
        The new weights reach the generation backend with :meth:`publish_weights`."""
        config = self.config
        learning_rate = self.optimizer.param_groups[0]["lr"]
        parameters = [p for p in self.model.parameters() if p.requires_grad]
        max_norm = config.max_grad_norm if config.max_grad_norm > 0 else float("inf")
        grad_norm = float(self.accelerator.clip_grad_norm_(parameters, max_norm))
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        if config.use_adaptive_entropy and self._pending_step_entropy is not None:
            self.entropy_coef = ops.adapt_entropy_coef(
                self.entropy_coef, self._pending_step_entropy, target=config.entropy_target,
                delta=config.entropy_coef_delta, coef_min=config.entropy_coef_min, coef_max=config.entropy_coef_max,
            )
            self.last_step_entropy, self._pending_step_entropy = self._pending_step_entropy, None
        if config.sync_ref_model and self.ref_model is not None and self.global_step % config.ref_model_sync_steps == 0:
            self._mix_reference()
        return {"grad_norm": grad_norm, "learning_rate": learning_rate, "update_skipped": float(skipped)}

    def publish_weights(self) -> None:
        """Hand the policy after the latest update to the generation backend (vLLM; nothing to do for
        transformers). Called after each update and, where that hand-over failed (a server that did
        not answer), again before the next generation, which would otherwise sample a stale policy."""
        self.rollout_backend.sync_weights(self.unwrapped_model, self.global_step)
        self.published_version = self.global_step

    def evaluate(self, dataset=None) -> dict[str, float]:
        """Sample ``num_generations_eval`` completions per prompt of ``dataset`` (default: eval_dataset)
        and report reward metrics, prefixed ``eval_`` as TRL does. The training random state is kept."""
        dataset = self.eval_dataset if dataset is None else dataset
        check_dataset(dataset, "eval_dataset")
        if self.published_version != self.global_step:
            self.publish_weights()
        config = self.config
        repeats = config.num_generations_eval or config.num_generations
        local = dist.local_slice(self.accelerator, len(dataset) - len(dataset) % self.accelerator.num_processes)
        if self.custom_rollout is None:  # else once its extra keys are known
            check_reward_signatures(self.reward_funcs, self.reward_names, [c for c in dataset.column_names if c != "prompt"])
        rows = dataset.with_format(None)[local.start:local.stop]
        prompts = [p for p in rows.pop("prompt") for _ in range(repeats)]
        columns = {k: [v for v in values for _ in range(repeats)] for k, values in rows.items()}
        size = config.per_device_eval_batch_size * repeats
        rewards, lengths, tool_counts = [], [], {}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed + self.accelerator.process_index)
            for start in range(0, len(prompts), size):
                chunk = prompts[start:start + size]
                chunk_columns = {k: v[start:start + size] for k, v in columns.items()}
                batch, env_mask_BT, extra, completions = self._generate_batch(chunk, list(chunk_columns))
                chunk_columns.update(extra)
                if "tool_calls" in extra:
                    tool_counts.setdefault("tool_calls", []).extend(extra["tool_calls"])
                    tool_counts.setdefault("tool_failures", []).extend(extra.get("tool_failures", [0] * len(extra["tool_calls"])))
                if self.custom_rollout is not None:
                    check_reward_signatures(self.reward_funcs, self.reward_names, list(chunk_columns))
                decoded = self.tokenizer.batch_decode(batch.completion_ids_BT, skip_special_tokens=True)
                ids = [i[m.bool()].tolist() for i, m in zip(batch.completion_ids_BT, batch.completion_mask_BT)]
                rewards_BF, _ = score_completions(
                    self.reward_funcs, self.reward_processing_classes, self.reward_names, prompts=chunk,
                    completions=wrap_completions(chunk, decoded) if completions is None else completions,
                    completion_ids=ids, columns=chunk_columns,
                    trainer_state=self.trainer_state(), reward_timeout=self.config.reward_timeout,
                )
                rewards.append(rewards_BF)
                lengths.append(generated_mask(batch.completion_mask_BT, env_mask_BT).sum(1).float())
        rewards_BF = dist.gather(self.accelerator, torch.cat(rewards).to(self.accelerator.device)).cpu()
        lengths_B = dist.gather(self.accelerator, torch.cat(lengths).to(self.accelerator.device)).cpu()
        weights = torch.tensor(config.reward_weights) if config.reward_weights else torch.ones(rewards_BF.shape[1])
        metrics = {"eval_reward": float(torch.nansum(rewards_BF * weights, dim=1).mean())}
        for i, name in enumerate(self.reward_names):
            metrics[f"eval_rewards/{name}/mean"] = float(torch.nanmean(rewards_BF[:, i]))
        metrics["eval_completions/mean_length"] = float(lengths_B.mean())
        if tool_counts.get("tool_calls"):
            metrics.update({f"eval_{k}": v for k, v in tool_metrics(self.accelerator, tool_counts).items()})
        return metrics

    @torch.no_grad()
    def _mix_reference(self) -> None:
        """TR-DPO: ref <- alpha * policy + (1 - alpha) * ref (arXiv:2404.09656)."""
        alpha = self.config.ref_model_mixup_alpha
        for ref, policy in zip(self.ref_model.parameters(), self.unwrapped_model.parameters(), strict=True):
            ref.mul_(1 - alpha).add_(policy.detach(), alpha=alpha)  # FSDP: each process mixes its shards
