"""What a generation backend returns: token tensors of one generation call."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_lab.rollout.prompt_tokens import tokenize_prompts


@dataclass
class GeneratedBatch:
    """B completions, P prompt tokens (left padded), T completion tokens (right padded).

    ``sampling_logprobs_BT`` holds the log-probs the inference engine sampled each token with (vLLM;
    None for transformers, which samples from the trained model itself), and ``policy_version`` the
    optimizer step of the weights or adapter that generated the batch (None when always current).
    """

    prompt_ids_BP: torch.Tensor
    prompt_mask_BP: torch.Tensor
    completion_ids_BT: torch.Tensor
    completion_mask_BT: torch.Tensor
    is_truncated_B: torch.Tensor
    sampling_logprobs_BT: torch.Tensor | None = None
    policy_version: int | None = None
    image_inputs_B: list | None = None
    """For a vision-language model: each prompt's image inputs
    (:class:`grpo_lab.rollout.vision.ImageInputs`); None for text."""


def padded_to_multiple(batch: GeneratedBatch, env_mask_BT: torch.Tensor | None, multiple: int | None, *,
                       pad_token_id: int) -> tuple[GeneratedBatch, torch.Tensor | None]:
    """``batch`` (and a rollout function's ``env_mask_BT``) with the prompts padded on the left and the
    completions on the right to widths that are multiples of ``multiple`` (``pad_to_multiple_of``)."""
    if not multiple:
        return batch, env_mask_BT

    def pad(tensor_BL, value, left: bool):
        if tensor_BL is None:
            return None
        extra = -tensor_BL.shape[1] % multiple
        return torch.nn.functional.pad(tensor_BL, (extra, 0) if left else (0, extra), value=value)

    padded = GeneratedBatch(
        pad(batch.prompt_ids_BP, pad_token_id, True), pad(batch.prompt_mask_BP, 0, True),
        pad(batch.completion_ids_BT, pad_token_id, False), pad(batch.completion_mask_BT, 0, False),
        batch.is_truncated_B, pad(batch.sampling_logprobs_BT, 0.0, False), batch.policy_version,
        batch.image_inputs_B,
    )
    return padded, pad(env_mask_BT, 0, False)


def batch_from_token_lists(
    prompt_ids_BP: torch.Tensor,
    prompt_mask_BP: torch.Tensor,
    completions: list[list[int]],
    logprobs: list[list[float]] | None,
    *,
    pad_token_id: int,
    eos_token_ids: set[int],
    policy_version: int | None = None,
) -> GeneratedBatch:
    """A padded batch from completions given as token lists (an inference engine's output), every
    tensor on the device of the prompt tensors.

    Every token the engine returned counts (engines stop at EOS, which is kept); a completion whose
    last token is not an EOS is truncated, as in the transformers backend.
    """
    size = max(1, max((len(ids) for ids in completions), default=0))
    ids_BT = torch.full((len(completions), size), pad_token_id, dtype=torch.long)
    mask_BT = torch.zeros((len(completions), size), dtype=torch.long)
    logprobs_BT = torch.zeros((len(completions), size), dtype=torch.float32) if logprobs is not None else None
    for row, ids in enumerate(completions):
        ids_BT[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        mask_BT[row, :len(ids)] = 1
        if logprobs_BT is not None:
            logprobs_BT[row, :len(ids)] = torch.tensor(logprobs[row], dtype=torch.float32)
    is_truncated_B = torch.tensor([not ids or ids[-1] not in eos_token_ids for ids in completions])
    device = prompt_ids_BP.device
    return GeneratedBatch(
        prompt_ids_BP, prompt_mask_BP, ids_BT.to(device), mask_BT.to(device), is_truncated_B.to(device),
        None if logprobs_BT is None else logprobs_BT.to(device), policy_version,
    )


def prompt_token_lists(tokenizer, prompts: list[str] | list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Left-padded prompt tensors (as the trainer sees them) and the unpadded token lists an
    inference engine is given, so that both sides condition on exactly the same tokens."""
    prompt_ids_BP, prompt_mask_BP = tokenize_prompts(tokenizer, prompts, "cpu")
    lists = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids_BP, prompt_mask_BP, strict=True)]
    return prompt_ids_BP, prompt_mask_BP, lists


def draw_seeds(count: int) -> list[int]:
    """Distinct per-request sampling seeds drawn from torch's generator: an engine's samples then
    follow the trainer's seed (reproducible runs, exact resume) while every completion differs."""
    base = int(torch.randint(0, 2**31 - 1 - count, (1,)))
    return [base + i for i in range(count)]


def eos_token_ids(tokenizer, model=None) -> set[int]:
    """Token ids that end a completion: the tokenizer's EOS and the model's generation config EOS."""
    ids = {tokenizer.eos_token_id}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    return {i for i in ids if i is not None}
