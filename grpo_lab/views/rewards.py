"""The rewards view: per reward function statistics of the last score()."""

from __future__ import annotations

import ipywidgets as widgets

from grpo_lab.views import data, render
from grpo_lab.views.base import View, guarded


class RewardsView(View):
    """Per reward function statistics, their correlation, and what reward functions logged."""

    events = ("score",)

    def __init__(self, session):
        self.body = widgets.HTML("<p>No rewards yet: run session.score().</p>")
        super().__init__(session, [self.body])
        self.add_class("grpo-rewards-view")
        self.refresh()

    @guarded
    def refresh(self) -> None:
        scores = self.session.scores
        if scores is None:
            return
        parts = [render.frame_html(data.reward_summary(scores), "rewards per function")]
        if len(scores.reward_names) > 1:
            parts.append(render.frame_html(data.reward_correlation(scores), "correlation between functions"))
        if scores.extras:
            extras = scores.rollout.to_pandas()[["group", "completion"]].assign(**scores.extras)
            parts.append(render.frame_html(extras.head(16), "logged with log_extra (first 16 rows)"))
        if scores.metrics:
            import pandas as pd

            logged = pd.DataFrame([{"metric": k, "mean": sum(v) / len(v)} for k, v in scores.metrics.items()])
            parts.append(render.frame_html(logged, "logged with log_metric"))
        self.body.value = "".join(parts)
