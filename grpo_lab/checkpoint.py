"""Save and restore everything a run needs to continue exactly: weights (or adapter), optimizer,
scheduler, random states, sampler position, counters and the caller's own state.

Under ``accelerate launch`` each process has its own random state (and its own share of a
half-finished batch): the caller gathers them into ``per_process``, one entry per rank, and each
process takes its own back on restore.

Writes are atomic: files go to a temporary sibling directory that replaces the target only once
complete, so a crash mid-save leaves the previous checkpoint intact.
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import tempfile
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import torch

from grpo_lab import notices
from grpo_lab.dist import load_full_state, load_optimizer_state

STATE_FILE = "trainer_state.pt"
MODEL_DIR = "model"
CHECKPOINT_PREFIX = "checkpoint-"
"""A trainer's checkpoints are ``<output_dir>/checkpoint-<step>``."""


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # this process's device: sampling on a GPU draws from it
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
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


def atomic_directory_write(target: Path, write) -> Path:
    """Call ``write(tmp_dir)``, then move ``tmp_dir`` to ``target`` in one rename."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write(tmp)
        (tmp / "COMPLETE").write_text("ok\n")
        if target.exists():
            old = target.with_name(f".{target.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def load_saved_weights(model, model_dir: Path) -> None:
    """Copy the weights (or adapter) saved in ``model_dir`` into ``model``, which must be built like
    the saved model (a PEFT model with the same adapter for an adapter)."""
    is_peft = hasattr(model, "peft_config")
    if (model_dir / "adapter_config.json").exists() != is_peft:
        saved = "a PEFT adapter" if not is_peft else "a full model"
        raise ValueError(
            f"{model_dir} holds {saved}, but the model given to load it into is {'a PEFT' if is_peft else 'not a PEFT'} "
            "model; pass a model built like the saved one."
        )
    if is_peft:
        from peft import load_peft_weights, set_peft_model_state_dict

        result = set_peft_model_state_dict(model, load_peft_weights(str(model_dir)))
        missing = [key for key in result.missing_keys if "lora_" in key]
        if result.unexpected_keys or missing:
            raise ValueError(
                f"The adapter in {model_dir} does not fit the PEFT model given to load it into (unexpected: "
                f"{result.unexpected_keys[:3]}, missing: {missing[:3]}); pass a model with the saved adapter's "
                "configuration (adapter_config.json)."
            )
        return
    if not _copy_saved_tensors(model, model_dir):  # names, shapes or ties that differ: transformers maps them
        saved = type(model).from_pretrained(str(model_dir), dtype=model.dtype)
        model.load_state_dict(saved.state_dict())


def _copy_saved_tensors(model, model_dir: Path) -> bool:
    """Copy the tensors of a ``save_pretrained`` directory into ``model`` one at a time, so that no
    second copy of the model is held in memory. Returns False, having copied nothing, unless the
    files hold exactly the model's tensors with their shapes (a tied weight, stored once, counts for
    its aliases). Raises ValueError where any copy would be wrong: the files store separately two
    tensors the model ties, or the model's weights are offloaded (on the meta device)."""
    from safetensors import safe_open

    target = model.state_dict()
    offloaded = [name for name, tensor in target.items() if tensor.is_meta]
    if offloaded:
        raise ValueError(
            f"The model given to load {model_dir} into has offloaded weights ({offloaded[0]} is on the meta "
            "device); load it without device_map offloading, or let load() build the model (model=None)."
        )
    with ExitStack() as stack:
        paths = sorted(model_dir.glob("*.safetensors"))
        files = [stack.enter_context(safe_open(str(path), framework="pt")) for path in paths]
        shapes = {name: f.get_slice(name).get_shape() for f in files for name in f.keys()}
        if not files or any(name not in target or list(target[name].shape) != shape for name, shape in shapes.items()):
            return False
        storage = lambda name: target[name].data_ptr() if target[name].numel() else name  # noqa: E731
        owner: dict[int | str, str] = {}
        for name in shapes:
            other = owner.setdefault(storage(name), name)
            if other != name:
                raise ValueError(
                    f"{model_dir} stores {other} and {name} separately, but the model given to load it into ties "
                    "them; pass a model built like the saved one (tie_word_embeddings as saved)."
                )
        if any(name not in shapes and storage(name) not in owner for name in target):
            return False  # e.g. saved tied, loaded untied: from_pretrained fills the alias
        with torch.no_grad():
            for f in files:
                for name in f.keys():
                    target[name].copy_(f.get_tensor(name))
    return True


