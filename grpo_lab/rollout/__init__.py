"""Generation backends: who samples the completions of a generation batch.

A backend turns prompts (texts, or token ids) into a :class:`GeneratedBatch` and is told after every
optimizer step that the policy changed (``sync_weights``). Backends are registered by name in
:data:`BACKENDS`; three exist:

- ``transformers`` (default): ``model.generate`` on the trained model itself;
- ``vllm`` colocated (``use_vllm=True, vllm_mode="colocate"``): a vLLM engine in this process;
- ``vllm`` server (``vllm_mode="server"``): a ``grpo-lab vllm-serve`` process reached over HTTP.

vLLM backends return the log-prob each token was sampled with, which the engine turns into the
importance-sampling correction (``grpo_lab.ops.vllm_importance_weights``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from grpo_lab.rollout.batch import GeneratedBatch


class RolloutBackend(Protocol):
    name: str

    def generate(self, prompts: list[str] | list[list[int]], config) -> GeneratedBatch:
        """One completion per prompt (a text or token ids), sampled with the settings of ``config`` (a GRPOConfig)."""

    def sync_weights(self, model, version: int) -> None:
        """Generate with ``model`` (the policy after optimizer step ``version``) from now on."""

    def close(self) -> None:
        """Release the backend's resources."""


@dataclass(frozen=True)
class BackendParts:
    """What a backend is built from: ``config`` (a GRPOConfig); ``model_fn`` returns the policy to
    generate with; ``vllm_model`` is what colocated vLLM loads (a path or hub id of the base model);
    ``lora_rank`` the rank of the trained adapter (0: full weights); ``speed_paths`` the trainer's
    ``accel.SpeedPaths``, which transformers generation shares (so that a model whose cache cannot be
    shared, or a speed path that fails, is found out, and warned about, once)."""

    config: object
    model_fn: Callable
    tokenizer: object
    accelerator: object
    vllm_model: str | None
    lora_rank: int
    speed_paths: object = None


def _transformers(parts: BackendParts) -> RolloutBackend:
    from grpo_lab.rollout.hf import TransformersBackend

    return TransformersBackend(parts.model_fn, parts.tokenizer, parts.accelerator, parts.speed_paths)


def _vllm_server(parts: BackendParts) -> RolloutBackend:
    from grpo_lab.rollout.vllm_client import VLLMServerBackend

    return VLLMServerBackend(parts.config, model_fn=parts.model_fn, tokenizer=parts.tokenizer,
                             accelerator=parts.accelerator, lora_rank=parts.lora_rank)


def _vllm_colocate(parts: BackendParts) -> RolloutBackend:
    from grpo_lab.rollout.vllm_colocate import VLLMColocateBackend

    return VLLMColocateBackend(parts.config, model_fn=parts.model_fn, tokenizer=parts.tokenizer,
                               accelerator=parts.accelerator, vllm_model=parts.vllm_model, lora_rank=parts.lora_rank)


BACKENDS: dict[str, Callable[[BackendParts], RolloutBackend]] = {
    "transformers": _transformers,
    "vllm-colocate": _vllm_colocate,
    "vllm-server": _vllm_server,
}
"""Generation backends by name. A new backend is a class with :class:`RolloutBackend`'s methods, a
factory of :class:`BackendParts` added here, and the configs that pick it in :func:`backend_name`."""


def backend_name(config) -> str:
    """The backend ``config`` picks with TRL's fields: ``use_vllm`` and ``vllm_mode``."""
    if not config.use_vllm:
        return "transformers"
    return "vllm-server" if config.vllm_mode == "server" else "vllm-colocate"


def make_backend(
    config, *, model_fn, tokenizer, accelerator, vllm_model: str | None, lora_rank: int, speed_paths=None
) -> RolloutBackend:
    """The backend ``config`` asks for, built from the given parts (see :class:`BackendParts`)."""
    parts = BackendParts(config, model_fn, tokenizer, accelerator, vllm_model, lora_rank, speed_paths)
    return BACKENDS[backend_name(config)](parts)


__all__ = ["BACKENDS", "BackendParts", "GeneratedBatch", "RolloutBackend", "backend_name", "make_backend"]
