"""The engine's evaluation: reward metrics of ``num_generations_eval`` completions per prompt of an
eval set, without training."""

from __future__ import annotations

import torch

from grpo_lab import dist
from grpo_lab.engine_build import check_dataset
from grpo_lab.metrics import tool_metrics
from grpo_lab.rewards import check_reward_signatures, score_completions
from grpo_lab.rollout.prompts import wrap_completions
from grpo_lab.types import generated_mask


class EvaluationStage:
    """Methods of :class:`grpo_lab.engine.Engine`."""

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
            columns = [c for c in dataset.column_names if c != "prompt"]
            check_reward_signatures(self.reward_funcs, self.reward_names, columns)
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
                    failures = extra.get("tool_failures", [0] * len(extra["tool_calls"]))
                    tool_counts.setdefault("tool_failures", []).extend(failures)
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
