"""The controls follow the session's owner guard (real widgets, no browser): disabled while anything
drives the session, a busy click refused with the reason, and Run N's two ways to stop."""

import re
import threading

import pytest

from grpo_lab.session.ownership import SessionBusyError
from tests.conftest import pause_at


@pytest.fixture
def session(make_session):
    return make_session()


def drive_buttons(controls):
    return [*controls.stage_buttons.values(), controls.step_button, controls.run_button]


def test_controls_buttons_run_stages_and_run_n_stops_cleanly(session):
    controls = session.controls()
    controls.stage_buttons["generate"].click()
    assert session.next_stage == "score"
    controls.stage_buttons["loss"].click()  # out of order: the error is shown, nothing raised
    assert "StageOrderError" in controls.status.value
    controls.step_button.click()
    assert session.global_step == 1
    three_steps = threading.Event()
    session.on(lambda name, row: three_steps.set() if name == "update" and session.global_step >= 3 else None)
    controls.steps.value = 1000
    controls.run_button.click()
    assert controls.run_n_active and controls.run_button.disabled and not controls.stop_button.disabled
    assert three_steps.wait(120)
    controls.stop_button.click()
    controls._thread.join(timeout=120)
    assert not controls.run_n_active and not controls.run_button.disabled and controls.stop_button.disabled
    assert 3 <= session.global_step < 1000 and "stopped after" in controls.status.value


def test_buttons_are_disabled_while_a_cell_runs_and_enabled_after(session):
    controls = session.controls()
    seen = []  # (event, every button disabled, Stop disabled, status) as each event reaches a listener after the view
    session.on(lambda name, payload: seen.append((name, all(b.disabled for b in drive_buttons(controls)),
                                                  controls.stop_button.disabled, controls.status.value)))
    session.run(2, progress=False)
    during = [entry for entry in seen if entry[0] != "idle"]
    assert [entry[0] for entry in during] == ["busy"] + ["generate", "score", "advantages", "loss", "update"] * 2
    assert all(disabled and stop_disabled for _, disabled, stop_disabled, _ in during)
    assert during[0][3] == ("step 0; <b>session.run(2)</b> running, started by a cell (step 1 of 2): buttons "
                            "disabled until it ends.")
    assert "(step 2 of 2, stage loss())" in during[-2][3]
    assert seen[-1][:3] == ("idle", False, True)
    assert not any(b.disabled for b in drive_buttons(controls)) and controls.stop_button.disabled
    assert controls.status.value == "step 2; next stage: <b>generate()</b>"


def test_a_click_while_another_thread_drives_the_session_changes_nothing_and_says_why(session):
    controls = session.controls()
    paused, resume = pause_at(session, "loss", global_step=0)
    runner = threading.Thread(target=session.run, args=(2,), kwargs={"progress": False}, name="trainer")
    runner.start()
    try:
        assert paused.wait(120)
        assert all(b.disabled for b in drive_buttons(controls)) and controls.stop_button.disabled
        assert controls.status.value.startswith("step 0; <b>session.run(2)</b> running, started by a background thread")
        for button, attempt in [(controls.step_button, r"session\.step\(\)"),
                                (controls.stage_buttons["update"], r"session\.update\(\)"),
                                (controls.run_button, "Run N")]:
            button.click()  # a click that reaches the kernel anyway (the browser disables the buttons)
            assert controls.status.value.startswith("<span style='color:#b00020'>SessionBusyError: ")
            assert "started by a background thread (trainer)" in controls.status.value
            assert re.search(rf"{attempt} cannot run now: session\.run\(2\)", controls.status.value)
            assert (session.global_step, session.next_stage, controls.run_n_active) == (0, "update", False)
    finally:
        resume.set()
        runner.join(timeout=120)
    assert not runner.is_alive() and session.global_step == 2
    assert not any(b.disabled for b in drive_buttons(controls))
    assert controls.status.value == "step 2; next stage: <b>generate()</b>"


def test_a_cell_call_during_run_n_is_refused_naming_run_n_and_stop(session):
    controls = session.controls()
    paused, resume = pause_at(session, "loss", global_step=1)
    controls.steps.value = 10
    controls.run_button.click()
    try:
        assert paused.wait(120)
        with pytest.raises(SessionBusyError) as refused:
            session.step()
        assert str(refused.value) == (
            "session.step() cannot run now: Run N (10 steps), started by the dashboard's Run N button, is running "
            "(step 2 of 10, stage loss()). A session runs one thing at a time and nothing was queued: wait for it "
            "to end, or press Stop on the dashboard (it ends between stages; Finish step ends after the current "
            "update()), or call session.request_stop(); then call session.step() again."
        )
        assert all(b.disabled for b in drive_buttons(controls))
        assert not controls.stop_button.disabled and not controls.finish_button.disabled
        assert "Stop ends it between stages, Finish step after the current update()." in controls.status.value
        controls.stop_button.click()
    finally:
        resume.set()
        controls._thread.join(timeout=120)
    assert not controls.run_n_active and session.global_step == 1 and session.next_stage == "update"
    assert controls.status.value.endswith(
        "(stopped after 1 step(s), between stages: loss() done, next stage update())")


@pytest.mark.parametrize("button, at_stage, state, note", [
    ("stop_button", "loss", (1, "update"), "stopped after 1 step(s), between stages: loss() done, next stage update()"),
    ("finish_button", "generate", (2, "generate"),
     "stopped after 2 step(s) at the end of step 2; next stage generate()"),
])
def test_stop_ends_between_stages_and_finish_step_after_the_update(session, button, at_stage, state, note):
    controls = session.controls()
    # pressed from inside the second step's stage (on Run N's thread, as a click between two stages would land)
    session.on(lambda name, payload: getattr(controls, button).click()
               if name == at_stage and session.global_step == 1 else None)
    controls.steps.value = 10
    controls.run_button.click()
    controls._thread.join(timeout=120)
    assert not controls._thread.is_alive() and (session.global_step, session.next_stage) == state
    assert controls.status.value == f"step {state[0]}; next stage: <b>{state[1]}()</b> ({note})"
    assert not any(b.disabled for b in drive_buttons(controls)) and controls.stop_button.disabled


def test_run_n_stops_from_any_dashboard_and_from_a_cell(session):
    first, second = session.controls(), session.controls()  # e.g. show() run twice
    paused, resume = pause_at(session, "loss", global_step=1)
    first.steps.value = 10
    first.run_button.click()
    assert paused.wait(120)
    assert not second.stop_button.disabled and not second.finish_button.disabled  # it can stop a run it did not start
    second.stop_button.click()
    resume.set()
    first._thread.join(timeout=120)
    assert (session.global_step, session.next_stage) == (1, "update")
    first.run_button.click()
    assert session.request_stop("step")  # a cell, while Run N holds the session
    first._thread.join(timeout=120)
    assert session.global_step == 2 and not session.request_stop("step")  # nothing runs now


def test_closing_the_dashboard_that_runs_n_stops_it(session):
    controls = session.controls()
    paused, resume = pause_at(session, "score", global_step=0)
    controls.steps.value = 10
    controls.run_button.click()
    assert paused.wait(120)
    thread = controls._thread
    controls.close()
    resume.set()
    thread.join(timeout=120)
    assert not thread.is_alive() and session.global_step == 0 and session.activity is None
