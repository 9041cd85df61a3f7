"""What ``session.doctor()`` returns: one :class:`Finding` per problem it saw, gathered in :class:`Findings`.

A finding names its cause in ``message`` (not the symptom alone), holds the numbers and a few
examples it read in ``evidence``, and says what to change in ``fix`` (a setting such as
``max_completion_length=64``, or what to do in code). ``docs/troubleshooting.md`` lists every code.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pandas loads in to_pandas() only: the config's checks import this package
    import pandas as pd

SEVERITIES = ("info", "warning", "error")
"""From least to most severe: "info" explains what a run will show (nothing to fix), "warning" costs
learning signal or compute, "error" stops the run from learning at all."""


@dataclass(frozen=True)
class Finding:
    """One diagnosis of the probe batch: ``code`` (stable, listed in docs/troubleshooting.md),
    ``severity`` (one of :data:`SEVERITIES`), ``message`` (the cause), ``evidence`` (the numbers
    and examples it read) and ``fix`` (what to change)."""

    code: str
    severity: str
    message: str
    evidence: dict = field(default_factory=dict)
    fix: str = ""
    cause: str = ""
    """The code of the finding this one follows from ("" for a root cause): :class:`Findings` shows a
    consequence under its cause, whose fix is the one to apply first."""

    def __post_init__(self):
        if self.severity not in SEVERITIES:
            raise ValueError(f"Finding severity must be one of {SEVERITIES}, got {self.severity!r}.")

    @property
    def rank(self) -> int:
        """0 for info, 1 for warning, 2 for error."""
        return SEVERITIES.index(self.severity)

    def to_dict(self) -> dict:
        """The finding as plain values (JSON-ready where its evidence is), for checkpoints and logs."""
        return {"code": self.code, "severity": self.severity, "message": self.message,
                "evidence": dict(self.evidence), "fix": self.fix, "cause": self.cause}

    @classmethod
    def from_dict(cls, values: dict) -> Finding:
        """The finding :meth:`to_dict` wrote (one written before causes were recorded has none)."""
        return cls(values["code"], values["severity"], values["message"], dict(values["evidence"]), values["fix"],
                   values.get("cause", ""))

    def __str__(self) -> str:
        indent = "    " if self.cause else ""
        follows = f" (follows from {self.cause})" if self.cause else ""
        lines = [f"{indent}[{self.severity}] {self.code}{follows}: {self.message}"]
        lines += [f"{indent}    {name}: {_shown(value)}" for name, value in self.evidence.items()]
        if self.fix:
            lines.append(f"{indent}    fix: {self.fix}")
        return "\n".join(lines)


def _shown(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return "; ".join(_shown(item) for item in value)
    return repr(value) if isinstance(value, str) and value != value.strip() else str(value)


class Findings(list):
    """The findings of one ``doctor()`` call, grouped by cause: each root cause (a finding with no
    ``cause`` among these findings) followed by the findings that follow from it, the groups most
    severe first (a group is as severe as its most severe member), the consequences most severe
    first within theirs. A list of :class:`Finding` with a readable ``repr``, a notebook table
    (``_repr_html_``) and ``to_pandas()``."""

    def __init__(self, findings=()):
        findings = list(findings)
        codes = {finding.code for finding in findings}
        roots = [f for f in findings if f.cause not in codes]
        under = {root.code: sorted((f for f in findings if f.cause == root.code and f is not root),
                                   key=lambda f: -f.rank) for root in roots}
        group_rank = {root.code: max([root.rank, *(f.rank for f in under[root.code])]) for root in roots}
        ordered = []
        for root in sorted(roots, key=lambda f: (-group_rank[f.code], -f.rank)):
            ordered += [root, *under[root.code]]
        placed = {id(f) for f in ordered}  # a consequence of a consequence: after the groups
        super().__init__(ordered + [f for f in findings if id(f) not in placed])

    @property
    def codes(self) -> list[str]:
        return [finding.code for finding in self]

    def above(self, severity: str) -> Findings:
        """The findings more severe than ``severity`` (``above("info")``: warnings and errors)."""
        return Findings(finding for finding in self if finding.rank > SEVERITIES.index(severity))

    def to_pandas(self) -> pd.DataFrame:
        """One row per finding: code, severity, message, evidence (a dict), fix, cause."""
        import pandas as pd

        columns = ["code", "severity", "message", "evidence", "fix", "cause"]
        return pd.DataFrame([[getattr(finding, name) for name in columns] for finding in self], columns=columns)

    def summary(self) -> str:
        if not self:
            return "no findings: the probe batch shows nothing that would stop this run from learning"
        counts = [f"{sum(f.severity == s for f in self)} {s}" for s in reversed(SEVERITIES)]
        return ", ".join(count for count in counts if not count.startswith("0 "))

    def __repr__(self) -> str:
        return "\n".join([f"Findings({self.summary()})", *map(str, self)])

    def _repr_html_(self) -> str:
        # Prose reads left-aligned; the fix under its finding leaves the evidence a column of its own.
        cell = "<td style='text-align:left;vertical-align:top;padding:3px 8px'>"
        rows = "".join(
            f"<tr>{cell}<b>{html.escape(f.severity)}</b></td>{cell}{_code_html(f)}</td>"
            f"{cell}{html.escape(f.message)}<div style='color:#444;margin-top:2px'><b>Fix:</b> {html.escape(f.fix)}"
            f"</div></td>{cell.replace('padding', 'min-width:14em;font-size:90%;padding')}"
            f"{_evidence_html(f.evidence)}</td></tr>"
            for f in self
        )
        head = "".join(f"<th style='text-align:left;padding:3px 8px'>{name}</th>"
                       for name in ("severity", "code", "finding and fix", "evidence"))
        table = (f"<table class='grpo-findings' border=0 style='border-collapse:collapse;font-size:13px'>"
                 f"<tr>{head}</tr>{rows}</table>") if self else ""
        return f"<p><b>Findings</b>: {html.escape(self.summary())}</p>{table}"


def _code_html(finding: Finding) -> str:
    if not finding.cause:
        return f"<code>{html.escape(finding.code)}</code>"
    return (f"<span style='padding-left:1.2em'>↳ <code>{html.escape(finding.code)}</code></span><br>"
            f"<small>follows from <code>{html.escape(finding.cause)}</code></small>")


def _evidence_html(evidence: dict) -> str:
    return "<br>".join(f"{html.escape(name)}: {html.escape(_shown(value))}" for name, value in evidence.items())


class DoctorStop(RuntimeError):
    """``train()`` with ``doctor="stop"`` refused to start: the preflight probe found errors."""

    def __init__(self, codes: list[str], findings: Findings):
        super().__init__(
            f"doctor='stop': the preflight probe found {len(codes)} error(s) ({', '.join(codes)}), so training did not "
            f"start (no step ran, no checkpoint was written).\n{findings.above('warning')!r}\nApply each fix above "
            "and call train() again; to train anyway, set doctor='warn' (the findings are printed and training "
            "goes on) or doctor='off'."
        )
        self.codes = codes
