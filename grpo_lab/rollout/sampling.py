"""``session.sample()``: one completion per prompt from the run's generation backend, the building
block of a rollout function."""

from __future__ import annotations

import copy
import numbers


def sample_prompts(session, prompts, max_new_tokens: int | None = None) -> dict[str, list]:
    """See :meth:`grpo_lab.GRPOSession.sample`."""
    from grpo_lab.rollout.custom import as_token_ids, outside_vocabulary
    from grpo_lab.rollout.prompts import is_conversational, render_prompts
    from grpo_lab.rollout.vision import ImageInputs, processed_prompts

    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("sample() takes a non-empty list of prompts (texts, chat messages or token-id lists).")
    if all(isinstance(p, numbers.Integral) for p in prompts):
        raise ValueError("sample() takes a list of prompts: wrap one prompt's token ids in a list, sample([ids]).")
    as_ids = [
        None if isinstance(p, str) or is_conversational(p) else as_token_ids(p, allow_empty=False) for p in prompts
    ]
    for index, (prompt, ids) in enumerate(zip(prompts, as_ids, strict=True)):
        if ids is None and not (isinstance(prompt, str) or is_conversational(prompt)):
            raise ValueError(
                f"sample() takes texts, chat messages or token-id lists (non-empty, ints); prompt {index} is a "
                f"{type(prompt).__name__}: {str(prompt)[:80]!r}."
            )
        problem = None if ids is None else outside_vocabulary(ids, session.engine.vocab_size())
        if problem is not None:
            raise ValueError(f"sample() got prompt {index}, whose {problem}.")
    processor = session.engine.processor
    if all(ids is not None for ids in as_ids):
        inputs = as_ids
    elif any(ids is not None for ids in as_ids):
        raise ValueError("sample() takes prompts of one kind: all token-id lists, or all texts and chat messages.")
    elif processor is not None:  # a vision-language model: rendered as generate() renders them, by its processor
        inputs, _ = processed_prompts(processor, list(prompts), [[] for _ in prompts],
                                      session.config.chat_template_kwargs)
    else:
        inputs = render_prompts(list(prompts), session.tokenizer, session.config.chat_template_kwargs)
    settings = session.config
    if max_new_tokens is not None:
        longest = session.config.max_completion_length
        whole = isinstance(max_new_tokens, int) and not isinstance(max_new_tokens, bool)
        if not whole or not 1 <= max_new_tokens <= longest:
            raise ValueError(
                f"max_new_tokens must be an int from 1 to max_completion_length ({longest}); "
                f"got {max_new_tokens!r}."
            )
        settings = copy.copy(session.config)
        settings.max_completion_length = max_new_tokens
    # a vision-language model's backend call: no images, and its image token never sampled
    images = {} if processor is None else {"image_inputs": [ImageInputs() for _ in inputs]}
    batch = session.engine.rollout_backend.generate(inputs, settings, **images)
    session.engine.generation_stage.check_policy_version(batch)
    prompt_ids = [
        ids[mask.bool()].tolist() for ids, mask in zip(batch.prompt_ids_BP, batch.prompt_mask_BP, strict=True)
    ]
    kept_BT = batch.completion_mask_BT.bool()
    completion_ids = [ids[mask].tolist() for ids, mask in zip(batch.completion_ids_BT, kept_BT, strict=True)]
    logprobs = None
    if batch.sampling_logprobs_BT is not None:
        logprobs = [values[mask].tolist() for values, mask in zip(batch.sampling_logprobs_BT, kept_BT, strict=True)]
    texts = session.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs, "texts": texts}
