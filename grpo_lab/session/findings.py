"""A session's findings: the last ``doctor()`` (a preflight probe that says why a run would not
learn) and the live rules read after every optimizer step (see :mod:`grpo_lab.doctor` for the probe
and its rules, :mod:`grpo_lab.doctor.live` for the live ones, docs/troubleshooting.md for every
finding)."""

from __future__ import annotations

from grpo_lab.doctor import Finding, Findings
from grpo_lab.doctor.live import LiveWatch
from grpo_lab.doctor.thresholds import resolve


class FindingsRecord:
    """The findings a session keeps: ``preflight`` (the last ``doctor()``'s, or None), the live ones
    raised since it was built, and the live rules' rate limit."""

    def __init__(self):
        self.preflight: Findings | None = None
        self.live: list[Finding] = []  # in the order raised
        self._watch = LiveWatch()

    def all(self) -> Findings:
        """The preflight findings and every live one, most severe first; the preflight result itself
        while no live finding is raised."""
        if not self.live:
            return Findings() if self.preflight is None else self.preflight
        return Findings([*(self.preflight or []), *self.live])

    def read_step(self, history: list[dict], config) -> list[Finding]:
        """Read the live rules over the history after an optimizer step, under the thresholds of
        ``config.doctor_thresholds`` as it stands (an edit applies from the next step); keep and
        return those the rate limit lets through."""
        new = self._watch.new_findings(history, beta=config.beta, max_completion_length=config.max_completion_length,
                                       thresholds=resolve(config.doctor_thresholds))
        self.live.extend(new)
        return new

    def state_dict(self) -> dict:
        """The findings and the live rate limit as plain values, for state dicts and checkpoints."""
        return {
            "doctor": None if self.preflight is None else [finding.to_dict() for finding in self.preflight],
            "live": [finding.to_dict() for finding in self.live],
            "raises": [list(entry) for entry in self._watch.raises],
        }

    def load_state_dict(self, state: dict | None, last_step: int) -> None:
        """Return to ``state`` (:meth:`state_dict`; None, from a state saved before findings were kept:
        none); live findings of steps past ``last_step``, the history's last, are dropped, as are their
        raises (the steps after an undo, or after the checkpoint a run resumed from)."""
        state = state or {"doctor": None, "live": [], "raises": []}
        self.preflight = None if state["doctor"] is None else Findings(map(Finding.from_dict, state["doctor"]))
        self.live = [finding for finding in map(Finding.from_dict, state["live"])
                     if finding.evidence.get("step", 0) <= last_step]
        self._watch = LiveWatch(state["raises"]).before(last_step)
