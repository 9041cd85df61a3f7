"""Generation with transformers' ``model.generate`` (or its continuous batching engine): the
default rollout backend.

Prompts are tokenized with left padding (so every prompt ends where generation starts), sampled
with the configured sampling parameters, cut after the first EOS, and returned as padded tensors
with a completion mask and a truncated flag (no EOS within ``max_new_tokens``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from transformers import GenerationConfig

from grpo_lab import compact_forward, dist, notices
from grpo_lab.models import CACHE
from grpo_lab.ops.masks import completion_mask_from_ids
from grpo_lab.prefix_sharing import PrefixSharing
from grpo_lab.rollout import decoding
from grpo_lab.rollout.batch import GeneratedBatch, batch_from_token_lists
from grpo_lab.rollout.kv_buffer import buffer_cache


def sampling_config(
    tokenizer,
    *,
    max_new_tokens: int,
    do_sample: bool = True,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int | None = 0,
    min_p: float | None = None,
    repetition_penalty: float = 1.0,
    cache_implementation: str | None = None,
    generation_kwargs: dict | None = None,
) -> GenerationConfig:
    """A ``GenerationConfig`` from TRL-named sampling fields; ``generation_kwargs`` override them."""
    settings = dict(
        max_new_tokens=max_new_tokens,
        do_sample=do_sample,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        repetition_penalty=repetition_penalty,
    )
    if do_sample:
        # top_k=0 disables top-k (as in TRL); None would let transformers fill in its default of 50.
        settings.update(temperature=temperature, top_p=top_p, top_k=top_k or 0, min_p=min_p)
    else:
        settings.update(temperature=None, top_p=None, top_k=None)
    if cache_implementation not in (None, "dynamic"):  # "dynamic" is generate's default cache
        settings.update(cache_implementation=cache_implementation)
    settings.update(generation_kwargs or {})
    return GenerationConfig(**settings)


def check_cache_device(cache_implementation: str | None, device: torch.device) -> None:
    """Refuse an offloaded key/value cache (a GPU cache kept in CPU memory) for generation on a CPU,
    where transformers would fail at the first token without saying why."""
    if device.type == "cpu" and (cache_implementation or "").startswith("offloaded"):
        raise ValueError(
            f"cache_implementation={cache_implementation!r} moves a GPU's key/value cache to CPU memory, but this "
            "run generates on a CPU. Set cache_implementation=None (or 'static')."
        )


def tokenize_prompts(tokenizer, prompts: list[str] | list[list[int]], device, multiple: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``(ids, mask)`` of prompts given as texts or as token ids (kept as they are), their
    width a multiple of ``multiple`` where given."""
    if tokenizer.padding_side != "left":
        raise ValueError(
            f"The tokenizer pads on the {tokenizer.padding_side!r}; generation needs left padding so that "
            "every prompt ends where its completion starts. Set tokenizer.padding_side = 'left'."
        )
    keys = [prompt if isinstance(prompt, str) else tuple(prompt) for prompt in prompts]
    distinct = list(dict.fromkeys(keys))  # each prompt once; the copies of a group are rows of it
    if all(isinstance(key, str) for key in distinct):
        encoded = tokenizer(distinct, return_tensors="pt", padding=True, add_special_tokens=False,
                            pad_to_multiple_of=multiple)
        ids_UP, mask_UP = encoded["input_ids"], encoded["attention_mask"]
    else:
        ids_UP, mask_UP = left_pad(distinct, tokenizer.pad_token_id, multiple)
    row_of = {key: row for row, key in enumerate(distinct)}
    row_B = torch.tensor([row_of[key] for key in keys], dtype=torch.long)
    return ids_UP[row_B].to(device), mask_UP[row_B].to(device)


