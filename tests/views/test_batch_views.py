"""The batch views: which batch each view shows and says it shows, the numbers of the batch charts
(hand-built inputs, hand-derived numbers) and what the completions and rewards views display."""

import html
import math
import re
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from grpo_lab.views import batch as batches
from grpo_lab.views import charts, data, render

NAN = float("nan")


# ---------------------------------------------------------------------------------- pure data
def test_pass_rates_binary_and_batch_max_with_none_left_out():
    scores = SimpleNamespace(reward_names=["binary", "graded", "never"], rewards_BF=torch.tensor([
        [1.0, 0.5, NAN],
        [0.0, 1.5, NAN],
        [1.0, 1.5, NAN],
        [NAN, 0.2, NAN],
    ]))
    summary = data.reward_summary(scores).set_index("function")
    # binary: 0/1 only -> pass where > 0: 2 of the 3 numbers (the None is left out, counted in none_share)
    assert summary.loc["binary", "pass_rule"] == "> 0 (binary)"
    assert summary.loc["binary", "pass_rate"] == pytest.approx(2 / 3) and summary.loc["binary", "none_share"] == 0.25
    # graded: the batch max is 1.5, reached by 2 of 4
    assert summary.loc["graded", "pass_rule"] == "= 1.5 (batch max)" and summary.loc["graded", "pass_rate"] == 0.5
    assert math.isnan(summary.loc["never", "pass_rate"]) and summary.loc["never", "none_share"] == 1.0


def test_a_constant_function_is_named_constant_not_none():
    scores = SimpleNamespace(reward_names=["varies", "same"],
                             rewards_BF=torch.tensor([[0.0, 1.0], [1.0, 1.0], [2.0, NAN]]))
    correlation = data.reward_correlation(scores)
    assert correlation.constant == ["same"] and correlation.matrix.loc["varies", "varies"] == pytest.approx(1.0)
    shown = render.correlation_html(correlation)
    cells = re.findall(r"<td[^>]*>([^<]*)</td>", shown)
    assert cells == ["1.000", "constant", "constant", "constant"]
    assert "same returned the same value for every completion" in shown
    assert "None" not in shown and "nan" not in shown


def test_group_flags_count_distinct_completions():
    frame = pd.DataFrame({"group": [0, 0, 0, 1, 1], "prompt": ["p", "p", "p", "q", "q"],
                          "completion": ["a", "a", "b", "c", "d"], "truncated": [False, True, False, False, False]})
    flags = data.group_flags(frame)
    assert flags["size"].tolist() == [3, 2] and flags["distinct"].tolist() == [2, 2]
    assert flags["truncated"].tolist() == [1, 0] and "std_zero" not in flags
    scored = data.group_flags(frame.assign(reward=[1.0, NAN, 0.0, 2.0, 2.0],
                                           group_std_zero=[False, False, False, True, True]))
    assert scored["reward_mean"].tolist() == [0.5, 2.0]  # the None (NaN) left out of the first group's mean
    assert scored["std_zero"].tolist() == [False, True]


def test_group_values_split_by_group_and_count_none():
    values = batches.group_values(torch.tensor([1, 0, 1, 1, 0]), torch.tensor([2.0, 1.0, 2.0, 0.5, NAN]))
    assert values.groups == [0, 1] and values.values == [[1.0], [2.0, 2.0, 0.5]] and values.missing == 1
    svg = charts.reward_strip_svg(values, "r")
    assert "group 1: 2.000 × 2" in svg and "group 1: 0.500 × 1" in svg  # equal values share one dot
    assert "group 1: mean 1.500" in svg and "r (1 None)" in svg  # (2 + 2 + 0.5) / 3


def test_histogram_bins_from_min_to_max():
    # 4 bins of width 0.5 over [-1, 1]: -1 | (none) | 0, 0 | 1 (the last bin includes its right edge)
    assert batches.histogram([-1.0, 0.0, 0.0, 1.0], bins=4) == ([-1.0, -0.5, 0.0, 0.5, 1.0], [1, 0, 2, 1])
    assert batches.histogram([0.0, 0.0, 0.0]) == ([0.0, 0.0], [3])  # every advantage 0: one bin
    assert batches.histogram([NAN]) == ([], [])
    svg = charts.histogram_svg(batches.histogram([-1.0, 0.0, 0.0, 1.0], bins=4), "advantages")
    assert re.findall(r"\]: (\d+)</title>", svg) == ["1", "0", "2", "1"]


