"""The engine's evaluation: reward, length and loss metrics of ``num_generations_eval`` completions per
prompt of each eval set, without training and without touching the training run's random state.

Eval completions are generated and scored as training's are: with ``environment_factory``, each
completion's instance (from the evaluation's own pool, see :mod:`grpo_lab.rollout.environments`)
is reset with its eval row's fields, its observation joins the prompt, its methods are the
completion's tools, and the reward functions (``get_reward`` among them) receive ``environments=``."""

from __future__ import annotations

import torch

from grpo_lab import ops
from grpo_lab.parallel import dist
from grpo_lab.core.build import check_dataset, eval_set_label, eval_sets, named_eval_dataset
from grpo_lab.core.metrics import loss_metrics, micro_batch_metrics, tool_metrics
from grpo_lab.rewards import check_reward_signatures
from grpo_lab.rewards.preparation import weights_tensor
from grpo_lab.rollout.environments import check_environment_columns
from grpo_lab.rollout.prompts import wrap_completions
from grpo_lab.state.run_state import rng_state, set_rng_state
from grpo_lab.types import Rollout


class EvaluationStage:
    """The engine's evaluation (``engine.evaluation_stage``): completions of an eval set generated as
    training's are (``engine.generation_stage``), scored with the run's reward functions, and TRL's
    eval loss metrics (``engine.loss_stage``'s entropy mask), leaving the run as it was. It holds no
    state of its own."""

    def __init__(self, engine):
        self.engine = engine

    def evaluate(self, dataset=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Sample ``num_generations_eval`` completions per prompt of ``dataset`` (default: the eval
        set) and report reward, length and loss metrics under ``metric_key_prefix`` (``eval_reward``,
        ``eval_loss``...), as TRL does; a dict of named sets is reported set by set
        (``eval_<name>_reward``...). With several
        processes, each evaluates its share of the prompts; the last ``len % processes`` prompts are
        left out so that every process has as many.

        The training run is left as it was: the weights, and every random generator the run draws
        from (the CPU's and the accelerator's), are restored, so a run that evaluates trains exactly
        as one that does not."""
        engine = self.engine
        sets = eval_sets(engine.eval_dataset if dataset is None else named_eval_dataset(dataset))
        if not sets:
            raise ValueError("There is no eval set: give eval_dataset to the session or trainer, or a dataset here.")
        processes, environments = engine.accelerator.num_processes, engine.environments
        for name, data in sets.items():
            check_dataset(data, eval_set_label(name), needs_prompt=environments is None)
            if environments is not None:
                check_environment_columns(data, eval_set_label(name), environments.factory)
            if len(data) < processes:
                raise ValueError(
                    f"{eval_set_label(name)} has {len(data)} prompt(s), fewer than the {processes} processes that "
                    "share it: give it at least one prompt per process."
                )
        if engine.published_version != engine.global_step:
            engine.publish_weights()
        metrics, kept = {}, rng_state()  # Python's and numpy's too: a reward function may draw from them
        training = engine.model.training
        try:
            for name, data in sets.items():
                prefix = metric_key_prefix if name is None else f"{metric_key_prefix}_{name}"
                evaluated = self._evaluate_set(data, eval_set_label(name))
                metrics.update({f"{prefix}_{key}": value for key, value in evaluated.items()})
        finally:
            set_rng_state(kept)
            engine.model.train(training)
        return metrics

    def _evaluate_set(self, dataset, label: str) -> dict[str, float]:
        """The metrics of the eval set ``dataset`` (``label`` names it in errors), without their prefix."""
        engine = self.engine
        config = engine.config
        repeats = config.num_generations_eval or config.num_generations
        local = dist.local_slice(engine.accelerator, len(dataset) - len(dataset) % engine.accelerator.num_processes)
        if engine.custom_rollout is None:  # else score() checks, once the rollout's extra keys are known
            columns = [c for c in dataset.column_names if c != "prompt"]
            check_reward_signatures(engine.reward_funcs, engine.reward_names,
                                    columns + ["environments"] * (engine.environments is not None))
        rows = dataset.with_format(None)[local.start:local.stop]
        rows = {key: [value for value in values for _ in range(repeats)] for key, values in rows.items()}
        indices = [index for index in range(local.start, local.stop) for _ in range(repeats)]
        size = config.per_device_eval_batch_size * repeats
        rewards, lengths, truncated, tool_counts, losses = [], [], [], {}, []
        cuda = [engine.accelerator.device] if engine.accelerator.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(config.seed + engine.accelerator.process_index)
            for start in range(0, len(indices), size):
                chunk = {key: values[start:start + size] for key, values in rows.items()}
                rollout = self._eval_rollout(chunk, indices[start:start + size], label, repeats)
                _count_tools(tool_counts, rollout)
                rewards_BF = engine.score(rollout).rewards_BF
                rewards.append(rewards_BF)
                losses.append((len(rollout), self._eval_loss_metrics(rollout, rewards_BF, repeats)))
                lengths.append(rollout.completion_lengths_B.float())
                truncated.append(rollout.is_truncated_B.float())
        gathered = [dist.gather(engine.accelerator, torch.cat(parts).to(engine.accelerator.device)).cpu()
                    for parts in (rewards, lengths, truncated)]
        # TRL's eval_loss weighs each batch's loss by its size; its other loss metrics are batch means
        metrics = {key: sum(part[key] for _, part in losses) / len(losses) for key in losses[0][1]}
        metrics["loss"] = sum(size * part["loss"] for size, part in losses) / sum(size for size, _ in losses)
        metrics |= _eval_metrics(*gathered, engine.reward_names, self._eval_reward_weights(), repeats)
        for k in config.eval_pass_at_k or ():
            for i, name in enumerate(engine.reward_names):
                passed_NG = (gathered[0][:, i] >= config.eval_pass_threshold).view(-1, repeats)  # NaN never passes
                metrics[f"rewards/{name}/pass@{k}"] = pass_at_k(passed_NG, k)
        metrics["num_tokens"] = float(engine.num_input_tokens_seen)  # the training run's count, as TRL logs it
        if tool_counts.get("tool_calls"):
            metrics.update(tool_metrics(engine.accelerator, tool_counts))
        return metrics

    def _eval_rollout(self, rows: dict[str, list], indices: list[int], label: str, repeats: int) -> Rollout:
        """The completions of one eval chunk, generated as training's are: ``rows`` holds each of its
        completions' eval row (rows ``indices`` of the eval set ``label``, each repeated for its
        ``repeats`` completions); with environment_factory, instances of the evaluation pool are
        reset with them first, and the rollout keeps them for the reward functions."""
        engine = self.engine
        prompts, environments = engine.generation_stage.start_rows(rows, indices, eval_set=label)
        batch, env_mask_BT, extra, completions = engine.generation_stage.generate_batch(prompts, rows)
        rows.update(extra)
        texts = engine.tokenizer.batch_decode(batch.completion_ids_BT, skip_special_tokens=True)
        return Rollout(
            prompts=prompts, completions=wrap_completions(prompts, texts) if completions is None else completions,
            completion_texts=texts, columns=rows, prompt_ids_BP=batch.prompt_ids_BP,
            prompt_mask_BP=batch.prompt_mask_BP, completion_ids_BT=batch.completion_ids_BT,
            completion_mask_BT=batch.completion_mask_BT, is_truncated_B=batch.is_truncated_B,
            group_index_B=torch.arange(len(prompts)) // repeats, step=engine.global_step, env_mask_BT=env_mask_BT,
            extra_keys=tuple(extra), environments=environments, image_inputs_B=batch.image_inputs_B,
        )

    def _eval_reward_weights(self) -> torch.Tensor | None:
        """The weight of each reward function (None: all 1): ``reward_weights``, then 1 for each
        environment's ``get_reward``, as training weighs them."""
        engine = self.engine
        own = 0 if engine.environments is None else len(engine.environments.reward_funcs)
        return weights_tensor(engine.config.reward_weights, engine.reward_names, own)

    def _eval_loss_metrics(self, rollout: Rollout, rewards_BF, repeats: int) -> dict[str, float]:
        """TRL's eval loss metrics of one eval chunk (whole groups of ``repeats``): the loss of the
        current settings on these completions, on-policy (ratio 1, so every clip ratio is 0), with
        the model in eval mode and no gradient, as TRL's ``prediction_step`` computes it (without
        vLLM's importance-sampling correction); and ``entropy`` (and ``kl`` when beta > 0) over the
        generated tokens. Means over processes, as TRL's are."""
        engine = self.engine
        config = engine.config
        advantages_B = self._eval_advantages(rewards_BF, repeats)
        settings = ops.LossSettings.from_config(config)
        engine.model.eval()
        with torch.no_grad(), engine.accelerator.autocast():
            ref_BT = engine.reference_logprobs(rollout) if config.beta > 0 else None
            logprobs_BT, entropies_BT = self._eval_token_scores(rollout)
            device = logprobs_BT.device
            mask_BT = rollout.generated_mask_BT.float().to(device)
            if config.mask_truncated_completions:
                mask_BT = ops.truncation_mask(mask_BT, rollout.is_truncated_B.to(device))
            entropy_mask_BT = None
            if config.top_entropy_quantile < 1.0:
                entropy_mask_BT = engine.loss_stage.entropy_mask(entropies_BT, mask_BT)
            tokens = dist.total(engine.accelerator, mask_BT.sum())
            normalizer = (tokens / engine.accelerator.num_processes).clamp(min=1.0)
            out = ops.policy_loss(
                logprobs_BT, None, advantages_B.to(device), mask_BT, settings=settings,
                ref_logprobs_BT=None if ref_BT is None else ref_BT.to(device), num_items_in_batch=normalizer,
                entropy_mask_BT=entropy_mask_BT, entropies_BT=entropies_BT,
                entropy_coef=engine.optimization.entropy.applied(config),
            )
        with_policy_loss = config.entropy_coef != 0.0 or config.use_adaptive_entropy
        row = micro_batch_metrics(engine.accelerator, settings, out, advantages_B, mask_BT, entropies_BT,
                                  with_policy_loss=with_policy_loss)
        return loss_metrics(engine.accelerator, [row], float(out.loss))

    def _eval_advantages(self, rewards_BF, repeats: int) -> torch.Tensor:
        """This process's advantages of an eval chunk, from the rewards of every process's chunk (as
        training's: batch scaling and ``normalize_then_sum`` use the whole gathered batch)."""
        engine = self.engine
        config = engine.config
        gathered_BF = dist.gather(engine.accelerator, rewards_BF.to(engine.accelerator.device)).cpu()
        advantages_B = ops.compute_advantages(
            gathered_BF, num_generations=repeats, reward_weights_F=self._eval_reward_weights(),
            scale_rewards=config.scale_rewards, multi_objective_aggregation=config.multi_objective_aggregation,
        ).advantages_B
        return advantages_B[dist.local_slice(engine.accelerator, gathered_BF.shape[0])]

    def _eval_token_scores(self, rollout) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropies of an eval chunk's completions, ``per_device_train_batch_size``
        at a time (a chunk holds every completion of ``per_device_eval_batch_size`` prompts)."""
        engine = self.engine
        size, parts = engine.config.per_device_train_batch_size, []
        for start in range(0, len(rollout), size):
            index_B = torch.arange(start, min(start + size, len(rollout)))
            logprobs_BT, entropies_BT, _ = engine.logprobs_and_aux_loss(engine.model, rollout, index_B,
                                                                        with_entropy=True)
            parts.append((logprobs_BT, entropies_BT))
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def pass_at_k(passed_NG: torch.Tensor, k: int) -> float:
    """The unbiased pass@k estimator (Chen et al. 2021, "Evaluating Large Language Models Trained on
    Code", arXiv:2107.03374): for a prompt with n samples of which c pass, the chance that k drawn
    without replacement hold at least one that passes,

        pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i)   (1 when n - c < k),

    averaged over the N prompts. ``passed_NG``: (N, n) booleans; 1 <= k <= n."""
    n = passed_NG.shape[1]
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, the samples per prompt; got k={k}, n={n}.")
    values = []
    for c in passed_NG.sum(dim=1).tolist():
        failing = n - int(c)
        values.append(1.0 if failing < k else 1.0 - float(torch.prod(1.0 - k / torch.arange(failing + 1, n + 1,
                                                                                             dtype=torch.float64))))
    return sum(values) / len(values)


def _count_tools(tool_counts: dict, rollout: Rollout) -> None:
    """Add the tool calls (and failures) the eval chunk ``rollout``'s rollout function returned."""
    if "tool_calls" in rollout.extra_keys:
        calls = rollout.columns["tool_calls"]
        failures = rollout.columns["tool_failures"] if "tool_failures" in rollout.extra_keys else [0] * len(calls)
        tool_counts.setdefault("tool_calls", []).extend(calls)
        tool_counts.setdefault("tool_failures", []).extend(failures)


