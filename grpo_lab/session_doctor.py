"""GRPOSession's ``doctor()``: a preflight probe that says why a run would not learn (see
:mod:`grpo_lab.doctor` for the probe and its rules, docs/troubleshooting.md for every finding)."""

from __future__ import annotations

from grpo_lab.doctor import Findings
from grpo_lab.doctor.probe import diagnose
from grpo_lab.stages import drives_stages


class SessionDoctor:
    """GRPOSession's doctor."""

    _findings: Findings | None = None

    @drives_stages
    def doctor(self) -> Findings:
        """Run one probe generation batch through generate, score, advantages and one loss pass (no
        update), and return what in it would keep the run from learning: truncated completions,
        reward functions that give no signal, prompt groups too easy or too hard, a chat template or
        EOS token that is wrong, compute spent on zero advantages, a memory shortfall, a vLLM
        log-prob gap; and what the loss will show (``Findings``, most severe first; each with its
        cause, evidence and fix).

        The session is left as it was: weights, gradients, optimizer, random states, the sampler's
        position, a half-used batch (and a pending loss()), history and config. Config edits made
        since the last stage are applied first, as the next stage would. With no batch held, the
        probe is the batch the next ``generate()`` will draw. The result is kept as ``findings``.
        """
        self._sync_config()
        self._findings = diagnose(self.engine)
        return self._findings

    @property
    def findings(self) -> Findings:
        """The findings of the last ``doctor()`` (empty before the first)."""
        return Findings() if self._findings is None else self._findings