def _hand_batch():
    """3 completions of 3 tokens; the last loss() trained on completions 0 and 2; token 2 of
    completion 2 is padding and token 1 of completion 0 was inserted by an environment."""
    rollout = SimpleNamespace(
        completion_ids_BT=torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 0]]),
        completion_mask_BT=torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0]]),
        generated_mask_BT=torch.tensor([[1, 0, 1], [1, 1, 1], [1, 1, 0]]),
        sampling_logprobs_BT=None, old_logprobs_BT=None,
    )
    advantages = SimpleNamespace(advantages_B=torch.tensor([2.0, 0.0, -1.0]))
    loss = SimpleNamespace(
        sample_index_B=torch.tensor([0, 2]), advantages=advantages,
        logprobs_BT=torch.tensor([[-0.1, -0.2, -0.3], [-1.0, -2.0, -3.0]]),
        entropies_BT=torch.tensor([[0.5, 0.6, 0.7], [1.5, 2.5, 3.5]]),
        ratio_BT=torch.tensor([[1.0, 1.1, 0.9], [1.2, 0.8, 1.0]]),
        clipped_BT=torch.tensor([[False, True, False], [True, False, False]]),
    )
    return batches.Batch(rollout, None, advantages, loss, step=4, stage="loss")


def test_token_values_cover_the_trained_completions_only():
    batch = _hand_batch()
    product_BT = data.token_values_BT(batch, "advantage_x_ratio")
    # completion 0: 2 * [1.0, (environment), 0.9]; completion 1: not trained; completion 2: -1 * [1.2, 0.8], padding
    assert (product_BT[0, 0] == pytest.approx(2.0) and math.isnan(product_BT[0, 1])
            and product_BT[0, 2] == pytest.approx(1.8))
    assert torch.isnan(product_BT[1]).all()
    assert product_BT[2, :2].tolist() == pytest.approx([-1.2, -0.8]) and math.isnan(product_BT[2, 2])
    # one scale for the whole batch: ±(largest magnitude) = ±2.0
    assert data.token_scale(product_BT, "advantage_x_ratio") == (-2.0, 2.0, "diverging")
    # entropy: from the batch's smallest (0.5) to its largest (2.5: 3.5 sits on padding) over every completion
    assert data.token_scale(data.token_values_BT(batch, "entropy"), "entropy") == (0.5, 2.5, "sequential")
    assert data.token_scale(data.token_values_BT(batch, "logprob"), "logprob") == (0.0, 1.0, "probability")
    assert (data.missing_token_reason(batch, 1, "logprob")
            == "the completion is not in the optimizer step of the last loss()")
    assert data.missing_token_reason(batch, 0, "logprob").startswith("inserted by the environment")
    assert data.missing_token_reason(batch._replace(loss=None), 0, "logprob") == "not computed yet: run session.loss()"
    tokenizer = SimpleNamespace(decode=lambda ids: f"<{ids[0]}>")
    assert data.tokens_of(batch, tokenizer, 2, data.token_values_BT(batch, "clipped")) == [("<5>", 1.0), ("<6>", 0.0)]


def test_token_colours_use_probability_and_a_centred_scale():
    probability = data.TokenScale(0.0, 1.0, "probability")
    # p = 1 is near white (alpha 0.05), p = 0.2 is 0.9 - 0.85 * 0.2 = 0.73, whatever the other tokens are
    assert render.token_colour(0.0, probability) == "rgba(214,39,40,0.05)"
    assert render.token_colour(math.log(0.2), probability) == "rgba(214,39,40,0.73)"
    centred = data.TokenScale(-2.0, 2.0, "diverging")
    assert render.token_colour(2.0, centred) == "rgba(214,39,40,1.00)"
    assert render.token_colour(-1.0, centred) == "rgba(31,119,180,0.50)"
    assert render.token_colour(0.0, centred) == "rgba(31,119,180,0.00)"  # white at 0
    assert render.token_colour(None, centred) == "#eeeeee"
    legend = render.token_legend("advantage_x_ratio", centred)
    assert "advantage × ratio" in legend and "one scale for every completion of this batch" in legend
    assert ">-2<" in legend and ">2 (white = 0)<" in legend and "linear-gradient" in legend
    assert "p = 0 (unlikely)" in render.token_legend("logprob", probability)


