"""dynamic_sampling (DAPO): generate() fills the batch with groups whose rewards differ, drawing and
scoring further rounds; the dropped groups stay on the batch. Resuming after a kill and two processes:
tests/test_generation_modes_resume.py."""

import functools
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from grpo_lab import GRPOConfig, GRPOTrainer, ops
from grpo_lab.core.dynamic_sampling import check_dynamic_sampling, dropped_kind, groups_kept
from grpo_lab.errors import ConfigError
from grpo_lab.tasks.addition import completion_text
from tests.conftest import SMALL

SPREAD = dict(temperature=2.0, dynamic_sampling=True)
"""A temperature at which the shipped model's completions of one prompt differ, with dynamic sampling."""


def parity_reward(completions, answer, **kwargs):
    """The same reward for every completion of a prompt whose answer is even (no signal); a checksum
    of the completion's text otherwise (a spread, mostly)."""
    return [1.0 if int(a) % 2 == 0 else float(sum(map(ord, completion_text(c))) % 7)
            for c, a in zip(completions, answer, strict=True)]


def constant_reward(completions, **kwargs):
    return [0.0] * len(completions)


def test_groups_with_signal_are_those_whose_values_are_not_all_equal():
    values_B = torch.tensor([1.0, 1.0, 1.0,   0.0, 1.0, 0.0,   2.0, float("nan"), 2.0,   float("nan"), 3.0, 4.0,
                             float("nan"), float("nan"), 5.0])
    assert ops.groups_with_signal(values_B, 3).tolist() == [False, True, False, True, False]
    with pytest.raises(ValueError, match="do not split into groups of 4"):
        ops.groups_with_signal(values_B, 4)


def test_a_dropped_group_is_too_easy_nearer_the_highest_value_drawn_and_by_the_pass_threshold_when_all_tie():
    assert dropped_kind(1.0, highest=1.0, lowest=0.0, pass_threshold=1.0) == "too easy"
    assert dropped_kind(0.0, highest=1.0, lowest=0.0, pass_threshold=1.0) == "too hard"
    assert dropped_kind(0.75, highest=1.0, lowest=0.0, pass_threshold=1.0) == "too easy"
    assert dropped_kind(0.5, highest=1.0, lowest=0.0, pass_threshold=1.0) == "too hard"  # midway: not easy
    assert dropped_kind(1.0, highest=1.0, lowest=1.0, pass_threshold=1.0) == "too easy"  # every group solved
    assert dropped_kind(0.5, highest=0.5, lowest=0.5, pass_threshold=1.0) == "too hard"


def test_under_normalize_then_sum_a_group_is_kept_where_any_weighted_function_differs():
    # two groups of two; group 0: a tied sum (1 + 0, 0 + 1) of differing functions; group 1: both tied
    scores = SimpleNamespace(rewards_BF=torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, 1.0]]),
                             reward_names=["a", "b"])
    sums_B = scores.rewards_BF.sum(dim=1)
    gdpo = SimpleNamespace(num_generations=2, dynamic_sampling_metric="reward", reward_weights=None,
                           multi_objective_aggregation="normalize_then_sum")
    assert groups_kept(scores, sums_B, gdpo).tolist() == [True, False]
    trl = SimpleNamespace(**{**vars(gdpo), "multi_objective_aggregation": "sum_then_normalize"})
    assert groups_kept(scores, sums_B, trl).tolist() == [False, False]  # the sums are all that counts there
    unweighted_b = SimpleNamespace(**{**vars(gdpo), "reward_weights": [1.0, 0.0]})
    assert groups_kept(scores, sums_B, unweighted_b).tolist() == [True, False]  # a differs in group 0