def left_pad(token_lists, pad_token_id: int, multiple: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)`` of token-id sequences padded on the left to the longest (rounded up to a
    multiple of ``multiple`` where given): ``(len, width)``."""
    bad = next((ids for ids in token_lists if not ids or not all(isinstance(t, int) for t in ids)), None)
    if bad is not None:
        raise ValueError(
            f"A prompt given as token ids must be a non-empty sequence of ints; got {list(bad)[:8]!r}. Pass texts, "
            "or lists of token ids from the tokenizer."
        )
    size = max(len(ids) for ids in token_lists)
    if multiple:
        size = -(-size // multiple) * multiple
    ids_BP = torch.full((len(token_lists), size), pad_token_id, dtype=torch.long)
    mask_BP = torch.zeros((len(token_lists), size), dtype=torch.long)
    for row, ids in enumerate(token_lists):
        ids_BP[row, size - len(ids):] = torch.tensor(list(ids), dtype=torch.long)
        mask_BP[row, size - len(ids):] = 1
    return ids_BP, mask_BP


def check_context_fits(model, prompt_length: int, max_new_tokens: int) -> None:
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and prompt_length + max_new_tokens > limit:
        raise ValueError(
            f"Prompts of {prompt_length} tokens plus max_completion_length={max_new_tokens} exceed the "
            f"model's context of {limit} tokens. Shorten or filter the prompts, or lower "
            "max_completion_length (a rollout function can also shorten its conversations or pass "
            "sample(max_new_tokens=...))."
        )


def _reuses_a_given_cache(model, generation_config: GenerationConfig) -> bool:
    """One sample per row by plain sampling or greedy search, which continues a cache handed to
    ``generate``. Unset fields take the model's own generation defaults, as ``generate`` does."""

    def setting(name):
        value = getattr(generation_config, name, None)
        return value if value is not None else getattr(getattr(model, "generation_config", None), name, None)

    return (
        (setting("num_beams") or 1) == 1
        and (setting("num_return_sequences") or 1) == 1
        and setting("cache_implementation") is None
        and setting("use_cache") is not False
        and setting("prompt_lookup_num_tokens") is None
        and setting("assistant_early_exit") is None
    )


def _model_generate(model, prompt_ids_BP, prompt_mask_BP, generation_config, prefix_sharing) -> torch.Tensor:
    """(B, T) completion tokens from ``model.generate``, continuing a shared prompt cache where it can."""
    cache = None
    if prefix_sharing is not None and _reuses_a_given_cache(model, generation_config):
        cache = prefix_sharing.prompt_cache(model, prompt_ids_BP, prompt_mask_BP)
        if cache is not None:
            buffer_cache(cache, new_tokens=generation_config.max_new_tokens)
    sequences = model.generate(
        input_ids=prompt_ids_BP, attention_mask=prompt_mask_BP, generation_config=generation_config,
        **({} if cache is None else {CACHE: cache}),
    )
    return sequences[:, prompt_ids_BP.shape[1]:]


@torch.no_grad()
def generate(
    model, tokenizer, prompts: list[str] | list[list[int]], generation_config: GenerationConfig,
    prefix_sharing: PrefixSharing | None = None, *, compact: bool = False,
    on_fallback: Callable[[Any, str], None] | None = None, pad_to_multiple_of: int | None = None,
) -> GeneratedBatch:
    """Sample one completion per prompt, a text or token ids (repeat a prompt to get several).

    With ``compact``, grpo_lab's own loop samples (``decoding``) where the model and settings allow
    it, else ``model.generate``, after a call of ``on_fallback(model, reason)``. With
    ``prefix_sharing``, a repeated prompt is pre-filled once and its keys and values reused by its
    copies (for ``model.generate``, a cache that then takes each decoding step's keys and values in
    place: ``kv_buffer``).
    """
    device = next(model.parameters()).device
    prompt_ids_BP, prompt_mask_BP = tokenize_prompts(tokenizer, prompts, device, pad_to_multiple_of)
    check_context_fits(model, int(prompt_mask_BP.sum(1).max()), generation_config.max_new_tokens)
    was_training = model.training
    model.eval()
    try:
        reason = decoding.unsupported_reason(model, generation_config) if compact else None
        if compact and reason is None:
            completion_ids_BT = decoding.sample(
                model, prompt_ids_BP, prompt_mask_BP, generation_config, share_prompts=prefix_sharing is not None
            )
        else:
            if reason is not None and on_fallback is not None:
                on_fallback(model, reason)
            completion_ids_BT = _model_generate(model, prompt_ids_BP, prompt_mask_BP, generation_config, prefix_sharing)
    finally:
        model.train(was_training)
    completion_mask_BT, is_truncated_B = completion_mask_from_ids(
        completion_ids_BT, eos_token_id=generation_config.eos_token_id
    )
    # After the first EOS, generate() appends whatever it pads with; make those positions pad tokens.
    completion_ids_BT = completion_ids_BT.masked_fill(completion_mask_BT == 0, tokenizer.pad_token_id)
    return GeneratedBatch(prompt_ids_BP, prompt_mask_BP, completion_ids_BT, completion_mask_BT, is_truncated_B)