def test_tables_align_numbers_hide_the_index_and_explain_missing_values():
    frame = pd.DataFrame({"name": ["a", "b"], "value": [0.5, NAN], "count": [3, 4]}, index=[7, 9])
    columns = [render.Column("name", "name", "the name", text=True),
               render.Column("value", "val", "value: what it is", missing="not computed"),
               render.Column("count", "n", "count")]
    shown = render.table_html(frame, columns, "things")
    assert re.findall(r"<td[^>]*>([^<]*)</td>", shown) == ["a", "0.500", "3", "b", "—", "4"]  # no index 7, 9
    assert "title='value: what it is'>val</th>" in shown and "title='not computed'>—</td>" in shown
    assert "text-align:right" in shown and "overflow-x:auto" in shown


def test_header_says_step_and_stage_and_marks_an_older_batch():
    assert batches.header(batches.EMPTY, "generate", "score") == ("Nothing to show yet: run session.score().", False)
    current = batches.Batch(None, None, None, None, step=7, stage="advantages")
    assert batches.header(current, "loss", "score") == (
        "Batch for step 7, after advantages(); next stage: loss().", False)
    previous = current._replace(step=6, stage="update", previous=True)
    text, older = batches.header(previous, "score", "score")
    assert older and text.startswith("From the previous batch (trained at step 6)") and "run session.score()" in text
    assert "previous batch</span>" in render.header_html(previous, "score", "score")


# ---------------------------------------------------------------------------------- views of real sessions
@pytest.fixture
def session(make_session):
    return make_session()


def test_rewards_view_marks_the_previous_batch_until_score(session):
    view = session.rewards_view()
    assert "No rewards yet" in view.body.value
    session.step()
    assert "Batch trained at step 1 (after update())" in view.header.value
    session.generate()
    assert "previous batch</span>" in view.header.value and "trained at step 1" in view.header.value
    assert "run session.score()" in view.header.value and "rewards per function" in view.body.value
    session.score()
    assert "Batch for step 2, after score()" in view.header.value and "previous batch" not in view.header.value
    assert "advantage histogram: run session.advantages()" in view.body.value
    session.advantages()
    equal = int(session.advantages_result.is_std_zero_B.sum())
    assert f"{equal} of {len(session.rollout)} completions are in groups with equal rewards" in view.body.value
    counts = [int(n) for n in re.findall(r"\]: (\d+)</title></rect>", view.body.value)]
    assert sum(counts) == len(session.rollout)  # the histogram holds every advantage
    assert "log_metric" not in view.body.value and "backward_skipped_fraction" not in view.body.value
    assert view.error.value == ""


def test_completions_view_before_score_says_rewards_are_not_scored(session):
    view = session.completions_view()
    session.generate()
    assert "rewards not scored yet: run session.score()" in view.overview.value
    assert "equal rewards" not in view.overview.value
    assert "Batch for step 1, after generate()" in view.header.value
    session.score()
    assert "advantages not computed yet" in view.overview.value
    session.advantages()
    assert "group(s) with equal rewards" in view.overview.value


def test_a_view_created_after_training_shows_the_trained_batch(session):
    session.step()
    assert session.rollout is None  # update() discarded the batch
    view = session.completions_view()
    assert "Batch trained at step 1 (after update())" in view.header.value
    trained = session.last_trained
    group_B = trained.advantages.scores.rollout.group_index_B
    rows = int((group_B == view.group.value).sum())
    assert view.table.value.count("<tr") == rows + 1
    # the tokens carry the trained step's log-probs: the first token of the group's first completion
    position = int((group_B == view.group.value).nonzero()[0])
    row = int((trained.sample_index_B == position).nonzero()[0])
    assert f'title="logprob = {float(trained.logprobs_BT[row, 0]):.4g} (p = ' in view.table.value
    assert view.error.value == ""


