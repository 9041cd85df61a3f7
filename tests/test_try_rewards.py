"""The reward workbench: session.try_rewards and session.use_rewards (grpo_lab/session/rewards.py,
grpo_lab/session/reward_trial.py), on real sessions of the shipped model."""

import copy
import random
import re

import numpy as np
import pytest
import torch

from grpo_lab.session.reward_trial import (
    AdvantageSettings,
    batch_advantages,
    correlations,
    disagreements,
    in_a_discordant_pair,
    groups_with_signal_N,
    signal_values_B,
)
from grpo_lab.rewards import RewardFunctionError
from grpo_lab.session.rewards import REWARD_INPUTS, group_runs, once_per_group, per_completion, shown_columns
from grpo_lab.session.stages import StageOrderError
from grpo_lab.tasks.addition import correctness_reward, format_reward
from tests.test_session_experiments import _history, _weights
from tests.test_session_experiments import _same_tensors as _same


def constant_reward(completions, **kwargs):
    return [0.5] * len(completions)


def current_total(completions, answer, **kwargs):
    """The session's own total reward (correctness + format, weights 1)."""
    return [c + f for c, f in zip(correctness_reward(completions, answer), format_reward(completions))]


# ---------------------------------------------------------------- the arithmetic, by hand
def test_rank_differences_by_hand():
    current, new = np.array([0.0, 1.0, 2.0, 3.0]), np.array([3.0, 1.0, 2.0, 0.0])
    # scaled ranks: current [0, 1/3, 2/3, 1], new [1, 1/3, 2/3, 0]: rows 0 and 3 swap ends, 1 and 2 agree
    positions, difference = disagreements(new, current, k=5)
    assert positions.tolist() == [0, 3] and difference.tolist() == [1.0, -1.0]
    # a None (NaN) reward is left out: of the three rows left, [0, 1, 2] vs [1, 0.5, 0] ranked as [1, 0.5, 0]
    positions, difference = disagreements(np.array([1.0, np.nan, 0.5, 0.0]), np.array([0.0, 5.0, 1.0, 2.0]), k=1)
    assert positions.tolist() == [0] and difference.tolist() == [1.0]
    # ties: scaled ranks current [1/3, 1/3, 1/3, 1], new [1/6, 1/6, 5/6, 5/6] differ everywhere, but the new
    # reward only breaks current's tie (rows 0-2): no pair is ordered oppositely, so no disagreement
    positions, difference = disagreements(np.array([0.0, 0.0, 1.0, 1.0]), np.array([0.0, 0.0, 0.0, 1.0]), k=5)
    assert positions.tolist() == [] and difference.tolist() == []
    # rows 2 and 3 swap (new 1 > 0.5, current 0 < 1); rows 0 and 1, both 0 under both, are in no such pair
    new, current = np.array([0.0, 0.0, 1.0, 0.5]), np.array([0.0, 0.0, 0.0, 1.0])
    assert in_a_discordant_pair(new, current).tolist() == [False, False, True, True]
    # scaled ranks: new [1/6, 1/6, 1, 2/3], current [1/3, 1/3, 1/3, 1]
    positions, difference = disagreements(new, current, k=5)
    assert positions.tolist() == [2, 3] and difference == pytest.approx([2 / 3, -1 / 3])


def test_correlations_by_hand():
    current = np.array([1.0, 2.0, 3.0, 4.0])
    assert correlations(2 * current + 1, current) == pytest.approx((1.0, 1.0))
    pearson, spearman = correlations(current**3, current)  # the same order, not a straight line
    assert spearman == pytest.approx(1.0) and pearson == pytest.approx(np.corrcoef(current, current**3)[0, 1])
    assert pearson < 0.99
    assert all(np.isnan(correlations(np.full(4, 0.5), current)))  # a constant reward has no correlation


def test_groups_with_signal_by_hand():
    rewards_B = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0])  # group 0 tied, group 1 varies
    assert groups_with_signal_N(rewards_B, 4).tolist() == [False, True]
    nan = float("nan")  # None rewards are left out: one number left is no spread, nor is none
    values_B = torch.tensor([1.0, nan, 1.0, 1.0, nan, 2.0, nan, nan, nan, nan, nan, nan])
    assert groups_with_signal_N(values_B, 4).tolist() == [False, False, False]


def half_tied(completions, **kwargs):
    """Equal rewards in the first prompt group, rewards that vary in the second (8 completions, 4 a group)."""
    return [0.5] * 4 + [0.0, 0.1, 0.2, 0.9]


