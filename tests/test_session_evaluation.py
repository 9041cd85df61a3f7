"""Evaluation while a session trains: ``run``, ``arun`` and Run N follow ``eval_strategy="steps"`` as the
trainer does, the rows are kept in ``session.evaluations`` (and in saves), and the session and the
trainer report the same evaluations."""

import pandas as pd
import pytest

from grpo_lab import GRPOSession, GRPOTrainer
from tests.conftest import SMALL

SCHEDULE = dict(eval_strategy="steps", eval_steps=2, eval_on_start=True, per_device_eval_batch_size=4,
                num_generations_eval=2, max_steps=3)


def _no_time(frame):
    return frame.drop(columns=["step_time"])


def test_run_evaluates_on_the_trainers_schedule_and_trains_as_without_it(make_session):
    plain = make_session(max_steps=3)
    plain.run(3, progress=False)
    scheduled = make_session(**SCHEDULE)
    scheduled.run(3, progress=False)
    # at the start, every eval_steps, and at the run's last step (max_steps)
    assert scheduled.evaluations["step"].tolist() == [0, 2, 3]
    assert {"eval_reward", "eval_loss", "eval_entropy"} <= set(scheduled.evaluations.columns)
    pd.testing.assert_frame_equal(_no_time(scheduled.history), _no_time(plain.history))
    assert plain.evaluations.empty


def test_evaluations_survive_save_load_and_state_dict(make_session, tmp_path):
    session = make_session(**SCHEDULE)
    session.run(2, progress=False)
    rows = session.evaluations.to_dict("records")
    session.save(tmp_path / "saved")
    loaded = GRPOSession.load(tmp_path / "saved", model=None)
    assert loaded.evaluations.to_dict("records") == rows
    state = session.state_dict()
    session.evaluate()
    session.load_state_dict(state)
    assert session.evaluations.to_dict("records") == rows


def test_a_schedule_without_an_eval_set_is_refused_before_any_stage(task, tmp_path):
    session = GRPOSession(task.model, task.reward_funcs, train_dataset=task.train_dataset,
                          args=task.config(**{**SMALL, "output_dir": str(tmp_path), "eval_strategy": "steps"}))
    with pytest.raises(ValueError, match=r"eval_strategy='steps' .* the session has no eval_dataset"):
        session.run(1, progress=False)
    assert session.global_step == 0 and session.next_stage == "generate"


def test_the_session_and_the_trainer_report_the_same_evaluations(task, tmp_path, make_session):
    session = make_session(**SCHEDULE)
    session.run(3, progress=False)
    config = task.config(**{**SMALL, **SCHEDULE, "output_dir": str(tmp_path / "trainer"), "disable_tqdm": True})
    trainer = GRPOTrainer(task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset,
                          eval_dataset=task.eval_dataset)
    trainer.train()
    logged = [row for row in trainer.state.log_history if "eval_reward" in row]
    assert [row["step"] for row in logged] == session.evaluations["step"].tolist() == [0, 2, 3]
    for row, (_, ours) in zip(logged, session.evaluations.iterrows()):
        for key in ("eval_reward", "eval_loss", "eval_entropy", "eval_completions/mean_length"):
            assert row[key] == pytest.approx(ours[key], abs=1e-6), key