def test_token_colours_share_one_scale_over_the_batch(session):
    view = session.completions_view()
    session.generate(), session.score(), session.advantages(), session.loss()
    view.quantity.value = "entropy"
    result, rollout = session.loss_result, session.rollout
    mask_BT = rollout.generated_mask_BT[result.sample_index_B].bool()
    entropies = result.entropies_BT[:, : mask_BT.shape[1]][mask_BT[:, : result.entropies_BT.shape[1]]]
    low, high = float(entropies.min()), float(entropies.max())  # over every group, not the one shown
    assert f"<span>{low:.3g}</span>" in view.overview.value and f"<span>{high:.3g}</span>" in view.overview.value
    view.quantity.value = "advantage_x_ratio"
    assert "advantage × ratio" in view.overview.value and "white = 0" in view.overview.value
    assert "<details><summary" in view.table.value and "text-overflow:ellipsis" in view.table.value


def test_missing_rewards_show_a_dash_and_why(make_session, task):
    def sometimes(completions, **kwargs):
        return [None if i % 2 else 1.0 for i in range(len(completions))]

    def constant(completions, **kwargs):
        return [0.5] * len(completions)

    session = make_session(reward_funcs=[*task.reward_funcs, sometimes, constant])
    completions, rewards = session.completions_view(), session.rewards_view()
    session.generate(), session.score()
    assert "title='sometimes returned None for this completion'>—</td>" in completions.table.value
    assert "<i>None</i>" not in completions.table.value and ">nan<" not in completions.table.value
    summary = data.reward_summary(session.scores).set_index("function")
    assert summary.loc["sometimes", "none_share"] == 0.5 and summary.loc["sometimes", "pass_rate"] == 1.0
    assert ">50.0%</td>" in rewards.body.value and ">100.0%</td>" in rewards.body.value
    cells = re.findall(r"<td[^>]*>([^<]*)</td>", rewards.body.value)
    assert "constant" in cells and "None" not in cells and "nan" not in cells


def test_rewards_view_shows_what_reward_functions_logged_only(make_session, task):
    def logging(completions, log_metric, **kwargs):
        log_metric("my_metric", 2.0)
        log_metric("my_metric", 4.0)
        return [1.0] * len(completions)

    session = make_session(reward_funcs=[*task.reward_funcs, logging])
    view = session.rewards_view()
    session.step()
    assert "logged with log_metric" in view.body.value
    cells = re.findall(r"<td[^>]*>([^<]*)</td>", view.body.value.split("logged with log_metric")[1])
    assert cells == ["my_metric", "3.000", "2"]  # (2 + 4) / 2, two calls
    assert "backward_skipped_fraction" not in view.body.value


def test_a_failing_batch_view_keeps_its_error_in_place(session, monkeypatch):
    view = session.rewards_view()

    def broken(scores):
        raise RuntimeError("broken summary")

    monkeypatch.setattr(data, "reward_summary", broken)
    session.step()
    assert "broken summary" in view.error.value and session.global_step == 1


def test_a_batch_that_feeds_two_steps_keeps_its_tokens_between_them(make_session):
    session = make_session(num_iterations=2)
    view = session.completions_view()
    session.step()
    assert session.next_stage == "loss" and session.loss_result is None  # the batch feeds one more step
    assert "Batch trained at step 1 (after update()); next stage: loss()." in view.header.value
    assert 'title="logprob = ' in view.table.value  # coloured by the loss() of step 1
    session.loss()
    assert "Batch for step 2, after loss()" in view.header.value


def test_the_completions_view_shows_what_dynamic_sampling_dropped_folded_away(make_session):
    from tests.test_dynamic_sampling import SPREAD, parity_reward

    session = make_session(reward_funcs=[parity_reward], **SPREAD)
    record = session.generate().dynamic_sampling
    shown = session.completions_view().overview.value
    groups = len(record.dropped_frame().drop_duplicates(["round", "group"]))
    assert groups > 0
    assert f"dynamic sampling: {record.rounds} round(s) drawn; {groups} group(s) dropped for equal values" in shown
    assert "<details class='grpo-dropped-groups'>" in shown and "filled in" not in shown
    assert "rewards computed by generate() (dynamic sampling), not taken yet: run session.score()" in shown
    first = record.dropped_frame().iloc[0]
    assert f"title='{html.escape(first['completion'], quote=True)}'" in shown and f">{first['why']}<" in shown
