"""The files transformers' and TRL's trainers write beside a saved model: ``training_args.bin`` (the
run's config, pickled with ``torch.save``, as ``Trainer.save_model`` writes its ``TrainingArguments``)
and a model card, ``README.md`` (TRL writes one with every checkpoint of a run)."""

from __future__ import annotations

from pathlib import Path

CARD = """---
{front_matter}
---

# Model card

This model{base} was trained with GRPO (Group Relative Policy Optimization, introduced in
[DeepSeekMath](https://huggingface.co/papers/2402.03300)) by grpo_lab's `GRPOTrainer`, which follows
TRL's `GRPOTrainer`.

## Framework versions

{versions}
"""


def write_training_files(directory: Path, config, base_model: str | None) -> None:
    """``training_args.bin`` and ``README.md`` in ``directory`` (a saved model's folder)."""
    import copy
    import importlib.metadata

    import torch
    import yaml

    shared = copy.copy(config)  # the run's own config keeps its credentials
    for name, value in config.shareable_dict().items():
        setattr(shared, name, value)
    torch.save(shared, directory / "training_args.bin")
    front = {"library_name": "transformers", "tags": ["generated_from_trainer", "grpo", "grpo_lab"]}
    if base_model and not Path(base_model).is_dir():  # a hub id, as TRL names the base model
        front["base_model"] = base_model
    versions = "\n".join(f"- {name}: {importlib.metadata.version(name)}"
                         for name in ("grpo_lab", "transformers", "torch", "datasets"))
    base = f", a fine-tuned version of [{base_model}](https://huggingface.co/{base_model})," if "base_model" in front \
        else ""
    card = CARD.format(front_matter=yaml.safe_dump(front, sort_keys=False).strip(), base=base, versions=versions)
    (directory / "README.md").write_text(card)
