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
import pickle
import random
import re
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


def plain_values(value, *, unknown=str):
    """``value`` in the types a checkpoint loads without unpickling code: numpy scalars become Python
    numbers, numpy arrays tensors (or lists), containers are rebuilt, and any other object goes
    through ``unknown`` (``str`` for logs; pass ``lambda v: v`` to keep it)."""
    if isinstance(value, dict):
        return {key: plain_values(item, unknown=unknown) for key, item in value.items()}
    if isinstance(value, (list, tuple, set)):
        items = [plain_values(item, unknown=unknown) for item in value]
        return tuple(items) if isinstance(value, tuple) else items
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.copy()) if value.dtype.kind in "biuf" else plain_values(value.tolist(), unknown=unknown)
    if value is None or isinstance(value, (str, bool, int, float, bytes, torch.Tensor)):
        return value
    return unknown(value)


def safe_batch(pending: tuple):
    """The half-used batch ``(rollout, scores, advantages)`` as a checkpoint stores it: its columns and
    logged extras made plain (:func:`plain_values`), or None, with the reason, where it still holds
    objects that :func:`load_state` would refuse (e.g. a dataset column of images)."""
    rollout, scores, _ = pending
    keep = lambda value: value  # noqa: E731
    if rollout is not None:
        rollout.columns = plain_values(rollout.columns, unknown=keep)
    if scores is not None:
        scores.extras, scores.metrics = plain_values(scores.extras, unknown=keep), plain_values(scores.metrics, unknown=keep)
    buffer = io.BytesIO()
    torch.save(pending, buffer)
    buffer.seek(0)
    try:
        with _batch_types():
            torch.load(buffer, weights_only=True)
    except pickle.UnpicklingError as error:
        found = re.search(r"GLOBAL (\S+)", str(error))
        return None, found.group(1) if found else "an object of another type"
    return pending, None


def _batch_types():
    from grpo_lab.types import Advantages, Rollout, Scores

    return torch.serialization.safe_globals([Rollout, Scores, Advantages])


PARTIAL_MARKER = ".grpo_lab_partial"
"""Written first into every directory a save is building: what a killed save leaves behind is
recognised by it, and only such directories are ever removed as leftovers."""


SAVE_ENTRIES = frozenset({"COMPLETE", STATE_FILE, MODEL_DIR, "config.yaml", "summary.json", "train_dataset",
                          "eval_dataset", PARTIAL_MARKER})
"""What a save directory holds: replacing a directory that holds anything else would delete it."""


def check_save_target(target: Path, *, overwrite: bool = False) -> None:
    """Refuse to save onto a file, or into an existing directory that holds anything but a grpo_lab
    save's own files (unless ``overwrite``): replacing it would delete what grpo_lab did not write."""
    target = Path(target)
    if target.is_file() or (target.exists() and not target.is_dir()):
        raise FileExistsError(
            f"{target} is a file; a save is a directory. Give a path that does not exist yet (e.g. {target}_save)."
        )
    foreign = sorted(p.name for p in target.iterdir() if p.name not in SAVE_ENTRIES) if target.is_dir() else []
    if foreign and not overwrite:
        held = "a grpo_lab save and other files" if (target / "COMPLETE").exists() else "other files than a grpo_lab save"
        raise FileExistsError(
            f"{target} is a directory that holds {held} ({_listing(foreign)}); saving there would delete them. Give a "
            "new or empty directory, move them out, or pass overwrite=True to replace the directory and everything in it."
        )
    blocked = _unwritable(target.parent)  # where the new save is built, then renamed into place
    if blocked is not None:
        raise PermissionError(f"Cannot save to {target}: {blocked} is not writable. Give a directory you can write to.")


