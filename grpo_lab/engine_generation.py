"""The engine's generate stage: draw prompts, sample completions (a backend or a rollout function),
and build the :class:`~grpo_lab.types.Rollout` with the log-probs the loss needs."""

from __future__ import annotations

import torch

from grpo_lab import dist
from grpo_lab.rewards.preparation import CALL_KEYWORDS
from grpo_lab.rollout.batch import eos_token_ids, padded_to_multiple
from grpo_lab.rollout.custom import CustomBatch, call_rollout_func
from grpo_lab.rollout.prompts import check_prompt_room, prompt_token_counts, render_prompts, wrap_completions
from grpo_lab.types import Rollout


class GenerationStage:
    """Methods of :class:`grpo_lab.engine.Engine`."""

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
            prompts, environments = self._start_rows(rows, global_rows[local])
            batch, env_mask_BT, extra, completions = self._generate_batch(prompts, list(rows))
            batch, env_mask_BT = padded_to_multiple(
                batch, env_mask_BT, config.pad_multiple(), pad_token_id=self.tokenizer.pad_token_id
            )
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
            environments=environments,
        )
        with self.accelerator.autocast():
            if self.needs_old_logprobs():
                rollout.old_logprobs_BT = self.batch_logprobs(self.model, rollout)
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

    def _start_rows(self, rows: dict[str, list], indices: list[int], eval_set: str | None = None
                    ) -> tuple[list, list | None]:
        """``(prompts, environments)`` of the drawn ``rows`` (rows ``indices`` of the train dataset, or
        of the eval set labelled ``eval_set``), the prompt column taken out of them: as the dataset
        holds them, or, with environment_factory, as each completion's environment instance (the
        second item; an eval set's come from the evaluation pool) left them after its ``reset()``,
        checked against the model's context."""
        if self.environments is None:
            return rows.pop("prompt"), None
        prompts, environments = self.environments.start(rows, evaluation=eval_set is not None)
        rows.pop("prompt", None)
        dataset = "train_dataset" if eval_set is None else eval_set
        tokens = prompt_token_counts(prompts, self.tokenizer, self.config.chat_template_kwargs, rows=indices,
                                     dataset=dataset)
        check_prompt_room(
            tokens, indices, context=self._context, chat_template_kwargs=self.config.chat_template_kwargs,
            max_new_tokens=None if self.custom_rollout is not None else self.config.max_completion_length,
            dataset=dataset,
        )
        return prompts, environments

    def _generate_batch(self, prompts: list, columns: list[str]) -> CustomBatch:
        """The completions of ``prompts`` (one per completion, after any environment's ``reset()``):
        from the rollout function or the tool loop when there is one, else from the generation
        backend. ``columns``: the names the rollout function's extra keys may not take."""
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
