"""One transformers forward call of a causal LM over ``[prompt, completion]`` rows, as every forward
path (``grpo_lab.core.policy_forward`` and the speed paths of ``grpo_lab.accel``) makes it.

Shapes: B completions, P prompt tokens (left padded), T completion tokens (right padded), L = P + T,
V vocabulary entries.
"""

from __future__ import annotations

import torch


def position_ids(attention_mask_BL: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as ``generate()`` assigns them: ``cumsum(mask) - 1``, >= 0."""
    return (attention_mask_BL.cumsum(dim=1) - 1).clamp(min=0)


def full_forward(model, prompt_ids_BP, prompt_mask_BP, completion_ids_BT, completion_mask_BT, **kwargs):
    """The model's output for one pass over ``[prompt, completion]``, its logits kept at the
    completion's positions and the one before (``kwargs`` go to the model: a vision-language model's
    image inputs among them)."""
    input_ids = torch.cat([prompt_ids_BP, completion_ids_BT], dim=1)
    attention_mask = torch.cat([prompt_mask_BP, completion_mask_BT], dim=1)
    positions = {} if derives_positions(model) else {"position_ids": position_ids(attention_mask)}
    return model(
        input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=completion_ids_BT.shape[1] + 1,
        use_cache=False, **positions, **kwargs,
    )


def full_logits(model, prompt_ids_BP, prompt_mask_BP, completion_ids_BT, completion_mask_BT,
                model_inputs: dict | None = None) -> torch.Tensor:
    """(B, T, V) logits predicting each completion token, from one pass over ``[prompt, completion]``
    (with a vision-language model's ``model_inputs``)."""
    args = (model, prompt_ids_BP, prompt_mask_BP, completion_ids_BT, completion_mask_BT)
    return full_forward(*args, **without_router_loss(model), **(model_inputs or {})).logits[:, :-1, :]


def derives_positions(model) -> bool:
    """Whether the model derives its token positions from the images' layout itself (multimodal rotary
    positions, as Qwen2-VL's family does, from the attention mask and the image grids): it is given
    no 1-D positions, which would override them."""
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("rope_parameters", "rope_scaling"):
        rope = getattr(text_config, name, None)
        if isinstance(rope, dict) and "mrope_section" in rope:
            return True
    return False


def without_router_loss(model) -> dict:
    """``output_router_logits=False`` for a mixture-of-experts model whose config turns it on: such a
    model computes its load-balancing loss in every call, against the call's attention mask, which
    a call that continues a cache does not match."""
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return {"output_router_logits": False} if getattr(text_config, "output_router_logits", False) else {}