def test_a_group_of_equal_rewards_has_no_signal_under_gdpo_by_hand():
    # GDPO normalizes each function within its group, then centres the sums over the whole batch: a group
    # whose rewards are all equal gets the same small advantage (not 0) on each of its completions
    settings = AdvantageSettings(num_generations=4, scale_rewards="group",
                                 multi_objective_aggregation="normalize_then_sum")
    rewards_BF = torch.tensor([[1.0] * 4 + [0.0, 0.3, 0.7, 1.0] + [0.1, 0.2, 0.9, 0.4]]).T
    stats = batch_advantages(rewards_BF, None, settings)
    assert (stats.advantages_B[:4] != 0).all() and stats.advantages_B[:4].abs().max() < 1e-6
    assert groups_with_signal_N(rewards_BF[:, 0], 4).tolist() == [False, True, True]
    values_B = signal_values_B(stats.rewards_B, stats.advantages_B, "normalize_then_sum")
    assert groups_with_signal_N(values_B, 4).tolist() == [False, True, True]
    # two functions whose group-normalized rewards cancel: the total has no signal under GDPO
    rewards_BF = torch.tensor([[1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 1.0, 1.0, 5.0, 1.0, 1.0, 1.0]]).T
    stats = batch_advantages(rewards_BF, None, settings)
    values_B = signal_values_B(stats.rewards_B, stats.advantages_B, "normalize_then_sum")
    assert groups_with_signal_N(values_B, 4).tolist() == [False, True]


def test_under_gdpo_a_group_of_equal_rewards_counts_as_no_signal(make_session):
    session = make_session(multi_objective_aggregation="normalize_then_sum")
    session.use_rewards([half_tied])  # the current rewards: tied in group 0, varying in group 1
    session.generate(), session.score()
    assert (session.advantages().advantages_B[:4] != 0).all()  # the batch-wide centring's rounding
    trial = session.try_rewards([half_tied, constant_reward])
    table = trial.to_pandas()
    assert trial.current_groups_with_signal == 1
    assert table["groups_with_signal"].tolist() == [1, 0, 1]  # half_tied, constant_reward, total
    assert table["groups_gained"].tolist() == [0, 0, 0] and table["groups_lost"].tolist() == [0, 1, 0]


# ---------------------------------------------------------------- on a real session
def test_a_constant_reward_gives_no_group_a_signal(make_session):
    session = make_session()
    session.generate(), session.score()
    trial = session.try_rewards(constant_reward)
    (row,) = trial.to_pandas().to_dict("records")
    assert trial.groups == 2 and row["groups_with_signal"] == 0 and row["signal_share"] == 0.0
    assert row["mean"] == 0.5 and row["std"] == 0.0 and row["min"] == row["max"] == 0.5 and row["none_share"] == 0.0
    assert np.isnan(row["pearson"]) and np.isnan(row["spearman"])
    assert trial.summaries[0].histogram == ([0.5, 0.5], [8])
    assert row["groups_lost"] == row["current_groups_with_signal"] and row["groups_gained"] == 0


def test_the_current_reward_tried_again_correlates_exactly_and_disagrees_nowhere(make_session):
    session = make_session()
    session.generate(), session.score()
    trial = session.try_rewards(current_total)
    frame = trial.completions
    assert frame["current_reward"].nunique() > 1, "the batch should have rewards that vary"
    assert frame["new/current_total"].tolist() == frame["current_reward"].tolist()
    (row,) = trial.to_pandas().to_dict("records")
    assert row["pearson"] == pytest.approx(1.0) and row["spearman"] == pytest.approx(1.0)
    assert row["groups_with_signal"] == row["current_groups_with_signal"]
    assert row["groups_gained"] == row["groups_lost"] == 0
    assert trial.disagreements["current_total"].empty
    # two functions: their weighted total is the current reward, each alone is not
    both = session.try_rewards([correctness_reward, format_reward], weights=[1.0, 1.0]).to_pandas()
    assert list(both.index) == ["correctness_reward", "format_reward", "total"]
    assert both.loc["total", "pearson"] == pytest.approx(1.0) and both.loc["total", "groups_lost"] == 0


def test_the_disagreements_are_the_rows_whose_rank_moved_most(make_session):
    session = make_session()
    session.generate(), session.score()
    current = session.try_rewards(current_total).completions["current_reward"].to_numpy()
    lowest = int(np.argmin(current))  # the first of the lowest-rewarded completions

    def lifts_one(completions, answer, **kwargs):
        values = current_total(completions, answer)
        values[lowest] = max(values) + 10.0  # from the bottom of the ranking to its top
        return values

    trial = session.try_rewards(lifts_one, k=3)
    examples = trial.disagreements["lifts_one"]
    assert examples.index[0] == lowest and examples["rank_difference"].iloc[0] > 0.5
    assert examples["current_reward"].iloc[0] == current.min() and examples["new_reward"].iloc[0] == current.max() + 10
    assert examples["completion"].iloc[0] == session.rollout.completion_texts[lowest]
    assert len(examples) <= 3 and (examples["rank_difference"].abs().diff().dropna() <= 0).all()


