"""async_generation (one-step-off): generate() returns the batch launched at the previous generate(),
generated with the weights of then; runs are deterministic and resume exactly. In-process backends
here (transformers); the vLLM server's overlap is tested in tests/rollout/test_vllm.py."""


import pandas as pd
import pytest
import torch

from grpo_lab import GRPOSession
from grpo_lab.errors import ConfigError
from tests.conftest import SMALL

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
TIMES = ["step_time", "async_generation/trainer_wait", "async_generation/generator_idle"]


def _comparable(history: pd.DataFrame) -> pd.DataFrame:
    return history.drop(columns=[c for c in TIMES if c in history.columns]).reset_index(drop=True)


def _weights(model) -> dict:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def _assert_same_weights(model, weights: dict) -> None:
    for name, value in model.state_dict().items():
        assert torch.equal(value, weights[name]), name


def test_each_batch_is_the_one_launched_a_generate_before_with_the_weights_of_then(make_session):
    session = make_session(async_generation=True)
    backend, launched_at = session.engine.rollout_backend, []
    generate = backend.generate

    def recorded(texts, config):
        launched_at.append((session.global_step, _weights(session.model)["model.embed_tokens.weight"]))
        return generate(texts, config)

    backend.generate = recorded
    trained = []
    session.on(lambda stage, result: trained.append(result) if stage == "generate" else None)
    session.run(4, progress=False)
    # the first generate() generates its batch and the next one; every later one launches one more
    assert [step for step, _ in launched_at] == [0, 0, 1, 2, 3]
    assert [rollout.policy_version for rollout in trained] == [0, 0, 1, 2]
    assert [rollout.step for rollout in trained] == [0, 1, 2, 3]
    assert session.history["async_generation/staleness"].tolist() == [0.0, 1.0, 1.0, 1.0]
    # in-process, a batch is done when launched: the trainer never waits, the generator waits for it
    assert (session.history["async_generation/trainer_wait"] == 0).all()
    assert (session.history["async_generation/generator_idle"] > 0).all()
    assert not torch.equal(launched_at[1][1], launched_at[2][1])  # the weights moved between the launches


def test_async_runs_are_deterministic(make_session):
    first, second = make_session(async_generation=True), make_session(async_generation=True)
    first.run(4, progress=False)
    second.run(4, progress=False)
    pd.testing.assert_frame_equal(_comparable(first.history), _comparable(second.history))
    _assert_same_weights(second.model, _weights(first.model))


def test_a_failed_launch_puts_the_sampler_back_and_the_run_goes_on_as_if_it_had_not_failed(make_session):
    whole = make_session(async_generation=True)
    whole.run(3, progress=False)
    session = make_session(async_generation=True)
    backend, calls = session.engine.rollout_backend, []
    generate = backend.generate

    def fails_once(texts, config):  # the launch of the second batch, inside the first generate()
        calls.append(len(texts))
        if len(calls) == 2:
            raise ConnectionError("the generator went away")
        return generate(texts, config)

    backend.generate = fails_once
    position = session.engine.sampler.state_dict()
    with pytest.raises(ConnectionError, match="went away"):
        session.step()
    assert session.engine.sampler.state_dict() == position and session.next_stage == "generate"
    session.run(3, progress=False)
    pd.testing.assert_frame_equal(_comparable(session.history), _comparable(whole.history))


def first_group_spread(completions, **kwargs):
    """Rewards 0, 1, 2, ... for the first group of each call and 0 elsewhere: under dynamic sampling every
    round keeps its first group and drops the others, so a batch of two groups takes two rounds."""
    G = SMALL["num_generations"]
    return [float(i) if i < G else 0.0 for i in range(len(completions))]


