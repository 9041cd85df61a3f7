"""Prompts as left-padded token tensors, the form every generation backend starts from.

Left padding makes every prompt end where its completion starts. Both the transformers backend
(``hf``) and the token-list helpers for inference engines (``batch``) build on these two functions.
"""

from __future__ import annotations

import torch


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
