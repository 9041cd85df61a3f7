"""Generation backends: who samples the completions of a generation batch.

A backend turns prompts (texts, or token ids) into a :class:`GeneratedBatch` and is told after every
optimizer step that the policy changed (``sync_weights``). Three exist:

- ``transformers`` (default): ``model.generate`` on the trained model itself;
- ``vllm`` colocated (``use_vllm=True, vllm_mode="colocate"``): a vLLM engine in this process;
- ``vllm`` server (``vllm_mode="server"``): a ``grpo-lab vllm-serve`` process reached over HTTP.

vLLM backends return the log-prob each token was sampled with, which the engine turns into the
importance-sampling correction (``grpo_lab.ops.vllm_importance_weights``).
"""

from __future__ import annotations

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


def make_backend(
    config, *, model_fn, tokenizer, accelerator, vllm_model: str | None, lora_rank: int, prefix_sharing=None
) -> RolloutBackend:
    """The backend ``config`` asks for. ``vllm_model`` is what colocated vLLM loads (a path or hub
    id of the base model); ``lora_rank`` the rank of the trained adapter (0: full weights);
    ``prefix_sharing`` the trainer's ``PrefixSharing``, which transformers generation shares (so
    that a model whose cache cannot be shared is found out, and warned about, once)."""
    if not config.use_vllm:
        from grpo_lab.rollout.hf import TransformersBackend

        return TransformersBackend(model_fn, tokenizer, accelerator, prefix_sharing)
    if config.vllm_mode == "server":
        from grpo_lab.rollout.vllm_client import VLLMServerBackend

        return VLLMServerBackend(config, model_fn=model_fn, tokenizer=tokenizer, accelerator=accelerator, lora_rank=lora_rank)
    from grpo_lab.rollout.vllm_colocate import VLLMColocateBackend

    return VLLMColocateBackend(
        config, model_fn=model_fn, tokenizer=tokenizer, accelerator=accelerator, vllm_model=vllm_model, lora_rank=lora_rank
    )


__all__ = ["GeneratedBatch", "RolloutBackend", "make_backend"]
