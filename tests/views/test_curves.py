"""The curves view's data and widget state carry the session's own numbers (see test_browser for
what the page draws from them)."""

import math

import numpy as np
import pandas as pd
import pytest

from grpo_lab.views import curve_data
from grpo_lab.views.plot_widget import curves_state


def _decoded(state, index):
    return np.frombuffer(state[1][index], dtype="<f8")


def _panels(curves):
    return {p.title: p for p in curves.panels}


def test_smooth_is_a_debiased_moving_average():
    # w = 0.5: s1 = 0.5*0 + 0.5*2 = 1 -> 1 / (1 - 0.5) = 2; s2 = 0.5*1 + 0.5*4 = 2.5 -> 2.5 / 0.75 = 3.3333
    assert curve_data.smooth([2.0, 4.0], 0.5) == pytest.approx([2.0, 10 / 3])
    assert curve_data.smooth([1.0, 5.0], 0.0) == [1.0, 5.0]
    smoothed = curve_data.smooth([2.0, float("nan"), 4.0], 0.5)
    assert smoothed[0] == 2.0 and math.isnan(smoothed[1]) and smoothed[2] == pytest.approx(10 / 3)


def _history(**columns):
    steps = len(next(iter(columns.values())))
    return pd.DataFrame({"step": list(range(1, steps + 1)), **columns})


def test_panels_carry_the_history_with_units_and_reward_std_as_a_band():
    history = _history(
        reward=[0.5, 0.75, 1.0], reward_std=[0.1, 0.2, 0.3], **{"rewards/a/mean": [0.0, 1.0, 1.0]},
        entropy=[0.3, 0.2, 0.1], frac_reward_zero_std=[0.5, 0.25, 0.0], grad_norm=[1.0, 2.0, 4.0],
    )
    panels = _panels(curve_data.curve_panels(history))
    reward = panels["reward"]
    assert reward.unit == "reward (mean)" and [s.name for s in reward.series] == ["reward"]
    assert reward.series[0].x.tolist() == [1.0, 2.0, 3.0] and reward.series[0].y.tolist() == [0.5, 0.75, 1.0]
    assert reward.series[0].spread.tolist() == [0.1, 0.2, 0.3]  # drawn as reward ± reward_std
    assert [s.name for s in panels["reward per function"].series] == ["rewards/a/mean"]
    assert panels["entropy"].unit == "nats per token"
    signal = panels[curve_data.LEARNING_SIGNAL]
    assert [(s.name, s.right) for s in signal.series] == [("frac_reward_zero_std", False), ("grad_norm", True)]
    assert signal.right_unit == "grad norm" and signal.y_range == curve_data.SHARE_RANGE


def test_dynamic_sampling_draws_its_shares_with_the_learning_signal_and_its_cost_on_a_panel_of_its_own():
    history = _history(frac_reward_zero_std=[0.0, 0.0, 0.25], grad_norm=[1.0, 2.0, 1.5], **{
        "dynamic_sampling/rounds": [2.0, 3.0, 10.0], "dynamic_sampling/tokens_per_kept_group": [80.0, 95.0, 400.0],
        "dynamic_sampling/frac_groups_dropped_too_easy": [0.1, 0.3, 0.6],
        "dynamic_sampling/frac_groups_dropped_too_hard": [0.4, 0.2, 0.3],
        "dynamic_sampling/frac_groups_filled": [0.0, 0.0, 0.25]})
    panels = _panels(curve_data.curve_panels(history))
    signal = panels[curve_data.LEARNING_SIGNAL]
    assert [s.name for s in signal.series] == ["frac_reward_zero_std", *curve_data.DYNAMIC_SAMPLING_SHARES, "grad_norm"]
    assert {s.name: s.y.tolist() for s in signal.series}["dynamic_sampling/frac_groups_filled"] == [0.0, 0.0, 0.25]
    cost = panels["dynamic sampling"]
    assert [(s.name, s.right) for s in cost.series] == [("dynamic_sampling/rounds", False),
                                                      ("dynamic_sampling/tokens_per_kept_group", True)]
    assert cost.unit == "rounds per batch" and cost.right_unit == "tokens per kept group"
    assert curve_data.LOGGED not in panels  # every dynamic_sampling/* metric is grpo_lab's own