def save_engine(engine, directory: Path, extra: dict, per_process: list[dict], gathered: tuple) -> None:
    """Write the engine's state into ``directory`` (which must exist); ``extra`` is pickled as is, and
    so is ``per_process``, each process's own state (its random state under "rng") in rank order.
    ``gathered``: the model's, optimizer's and reference model's whole state dicts when they are
    sharded (from ``dist.full_model_state``, ``dist.full_optimizer_state`` and ``dist.full_state``),
    else None in their places."""
    model_state, optimizer_state, ref_state = gathered
    if ref_state is None and engine.ref_model is not None:
        ref_state = engine.ref_model.state_dict()
    engine.unwrapped_model.save_pretrained(directory / MODEL_DIR, safe_serialization=True, state_dict=model_state)
    engine.tokenizer.save_pretrained(directory / MODEL_DIR)
    engine.config.to_yaml(directory / "config.yaml")
    state = {
        "optimizer": engine.optimizer.state_dict() if optimizer_state is None else optimizer_state,
        "optimizer_by_name": optimizer_state is not None,
        "scheduler": engine.scheduler.state_dict(),
        "per_process": per_process,
        "sampler": engine.sampler.state_dict(),
        "global_step": engine.global_step,
        "num_input_tokens_seen": engine.num_input_tokens_seen,
        "entropy_control": {"coef": engine.entropy_coef, "last_step_entropy": engine.last_step_entropy},
        # which parameters a backward pass reaches, once known (skip_zero_advantage_backward)
        "trained_parameters": None if engine.trained_parameter_names is None else sorted(engine.trained_parameter_names),
        "ref_model": ref_state,
        "extra": extra,
    }
    torch.save(state, directory / STATE_FILE)
    (directory / "summary.json").write_text(
        json.dumps({"global_step": engine.global_step, "is_peft": engine.is_peft}, indent=2) + "\n"
    )


def trainer_checkpoints(output_dir: Path) -> list[Path]:
    """The ``checkpoint-<step>`` directories in ``output_dir``, oldest step first."""
    found = [
        p for p in Path(output_dir).glob(f"{CHECKPOINT_PREFIX}*")
        if p.name.removeprefix(CHECKPOINT_PREFIX).isascii() and p.name.removeprefix(CHECKPOINT_PREFIX).isdigit()
    ]
    return sorted(found, key=lambda p: int(p.name.removeprefix(CHECKPOINT_PREFIX)))


def check_complete(directory: Path) -> Path:
    directory = Path(directory)
    if not directory.exists():
        raise FileNotFoundError(
            f"{directory} does not exist. Give a directory written by session.save() or a trainer's checkpoint-N."
        )
    if not (directory / "COMPLETE").exists() or not (directory / STATE_FILE).exists():
        inside = trainer_checkpoints(directory)
        hint = (
            f" It holds a trainer's checkpoints: give one of them, e.g. the newest, {inside[-1]}."
            if inside else " Give a directory written by save() or a trainer's checkpoint-N."
        )
        raise FileNotFoundError(
            f"{directory} is not a complete grpo_lab checkpoint (no COMPLETE marker or {STATE_FILE}).{hint}"
        )
    return directory


def load_state(directory: Path) -> dict:
    """The saved state with every tensor on the CPU (loading moves what it restores to the model's
    device), so a checkpoint written on N GPUs loads on any device."""
    return torch.load(check_complete(directory) / STATE_FILE, map_location="cpu", weights_only=False)


def per_process_states(state: dict) -> list[dict]:
    """The checkpoint's per-process entries in rank order: each process's random state ("rng") and
    its share of a half-finished batch ("pending"). A checkpoint written before these were kept per
    process holds the main process's alone."""
    return state.get("per_process") or [{"rng": state["rng"], "pending": state["extra"]["pending"]}]


def own_process_state(state: dict, process_index: int, num_processes: int) -> dict:
    """This process's entry of :func:`per_process_states`.

    A checkpoint written by another number of processes (or, on several processes, one that kept
    the main process's state alone) cannot continue exactly: the half-finished batch is dropped
    (``pending`` None) and a process without a saved state gets ``rng`` None (it is seeded afresh).
    """
    saved = per_process_states(state)
    if len(saved) == num_processes:
        return saved[process_index]
    if process_index == 0:
        written = (
            f"written by {len(saved)} process(es)" if "per_process" in state
            else "written before grpo_lab kept every process's random state"
        )
        dropped = ", and its half-finished generation batch is dropped" if saved[0]["pending"][0] is not None else ""
        notices.warn(
            f"The checkpoint was {written} and is resumed on {num_processes}: the run continues, but not exactly as "
            f"an uninterrupted run would (random states and the sharding of prompts differ){dropped}.",
        )
    return {"rng": saved[process_index]["rng"] if process_index < len(saved) else None, "pending": None}


def restore_engine(engine, state: dict, rng: dict | None) -> None:
    """Load ``state`` into ``engine``, with ``rng`` this process's random state (None: seed it afresh
    from ``config.seed`` and its rank, as a new run does)."""
    load_optimizer_state(
        engine.accelerator, engine.model, engine.optimizer, state["optimizer"], by_name=state.get("optimizer_by_name", False)
    )
    engine.scheduler.load_state_dict(state["scheduler"])
    engine.sampler.load_state_dict(state["sampler"])
    engine.global_step = state["global_step"]
    engine.num_input_tokens_seen = state["num_input_tokens_seen"]
    control = state.get("entropy_control")  # absent from checkpoints written before the entropy bonus
    if control is not None:
        engine.entropy_coef, engine.last_step_entropy = control["coef"], control["last_step_entropy"]
    if state.get("trained_parameters") is not None:  # absent from checkpoints written before the setting
        engine.trained_parameter_names = set(state["trained_parameters"])
    if state["ref_model"] is not None and engine.ref_model is not None:
        load_full_state(engine.accelerator, engine.ref_model, state["ref_model"])
    if rng is not None:
        set_rng_state(rng)
    else:
        from transformers import set_seed

        set_seed(engine.config.seed + engine.accelerator.process_index)
    engine.rollout_backend.sync_weights(engine.unwrapped_model, engine.global_step)
