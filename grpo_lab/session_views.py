"""The notebook views and the script export of a GRPOSession, imported on demand (the session and
engine never import widget code until a view is asked for)."""

from __future__ import annotations

from pathlib import Path


class SessionViews:
    def show(self):
        """The live dashboard: stage controls, curves, completions and rewards."""
        from grpo_lab.views.dashboard import Dashboard

        return Dashboard(self)

    def completions_view(self):
        """The current batch (or the last trained one) by prompt group, tokens coloured by probability,
        entropy, A x ratio, clipping or (with vLLM) the trainer/vLLM log-prob gap."""
        from grpo_lab.views.completions import CompletionsView

        return CompletionsView(self)

    def rewards_view(self):
        """Per reward function statistics, pass rates, correlations, reward strips per group, the
        advantage histogram and logged extras of the batch shown (marked when older than the session's)."""
        from grpo_lab.views.rewards import RewardsView

        return RewardsView(self)

    def curves(self):
        """Training curves, redrawn from the whole history after every update()."""
        from grpo_lab.views.curves import CurvesView

        return CurvesView(self)

    def controls(self):
        """Buttons for each stage, Step, and Run N with Stop."""
        from grpo_lab.views.controls import Controls

        return Controls(self)

    def export_script(self, path) -> Path:
        """Write a standalone training script with this session's current config, model reference,
        datasets (saved beside it) and reward functions (their source, or an import where a module
        defines them); see :mod:`grpo_lab.export`."""
        from grpo_lab.export import export_session

        return export_session(self, path)
