"""Ctrl-C anywhere in a step: continuing gives the uninterrupted run's weights, bitwise.

The interrupt is a real SIGINT sent to this process at a chosen point (by a hook), as Ctrl-C or a
Jupyter kernel interrupt sends it."""

import contextlib
import os
import signal

import pytest
import torch
from torch.overrides import TorchFunctionMode

STEPS = 3


@pytest.fixture(autouse=True)
def ctrl_c_raises():
    """Python's own SIGINT handler, as an interactive interpreter or a Jupyter kernel has it: a test
    run started in the background (CI) inherits SIGINT ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)


def weights(session) -> dict:
    return {name: tensor.detach().clone() for name, tensor in session.engine.unwrapped_model.state_dict().items()}


def finish(session, steps: int) -> None:
    """Continue as a user does after an interrupt: run what is left, stage by stage."""
    while session.global_step < steps:
        session.step()


@pytest.fixture(scope="module")
def reference(task, tmp_path_factory):
    from grpo_lab import GRPOSession
    from tests.conftest import SMALL

    config = task.config(**{**SMALL, "output_dir": str(tmp_path_factory.mktemp("reference")), "num_iterations": 2})
    session = GRPOSession(task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset,
                          eval_dataset=task.eval_dataset)
    session.run(STEPS, progress=False)  # a batch feeds two steps: interrupts inside a half-used batch too
    return weights(session)


class InterruptOnce:
    """Sends SIGINT the first time a torch function whose name starts with one of ``prefixes`` is
    called inside the block."""

    def __init__(self, *prefixes: str):
        self.prefixes, self.sent = prefixes, False

    def mode(self):
        outer = self

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if not outer.sent and getattr(func, "__name__", "").startswith(outer.prefixes):
                    outer.sent = True
                    ctrl_c()
                return func(*args, **(kwargs or {}))

        return Mode()


def _assert_same(session, reference):
    got = weights(session)
    assert got.keys() == reference.keys()
    for name in reference:
        assert torch.equal(got[name], reference[name]), name


@pytest.mark.parametrize("stage", ["generate", "score", "advantages", "loss", "update"])
def test_an_interrupt_at_a_stage_boundary_continues_bitwise(make_session, reference, stage):
    session = make_session(num_iterations=2)
    session.step()
    while session.next_stage != stage:
        getattr(session, session.next_stage)()
    session.on(lambda name, result: ctrl_c() if name == stage and not hit else None)
    hit = []
    with pytest.raises(KeyboardInterrupt):
        session.step()
    hit.append(True)
    finish(session, STEPS)
    _assert_same(session, reference)


def _interrupted_in_a_forward_pass(session, stage: str, call: int) -> None:
    """Run ``stage``, sending Ctrl-C from the model's ``call``-th forward pass inside it."""
    calls = []

    def hook(*args):
        calls.append(1)
        if len(calls) == call:
            ctrl_c()

    handle = session.engine.unwrapped_model.register_forward_hook(hook)
    try:
        with pytest.raises(KeyboardInterrupt):
            getattr(session, stage)()
    finally:
        handle.remove()
    assert session.next_stage == stage


def test_an_interrupt_inside_generation_restores_the_prompts_and_random_state(make_session, reference):
    session = make_session(num_iterations=2)
    _interrupted_in_a_forward_pass(session, "generate", call=3)  # two tokens sampled: the random generator has moved
    finish(session, STEPS)
    _assert_same(session, reference)


def test_an_interrupt_inside_the_loss_pass_continues_bitwise(make_session, reference):
    session = make_session(num_iterations=2)
    session.generate(), session.score(), session.advantages()
    _interrupted_in_a_forward_pass(session, "loss", call=1)
    finish(session, STEPS)
    _assert_same(session, reference)


@pytest.mark.parametrize("point", ["before_optimizer_step", "after_optimizer_step", "inside_first_adamw_step",
                                   "inside_a_later_adamw_step"])
def test_an_interrupt_inside_update_waits_for_the_whole_update(make_session, reference, point):
    session = make_session(num_iterations=2)
    if point == "inside_a_later_adamw_step":
        session.step()
    while session.next_stage != "update":
        getattr(session, session.next_stage)()
    optimizer, step_before = session.engine.optimizer, session.global_step
    handles = []
    if point == "before_optimizer_step":
        handles.append(optimizer.optimizer.register_step_pre_hook(lambda *args: ctrl_c()))
    elif point == "after_optimizer_step":
        handles.append(optimizer.optimizer.register_step_post_hook(lambda *args: ctrl_c()))
    # AdamW creates each parameter's moments on its first step (zeros_like twice; an interrupt between
    # the two broke every later update) and updates them with fused or foreach kernels later
    interrupt = (InterruptOnce("zeros_like") if point == "inside_first_adamw_step"
                 else InterruptOnce("_fused_adam", "_foreach_"))
    with interrupt.mode() if point.startswith("inside") else contextlib.nullcontext(), pytest.raises(KeyboardInterrupt):
        session.update()
    for handle in handles:
        handle.remove()
    assert interrupt.sent or not point.startswith("inside")
    assert session.global_step == step_before + 1 and len(session.history) == step_before + 1
    assert session.engine.scheduler.last_epoch == session.global_step  # moved with the optimizer
    finish(session, STEPS)
    _assert_same(session, reference)


def test_run_stops_on_an_interrupt_after_the_update_it_reached(make_session):
    session = make_session()
    session.on(lambda name, result: ctrl_c() if name == "update" and session.global_step == 2 else None)
    rows = session.run(5, progress=False)
    assert list(rows["step"]) == [1, 2] and session.next_stage == "generate"


@pytest.mark.parametrize("n", [-2, 2.5, "3", True])
def test_run_refuses_a_count_that_is_not_a_whole_number(make_session, n):
    session = make_session()
    with pytest.raises(ValueError, match=r"run\(n\) takes a whole number of optimizer steps >= 0.*session.run\(3\)"):
        session.run(n)
    assert session.run(1, progress=False)["step"].tolist() == [1]


def test_a_second_ctrl_c_stops_a_deferred_block_at_once_and_an_ignored_one_stays_ignored():
    from grpo_lab.interrupts import deferred_interrupts

    reached = []
    with pytest.raises(KeyboardInterrupt), deferred_interrupts():
        ctrl_c()
        reached.append("held")
        ctrl_c()  # a block that hangs can still be stopped
        reached.append("not reached")
    assert reached == ["held"] and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # e.g. a job started with nohup
    try:
        with deferred_interrupts():
            ctrl_c()
        reached.append("ignored")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert reached == ["held", "ignored"]


def test_a_weight_hand_over_that_fails_after_the_update_leaves_the_step_recorded_and_is_retried(make_session, reference,
                                                                                              monkeypatch):
    session = make_session(num_iterations=2)
    session.step()
    while session.next_stage != "update":
        getattr(session, session.next_stage)()
    backend, calls = session.engine.rollout_backend, []
    publish = type(backend).sync_weights

    def unreachable_once(self, model, version):  # e.g. a vLLM server that did not answer
        calls.append(version)
        if len(calls) == 1:
            raise ConnectionError("server did not answer")
        publish(self, model, version)

    monkeypatch.setattr(type(backend), "sync_weights", unreachable_once)
    with pytest.raises(ConnectionError):
        session.update()
    assert session.global_step == 2 and len(session.history) == 2 and session.next_stage == "generate"
    finish(session, STEPS)  # the next generation hands the weights over first
    assert calls == [2, 2, 3]
    _assert_same(session, reference)
