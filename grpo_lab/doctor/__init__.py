"""``session.doctor()``: a preflight probe that says why a run would not learn.

The probe runs one generation batch through the engine's own stages (generate, score, advantages,
and one loss pass, no update), reads it with small rules, and leaves the session as it was.
:mod:`~grpo_lab.doctor.findings` holds the result types, :mod:`~grpo_lab.doctor.rules` the rules
over lengths, rewards, advantages and the loss, :mod:`~grpo_lab.doctor.tokens` those over the chat
template and special tokens, :mod:`~grpo_lab.doctor.memory` the memory forecast,
:mod:`~grpo_lab.doctor.thresholds` every threshold the rules compare with (settings, through
``GRPOConfig.doctor_thresholds``), and :mod:`~grpo_lab.session.probe` runs the probe and the rules.
Every finding and threshold is listed in docs/troubleshooting.md.
"""

from grpo_lab.doctor.findings import SEVERITIES, DoctorStop, Finding, Findings

__all__ = ["SEVERITIES", "DoctorStop", "Finding", "Findings"]
