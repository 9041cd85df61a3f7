"""One owner at a time: a session driven by one thread refuses another thread's calls at once, with
what runs, who started it, where it is and how to stop it; the owning thread nests its own calls."""

import threading

import pytest

from grpo_lab.session.ownership import SessionBusyError
from tests.conftest import pause_at


@pytest.fixture
def session(make_session):
    return make_session()


def test_a_call_from_another_thread_during_a_run_is_refused_with_what_runs_and_how_to_stop(session):
    paused, resume = pause_at(session, "loss", global_step=1)  # inside the run's second step, loss() done
    runner = threading.Thread(target=session.run, args=(3,), kwargs={"progress": False}, name="trainer")
    runner.start()
    try:
        assert paused.wait(120)
        with pytest.raises(SessionBusyError) as refused:
            session.step()
        assert str(refused.value) == (
            "session.step() cannot run now: session.run(3), started by a background thread (trainer), is running "
            "(step 2 of 3, stage loss()). A session runs one thing at a time and nothing was queued: wait for it "
            "to end, or make that thread's code return (an interrupt reaches the main thread only); then call "
            "session.step() again."
        )
        for call in (session.generate, session.update, session.evaluate, session.discard_batch):
            with pytest.raises(SessionBusyError, match=rf"session.{call.__name__}\(\) cannot run now: "
                                                       r"session.run\(3\)"):
                call()
        with pytest.raises(SessionBusyError, match=r"session.run\(1\) cannot run now"):
            session.run(1, progress=False)
        activity = session.activity
        assert (activity.description, activity.started_by, activity.where) == (
            "session.run(3)", "a background thread (trainer)", "step 2 of 3, stage loss()")
        assert (session.global_step, session.next_stage) == (1, "update")  # the refused calls changed nothing
    finally:
        resume.set()
        runner.join(timeout=120)
    assert not runner.is_alive() and session.global_step == 3 and session.activity is None
    assert session.step()["step"] == 4  # released: this thread may drive it now


def test_the_owning_thread_nests_its_calls_and_busy_idle_come_once_per_outermost_call(session):
    events = []
    session.on(lambda name, payload: events.append((name, None if payload is None else str(payload))
                                                   if name in ("busy", "idle") else name))
    session.run(2, progress=False)  # run -> step -> each stage: nested holds of one thread
    stages = ["generate", "score", "advantages", "loss", "update"]
    assert events == [("busy", "session.run(2), started by a cell: step 1 of 2"), *stages, *stages, ("idle", None)]
    # busy and idle are not stages: only the ten stages count, and the last stage stays update
    assert session.record.stages_run == 10 and session.record.last_stage == "update"

    events.clear()
    with session.hold("a loop in a cell", steps=2):
        session.generate()
        assert str(session.activity) == "a loop in a cell, started by a cell: step 1 of 2"
        session.step()
        assert session.activity.where == "step 2 of 2"  # update() finished a step
        session.step()
    assert events == [("busy", "a loop in a cell, started by a cell: step 1 of 2"), *stages, *stages, ("idle", None)]
    assert session.activity is None and session.global_step == 4


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_an_error_or_interrupt_inside_a_stage_releases_the_session(session, error):
    events = []
    session.on(lambda name, payload: events.append(name) if name in ("busy", "idle") else None)

    def fail(name, payload):
        if name == "score":
            raise error("inside score()")

    unsubscribe = session.on(fail)
    with pytest.raises(error, match=r"inside score\(\)"):
        session.step()
    unsubscribe()
    assert session.activity is None and events == ["busy", "idle"]
    other = threading.Thread(target=session.step)  # another thread may take it now
    other.start()
    other.join(timeout=120)
    assert not other.is_alive() and session.global_step == 1 and session.activity is None


def test_a_refused_outermost_hold_leaves_the_owner_as_it_was(session):
    holding, release = threading.Event(), threading.Event()

    def hold():
        with session.hold("a check", started_by="a test", how_to_stop="set release"):
            holding.set()
            release.wait(120)

    owner = threading.Thread(target=hold)
    owner.start()
    try:
        assert holding.wait(120)
        with pytest.raises(SessionBusyError, match=r"^session.generate\(\) cannot run now: a check, started by a test, "
                                                    r"is running\. .* wait for it to end, or set release; then"):
            session.generate()
        assert str(session.activity) == "a check, started by a test"
    finally:
        release.set()
        owner.join(timeout=120)
    assert session.activity is None and session.generate() is session.rollout
