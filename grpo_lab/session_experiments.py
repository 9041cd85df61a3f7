"""The experiment layer of a GRPOSession: undo steps, fork a run into independent branches, and try
other settings on the scored batch (what-if, :mod:`grpo_lab.what_if`).

Undo: after each optimizer step (and before the first stage) the session keeps a snapshot of its
whole state (:func:`grpo_lab.state.session_state_dict`, tensors moved to the CPU) in a ring of
``undo_steps + 1``; ``undo(n)`` loads the one n steps back and drops the later ones.

Fork: ``fork(name, **config_edits)`` builds a second session on a copy of the model and loads this
one's state into it, so that it continues exactly as this one would, then applies the edits as
edits to ``config`` (each field's live rule). A LoRA model's copy shares the frozen base weights
and copies only the trainable ones; a full model's copy is refused, with the figures, where it
would not fit in free memory. Each session keeps its own random state from its first stage on
(:mod:`grpo_lab.stages`), so a fork and its parent stepped in turns draw what each would alone.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from grpo_lab import dist, notices
from grpo_lab.rollout.environments import user_reward_funcs
from grpo_lab.stages import RANDOM_STATE_LOCK, StageOrderError, drives_stages
from grpo_lab.state import load_session_state_dict, on_device, rng_state, session_state_dict, set_rng_state
from grpo_lab.what_if import WhatIf, run_what_if, settings_grid

if TYPE_CHECKING:
    from grpo_lab.session import GRPOSession


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


class SessionExperiments:
    """GRPOSession's undo and fork (see the module docstring)."""

    name: str | None
    fork_point: int | None
    undo_by_default: bool = True
    """Whether ``undo_steps=None`` keeps undo points; a ``GRPOTrainer`` turns it off for its session."""

    def _init_experiments(self, name: str | None = None) -> None:
        self.name = name
        self.fork_point = None  # the parent's global step a fork started from
        self.branches: list[GRPOSession] = []
        self._snapshots: list[Snapshot] = []
        self._stages_at_snapshot = -1
        self._undo_off: str | None = None  # why undo turned off during the run, if it did

    # ------------------------------------------------------------------ undo
    @property
    def snapshots(self) -> list[Snapshot]:
        """The undo points kept (oldest first), each with the memory it holds; ``undo_steps`` bounds them."""
        return list(self._snapshots)

    def undo_steps(self) -> int:
        """The steps undo can return over: 0 under FSDP or DeepSpeed ZeRO (each process holds a shard
        of the state) or after a snapshot failed; else ``config.undo_steps``, or where that is None:
        0 in a ``GRPOTrainer`` (a script does not undo), 2 if a snapshot (the trainable weights and two
        optimizer moments) takes at most :data:`DEFAULT_UNDO_BUDGET` bytes, else 0."""
        if self._undo_off is not None or dist.sharding(self.engine.accelerator) is not None:
            return 0
        if self.config.undo_steps is not None:
            return self.config.undo_steps
        if not self.undo_by_default:
            return 0
        trainable = sum(p.numel() * p.element_size() for p in self.engine.unwrapped_model.parameters()
                        if p.requires_grad)
        return 2 if 3 * trainable <= DEFAULT_UNDO_BUDGET else 0

    def _take_snapshot(self) -> None:
        """Keep the state as it stands now as an undo point (the ring's oldest drops out). It runs
        after an optimizer step has been taken, so a failure turns undo off with a warning instead of
        failing the step."""
        keep = self.undo_steps()
        if keep <= 0:
            self._snapshots.clear()
            return
        try:
            state = session_state_dict(self, copy_records=_list_copies, with_reference=self.config.sync_ref_model)
        except Exception as error:  # e.g. a half-used batch holding objects that cannot be copied
            self._undo_off = f"the snapshot after step {self.global_step} failed: {type(error).__name__}: {error}"
            self._snapshots.clear()
            notices.warn(f"Undo is off for this session: {self._undo_off}. Training goes on.")
            return
        state = {**state, "engine": _on_cpu(state["engine"]), "rng": _on_cpu(state["rng"])}
        self._snapshots.append(Snapshot(self.global_step, state, _tensor_bytes(state)))
        del self._snapshots[:-(keep + 1)]
        self._stages_at_snapshot = self._stages_run

    def _before_stage(self) -> None:
        """The undo point of a run's start (or of a loaded state): taken before the first stage."""
        if not self._snapshots:
            self._take_snapshot()

    def _forget_snapshots(self) -> None:
        """Drop every undo point: the state was replaced from outside (``load_state_dict``)."""
        self._snapshots.clear()
        self._stages_at_snapshot = -1

    def _undo_refusal(self) -> str:
        if self._undo_off is not None:
            return self._undo_off
        if dist.sharding(self.engine.accelerator) is not None:
            return "under FSDP or DeepSpeed ZeRO each process holds a shard of the state; use save() and load()"
        if self.config.undo_steps == 0:
            return "config.undo_steps = 0"
        if not self.undo_by_default:
            return "a GRPOTrainer's session keeps no undo points unless config.undo_steps says so"
        return (f"config.undo_steps = None, and a snapshot of this model would take over "
                f"{DEFAULT_UNDO_BUDGET / 2**30:.0f} GiB")

    @drives_stages
    def undo(self, n: int = 1) -> int:
        """Return to the state n optimizer steps back: weights (or adapter), optimizer, scheduler,
        random states, sampler position, the pending batch, history and config. Stages run since the
        last step count as the first of the n: ``undo()`` after ``generate()`` drops that batch.
        Returns the global step it returned to. Later undo points are dropped."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"undo(n) takes a whole number of steps >= 1, got {n!r}.")
        moved = self._stages_run != self._stages_at_snapshot
        index = len(self._snapshots) - 1 - n + moved
        if self.undo_steps() <= 0:
            raise RuntimeError(f"Undo is off ({self._undo_refusal()}). Set session.config.undo_steps = 2 (or more) "
                               "to keep that many steps to return to, from the next step on, where undo can run.")
        if index < 0:
            kept = len(self._snapshots) - 1 + moved
            raise ValueError(
                f"undo({n}) goes back further than the {kept} step(s) this session can return to "
                f"(undo_steps = {self.config.undo_steps!r}, so {self.undo_steps()}; snapshots at steps "
                f"{[s.step for s in self._snapshots]}). Raise session.config.undo_steps to keep more, from now on."
            )
        snapshot = self._snapshots[index]
        state = snapshot.state
        device = self.engine.accelerator.device
        load_session_state_dict(self, {**state, "engine": on_device(state["engine"], device)})
        del self._snapshots[index + 1:]
        self._stages_at_snapshot = self._stages_run
        self._notify("undo", snapshot.step)
        return snapshot.step

    # ------------------------------------------------------------------ fork
    def fork(self, name: str | None = None, **config_edits) -> GRPOSession:
        """An independent session from this one's state, with ``config_edits`` applied as edits to
        its ``config`` (the same rules as editing ``session.config``). Stepped without edits, it
        produces the history and weights this session would. The model is copied (a LoRA model's
        adapter only); reward functions, datasets, tokenizer and tools are shared. The fork is listed
        in ``branches``; its ``fork_point`` is this session's step now."""
        if self._made_with_optimizers:
            raise ValueError(
                "This session was built with optimizers=(...): a fork cannot copy an optimizer bound to this model's "
                "parameters. Build the session without optimizers= (grpo_lab makes them from the config) to fork it."
            )
        if self.engine.environments is not None and self.rollout is not None and self.scores is None:
            raise RuntimeError(
                "This session holds a generated batch not yet scored, whose environments (live objects) a fork "
                "cannot copy. Call session.score() first (or session.discard_batch()), then fork."
            )
        name = name or f"{self.name or 'session'}-{len(self.branches) + 1}"
        with self._owner.hold(f"session.fork({name!r})"), RANDOM_STATE_LOCK:
            self._sync_config()
            engine = self.engine
            model = model_copy(engine.unwrapped_model, what=f"session {self.name or ''}".strip(),
                               reference=engine.ref_model)
            state = session_state_dict(self)
            fork = type(self)(
                model, user_reward_funcs(engine), args=copy.deepcopy(self.config), train_dataset=engine.train_dataset,
                eval_dataset=engine.eval_dataset, processing_class=self.tokenizer, rollout_func=engine.rollout_func,
                tools=engine.tools, environment_factory=self.environment_factory,
                reward_processing_classes=self._given_reward_processing_classes,
            )
            fork.load_state_dict(state)  # the random state included: the fork draws what this session would
            self._rng = copy.deepcopy(state["rng"])  # building the fork drew from the global one
        for field, value in config_edits.items():
            if not hasattr(fork.config, field):
                fork.close()
                raise AttributeError(f"fork(): GRPOConfig has no field {field!r}.")
            setattr(fork.config, field, value)
        try:
            fork._sync_config()
        except Exception:
            fork.close()
            raise
        fork.name, fork.fork_point = name, self.global_step
        self.branches.append(fork)
        self._notify("fork", fork)
        return fork

    # ------------------------------------------------------------------ what-if
    @drives_stages
    def what_if(self, cases: list[dict] | None = None, /, *, lookahead: bool = False, **settings) -> WhatIf:
        """The advantages, loss, gradient and loss metrics each setting would give the scored batch,
        and which settings' gradients are equal; the session is left exactly as it was.

        ``session.what_if(loss_type=["dapo", "grpo"], epsilon=[0.2, 0.28])`` tries every combination
        of the lists; ``session.what_if([{"loss_type": "cispo", "epsilon_high": 5.0}, {...}])`` each
        dict. Fields: those the advantages and loss read (``grpo_lab.what_if.WHAT_IF_FIELDS``); the
        other fields stay as the session has them. Needs a scored batch (after ``score()``).

        ``lookahead=True``: for each setting, also take the optimizer step its gradient gives and
        report how the log-probability of the positive- and negative-advantage completions moves
        and the KL to the current policy (``lookahead/...`` columns); the weights, optimizer and
        scheduler are put back after each."""
        if self.scores is None:
            raise StageOrderError(
                f"what_if() tries settings on the scored batch, and there is none: the next stage is "
                f"{self.next_stage}(). Call session.generate() and session.score() first."
            )
        self._sync_config()
        grid = settings_grid(cases, settings)
        random = rng_state()
        try:
            return run_what_if(self, grid, lookahead=lookahead)
        finally:
            set_rng_state(random)  # a forward pass with dropout draws: the session's stream stays where it was
