"""The engine's loss stage: the micro-batches of one optimizer step, their forward passes, the policy
loss of :mod:`grpo_lab.ops` and its backward pass, and the step's metrics."""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from grpo_lab import ops
from grpo_lab.parallel import dist
from grpo_lab.core.metrics import loss_metrics, micro_batch_metrics
from grpo_lab.types import Advantages, LossResult, Rollout


class _MicroBatch(NamedTuple):
    """One micro-batch's forward pass and loss (``LossStage._micro_batch_loss``)."""

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


class LossStage:
    """The engine's loss stage (``engine.loss_stage``): the micro-batches of an optimizer step, their
    forward passes through ``engine.logprobs_and_aux_loss``, :func:`grpo_lab.ops.policy_loss` and the
    backward pass through ``engine.layout``. It reads the engine's config, accelerator, model,
    optimization and batching, records ``engine.trained_parameter_names`` (which parameters a
    backward pass reaches) and tells ``engine.step_event`` of each micro-batch."""

    def __init__(self, engine):
        self.engine = engine
        self.token_weight_sink: list | None = None
        """Where set (``what_if``), each backward pass appends ``(index_B, d loss / d logprobs_BT)``:
        the weight the step's loss gives each token's log-prob."""

    def step_indices(self, batch_step: int) -> list[torch.Tensor]:
        """Completion indices of each micro-batch that optimizer step ``batch_step`` of a batch uses."""
        engine = self.engine
        size = engine.config.per_device_train_batch_size
        ga, spg = engine.config.gradient_accumulation_steps, engine.batching.steps_per_generation
        micro = [(batch_step * ga + i) % spg for i in range(ga)]
        return [torch.arange(m * size, (m + 1) * size) for m in micro]

    def loss(self, advantages: Advantages, batch_step: int = 0) -> LossResult:
        """Forward and backward passes for optimizer step ``batch_step`` of the current batch.

        Gradients are zeroed first, so calling this again (after changing settings) recomputes them.
        """
        engine = self.engine
        config = engine.config
        rollout = advantages.scores.rollout
        if config.beta > 0 and rollout.ref_logprobs_BT is None:  # beta switched on after this batch was sampled
            rollout.ref_logprobs_BT = self._reference_logprobs_autocast(rollout)
        aux_weight = engine.router_aux_loss_weight()  # raises before any gradient is touched
        engine.layout.clear_gradients(engine.model, engine.optimizer)
        micro_batches = self.step_indices(batch_step)
        step_index = torch.cat(micro_batches)
        loss_mask_BT, normalizer = self._loss_mask_and_normalizer(rollout, step_index)
        settings = ops.LossSettings.from_config(config)
        entropy_coef = engine.optimization.entropy.applied(config)
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
            context = contextlib.nullcontext() if sync else engine.accelerator.no_sync(engine.model)
            with torch.no_grad() if skip else context:
                step = self._micro_batch_loss(*args)
                if skip:
                    not_finite |= not _finite_zero_gradient(step.loss, step.out.ratio_BT, step.mask_BT)
                else:
                    engine.layout.backward(engine.model, step.loss, last=sync)
            skipped += skip
            if config.use_adaptive_entropy:
                kept_entropy = (step.entropies_BT.detach() * step.kept_BT).sum()
                entropy_stats.append(torch.stack([kept_entropy, step.kept_BT.sum()]))
            if step.off_policy_B1 is not None:
                masked_sequences += (step.off_policy_B1 == 0).sum().to(masked_sequences.device)
            if step.aux_loss is not None:
                aux_losses.append(step.aux_loss.detach())
            total_loss += float(step.loss.detach())
            parts.append((index_B, step.logprobs_BT.detach(), step.entropies_BT.detach(), step.out, step.mask_BT))
            if not sync:
                engine.step_event("on_substep_end")
        if zero_K is not None:
            not_finite, skipped_fraction = self._skips_over_processes(not_finite, skipped, len(micro_batches))
        self._complete_gradients(none_ran=skipped == len(micro_batches), not_finite=not_finite)
        if config.use_adaptive_entropy:
            self._hold_step_entropy(entropy_stats)
        result = self._loss_result(advantages, step_index, parts, total_loss, settings)
        result.micro_batches, result.backward_skipped = len(micro_batches), skipped
        if config.entropy_coef != 0.0 or config.use_adaptive_entropy:
            result.metrics["entropy_coef"] = entropy_coef
        if zero_K is not None:
            result.metrics["backward_skipped_fraction"] = skipped_fraction
        self._add_step_metrics(result.metrics, aux_losses, masked_sequences, len(step_index))
        return result

    def _reference_logprobs_autocast(self, rollout):
        engine = self.engine
        with engine.accelerator.autocast():
            return engine.reference_logprobs(rollout)

    def _skips_over_processes(self, not_finite: bool, skipped: int, micro_batches: int) -> tuple[bool, float]:
        """Whether any process saw a non-finite skipped loss, and the fraction of micro-batches whose
        backward was skipped, over processes in one collective (running a non-finite one would
        average a NaN into every process's gradients)."""
        engine = self.engine
        values = [[float(not_finite), float(skipped), float(micro_batches)]]
        counts = torch.tensor(values, device=engine.accelerator.device)
        not_finite_all, skipped_all, micro_batches_all = dist.gather(engine.accelerator, counts).sum(0).tolist()
        return not_finite_all > 0, skipped_all / micro_batches_all

    def _skips_backward(self, zero_K: list[bool] | None, k: int, last: bool, skipped: int) -> bool:
        """Whether micro-batch ``k`` runs its forward pass without a backward. A micro-batch whose
        advantages are all zero adds exactly nothing to the gradient: its forward pass runs (for the
        metrics) without a backward. The ``last`` micro-batch of a step always runs one where gradients
        are averaged or gathered in it (several processes, FSDP), and where no backward pass has run
        yet that says which parameters it reaches (``skipped`` of the ``k`` before it were skipped)."""
        engine = self.engine
        return zero_K is not None and zero_K[k] and (
            not last
            or (engine.layout.whole_model_here() and (skipped < k or engine.trained_parameter_names is not None))
        )

    def _hold_step_entropy(self, entropy_stats: list[torch.Tensor]) -> None:
        """Keep the step's mean token entropy, over processes, for the adaptive entropy weight that
        ``update`` adapts; ``entropy_stats`` holds each micro-batch's kept-token entropy sum and count."""
        engine = self.engine
        entropy_sum, tokens = (dist.total(engine.accelerator, value) for value in torch.stack(entropy_stats).sum(0))
        engine.optimization.entropy.pending_step_entropy = float(entropy_sum / tokens.clamp(min=1.0))

    def _loss_mask_and_normalizer(self, rollout: Rollout, step_index: torch.Tensor):
        """The (B, T) mask of the tokens the loss counts (``mask_truncated_completions`` and a masked
        dynamic-sampling filler leave rows out), and the step-token normalizer: losses that
        normalize globally (dapo's) divide by the tokens of the whole optimizer step, counted over all
        processes; DDP averages gradients over processes, hence the division by their number."""
        engine = self.engine
        loss_mask_BT = rollout.generated_mask_BT.float()
        if engine.config.mask_truncated_completions:
            loss_mask_BT = ops.truncation_mask(loss_mask_BT, rollout.is_truncated_B)
        filling = rollout.dynamic_sampling
        if filling is not None and engine.config.dynamic_sampling_fill == "masked":  # train on the kept groups only
            loss_mask_BT = loss_mask_BT * (~filling.filler_B).to(loss_mask_BT.device, loss_mask_BT.dtype)[:, None]
        global_tokens = dist.total(engine.accelerator, loss_mask_BT[step_index].sum())
        return loss_mask_BT, (global_tokens / engine.accelerator.num_processes).clamp(min=1.0)

    def _add_step_metrics(self, metrics: dict, aux_losses: list, masked_sequences: torch.Tensor,
                          sequences: int) -> None:
        """The load-balancing loss (where one was weighted) and the share of sequences the off-policy
        mask dropped (where it is on), over processes."""
        engine = self.engine
        if aux_losses:
            metrics["aux_loss"] = float(dist.mean(engine.accelerator, torch.stack(aux_losses).mean()))
        if engine.config.off_policy_mask_threshold is not None:
            total = dist.total(engine.accelerator, torch.tensor(float(sequences), device=masked_sequences.device))
            metrics["off_policy_mask/masked_fraction"] = float(dist.total(engine.accelerator, masked_sequences) / total)

    def _micro_batch_loss(self, rollout: Rollout, advantages: Advantages, index_B, loss_mask_BT, normalizer,
                          settings: ops.LossSettings, entropy_coef: float, aux_weight: float,
                          micro_batches: int) -> _MicroBatch:
        """One micro-batch's forward pass and loss; a mixture-of-experts model's load-balancing loss
        is added with ``aux_weight`` / ``micro_batches`` (TRL's scaling)."""
        engine = self.engine
        config = engine.config
        with engine.accelerator.autocast():
            logprobs_BT, entropies_BT, aux_loss = engine.logprobs_and_aux_loss(
                engine.model, rollout, index_B, with_entropy=True, entropy_grad=entropy_coef != 0.0,
                router_aux_loss=aux_weight != 0.0,
            )
        sink = self.token_weight_sink
        if sink is not None and logprobs_BT.requires_grad:
            logprobs_BT.register_hook(lambda grad_BT: sink.append((index_B, grad_BT.detach().float().cpu())))
        device = logprobs_BT.device  # the batch's tensors live on the CPU; the passes on the accelerator
        on_device = lambda tensor_BT: None if tensor_BT is None else tensor_BT[index_B].to(device)  # noqa: E731
        mask_BT = on_device(loss_mask_BT)
        entropy_mask_BT = None
        if config.top_entropy_quantile < 1.0:
            entropy_mask_BT = self.entropy_mask(entropies_BT.detach(), mask_BT)
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
            accumulation_steps=micro_batches,
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

        engine = self.engine
        config = engine.config
        if (not config.skip_zero_advantage_backward or config.beta != 0.0 or entropy_coef != 0.0 or aux_weight != 0.0
                or engine.accelerator.distributed_type == DistributedType.DEEPSPEED or engine.routes_to_experts):
            return None
        zero_K = torch.stack([~advantages.advantages_B[index_B].any() for index_B in micro_batches])
        if engine.layout.backward_gathers:
            every_K = dist.gather(engine.accelerator, zero_K.to(engine.accelerator.device))
            zero_K = every_K.view(-1, len(micro_batches)).all(0)
        return zero_K.tolist()

    def entropy_mask(self, entropies_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
        """(B, T) ``top_entropy_quantile``'s mask (:func:`grpo_lab.ops.entropy_mask`), with one
        threshold over every process's tokens, as TRL takes it."""
        engine = self.engine
        pool = dist.gather_ragged(engine.accelerator, entropies_BT[mask_BT.bool()].float())
        return ops.entropy_mask(entropies_BT, mask_BT, quantile=engine.config.top_entropy_quantile, pool=pool)

    def _complete_gradients(self, *, none_ran: bool, not_finite: bool) -> None:
        """Record which parameters a backward pass reaches (once). When no micro-batch of the step ran
        one, give those parameters the zero gradient it would have given, so that the optimizer step
        (momentum, weight decay) is the one it would have been; when a skipped micro-batch's loss or
        ratios were not finite, make the gradient not finite, as its backward pass would have, so
        that ``update`` skips the step."""
        engine = self.engine
        if none_ran:
            for name, parameter in engine.unwrapped_model.named_parameters():
                if name in engine.trained_parameter_names and parameter.requires_grad and parameter.grad is None:
                    parameter.grad = torch.zeros_like(parameter)
        elif engine.trained_parameter_names is None:  # the unwrapped model's names: a checkpoint keeps them
            parameters = engine.unwrapped_model.named_parameters()
            engine.trained_parameter_names = {name for name, p in parameters if p.grad is not None}
        if not_finite:
            next(p for p in engine.model.parameters() if p.grad is not None).grad.fill_(float("nan"))

    def _off_policy_mask(self, rollout: Rollout, index_B, advantages: Advantages, logprobs_BT, mask_BT):
        """(B, 1) off-policy sequence mask (``off_policy_mask_threshold``) against the sampling policy:
        vLLM's log-probs, else the old policy's; None when off or when the batch is on-policy."""
        threshold = self.engine.config.off_policy_mask_threshold
        sampling_BT = rollout.old_logprobs_BT if rollout.sampling_logprobs_BT is None else rollout.sampling_logprobs_BT
        if threshold is None or sampling_BT is None:
            return None
        return ops.off_policy_mask(
            advantages.advantages_B[index_B].to(logprobs_BT.device), logprobs_BT,
            sampling_BT[index_B].to(logprobs_BT.device).float(), mask_BT, threshold=threshold,
        )

    def _loss_result(self, advantages, step_index, parts, total_loss, settings: ops.LossSettings) -> LossResult:
        """The step's metrics (each micro-batch's, averaged, as TRL logs them) and its tensors for the
        views (each token's ratio and whether the clip removed its gradient)."""
        engine = self.engine
        with_policy_loss = engine.config.entropy_coef != 0.0 or engine.config.use_adaptive_entropy
        rows = [micro_batch_metrics(engine.accelerator, settings, out, advantages.advantages_B[index_B], mask_BT,
                                    entropies_BT, with_policy_loss=with_policy_loss)
                for index_B, _, entropies_BT, out, mask_BT in parts]
        metrics = loss_metrics(engine.accelerator, rows, total_loss)
        cat = lambda i: torch.cat([p[i] for p in parts])  # noqa: E731
        logprobs_BT, entropies_BT, mask_BT = cat(1), cat(2), cat(4)
        ratio_BT = torch.cat([p[3].ratio_BT.detach().expand_as(p[1]) for p in parts])
        clip = ops.clip_diagnostics(
            ratio_BT, advantages.advantages_B[step_index].to(ratio_BT.device), mask_BT,
            epsilon_low=settings.epsilon_low, epsilon_high=settings.epsilon_high, loss_type=settings.loss_type,
        )
        return LossResult(
            advantages=advantages, loss=metrics["loss"], sample_index_B=step_index, logprobs_BT=logprobs_BT,
            entropies_BT=entropies_BT, ratio_BT=ratio_BT, clipped_BT=clip.is_region_clipped_BT, metrics=metrics,
        )