@torch.no_grad()
def generate_continuous(model, tokenizer, prompts: list[str] | list[list[int]], generation_config: GenerationConfig,
                        batching_config) -> GeneratedBatch:
    """Sample one completion per prompt (a text or token ids) with transformers' continuous batching engine
    (``model.generate_batch``), which takes the prompts unpadded and stops each at EOS."""
    device = next(model.parameters()).device
    prompt_ids_BP, prompt_mask_BP = tokenize_prompts(tokenizer, prompts, device)
    check_context_fits(model, prompt_ids_BP.shape[1], generation_config.max_new_tokens)
    inputs = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids_BP, prompt_mask_BP, strict=True)]
    was_training, attention = model.training, model.config._attn_implementation
    model.eval()
    try:
        outputs = list(model.generate_batch(
            inputs, generation_config=generation_config, continuous_batching_config=batching_config, progress_bar=False,
        ).values())
    finally:
        model.train(was_training)
        if model.config._attn_implementation != attention:  # the engine's own, left behind if it failed to start
            model.set_attn_implementation(attention)
    failed = [output.error for output in outputs if output.error is not None]
    if len(outputs) != len(inputs) or failed:  # generate_batch logs its errors and returns what finished
        raise RuntimeError(
            f"transformers' continuous batching returned {len(outputs) - len(failed)} of {len(inputs)} completions"
            f"{': ' + str(failed[0]) if failed else ''} (its log above says why). Set "
            "use_transformers_continuous_batching=False to generate with generate()."
        )
    eos = generation_config.eos_token_id
    return batch_from_token_lists(
        prompt_ids_BP, prompt_mask_BP, [list(output.generated_tokens) for output in outputs], None,
        pad_token_id=tokenizer.pad_token_id, eos_token_ids=set(eos) if isinstance(eos, list) else {eos},
    )


def check_unsharded(accelerator) -> None:
    """Refuse continuous batching over parameters that FSDP or ZeRO-3 shard: its engine runs the model
    on a thread of its own, outside the collectives that gather them."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if dist.sharding(accelerator) == "fsdp" or (dist.sharding(accelerator) == "deepspeed" and plugin.zero_stage == 3):
        raise ValueError(
            "use_transformers_continuous_batching cannot generate with parameters sharded by FSDP or ZeRO-3 (its "
            "engine runs the model on a thread of its own). Set use_transformers_continuous_batching=False."
        )


class TransformersBackend:
    """The default backend: ``model.generate`` on the policy being trained (always up to date)."""

    name = "transformers"

    def __init__(self, model_fn, tokenizer, accelerator, prefix_sharing: PrefixSharing | None = None):
        self._model_fn, self.tokenizer, self.accelerator = model_fn, tokenizer, accelerator
        self.prefix_sharing = PrefixSharing() if prefix_sharing is None else prefix_sharing
        self._noted: set[str] = set()

    def generate(self, prompts: list[str] | list[list[int]], config) -> GeneratedBatch:
        check_cache_device(config.cache_implementation, self.accelerator.device)  # it may change between steps
        settings = sampling_config(
            self.tokenizer, max_new_tokens=config.max_completion_length, temperature=config.temperature,
            top_p=config.top_p, top_k=config.top_k, min_p=config.min_p,
            repetition_penalty=config.repetition_penalty, cache_implementation=config.cache_implementation,
            generation_kwargs=config.generation_kwargs,
        )
        if config.use_transformers_continuous_batching:  # its engine samples on a thread of its own
            check_unsharded(self.accelerator)
            return generate_continuous(self._model_fn(), self.tokenizer, prompts, settings,
                                       config.continuous_batching_config())
        with self.accelerator.autocast():
            return generate(
                self._model_fn(), self.tokenizer, prompts, settings,
                self.prefix_sharing if config.share_prompt_prefix else None, compact=config.compact_forward,
                on_fallback=self._note_model_generate, pad_to_multiple_of=config.pad_multiple(),
            )

    def _note_model_generate(self, model, reason: str) -> None:
        """Warn (main process, once per reason) when generation settings keep a model that the
        sampling loop can run on ``model.generate``. A model the loop cannot run is not warned
        about here: the engine names it when it is built."""
        if reason in self._noted:
            return
        self._noted.add(reason)
        if self.accelerator.is_main_process and compact_forward.unsupported_reason(model) is None:
            notices.warn(
                f"Generation runs model.generate, not grpo_lab's faster sampling loop: {reason}. The log-prob "
                "passes are not affected."
            )

    def sync_weights(self, model, version: int) -> None:
        """Nothing to do: generation uses the trained model itself."""

    def close(self) -> None:
        """Nothing to release."""
