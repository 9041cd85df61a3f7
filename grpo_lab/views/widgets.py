"""ipywidgets views of a GRPOSession, each subscribed to the session's stage events.

``session.show()`` is :class:`Dashboard`: controls, curves, completions and rewards. Each part is
also available alone. A view that fails to render shows the error in itself and never interrupts
training.
"""

from __future__ import annotations

import functools
import html
import threading
import traceback

import ipywidgets as widgets

from grpo_lab.views import data, plots, render


def _guarded(method):
    """Run a refresh; on failure show the error in the view instead of raising into the session."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except Exception as error:  # a broken view must never stop a training run
            self.error.value = (
                f"<pre style='color:#b00020'>{html.escape(type(self).__name__)} could not update: "
                f"{html.escape(repr(error))}\n{html.escape(traceback.format_exc(limit=3))}</pre>"
            )

    return wrapper


class _View(widgets.VBox):
    events: tuple[str, ...] = ()

    def __init__(self, session, children=()):
        self.session = session
        self.error = widgets.HTML()
        super().__init__(children=[*children, self.error])
        self._unsubscribe = session.on(self._on_event)

    def _on_event(self, stage, result) -> None:
        if stage in self.events:
            self.refresh()

    def refresh(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._unsubscribe()
        super().close()


class CurvesView(_View):
    """Training curves, one small plot per metric group, extended in place after every update()."""

    events = ("update",)

    def __init__(self, session):
        self.smoothing = widgets.FloatSlider(value=0.0, min=0.0, max=0.99, step=0.01, description="smoothing",
                                             continuous_update=False)
        self.placeholder = widgets.HTML("<p>No optimizer step yet: the curves start after the first update().</p>")
        self.figure = None
        self._layout = None
        super().__init__(session, [self.smoothing, self.placeholder])
        self.add_class("grpo-curves")
        self.smoothing.observe(lambda change: self.refresh(), names="value")
        self.refresh()

    @_guarded
    def refresh(self) -> None:
        panels = data.curve_panels(self.session.history, self.smoothing.value)
        if not panels:
            return
        layout = plots.layout_of(panels)
        if layout == self._layout:
            plots.update_curves(self.figure, panels)
            return
        self.figure, self._layout = plots.curves_figure(panels), layout
        self.children = [self.smoothing, self.figure, self.error]


class CompletionsView(_View):
    """The current batch, one prompt group at a time, tokens coloured by a chosen quantity
    ("vllm_logprob_gap" is offered only for a rollout with sampling and old log-probs)."""

    events = ("generate", "score", "advantages", "loss", "update")

    def __init__(self, session):
        self.group = widgets.Dropdown(description="group", options=[], layout={"width": "60%"})
        self.quantity = widgets.Dropdown(description="colour by", options=data.token_quantities(session.rollout),
                                         value="logprob")
        self.overview = widgets.HTML()
        self.table = widgets.HTML()
        super().__init__(session, [widgets.HBox([self.group, self.quantity]), self.overview, self.table])
        self.add_class("grpo-completions-view")
        self._updating = False
        self.group.observe(lambda change: None if self._updating else self.refresh(), names="value")
        self.quantity.observe(lambda change: None if self._updating else self.refresh(), names="value")
        self.refresh()

    def _set_options(self, dropdown: widgets.Dropdown, options, values) -> None:
        """Replace a dropdown's options without a refresh, keeping its value while it is still offered."""
        current, self._updating = dropdown.value, True
        try:
            dropdown.options = options
            dropdown.value = current if current in values else values[0]
        finally:
            self._updating = False

    @_guarded
    def refresh(self) -> None:
        if self.session.rollout is None:
            if not self.table.value:
                self.table.value = "<p>No completions yet: run session.generate().</p>"
            else:
                self.overview.value = (
                    f"<p>step {self.session.global_step}: the batch below has been trained on; next stage "
                    "<b>generate()</b>.</p>"
                )
            return
        frame = data.latest_table(self.session)
        flags = data.group_flags(frame)
        options = []
        for row in flags.itertuples():
            marks = " [equal rewards]" if getattr(row, "std_zero", False) else ""
            marks += f" [{row.truncated} truncated]" if row.truncated else ""
            options.append((f"{row.group}: {row.prompt}{marks}", int(row.group)))
        if list(self.group.options) != options:
            self._set_options(self.group, options, [v for _, v in options])
        quantities = data.token_quantities(self.session.rollout)
        if tuple(self.quantity.options) != quantities:
            self._set_options(self.quantity, quantities, quantities)
        zero = int(flags["std_zero"].sum()) if "std_zero" in flags else 0
        self.overview.value = (
            f"<p>step {self.session.global_step}, next stage <b>{self.session.next_stage}()</b>: {len(frame)} completions "
            f"in {len(flags)} groups; {zero} group(s) with equal rewards; {int(frame['truncated'].sum())} truncated.</p>"
            f"{render.token_legend(self.quantity.value)}"
        )
        group = self.group.value
        rows = data.group_table(frame, group)
        tokens = {
            position: render.token_spans(data.token_values(self.session, position, self.quantity.value), self.quantity.value)
            for position in rows.index
        }
        self.table.value = render.group_html(frame, group, tokens)


