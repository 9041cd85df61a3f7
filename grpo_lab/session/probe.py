"""The doctor's probe: one generation batch, scored, with advantages and one loss pass (no update),
run by the engine's own stages and then undone, and the rules read over it.

What the stages change is put back by ``engine.scratch()`` (:meth:`grpo_lab.core.engine.Engine.scratch`):
the random states (so the probe draws the batch the next
``generate()`` would, and that ``generate()`` still draws it), the prompt sampler's position and the
engine's counters (:func:`grpo_lab.state.run_state.engine_counters`), every parameter's gradient (the very
tensors: a ``loss()`` the session holds for its next ``update()`` keeps its gradients), the entropy
the adaptive weight holds, and the training callbacks' hook. The weights and the optimizer are not
copied, because nothing here steps them: a copy (``session.state_dict()``) would take as much
memory again as the model and its optimizer, and loading it back would drop a pending ``loss()``.
With ``environment_factory`` the probe draws fresh environment instances, so that those a held
batch ran in keep their state. Reward functions run on the probe; side effects of their own (a
counter, a log file) are theirs.
"""

from __future__ import annotations

import dataclasses

import copy
import math
from dataclasses import dataclass

import torch

from grpo_lab.doctor import memory, rules, tokens
from grpo_lab.parallel import dist
from grpo_lab.doctor.findings import Finding, Findings
from grpo_lab.doctor.thresholds import DEFAULTS, Thresholds, resolve
from grpo_lab.rollout.batch import eos_token_ids
from grpo_lab.rollout.prompts import is_conversational
from grpo_lab.types import Advantages, LossResult


@dataclass
class Probe:
    """The probe batch's stage results, its gradient norm, and the memory it took."""

    advantages: Advantages
    loss: LossResult
    grad_norm: float
    memory: memory.MemoryReading


def _grad_norm(model) -> float:
    norms = [p.grad.detach().float().norm() for p in model.parameters() if p.grad is not None]
    return float(torch.stack(norms).norm()) if norms else 0.0


def run_probe(engine) -> Probe:
    """Generate, score, compute advantages and one loss pass (the batch's first optimizer step) on
    ``engine``, which is left as it was; the memory taken is measured over the whole. The batch is
    drawn as without ``dynamic_sampling``: the rules judge the prompts and rewards as they come (a
    filled batch holds only the groups that passed its filter, which would hide a reward's faults)."""
    plain = dataclasses.replace(engine.config, dynamic_sampling=False) if engine.config.dynamic_sampling else None
    with engine.scratch(plain), memory.MemoryWatch(engine.accelerator.device) as watch:
        rollout = engine.generate()
        watch.sample()
        advantages = engine.advantages(engine.score(rollout))
        loss = engine.loss(advantages, 0)
        watch.sample()
        grad_norm = _grad_norm(engine.model)
    return Probe(advantages, loss, grad_norm, watch.reading)


def diagnose(engine) -> Findings:
    """Run the probe on ``engine`` and every rule over it, under the thresholds of its config's
    ``doctor_thresholds``; a probe that runs out of memory is itself the finding (the first step
    would fail alike)."""
    thresholds = resolve(engine.config.doctor_thresholds)
    try:
        probe = run_probe(engine)
    except Exception as error:  # the engine is left as it was (engine.scratch() restores it)
        if not memory.is_out_of_memory(error):
            raise
        config = engine.config
        return Findings([memory.probe_out_of_memory(
            error, device=str(engine.accelerator.device), max_completion_length=config.max_completion_length,
            batch_size=config.per_device_train_batch_size)])
    return Findings(batch_findings(engine, probe, thresholds) + token_findings(engine, probe, thresholds)
                    + resource_findings(engine, probe, thresholds))


