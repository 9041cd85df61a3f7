"""Stage buttons, Step, and Run N with two ways to stop it.

The buttons follow the session's owner guard (:mod:`grpo_lab.session.ownership`). While anything drives the
session they are disabled, a cell's ``session.run(3)`` included: the view hears the session's
``"busy"`` and ``"idle"`` events, and a widget's change reaches the browser while the cell runs. A
click that still finds the session busy is refused with the reason in the status line, never queued.
Run N trains on a thread of its own and holds the session as "the dashboard's Run N button", so a
cell's ``session.step()`` meanwhile raises SessionBusyError naming Run N and the Stop button.
"""

from __future__ import annotations

import functools
import html
import threading

import ipywidgets as widgets

from grpo_lab.session.ownership import SessionBusyError
from grpo_lab.session.loops import run_stages
from grpo_lab.views.base import View, guarded

RUN_N = "the dashboard's Run N button"
STOP_RUN_N = (
    "press Stop on the dashboard (it ends between stages; Finish step ends after the current update()), or call "
    "session.request_stop()"
)


class Controls(View):
    """Buttons for each stage, Step, and Run N with Stop (ends between stages) and Finish step (ends
    after the current update())."""

    STAGES = ("generate", "score", "advantages", "loss", "update")
    events = (*STAGES, "busy", "idle", "undo")
    immediate = ("busy", "idle", "undo")  # the buttons turn off and on with the session at once

    def __init__(self, session):
        self.stage_buttons = {name: widgets.Button(description=f"{name}()", layout={"width": "110px"})
                              for name in self.STAGES}
        self.step_button = widgets.Button(description="Step", button_style="info")
        self.steps = widgets.BoundedIntText(value=10, min=1, max=100_000, description="N", layout={"width": "130px"})
        self.run_button = widgets.Button(description="Run N", button_style="success")
        self.stop_button = widgets.Button(description="Stop", button_style="danger", disabled=True,
                                          tooltip="End Run N between two stages")
        self.finish_button = widgets.Button(description="Finish step", button_style="warning", disabled=True,
                                            tooltip="End Run N after the current update()")
        self.status = widgets.HTML()
        super().__init__(session, [
            widgets.HBox(list(self.stage_buttons.values())),
            widgets.HBox([self.step_button, self.steps, self.run_button, self.stop_button, self.finish_button]),
            self.status,
        ])
        self.add_class("grpo-controls")
        self._run_active = False  # from this view's Run N click until its loop has ended
        self._thread: threading.Thread | None = None
        for name, button in self.stage_buttons.items():
            button.on_click(functools.partial(self._press, name))
        self.step_button.on_click(functools.partial(self._press, "step"))
        self.run_button.on_click(self._start_run)
        self.stop_button.on_click(lambda _: session.request_stop("stage"))
        self.finish_button.on_click(lambda _: session.request_stop("step"))
        self.refresh()

    @property
    def run_n_active(self) -> bool:
        """Run N was started here and its loop has not ended."""
        return self._run_active

    def _show_error(self, error: Exception) -> None:
        self.status.value = (f"<span style='color:#b00020'>{html.escape(type(error).__name__)}: "
                             f"{html.escape(str(error))}</span>")

    def _press(self, name: str, _button=None) -> None:
        """A stage button or Step: run it on the kernel's thread, holding the session as that button."""
        label = "Step" if name == "step" else f"{name}()"
        try:
            with self.session.hold(f"session.{name}()", started_by=f"the dashboard's {label} button"):
                getattr(self.session, name)()
        except Exception as error:  # SessionBusyError included: refused, nothing ran
            self._show_error(error)
            return
        self.refresh()

    def _start_run(self, _button=None) -> None:
        activity = self.session.activity
        if self._run_active or activity is not None:
            self._show_error(SessionBusyError(activity.refusal("Run N") if activity else "Run N is already running."))
            return
        self._run_active = True
        self.refresh()  # disabled now, not when the thread first holds the session: a second click finds it so
        self._thread = threading.Thread(target=self._run_loop, args=(self.steps.value,), daemon=True,
                                        name="grpo_lab Run N")
        self._thread.start()

    def _stop_request(self) -> str | None:
        activity = self.session.activity
        return None if activity is None else activity.stop_request

    def _run_loop(self, n: int) -> None:
        done, last, failure = 0, None, None
        try:
            with self.session.hold(f"Run N ({n} steps)", started_by=RUN_N, how_to_stop=STOP_RUN_N, steps=n,
                                   stoppable=True):
                done, last = run_stages(self.session, n, self._stop_request)
        except Exception as error:
            failure = error
        finally:  # whatever ends the loop, the buttons come back
            self._run_active = False
            self.refresh(note="" if failure else self._end_note(n, done, last))
        if failure is not None:
            self._show_error(failure)

    def _end_note(self, n: int, done: int, last: str | None) -> str:
        """Where Run N left the session."""
        next_stage = self.session.next_stage
        if done == n:
            return f"ran {done} step(s)"
        if last is None:
            return f"stopped before any stage ran; next stage {next_stage}()"
        if last == "update":
            return (f"stopped after {done} step(s) at the end of step {self.session.global_step}; "
                    f"next stage {next_stage}()")
        return f"stopped after {done} step(s), between stages: {last}() done, next stage {next_stage}()"

    @guarded
    def refresh(self, note: str = "") -> None:
        activity = self.session.activity
        stoppable = self._run_active or (activity is not None and activity.stoppable)  # Run N of any dashboard, arun
        for button in [*self.stage_buttons.values(), self.step_button, self.run_button]:
            button.disabled = activity is not None or self._run_active
        self.stop_button.disabled = self.finish_button.disabled = not stoppable
        next_stage = self.session.next_stage
        for name, button in self.stage_buttons.items():
            button.button_style = "primary" if name == next_stage else ""
        if activity is not None:
            stops = " Stop ends it between stages, Finish step after the current update()." if stoppable else ""
            where = f" ({html.escape(activity.where)})" if activity.where else ""
            self.status.value = (  # the global step first, as when idle: "step (\d+)" finds it either way
                f"step {self.session.global_step}; <b>{html.escape(activity.description)}</b> running, started by "
                f"{html.escape(activity.started_by)}{where}: buttons disabled until it ends.{stops}"
            )
            return
        suffix = f" ({html.escape(note)})" if note else ""
        self.status.value = f"step {self.session.global_step}; next stage: <b>{next_stage}()</b>{suffix}"

    def close(self) -> None:
        """A closed dashboard's Run N ends between stages: no view would be left to stop it from."""
        if self._run_active:
            self.session.request_stop("stage")
        super().close()
