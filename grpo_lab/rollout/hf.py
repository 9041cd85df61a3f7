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

from grpo_lab import notices
from grpo_lab.accel import TRANSFORMERS_CHANGED, SpeedPaths
from grpo_lab.parallel.layout import layout_for
from grpo_lab.core.models import CACHE
from grpo_lab.ops.masks import completion_mask_from_ids
from grpo_lab.rollout.batch import GeneratedBatch, batch_from_token_lists
from grpo_lab.rollout import vision
from grpo_lab.rollout.prompt_tokens import tokenize_prompts


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


def _shared_prompt_cache(model, prompt_ids_BP, prompt_mask_BP, generation_config, prefix_sharing,
                         speed_paths: SpeedPaths):
    """A cache of the distinct prompts for ``model.generate`` to continue, taking each decoding step's
    keys and values in place (``accel.kv_buffer``); None where it cannot be shared."""
    if prefix_sharing is None or not _reuses_a_given_cache(model, generation_config):
        return None
    try:
        cache = prefix_sharing.prompt_cache(model, prompt_ids_BP, prompt_mask_BP)
    except TRANSFORMERS_CHANGED as error:
        speed_paths.turn_off("prefix_sharing", error)
        return None
    kv_buffer = None if cache is None else speed_paths.module("kv_buffer")
    if kv_buffer is not None:
        try:
            kv_buffer.buffer_cache(cache, new_tokens=generation_config.max_new_tokens)
        except TRANSFORMERS_CHANGED as error:  # the layers not yet replaced concatenate, as transformers' own do
            speed_paths.turn_off("kv_buffer", error)
    return cache


def _model_generate(model, tokenizer, prompt_ids_BP, prompt_mask_BP, generation_config, prefix_sharing,
                    speed_paths: SpeedPaths, model_inputs: dict | None = None) -> torch.Tensor:
    """(B, T) completion tokens from ``model.generate``, continuing a shared prompt cache where it can;
    the tokenizer goes along where ``stop_strings`` needs it to match text. ``model_inputs``: a
    vision-language model's image inputs."""
    cache = _shared_prompt_cache(model, prompt_ids_BP, prompt_mask_BP, generation_config, prefix_sharing, speed_paths)
    sequences = model.generate(
        input_ids=prompt_ids_BP, attention_mask=prompt_mask_BP, generation_config=generation_config,
        **({} if cache is None else {CACHE: cache}),
        **({"tokenizer": tokenizer} if generation_config.stop_strings else {}),
        **(model_inputs or {}),
    )
    return sequences[:, prompt_ids_BP.shape[1]:]


def _loop_sample(model, prompt_ids_BP, prompt_mask_BP, generation_config, *, share_prompts: bool,
                 speed_paths: SpeedPaths, on_fallback) -> torch.Tensor | None:
    """(B, T) completion tokens from grpo_lab's sampling loop (``accel.decoding``); None where the
    model or settings keep generation on ``model.generate`` (after ``on_fallback(model, reason)``), or
    where the loop does not work with this transformers (turned off for the run)."""
    decoding = speed_paths.module("decoding")
    if decoding is None:
        return None
    try:
        reason = decoding.unsupported_reason(model, generation_config)
        if reason is None:
            return decoding.sample(model, prompt_ids_BP, prompt_mask_BP, generation_config, share_prompts=share_prompts)
    except TRANSFORMERS_CHANGED as error:
        speed_paths.turn_off("decoding", error)
        return None
    if on_fallback is not None:
        on_fallback(model, reason)
    return None


@torch.no_grad()
def generate(
    model, tokenizer, prompts: list[str] | list[list[int]], generation_config: GenerationConfig,
    prefix_sharing=None, *, compact: bool = False, on_fallback: Callable[[Any, str], None] | None = None,
    pad_to_multiple_of: int | None = None, speed_paths: SpeedPaths | None = None, image_inputs: list | None = None,
) -> GeneratedBatch:
    """Sample one completion per prompt, a text or token ids (repeat a prompt to get several).

    ``image_inputs``: for a vision-language model, each prompt's (token ids) image inputs
    (:class:`grpo_lab.rollout.vision.ImageInputs`), given to ``model.generate``; the speed paths
    (``compact``, ``prefix_sharing``) do not take images and are not used then.

    With ``compact``, grpo_lab's own loop samples (``accel.decoding``) where the model and settings
    allow it, else ``model.generate``, after a call of ``on_fallback(model, reason)``. With
    ``prefix_sharing`` (an ``accel.prefix_sharing.PrefixSharing``), a repeated prompt is pre-filled
    once and its keys and values reused by its copies (for ``model.generate``, a cache that then
    takes each decoding step's keys and values in place: ``accel.kv_buffer``). ``speed_paths``: the
    run's, which imports those paths and turns off one that fails (a fresh one where None).
    """
    speed_paths = SpeedPaths() if speed_paths is None else speed_paths
    device = next(model.parameters()).device
    prompt_ids_BP, prompt_mask_BP = tokenize_prompts(tokenizer, prompts, device, pad_to_multiple_of)
    check_context_fits(model, int(prompt_mask_BP.sum(1).max()), generation_config.max_new_tokens)
    model_inputs = None
    if image_inputs is not None:
        model_inputs = vision.model_inputs(image_inputs, prompt_mask_BP, dtype=floating_dtype(model))
        compact, prefix_sharing = False, None
    was_training = model.training
    model.eval()
    try:
        completion_ids_BT = None if not compact else _loop_sample(
            model, prompt_ids_BP, prompt_mask_BP, generation_config, share_prompts=prefix_sharing is not None,
            speed_paths=speed_paths, on_fallback=on_fallback,
        )
        if completion_ids_BT is None:
            completion_ids_BT = _model_generate(
                model, tokenizer, prompt_ids_BP, prompt_mask_BP, generation_config, prefix_sharing, speed_paths,
                model_inputs,
            )
    finally:
        model.train(was_training)
    completion_mask_BT, is_truncated_B = completion_mask_from_ids(
        completion_ids_BT, eos_token_id=generation_config.eos_token_id
    )
    # After the first EOS, generate() appends whatever it pads with; make those positions pad tokens.
    completion_ids_BT = completion_ids_BT.masked_fill(completion_mask_BT == 0, tokenizer.pad_token_id)
    return GeneratedBatch(prompt_ids_BP, prompt_mask_BP, completion_ids_BT, completion_mask_BT, is_truncated_B,
                          image_inputs_B=image_inputs)


