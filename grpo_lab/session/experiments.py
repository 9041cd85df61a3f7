"""The experiment layer of a GRPOSession: undo steps, fork a run into independent branches, and try
other settings on the scored batch (what-if, :mod:`grpo_lab.session.what_if`).

Undo: after each optimizer step (and before the first stage) the session keeps a snapshot of its
whole state (:func:`grpo_lab.state.run_state.session_state_dict`, tensors moved to the CPU) in a ring of
``undo_steps + 1``; ``undo(n)`` loads the one n steps back and drops the later ones.

Fork: ``fork(name, **config_edits)`` builds a second session on a copy of the model and loads this
one's state into it, so that it continues exactly as this one would, then applies the edits as
edits to ``config`` (each field's live rule). A LoRA model's copy shares the frozen base weights
and copies only the trainable ones; a full model's copy is refused, with the figures, where it
would not fit in free memory. Each session keeps its own random state from its first stage on
(:mod:`grpo_lab.session.stages`), so a fork and its parent stepped in turns draw what each would alone.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import torch

from grpo_lab import notices
from grpo_lab.interrupts import deferred_interrupts
from grpo_lab.session.stages import StageOrderError
from grpo_lab.state.run_state import load_session_state_dict, on_device, rng_state, session_state_dict, set_rng_state
from grpo_lab.session.what_if import WhatIf, run_what_if, settings_grid

DEFAULT_UNDO_BUDGET = 2**30
"""Bytes one undo snapshot may take for undo to be on by default (``undo_steps=None``)."""


@dataclass(frozen=True)
class Snapshot:
    """One undo point: the session's state as it stood after optimizer step ``step``."""

    step: int
    state: dict
    nbytes: int

    def __repr__(self) -> str:
        return f"Snapshot(step={self.step}, {self.nbytes / 2**20:.1f} MiB)"


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _on_cpu(obj):
    """``obj`` with every tensor of its dicts, lists and tuples on the CPU (moved only where elsewhere)."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.device.type == "cpu" else obj.cpu()
    if isinstance(obj, dict):
        return {k: _on_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_on_cpu(v) for v in obj)
    return obj


def _list_copies(records: dict) -> dict:
    """Copies of the session's records for an undo point: new lists of the same rows, which are
    never changed once appended (a deep copy each step would grow with the run)."""
    return {k: list(v) if isinstance(v, list) else copy.deepcopy(v) for k, v in records.items()}


def _free_memory(device: torch.device) -> int:
    """Bytes free for a new copy of the model on ``device``: the accelerator's free memory, or the
    host's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


