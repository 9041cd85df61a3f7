"""The stage order of a GRPOSession and the guard every stage-driving call runs under.

    generate -> score -> advantages -> loss -> update   (one optimizer step)
"""

from __future__ import annotations

import functools
import threading

from grpo_lab.state import rng_state, set_rng_state

STAGES = ("generate", "score", "advantages", "loss", "update")

RANDOM_STATE_LOCK = threading.RLock()
"""Held while a session's call swaps its own random state into the process's generators (and while
a session is built, which seeds them): sessions driven from two threads take turns, call by call."""


class StageOrderError(RuntimeError):
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
        again = " The previous update() already used the last gradients." if session._last_stage == "update" else ""
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


def drives_stages(method):
    """Run a session method under the session's owner guard (:mod:`grpo_lab.ownership`): the thread
    that holds the session may nest calls; another thread's call raises SessionBusyError at once.

    The outermost call also swaps in the session's own random state and keeps it when it ends
    (:meth:`GRPOSession.random_state`), so that sessions in one process, a fork and its parent among
    them, draw what each would alone; before a stage the session may keep an undo point."""
    name = method.__name__
    now = f"stage {name}()" if name in STAGES else None

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._owner.hold(call_text(name, args, kwargs), now=now, finishes_step=name == "update"):
            if self._rng_held:  # a nested call: the outermost one holds the random state
                return _call(self, name, method, args, kwargs)
            with RANDOM_STATE_LOCK:  # another thread's session (arun) must not draw from it meanwhile
                self._rng_held = True
                try:
                    if self._rng is not None:
                        set_rng_state(self._rng)
                    return _call(self, name, method, args, kwargs)
                finally:
                    self._rng, self._rng_held = rng_state(), False

    return wrapper


def _call(session, name: str, method, args: tuple, kwargs: dict):
    if name in STAGES:
        session._before_stage()
    return method(session, *args, **kwargs)


def call_text(name: str, args: tuple, kwargs: dict) -> str:
    """``session.save('run/step-3')``, for messages: an argument too long for one line shows as ``...``."""
    def short(value) -> str:
        text = repr(value)
        return text if len(text) <= 40 and "\n" not in text else "..."

    return f"session.{name}({', '.join([short(a) for a in args] + [f'{k}={short(v)}' for k, v in kwargs.items()])})"
