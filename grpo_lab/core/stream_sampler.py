"""Prompts drawn from a streaming ``datasets.IterableDataset``, in stream order, resumably.

:class:`StreamSampler` has :class:`grpo_lab.core.sampler.PromptSampler`'s interface. A stream has no
length and no random access, so it is read in order, ``prompts_per_batch`` rows a batch, and the
rows of the current batch are kept for the engine to read. Its position (epoch, rows read in that
epoch) is all a checkpoint needs: a resumed run reads past that many rows of the same stream. When
the stream ends, a new epoch starts from its beginning (``set_epoch`` reshuffles a shuffled
stream) and the rows that did not fill a batch are dropped, as a map-style dataset's are. Every
process reads the whole stream, so all draw the same batches.
"""

from __future__ import annotations

import itertools


def is_stream(dataset) -> bool:
    """Whether ``dataset`` is a ``datasets.IterableDataset`` (streamed: no length, no indexing)."""
    from datasets import IterableDataset

    return isinstance(dataset, IterableDataset)


def first_row(dataset) -> dict:
    """The first row of a stream, or None for an empty one."""
    return next(iter(dataset), None)


class StreamSampler:
    """Yields ``prompts_per_batch`` rows of a stream at a time (as indices into :attr:`rows`)."""

    dataset_size = None

    def __init__(self, dataset, prompts_per_batch: int):
        self.dataset, self.prompts_per_batch = dataset, prompts_per_batch
        self.epoch = self.position = 0
        self.rows: list[dict] = []
        self._iterator = None

    def _stream(self):
        # islice, not IterableDataset.skip: skip() returns a stream without the shuffling and epoch
        # set on this one, so a shuffled stream would resume in its first epoch's order
        self.dataset.set_epoch(self.epoch)
        return itertools.islice(iter(self.dataset), self.position, None)

    def next_indices(self) -> list[int]:
        rows: list[dict] = []
        while len(rows) < self.prompts_per_batch:
            if self._iterator is None:
                self._iterator = self._stream()
            row = next(self._iterator, None)
            if row is not None:
                rows.append(row)
                self.position += 1
                continue
            if self.position == len(rows):  # a whole epoch read without filling one batch
                raise ValueError(
                    f"The training stream holds {self.position} prompts but one generation batch needs "
                    f"{self.prompts_per_batch} distinct prompts (generation_batch_size / num_generations). Add "
                    "prompts, or lower per_device_train_batch_size / steps_per_generation."
                )
            self.epoch, self.position, self._iterator, rows = self.epoch + 1, 0, None, []
        self.rows = rows
        return list(range(len(rows)))

    def rows_at(self, indices: list[int]) -> dict[str, list]:
        """Columns of the current batch's rows ``indices``."""
        names = list(self.rows[0]) if self.rows else []
        return {name: [self.rows[i][name] for i in indices] for name in names}

    @property
    def next_draw_starts_epoch(self) -> bool:
        """A stream's end shows only when it is read: its epochs end within a draw."""
        return False

    @property
    def epoch_progress(self) -> float:
        """Passes over the stream completed (its length is unknown, so no fraction of one)."""
        return float(self.epoch)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._iterator = None  # read again from the saved position
