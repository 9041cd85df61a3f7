"""``grpo_lab.compare``: runs read from live sessions, saved sessions and trainer output dirs, drawn
as one named series per run on the curves view's panels (see test_browser for what the page draws)."""

import dataclasses
import json

import pytest

import grpo_lab
from grpo_lab.views import compare_data, compare_runs
from grpo_lab.views.curve_data import ForkMark
from grpo_lab.views.plot_widget import curves_state
from tests.conftest import SMALL


def _panels(curves):
    return {panel.title: panel for panel in curves.panels}


def _train(task, output_dir, **overrides):
    """A real GRPOTrainer run of 2 steps: metrics.jsonl and a checkpoint-2 with its config."""
    config = task.config(**{**SMALL, "output_dir": str(output_dir), "max_steps": 2, **overrides})
    trainer = grpo_lab.GRPOTrainer(task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset)
    trainer.train()
    trainer.close()
    return output_dir


def _metrics_dir(path, rows):
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_two_sessions_are_one_named_series_each_on_shared_panels_and_followed_live(make_session):
    first = make_session(learning_rate=1e-3)
    first.run(2, progress=False)
    second = make_session(learning_rate=5e-4)  # built after the first ran: they share the global RNG
    second.run(3, progress=False)

    runs = compare_runs.read_runs([first, second])
    assert [run.name for run in runs] == ["run 1", "run 2"]
    reward = _panels(compare_data.compare_panels(runs))["reward"]
    assert [(s.run, s.run_name, s.x.tolist()) for s in reward.series] == [(0, "run 1", [1, 2]), (1, "run 2", [1, 2, 3])]
    assert reward.series[0].y.tolist() == first.history["reward"].tolist()
    assert reward.series[1].y.tolist() == second.history["reward"].tolist()
    assert all(s.spread is None for s in reward.series)  # no band: two runs' bands would hide each other
    lengths = _panels(compare_data.compare_panels(runs))["completion length"]
    assert [(s.run, s.name) for s in lengths.series][:3] == [
        (0, "completions/mean_length"), (0, "completions/min_length"), (0, "completions/max_length")]

    differences = compare_data.config_differences(runs)
    assert differences.loc["learning_rate"].tolist() == [1e-3, 5e-4]
    assert "seed" not in differences.index and list(differences.columns) == ["run 1", "run 2"]

    forked = [runs[0], dataclasses.replace(runs[1], fork_point=2)]
    curves = compare_data.compare_panels(forked)
    assert curves.forks == [ForkMark(2, 1, "run 2")]
    spec, _ = curves_state(curves, "")
    assert spec["forks"] == [{"step": 2, "run": 1, "name": "run 2"}]
    assert [(s["run"], s["run_name"]) for s in spec["panels"][0]["series"]] == [(0, "run 1"), (1, "run 2")]

    view = grpo_lab.compare(first, second, names=["fast", "slow"])
    assert view.names == ["fast", "slow"] and "learning_rate" in view.config_table.value
    first.step()  # the view follows the live session
    reward = _panels(view.curves)["reward"]
    assert [len(s.x) for s in reward.series] == [3, 3] and view.error.value == ""
    view.close()
    assert first._listeners == [] and second._listeners == []


