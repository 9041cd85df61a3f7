"""Which prompts each generation batch uses: seeded shuffling, epochs, resumable position.

Every process draws the same global sequence of prompts (the seed does not depend on the process),
then keeps its own slice of the repeated batch. A generation batch never spans two epochs: the last
prompts of an epoch that do not fill a batch are skipped, like a data loader with ``drop_last``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PromptSampler:
    """Yields lists of dataset indices, ``prompts_per_batch`` unique prompts at a time."""

    dataset_size: int
    prompts_per_batch: int
    seed: int
    shuffle: bool = True
    epoch: int = 0
    position: int = 0

    def __post_init__(self) -> None:
        if self.dataset_size < self.prompts_per_batch:
            raise ValueError(
                f"The training dataset has {self.dataset_size} prompts but one generation batch needs "
                f"{self.prompts_per_batch} distinct prompts (generation_batch_size / num_generations). "
                "Add prompts, or lower per_device_train_batch_size / steps_per_generation."
            )

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.dataset_size))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.dataset_size, generator=generator).tolist()

    def next_indices(self) -> list[int]:
        if self.position + self.prompts_per_batch > self.dataset_size:
            self.epoch, self.position = self.epoch + 1, 0
        indices = self._order()[self.position:self.position + self.prompts_per_batch]
        self.position += self.prompts_per_batch
        return indices

    @property
    def next_draw_starts_epoch(self) -> bool:
        """Whether the next batch comes from a new epoch (this one has no full batch left)."""
        return self.position + self.prompts_per_batch > self.dataset_size

    @property
    def epoch_progress(self) -> float:
        """Epochs completed, fractional (TRL's ``epoch`` metric)."""
        return self.epoch + self.position / self.dataset_size

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