def test_history_scores_every_logged_batch_with_the_inputs_training_gave(make_session, tmp_path):
    seen = []

    def recorder(prompts, completions, completion_ids, answer, trainer_state, **kwargs):
        seen.append((prompts, completions, completion_ids, answer, trainer_state.global_step))
        return correctness_reward(completions, answer)

    session = make_session(reward_funcs=[recorder, format_reward])
    session.run(3, progress=False)
    in_training = list(seen)
    seen.clear()
    trial = session.try_rewards(recorder, on="history")
    assert _same(seen, in_training)  # one call per logged batch, with the very inputs of its training call
    log = session.completions_log
    assert "reward_inputs" not in log.columns and len(trial.completions) == len(log) == 24
    assert trial.completions["step"].tolist() == log["step"].tolist() == [1] * 8 + [2] * 8 + [3] * 8
    assert trial.completions["new/recorder"].tolist() == log["rewards/recorder"].tolist()
    tied_N = (log["advantage"].to_numpy().reshape(-1, 4) == 0).all(axis=1)
    assert trial.groups == 6 and trial.current_groups_with_signal == int((~tied_N).sum())
    # the inputs travel with a saved session
    loaded = type(session).load(session.save(tmp_path / "run"), reward_funcs=[recorder, format_reward])
    seen.clear()
    assert loaded.try_rewards(recorder, on="history").completions.equals(trial.completions)
    assert _same(seen, in_training)


def test_the_log_keeps_what_a_prompt_group_shares_once(make_session, tmp_path):
    runs = group_runs([0, 0, 1, 1, 1, 2])
    assert runs == [2, 3, 1]
    assert once_per_group(["a", "a", "b", "b", "b", "c"], runs) == {"per_group": ["a", "b", "c"]}
    assert per_completion({"per_group": ["a", "b", "c"]}, runs) == ["a", "a", "b", "b", "b", "c"]
    varies = ["a", "a", "b", "b", "x", "c"]  # e.g. an environment's reset() that changes one prompt
    assert once_per_group(varies, runs) is varies and per_completion(varies, runs) is varies
    assert once_per_group([1, 1.0], [2]) == [1, 1.0]  # equal values of two types: each kept as it was
    arrays = [np.arange(3), np.arange(3)]  # == is elementwise: kept whole
    assert once_per_group(arrays, [2]) is arrays and once_per_group([arrays[0]] * 2, [2]) == {"per_group": [arrays[0]]}
    seen = []

    def recorder(prompts, answer, **kwargs):
        seen.append((prompts, answer))
        return correctness_reward(kwargs["completions"], answer)

    session = make_session(reward_funcs=[recorder, format_reward])
    session.run(2, progress=False)
    (prompts, answer), inputs = seen[0], session.record.completion_log[0][REWARD_INPUTS]
    assert inputs["prompts"] == {"per_group": [prompts[0], prompts[4]]} and isinstance(prompts[0], list)
    assert inputs["columns"]["answer"] == {"per_group": [answer[0], answer[4]]}
    in_training = list(seen)
    seen.clear()
    session.try_rewards(recorder, on="history")  # given back one per completion
    assert _same(seen, in_training)


def test_history_leaves_out_a_batch_logged_without_the_inputs_with_a_warning(make_session):
    session = make_session()
    session.run(2, progress=False)
    log = session.record.completion_log
    log[0] = shown_columns(log[0])  # as an earlier release logged it
    with pytest.warns(UserWarning, match=r"1 logged batch\(es\) were logged without the reward functions' inputs "
                                         r"\(by an earlier grpo_lab\) and are left out"):
        trial = session.try_rewards(correctness_reward, on="history")
    assert trial.completions["step"].tolist() == [2] * 8
    session.record.completion_log[1] = shown_columns(session.record.completion_log[1])
    with pytest.raises(StageOrderError, match="none that kept the reward functions' inputs.*earlier grpo_lab"):
        session.try_rewards(correctness_reward, on="history")