def test_saved_sessions_and_trainer_output_dirs_are_read_without_building_a_model(make_session, task, tmp_path):
    session = make_session()
    session.run(2, progress=False)
    session.save(tmp_path / "saved")
    trained = _train(task, tmp_path / "trained", learning_rate=5e-4)

    saved, trainer_run = compare_runs.read_runs([tmp_path / "saved", trained])
    assert (saved.name, trainer_run.name) == ("saved", "trained")
    assert [row["reward"] for row in saved.rows] == session.history["reward"].tolist()
    logged = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    assert trainer_run.rows == logged and [row["step"] for row in logged] == [1, 2]
    assert trainer_run.config["learning_rate"] == 5e-4  # from checkpoint-2/config.yaml
    assert saved.config == session.config.to_dict()  # the saved config, with every field filled in
    assert compare_data.config_differences([saved, trainer_run]).loc["learning_rate"].tolist() == [1e-3, 5e-4]
    reward = _panels(compare_data.compare_panels([saved, trainer_run]))["reward"]
    assert [s.run_name for s in reward.series] == ["saved", "trained"]

    (checkpoint,) = compare_runs.read_runs([trained / "checkpoint-2"])
    assert checkpoint.name == "trained/checkpoint-2" and len(checkpoint.rows) == 2

    # a fresh run appended to the same metrics.jsonl (the trainer warns that it appends), ending in a cut line
    lines = (trained / "metrics.jsonl").read_text()
    appended = _metrics_dir(tmp_path / "appended", [])
    (appended / "metrics.jsonl").write_text(lines + "not json\n[1, 2]\n" + lines + lines.splitlines()[0][:20])
    with pytest.warns(UserWarning, match=r"metrics.jsonl: line\(s\) 3, 4, 7 are not metric rows.*cut short by a run "
                                         r"stopped while writing.*left out of the comparison"):
        (again,) = compare_runs.read_runs([appended])
    assert again.rows == logged and again.config is None


def test_a_metric_only_some_runs_log_is_drawn_for_those_and_the_panel_says_so(make_session):
    without_kl = make_session()  # beta 0: no reference model, no kl
    without_kl.run(2, progress=False)
    with_kl = make_session(beta=0.04)
    with_kl.run(2, progress=False)

    panels = _panels(compare_data.compare_panels(compare_runs.read_runs([without_kl, with_kl], names=["a", "b"])))
    assert [s.run_name for s in panels["kl"].series] == ["b"] and panels["kl"].note == "kl only in b"
    assert [s.run_name for s in panels["reward"].series] == ["a", "b"] and panels["reward"].note == ""


def test_runs_that_share_no_metric_are_refused_naming_the_fix(tmp_path):
    grpo = _metrics_dir(tmp_path / "grpo", [{"step": 1, "reward": 0.5}, {"step": 2, "reward": 0.75}])
    other = _metrics_dir(tmp_path / "other", [{"step": 1, "accuracy": 0.5}])
    with pytest.raises(ValueError, match="share no metric") as raised:
        grpo_lab.compare(grpo, other)
    assert "grpo (trainer output in" in str(raised.value) and "TRL's metric names" in str(raised.value)
    # a run with no step yet is no reason to refuse: it is drawn once it logs
    empty = _metrics_dir(tmp_path / "empty", [])
    curves = compare_data.compare_panels(compare_runs.read_runs([grpo, empty]))
    assert [s.run_name for s in _panels(curves)["reward"].series] == ["grpo"] and curves.steps == 2


def test_a_path_or_object_that_is_not_a_run_names_what_is_accepted(tmp_path):
    (tmp_path / "nothing").mkdir()
    for given, said in [(tmp_path / "nothing", "holds neither trainer_state.pt nor metrics.jsonl"),
                        (tmp_path / "missing", "does not exist")]:
        with pytest.raises(ValueError, match=said) as raised:
            grpo_lab.compare(given)
        assert compare_runs.ACCEPTED in str(raised.value)
    with pytest.raises(TypeError, match="Run 2 is a int; compare\\(\\) takes a GRPOSession"):
        compare_runs.read_runs([_metrics_dir(tmp_path / "run", [{"step": 1, "reward": 0.5}]), 42])
    with pytest.raises(ValueError, match="at least one run"):
        grpo_lab.compare()


def test_run_names_are_given_own_or_numbered_and_never_repeat():
    assert compare_data.run_names(["a", None, "a", "a"]) == ["a", "run 2", "a (2)", "a (3)"]
    assert compare_data.run_names(["a", "b"], names=["x", "x"]) == ["x", "x (2)"]
    with pytest.raises(ValueError, match="one name per run"):
        compare_data.run_names(["a", "b"], names=["x"])
