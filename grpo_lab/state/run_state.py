"""A run's whole state as a dictionary of copies: what checkpoints write, and what undo and fork keep.

``engine_state_dict`` holds the engine's part (weights or adapter, optimizer, scheduler, prompt
sampler position, counters, the adaptive entropy weight, a reference model's weights);
``session_state_dict`` adds this process's random states, the half-used generation batch and the
session's records (history, completion log, config edits). Loading one into a session built like
the one that made it continues exactly as that session would have.

Every tensor is a copy: training on after taking a state dict leaves it as it was. The dictionaries
hold only tensors, numbers, strings and containers, plus grpo_lab's batch result types, so that a
checkpoint written from them loads with ``weights_only=True``.
"""

from __future__ import annotations

import copy
import io
import random

import numpy as np
import torch

FORMAT_VERSION = 2
"""Version of the state layout (in memory and in a checkpoint's ``trainer_state.pt``). Version 0 is
the layout of checkpoints written before the version was recorded: the same keys, no version.
Version 2 puts a checkpoint's model at its top (it was in ``model/``) and its optimizer and schedule
in ``optimizer.pt`` and ``scheduler.pt`` (they were in ``trainer_state.pt``), as TRL's checkpoints
hold them; every version loads."""


def rng_state() -> dict:
    """This process's random states, in types a checkpoint loads without running code (tensors,
    ints, floats, tuples): numpy's state array is kept as a tensor."""
    name, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # this process's device: sampling on a GPU draws from it
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    saved = state["numpy"]
    np.random.set_state((saved["name"], saved["keys"].numpy().astype(np.uint32), saved["position"],
                         saved["has_gauss"], saved["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def on_device(obj, device):
    """A copy of ``obj`` (tensors in dataclasses, dicts, lists...) with every tensor on ``device`` and
    shared references kept shared; what a process gathers or loads of a half-used batch."""
    device = torch.device(device)
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    # torch.load knows "cpu" but not an indexed "cpu:0" (accelerate's device under multi-CPU runs)
    return torch.load(buffer, map_location="cpu" if device.type == "cpu" else device, weights_only=False)


def copied(obj):
    """A copy of a state dict ``obj``: every tensor cloned (detached), its dicts, lists and tuples
    rebuilt, other values deep-copied. ``copy.deepcopy``'s result for the state dicts of optimizers,
    schedules and samplers, whose tensors are not shared between entries, in a fraction of its time
    (an undo point takes one each step)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if type(obj) is dict:
        return {key: copied(value) for key, value in obj.items()}
    if type(obj) is list:
        return [copied(value) for value in obj]
    if type(obj) is tuple:
        return tuple(copied(value) for value in obj)
    if obj is None or type(obj) in (int, float, str, bool):
        return obj
    return copy.deepcopy(obj)


def check_format_version(state: dict, where: str) -> None:
    """Refuse a state newer than this grpo_lab reads, naming both versions."""
    version = state.get("format_version", 0)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ValueError(
            f"{where} has checkpoint format version {version!r}; this grpo_lab reads versions 0 to {FORMAT_VERSION}. "
            "It was written by a newer grpo_lab: upgrade grpo_lab to load it."
        )


def _model_weights(engine) -> dict[str, torch.Tensor]:
    model = engine.unwrapped_model
    if engine.is_peft:
        from peft import get_peft_model_state_dict

        weights = get_peft_model_state_dict(model)
    else:
        weights = model.state_dict()
    return {name: tensor.detach().clone() for name, tensor in weights.items()}


def _load_model_weights(engine, weights: dict[str, torch.Tensor]) -> None:
    model = engine.unwrapped_model
    if engine.is_peft:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, weights)
    else:
        model.load_state_dict(weights)


def engine_counters(engine) -> dict:
    """The engine's state besides weights, optimizer and reference model: schedule, sampler, counters."""
    return {
        **engine.optimization.state_dict(),  # the schedule and the entropy weight
        "sampler": engine.sampler.state_dict(),
        "global_step": engine.global_step,
        "num_input_tokens_seen": engine.num_input_tokens_seen,
        # which parameters a backward pass reaches, once known (skip_zero_advantage_backward)
        "trained_parameters": (None if engine.trained_parameter_names is None
                               else sorted(engine.trained_parameter_names)),
    }


def load_engine_counters(engine, state: dict) -> None:
    engine.optimization.load_state_dict(state)
    engine.sampler.load_state_dict(state["sampler"])
    engine.global_step = state["global_step"]
    engine.num_input_tokens_seen = state["num_input_tokens_seen"]
    if state["trained_parameters"] is not None:
        engine.trained_parameter_names = set(state["trained_parameters"])


def _refuse_sharded(engine) -> None:
    if engine.layout.shards_state:
        raise NotImplementedError(
            "A state dict in memory holds this process's own copy of the weights; under FSDP each process holds "
            "only a shard. Use session.save(path), which gathers the shards."
        )


def engine_state_dict(engine, *, with_reference: bool = True) -> dict:
    """Copies of everything the engine needs to continue: ``{"model", "optimizer", "ref_model", ...}``
    with :func:`engine_counters`' entries; ``model`` holds the adapter's weights for a PEFT model.
    ``with_reference=False`` leaves a reference model out (None), for a state to return to in this
    session, where it has not changed (no ``sync_ref_model``)."""
    _refuse_sharded(engine)
    return {
        "model": _model_weights(engine),
        "optimizer": copied(engine.optimizer.state_dict()),
        "ref_model": None if engine.ref_model is None or not with_reference else {
            name: tensor.detach().clone() for name, tensor in engine.ref_model.state_dict().items()
        },
        **copied(engine_counters(engine)),
    }


def load_engine_state_dict(engine, state: dict) -> None:
    """Load :func:`engine_state_dict`'s output into an engine built like the one that made it; the
    generation backend receives the loaded weights before the next generation."""
    _refuse_sharded(engine)
    with torch.no_grad():
        _load_model_weights(engine, state["model"])
        if state["ref_model"] is not None and engine.ref_model is not None:
            engine.ref_model.load_state_dict(state["ref_model"])
    engine.model.zero_grad(set_to_none=True)  # gradients of a loss() after the state was taken do not carry over
    engine.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
    load_engine_counters(engine, copy.deepcopy({k: v for k, v in state.items()
                                                if k not in ("model", "optimizer", "ref_model")}))
    engine.torn = None  # a whole state again
    engine.publish_weights()


def session_records(session) -> dict:
    """The session's own records: its run record (history, evaluations, completion log, config edits,
    the last stage), where it stands in its batch, and its findings."""
    return {**session.record.state_dict(), "batch_step": session.batch_step,
            "findings": session.findings_record.state_dict()}


def session_state_dict(session, *, copy_records=copy.deepcopy, with_reference: bool = True) -> dict:
    """Copies of everything the session needs to continue exactly: the engine's state
    (:func:`engine_state_dict`), the session's random states (this process's), the half-used batch
    (rollout, scores, advantages), the batch prepared one ``generate()`` ahead (``async_generation``;
    waited for) and the records (copied by ``copy_records``)."""
    pending = (session.rollout, session.scores, session.advantages_result)
    return {
        "format_version": FORMAT_VERSION,
        "engine": engine_state_dict(session.engine, with_reference=with_reference),
        "rng": session.random_state(),
        "pending": on_device(pending, "cpu"),
        "generation_ahead": session.engine.generation_stage.ahead.state_dict(),  # async_generation's next batch
        "records": copy_records(session_records(session)),
        "config": copy.deepcopy(session.config.to_dict()),
    }


def load_session_state_dict(session, state: dict) -> None:
    """Return ``session`` (built like the one that made ``state``) to ``state``; stage results past
    the batch's advantages (a loss() not yet used by update()) are dropped, so the next stage is
    whatever the saved batch needs next."""
    check_format_version(state, "This state dict")
    load_engine_state_dict(session.engine, state["engine"])
    set_rng_state(state["rng"])
    records = copy.deepcopy(state["records"])
    session.record.load_state_dict(records)
    session.batch_step = records["batch_step"]
    # absent from a state dict made before findings were kept
    session.findings_record.load_state_dict(records.get("findings"), session.record.last_step)
    for name, value in copy.deepcopy(state["config"]).items():
        setattr(session.config, name, value)
    session.rollout, session.scores, session.advantages_result = on_device(
        state["pending"], session.engine.accelerator.device)
    session.engine.generation_stage.ahead.load_state_dict(state.get("generation_ahead"))  # absent before it existed
    session.loss_result = None