def test_with_dynamic_sampling_each_round_is_a_batch_prepared_ahead_and_a_batch_is_as_stale_as_its_first(
        make_session):
    session = make_session(reward_funcs=[first_group_spread], async_generation=True)
    backend, launched_at = session.engine.rollout_backend, []
    generate = backend.generate

    def recorded(texts, config):
        launched_at.append(session.global_step)
        return generate(texts, config)

    backend.generate = recorded
    session.step()  # without dynamic sampling: its batch and the next launched
    session.config.dynamic_sampling = True  # a live edit: the batch prepared then is the next batch's first round
    for _ in range(2):
        rollout = session.generate()
        assert rollout.dynamic_sampling.rounds == 2
        assert rollout.policy_version == session.global_step - 1  # the first round's weights, the oldest
        assert session.score().rewards_BF[:, 0].view(-1, 4)[:, 0].tolist() == [0.0, 0.0]  # each a kept first group
        assert session.advantages().metrics["frac_reward_zero_std"] == 0.0
        session.loss(), session.update()
    # each round taken launches the next: the second of a batch with the current weights, the first of the
    # next batch with them too, one step before it trains
    assert launched_at == [0, 0, 1, 1, 2, 2]
    assert session.history["async_generation/staleness"].tolist() == [0.0, 1.0, 1.0]
    assert (session.history["async_generation/generator_idle"] > 0).all()


@pytest.mark.parametrize("failing, first", [
    ("the reference pass", False), ("the reference pass", True),  # True: in the run's first generate()
    ("a later round's reward", False), ("a Ctrl-C in a later round", False),
])
def test_a_failure_anywhere_in_generate_leaves_the_prepared_batch_and_the_sampler_as_they_were(make_session, failing,
                                                                                              first):
    calls, armed = [], []

    def fails_in_round_two(completions, **kwargs):
        calls.append(1)
        if armed and len(calls) in (2, 3):  # round two's call and its retry
            raise RuntimeError("the judge is down")
        return first_group_spread(completions)

    fails_in_round_two.__name__ = "first_group_spread"  # the same metric names as the uninterrupted run's
    settings = dict(async_generation=True, beta=0.04, doctor="off")
    if failing != "the reference pass":
        settings.update(dynamic_sampling=True, reward_funcs=[first_group_spread])
    whole = make_session(**settings)
    whole.run(3, progress=False)
    if failing == "a later round's reward":
        settings.update(reward_funcs=[fails_in_round_two])
    session = make_session(**settings)
    if not first:
        session.step()  # the second batch is prepared: the failure is in the generate() that takes it
    calls.clear()
    armed.append(True)
    engine = session.engine
    if failing == "the reference pass":
        reference = engine.reference_logprobs

        def interrupted_once(rollout):
            calls.append(1)
            if len(calls) == 1:
                raise KeyboardInterrupt  # Ctrl-C
            return reference(rollout)

        engine.reference_logprobs = interrupted_once
    elif failing == "a Ctrl-C in a later round":
        score = engine.score

        def interrupted_in_round_two(rollout):
            calls.append(1)
            if len(calls) == 2:
                raise KeyboardInterrupt
            return score(rollout)

        engine.score = interrupted_in_round_two
    position = engine.sampler.state_dict()
    with pytest.raises((KeyboardInterrupt, RuntimeError)):
        session.generate()
    assert engine.sampler.state_dict() == position and session.next_stage == "generate"
    session.run(3 - session.global_step, progress=False)
    pd.testing.assert_frame_equal(_comparable(session.history), _comparable(whole.history))
    _assert_same_weights(session.model, _weights(whole.model))


def test_a_saved_run_resumes_with_its_prepared_batch_and_undo_and_the_doctor_leave_it_alone(make_session, tmp_path):
    whole = make_session(async_generation=True)
    whole.run(5, progress=False)
    part = make_session(async_generation=True)
    part.run(3, progress=False)
    part.doctor()  # its probe generates a batch of its own
    part.step()
    part.undo()  # back to step 3, with the batch prepared then
    part.save(tmp_path / "run")
    loaded = GRPOSession.load(tmp_path / "run")
    assert loaded.global_step == 3
    loaded.run(2, progress=False)
    pd.testing.assert_frame_equal(_comparable(loaded.history), _comparable(whole.history))
    _assert_same_weights(loaded.model, _weights(whole.model))


def test_a_rollout_function_is_refused(task, tmp_path):
    def rollout(prompts, trainer):
        raise AssertionError("never called: the session is refused first")

    config = task.config(**{**SMALL, "async_generation": True, "output_dir": str(tmp_path)})
    with pytest.raises(ConfigError, match="async_generation is not supported with rollout_func"):
        GRPOSession(task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset, rollout_func=rollout)
