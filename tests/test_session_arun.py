"""``await session.arun(n)``: run(n) on a worker thread while the caller's event loop stays free (what
keeps a notebook page answered during training), stopped by the dashboard's buttons or a cancel."""

import asyncio
import threading

import pandas as pd
import pytest

from grpo_lab.session.ownership import SessionBusyError
from tests.conftest import pause_at


def test_arun_trains_as_run_does(make_session):
    ran = make_session().run(2, progress=False).to_pandas()
    # built after the first ran: the same RNG stream
    awaited = asyncio.run(make_session().arun(2, progress=False)).to_pandas()
    pd.testing.assert_frame_equal(awaited.drop(columns=["step_time"]), ran.drop(columns=["step_time"]))


def test_the_event_loop_stays_free_and_the_dashboard_stop_ends_it_between_stages(make_session):
    session = make_session()
    controls = session.controls()
    paused, resume = pause_at(session, "loss", global_step=1)  # inside the second step, loss() done

    async def scenario():
        training = asyncio.ensure_future(session.arun(5, progress=False))
        ticks = 0
        while not paused.is_set():  # the loop runs other work while the steps train
            await asyncio.sleep(0.01)
            ticks += 1
        assert ticks > 0 and threading.current_thread() is threading.main_thread()
        activity = session.activity
        assert (activity.started_by, activity.where, activity.stoppable) == (
            "a cell (await session.arun)", "step 2 of 5, stage loss()", True)
        with pytest.raises(SessionBusyError, match=r"^session.step\(\) cannot run now: await session.arun\(5\), "
                                                    r"started by a cell \(await session.arun\).*press Stop"):
            session.step()  # a cell (this thread) while the worker holds the session
        assert not controls.stop_button.disabled and not controls.finish_button.disabled
        controls.step_button.click()
        assert "cannot run now" in controls.status.value  # refused and said, not queued
        controls.stop_button.click()
        resume.set()
        return await training

    rows = asyncio.run(scenario()).to_pandas()
    assert list(rows["step"]) == [1] and (session.global_step, session.next_stage) == (1, "update")
    assert session.activity is None and controls.stop_button.disabled and not controls.step_button.disabled
    assert session.step()["step"] == 2  # released: the caller's thread drives it again


def _interrupted_while_awaiting(session, interrupt):
    """``await session.arun(5)``, with ``interrupt(training)`` called while its worker is held inside
    step 1's score(); the rows it returns."""
    paused, resume = pause_at(session, "score", global_step=1)

    async def scenario():
        training = asyncio.ensure_future(session.arun(5, progress=False))
        while not paused.is_set():
            await asyncio.sleep(0.01)
        interrupt(training)
        await asyncio.sleep(0.05)  # delivered while the loop awaits
        resume.set()
        return await training

    return asyncio.run(scenario())


def test_a_cancel_ends_it_between_stages_with_nothing_lost(make_session):
    session = make_session()
    rows = _interrupted_while_awaiting(session, lambda training: training.cancel())  # what an interrupted cell does
    assert list(rows.to_pandas()["step"]) == [1] and (session.global_step, session.next_stage) == (1, "advantages")
    assert session.activity is None


def test_a_kernel_interrupt_while_it_awaits_stops_the_worker_at_the_next_stage_boundary(make_session):
    import os
    import signal

    session = make_session()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:  # SIGINT is what interrupting the kernel sends the main thread: no KeyboardInterrupt while it awaits
        rows = _interrupted_while_awaiting(session, lambda training: os.kill(os.getpid(), signal.SIGINT))
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back when it ends
    finally:
        signal.signal(signal.SIGINT, previous)
    assert list(rows.to_pandas()["step"]) == [1] and (session.global_step, session.next_stage) == (1, "advantages")
    assert session.activity is None


def test_one_kernel_interrupt_stops_every_arun_a_cell_awaits_and_the_handler_is_put_back(make_session):
    import os
    import signal

    first, second = make_session(), make_session()  # one process: their stages take turns
    paused, resume = pause_at(first, "score", global_step=1)

    async def scenario():
        runs = asyncio.gather(first.arun(5, progress=False), second.arun(5, progress=False))
        while not paused.is_set():
            await asyncio.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)
        await asyncio.sleep(0.05)
        resume.set()
        return await runs

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        ran_first, ran_second = asyncio.run(scenario())
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)
    assert list(ran_first.to_pandas()["step"]) == [1] and first.next_stage == "advantages"
    assert len(ran_second) < 5 and second.global_step < 5  # stopped too, at its next stage boundary


@pytest.mark.parametrize("n", [-1, 1.5, True])
def test_arun_refuses_a_step_count_that_is_not_a_whole_number(make_session, n):
    with pytest.raises(ValueError, match=r"arun\(n\) takes a whole number of optimizer steps >= 0"):
        asyncio.run(make_session().arun(n))
