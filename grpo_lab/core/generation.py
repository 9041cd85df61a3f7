"""The engine's generate stage: draw prompts, sample completions (a backend or a rollout function),
and build the :class:`~grpo_lab.types.Rollout` with the log-probs the loss needs."""

from __future__ import annotations

import torch

from grpo_lab import ops
from grpo_lab.parallel import dist
from grpo_lab.core.dynamic_sampling import check_dynamic_sampling, fill_batch
from grpo_lab.core.generation_ahead import DrawnRound, GenerationAhead, check_async_generation
from grpo_lab.rewards.preparation import CALL_KEYWORDS
from grpo_lab.rollout.batch import eos_token_ids, padded_to_multiple
from grpo_lab.rollout.custom import CustomBatch, call_rollout_func
from grpo_lab.rollout.prompts import check_prompt_room, prompt_token_counts, render_prompts, wrap_completions
from grpo_lab.rollout.vision import engine_prompts, image_column, processed_prompts, prompt_lengths, row_images
from grpo_lab.core.stream_sampler import StreamSampler
from grpo_lab.types import Rollout


class GenerationStage:
    """The engine's generate stage (``engine.generation_stage``): it owns how training rows are read
    (a format-free view of the dataset), the prompt-fits-the-context check with the prompt token
    counts taken when the engine was built, and the guard against a rollout function that calls
    ``generate()`` again. It reads the engine's public parts (config, sampler, tokenizer, model,
    backend, environments) and adds the batch's tokens to ``engine.num_input_tokens_seen``.

    ``context``: the model's context length (None: unknown); ``prompt_tokens``: every prompt's token
    count of ``counted_dataset`` (None where it was too large to count at build)."""

    def __init__(self, engine, *, context: int | None, prompt_tokens: list[int] | None, counted_dataset):
        self.engine = engine
        self.context = context
        self._prompt_tokens, self._counted_dataset = prompt_tokens, counted_dataset
        self._in_rollout = False  # while the rollout function runs: generate() from inside it would recurse
        self._rows_source = self._rows_view = None  # a format-free view of train_dataset, see train_rows
        self.ahead = GenerationAhead(self)  # with async_generation: the batch prepared one generate() ahead

    def generate(self) -> Rollout:
        """Draw the next generation batch of prompts and sample ``num_generations`` completions each
        (with ``async_generation``, take the batch prepared at the last ``generate()`` instead); with
        ``dynamic_sampling``, rounds of them scored until the batch holds groups with a signal
        (:func:`grpo_lab.core.dynamic_sampling.fill_batch`). Then the log-prob passes the loss needs."""
        engine = self.engine
        config = engine.config
        if engine.published_version != engine.global_step:
            engine.publish_weights()
        if self.ahead.active(config):
            with self.ahead.one_generate():
                return self._finished(self._rollout(config, self.prepared_rollout))
        return self._finished(self._rollout(config, self.generate_round))

    def _rollout(self, config, next_round) -> Rollout:
        """The generation batch of ``next_round()`` (a generated or a prepared batch); with
        ``dynamic_sampling``, its kept groups filled from as many of them as it takes."""
        if not config.dynamic_sampling:
            return next_round()
        engine = self.engine
        sampler_state = engine.sampler.state_dict()
        try:
            return fill_batch(engine, next_round)
        except BaseException:
            engine.sampler.load_state_dict(sampler_state)
            raise

    def _finished(self, rollout: Rollout) -> Rollout:
        """``rollout`` with the log-prob passes the loss needs, its tokens counted."""
        engine = self.engine
        config = engine.config
        with engine.accelerator.autocast():
            if engine.needs_old_logprobs():
                rollout.old_logprobs_BT = engine.batch_logprobs(engine.model, rollout)
            if config.beta > 0:
                rollout.ref_logprobs_BT = engine.reference_logprobs(rollout)
        if engine.corrects_sampling() and rollout.sampling_logprobs_BT is not None:
            importance_weights(rollout, config)
        tokens = rollout.prompt_mask_BP.sum() + rollout.completion_lengths_B.sum()
        engine.num_input_tokens_seen += int(dist.total(engine.accelerator, tokens))
        return rollout

    def generate_round(self) -> Rollout:
        """Draw one generation batch of prompts and sample their completions, without the log-prob
        passes; the sampler is put back where it was if anything fails."""
        engine = self.engine
        sampler_state = engine.sampler.state_dict()
        try:
            drawn = self.draw_round()
            return self.finished_round(drawn, self.generate_batch(drawn.prompts, drawn.rows))
        except BaseException:
            engine.sampler.load_state_dict(sampler_state)
            raise

    def draw_round(self) -> DrawnRound:
        """The next generation batch's prompts, this process's share, checked against the context."""
        engine = self.engine
        config = engine.config
        indices = engine.sampler.next_indices()
        global_rows = [i for i in indices for _ in range(config.num_generations)]
        group_B = [position // config.num_generations for position in range(len(global_rows))]
        local = dist.local_slice(engine.accelerator, len(global_rows))
        rows = self.train_rows(global_rows[local])
        prompts, environments = self.start_rows(rows, global_rows[local])
        return DrawnRound(rows, prompts, global_rows[local], group_B[local], environments)

    def rendered(self, prompts: list) -> list:
        """The prompts as the backend takes them (chat messages through the chat template)."""
        return render_prompts(prompts, self.engine.tokenizer, self.engine.config.chat_template_kwargs)

    def finished_round(self, drawn: DrawnRound, generated: CustomBatch, *, lag: int = 0) -> Rollout:
        """The :class:`Rollout` of ``drawn``'s completions (padded as configured, decoded), refused where
        an inference engine generated it with a policy more than ``lag`` optimizer steps old."""
        engine = self.engine
        batch, env_mask_BT, extra, completions = generated
        batch, env_mask_BT = padded_to_multiple(
            batch, env_mask_BT, engine.config.pad_multiple(), pad_token_id=engine.tokenizer.pad_token_id
        )
        rows, prompts = dict(drawn.rows), drawn.prompts
        rows.update(extra)
        self.check_policy_version(batch, lag)
        completion_texts = engine.tokenizer.batch_decode(batch.completion_ids_BT, skip_special_tokens=True)
        return Rollout(
            prompts=prompts,
            completions=wrap_completions(prompts, completion_texts) if completions is None else completions,
            completion_texts=completion_texts,
            columns=rows,
            prompt_ids_BP=batch.prompt_ids_BP,
            prompt_mask_BP=batch.prompt_mask_BP,
            completion_ids_BT=batch.completion_ids_BT,
            completion_mask_BT=batch.completion_mask_BT,
            is_truncated_B=batch.is_truncated_B,
            group_index_B=torch.tensor(drawn.group_B),
            step=engine.global_step,
            sampling_logprobs_BT=batch.sampling_logprobs_BT,
            policy_version=batch.policy_version,
            env_mask_BT=env_mask_BT,
            extra_keys=tuple(extra),
            environments=drawn.environments,
            image_inputs_B=batch.image_inputs_B,
        )

    def prepared_rollout(self) -> Rollout:
        """With ``async_generation``: the batch prepared at the last ``generate()`` (generated with the
        weights of then), the next one launched (:class:`~grpo_lab.core.generation_ahead.GenerationAhead`;
        inside its ``one_generate()``, which undoes this after a failure)."""
        taken = self.ahead.take()
        rollout = self.finished_round(taken.drawn, CustomBatch(taken.batch, None, {}, None),
                                      lag=self.engine.steps_per_batch)
        if rollout.policy_version is None:  # in-process: generated with the weights of its launch
            rollout.policy_version = taken.version
        rollout.async_timing = taken.timing
        return rollout

    def check_modes(self) -> None:
        """Refuse ``dynamic_sampling`` and ``async_generation`` settings they cannot run under (once the
        engine's reward functions, batch layout and rollout are known)."""
        engine = self.engine
        check_async_generation(engine.config, engine.custom_rollout)
        check_dynamic_sampling(engine.config, engine.batching, engine.accelerator.num_processes, engine.reward_names,
                               engine.environments)

    def counted_prompt_tokens(self) -> list[int] | None:
        """The token count of every training prompt, as counted when the engine was built (None where
        the dataset was too large to count then, or has been swapped since)."""
        return self._prompt_tokens if self._counted_dataset is self.engine.train_dataset else None

    def train_rows(self, indices: list[int]) -> dict[str, list]:
        """The training dataset's rows ``indices`` as columns of Python lists, whatever format the
        dataset has (by indexing a format-free view with a list, which is cheaper than select().to_dict()).
        Refuses, naming the row, a prompt that cannot be rendered or does not fit the model's context
        with the current ``max_completion_length``."""
        engine = self.engine
        if isinstance(engine.sampler, StreamSampler):
            rows = engine.sampler.rows_at(indices)
        else:
            if self._rows_source is not engine.train_dataset:
                self._rows_source, self._rows_view = engine.train_dataset, engine.train_dataset.with_format(None)
            rows = self._rows_view[indices]
        if engine.environments is not None:  # the prompts are complete after reset(): generate() checks them then
            return rows
        # The drawn prompts must fit the context with the current max_completion_length; raised here,
        # generate() puts the sampler back, and the error names the rows (generation's would not).
        drawn = list(dict.fromkeys(indices))
        if self._counted_dataset is engine.train_dataset:  # counted when the session was built
            tokens = [self._prompt_tokens[index] for index in drawn]
        else:  # a dataset too large to count at build, or one swapped in since
            tokens = self.drawn_prompt_tokens(rows, indices, drawn)
        check_prompt_room(
            tokens, drawn, context=self.context, chat_template_kwargs=engine.config.chat_template_kwargs,
            max_new_tokens=None if engine.custom_rollout is not None else engine.config.max_completion_length,
        )
        return rows

    def drawn_prompt_tokens(self, rows: dict[str, list], indices: list[int], drawn: list[int]) -> list[int]:
        """The token count of each of the ``drawn`` rows' prompts (``rows`` holds rows ``indices``), with
        a vision-language model's images where the rows have them (their image tokens included)."""
        engine = self.engine
        first = {index: position for position, index in reversed(list(enumerate(indices)))}
        prompts = [rows["prompt"][first[index]] for index in drawn]
        if engine.processor is None:
            return prompt_token_counts(prompts, engine.tokenizer, engine.config.chat_template_kwargs, rows=drawn)
        column = image_column(rows)
        images = row_images({column: [rows[column][first[index]] for index in drawn]} if column else {}, column,
                            len(drawn))
        return prompt_lengths(engine.processor, prompts, images, engine.config.chat_template_kwargs, rows=drawn)

    def check_policy_version(self, batch, lag: int = 0) -> None:
        """Refuse completions an inference engine generated with another policy than the current one
        (with ``async_generation``: than one of the ``lag`` optimizer steps before it, or it)."""
        engine = self.engine
        if batch.policy_version is not None and not 0 <= engine.global_step - batch.policy_version <= lag:
            raise RuntimeError(
                f"The {engine.rollout_backend.name} backend generated with the policy of step {batch.policy_version}, "
                f"but the trainer is at step {engine.global_step}: the server was restarted (resume the run from "
                "its last checkpoint, which pushes the policy again) or another run shares it (give each its own)."
            )

    def start_rows(self, rows: dict[str, list], indices: list[int], eval_set: str | None = None
                    ) -> tuple[list, list | None]:
        """``(prompts, environments)`` of the drawn ``rows`` (rows ``indices`` of the train dataset, or
        of the eval set labelled ``eval_set``), the prompt column taken out of them: as the dataset
        holds them, or, with environment_factory, as each completion's environment instance (the
        second item; an eval set's come from the evaluation pool) left them after its ``reset()``,
        checked against the model's context."""
        engine = self.engine
        if engine.environments is None:
            return rows.pop("prompt"), None
        prompts, environments = engine.environments.start(rows, evaluation=eval_set is not None)
        rows.pop("prompt", None)
        dataset = "train_dataset" if eval_set is None else eval_set
        tokens = prompt_token_counts(prompts, engine.tokenizer, engine.config.chat_template_kwargs, rows=indices,
                                     dataset=dataset)
        check_prompt_room(
            tokens, indices, context=self.context, chat_template_kwargs=engine.config.chat_template_kwargs,
            max_new_tokens=None if engine.custom_rollout is not None else engine.config.max_completion_length,
            dataset=dataset,
        )
        return prompts, environments

    def backend_generate(self, prompts: list, rows: dict[str, list]):
        """The backend's completions of ``prompts``: their texts (chat messages through the chat
        template), or for a vision-language model their token ids and image inputs, from the images
        of ``rows`` (:func:`grpo_lab.rollout.vision.processed_prompts`); a vLLM backend is also given
        each prompt's tokens before the images are expanded, and its images, which vLLM processes itself
        (:func:`grpo_lab.rollout.vision.engine_prompts`)."""
        engine = self.engine
        backend, config = engine.rollout_backend, engine.config
        if engine.processor is None:
            return backend.generate(self.rendered(prompts), config)
        images = row_images(rows, image_column(rows), len(prompts))
        ids, image_inputs = processed_prompts(engine.processor, prompts, images, config.chat_template_kwargs)
        if not getattr(backend, "sends_images", False):
            return backend.generate(ids, config, image_inputs=image_inputs)
        return backend.generate(ids, config, image_inputs=image_inputs, engine_prompts=engine_prompts(
            engine.processor, prompts, images, config.chat_template_kwargs))

    def generate_batch(self, prompts: list, rows: dict[str, list]) -> CustomBatch:
        """The completions of ``prompts`` (one per completion, after any environment's ``reset()``):
        from the rollout function or the tool loop when there is one, else from the generation
        backend. ``rows``: their dataset columns (the images of a vision-language model's rows; the
        names the rollout function's extra keys may not take)."""
        engine = self.engine
        if engine.custom_rollout is None:
            return CustomBatch(self.backend_generate(prompts, rows), None, {}, None)
        if self._in_rollout:
            raise RuntimeError(
                "generate() (or step(), evaluate()) was called from inside the rollout function: sample its "
                "completions with session.sample(prompts) instead."
            )
        self._in_rollout = True
        try:
            return call_rollout_func(
                engine.custom_rollout, prompts, engine.rollout_owner, pad_token_id=engine.tokenizer.pad_token_id,
                eos_token_ids=eos_token_ids(engine.tokenizer, engine.unwrapped_model), vocab_size=engine.vocab_size(),
                context=getattr(engine.unwrapped_model.config, "max_position_embeddings", None),
                reserved={"prompt", *CALL_KEYWORDS, *rows}, device=engine.accelerator.device,
            )
        finally:
            self._in_rollout = False


def importance_weights(rollout: Rollout, config) -> None:
    """Set ``rollout``'s vLLM importance-sampling weights pi_old / pi_sampler (``(B, T)``,
    :func:`grpo_lab.ops.vllm_importance_weights` with ``config``'s mode and bounds) and their stats."""
    old_BT = rollout.old_logprobs_BT.float()
    sampling_BT = rollout.sampling_logprobs_BT.to(old_BT.device)
    mask_BT = rollout.generated_mask_BT.to(old_BT.device)
    if config.mask_truncated_completions:  # as in TRL: a truncated row's weight is 1 and it is in no stat
        mask_BT = ops.truncation_mask(mask_BT, rollout.is_truncated_B.to(old_BT.device))
    clip_max = config.vllm_importance_sampling_clip_max
    if config.vllm_importance_sampling_cap is not None:
        clip_max = config.vllm_importance_sampling_cap
    rollout.importance_weights_BT = ops.vllm_importance_weights(
        old_BT, sampling_BT, mask_BT, mode=config.vllm_importance_sampling_mode,
        clip_max=clip_max, clip_min=config.vllm_importance_sampling_clip_min,
    )
    rollout.sampling_stats = ops.importance_sampling_stats(
        rollout.importance_weights_BT, old_BT, sampling_BT, mask_BT
    )