def batch_findings(engine, probe: Probe, thresholds: Thresholds = DEFAULTS) -> list[Finding]:
    """Lengths, rewards, zero-signal groups, the loss and the micro-batches."""
    config, advantages = engine.config, probe.advantages
    scores = advantages.scores
    rollout = scores.rollout
    declared = {name: getattr(func, "max_reward", None) for name, func in zip(scores.reward_names, engine.reward_funcs)}
    entropy_bonus = config.entropy_coef != 0.0 or config.use_adaptive_entropy
    return rules.link_causes([
        *rules.truncation(rollout.completion_lengths_B, rollout.is_truncated_B, rollout.completion_texts,
                          max_completion_length=config.max_completion_length,
                          mask_truncated_completions=config.mask_truncated_completions, thresholds=thresholds,
                          longer=longer_limit_trial(engine, rollout, thresholds)),
        *rules.rewards(scores.rewards_BF, rollout.group_index_B, scores.reward_names, rollout.prompts,
                       declared_max=declared),
        *rules.zero_signal_groups(advantages.rewards_B, advantages.advantages_B, rollout.group_index_B,
                                  rollout.prompts, pass_threshold=config.eval_pass_threshold, thresholds=thresholds,
                                  dynamic_sampling=config.dynamic_sampling),
        *rules.loss_by_construction(probe.loss.loss, probe.grad_norm, beta=config.beta,
                                    steps_per_batch=engine.steps_per_batch, loss_type=config.loss_type,
                                    corrects_sampling=engine.corrects_sampling(), entropy_bonus=entropy_bonus),
        *rules.zero_advantage_micro_batches(advantages.advantages_B,
                                            micro_batch_size=config.per_device_train_batch_size,
                                            skip_backward=config.skip_zero_advantage_backward, thresholds=thresholds),
    ])


LONGER_LIMIT_ROUNDS = 3
"""How many times the probe's batch may be generated again, each with twice the limit (up to 8x)."""


def longer_limit_trial(engine, rollout, thresholds: Thresholds = DEFAULTS) -> rules.LongerLimitTrial | None:
    """Where nearly every completion of the probe (``rollout``) was cut, the lengths they need are
    unknown: generate the probe's batch again (``engine.scratch`` puts the random state back, so
    the same prompts and the same draws, continued past the old limit) with twice the limit, then
    four and eight times, stopping at the first that cuts fewer than ``truncation_warning`` of
    them, and return what the last one saw. None where the probe's own lengths suffice, with a
    rollout function (its lengths are its own), or where even twice the limit does not fit the
    model's context (or, on one process, the memory). With several processes every decision is
    taken on the numbers of all of them (generation is collective: each process must generate as
    often as the others)."""
    accelerator = engine.accelerator
    cut_share = float(dist.mean(accelerator, rollout.is_truncated_B.float().mean().reshape(())))
    if engine.custom_rollout is not None or cut_share < thresholds.nearly_all_truncated:
        return None
    trial, limit = None, engine.config.max_completion_length
    context = engine.generation_stage.context
    longest_prompt = int(dist.gather(accelerator, rollout.prompt_mask_BP.sum(1).max().reshape(1)).max())
    for _ in range(LONGER_LIMIT_ROUNDS):
        limit *= 2
        if context is not None and longest_prompt + limit > context:
            break
        longer = copy.deepcopy(engine.config)
        longer.max_completion_length = limit
        try:
            with engine.scratch(longer):
                again = engine.generate()
        except Exception as error:  # a longer generation that does not fit: stop at what was seen
            if not memory.is_out_of_memory(error) or accelerator.num_processes > 1:  # the others would wait
                raise
            break
        cut_B = again.is_truncated_B.bool()
        ended = dist.gather_ragged(accelerator, again.completion_lengths_B[~cut_B].to(torch.long))
        trial = rules.LongerLimitTrial(limit, ended.cpu().tolist(),
                                       float(dist.mean(accelerator, cut_B.float().mean().reshape(()))))
        if trial.cut_share < thresholds.truncation_warning:  # the lengths they need are seen
            break
    return trial


