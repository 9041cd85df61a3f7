"""The stage order of a GRPOSession, the session's own random state, the clock of its steps' compute
time, and the stage that comes next.

    generate -> score -> advantages -> loss -> update   (one optimizer step)
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time

from grpo_lab.state.run_state import rng_state, set_rng_state
from grpo_lab.errors import UsageError

STAGES = ("generate", "score", "advantages", "loss", "update")

RANDOM_STATE_LOCK = threading.RLock()
"""Held while a session's call swaps its own random state into the process's generators (and while
a session is built, which seeds them): sessions driven from two threads take turns, call by call."""


class StageOrderError(UsageError, RuntimeError):
    """A stage was called before the stage it depends on."""


def check_stage_order(session, stage: str) -> None:
    """Refuse ``stage`` where the session's batch is not ready for it, naming the stage to call."""
    order = {name: i for i, name in enumerate(STAGES)}
    missing = {"score": session.rollout, "advantages": session.scores, "loss": session.advantages_result}
    if stage in missing and missing[stage] is None:
        needed = STAGES[order[stage] - 1]
        raise StageOrderError(
            f"{stage}() needs the result of {needed}(); the next stage is {session.next_stage}(). "
            f"Call session.{session.next_stage}() first (or session.step() to finish the iteration)."
        )
    if stage == "update" and session.loss_result is None:
        again = (" The previous update() already used the last gradients." if session.record.last_stage == "update"
                 else "")
        raise StageOrderError(
            f"update() needs the gradients of loss().{again} The next stage is {session.next_stage}(): "
            f"call session.{session.next_stage}() first."
        )
    if stage in {"score", "advantages"} and session.batch_step > 0:
        raise StageOrderError(
            f"{stage}() cannot be recomputed after this batch has been trained on "
            f"({session.batch_step} optimizer step(s) used it). Call session.{session.next_stage}()."
        )
    if stage == "generate" and session.rollout is not None:
        raise StageOrderError(
            "generate() would discard the current batch, which still has "
            f"{session.engine.steps_per_batch - session.batch_step} optimizer step(s) to feed. Call "
            f"session.{session.next_stage}(), or session.discard_batch() to drop it."
        )


class OwnRandomState:
    """A session's own random states (Python, numpy, torch, CUDA): swapped into the process's
    generators while a call of the session runs (:meth:`drawing`) and kept when it ends, so that
    sessions in one process, a fork and its parent among them, draw what each would alone."""

    def __init__(self, state: dict):
        self.kept = copy.deepcopy(state)  # the process's state when the session was built (seeded by it)
        self.held = False  # a call of the session runs, with its state in the process's generators

    @contextlib.contextmanager
    def drawing(self):
        """Run a block with the session's random state in the process's generators; a nested block
        (a stage inside ``run``) runs in the outermost one's."""
        if self.held:
            yield
            return
        with RANDOM_STATE_LOCK:  # another thread's session (arun) must not draw from it meanwhile
            self.held = True
            try:
                set_rng_state(self.kept)
                yield
            finally:
                self.kept, self.held = rng_state(), False

    def current(self) -> dict:
        """The session's random state: the process's while a call runs, else the kept one."""
        return rng_state() if self.held else copy.deepcopy(self.kept)

    def adopt(self, state: dict | None) -> None:
        """Make ``state`` the session's own from here (a loaded checkpoint's, or the one before a fork
        was built, which drew from the process's generators); None: the process's now (a process a
        checkpoint kept no state for, seeded afresh)."""
        self.kept = rng_state() if state is None else copy.deepcopy(state)


class StepClock:
    """The compute time of an optimizer step: the time spent inside its stages, from the first stage
    after the last ``update()`` to this one's metrics row. The time between stages (a person reading
    a cell's output, a paused or stopped run, a checkpoint or an evaluation between steps) does not
    count."""

    def __init__(self):
        self.spent = 0.0  # seconds inside the stages that ended since the last step's row
        self._started: float | None = None  # when the stage running now began
        self._step_ended = False  # the running stage (update) already read the step's time

    @contextlib.contextmanager
    def timing(self):
        """Count a stage's time (a stage nested in another is counted once, by the outer one)."""
        if self._started is not None:
            yield
            return
        self._started = time.perf_counter()
        try:
            yield
        finally:
            self.spent = 0.0 if self._step_ended else self.spent + time.perf_counter() - self._started
            self._started, self._step_ended = None, False

    def step_time(self) -> float:
        """The step's compute time so far (called inside ``update()``, as its row is made); the rest of
        that update (handing the weights to a generation server) counts for no step."""
        self._step_ended = True
        return self.spent + (time.perf_counter() - self._started if self._started is not None else 0.0)


def call_text(name: str, args: tuple, kwargs: dict) -> str:
    """``session.save('run/step-3')``, for messages: an argument too long for one line shows as ``...``."""
    def short(value) -> str:
        text = repr(value)
        return text if len(text) <= 40 and "\n" not in text else "..."

    return f"session.{name}({', '.join([short(a) for a in args] + [f'{k}={short(v)}' for k, v in kwargs.items()])})"


def run_next_stage(session) -> tuple[str, object]:
    """Run the stage the session's batch needs next (``session.next_stage``); returns its name and result."""
    stage = session.next_stage
    if stage == "generate":
        return stage, session.generate()
    if stage == "score":
        return stage, session.score()
    if stage == "advantages":
        return stage, session.advantages()
    if stage == "loss":
        return stage, session.loss()
    return stage, session.update()
