"""``session.show()``: controls, curves (with its forks overlaid, on request), completions, rewards and
findings of one session, live."""

from __future__ import annotations

import ipywidgets as widgets

from grpo_lab.views.base import close_tree
from grpo_lab.views.completions import CompletionsView
from grpo_lab.views.controls import Controls
from grpo_lab.views.curves import CurvesView
from grpo_lab.views.findings import FindingsView
from grpo_lab.views.forks import ForksOverlay
from grpo_lab.views.rewards import RewardsView


class Dashboard(widgets.VBox):
    """Controls, curves, completions, rewards and findings of one session, live."""

    def __init__(self, session):
        self.controls = Controls(session)
        self.curves = CurvesView(session)
        self.forks = ForksOverlay(session, self.curves)
        self.completions = CompletionsView(session)
        self.rewards = RewardsView(session)
        self.findings = FindingsView(session)

        def section(title):
            return widgets.HTML(f"<h3 style='margin:8px 0 2px'>{title}</h3>")

        super().__init__([
            section("GRPO session"), self.controls, section("Curves"), self.forks, self.curves,
            section("Completions"), self.completions, section("Rewards"), self.rewards,
            section("Findings"), self.findings,
        ])
        self.add_class("grpo-dashboard")

    def close(self) -> None:
        for part in (self.controls, self.forks, self.curves, self.completions, self.rewards, self.findings):
            part.close()  # each unsubscribes from the session
        close_tree(self)
