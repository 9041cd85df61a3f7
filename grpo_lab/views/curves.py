"""The training curves view."""

from __future__ import annotations

import ipywidgets as widgets
import numpy as np

from grpo_lab.views import curve_data
from grpo_lab.views.base import View, guarded
from grpo_lab.views.plot_widget import CurvesWidget

EMPTY = "No optimizer step yet: the curves start after the first update()."


class CurvesView(View):
    """Training curves, one small plot per metric group, redrawn from the full history after every
    update(), evaluate() and undo() (an evaluated metric's series beside its training one). The figure
    widget exists from the start and its state is the whole picture, so a view of it made at any
    time (a reloaded page included) draws every step so far."""

    events = ("update", "evaluate", "undo")

    def __init__(self, session):
        self.smoothing = widgets.FloatSlider(value=0.0, min=0.0, max=0.99, step=0.01, description="smoothing",
                                             continuous_update=False)
        self.figure = CurvesWidget()
        self.curves: curve_data.Curves | None = None
        self._shares: dict[int, tuple[dict, tuple[float, float]]] = {}  # log position -> (its entry, (step, share))
        super().__init__(session, [self.smoothing, self.figure])
        self.add_class("grpo-curves")
        self.smoothing.observe(lambda change: self.refresh(), names="value")
        self.refresh()

    def _nonzero_advantage(self) -> tuple[np.ndarray, np.ndarray]:
        """The learning-signal share per scored batch, computed once per batch: a log entry is never
        changed, but undo() (or loading a state) puts new entries in place of old ones."""
        log = self.session.record.completion_log
        for position, entry in enumerate(log):
            if self._shares.get(position, (None,))[0] is not entry:
                steps, shares = curve_data.nonzero_advantage_share([entry])
                share = (float(steps[0]), float(shares[0])) if len(steps) else (np.nan, np.nan)
                self._shares[position] = (entry, share)
        pairs = np.array([self._shares[p][1] for p in range(len(log))], dtype=float).reshape(-1, 2)
        kept = np.isfinite(pairs[:, 0])
        return pairs[kept, 0], pairs[kept, 1]

    @guarded
    def refresh(self) -> None:
        session = self.session
        history = session.history
        loss_zero = "loss" in history and curve_data.loss_is_zero_by_construction(
            session.config.beta, session.engine.steps_per_batch, history["loss"]
        )
        self.curves = curve_data.curve_panels(
            history, self.smoothing.value, nonzero_advantage=self._nonzero_advantage(), loss_zero=loss_zero,
            config_changes=session.config_changes,
            absent=curve_data.absent_steps(session.record.history, history.columns),
            evaluations=session.evaluations,
        )
        self.figure.show_curves(self.curves, EMPTY)