def test_generation_ahead_draws_the_waits_with_the_staleness_on_the_right():
    history = _history(reward=[0.1, 0.2, 0.3], **{
        "async_generation/trainer_wait": [0.5, 0.0, 0.1], "async_generation/generator_idle": [0.2, 0.3, 0.25],
        "async_generation/staleness": [0.0, 1.0, 1.0]})
    panels = _panels(curve_data.curve_panels(history))
    ahead = panels["generation ahead"]
    assert [(s.name, s.right) for s in ahead.series] == [("async_generation/trainer_wait", False),
                                                       ("async_generation/generator_idle", False),
                                                       ("async_generation/staleness", True)]
    assert ahead.unit == "seconds per step" and ahead.right_unit == "staleness (optimizer steps)"
    assert curve_data.LOGGED not in panels


def test_learning_signal_share_of_completions_with_nonzero_advantage():
    log = [
        {"step": [1, 1, 1, 1], "advantage": [0.0, 0.0, 0.7, -0.7]},  # 2 of 4 move the policy
        {"step": [2, 2, 2, 2], "advantage": [0.0, 0.0, 0.0, 0.0]},  # none: every group had equal rewards
        {"step": [3, 3, 3, 3], "advantage": [0.5, -0.5, 1.0, -1.0]},
    ]
    steps, shares = curve_data.nonzero_advantage_share(log)
    assert steps.tolist() == [1.0, 2.0, 3.0] and shares.tolist() == [0.5, 0.0, 1.0]
    history = _history(reward=[1.0, 2.0, 3.0], frac_reward_zero_std=[0.5, 1.0, 0.0])
    signal = _panels(curve_data.curve_panels(history, nonzero_advantage=(steps, shares)))[curve_data.LEARNING_SIGNAL]
    series = {s.name: s for s in signal.series}
    assert series[curve_data.NONZERO_ADVANTAGE].y.tolist() == [0.5, 0.0, 1.0]
    assert series["frac_reward_zero_std"].y.tolist() == [0.5, 1.0, 0.0]


def test_constant_panels_are_summarised_not_drawn():
    history = _history(reward=[1.0, 2.0], kl=[0.0, 0.0], learning_rate=[1e-5, 1e-5])
    curves = curve_data.curve_panels(history)
    assert [p.title for p in curves.panels] == ["reward"]
    assert curves.constant == ["kl = 0", "learning_rate = 1e-05"]
    # one step: nothing is known to be constant yet, every panel is drawn (a flat one on its own range)
    one = curve_data.curve_panels(history.head(1))
    assert [p.title for p in one.panels] == ["reward", "kl", "learning rate"]
    assert _panels(one)["kl"].y_range == (-1.0, 1.0) and _panels(one)["reward"].y_range == (0.5, 1.5)


def test_a_non_finite_value_is_a_gap_with_its_step_listed():
    history = _history(reward=[1.0, float("nan"), 3.0], loss=[0.1, float("inf"), 0.2])
    curves = curve_data.curve_panels(history)
    panels = _panels(curves)
    assert panels["reward"].series[0].nonfinite_steps() == [2.0]
    assert panels["loss"].series[0].nonfinite_steps() == [2.0]
    spec, arrays = curves_state(curves, "")
    loss = next(p for p in spec["panels"] if p["title"] == "loss")["series"][0]
    sent = np.frombuffer(arrays[loss["y"]], dtype="<f8")
    assert sent[0] == 0.1 and math.isnan(sent[1]) and sent[2] == 0.2  # inf travels as a gap
    assert loss["nonfinite"] == [2.0]


def test_loss_zero_by_construction_is_said_not_magnified():
    # beta 0, one update per batch, every loss below 1e-6: rounding around 0
    assert curve_data.loss_is_zero_by_construction(0.0, 1, [1e-8, -2e-8])
    assert not curve_data.loss_is_zero_by_construction(0.04, 1, [1e-8, -2e-8])  # a KL term
    assert not curve_data.loss_is_zero_by_construction(0.0, 2, [1e-8, -2e-8])  # later steps are off-policy
    assert not curve_data.loss_is_zero_by_construction(0.0, 1, [1e-8, 0.02])  # a real value
    history = _history(reward=[1.0, 2.0], loss=[1e-8, -2e-8])
    loss = _panels(curve_data.curve_panels(history, loss_zero=True))["loss"]
    assert loss.note == curve_data.LOSS_ZERO_NOTE and loss.y_range == (-1.0, 1.0)
    # a reward that is always 0: reward and grad norm are constant, and still drawn, as the note says to watch them
    stuck = _history(reward=[0.0, 0.0, 0.0], grad_norm=[0.0, 0.0, 0.0], loss=[0.0, 0.0, 0.0], kl=[0.0, 0.0, 0.0])
    curves = curve_data.curve_panels(stuck, loss_zero=True)
    drawn = [series.name for panel in curves.panels for series in panel.series]
    assert {"reward", "grad_norm", "loss"} <= set(drawn) and curves.constant == ["kl = 0"]
    assert "reward" in curve_data.curve_panels(stuck).constant[0]  # without the note, folded as constant


