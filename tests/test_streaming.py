"""Streaming datasets (``datasets.IterableDataset``) for training and evaluation: prompts in stream
order, epochs, and a resume that continues at the saved position of the same stream."""

import pandas as pd
import pytest
from datasets import Dataset, IterableDataset

from grpo_lab import GRPOSession, GRPOTrainer
from grpo_lab.core.stream_sampler import StreamSampler
from tests.conftest import SMALL


def _stream(rows: list[dict]) -> IterableDataset:
    return Dataset.from_list(rows).to_iterable_dataset()


def test_the_sampler_reads_in_order_starts_epochs_and_resumes_at_its_position():
    stream = _stream([{"prompt": f"p{i}"} for i in range(5)])
    sampler = StreamSampler(stream, prompts_per_batch=2)
    drawn = []
    for _ in range(4):
        indices = sampler.next_indices()
        drawn.append(sampler.rows_at(indices)["prompt"])
    # 5 rows, batches of 2: p4 does not fill a batch and is dropped; the second epoch starts again
    assert drawn == [["p0", "p1"], ["p2", "p3"], ["p0", "p1"], ["p2", "p3"]]
    assert sampler.state_dict() == {"epoch": 1, "position": 4}
    again = StreamSampler(stream, prompts_per_batch=2)
    again.load_state_dict({"epoch": 0, "position": 2})
    assert again.rows_at(again.next_indices())["prompt"] == ["p2", "p3"]
    with pytest.raises(ValueError, match="holds 1 prompts but one generation batch needs 2"):
        StreamSampler(_stream([{"prompt": "only"}]), prompts_per_batch=2).next_indices()


def _config(task, tmp_path, **overrides):
    return task.config(**{**SMALL, "output_dir": str(tmp_path), "disable_tqdm": True, **overrides})


def test_a_stream_of_the_same_prompts_trains_like_the_dataset_unshuffled(task, tmp_path):
    rows = task.train_dataset.select(range(16))
    mapped = GRPOSession(task.model, task.reward_funcs, args=_config(task, tmp_path / "a", shuffle_dataset=False),
                         train_dataset=rows)
    mapped.run(3)  # one session after the other: a session seeds torch's generator when it is built
    streamed = GRPOSession(task.model, task.reward_funcs, args=_config(task, tmp_path / "b", shuffle_dataset=False),
                           train_dataset=rows.to_iterable_dataset())
    streamed.run(3)
    columns = [c for c in mapped.history.columns if c not in ("step_time", "epoch")]
    pd.testing.assert_frame_equal(streamed.history[columns], mapped.history[columns])
    assert mapped.completions_log["prompt"].tolist() == streamed.completions_log["prompt"].tolist()


def test_a_streamed_run_needs_max_steps(task, tmp_path):
    with pytest.raises(ValueError, match="is a stream .* set max_steps"):
        GRPOSession(task.model, task.reward_funcs, args=_config(task, tmp_path, max_steps=-1),
                    train_dataset=task.train_dataset.to_iterable_dataset())


def test_a_streamed_trainer_resumes_at_the_stream_position(task, tmp_path):
    stream = task.train_dataset.select(range(32)).to_iterable_dataset()
    args = dict(max_steps=4, save_steps=2)
    eval_stream = task.eval_dataset.select(range(4)).to_iterable_dataset()
    whole = GRPOTrainer(task.model, task.reward_funcs, args=_config(task, tmp_path / "whole", **args),
                        train_dataset=stream, eval_dataset=eval_stream)
    assert whole.eval_dataset is eval_stream  # as given, as TRL's trainer shows it
    assert whole.args.accelerator_config.dispatch_batches is False  # TRL's setting for iterable datasets
    whole.train()
    assert not (tmp_path / "whole" / "checkpoint-2" / "train_dataset").exists()  # a stream is not stored
    metrics = whole.evaluate()  # read whole: it has a length for the throughput
    assert metrics["eval_samples_per_second"] == pytest.approx(4 / metrics["eval_runtime"], rel=0.05)
    resumed = GRPOTrainer(task.model, task.reward_funcs, args=_config(task, tmp_path / "resumed", **args),
                          train_dataset=stream)
    resumed.train(resume_from_checkpoint=tmp_path / "whole" / "checkpoint-2")
    drop = ["step_time"]
    pd.testing.assert_frame_equal(resumed.session.history.drop(columns=drop), whole.session.history.drop(columns=drop))
    with pytest.raises(ValueError, match="streamed its prompts .* pass the same stream as train_dataset="):
        GRPOSession.load(tmp_path / "whole" / "checkpoint-2")


def test_a_shuffled_stream_resumes_in_the_epoch_order_it_was_in():
    stream = _stream([{"prompt": f"p{i}"} for i in range(6)]).shuffle(seed=3, buffer_size=6)
    sampler = StreamSampler(stream, prompts_per_batch=2)
    drawn, states = [], []
    for _ in range(6):  # three epochs of three batches... two epochs: 3 batches each
        states.append(sampler.state_dict())
        drawn.append(sampler.rows_at(sampler.next_indices())["prompt"])
    assert drawn[:3] != drawn[3:]  # set_epoch reshuffled the second pass
    for state, expected in zip(states, drawn):
        resumed = StreamSampler(stream, prompts_per_batch=2)
        resumed.load_state_dict(state)
        assert resumed.rows_at(resumed.next_indices())["prompt"] == expected


def test_a_session_evaluates_a_stream_it_is_given(make_session, task):
    session = make_session()
    metrics = session.evaluate(task.eval_dataset.select(range(4)).to_iterable_dataset())
    assert "eval_reward" in metrics


def test_dispatch_batches_true_with_a_stream_is_refused_with_trls_message(task, tmp_path):
    config = _config(task, tmp_path)
    config.accelerator_config = {"dispatch_batches": True}  # as a config built elsewhere may hold it
    with pytest.raises(ValueError, match="Iterable datasets require `dispatch_batches=False`"):
        GRPOTrainer(task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset.to_iterable_dataset())
