"""Stage buttons, Step, and Run N with Stop."""

from __future__ import annotations

import functools
import html
import threading

import ipywidgets as widgets

from grpo_lab.views.base import View, guarded


class Controls(View):
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

    @guarded
    def refresh(self, note: str = "") -> None:
        next_stage = self.session.next_stage
        for name, button in self.stage_buttons.items():
            button.button_style = "primary" if name == next_stage else ""
        suffix = f" ({html.escape(note)})" if note else ""
        self.status.value = f"step {self.session.global_step}; next stage: <b>{next_stage}()</b>{suffix}"
