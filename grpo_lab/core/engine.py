"""THE trainer core: one method per GRPO stage over an ``accelerate.Accelerator``.

``GRPOSession`` (stepping in a notebook) and ``GRPOTrainer`` (a script under ``accelerate launch``)
both drive this class, stage by stage, in the same order: ``generate`` -> ``score`` ->
``advantages`` -> ``loss`` -> ``update``. The math lives in :mod:`grpo_lab.ops`; the engine wires it
to models, data, reward functions and processes. Its parts are built by :mod:`grpo_lab.core.build`;
the longer stages live beside it (:mod:`grpo_lab.core.generation`, :mod:`grpo_lab.core.loss`,
:mod:`grpo_lab.core.evaluation`). The optimizer, its schedule and the entropy weight are its
``optimization`` part (:mod:`grpo_lab.core.optimization`), which the live config edits change.

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
import uuid
from collections.abc import Callable

import torch

from grpo_lab import ops
from grpo_lab.parallel import dist, zero
from grpo_lab.core import build
from grpo_lab.accel import SpeedPaths, release_freed_memory
from grpo_lab.config.grpo_config import GRPOConfig
from grpo_lab.core.dynamic_sampling import reused_scores
from grpo_lab.core.evaluation import EvaluationStage
from grpo_lab.core.generation import GenerationStage
from grpo_lab.core.hf_trainer_types import TrainerState, set_seed
from grpo_lab.core.loss import LossStage
from grpo_lab.parallel.layout import layout_for
from grpo_lab.core.metrics import async_generation_metrics, generation_metrics, sampling_metrics, tool_metrics
from grpo_lab.core.models import router_aux_loss_weight, routes_to_experts
from grpo_lab.core.optimization import Optimization, optimizer_for
from grpo_lab.core.policy_forward import TokenScores, note_speed_paths, score_tokens
from grpo_lab.rewards import check_reward_signatures, score_completions
from grpo_lab.rewards.preparation import weights_tensor
from grpo_lab.rollout import vision
from grpo_lab.rollout.hf import floating_dtype
from grpo_lab.state.run_state import engine_counters, load_engine_counters, rng_state, set_rng_state
from grpo_lab.types import Advantages, LossResult, Rollout, Scores
from grpo_lab.core.stream_sampler import first_row
from grpo_lab.interrupts import deferred_interrupts


class Engine:
    """Model, optimizer, data and reward functions, with one method per GRPO stage; the longer stages
    are its parts ``generation_stage``, ``loss_stage`` and ``evaluation_stage``, which its stage
    methods call."""

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, reward_processing_classes=None, optimizers=(None, None),
                 quantization_config=None, peft_config=None, tools=None, rollout_func=None, environment_factory=None):
        self.config = config = build.checked_config(model, args, train_dataset, eval_dataset, reward_funcs,
                                                    rollout_func, environment_factory)
        self.accelerator = build.start_accelerator(config)
        self.layout = layout_for(self.accelerator)  # how the model's state lies over the processes
        self.speed_paths = SpeedPaths(quiet=not self.accelerator.is_main_process)
        self.batching = config.resolve(self.accelerator.num_processes)
        # Prompt order is shared by all processes (the sampler's own generator); sampling differs.
        set_seed(config.seed + self.accelerator.process_index)
        self.tokenizer, self.processor, name = build.tokenizer_for(model, processing_class, config)
        policy = build.load_policy(model, config, self.accelerator.device, quantization_config)
        build.check_policy(policy, config, self.processing_class, (train_dataset, eval_dataset),
                           dict(rollout_func=rollout_func, tools=tools, environment_factory=environment_factory))
        plain = environment_factory is None  # else the prompts are complete only after reset(): checked then
        context, prompt_tokens, counted_dataset = build.check_prompts(
            policy, self.tokenizer, config, train_dataset if plain else None, eval_dataset if plain else None,
            custom_rollout=rollout_func is not None or tools is not None, processor=self.processor)
        self.generation_stage = GenerationStage(self, context=context, prompt_tokens=prompt_tokens,
                                                counted_dataset=counted_dataset)
        self.loss_stage, self.evaluation_stage = LossStage(self), EvaluationStage(self)
        self.model_reference = build.model_reference(model, name)
        vllm_model, self._remove_model_copy = build.vllm_model_source(self, model, policy, config)
        policy, self.is_peft = build.adapt_policy(policy, config, peft_config, self.accelerator)
        self.ref_model = build.reference_copy(policy, config, self.is_peft, self.accelerator.device)
        given_optimizer, scheduler = optimizers
        self.model, optimizer = self.accelerator.prepare(
            policy, optimizer_for(policy, config) if given_optimizer is None else given_optimizer)
        self.unwrapped_model = self.layout.unwrap(self.model)  # once, not at every use
        if self.ref_model is not None:  # FSDP: sharded like the policy, not a whole copy on every process
            self.ref_model = self.layout.shard_frozen_copy(self.ref_model)
        self.given_eval_dataset, self.eval_dataset = eval_dataset, build.named_eval_dataset(eval_dataset)  # given; read
        self.tools, self.custom_rollout, self.environments, train_dataset = build.custom_rollout(
            rollout_func, tools, environment_factory, self.tokenizer, self.unwrapped_model, train_dataset, config,
            self.batching)
        self.train_dataset, self.rollout_func = train_dataset, rollout_func
        self.rollout_owner = None
        self.sampler = build.prompt_sampler(config, self.batching, train_dataset)
        spg, ga = self.batching.steps_per_generation, config.gradient_accumulation_steps
        self.steps_per_batch = config.num_iterations * spg // ga
        self.optimization = Optimization(optimizer, scheduler, config, self.total_steps(),
                                         owns_optimizer=given_optimizer is None)
        self.set_reward_functions(*build.reward_functions(
            reward_funcs, reward_processing_classes, config, self.reward_columns(), self.accelerator.device,
            self.environments))
        self.generation_stage.check_modes()  # dynamic sampling and generation ahead, now that the parts are built
        self.global_step = self.num_input_tokens_seen = 0
        self.trained_parameter_names: set[str] | None = None  # parameters a backward pass reaches (LossStage.loss)
        self.routes_to_experts = routes_to_experts(self.unwrapped_model)
        self.rollout_backend = build.rollout_backend(
            config, model_fn=lambda: self.unwrapped_model, tokenizer=self.tokenizer, accelerator=self.accelerator,
            vllm_model=vllm_model, lora_rank=build.lora_rank(peft_config, self.is_peft, self.unwrapped_model),
            speed_paths=self.speed_paths, remove_model_copy=self._remove_model_copy,
        )
        self.published_version = 0  # a backend starts from the policy it is built with
        self.step_events: Callable[[str], None] | None = None  # see step_event
        self.torn: str | None = None  # what a second Ctrl-C stopped midway, or None: see mark_torn
        note_speed_paths(self.unwrapped_model, self.speed_paths, config, images=self.processor is not None,
                         main_process=self.accelerator.is_main_process)

    def set_reward_functions(self, funcs: list, processing_classes: list, names: list[str]) -> None:
        """Score with ``funcs`` (prepared, with their processing classes and names) from the next
        ``score()``; ``reward_funcs_token`` changes with them, so that a batch dynamic sampling scored
        with the ones before is scored again."""
        self.reward_funcs, self.reward_processing_classes, self.reward_names = funcs, processing_classes, names
        self.reward_funcs_token = uuid.uuid4().hex

    @property
    def processing_class(self):
        """What the run renders prompts with, and what a checkpoint saves beside the model: a
        vision-language model's processor, else the tokenizer."""
        return self.tokenizer if self.processor is None else self.processor

    @property
    def optimizer(self):
        """The optimizer (``optimization.optimizer``)."""
        return self.optimization.optimizer

    @property
    def scheduler(self):
        """The learning-rate schedule (``optimization.scheduler``)."""
        return self.optimization.scheduler

    def close(self) -> None:
        """Release the generation backend (a vLLM engine holds memory until then), and return the
        free memory that ``keep_freed_cpu_memory`` kept to the kernel."""
        self.generation_stage.ahead.close()
        self.rollout_backend.close()
        self._remove_model_copy()
        release_freed_memory()

    @contextlib.contextmanager
    def scratch(self, config: GRPOConfig | None = None):
        """Run a block of stages short of ``update()`` (a what-if, the doctor's probe) with ``config``
        as the engine's (None: its own), then put back everything the stages change: the random
        states, the schedule, sampler position and counters (:func:`grpo_lab.state.run_state.engine_counters`),
        every parameter's gradient (the very tensors: a pending ``loss()`` keeps its gradients), which
        parameters a backward reaches, the entropy the adaptive weight holds, the published weight
        version and the training callbacks' hook (off inside, so that callbacks see no scratch
        micro-batch). Environments drawn inside are fresh instances; the run's pool and its batch's
        instances come back after. The weights and the optimizer are not copied: nothing short of
        ``update()`` steps them, and a block that steps them puts them back itself."""
        parameters = list(self.model.parameters())
        saved_config, counters, entropy = self.config, copy.deepcopy(engine_counters(self)), self.optimization.entropy
        saved = (rng_state(), [p.grad for p in parameters], self.step_events, self.trained_parameter_names,
                 entropy.pending_step_entropy, self.published_version)
        self.step_events, ahead_paused = None, self.generation_stage.ahead.paused
        self.generation_stage.ahead.paused = True  # the blocks generate their own batches
        if config is not None:
            self.config = config
            if config.entropy_coef != saved_config.entropy_coef:  # an adaptive weight keeps its own otherwise
                entropy.coef = config.entropy_coef
        environments = self.environments
        pool = None if environments is None else (environments.pool, environments.batch)
        if environments is not None:
            environments.pool = {name: [] for name in pool[0]}  # every instance drawn inside is built new
        try:
            yield
        finally:
            with deferred_interrupts(torn=lambda: self.mark_torn("putting the run back after a what-if or probe")):
                random, grads, self.step_events, trained, entropy.pending_step_entropy, self.published_version = saved
                self.config, self.generation_stage.ahead.paused = saved_config, ahead_paused
                if environments is not None:
                    environments.pool, environments.batch = pool
                load_engine_counters(self, counters)
                self.trained_parameter_names = trained
                for parameter, grad in zip(parameters, grads):
                    parameter.grad = grad
                set_rng_state(random)

    def mark_torn(self, what: str) -> None:
        """Note that a second Ctrl-C stopped ``what`` (an optimizer step, a state being put back) midway,
        leaving weights, optimizer, schedule and counters that may disagree. A session refuses to run a
        stage while ``torn`` is set; loading a whole state (undo, load_state_dict) clears it."""
        self.torn = f"{what} (the step counter at {self.global_step})"

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

    def sequence_logprobs(self, model, rollout: Rollout, index_B: torch.Tensor, *, with_entropy: bool,
                          entropy_grad: bool = False):
        """Per-token log-probs (and entropies) of the completions ``index_B`` under ``model``:
        ``(logprobs_BT, entropies_BT or None)``; see ``logprobs_and_aux_loss``."""
        scores = self.logprobs_and_aux_loss(
            model, rollout, index_B, with_entropy=with_entropy, entropy_grad=entropy_grad
        )
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
        prompt_mask_BP = rollout.prompt_mask_BP[index_B]
        model_inputs = None
        if rollout.image_inputs_B is not None:
            model_inputs = vision.model_inputs(
                [rollout.image_inputs_B[i] for i in index_B.tolist()], prompt_mask_BP.to(self.accelerator.device),
                rollout.completion_ids_BT.shape[1], dtype=floating_dtype(self.unwrapped_model),
            )
        scores = score_tokens(
            model, rollout.prompt_ids_BP[index_B], prompt_mask_BP, rollout.completion_ids_BT[index_B],
            rollout.completion_mask_BT[index_B], speed_paths=self.speed_paths, compact_forward=config.compact_forward,
            share_prompt_prefix=not router_aux_loss and config.share_prompt_prefix and (
                model is not self.model or self.router_aux_loss_weight() == 0.0
            ),
            temperature=config.temperature, with_entropy=with_entropy, entropy_grad=entropy_grad,
            router_aux_loss=router_aux_loss, model_inputs=model_inputs,
        )
        if router_aux_loss and not isinstance(scores.aux_loss, torch.Tensor):
            raise ValueError(
                f"router_aux_loss_coef weights a load-balancing loss ({self.router_aux_loss_weight():g}, "
                f"{'the model config' if config.router_aux_loss_coef is None else 'set'}), but "
                f"{type(self.unwrapped_model).__name__} returns none with output_router_logits=True. "
                "Set router_aux_loss_coef=0."
            )
        return scores

    def router_aux_loss_weight(self) -> float:
        """The weight of the policy's load-balancing loss now (``models.router_aux_loss_weight``)."""
        return router_aux_loss_weight(self.unwrapped_model, self.config.router_aux_loss_coef)

    @torch.no_grad()
    def batch_logprobs(self, model, rollout: Rollout) -> torch.Tensor:
        """Per-token log-probs ``(B, T)`` of every completion of ``rollout`` under ``model``, without
        gradients, in micro-batches of ``per_device_train_batch_size``."""
        size = self.config.per_device_train_batch_size
        parts = []
        for start in range(0, len(rollout), size):
            index_B = torch.arange(start, min(start + size, len(rollout)))
            parts.append(self.sequence_logprobs(model, rollout, index_B, with_entropy=False)[0])
        return torch.cat(parts)

    # ------------------------------------------------------------------ stages
    def vocab_size(self) -> int:
        """Token ids the policy has embeddings for."""
        return self.unwrapped_model.get_input_embeddings().num_embeddings

    def reward_columns(self) -> list[str] | None:
        """The training dataset's columns that reward functions receive as keyword arguments (and
        ``environments`` with environment_factory); None with a rollout function (or tools), whose
        extra keys are known only once it has run (score() checks then)."""
        if self.custom_rollout is not None:
            return None
        names = self.train_dataset.column_names
        if names is None:  # a stream without declared features: its first row's keys
            names = list(first_row(self.train_dataset))
        return [name for name in names if name != "prompt"] + ["environments"] * (self.environments is not None)

    def counted_prompt_tokens(self) -> list[int] | None:
        """The token count of every training prompt, as counted when the engine was built (None where
        the dataset was too large to count then, or has been swapped since)."""
        return self.generation_stage.counted_prompt_tokens()

    def reference_logprobs(self, rollout: Rollout) -> torch.Tensor:
        """Per-token log-probs ``(B, T)`` of ``rollout``'s completions under the reference policy: the
        reference copy, or, for a PEFT policy without one, the base model with the adapter off."""
        if self.ref_model is not None:
            logprobs = self.batch_logprobs(self.ref_model, rollout)
            self.layout.reshard(self.ref_model)  # FSDP: back to its shards, as TR-DPO mixing and memory want
            return logprobs
        with self.unwrapped_model.disable_adapter():  # PEFT: the base model is the reference
            return self.batch_logprobs(self.model, rollout)

    def generate(self) -> Rollout:
        """Draw the next generation batch of prompts and sample ``num_generations`` completions each
        (:meth:`GenerationStage.generate`)."""
        return self.generation_stage.generate()

    def score(self, rollout: Rollout) -> Scores:
        """Call every reward function on the completions (TRL's keyword-argument convention); a batch
        that dynamic sampling filled was scored by ``generate()``, whose rewards are returned while the
        reward functions are the same objects."""
        reused = reused_scores(self, rollout)
        if reused is not None:
            return reused
        completion_ids = [  # as Python lists: one indexing call per row would take longer than the rewards
            [token for token, kept in zip(ids, mask) if kept]
            for ids, mask in zip(rollout.completion_ids_BT.tolist(), rollout.completion_mask_BT.tolist())
        ]
        columns = rollout.columns if self.environments is None else self.environments.scoring_columns(rollout)
        if self.custom_rollout is not None:
            check_reward_signatures(self.reward_funcs, self.reward_names, list(columns))
        rewards_BF, logs = score_completions(
            self.reward_funcs, self.reward_processing_classes, self.reward_names,
            prompts=rollout.prompts, completions=rollout.completions, completion_ids=completion_ids,
            columns=columns, trainer_state=self.trainer_state(), reward_timeout=self.config.reward_timeout,
            timeout_sync=self.config.reward_timeout_sync,
        )
        return Scores(rollout, rewards_BF, list(self.reward_names), logs.extras, logs.metrics)

    def advantages(self, scores: Scores) -> Advantages:
        """Group-relative advantages from rewards gathered over every process."""
        config = self.config
        rewards_BF = dist.gather(self.accelerator, scores.rewards_BF.to(self.accelerator.device)).cpu()
        own = 0 if self.environments is None else len(self.environments.reward_funcs)
        weights = weights_tensor(config.reward_weights, scores.reward_names, own)
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
            )
            | sampling_metrics(self.accelerator, scores.rollout.sampling_stats)
            | tool_metrics(self.accelerator, scores.rollout.columns)
            | ({} if scores.rollout.dynamic_sampling is None else scores.rollout.dynamic_sampling.metrics)
            | async_generation_metrics(self.accelerator, scores.rollout, self.global_step),
        )

    def loss(self, advantages: Advantages, batch_step: int = 0) -> LossResult:
        """Forward and backward passes for optimizer step ``batch_step`` of the current batch
        (:meth:`LossStage.loss`); gradients are zeroed first, so calling it again recomputes them."""
        return self.loss_stage.loss(advantages, batch_step)

    def update(self) -> dict[str, float]:
        """Clip gradients, take the optimizer and scheduler step; skip it if the gradient is not finite.
        The new weights reach the generation backend with :meth:`publish_weights`."""
        config = self.config
        learning_rate = self.optimizer.param_groups[0]["lr"]
        parameters = [p for p in self.model.parameters() if p.requires_grad]
        max_norm = config.max_grad_norm if config.max_grad_norm > 0 else float("inf")
        grad_norm, skipped = self.layout.clip_gradients(
            self.model, parameters, max_norm, clipped=lambda: self.step_event("on_pre_optimizer_step"))
        if not skipped:
            self.optimizer.step()  # under DeepSpeed a no-op, which tells the scheduler that a step was taken
        self.step_event("on_optimizer_step")
        if not skipped:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        self.optimization.entropy.after_step(config)
        if config.sync_ref_model and self.ref_model is not None and self.global_step % config.ref_model_sync_steps == 0:
            self._mix_reference()
        return {"grad_norm": grad_norm, "learning_rate": learning_rate, "update_skipped": float(skipped)}

    def evaluate(self, dataset=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Reward, length and loss metrics of fresh completions of ``dataset`` (default: the eval set),
        under TRL's names, leaving the training run as it was (:meth:`EvaluationStage.evaluate`)."""
        return self.evaluation_stage.evaluate(dataset, metric_key_prefix)

    def step_event(self, name: str) -> None:
        """Tell ``step_events`` (the trainer's callbacks, by transformers' names) of an event inside a
        step: "on_substep_end" after each micro-batch but a step's last, "on_pre_optimizer_step" once
        the gradient is clipped, "on_optimizer_step" after the optimizer step."""
        if self.step_events is not None:
            self.step_events(name)

    def publish_weights(self) -> None:
        """Hand the policy after the latest update to the generation backend (vLLM; nothing to do for
        transformers). Called after each update and, where that hand-over failed (a server that did
        not answer), again before the next generation, which would otherwise sample a stale policy.
        A batch in flight (``async_generation``) is waited for first, on every process: it was launched
        with the weights before, and a server must not switch weights under any process's request."""
        self.generation_stage.ahead.wait()
        if self.config.async_generation and self.accelerator.num_processes > 1:
            self.accelerator.wait_for_everyone()
        self.rollout_backend.sync_weights(self.unwrapped_model, self.global_step)
        self.published_version = self.global_step

    @torch.no_grad()
    def _mix_reference(self) -> None:
        """TR-DPO: ref <- alpha * policy + (1 - alpha) * ref (arXiv:2404.09656)."""
        alpha = self.config.ref_model_mixup_alpha
        for ref, policy in zero.parameter_pairs(self.ref_model, self.unwrapped_model):  # ZeRO-3: gathered
            ref.mul_(1 - alpha).add_(policy.detach(), alpha=alpha)  # FSDP: each process mixes its shards
