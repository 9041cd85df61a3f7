"""transformers' ``Trainer`` methods that scripts call after ``train()`` to keep its results:
``save_state()``, ``log_metrics()`` and ``save_metrics()``, with transformers' files and formats."""

from __future__ import annotations

import json
import os
from pathlib import Path


def _write_json(path: Path, values) -> None:
    """Write ``values`` as JSON, whole or not at all (a partial file replaces nothing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(values, indent=4, sort_keys=True) + "\n")
    os.replace(partial, path)


class TrainerResults:
    """Methods of :class:`grpo_lab.trainer.trainer.GRPOTrainer`."""

    def save_state(self) -> None:
        """Write ``state`` (log history, best checkpoint, step) to ``output_dir/trainer_state.json``
        on the main process."""
        if self.accelerator.is_main_process:
            _write_json(self.output_dir / "trainer_state.json", json.loads(self._events.state_json()))

    def log_metrics(self, split: str, metrics: dict) -> None:
        """Print ``metrics`` under a ``***** split metrics *****`` heading, on the main process."""
        if not self.accelerator.is_main_process:
            return
        print(f"***** {split} metrics *****")
        width = max((len(key) for key in metrics), default=0)
        for key in sorted(metrics):
            print(f"  {key:<{width}} = {metrics[key]}")

    def save_metrics(self, split: str, metrics: dict, combined: bool = True) -> None:
        """Write ``metrics`` to ``output_dir/<split>_results.json`` and, with ``combined``, merge them
        into ``output_dir/all_results.json``, on the main process."""
        if not self.accelerator.is_main_process:
            return
        _write_json(self.output_dir / f"{split}_results.json", metrics)
        if combined:
            everything = self.output_dir / "all_results.json"
            merged = json.loads(everything.read_text()) if everything.exists() else {}
            _write_json(everything, {**merged, **metrics})
