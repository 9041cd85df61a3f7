"""The trainer's side of the doctor: the preflight ``doctor()`` that ``GRPOConfig.doctor`` asks for
before the first step, and the log of every finding, preflight and live.

Findings are printed (the main process only) and appended to ``<output_dir>/findings.jsonl``, one
line per finding: ``step`` (for the preflight probe, the step training starts from: 0, or the
checkpoint's step on a resume; else the optimizer step whose row the live rule read), ``source``
("doctor" or "live"), ``code``, ``severity``, ``message``, ``evidence`` and ``fix``. They go to a
file of their own rather than into ``metrics.jsonl``, whose rows keep TRL's metric names (numbers,
one row per step).
"""

from __future__ import annotations

import contextlib
import json

from grpo_lab.parallel.dist import from_main, on_main
from grpo_lab.doctor import DoctorStop, Finding, Findings

FINDINGS_FILE = "findings.jsonl"
_probe_only = False  # set by probe_only(): train() runs the probe and stops, whatever GRPOConfig.doctor says
_probed: Findings | None = None  # inside probe_only(), once the probe ran: its findings


class ProbeDone(BaseException):
    """Raised by ``train()`` inside :func:`probe_only` once the probe ran: it carries the findings.

    A ``BaseException``, as ``KeyboardInterrupt`` is: a script's ``except Exception`` around
    ``train()`` does not catch it, so the script's code after ``train()`` (a save over the user's
    model, say) does not run."""

    def __init__(self, findings: Findings):
        super().__init__("the doctor's probe ran; training was not started")
        self.findings = findings


@contextlib.contextmanager
def probe_only():
    """Within it, ``GRPOTrainer.train()`` runs ``session.doctor()`` in place of training and raises
    :class:`ProbeDone` with the findings (what ``grpo-lab doctor script.py`` runs a script under)."""
    global _probe_only, _probed
    _probe_only, _probed = True, None
    try:
        yield
    finally:
        _probe_only, _probed = False, None


def refuse_after_probe() -> None:
    """Inside :func:`probe_only`, once the probe ran, raise :class:`ProbeDone` again: what a script
    does while the stop unwinds (a ``finally`` block that saves the model, a second ``train()``)
    writes nothing."""
    if _probed is not None:
        raise ProbeDone(_probed)


def preflight(trainer) -> None:
    """Run ``session.doctor()`` on every process (its stages gather) when ``trainer.args.doctor`` is
    "warn" or "stop", print and record its findings on the main process, and, for "stop", raise
    :class:`DoctorStop` on every process where the main process's probe found an error."""
    mode = trainer.args.doctor
    global _probed
    if _probe_only:
        _probed = trainer.session.doctor()
        raise ProbeDone(_probed)
    if mode == "off":
        return
    findings = trainer.session.doctor()
    step = trainer.session.global_step
    on_main(trainer.accelerator, f"write {FINDINGS_FILE}", lambda: _record(trainer, findings, step, "doctor"))
    errors = from_main(trainer.accelerator, [f.code for f in findings if f.severity == "error"])
    if mode == "stop" and errors:
        raise DoctorStop(errors, findings)


def log_live_findings(trainer, row: dict) -> None:
    """Print and record the live findings raised at ``row``'s step (called on the main process)."""
    raised = [finding for finding in trainer.session.live_findings if finding.evidence.get("step") == row["step"]]
    if raised:
        _record(trainer, raised, row["step"], "live")


def _record(trainer, findings: list[Finding], step: int, source: str) -> None:
    if not findings:
        if source == "doctor":
            print(f"doctor: {Findings().summary()}")
        return
    title = f"doctor, before step {step + 1}" if source == "doctor" else f"doctor, at step {step}"
    print(f"{title}: {Findings(findings).summary()}")
    for finding in findings:
        print(finding)
    trainer.output_dir.mkdir(parents=True, exist_ok=True)
    with open(trainer.output_dir / FINDINGS_FILE, "a") as handle:
        for finding in findings:
            entry = {"step": step, "source": source, "code": finding.code, "severity": finding.severity,
                     "message": finding.message, "evidence": finding.evidence, "fix": finding.fix}
            handle.write(json.dumps(entry, default=str) + "\n")