def model_copy(model, *, what: str, reference=None):
    """A copy of ``model`` whose trainable parameters are new tensors; frozen parameters (a LoRA
    model's base) and buffers of frozen modules are shared. Refused with the figures where the fork
    would not fit in free memory: its trainable weights and their two AdamW moments, and a copy of
    ``reference`` (a separate reference model, which the fork builds its own of); ``what`` names the
    session in that message."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    needed = 3 * sum(p.numel() * p.element_size() for p in trainable)
    if reference is not None:
        needed += sum(t.numel() * t.element_size() for t in reference.state_dict().values())
    device = trainable[0].device if trainable else torch.device("cpu")
    free = _free_memory(device)
    if needed > free:
        raise MemoryError(
            f"Forking {what} takes about {needed / 2**30:.2f} GiB (its trainable weights, their optimizer state"
            f"{' and a reference model' if reference is not None else ''}), but {device} has {free / 2**30:.2f} GiB "
            "free. Fork a LoRA session (only the adapter is copied), free memory (close other sessions), or save "
            "this session and load it in another process."
        )
    shared = {id(p): p for p in model.parameters() if not p.requires_grad}
    try:
        return copy.deepcopy(model, memo=shared)
    except Exception as error:  # a quantized or hooked model may hold objects that cannot be copied
        raise RuntimeError(
            f"Forking copies {what}'s model, and {type(model).__name__} cannot be copied in memory "
            f"({type(error).__name__}: {error}). Save this session (session.save(path)) and load the copy with "
            "GRPOSession.load(path), which rebuilds the model from the saved weights."
        ) from error


class UndoRing:
    """A session's undo points: after each optimizer step (and before the first stage) a snapshot of
    its whole state, tensors on the CPU, in a ring of ``undo_steps() + 1`` (see the module docstring).
    The session that owns it is passed to the methods that read or load its state."""

    def __init__(self):
        self.snapshots: list[Snapshot] = []  # oldest first
        self._stages_at_snapshot = -1  # the session's record.stages_run when the last snapshot was taken
        self._off: str | None = None  # why undo turned off during the run, if it did

    def steps(self, session) -> int:
        """The steps undo can return over: 0 under FSDP or DeepSpeed ZeRO (each process holds a shard
        of the state) or after a snapshot failed; else ``config.undo_steps``, or where that is None:
        0 in a ``GRPOTrainer`` (a script does not undo), 2 if a snapshot (the trainable weights and two
        optimizer moments) takes at most :data:`DEFAULT_UNDO_BUDGET` bytes, else 0."""
        if self._off is not None or session.engine.layout.shards_state:
            return 0
        if session.config.undo_steps is not None:
            return session.config.undo_steps
        if not session.undo_by_default:
            return 0
        trainable = sum(p.numel() * p.element_size() for p in session.engine.unwrapped_model.parameters()
                        if p.requires_grad)
        return 2 if 3 * trainable <= DEFAULT_UNDO_BUDGET else 0

    def keep(self, session) -> None:
        """Keep ``session``'s state as it stands now as an undo point (the ring's oldest drops out). It
        runs after an optimizer step has been taken, so a failure turns undo off with a warning instead
        of failing the step."""
        keep = self.steps(session)
        if keep <= 0:
            self.snapshots.clear()
            return
        try:
            state = session_state_dict(session, copy_records=_list_copies,
                                       with_reference=session.config.sync_ref_model)
        except Exception as error:  # e.g. a half-used batch holding objects that cannot be copied
            self._off = f"the snapshot after step {session.global_step} failed: {type(error).__name__}: {error}"
            self.snapshots.clear()
            notices.warn(f"Undo is off for this session: {self._off}. Training goes on.")
            return
        state = {**state, "engine": _on_cpu(state["engine"]), "rng": _on_cpu(state["rng"])}
        # the records' rows are shared with the session and the other snapshots: what a snapshot holds of its
        # own is its tensors
        held = _tensor_bytes([state["engine"], state["rng"], state["pending"]])
        self.snapshots.append(Snapshot(session.global_step, state, held))
        del self.snapshots[:-(keep + 1)]
        self._stages_at_snapshot = session.record.stages_run

    def keep_start(self, session) -> None:
        """The undo point of a run's start (or of a loaded state): taken before the first stage."""
        if not self.snapshots:
            self.keep(session)

    def forget(self) -> None:
        """Drop every undo point: the state was replaced from outside (``load_state_dict``)."""
        self.snapshots.clear()
        self._stages_at_snapshot = -1

    def _refusal(self, session) -> str:
        if self._off is not None:
            return self._off
        if session.engine.layout.shards_state:
            return "under FSDP or DeepSpeed ZeRO each process holds a shard of the state; use save() and load()"
        if session.config.undo_steps == 0:
            return "config.undo_steps = 0"
        if not session.undo_by_default:
            return "a GRPOTrainer's session keeps no undo points unless config.undo_steps says so"
        return (f"config.undo_steps = None, and a snapshot of this model would take over "
                f"{DEFAULT_UNDO_BUDGET / 2**30:.0f} GiB")

    def undo(self, session, n: int) -> int:
        """Load into ``session`` the undo point ``n`` steps back (stages run since the last step count
        as the first of the n) and drop the later ones; returns the step it returned to."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"undo(n) takes a whole number of steps >= 1, got {n!r}.")
        moved = session.record.stages_run != self._stages_at_snapshot
        index = len(self.snapshots) - 1 - n + moved
        if self.steps(session) <= 0:
            raise RuntimeError(f"Undo is off ({self._refusal(session)}). Set session.config.undo_steps = 2 (or more) "
                               "to keep that many steps to return to, from the next step on, where undo can run.")
        if index < 0:
            kept = len(self.snapshots) - 1 + moved
            raise ValueError(
                f"undo({n}) goes back further than the {kept} step(s) this session can return to "
                f"(undo_steps = {session.config.undo_steps!r}, so {self.steps(session)}; snapshots at steps "
                f"{[s.step for s in self.snapshots]}). Raise session.config.undo_steps to keep more, from now on."
            )
        snapshot = self.snapshots[index]
        state = snapshot.state
        device = session.engine.accelerator.device
        with deferred_interrupts(torn=functools.partial(session.engine.mark_torn, f"undo({n})")):
            load_session_state_dict(session, {**state, "engine": on_device(state["engine"], device)})
            del self.snapshots[index + 1:]
            self._stages_at_snapshot = session.record.stages_run
        return snapshot.step


def check_forkable(session) -> None:
    """Refuse a fork that could not continue as ``session`` would, naming the fix."""
    if session.made_with_optimizers:
        raise ValueError(
            "This session was built with optimizers=(...): a fork cannot copy an optimizer bound to this model's "
            "parameters. Build the session without optimizers= (grpo_lab makes them from the config) to fork it."
        )
    if session.engine.environments is not None and session.rollout is not None and session.scores is None:
        raise RuntimeError(
            "This session holds a generated batch not yet scored, whose environments (live objects) a fork "
            "cannot copy. Call session.score() first (or session.discard_batch()), then fork."
        )


def apply_fork_edits(fork, config_edits: dict) -> None:
    """Apply ``config_edits`` to a new fork as edits to its ``config`` (each field's live rule); the
    fork is closed when one is refused."""
    unchanged = []
    for field, value in config_edits.items():
        if not hasattr(fork.config, field):
            fork.close()
            raise AttributeError(f"fork(): GRPOConfig has no field {field!r}.")
        if getattr(fork.config, field) == value:
            unchanged.append(f"{field}={value!r}")
        setattr(fork.config, field, value)
    if unchanged and len(unchanged) == len(config_edits):
        notices.warn(f"fork(): {', '.join(unchanged)} is already this session's value, so the fork steps as this "
                     "session would. Give the value to try instead.")
    elif unchanged:
        notices.warn(f"fork(): {', '.join(unchanged)} is already this session's value; the other edits apply. "
                     "Leave it out, or give the value to try.")
    try:
        fork.apply_config_edits()
    except Exception:
        fork.close()
        raise


def what_if(session, cases: list[dict] | None, settings: dict, *, lookahead: bool) -> WhatIf:
    """``session.what_if``: each setting's advantages, loss and gradient on the scored batch (see
    :mod:`grpo_lab.session.what_if`), the session's random stream left where it was."""
    if session.scores is None:
        raise StageOrderError(
            f"what_if() tries settings on the scored batch, and there is none: the next stage is "
            f"{session.next_stage}(). Call session.generate() and session.score() first."
        )
    session.apply_config_edits()
    grid = settings_grid(cases, settings)
    random = rng_state()
    try:
        return run_what_if(session, grid, lookahead=lookahead)
    finally:
        set_rng_state(random)  # a forward pass with dropout draws: the session's stream stays where it was