def test_undo_to_before_use_rewards_says_the_functions_stay_and_how_to_fix_it(make_session, recwarn):
    session = make_session(reward_weights=[1.0, 1.0])
    session.run(1, progress=False)
    session.use_rewards([correctness_reward])
    session.step()
    session.step()
    assert session.undo() == 2  # to after the swap: nothing to say
    assert not [w for w in recwarn if "use_rewards" in str(w.message)]
    with pytest.warns(UserWarning, match=(
            r"undo\(\) returned to step 1, before use_rewards\(\) at step 2: the config is back \(reward_weights = "
            r"\[1.0, 1.0\], set for correctness_reward, format_reward\) but not the reward functions.*still "
            r"correctness_reward\. The next advantages\(\) refuses them: 2 weights for 1 functions\. To train on "
            r"the functions of step 1 again, call session.use_rewards\(\[correctness_reward, format_reward\], "
            r"weights=\[1.0, 1.0\]\); to keep the current ones, set session.config.reward_weights")):
        assert session.undo() == 1
    with pytest.raises(ValueError, match="reward_weights has 2 entries but there are 1 reward functions"):
        session.step()
    session.use_rewards([correctness_reward, format_reward], weights=[1.0, 1.0])  # the fix the warning names
    assert session.step()["step"] == 2


def test_try_rewards_changes_nothing_in_the_session(make_session):
    def draws(completions, **kwargs):  # moves every random generator it can reach
        return [random.random() + float(torch.rand(())) + float(np.random.rand()) for _ in completions]

    session = make_session()
    session.run(2, progress=False)
    session.generate(), session.score()
    before = (_weights(session), session.random_state(), session.rollout, session.scores,
              session.scores.rewards_BF.clone(), _history(session), list(session.record.completion_log),
              copy.deepcopy(session.record.completion_log), list(session.reward_funcs), session.config.to_dict(),
              list(session.config_changes), session.next_stage)
    session.try_rewards([draws, constant_reward], on="batch")
    session.try_rewards(draws, on="history")
    after = (_weights(session), session.random_state(), session.rollout, session.scores,
             session.scores.rewards_BF, _history(session), list(session.record.completion_log),
             session.record.completion_log, list(session.reward_funcs), session.config.to_dict(),
             list(session.config_changes), session.next_stage)
    assert _same(after[:2], before[:2]) and after[2] is before[2] and after[3] is before[3]
    assert _same(after[4], before[4]) and after[5].equals(before[5])
    assert all(a is b for a, b in zip(after[6], before[6])) and after[7] == before[7]
    assert all(a is b for a, b in zip(after[8], before[8])) and after[9:] == before[9:]
    twin = make_session()  # built (and seeded) after: a session's first stage draws from the process's state
    twin.run(2, progress=False)
    twin.generate(), twin.score()
    for each in (session, twin):  # and it goes on exactly as the twin that tried nothing
        each.step()
        each.step()
    assert _history(session).equals(_history(twin)) and _same(_weights(session), _weights(twin))


def test_an_unscored_batch_is_tried_without_a_comparison(make_session):
    session = make_session()
    session.generate()
    trial = session.try_rewards(correctness_reward)
    assert trial.current_groups_with_signal is None and trial.disagreements == {}
    assert "call session.score()" in repr(trial) and np.isnan(trial.to_pandas()["pearson"].iloc[0])
    assert session.next_stage == "score"


def test_bad_input_is_refused_with_the_fix(make_session):
    session = make_session()
    with pytest.raises(StageOrderError, match=r"no.*Call session.generate\(\) first"):
        session.try_rewards(correctness_reward)
    with pytest.raises(StageOrderError, match=r"history.*none.*session.step\(\)"):
        session.try_rewards(correctness_reward, on="history")
    session.generate(), session.score()
    with pytest.raises(ValueError, match="'batch'.*'history'"):
        session.try_rewards(correctness_reward, on="logs")
    with pytest.raises(TypeError, match="must be callable"):
        session.try_rewards(42)
    with pytest.raises(ValueError, match="reward_weights has 1 entries.*2 reward functions"):
        session.try_rewards([correctness_reward, format_reward], weights=[1.0])
    with pytest.raises(ValueError, match="finite numbers"):
        session.try_rewards(correctness_reward, weights=[float("nan")])

    def broken(completions, **kwargs):
        raise KeyError("no such column")

    with pytest.raises(RewardFunctionError, match="'broken' raised KeyError.*no such column"):
        session.try_rewards([format_reward, broken])
    assert session.next_stage == "advantages" and session.step()["step"] == 1  # the session goes on