def test_config_edits_become_marks_one_per_step():
    changes = [
        {"step": 3, "field": "learning_rate", "old": 1e-5, "new": 3e-5},
        {"step": 3, "field": "beta", "old": 0.0, "new": 0.04},
        {"step": 5, "field": "loss_type", "old": "dapo", "new": "grpo"},
    ]
    marks = curve_data.config_marks(changes)
    assert [(m.step, m.text) for m in marks] == [
        (3, "learning_rate: 1e-05 → 3e-05; beta: 0 → 0.04"), (5, "loss_type: dapo → grpo"),
    ]


def test_logged_metrics_panel_holds_only_what_reward_functions_logged():
    history = _history(
        reward=[0.1, 0.2], **{"my/score": [3.0, 4.0], "sampling/importance_sampling_ratio/mean": [1.0, 0.9]},
        step_time=[1.0, 1.0], backward_skipped_fraction=[0.0, 0.5], entropy_coef=[0.01, 0.02], aux_loss=[0.3, 0.2],
        **{"clip_ratio/high_max": [0.1, 0.2], "completions/mean_terminated_length": [4.0, 5.0]},
    )
    panels = {p.title: [s.name for s in p.series] for p in curve_data.curve_panels(history).panels}
    assert panels == {
        "reward": ["reward"],
        "engine diagnostics": ["sampling/importance_sampling_ratio/mean", "entropy_coef", "aux_loss"],
        "logged metrics": ["my/score"],
    }


def test_a_metric_a_step_did_not_log_is_a_plain_gap_not_a_non_finite_value():
    rows = [{"step": 1, "reward": 1.0}, {"step": 2, "reward": 2.0, "kl": float("nan")},
            {"step": 3, "reward": 3.0, "kl": 0.5}]
    history = pd.DataFrame(rows)  # pandas fills the missing kl of step 1 with NaN
    curves = curve_data.curve_panels(history, absent=curve_data.absent_steps(rows, history.columns))
    assert _panels(curves)["kl"].series[0].nonfinite_steps() == [2.0]  # step 2 logged NaN; step 1 logged nothing


def test_ranges_hold_a_one_point_band_and_put_both_zeros_of_the_learning_signal_level():
    one = _panels(curve_data.curve_panels(_history(reward=[0.25], reward_std=[0.4])))["reward"]
    assert one.y_range is None  # not pinned around 0.25: the axis follows the band's edges, -0.15 and 0.65
    flat = _panels(curve_data.curve_panels(_history(reward=[0.25], reward_std=[0.0])))["reward"]
    assert flat.y_range == (0.125, 0.375)
    history = _history(reward=[1.0, 2.0], frac_reward_zero_std=[0.5, 0.25], grad_norm=[0.0, 4.0])
    signal = _panels(curve_data.curve_panels(history))[curve_data.LEARNING_SIGNAL]
    assert signal.y_range == curve_data.SHARE_RANGE
    assert signal.right_range == pytest.approx((-0.05 * 4.0, 1.05 * 4.0))  # 0 grad norm level with share 0


def test_widget_state_decodes_to_the_panels_values_and_shares_the_step_buffer():
    history = _history(reward=[0.5, 0.75], entropy=[0.3, 0.2])
    spec, arrays = curves_state(curve_data.curve_panels(history), "empty")
    reward, entropy = (p["series"][0] for p in spec["panels"])
    assert reward["x"] == entropy["x"]  # one buffer of steps for every series of the history
    assert np.frombuffer(arrays[reward["x"]], dtype="<f8").tolist() == [1.0, 2.0]
    assert np.frombuffer(arrays[entropy["y"]], dtype="<f8").tolist() == [0.3, 0.2]
    assert spec["steps"] == 2 and spec["empty_text"] == "empty"


@pytest.fixture
def session(make_session):
    return make_session()


def test_view_follows_updates_and_a_view_made_later_starts_complete(session):
    view = session.curves()
    assert view.figure.spec["panels"] == [] and "No optimizer step yet" in view.figure.spec["empty_text"]
    figure = view.figure
    session.step()
    session.config.learning_rate = session.config.learning_rate * 2
    session.step()
    assert view.figure is figure  # one widget for the view's life: its state is replaced, never the widget
    reward = next(p for p in figure.spec["panels"] if p["title"] == "reward")["series"][0]
    assert (np.frombuffer(figure.arrays[reward["y"]], dtype="<f8").tolist()
            == pytest.approx(session.history["reward"].tolist()))
    assert [m["step"] for m in figure.spec["marks"]] == [2]
    later = session.curves()  # e.g. a second show(): its state already holds both steps
    assert later.figure.spec == figure.spec
    assert later.figure._library is figure._library  # plotly.js travels once per kernel
    assert view.error.value == "" and later.error.value == ""


