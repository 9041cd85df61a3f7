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

    def __init__(self, *prefixes: str, times: int = 1):
        self.prefixes, self.sent, self.times = prefixes, False, times

    def mode(self):
        outer = self

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if not outer.sent and getattr(func, "__name__", "").startswith(outer.prefixes):
                    outer.sent = True
                    for _ in range(outer.times):
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
    rows = session.run(5, progress=False).to_pandas()
    assert list(rows["step"]) == [1, 2] and session.next_stage == "generate"


@pytest.mark.parametrize("n", [-2, 2.5, "3", True])
def test_run_refuses_a_count_that_is_not_a_whole_number(make_session, n):
    session = make_session()
    with pytest.raises(ValueError, match=r"run\(n\) takes a whole number of optimizer steps >= 0.*session.run\(3\)"):
        session.run(n)
    assert session.run(1, progress=False).to_pandas()["step"].tolist() == [1]


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


class InterruptAt:
    """Sends SIGINT (``times`` of them in a row) at the ``at``-th torch function called inside the
    block; ``calls`` counts them, so a first pass with ``at=None`` measures an operation's length."""

    def __init__(self, at: int | None, times: int = 1):
        self.at, self.times, self.calls = at, times, 0

    def mode(self):
        outer = self

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                outer.calls += 1
                if outer.calls == outer.at:
                    for _ in range(outer.times):
                        ctrl_c()
                return func(*args, **(kwargs or {}))

        return Mode()