def check_writable(directory: Path, action: str) -> None:
    """Refuse a ``directory`` that is a file, or that cannot be created or written to; the message
    reads "Cannot <action> <directory>: ..."."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise FileExistsError(f"Cannot {action} {directory}: it is a file. Give a directory path.")
    blocked = _unwritable(directory)
    if blocked is not None:
        raise PermissionError(f"Cannot {action} {directory}: {blocked} is not writable. Give a directory you can write to.")


def _unwritable(directory: Path) -> Path | None:
    """The folder that keeps ``directory`` from being created or written to, if any: the nearest
    existing one of it and its parents, where it lacks write permission."""
    existing = next((p for p in [directory, *directory.parents] if p.exists()), None)
    return existing if existing is not None and not os.access(existing, os.W_OK | os.X_OK) else None


def _listing(names: list[str], most: int = 3) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _previous(target: Path) -> Path:
    return target.with_name(f".{target.name}.old")


def recover_interrupted_write(target: Path) -> None:
    """Finish what an interrupted replacement of ``target`` left: the previous save, moved aside to
    ``.NAME.old`` just before the new one took its place, is put back where the new one never
    arrived, and removed where it did; leftover partial directories of ``target`` are removed."""
    target = Path(target)
    old = _previous(target)
    if old.is_dir() and (old / "COMPLETE").exists():
        if not target.exists():
            os.replace(old, target)
        elif (target / "COMPLETE").exists():
            shutil.rmtree(old, ignore_errors=True)
    if target.parent.is_dir():
        for leftover in target.parent.glob(f".{glob_escape(target.name)}.*"):
            if leftover != old and leftover.is_dir() and (leftover / PARTIAL_MARKER).exists():
                shutil.rmtree(leftover, ignore_errors=True)


def glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def remove_partial_writes(parent: Path, prefix: str) -> None:
    """Remove the partial directories that killed saves of ``parent/<prefix>*`` left behind (each
    carries :data:`PARTIAL_MARKER`); complete saves are never touched."""
    parent = Path(parent)
    if not parent.is_dir():
        return
    for leftover in parent.glob(f".{glob_escape(prefix)}*"):
        if leftover.is_dir() and (leftover / PARTIAL_MARKER).exists() and not (leftover / "COMPLETE").exists():
            shutil.rmtree(leftover, ignore_errors=True)


def _fsync(path: Path) -> None:
    """Flush ``path`` (a file or a directory's entries) to disk; some file systems refuse it for
    directories, which is then skipped."""
    try:
        descriptor = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def _fsync_tree(directory: Path) -> None:
    """Flush every file under ``directory``, and the directories themselves: a rename that reaches
    the disk before the data it names would leave an empty checkpoint after a power cut."""
    for path in [*sorted(directory.rglob("*"), reverse=True), directory]:
        _fsync(path)


def atomic_directory_write(target: Path, write, *, overwrite: bool = False) -> Path:
    """Call ``write(tmp_dir)``, then move ``tmp_dir`` to ``target`` in one rename.

    ``target`` must be new, empty, or a grpo_lab save (:func:`check_save_target`; ``overwrite``
    allows any directory). Replacing a save moves the old one aside first; an interruption between
    the two renames puts it back, here or at the next save or load (:func:`recover_interrupted_write`).
    """
    target = Path(target)
    recover_interrupted_write(target)
    check_save_target(target, overwrite=overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    old = _previous(target)
    moved_aside = False
    try:
        (tmp / PARTIAL_MARKER).write_text("a save being written; removed once complete\n")
        write(tmp)
        (tmp / "COMPLETE").write_text("ok\n")
        (tmp / PARTIAL_MARKER).unlink()
        _fsync_tree(tmp)
        if target.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(target, old)
            moved_aside = True
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
        _fsync(target.parent)
    except BaseException:
        if moved_aside and not target.exists() and old.exists():
            os.replace(old, target)
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


def first_process() -> bool:
    """Whether this is the launch's first process (``RANK`` 0, or no launcher), known before any
    accelerator exists: the one process that writes checkpoints, and so the one that repairs them."""
    return os.environ.get("RANK", "0") == "0"


def check_complete(directory: Path) -> Path:
    directory = Path(directory)
    if first_process():  # one process repairs; others racing on the same renames would fail
        recover_interrupted_write(directory)
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
    device), so a checkpoint written on N GPUs loads on any device.

    Read with ``weights_only=True``: tensors, containers and numbers, plus the batch's own result
    types, so that a file crafted to call a function when unpickled is refused instead of run."""
    path = check_complete(directory) / STATE_FILE
    try:
        with _batch_types():
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        found = re.search(r"GLOBAL (\S+)", str(error))
        raise ValueError(
            f"{path} holds objects other than tensors, numbers and grpo_lab's batch results"
            f"{f' ({found.group(1)})' if found else ''}. "
            "grpo_lab does not unpickle them, since unpickling can run code. Either the file was written by a grpo_lab "
            "version that pickled its state, or it was altered. To go on from such a checkpoint you trust, start a new "
            f"run from its weights, GRPOSession('{Path(directory) / MODEL_DIR}', ...), which starts the optimizer, "
            "schedule and step count afresh; or load it with the grpo_lab version that wrote it."
        ) from None


def per_process_states(state: dict) -> list[dict]:
    """The checkpoint's per-process entries in rank order: each process's random state ("rng") and
    its share of a half-finished batch ("pending")."""
    return state["per_process"]


def own_process_state(state: dict, process_index: int, num_processes: int) -> dict:
    """This process's entry of :func:`per_process_states`.

    A checkpoint written by another number of processes cannot continue exactly: the half-finished
    batch is dropped (``pending`` None) and a process without a saved state gets ``rng`` None (it is
    seeded afresh).
    """
    saved = per_process_states(state)
    if len(saved) == num_processes:
        return saved[process_index]
    if process_index == 0:
        dropped = ", and its half-finished generation batch is dropped" if saved[0]["pending"][0] is not None else ""
        notices.warn(
            f"The checkpoint was written by {len(saved)} process(es) and is resumed on {num_processes}: the run continues, but not exactly as "
            f"an uninterrupted run would (random states and the sharding of prompts differ){dropped}.",
        )
    return {"rng": saved[process_index]["rng"] if process_index < len(saved) else None, "pending": None}


def restore_engine(engine, state: dict, rng: dict | None) -> None:
    """Load ``state`` into ``engine``, with ``rng`` this process's random state (None: seed it afresh
    from ``config.seed`` and its rank, as a new run does)."""
    load_optimizer_state(
        engine.accelerator, engine.model, engine.optimizer, state["optimizer"], by_name=state["optimizer_by_name"]
    )
    engine.scheduler.load_state_dict(state["scheduler"])
    engine.sampler.load_state_dict(state["sampler"])
    engine.global_step = state["global_step"]
    engine.num_input_tokens_seen = state["num_input_tokens_seen"]
    control = state["entropy_control"]
    engine.entropy_coef, engine.last_step_entropy = control["coef"], control["last_step_entropy"]
    if state["trained_parameters"] is not None:
        engine.trained_parameter_names = set(state["trained_parameters"])
    if state["ref_model"] is not None and engine.ref_model is not None:
        load_full_state(engine.accelerator, engine.ref_model, state["ref_model"])
    if rng is not None:
        set_rng_state(rng)
    else:
        from transformers import set_seed

        set_seed(engine.config.seed + engine.accelerator.process_index)
    engine.rollout_backend.sync_weights(engine.unwrapped_model, engine.global_step)
