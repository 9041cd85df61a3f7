"""What a session has done: the history rows, evaluations, completion log and config edits, and the
last stage it ran. A session's ``history``, ``evaluations``, ``completions_log`` and
``config_changes`` are views of it; checkpoints, undo points and forks keep its ``state_dict()``.

Rows are appended and never changed once appended, so a copy of the lists (not of the rows) is a
copy of the record (what an undo point keeps each step).
"""

from __future__ import annotations


class RunRecord:
    """The records of one run (see the module docstring). ``applied_config``: the config as the
    stages last ran with it (``GRPOConfig.to_dict()``), against which edits are found."""

    def __init__(self, applied_config: dict):
        self.history: list[dict] = []  # one row per optimizer step
        self.evaluations: list[dict] = []  # one row per evaluate()
        self.completion_log: list[dict[str, list]] = []  # columns of each batch's completions, as first trained
        self.config_changes: list[dict] = []  # {"step", "field", "old", "new"}, the step the edit took effect at
        self.applied_config = applied_config
        self.last_stage: str | None = None
        self.stages_run = 0  # stages completed, so that an edit no stage used can be replaced in config_changes
        self._unused_changes: dict[str, tuple[dict, int]] = {}  # field -> (its last change, stages_run then)

    def stage_done(self, stage: str) -> None:
        self.last_stage = stage
        self.stages_run += 1

    def record_change(self, name: str, old, new, step: int) -> None:
        """Add an edit taking effect at ``step`` to ``config_changes``, or, where no stage has run
        since the field's last change (the stage that would have used it failed, or none was
        called), replace that change: the record holds the values stages ran with."""
        earlier, stages = self._unused_changes.get(name, (None, -1))
        if earlier is not None and stages == self.stages_run and earlier in self.config_changes:
            self.config_changes.remove(earlier)
            old = earlier["old"]
        if old == new:
            self._unused_changes.pop(name, None)
            return
        change = {"step": step, "field": name, "old": old, "new": new}
        self.config_changes.append(change)
        self._unused_changes[name] = (change, self.stages_run)

    @property
    def last_step(self) -> int:
        """The optimizer step of the last history row (0 before the first)."""
        return self.history[-1]["step"] if self.history else 0

    def state_dict(self) -> dict:
        """The records themselves (not copies: the caller copies, see the module docstring)."""
        return {"history": self.history, "evaluations": self.evaluations, "completion_log": self.completion_log,
                "config_changes": self.config_changes, "applied_config": self.applied_config,
                "last_stage": self.last_stage}

    def load_state_dict(self, state: dict) -> None:
        """Take the records of ``state`` (:meth:`state_dict`'s keys; ``evaluations`` is absent from a
        state made before they were kept)."""
        self.history, self.completion_log = state["history"], state["completion_log"]
        self.evaluations = state.get("evaluations", [])
        self.config_changes, self.applied_config = state["config_changes"], state["applied_config"]
        self.last_stage = state["last_stage"]