def test_a_filled_batch_holds_only_groups_with_a_spread_scored_once_and_keeps_the_dropped_ones(make_session):
    calls = []

    def counted_parity(completions, answer, **kwargs):
        calls.append(len(completions))
        return parity_reward(completions, answer)

    session = make_session(reward_funcs=[counted_parity], **SPREAD)
    prompts_per_round = session.engine.sampler.prompts_per_batch
    for _ in range(3):
        position = session.engine.sampler.state_dict()
        calls.clear()
        rollout = session.generate()
        record = rollout.dynamic_sampling
        assert calls == [len(rollout)] * record.rounds  # every round scored once, in generate()
        assert record.rounds < session.config.dynamic_sampling_max_rounds
        scores = session.score()
        assert len(calls) == record.rounds  # score() returns generate()'s rewards
        assert torch.equal(scores.rewards_BF, record.rewards_BF)
        advantages = session.advantages()
        assert advantages.metrics["frac_reward_zero_std"] == 0.0
        assert advantages.metrics["dynamic_sampling/rounds"] == record.rounds
        assert advantages.metrics["dynamic_sampling/frac_groups_filled"] == 0.0
        assert not record.filler_B.any()
        # the batch: whole kept groups, numbered like any batch, each with a spread
        G = session.config.num_generations
        assert len(rollout) == session.engine.batching.generation_batch_size
        assert rollout.group_index_B.tolist() == torch.arange(len(rollout) // G).repeat_interleave(G).tolist()
        rewards_NG = scores.rewards_BF[:, 0].view(-1, G)
        assert all(len(set(group.tolist())) > 1 for group in rewards_NG)
        for answer, group in zip(rollout.columns["answer"][::G], rewards_NG):
            assert int(answer) % 2 == 1  # an even answer's group is all 1.0: never kept
        # the dropped groups: each of one value, the reason given, counted in the metrics
        dropped = record.dropped_frame()
        assert len(dropped) % G == 0 and set(dropped["why"]) <= {"too easy", "too hard"}
        assert all(frame["value"].nunique() == 1 for _, frame in dropped.groupby(["round", "group"]))
        drawn = record.rounds * prompts_per_round
        dropped_share = (advantages.metrics["dynamic_sampling/frac_groups_dropped_too_easy"]
                         + advantages.metrics["dynamic_sampling/frac_groups_dropped_too_hard"])
        assert dropped_share == pytest.approx(len(dropped) / G / drawn)
        tokens = advantages.metrics["dynamic_sampling/tokens_per_kept_group"]
        assert tokens >= float(rollout.completion_lengths_B.sum()) / (len(rollout) // G)  # the dropped ones count too
        # the sampler moved on by every round's prompts
        sampler = session.engine.sampler
        assert sampler.epoch * sampler.dataset_size + sampler.position == (
            position["epoch"] * sampler.dataset_size + position["position"] + drawn)
        session.loss(), session.update()


def solved_reward(completions, **kwargs):
    return [1.0] * len(completions)


def test_when_every_group_is_solved_the_dropped_ones_are_too_easy(make_session):
    row = make_session(reward_funcs=[solved_reward], dynamic_sampling=True, dynamic_sampling_max_rounds=3).step()
    assert row["dynamic_sampling/frac_groups_dropped_too_easy"] == pytest.approx(2 / 3)
    assert row["dynamic_sampling/frac_groups_dropped_too_hard"] == 0.0


def test_when_the_rounds_run_out_dropped_groups_fill_the_batch_trained_on_or_masked(make_session):
    results = {}
    for fill in ("zero_signal", "masked"):
        session = make_session(reward_funcs=[constant_reward], dynamic_sampling=True, dynamic_sampling_max_rounds=3,
                               dynamic_sampling_fill=fill, entropy_coef=0.01)  # a term that trains without advantages
        row = session.step()
        assert row["dynamic_sampling/rounds"] == 3.0
        assert row["dynamic_sampling/frac_groups_filled"] == 1.0 and row["frac_reward_zero_std"] == 1.0
        # 3 rounds of 2 groups, none kept; 2 taken back to fill the batch: 4 of the 6 dropped
        assert row["dynamic_sampling/frac_groups_dropped_too_hard"] == pytest.approx(2 / 3)
        assert session.last_trained.advantages.scores.rollout.dynamic_sampling.filler_B.all()
        results[fill] = row
    assert results["zero_signal"]["grad_norm"] > 0  # the entropy term of the filled groups
    assert results["masked"]["grad_norm"] == 0.0 and results["masked"]["loss"] == 0.0  # none of their tokens counts


def test_settings_dynamic_sampling_cannot_fill_a_batch_under_are_refused(make_session):
    with pytest.raises(ConfigError, match="dynamic_sampling_fill='drop' is not supported. Allowed values: "
                                          "'zero_signal', 'masked'."):
        GRPOConfig(dynamic_sampling_fill="drop")
    with pytest.raises(ConfigError, match="dynamic_sampling_max_rounds must be"):
        GRPOConfig(dynamic_sampling_max_rounds=0)
    with pytest.raises(ConfigError, match=r"dynamic_sampling_metric='accuracy' names no reward function of this run "
                                          r"\(correctness_reward, format_reward\)"):
        make_session(dynamic_sampling=True, dynamic_sampling_metric="accuracy")
    config = GRPOConfig(num_generations=4, per_device_train_batch_size=2, generation_batch_size=4,
                        dynamic_sampling=True)
    with pytest.raises(ConfigError, match="a share holds 2 completions, not a multiple of num_generations"):
        check_dynamic_sampling(config, config.resolve(2), 2, ["reward"], None)
    whole = GRPOConfig(num_generations=4, per_device_train_batch_size=4, dynamic_sampling=True)
    check_dynamic_sampling(whole, whole.resolve(2), 2, ["reward"], None)  # a share of 4 completions: one group
    session = make_session(**SPREAD, dynamic_sampling_metric="format_reward")
    session.config.dynamic_sampling_metric = "missing"  # a live edit is checked at the next generate()
    with pytest.raises(ConfigError, match="names no reward function"):
        session.generate()
    assert session.next_stage == "generate"


def test_a_named_reward_decides_which_groups_are_kept(make_session, task):
    session = make_session(reward_funcs=[parity_reward, constant_reward], **SPREAD,
                           dynamic_sampling_metric="parity_reward")
    session.generate()
    rewards_BF = session.score().rewards_BF
    G = session.config.num_generations
    assert all(len(set(group.tolist())) > 1 for group in rewards_BF[:, 0].view(-1, G))
    assert (rewards_BF[:, 1] == 0).all()  # the constant reward alone would have kept nothing


def a_high_scorer_and_a_spread(rewards) -> bool:
    """Keeps a group where some completion's parity reward reaches 4 and the rewards differ."""
    return bool(rewards["parity_reward"].max() >= 4) and bool(rewards["reward"].std() > 0)


def test_a_function_decides_per_group_from_its_rewards_by_name():
    # two groups of three: group 0 holds a correct answer (1.0), group 1 none; a metric keeping the former
    scores = SimpleNamespace(rewards_BF=torch.tensor([[0.0, 2.0], [1.0, 2.0], [0.0, 2.0],
                                                      [0.0, 1.0], [0.0, 3.0], [0.0, 2.0]]),
                             reward_names=["correct", "length"])
    sums_B = scores.rewards_BF.sum(dim=1)  # 2, 3, 2, 1, 3, 2: both groups differ
    seen = []

    def any_correct(rewards):
        seen.append({name: values.tolist() for name, values in rewards.items()})
        return rewards["correct"].max() == 1  # a one-element tensor

    config = SimpleNamespace(num_generations=3, dynamic_sampling_metric=any_correct, reward_weights=None,
                             multi_objective_aggregation="sum_then_normalize")
    assert groups_kept(scores, sums_B, config).tolist() == [True, False]
    assert seen == [{"reward": [2.0, 3.0, 2.0], "correct": [0.0, 1.0, 0.0], "length": [2.0, 2.0, 2.0]},
                    {"reward": [1.0, 3.0, 2.0], "correct": [0.0, 0.0, 0.0], "length": [1.0, 3.0, 2.0]}]
    config.dynamic_sampling_metric = lambda rewards: rewards["reward"]  # three values, no decision
    with pytest.raises(TypeError, match="must return True to keep the group or False to drop it"):
        groups_kept(scores, sums_B, config)


def test_a_function_given_as_the_metric_keeps_the_groups_it_accepts_and_comes_back_from_a_save(make_session, tmp_path):
    from grpo_lab import GRPOSession

    session = make_session(reward_funcs=[parity_reward], **SPREAD, dynamic_sampling_metric=a_high_scorer_and_a_spread)
    rollout = session.generate()
    G = session.config.num_generations
    record = rollout.dynamic_sampling
    kept_NG = record.rewards_BF[~record.filler_B, 0].view(-1, G)  # not the groups filled in when rounds ran out
    assert len(kept_NG) and all(group.max() >= 4 and len(set(group.tolist())) > 1 for group in kept_NG)
    dropped = record.dropped_frame()  # dropped despite a spread, some of them: the function's call
    spread = [frame["value"].nunique() > 1 for _, frame in dropped.groupby(["round", "group"])]
    assert any(spread)
    assert [why == "by the metric" for why in dropped.groupby(["round", "group"])["why"].first()] == spread
    session.save(tmp_path / "saved")
    assert "dynamic_sampling_metric: tests.test_dynamic_sampling:a_high_scorer_and_a_spread" in (
        tmp_path / "saved" / "config.yaml").read_text()
    loaded = GRPOSession.load(tmp_path / "saved", reward_funcs=[parity_reward])
    assert loaded.config.dynamic_sampling_metric is a_high_scorer_and_a_spread
    for _ in range(2):  # the saved batch, then one the loaded function fills
        a, b = session.step(), loaded.step()
        assert {k: v for k, v in a.items() if k != "step_time"} == {k: v for k, v in b.items() if k != "step_time"}
    assert loaded.config_changes == []  # the function imported again is no edit


def test_a_saved_metric_that_cannot_be_imported_again_is_asked_for(make_session, tmp_path):
    from grpo_lab import GRPOSession

    session = make_session(reward_funcs=[parity_reward], **SPREAD,
                           dynamic_sampling_metric=lambda rewards: bool(rewards["reward"].std() > 0))
    session.save(tmp_path / "saved")
    with pytest.raises(ValueError, match=r"dynamic_sampling_metric function saved in .* \(tests.test_dynamic_sampling:"
                                         r"test_a_saved.*<lambda>\) cannot be found .*make it importable under that "
                                         r"module and name"):
        GRPOSession.load(tmp_path / "saved", reward_funcs=[parity_reward])
    with pytest.raises(ConfigError, match="reads like a function stored by a save: pass the function itself"):
        make_session(reward_funcs=[parity_reward], **SPREAD, dynamic_sampling_metric="mod:keep")
    with pytest.raises(ConfigError, match="dynamic_sampling_metric must be 'reward', a reward function's name or a"):
        make_session(reward_funcs=[parity_reward], **SPREAD, dynamic_sampling_metric=functools.partial(parity_reward))


def test_an_exported_session_script_imports_the_metric_function_its_config_names(make_session, tmp_path):
    import runpy

    session = make_session(reward_funcs=[parity_reward], **SPREAD, dynamic_sampling_metric=a_high_scorer_and_a_spread)
    script = session.export_script(tmp_path / "train.py")
    text = script.read_text()
    assert "from tests.test_dynamic_sampling import a_high_scorer_and_a_spread" in text
    assert "    dynamic_sampling_metric=a_high_scorer_and_a_spread,\n" in text
    settings = runpy.run_path(str(script), run_name="exported")  # its definitions, not its main()
    assert GRPOConfig(**settings["CONFIG"]).dynamic_sampling_metric is a_high_scorer_and_a_spread


def _no_time(history: pd.DataFrame) -> pd.DataFrame:
    return history.drop(columns=["step_time"]).reset_index(drop=True)


def test_the_trainer_and_a_session_fill_the_same_batches(make_session, task, tmp_path):
    session = make_session(reward_funcs=[parity_reward], **SPREAD, max_steps=3)
    session.run(3, progress=False)
    config = task.config(**{**SMALL, **SPREAD, "max_steps": 3, "output_dir": str(tmp_path / "trainer"),
                            "save_strategy": "no"})
    trainer = GRPOTrainer(task.model, [parity_reward], args=config, train_dataset=task.train_dataset)
    trainer.train()
    pd.testing.assert_frame_equal(_no_time(trainer.session.history), _no_time(session.history))
    assert (trainer.session.history["frac_reward_zero_std"] == 0).all()


def test_a_saved_filled_batch_loads_with_its_record_and_trains_on_as_it_would_have(make_session, tmp_path):
    from grpo_lab import GRPOSession

    original = make_session(reward_funcs=[parity_reward], **SPREAD)
    original.generate()
    original.save(tmp_path / "mid")
    loaded = GRPOSession.load(tmp_path / "mid", reward_funcs=[parity_reward])
    record, saved = loaded.rollout.dynamic_sampling, original.rollout.dynamic_sampling
    assert record.rounds == saved.rounds and record.dropped == saved.dropped
    assert torch.equal(record.rewards_BF, saved.rewards_BF)
    a, b = original.step(), loaded.step()
    assert {k: v for k, v in a.items() if k != "step_time"} == {k: v for k, v in b.items() if k != "step_time"}


def test_a_reward_function_failing_in_a_later_round_puts_every_round_back(make_session):
    calls, failing = [], [True]

    def parity_failing_in_round_two(completions, answer, **kwargs):
        calls.append(len(completions))
        if failing[0] and len(calls) in (2, 3):  # round two's call and its retry
            raise RuntimeError("the judge is down")
        return parity_reward(completions, answer)

    whole = make_session(reward_funcs=[parity_reward], **SPREAD, doctor="off")
    whole.step()
    session = make_session(reward_funcs=[parity_failing_in_round_two], **SPREAD, doctor="off")
    position = session.engine.sampler.state_dict()
    with pytest.raises(Exception, match="the judge is down"):
        session.generate()
    assert session.engine.sampler.state_dict() == position and session.next_stage == "generate"
    failing[0] = False
    row = session.step()  # the same rounds again, from the same prompts and draws
    expected = whole.history.iloc[0].to_dict()
    assert {k: v for k, v in row.items() if k not in ("step_time",) and "parity" not in k} == pytest.approx(
        {k: v for k, v in expected.items() if k not in ("step_time",) and "parity" not in k})


def test_the_doctors_probe_judges_a_batch_drawn_as_without_dynamic_sampling(make_session):
    from grpo_lab.session.probe import run_probe

    session = make_session(reward_funcs=[parity_reward], **SPREAD)
    probe = run_probe(session.engine)
    assert probe.advantages.scores.rollout.dynamic_sampling is None  # the prompts and rewards as they come
    assert probe.advantages.metrics["frac_reward_zero_std"] > 0  # here: the even answers' tied groups
    assert session.config.dynamic_sampling and session.engine.sampler.state_dict() == {"epoch": 0, "position": 0}
