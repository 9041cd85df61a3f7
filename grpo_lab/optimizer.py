"""The optimizer grpo_lab builds when ``optimizers=`` gives none, by ``optim``'s transformers name."""

from __future__ import annotations

import torch

TORCH_ADAMW = ("adamw_torch_fused", "adamw_torch")
"""The names built here as torch's AdamW (fused for the first)."""


def optimizer_for(policy, config) -> torch.optim.Optimizer:
    """``config.optim`` over the trainable parameters of ``policy``, with ``learning_rate``, the Adam
    betas and epsilon and ``weight_decay``. adamw_torch_fused and adamw_torch are torch's AdamW; any
    other of transformers' names (``paged_adamw_8bit``, ``adafactor``, ``sgd``, ...) is built as
    transformers' Trainer builds it (``Trainer.get_optimizer_cls_and_kwargs``), as TRL's trainer does,
    except that ``weight_decay`` applies to every trainable parameter here (transformers leaves biases
    and norms out)."""
    trainable = [parameter for parameter in policy.parameters() if parameter.requires_grad]
    if config.optim in TORCH_ADAMW:
        return torch.optim.AdamW(trainable, lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2),
                                 eps=config.adam_epsilon, weight_decay=config.weight_decay,
                                 fused=config.optim == "adamw_torch_fused")
    from transformers import Trainer

    optimizer_class, kwargs = Trainer.get_optimizer_cls_and_kwargs(config, policy)
    return optimizer_class([{"params": trainable, "weight_decay": config.weight_decay}], **kwargs)
