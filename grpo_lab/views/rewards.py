"""The rewards view: what the reward functions said about one batch, and the advantages they gave."""

from __future__ import annotations

import html

import ipywidgets as widgets

from grpo_lab.views import batch as batches
from grpo_lab.views import charts, data, render
from grpo_lab.views.base import View, guarded


class RewardsView(View):
    """Per reward function statistics and pass rates, their correlation, each group's rewards, the
    advantage histogram, and what the reward functions logged (``log_extra``, ``log_metric``).

    Shows the current batch once scored; before that the last trained batch, marked as the previous
    one while a newer batch waits for score()."""

    events = ("generate", "score", "advantages", "loss", "update", "undo")

    def __init__(self, session):
        self.header = widgets.HTML()
        self.body = widgets.HTML("<p>No rewards yet: run session.score().</p>")
        super().__init__(session, [self.header, self.body])
        self.add_class("grpo-rewards-view")
        self.refresh()

    @guarded
    def refresh(self) -> None:
        batch = batches.batch_for(self.session, "score")
        self.header.value = render.header_html(batch, self.session.next_stage, "score")
        scores = batch.scores
        if scores is None:
            self.body.value = "<p>No rewards yet: run session.score().</p>"
            return
        parts = [render.reward_summary_html(data.reward_summary(scores))]
        if len(scores.reward_names) > 1:
            parts.append(render.correlation_html(data.reward_correlation(scores)))
        parts.append(self._charts(batch))
        if scores.extras:
            extras = scores.rollout.to_pandas()[["group", "completion"]].assign(**scores.extras)
            parts.append(render.logged_extras_html(extras.head(16)))
        if any(scores.metrics.values()):  # only what reward functions logged, never the step's own metrics
            parts.append(render.logged_metrics_html(scores.metrics))
        self.body.value = "".join(parts)

    @staticmethod
    def _charts(batch) -> str:
        """Each group's rewards (the total, once advantages() has weighted it, then each function's)
        and the advantage histogram, side by side."""
        scores, advantages = batch.scores, batch.advantages
        group_B = scores.rollout.group_index_B.cpu()
        shown = []
        if advantages is not None:
            shown.append(charts.reward_strip_svg(batches.group_values(group_B, advantages.rewards_B.cpu()),
                                                 "total reward"))
        for i, name in enumerate(scores.reward_names):
            shown.append(charts.reward_strip_svg(batches.group_values(group_B, scores.rewards_BF[:, i].cpu()), name))
        if advantages is None:
            note = "advantage histogram: run session.advantages()."
        else:
            shown.append(charts.histogram_svg(batches.histogram(advantages.advantages_B.cpu().tolist()), "advantages"))
            equal = int(advantages.is_std_zero_B.sum())
            note = (f"{equal} of {len(advantages.advantages_B)} completions are in groups with equal rewards "
                    "(advantage 0, no gradient).")
        return (
            "<p style='margin:6px 0 2px'><b>rewards by group</b> (x: group; a dot per value, larger where several "
            "completions share it; red dash: the group's mean; hover a mark for its numbers) <b>and advantages</b></p>"
            f"<div style='display:flex;flex-wrap:wrap;gap:12px;overflow-x:auto'>{''.join(shown)}</div>"
            f"<p style='margin:2px 0;color:#555'>{html.escape(note)}</p>"
        )