def floating_dtype(model) -> torch.dtype | None:
    """The dtype of ``model``'s floating-point weights (what its image inputs are cast to), or None."""
    dtype = getattr(model, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


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


def check_takes_images(config) -> None:
    """Refuse generation settings that cannot take a vision-language model's images."""
    if config.use_transformers_continuous_batching:
        raise ValueError(
            "use_transformers_continuous_batching does not take images (as in TRL): its engine schedules token ids "
            "alone. Set use_transformers_continuous_batching=False to train a vision-language model."
        )


def check_unsharded(accelerator) -> None:
    """Refuse continuous batching over parameters that FSDP or ZeRO-3 shard: its engine runs the model
    on a thread of its own, outside the collectives that gather them."""
    if layout_for(accelerator).shards_parameters:
        raise ValueError(
            "use_transformers_continuous_batching cannot generate with parameters sharded by FSDP or ZeRO-3 (its "
            "engine runs the model on a thread of its own). Set use_transformers_continuous_batching=False."
        )


class TransformersBackend:
    """The default backend: ``model.generate`` on the policy being trained (always up to date)."""

    name = "transformers"

    def __init__(self, model_fn, tokenizer, accelerator, speed_paths: SpeedPaths | None = None):
        self._model_fn, self.tokenizer, self.accelerator = model_fn, tokenizer, accelerator
        self.speed_paths = SpeedPaths() if speed_paths is None else speed_paths
        self._noted: set[str] = set()

    def generate(self, prompts: list[str] | list[list[int]], config,
                 image_inputs: list | None = None) -> GeneratedBatch:
        """One completion per prompt (texts, or token ids with a vision-language model's
        ``image_inputs``), sampled with ``config``'s settings."""
        check_cache_device(config.cache_implementation, self.accelerator.device)  # it may change between steps
        generation_kwargs = config.generation_kwargs
        if image_inputs is not None:
            check_takes_images(config)  # the build refused it; a live edit may have turned it on since
            image_token = vision.image_token_id(self._model_fn())
            if image_token is not None:  # as TRL: a sampled image token would not match the image features
                given = dict(generation_kwargs or {})
                others = [token for token in given.get("suppress_tokens") or [] if token != image_token]
                generation_kwargs = {**given, "suppress_tokens": [image_token, *others]}
        settings = sampling_config(
            self.tokenizer, max_new_tokens=config.max_completion_length, temperature=config.temperature,
            top_p=config.top_p, top_k=config.top_k, min_p=config.min_p,
            repetition_penalty=config.repetition_penalty, cache_implementation=config.cache_implementation,
            generation_kwargs=generation_kwargs,
        )
        if config.use_transformers_continuous_batching:  # its engine samples on a thread of its own
            check_unsharded(self.accelerator)
            return generate_continuous(self._model_fn(), self.tokenizer, prompts, settings,
                                       config.continuous_batching_config())
        with self.accelerator.autocast():
            return generate(
                self._model_fn(), self.tokenizer, prompts, settings,
                self.speed_paths.prefix_sharing() if config.share_prompt_prefix else None,
                compact=config.compact_forward, on_fallback=self._note_model_generate,
                pad_to_multiple_of=config.pad_multiple(), speed_paths=self.speed_paths, image_inputs=image_inputs,
            )

    def _note_model_generate(self, model, reason: str) -> None:
        """Warn (main process, once per reason) when generation settings keep a model that the
        sampling loop can run on ``model.generate``. A model the loop cannot run is not warned
        about here: the engine names it when it is built."""
        if reason in self._noted:
            return
        self._noted.add(reason)
        if self.accelerator.is_main_process and self.speed_paths.compact_reason(model) is None:
            notices.warn(
                f"Generation runs model.generate, not grpo_lab's faster sampling loop: {reason}. The log-prob "
                "passes are not affected."
            )

    def sync_weights(self, model, version: int) -> None:
        """Nothing to do: generation uses the trained model itself."""

    def close(self) -> None:
        """Nothing to release."""
