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
import math
import warnings
from typing import NamedTuple

import torch
from transformers import TrainerState, get_scheduler, set_seed

from grpo_lab import dist, ops
from grpo_lab import engine_build as build
from grpo_lab.accel import SpeedPaths, release_freed_memory
from grpo_lab.config import GRPOConfig
from grpo_lab.engine_build import check_dataset
from grpo_lab.models import router_aux_loss_weight, routes_to_experts
from grpo_lab.metrics import generation_metrics, loss_metrics, sampling_metrics, tool_metrics
from grpo_lab.policy_forward import TokenScores, note_compact_unsupported, score_tokens
from grpo_lab.rewards import check_reward_signatures, score_completions
from grpo_lab.rewards.runner import CALL_KEYWORDS
from grpo_lab.rollout.batch import eos_token_ids, padded_to_multiple
from grpo_lab.rollout.custom import CustomBatch, call_rollout_func
from grpo_lab.rollout.prompts import check_prompt_room, prompt_token_counts, render_prompts, wrap_completions
from grpo_lab.types import Advantages, LossResult, Rollout, Scores, generated_mask


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


class Engine:
    """Model, optimizer, data and reward functions, with one method per GRPO stage."""

    def __init__(self, model, reward_funcs, args: GRPOConfig | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, reward_processing_classes=None, peft_config=None, optimizers=(None, None),
                 rollout_func=None, tools=None):
        self.config = config = build.checked_config(args, train_dataset, eval_dataset, reward_funcs)
        self.accelerator = build.start_accelerator(config)
        self.speed_paths = SpeedPaths(quiet=not self.accelerator.is_main_process)
        self.batching = config.resolve(self.accelerator.num_processes)
        # Prompt order is shared by all processes (the sampler's own generator); sampling differs.
        set_seed(config.seed + self.accelerator.process_index)
        self.tokenizer, name = build.tokenizer_for(model, processing_class, config)
        policy = build.load_policy(model, config, self.tokenizer)
        self._context, self._prompt_tokens, self._prompt_tokens_source = build.check_prompts(
            policy, self.tokenizer, config, train_dataset, eval_dataset,
            custom_rollout=rollout_func is not None or tools is not None,
        )
        build.check_policy(policy, config)
        self.model_reference = build.model_reference(model, name)
        vllm_model, self._remove_model_copy = build.vllm_model_source(self, model, policy, self.tokenizer, config)
        policy, self.is_peft = build.adapt_policy(policy, config, peft_config, self.accelerator)
        self.ref_model = build.reference_copy(policy, config, self.is_peft, self.accelerator.device)
        optimizer, scheduler = optimizers
        self.owns_optimizer, self.owns_scheduler = optimizer is None, scheduler is None
        self.model, self.optimizer = self.accelerator.prepare(policy, build.adamw(policy, config) if optimizer is None
                                                              else optimizer)
        self.unwrapped_model = self.accelerator.unwrap_model(self.model)  # once: each unwrap costs about 0.1 ms
        if self.ref_model is not None:  # FSDP: sharded like the policy, not a whole copy on every process
            self.ref_model = dist.shard_frozen_copy(self.accelerator, self.ref_model)
        self.train_dataset, self.eval_dataset, self.rollout_func = train_dataset, eval_dataset, rollout_func
        self.tools, self.custom_rollout = build.custom_rollout(
            rollout_func, tools, self.tokenizer, self.unwrapped_model, train_dataset, config
        )
        self.rollout_owner = None
        self._in_rollout = False  # while the rollout function runs: generate() from inside it would recurse
        self._rows_source = self._rows_view = None  # a format-free view of train_dataset, see _train_rows
        self.sampler = build.prompt_sampler(config, self.batching, len(train_dataset))
        spg, ga = self.batching.steps_per_generation, config.gradient_accumulation_steps
        self.steps_per_batch = config.num_iterations * spg // ga
        self.scheduler = self._new_scheduler() if scheduler is None else scheduler
        self.reward_funcs, self.reward_processing_classes, self.reward_names = build.reward_functions(
            reward_funcs, reward_processing_classes, config, self.reward_columns(), self.accelerator.device
        )
        self.global_step = 0
        self.num_input_tokens_seen = 0
        self.trained_parameter_names: set[str] | None = None  # parameters a backward pass reaches (_complete_gradients)
        self._routes_to_experts = routes_to_experts(self.unwrapped_model)
        # The entropy bonus's weight, and the last optimizer step's mean token entropy, which the
        # adaptive weight (use_adaptive_entropy) follows; both are checkpointed.
        self.entropy_coef = config.entropy_coef
        self.last_step_entropy: float | None = None
        self._pending_step_entropy: float | None = None
        self.rollout_backend = build.rollout_backend(
            config, model_fn=lambda: self.unwrapped_model, tokenizer=self.tokenizer, accelerator=self.accelerator,
            vllm_model=vllm_model, lora_rank=build.lora_rank(peft_config, self.is_peft, self.unwrapped_model),
            speed_paths=self.speed_paths, remove_model_copy=self._remove_model_copy,
        )
        self.published_version = 0  # a backend starts from the policy it is built with
        note_compact_unsupported(self.unwrapped_model, self.speed_paths, compact_forward=config.compact_forward,
                                 main_process=self.accelerator.is_main_process)

    def close(self) -> None:
        """Release the generation backend (a vLLM engine holds memory until then), and return the
        free memory that ``keep_freed_cpu_memory`` kept to the kernel."""
        self.rollout_backend.close()
        self._remove_model_copy()
        release_freed_memory()

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
        scores = self.logprobs_and_aux_loss(model, rollout, index_B, with_entropy=with_entropy, entropy_grad=entropy_grad)
        return scores[:2]

    def logprobs_and_aux_loss(self, model, rollout: Rollout, index_B: torch.Tensor, *, with_entropy: bool,
                              entropy_grad: bool = False, router_aux_loss: bool = False) -> TokenScores:
        """Per-token log-probs (and entropies, and a mixture-of-experts model's load-balancing loss)
        of the completions ``index_B`` under ``model``: ``(logprobs_BT, entropies_BT or None,
        aux_loss or None)``, from ``policy_forward.score_tokens``, which picks the forward pass.

        While the load-balancing loss is weighted, every pass of the policy runs whole sequences, as
        that loss is over them (and the old policy's log-probs then come from the same path as the
        training pass's).
        """
        config = self.config
        scores = score_tokens(
            model, rollout.prompt_ids_BP[index_B], rollout.prompt_mask_BP[index_B], rollout.completion_ids_BT[index_B],
            rollout.completion_mask_BT[index_B], speed_paths=self.speed_paths, compact_forward=config.compact_forward,
            share_prompt_prefix=not router_aux_loss and config.share_prompt_prefix and (
                model is not self.model or self.router_aux_loss_weight() == 0.0
            ),
            temperature=config.temperature, with_entropy=with_entropy, entropy_grad=entropy_grad,
            router_aux_loss=router_aux_loss,
        )
        if router_aux_loss and not isinstance(scores.aux_loss, torch.Tensor):
            raise ValueError(
                f"router_aux_loss_coef weights a load-balancing loss ({self.router_aux_loss_weight():g}, "
                f"{'the model config' if config.router_aux_loss_coef is None else 'set'}), but "
                f"{type(self.unwrapped_model).__name__} returns none with output_router_logits=True. "
                "Set router_aux_loss_coef=0."
            )
        return scores

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
        loss_mask_BT, normalizer = self._loss_mask_and_normalizer(rollout, step_index)
        settings = ops.LossSettings.from_config(config)
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
            skip = self._skips_backward(zero_K, k, sync, skipped)
            args = (rollout, advantages, index_B, loss_mask_BT, normalizer, settings, entropy_coef, aux_weight,
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
            self._hold_step_entropy(entropy_stats)
        result = self._loss_result(advantages, step_index, parts, total_loss, settings)
        result.micro_batches, result.backward_skipped = len(micro_batches), skipped
        if config.entropy_coef != 0.0 or config.use_adaptive_entropy:
            result.metrics["entropy_coef"] = entropy_coef
        if zero_K is not None:
            result.metrics["backward_skipped_fraction"] = skipped_all / micro_batches_all
        self._add_step_metrics(result.metrics, aux_losses, masked_sequences, len(step_index))
        return result

    def _skips_backward(self, zero_K: list[bool] | None, k: int, last: bool, skipped: int) -> bool:
        """Whether micro-batch ``k`` runs its forward pass without a backward. A micro-batch whose
        advantages are all zero adds exactly nothing to the gradient: its forward pass runs (for the
        metrics) without a backward. The ``last`` micro-batch of a step always runs one where gradients
        are averaged or gathered in it (several processes, FSDP), and where no backward pass has run
        yet that says which parameters it reaches (``skipped`` of the ``k`` before it were skipped)."""
        return zero_K is not None and zero_K[k] and (
            not last or (self._whole_model_here() and (skipped < k or self.trained_parameter_names is not None))
        )

    def _hold_step_entropy(self, entropy_stats: list[torch.Tensor]) -> None:
        """Keep the step's mean token entropy, over processes, for the adaptive entropy weight that
        ``update`` adapts; ``entropy_stats`` holds each micro-batch's kept-token entropy sum and count."""
        entropy_sum, tokens = (dist.total(self.accelerator, value) for value in torch.stack(entropy_stats).sum(0))
        self._pending_step_entropy = float(entropy_sum / tokens.clamp(min=1.0))

    def _loss_mask_and_normalizer(self, rollout: Rollout, step_index: torch.Tensor):
        """The (B, T) mask of the tokens the loss counts, and the step-token normalizer: losses that
        normalize globally (dapo's) divide by the tokens of the whole optimizer step, counted over all
        processes; DDP averages gradients over processes, hence the division by their number."""
        loss_mask_BT = rollout.generated_mask_BT.float()
        if self.config.mask_truncated_completions:
            loss_mask_BT = ops.truncation_mask(loss_mask_BT, rollout.is_truncated_B)
        global_tokens = dist.total(self.accelerator, loss_mask_BT[step_index].sum())
        return loss_mask_BT, (global_tokens / self.accelerator.num_processes).clamp(min=1.0)

    def _add_step_metrics(self, metrics: dict, aux_losses: list, masked_sequences: torch.Tensor,
                          sequences: int) -> None:
        """The load-balancing loss (where one was weighted) and the share of sequences the off-policy
        mask dropped (where it is on), over processes."""
        if aux_losses:
            metrics["aux_loss"] = float(dist.mean(self.accelerator, torch.stack(aux_losses).mean()))
        if self.config.off_policy_mask_threshold is not None:
            total = dist.total(self.accelerator, torch.tensor(float(sequences), device=masked_sequences.device))
            metrics["off_policy_mask/masked_fraction"] = float(dist.total(self.accelerator, masked_sequences) / total)

    def _micro_batch_loss(self, rollout: Rollout, advantages: Advantages, index_B, loss_mask_BT, normalizer,
                          settings: ops.LossSettings, entropy_coef: float, aux_weight: float,
                          micro_batches: int) -> _MicroBatch:
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
            settings=settings,
            ref_logprobs_BT=on_device(rollout.ref_logprobs_BT),
            entropy_mask_BT=entropy_mask_BT,
            importance_sampling_ratio_BT=on_device(rollout.importance_weights_BT),
            num_items_in_batch=normalizer,
            off_policy_mask_B1=off_policy_B1,
            entropies_BT=entropies_BT,
            entropy_coef=entropy_coef,
        )
        loss = out.loss if settings.spec.normalizes_globally else out.loss / micro_batches
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

    def _loss_result(self, advantages, step_index, parts, total_loss, settings: ops.LossSettings) -> LossResult:
        cat = lambda i: torch.cat([p[i] for p in parts])  # noqa: E731
        logprobs_BT, entropies_BT, mask_BT = cat(1), cat(2), cat(4)
        ratio_BT = torch.cat([p[3].ratio_BT.detach().expand_as(p[1]) for p in parts])
        kl_BT = torch.cat([p[3].kl_BT.detach() for p in parts]) if settings.beta > 0 else None
        clip = ops.clip_diagnostics(
            ratio_BT, advantages.advantages_B[step_index].to(ratio_BT.device), mask_BT,
            epsilon_low=settings.epsilon_low, epsilon_high=settings.epsilon_high, loss_type=settings.loss_type,
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