class RewardsView(_View):
    """Per reward function statistics, their correlation, and what reward functions logged."""

    events = ("score",)

    def __init__(self, session):
        self.body = widgets.HTML("<p>No rewards yet: run session.score().</p>")
        super().__init__(session, [self.body])
        self.add_class("grpo-rewards-view")
        self.refresh()

    @_guarded
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


class Controls(_View):
    """Buttons for each stage, Step, and Run N with Stop (Stop ends between stages)."""

    events = ("generate", "score", "advantages", "loss", "update")
    STAGES = ("generate", "score", "advantages", "loss", "update")

    def __init__(self, session):
        self.stage_buttons = {name: widgets.Button(description=f"{name}()", layout={"width": "110px"}) for name in self.STAGES}
        self.step_button = widgets.Button(description="Step", button_style="info")
        self.steps = widgets.BoundedIntText(value=10, min=1, max=100_000, description="N", layout={"width": "130px"})
        self.run_button = widgets.Button(description="Run N", button_style="success")
        self.stop_button = widgets.Button(description="Stop", button_style="danger", disabled=True)
        self.status = widgets.HTML()
        super().__init__(session, [
            widgets.HBox(list(self.stage_buttons.values())),
            widgets.HBox([self.step_button, self.steps, self.run_button, self.stop_button]),
            self.status,
        ])
        self.add_class("grpo-controls")
        self._stop = threading.Event()
        self._thread = None
        for name, button in self.stage_buttons.items():
            button.on_click(functools.partial(self._run_stage, name))
        self.step_button.on_click(lambda _: self._busy_call(self.session.step))
        self.run_button.on_click(self._start_run)
        self.stop_button.on_click(lambda _: self._stop.set())
        self.refresh()

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _set_busy(self, busy: bool) -> None:
        for button in [*self.stage_buttons.values(), self.step_button, self.run_button]:
            button.disabled = busy
        self.stop_button.disabled = not busy

    def _run_stage(self, name, _button=None) -> None:
        self._busy_call(getattr(self.session, name))

    def _busy_call(self, function) -> None:
        self._set_busy(True)
        try:
            function()
        except Exception as error:
            self.status.value = f"<span style='color:#b00020'>{html.escape(type(error).__name__)}: {html.escape(str(error))}</span>"
            self._set_busy(False)
            return
        self._set_busy(False)
        self.refresh()

    def _start_run(self, _button=None) -> None:
        if self.busy:
            return
        self._stop.clear()
        self._set_busy(True)
        self._thread = threading.Thread(target=self._run_loop, args=(self.steps.value,), daemon=True)
        self._thread.start()

    def _run_loop(self, n: int) -> None:
        done = 0
        try:
            while done < n and not self._stop.is_set():
                stage = self.session.next_stage
                getattr(self.session, stage)()
                done += stage == "update"
        except Exception as error:
            self.status.value = f"<span style='color:#b00020'>{html.escape(type(error).__name__)}: {html.escape(str(error))}</span>"
            self._set_busy(False)
            return
        self._set_busy(False)
        self.refresh(note=f"stopped after {done} step(s)" if done < n else f"ran {done} step(s)")

    @_guarded
    def refresh(self, note: str = "") -> None:
        next_stage = self.session.next_stage
        for name, button in self.stage_buttons.items():
            button.button_style = "primary" if name == next_stage else ""
        suffix = f" ({html.escape(note)})" if note else ""
        self.status.value = f"step {self.session.global_step}; next stage: <b>{next_stage}()</b>{suffix}"


class Dashboard(widgets.VBox):
    """Controls, curves, completions and rewards of one session, live."""

    def __init__(self, session):
        self.controls = Controls(session)
        self.curves = CurvesView(session)
        self.completions = CompletionsView(session)
        self.rewards = RewardsView(session)

        def section(title):
            return widgets.HTML(f"<h3 style='margin:8px 0 2px'>{title}</h3>")

        super().__init__([
            section("GRPO session"), self.controls, section("Curves"), self.curves,
            section("Completions"), self.completions, section("Rewards"), self.rewards,
        ])
        self.add_class("grpo-dashboard")

    def close(self) -> None:
        for part in (self.controls, self.curves, self.completions, self.rewards):
            part.close()
        super().close()