def token_findings(engine, probe: Probe, thresholds: Thresholds = DEFAULTS) -> list[Finding]:
    """The chat template's generation prompt, EOS, pad and stop strings."""
    tokenizer, config = engine.tokenizer, engine.config
    rollout = probe.advantages.scores.rollout
    parts = tokens.chat_parts(tokenizer, config.chat_template_kwargs)
    firsts = [row for row, group in enumerate(rollout.group_index_B.tolist()) if row == 0
              or group != rollout.group_index_B[row - 1]]
    prompt_texts = [tokenizer.decode(rollout.prompt_ids_BP[row][rollout.prompt_mask_BP[row].bool()],
                                     skip_special_tokens=False) for row in firsts]
    eos_ids = stopping_ids(engine)
    end_of_turn = None if parts is None or parts.end_of_turn is None else tokenizer.convert_tokens_to_ids(
        parts.end_of_turn)
    names = {i: tokenizer.convert_ids_to_tokens(i) for i in {*eos_ids, end_of_turn} if i is not None}
    generated_BT = rollout.generated_mask_BT
    stops = (config.generation_kwargs or {}).get("stop") or (config.generation_kwargs or {}).get("stop_strings") or []
    truncated_B = rollout.is_truncated_B.bool().cpu()
    # a completion that ends without EOS before the limit was ended by something else: a stop string
    stopped_early = int((truncated_B & (rollout.completion_lengths_B.cpu() < config.max_completion_length)).sum())
    return [
        *tokens.generation_prompt(parts, prompt_texts, conversational=is_conversational(rollout.prompts[0])),
        *tokens.eos_emitted(rollout.completion_ids_BT, generated_BT, eos_ids=eos_ids, end_of_turn_id=end_of_turn,
                            names=names, is_truncated_B=rollout.is_truncated_B,
                            max_completion_length=config.max_completion_length),
        *tokens.pad_is_eos(tokenizer.pad_token_id, eos_ids, rollout.completion_ids_BT, generated_BT,
                           custom_rollout=engine.custom_rollout is not None),
        *tokens.stop_strings([stops] if isinstance(stops, str) else list(stops), rollout.completion_texts,
                             stopped_early=stopped_early, truncated_share=float(truncated_B.float().mean()),
                             thresholds=thresholds),
    ]


def stopping_ids(engine) -> set[int]:
    """The token ids that end a completion in this run: for transformers generation the tokenizer's
    EOS (or ``generation_kwargs['eos_token_id']``), which replaces the model's own; for vLLM and a
    rollout function the tokenizer's and the model's generation config's EOS ids (and vLLM's
    ``stop_token_ids``)."""
    kwargs = engine.config.generation_kwargs or {}
    if engine.custom_rollout is None and not engine.config.use_vllm:
        given = kwargs.get("eos_token_id", engine.tokenizer.eos_token_id)
        return {i for i in (given if isinstance(given, list) else [given]) if i is not None}
    return eos_token_ids(engine.tokenizer, engine.unwrapped_model) | set(kwargs.get("stop_token_ids") or [])


def resource_findings(engine, probe: Probe, thresholds: Thresholds = DEFAULTS) -> list[Finding]:
    """The memory forecast and, with vLLM, the trainer/vLLM log-prob gap."""
    rollout = probe.advantages.scores.rollout
    longest_prompt = max([*(engine.counted_prompt_tokens() or []), int(rollout.prompt_mask_BP.sum(1).max())])
    probe_length = rollout.prompt_ids_BP.shape[1] + rollout.completion_ids_BT.shape[1]
    findings = memory.memory_forecast(
        probe.memory, probe_length=probe_length, worst_length=longest_prompt + engine.config.max_completion_length,
        optimizer_bytes=memory.optimizer_state_bytes(engine.optimizer, engine.model),
    )
    return findings + rules.sampling_gap(*_logprob_gap(probe), thresholds=thresholds)


def _logprob_gap(probe: Probe) -> tuple[float | None, float | None]:
    """The trainer/vLLM log-prob gap: the sampling metrics where the vLLM correction computed them,
    else from the loss pass's log-probs (the policy that sampled: nothing has stepped) over its
    completions; None without vLLM log-probs."""
    metrics = probe.advantages.metrics
    if "sampling/sampling_logp_difference/mean" in metrics:
        return metrics["sampling/sampling_logp_difference/mean"], metrics["sampling/sampling_logp_difference/max"]
    rollout, loss = probe.advantages.scores.rollout, probe.loss
    if rollout.sampling_logprobs_BT is None:
        return None, None
    rows = loss.sample_index_B
    mask_BT = rollout.generated_mask_BT[rows].bool().to(loss.logprobs_BT.device)
    gap = (loss.logprobs_BT.float() - rollout.sampling_logprobs_BT[rows].to(loss.logprobs_BT.device).float()).abs()
    gap = gap[mask_BT]
    gap = gap[~torch.isnan(gap)]
    if gap.numel() == 0:
        return None, None
    mean = float(gap.mean())
    return (mean, float(gap.max())) if math.isfinite(mean) else (None, None)
