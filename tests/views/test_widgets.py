"""The ipywidgets views follow the session's events (real widgets, no browser; see test_browser)."""

import pytest
import torch


@pytest.fixture
def session(make_session):
    return make_session()


def test_dashboard_parts_follow_the_stages_without_errors(session):
    dashboard = session.show()
    session.step()
    session.step()
    assert dashboard.curves.curves.steps == 2
    for part in (dashboard.controls, dashboard.curves, dashboard.completions, dashboard.rewards):
        assert part.error.value == "", part.error.value


def test_completions_view_shows_each_group_and_switches_quantity(session):
    view = session.completions_view()
    session.generate()
    assert len(view.group.options) == session.config.per_device_train_batch_size // session.config.num_generations
    session.score(), session.advantages(), session.loss()
    assert view.table.value.count("<tr>") + view.table.value.count("<tr ") == session.config.num_generations + 1
    view.quantity.value = "entropy"
    assert "entropy = " in view.table.value
    view.group.value = view.group.options[-1][1]
    assert view.error.value == ""


def test_a_failing_view_never_stops_training(session, monkeypatch):
    from grpo_lab.views import curve_data

    view = session.curves()

    def broken(*args, **kwargs):
        raise RuntimeError("broken panel")

    monkeypatch.setattr(curve_data, "curve_panels", broken)
    row = session.step()
    assert row["step"] == 1 and "broken panel" in view.error.value


def test_completions_view_offers_the_vllm_gap_only_with_sampling_logprobs(session):
    view = session.completions_view()
    session.generate()
    assert "vllm_logprob_gap" not in view.quantity.options  # transformers: no sampling log-probs
    rollout = session.rollout
    rollout.old_logprobs_BT = torch.full(rollout.completion_ids_BT.shape, -1.0)
    rollout.sampling_logprobs_BT = torch.full(rollout.completion_ids_BT.shape, -1.25)  # emulated vLLM output
    view.refresh()
    view.quantity.value = "vllm_logprob_gap"
    assert "log π_trainer − log π_vLLM" in view.overview.value
    group_B = rollout.group_index_B == view.group.value
    # every completion token of the group, and no padding token, shows -1 - (-1.25) = 0.25
    assert view.table.value.count('title="vllm_logprob_gap = 0.25"') == int(rollout.completion_mask_BT[group_B].sum())
    rollout.sampling_logprobs_BT = None
    view.refresh()
    assert "vllm_logprob_gap" not in view.quantity.options and view.quantity.value == "logprob"
    assert view.error.value == ""


def test_closing_a_dashboard_closes_every_widget_it_made(session):
    from ipywidgets.widgets.widget import _instances

    before = set(_instances)
    dashboard = session.show()
    session.step()
    assert len(set(_instances) - before) > 40
    dashboard.close()
    left = [type(_instances[key]).__name__ for key in set(_instances) - before]
    assert set(left) <= {"PlotlyLibrary"}  # plotly.js, sent once per kernel, stays for the next figure
    assert session._listeners == []


def test_the_findings_panel_shows_doctor_and_live_findings(make_session):
    from tests.test_doctor import always

    session = make_session(reward_funcs=[always(0.0)], max_completion_length=2)
    dashboard = session.show()
    assert "No findings" in dashboard.findings.body.value
    session.doctor()
    assert "<code>truncation</code>" in dashboard.findings.body.value  # refreshed when doctor() ended
    session.run(5, progress=False)
    shown = dashboard.findings.body.value
    assert "<code>no_signal_steps</code>" in shown and "<code>truncation_in_training</code>" in shown
    assert dashboard.findings.error.value == ""
    dashboard.close()


class _Clock:
    def __init__(self):
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


def test_the_pacer_opens_a_round_after_39_times_the_last_round_and_whenever_the_session_goes_idle(monkeypatch):
    from grpo_lab.views import base

    clock = _Clock()
    monkeypatch.setattr(base, "time", clock)
    pacer = base.Pacer()
    pacer.on_event("generate", None)
    assert pacer.round_open  # nothing refreshed yet
    pacer.spent(99.996)  # two views refreshed in this round: 4 ms, then 6 ms
    clock.now = 100.006
    pacer.spent(100.000)
    clock.now = 100.3
    pacer.on_event("score", None)
    assert not pacer.round_open  # the round took 10 ms and ended at 100.006: the next opens at 100.006 + 39 * 0.010
    pacer.on_event("idle", None)
    assert pacer.round_open  # the end of a call: every stale view refreshes
    clock.now = 100.395
    pacer.on_event("advantages", None)
    assert not pacer.round_open
    clock.now = 100.397
    pacer.on_event("loss", None)
    assert pacer.round_open


def test_a_dashboard_refreshes_in_rounds_during_a_run_and_is_current_when_it_returns(session, monkeypatch):
    from grpo_lab.views import base

    monkeypatch.setattr(base.Pacer, "RATIO", 10**9)  # no round opens by time: only the end of the call's
    dashboard = session.show()
    refreshed = []
    for part in (dashboard.controls, dashboard.curves, dashboard.completions, dashboard.rewards):
        original = part.refresh
        part.refresh = lambda original=original, part=part: (refreshed.append(type(part).__name__), original())[1]
    session.run(8, progress=False)  # 40 stage events, each of which the completions view shows
    assert refreshed.count("CompletionsView") == refreshed.count("CurvesView") == refreshed.count("RewardsView") == 1
    assert refreshed.count("Controls") == 2  # at once when the session turned busy and idle
    assert dashboard.curves.curves.steps == 8  # the round at the end of the call drew the last step
    assert f"step {session.global_step}" in dashboard.completions.header.value
    assert not dashboard.controls.run_button.disabled
    for part in (dashboard.controls, dashboard.curves, dashboard.completions, dashboard.rewards):
        assert part.error.value == "", part.error.value
    dashboard.close()
    assert session._listeners == []


def test_a_view_closed_while_the_session_calls_its_listeners_hears_nothing_more(session):
    closed = []

    def close_at_step_two(event, payload):  # listens before the view, as another thread's close may land
        if event == "update" and session.global_step == 2 and not closed:
            view.close()
            closed.append(True)

    session.on(close_at_step_two)
    view = session.completions_view()
    session.run(4, progress=False)
    assert closed and session.global_step == 4 and view.error.value == ""