def test_a_tried_function_that_hangs_is_stopped_by_the_sessions_timeout(make_session):
    import threading

    release = threading.Event()

    def stuck(completions, **kwargs):
        release.wait(60)
        return [0.0] * len(completions)

    session = make_session(reward_timeout=0.5, reward_timeout_sync=True)
    session.generate(), session.score()
    try:
        with pytest.raises(RewardFunctionError, match="'stuck' did not finish within reward_timeout=0.5"):
            session.try_rewards(stuck)
    finally:
        release.set()
    assert session.next_stage == "advantages"


def test_the_result_displays_as_tables_and_histograms(make_session):
    session = make_session()
    session.generate(), session.score()
    trial = session.try_rewards([correctness_reward, constant_reward])
    text, page = repr(trial), trial._repr_html_()
    assert text.startswith("RewardTrial: 8 completions of the held batch") and "Largest rank differences" in text
    assert page.count("<svg") == 4 and "constant_reward" in page  # current, two functions, total
    header = re.search(r"<thead>(.*?)</thead>", page, re.S).group(1)  # a column per function: a screen wide
    assert re.findall(r"<th>([^<]+)</th>", header) == ["name", "correctness_reward", "constant_reward", "total"]
    assert "<th>spearman</th>" in page
    figure = trial.figure()
    assert [bar.name for bar in figure.data] == ["current reward", "correctness_reward", "constant_reward", "total"]
    assert sum(figure.data[2].y) == 8


def test_use_rewards_swaps_the_functions_in_one_recorded_edit(make_session):
    session = make_session()
    session.run(1, progress=False)
    session.generate(), session.score()
    with pytest.raises(ValueError, match="reward_weights has 2 entries"):
        session.use_rewards([correctness_reward], weights=[1.0, 2.0])
    with pytest.raises(TypeError, match="must be callable"):
        session.use_rewards([correctness_reward, 3])
    assert session.config_changes == [] and session.next_stage == "advantages"  # refused: nothing changed
    session.use_rewards([correctness_reward, constant_reward], weights=[2.0, 1.0])
    assert session.config_changes == [
        {"step": 2, "field": "reward_funcs", "old": ["correctness_reward", "format_reward"],
         "new": ["correctness_reward", "constant_reward"]},
        {"step": 2, "field": "reward_weights", "old": None, "new": [2.0, 1.0]},
    ]
    assert session.reward_funcs == [correctness_reward, constant_reward] and session.config.reward_weights == [2.0, 1.0]
    assert session.next_stage == "score"  # the held batch is scored again by the new functions
    row = session.step()
    assert "rewards/constant_reward/mean" in row and "rewards/format_reward/mean" not in row
    log = session.completions_log
    new = log[log["step"] == 2]
    assert (new["reward"] == 2 * new["rewards/correctness_reward"] + 0.5).all()
    from grpo_lab.views.curve_data import config_marks

    (mark,) = config_marks(session.config_changes)
    assert mark.step == 2 and "reward_funcs" in mark.text and "constant_reward" in mark.text


def test_history_gives_back_a_rollout_functions_extra_columns(task, tmp_path):
    from grpo_lab import GRPOSession
    from tests.conftest import SMALL

    def answers_with_a_note(prompts, session):
        out = session.sample(prompts)
        return {"prompt_ids": out["prompt_ids"], "completion_ids": out["completion_ids"], "logprobs": out["logprobs"],
                "note": [f"length {len(ids)}" for ids in out["completion_ids"]]}

    seen = []

    def recorder(completions, completion_ids, note, answer, **kwargs):
        seen.append((completions, completion_ids, note, answer))
        return [float(len(ids)) for ids in completion_ids]

    config = task.config(**{**SMALL, "output_dir": str(tmp_path / "out")})
    session = GRPOSession(task.model, [recorder], args=config, train_dataset=task.train_dataset,
                          rollout_func=answers_with_a_note)
    session.run(2, progress=False)
    in_training = list(seen)
    seen.clear()
    trial = session.try_rewards(recorder, on="history")
    assert _same(seen, in_training) and trial.to_pandas().loc["recorder", "pearson"] == pytest.approx(1.0)


def test_a_library_reward_whose_column_the_dataset_lacks_is_told_to_rename_the_column(make_session):
    from grpo_lab.rewards import accuracy_reward

    session = make_session()
    session.generate()
    for call in (lambda: session.try_rewards(accuracy_reward), lambda: session.use_rewards([accuracy_reward])):
        with pytest.raises(TypeError, match=r"reads the dataset column\(s\) solution.*rename_column\('answer', "
                                            r"'solution'\)"):
            call()
    assert session.engine.reward_names == ["correctness_reward", "format_reward"]  # the swap was refused whole