def _points(length: int, count: int = 10) -> list[int]:
    """``count`` call indices over an operation of ``length`` torch calls: one drawn in each of ``count``
    equal stretches of it (seeded: the same points on every run), the first and last calls included."""
    import random

    draw = random.Random(length)
    edges = [1 + length * k // count for k in range(count + 1)]
    inner = [draw.randrange(low, max(low + 1, high)) for low, high in zip(edges[1:-2], edges[2:-1])]
    return sorted({1, *inner, length})


def _interrupted_everywhere(prepare, operation, check, count: int = 10) -> None:
    """Measure ``operation(session)``'s torch calls, then interrupt it at ``count`` points spread over
    them, each on a session from ``prepare()``; ``check(session, raised)`` holds after each."""
    counting = InterruptAt(None)
    session = prepare()
    with counting.mode():
        operation(session)
    for at in _points(counting.calls, count):
        session = prepare()
        raised = False
        try:
            with InterruptAt(at).mode():
                operation(session)
        except KeyboardInterrupt:
            raised = True
        check(session, raised)


def test_ctrl_c_anywhere_in_undo_returns_whole_to_the_step_before(make_session, reference):
    def prepare():
        session = make_session(num_iterations=2)
        session.run(STEPS, progress=False)
        return session

    def check(session, raised):
        assert raised
        if session.global_step == STEPS:  # stopped before the undo began: nothing moved
            assert len(session.history) == STEPS
        else:
            assert session.global_step == STEPS - 1 and len(session.history) == STEPS - 1
            finish(session, STEPS)
        _assert_same(session, reference)

    _interrupted_everywhere(prepare, lambda session: session.undo(1), check)


def _stepped_until(make_session, stage: str):
    """A session (num_iterations=2) one step in, its second step run up to ``stage``."""
    session = make_session(num_iterations=2)
    session.step()
    while session.next_stage != stage:
        getattr(session, session.next_stage)()
    return session


def _update_with_interrupted_undo_point(session, at: int | None) -> InterruptAt:
    """``session.update()``, with Ctrl-C at the ``at``-th torch call of the undo point it keeps after
    the optimizer step (None: none, the calls counted)."""
    ring, keep, interrupt = session.undo_ring, session.undo_ring.keep, InterruptAt(at)

    def interrupted_keep(target):
        with interrupt.mode():
            keep(target)

    ring.keep = interrupted_keep
    try:
        session.update()
    finally:
        del ring.keep
    return interrupt


def test_ctrl_c_anywhere_in_the_undo_point_after_update_leaves_the_step_whole(make_session, reference):
    def prepare():
        return _stepped_until(make_session, "update")

    for at in _points(_update_with_interrupted_undo_point(prepare(), None).calls):
        session = prepare()
        with pytest.raises(KeyboardInterrupt):
            _update_with_interrupted_undo_point(session, at)
        assert torch.is_grad_enabled() and session.global_step == 2 and len(session.history) == 2
        session.step()
        assert session.undo(1) == 2  # the point kept after step 2 is whole
        finish(session, STEPS)
        _assert_same(session, reference)


def test_ctrl_c_anywhere_in_a_lookahead_what_if_leaves_the_session_bitwise(make_session, reference):
    def prepare():
        return _stepped_until(make_session, "loss")

    def check(session, raised):
        assert session.global_step == 1 and len(session.history) == 1 and session.next_stage == "loss"
        assert session.engine.scheduler.last_epoch == 1
        finish(session, STEPS)
        _assert_same(session, reference)

    # 16 points: the two stretches that put the run back after each lookahead are a fifth of the calls
    _interrupted_everywhere(prepare, lambda session: session.what_if(epsilon=[0.1, 0.3], lookahead=True), check,
                            count=16)


def test_ctrl_c_anywhere_in_fork_leaves_the_session_continuing_bitwise(make_session, reference):
    def prepare():
        session = make_session(num_iterations=2)
        session.step()
        return session

    def check(session, raised):
        assert session.global_step == 1
        finish(session, STEPS)
        _assert_same(session, reference)

    _interrupted_everywhere(prepare, lambda session: session.fork("other", learning_rate=1e-3), check)


def _after_one_step(make_session):
    session = make_session(num_iterations=2)
    session.step()
    return session


def _continues_bitwise(reference):
    def check(session, raised):  # the batch of step 1 is used once more (num_iterations=2): loss() is next
        assert session.global_step == 1 and len(session.history) == 1 and session.next_stage == "loss"
        finish(session, STEPS)
        _assert_same(session, reference)

    return check


def test_ctrl_c_anywhere_in_the_doctors_probe_leaves_the_session_continuing_bitwise(make_session, reference):
    _interrupted_everywhere(lambda: _after_one_step(make_session), lambda session: session.doctor(),
                            _continues_bitwise(reference))


def test_ctrl_c_anywhere_in_try_rewards_leaves_the_session_continuing_bitwise(make_session, reference, task):
    _interrupted_everywhere(lambda: _after_one_step(make_session),
                            lambda session: session.try_rewards(task.reward_funcs, on="history"),
                            _continues_bitwise(reference))


def test_a_second_ctrl_c_inside_the_optimizer_step_is_named_and_undo_repairs_it(make_session, reference, tmp_path):
    session = _stepped_until(make_session, "update")
    twice = InterruptOnce("_fused_adam", "_foreach_", times=2)  # the second goes through, mid-AdamW
    with twice.mode(), pytest.raises(KeyboardInterrupt):
        session.update()
    assert twice.sent
    torn = r"cannot run now: a second Ctrl-C stopped the optimizer step \(the step counter at [12]\) midway.*"
    with pytest.raises(RuntimeError, match=r"^update\(\) " + torn + r"session.undo\(n\) back to an undo point"):
        session.step()
    for call, attempt in (("save", lambda: session.save(tmp_path / "torn")), ("fork", session.fork),
                          ("what_if", lambda: session.what_if(epsilon=[0.1]))):  # none carries the torn state on
        with pytest.raises(RuntimeError, match=rf"^{call}\(\) " + torn):
            attempt()
    assert not (tmp_path / "torn").exists() and session.branches == []
    assert session.undo(1) == 1
    finish(session, STEPS)
    _assert_same(session, reference)


def test_grad_mode_left_off_by_an_interrupt_is_restored_when_the_call_ends(make_session):
    session = make_session()

    def interrupted_inside_no_grad_entry(name, result):  # what a Ctrl-C between no_grad's two lines leaves
        if name == "advantages":
            torch.set_grad_enabled(False)
            raise KeyboardInterrupt

    unsubscribe = session.on(interrupted_inside_no_grad_entry)
    with pytest.raises(KeyboardInterrupt):
        session.step()
    unsubscribe()
    assert torch.is_grad_enabled()
    assert session.run(1, progress=False).to_pandas()["step"].tolist() == [1]