def test_learning_signal_panel_reads_the_sessions_completion_log(session):
    view = session.curves()
    session.run(2, progress=False)
    log = session.completions_log
    expected = [float((log[log["step"] == step]["advantage"] != 0).mean()) for step in (1, 2)]
    signal = _panels(view.curves)[curve_data.LEARNING_SIGNAL]
    series = {s.name: s for s in signal.series}
    assert series[curve_data.NONZERO_ADVANTAGE].y.tolist() == pytest.approx(expected)
    assert series["frac_reward_zero_std"].y.tolist() == pytest.approx(session.history["frac_reward_zero_std"].tolist())


def test_evaluations_are_drawn_beside_their_training_metric_one_series_per_eval_set():
    history = _history(reward=[0.5, 0.75, 1.0], loss=[0.1, 0.2, 0.05], **{"rewards/a/mean": [0.0, 1.0, 1.0]},
                       grad_norm=[1.0, 2.0, 3.0])
    evaluations = pd.DataFrame([
        {"step": 0, "eval_reward": 0.25, "eval_loss": 0.01, "eval_rewards/a/mean": 0.0, "eval_hard_reward": 0.0},
        {"step": 2, "eval_reward": 0.5, "eval_loss": float("nan"), "eval_rewards/a/mean": 0.5,
         "eval_hard_reward": 0.25},
    ])
    panels = _panels(curve_data.curve_panels(history, evaluations=evaluations))
    assert curve_data.eval_prefixes(evaluations.columns) == ["eval", "eval_hard"]
    reward = panels["reward"].series
    assert [(s.name, s.evaluation) for s in reward] == [
        ("reward", None), ("eval_reward", "eval"), ("eval_hard_reward", "eval_hard")]
    assert reward[1].x.tolist() == [0.0, 2.0] and reward[1].y.tolist() == [0.25, 0.5]
    assert reward[2].y.tolist() == [0.0, 0.25]
    assert [s.name for s in panels["reward per function"].series] == ["rewards/a/mean", "eval_rewards/a/mean"]
    loss = panels["loss"].series[1]
    assert (loss.name, loss.x.tolist(), loss.y.tolist()) == ("eval_loss", [0.0], [0.01])  # NaN rows left out
    assert [s.name for s in panels[curve_data.LEARNING_SIGNAL].series] == ["grad_norm"]  # not evaluated
    spec, arrays = curves_state(curve_data.curve_panels(history, evaluations=evaluations), "")
    drawn = next(p for p in spec["panels"] if p["title"] == "reward")["series"][1]
    assert drawn["evaluation"] == "eval" and _decoded((spec, arrays), drawn["y"]).tolist() == [0.25, 0.5]


def test_the_view_redraws_after_an_evaluation(session):
    view = session.curves()
    session.step()
    metrics = session.evaluate()
    reward = next(p for p in view.figure.spec["panels"] if p["title"] == "reward")["series"]
    assert [s["name"] for s in reward] == ["reward", "eval_reward"]
    assert _decoded((view.figure.spec, view.figure.arrays), reward[1]["y"]).tolist() == [metrics["eval_reward"]]
    assert session.evaluations[["step", "eval_reward"]].to_dict("records") == [
        {"step": 1, "eval_reward": metrics["eval_reward"]}]


def test_the_static_picture_draws_each_panel_as_lines_with_gaps_where_values_are_not_finite():
    from grpo_lab.views import charts

    # x: steps 1..4 across 300 px less the 44 px axis margin and 10 px right margin (246 px from x = 44);
    # y: 0..2 over the 110 px between the top (18) and the bottom (128)
    x, y = np.array([1.0, 2.0, 3.0, 4.0]), np.array([0.0, 1.0, math.nan, 2.0])
    points = charts.curve_points(x, y, (1.0, 4.0), 0.0, 2.0)
    assert points == ["44.0,128.0 126.0,73.0", "290.0,18.0"]
    history = _history(reward=[1.0, 2.0, 1.5], loss=[0.1, 0.2, 0.3], kl=[0.0, 0.0, 0.0])
    picture = charts.curves_svg(curve_data.curve_panels(history))
    assert picture.count("<svg") == 2 and picture.count("<polyline") == 2  # reward and loss; kl is constant
    assert "Constant: kl = 0" in picture and "reward" in picture