def _eval_metrics(rewards_BF, lengths_B, truncated_B, names, reward_weights, repeats: int) -> dict[str, float]:
    """An eval set's metrics under TRL's names: ``reward`` and ``reward_std`` (the weighted sum of the
    reward functions, its mean and standard deviation over every completion some function scored), ``rewards/<fn>/mean``
    and ``std`` (None rewards left out), ``frac_reward_zero_std`` (share of prompts whose completions
    all got the same reward), ``completions/{mean,min,max}_length`` and ``clipped_ratio``, and
    ``completions/{mean,min,max}_terminated_length`` over the completions that ended (0 when none did)."""
    weights = torch.ones(rewards_BF.shape[1]) if reward_weights is None else torch.as_tensor(reward_weights)
    reward_B = torch.nansum(rewards_BF * weights, dim=1).masked_fill(torch.isnan(rewards_BF).all(dim=1), float("nan"))
    groups_GN = reward_B.view(-1, repeats)
    metrics = {"reward": float(torch.nanmean(reward_B)), "reward_std": float(ops.batch_std(reward_B))}
    for i, name in enumerate(names):
        scored = rewards_BF[:, i][~torch.isnan(rewards_BF[:, i])]
        metrics[f"rewards/{name}/mean"] = float(scored.mean()) if len(scored) else float("nan")
        metrics[f"rewards/{name}/std"] = float(ops.batch_std(scored))
    numbers_GN = ~torch.isnan(groups_GN)  # a completion no function scored counts in no group's spread
    highest = groups_GN.masked_fill(~numbers_GN, -torch.inf).amax(dim=1)
    lowest = groups_GN.masked_fill(~numbers_GN, torch.inf).amin(dim=1)
    metrics["frac_reward_zero_std"] = float((highest <= lowest).float().mean())
    metrics["completions/mean_length"] = float(lengths_B.mean())
    metrics["completions/min_length"] = float(lengths_B.min())
    metrics["completions/max_length"] = float(lengths_B.max())
    metrics["completions/clipped_ratio"] = float(truncated_B.mean())
    ended_B = lengths_B[truncated_B == 0]
    for stat, value in (("mean", ended_B.mean), ("min", ended_B.min), ("max", ended_B.max)):
        metrics[f"completions/{stat}_terminated_length"] = float(value()) if len(ended_B) else 0.0
    return metrics
