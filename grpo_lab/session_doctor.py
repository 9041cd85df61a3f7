"""GRPOSession's doctor: ``doctor()``, a preflight probe that says why a run would not learn, and the
live rules read after every optimizer step (see :mod:`grpo_lab.doctor` for the probe and its rules,
:mod:`grpo_lab.doctor.live` for the live ones, docs/troubleshooting.md for every finding)."""

from __future__ import annotations

from grpo_lab.doctor import Finding, Findings
from grpo_lab.doctor.live import LiveWatch
from grpo_lab.doctor.probe import diagnose
from grpo_lab.doctor.thresholds import resolve
from grpo_lab.stages import drives_stages


class SessionDoctor:
    """GRPOSession's doctor."""

    _findings: Findings | None = None
    _live_findings: list[Finding] | None = None
    _live_watch: LiveWatch | None = None

    @drives_stages
    def doctor(self) -> Findings:
        """Run one probe generation batch through generate, score, advantages and one loss pass (no
        update), and return what in it would keep the run from learning: truncated completions,
        reward functions that give no signal, prompt groups too easy or too hard, a chat template or
        EOS token that is wrong, compute spent on zero advantages, a memory shortfall, a vLLM
        log-prob gap; and what the loss will show (``Findings``, most severe first; each with its
        cause, evidence and fix). The rules compare with the thresholds of
        ``config.doctor_thresholds`` (their defaults: docs/troubleshooting.md, "Thresholds").

        The session is left as it was: weights, gradients, optimizer, random states, the sampler's
        position, a half-used batch (and a pending loss()), history and config. Config edits made
        since the last stage are applied first, as the next stage would. With no batch held, the
        probe is the batch the next ``generate()`` will draw. The result is kept in ``findings``.
        Collective: under several processes every process must call it (its stages gather).
        """
        self._sync_config()
        self._findings = diagnose(self.engine)
        return self._findings

    @property
    def findings(self) -> Findings:
        """The last ``doctor()``'s findings and every live finding raised since the session was built
        (each with the step in its evidence), most severe first; a later ``doctor()`` replaces its
        own part only. Empty before either; ``doctor()``'s very result while no live finding is raised."""
        if not self._live_findings:
            return Findings() if self._findings is None else self._findings
        return Findings([*(self._findings or []), *self._live_findings])

    def _diagnose_step(self) -> list[Finding]:
        """Read the live rules over the history after an optimizer step, under the thresholds of
        ``config.doctor_thresholds`` as it stands (an edit applies from the next step); keep and announce
        (event ``"finding"``, one per finding) those the rate limit lets through, and return them."""
        if self._live_watch is None:
            self._live_watch, self._live_findings = LiveWatch(), []
        new = self._live_watch.new_findings(self._history, beta=self.config.beta,
                                            max_completion_length=self.config.max_completion_length,
                                            thresholds=resolve(self.config.doctor_thresholds))
        self._live_findings.extend(new)
        for finding in new:
            self._notify("finding", finding)
        return new

    @property
    def live_findings(self) -> list[Finding]:
        """The live findings raised since the session was built, in the order raised (those of steps an
        ``undo()`` took back are gone; a checkpoint keeps them)."""
        return list(self._live_findings or [])

    def _doctor_records(self) -> dict:
        """The findings and the live rate limit as plain values, for state dicts and checkpoints."""
        return {
            "doctor": None if self._findings is None else [finding.to_dict() for finding in self._findings],
            "live": [finding.to_dict() for finding in self._live_findings or []],
            "raises": [list(entry) for entry in (self._live_watch.raises if self._live_watch else [])],
        }

    def _load_doctor_records(self, records: dict | None) -> None:
        """Return the findings to ``records`` (:meth:`_doctor_records`; None, from a state saved before
        findings were kept: none); live findings of steps past the history's last are dropped, as are
        their raises (the steps after an undo, or after the checkpoint a run resumed from)."""
        records = records or {"doctor": None, "live": [], "raises": []}
        step = self._history[-1]["step"] if self._history else 0
        self._findings = None if records["doctor"] is None else Findings(map(Finding.from_dict, records["doctor"]))
        self._live_findings = [finding for finding in map(Finding.from_dict, records["live"])
                               if finding.evidence.get("step", 0) <= step]
        self._live_watch = LiveWatch(records["raises"]).before(step)
