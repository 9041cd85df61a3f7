"""Save and restore everything a run needs to continue exactly: weights (or adapter), optimizer,
scheduler, random states, sampler position, counters and the caller's own state.

Under ``accelerate launch`` each process has its own random state (and its own share of a
half-finished batch): the caller gathers them into ``per_process``, one entry per rank, and each
process takes its own back on restore.

The layout is TRL's ``checkpoint-N``: the model's (or adapter's) files and the tokenizer's at the
top, so that ``from_pretrained(checkpoint)`` loads it, beside ``optimizer.pt``, ``scheduler.pt``,
``rng_state.pth`` (``rng_state_<rank>.pth`` for several processes), ``training_args.bin`` and a model
card; the rest of the run's state (counters, sampler position, reference model, records, each
process's random state and half-used batch) is in ``trainer_state.pt``. Checkpoints of format version
1 and before hold the model in ``model/``; they load as they did.

Writes are atomic (``grpo_lab.state.safe_write``): files go to a temporary sibling directory that
replaces the target only once complete, so a crash mid-save leaves the previous checkpoint intact.
Loading reads the state with ``weights_only=True``: nothing in a checkpoint is unpickled as code.
"""

from __future__ import annotations

import io
import json
import pickle
import re
import sys
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import torch

from grpo_lab import notices
from grpo_lab.state.safe_write import PARTIAL_MARKER, check_target, first_process, recover_interrupted_write
from grpo_lab.state.run_state import (
    FORMAT_VERSION,
    check_format_version,
    engine_counters,
    load_engine_counters,
    set_rng_state,
)

STATE_FILE = "trainer_state.pt"
MODEL_DIR = "model"
"""Where checkpoints of format version 1 and before keep the model (:func:`saved_model_dir`)."""
OWN_FILES = {"optimizer": "optimizer.pt", "scheduler": "scheduler.pt"}
"""The state entries kept in files of their own, under the names transformers' Trainer gives them."""
CHECKPOINT_PREFIX = "checkpoint-"
"""A trainer's checkpoints are ``<output_dir>/checkpoint-<step>``."""


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
        return (torch.from_numpy(value.copy()) if value.dtype.kind in "biuf"
                else plain_values(value.tolist(), unknown=unknown))
    if value is None or isinstance(value, (str, bool, int, float, bytes, torch.Tensor)):
        return value
    return unknown(value)


def safe_batch(pending: tuple):
    """The half-used batch ``(rollout, scores, advantages)`` as a checkpoint stores it: its columns and
    logged extras made plain (:func:`plain_values`; images as lossless image files, :func:`stored_images`),
    or None, with the reason, where it still holds objects that :func:`load_state` would refuse."""
    rollout, scores, _ = pending
    keep = lambda value: value  # noqa: E731
    if rollout is not None:
        rollout.columns = plain_values(stored_images(rollout.columns), unknown=keep)
    if scores is not None:
        scores.extras, scores.metrics = (plain_values(scores.extras, unknown=keep),
                                         plain_values(scores.metrics, unknown=keep))
    refused = _refused_type(pending)
    return (None, refused) if refused else (pending, None)


STORED_IMAGE = "grpo_lab.image"
"""The key of an image stored as plain values (:func:`stored_images`)."""


def stored_images(value):
    """``value`` (a batch's columns) with every PIL image replaced by plain values a checkpoint loads
    without unpickling code: ``{STORED_IMAGE: the image as lossless PNG bytes}`` (TIFF for a mode PNG
    cannot hold), which keep its mode and palette."""
    if isinstance(value, dict):
        return {key: stored_images(item) for key, item in value.items()}
    if isinstance(value, list):
        return [stored_images(item) for item in value]
    if _is_pil_image(value):
        buffer = io.BytesIO()
        try:
            value.save(buffer, format="PNG")
        except OSError:  # a mode PNG does not take (CMYK, 32-bit float)
            buffer = io.BytesIO()
            value.save(buffer, format="TIFF")
        return {STORED_IMAGE: buffer.getvalue()}
    return value


def restored_images(value):
    """``value`` with the images :func:`stored_images` stored made PIL images again (pixel for pixel)."""
    if isinstance(value, dict):
        if STORED_IMAGE in value:
            from PIL import Image

            image = Image.open(io.BytesIO(value[STORED_IMAGE]))
            image.load()
            return image
        return {key: restored_images(item) for key, item in value.items()}
    if isinstance(value, list):
        return [restored_images(item) for item in value]
    return value


def _is_pil_image(value) -> bool:
    """Whether ``value`` is a PIL image (without importing PIL for a run that has none)."""
    image_module = sys.modules.get("PIL.Image")
    return image_module is not None and isinstance(value, image_module.Image)


def safe_state(state):
    """Like :func:`safe_batch` for any state (the batch ``async_generation`` prepared ahead): made
    plain, and ``(state, None)``, or ``(None, the type)`` where :func:`load_state` would refuse it."""
    state = plain_values(state, unknown=lambda value: value)
    refused = _refused_type(state)
    return (None, refused) if refused else (state, None)


def _refused_type(value) -> str | None:
    """The type :func:`load_state` (``weights_only``) would refuse in ``value``, None where it loads."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    try:
        with _batch_types():
            torch.load(buffer, weights_only=True)
    except pickle.UnpicklingError as error:
        found = re.search(r"GLOBAL (\S+)", str(error))
        return found.group(1) if found else "an object of another type"
    return None


def _batch_types():
    from grpo_lab.rollout.vision import ImageInputs
    from grpo_lab.types import Advantages, DynamicSampling, Rollout, Scores

    return torch.serialization.safe_globals([Rollout, Scores, Advantages, DynamicSampling, ImageInputs])


def saved_model_dir(directory: Path) -> Path:
    """The folder of a checkpoint or save that holds its model: the checkpoint itself, or its
    ``model/`` for one written before format version 2."""
    directory = Path(directory)
    return directory / MODEL_DIR if (directory / MODEL_DIR / "config.json").exists() \
        or (directory / MODEL_DIR / "adapter_config.json").exists() else directory


def load_saved_weights(model, model_dir: Path) -> None:
    """Copy the weights (or adapter) saved in ``model_dir`` into ``model``, which must be built like
    the saved model (a PEFT model with the same adapter for an adapter)."""
    is_peft = hasattr(model, "peft_config")
    if (model_dir / "adapter_config.json").exists() != is_peft:
        saved = "a PEFT adapter" if not is_peft else "a full model"
        raise ValueError(
            f"{model_dir} holds {saved}, but the model given to load it into is "
            f"{'a PEFT' if is_peft else 'not a PEFT'} model; pass a model built like the saved one."
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
    """Write the engine's state into ``directory`` (which must exist), in the layout the module
    docstring gives; ``extra`` is pickled as is, and so is ``per_process``, each process's own state
    (its random state under "rng") in rank order. ``gathered``: the model's, optimizer's and
    reference model's whole state dicts when they are sharded (from the layout's ``full_model_state``,
    ``full_optimizer_state`` and ``full_state``), else None in their places."""
    from grpo_lab.state.model_card import write_training_files

    model_state, optimizer_state, ref_state = gathered
    if ref_state is None and engine.ref_model is not None:
        ref_state = engine.ref_model.state_dict()
    engine.unwrapped_model.save_pretrained(directory, safe_serialization=True, state_dict=model_state)
    engine.processing_class.save_pretrained(directory)
    write_training_files(directory, engine.config, engine.model_reference)
    engine.config.to_yaml(directory / "config.yaml")
    counters = engine_counters(engine)
    own_files = {
        "optimizer": engine.optimizer.state_dict() if optimizer_state is None else optimizer_state,
        "scheduler": counters.pop("scheduler"),
    }
    for key, value in own_files.items():
        torch.save(value, directory / OWN_FILES[key])
    for rank, process in enumerate(per_process):
        name = "rng_state.pth" if len(per_process) == 1 else f"rng_state_{rank}.pth"
        torch.save(_transformers_rng_state(process["rng"]), directory / name)
    state = {
        "format_version": FORMAT_VERSION,
        "optimizer_by_name": optimizer_state is not None,
        "per_process": per_process,
        **counters,
        "ref_model": ref_state,
        "extra": extra,
    }
    torch.save(state, directory / STATE_FILE)
    summary = {"format_version": FORMAT_VERSION, "global_step": engine.global_step, "is_peft": engine.is_peft}
    (directory / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def _transformers_rng_state(rng: dict) -> dict:
    """A process's random state (:func:`grpo_lab.state.run_state.rng_state`) in the layout of
    transformers' ``rng_state.pth``, for tools that read TRL's checkpoints; grpo_lab resumes from its
    own copy in ``trainer_state.pt``."""
    numpy = rng["numpy"]
    state = {
        "python": rng["python"],
        "numpy": (numpy["name"], numpy["keys"].numpy().astype(np.uint32), numpy["position"], numpy["has_gauss"],
                  numpy["cached_gaussian"]),
        "cpu": rng["torch"],
    }
    if "cuda" in rng:
        state["cuda"] = rng["cuda"]
    return state


def trainer_checkpoints(output_dir: Path) -> list[Path]:
    """The ``checkpoint-<step>`` directories in ``output_dir``, oldest step first."""
    found = [
        p for p in Path(output_dir).glob(f"{CHECKPOINT_PREFIX}*")
        if p.name.removeprefix(CHECKPOINT_PREFIX).isascii() and p.name.removeprefix(CHECKPOINT_PREFIX).isdigit()
    ]
    return sorted(found, key=lambda p: int(p.name.removeprefix(CHECKPOINT_PREFIX)))


TRAINER_STATE_FILE = "trainer_state.json"
"""A trainer checkpoint's transformers ``TrainerState`` (log history, best metric), in JSON."""

SAVE_ENTRIES = frozenset({"COMPLETE", STATE_FILE, MODEL_DIR, "config.yaml", "summary.json", "train_dataset",
                          "eval_dataset", TRAINER_STATE_FILE, PARTIAL_MARKER})
"""What a save directory of format version 1 held; a newer one lists its entries in its COMPLETE
marker. Replacing a directory that holds anything else would delete what grpo_lab did not write."""


def check_save_target(target: Path, *, overwrite: bool = False) -> None:
    """Refuse a save ``target`` that is a file, or a directory holding anything but a save's own
    entries (unless ``overwrite``); see :func:`grpo_lab.state.safe_write.check_target`."""
    check_target(Path(target), SAVE_ENTRIES, overwrite=overwrite)


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
    return _read_state(check_complete(directory), mmap=False)


def load_records(directory: Path) -> dict:
    """A checkpoint's records (``history``, ``evaluations``, ``config_changes``...), for reading a run
    without building it. The state file is memory-mapped, so the weights and optimizer state in it
    are not read; and nothing in the directory changes (:func:`check_complete` would finish an
    interrupted save, which is what a save still being written looks like)."""
    directory = Path(directory)
    if not (directory / "COMPLETE").exists() or not (directory / STATE_FILE).exists():
        raise FileNotFoundError(
            f"{directory} is not a complete grpo_lab checkpoint (no COMPLETE marker or {STATE_FILE})."
        )
    return _read_state(directory, mmap=True, own_files=False)["extra"]


def _read_state(directory: Path, *, mmap: bool, own_files: bool = True) -> dict:
    """The state file, with the optimizer's and scheduler's own files (``own_files``) merged in."""
    path = directory / STATE_FILE
    try:
        with _batch_types():
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
            check_format_version(state, str(path))
            for key, name in OWN_FILES.items() if own_files else ():  # format 2 keeps them beside the state
                if key not in state:
                    path = directory / name
                    state[key] = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        return state
    except pickle.UnpicklingError as error:
        found = re.search(r"GLOBAL (\S+)", str(error))
        raise ValueError(
            f"{path} holds objects other than tensors, numbers and grpo_lab's batch results"
            f"{f' ({found.group(1)})' if found else ''}. "
            "grpo_lab does not unpickle them, since unpickling can run code. Either the file was written by a grpo_lab "
            "version that pickled its state, or it was altered. To go on from such a checkpoint you trust, start a new "
            f"run from its weights, GRPOSession('{saved_model_dir(directory)}', ...), which starts the optimizer, "
            "schedule and step count afresh; or load it with the grpo_lab version that wrote it."
        ) from None


def per_process_states(state: dict) -> list[dict]:
    """The checkpoint's per-process entries in rank order: each process's random state ("rng") and
    its share of a half-finished batch ("pending")."""
    return state["per_process"]


def own_process_state(state: dict, process_index: int, num_processes: int) -> dict:
    """This process's entry of :func:`per_process_states`.

    A checkpoint written by another number of processes cannot continue exactly: the half-finished
    batch and the one prepared ahead (``async_generation``) are dropped (``pending`` and
    ``generation_ahead`` None) and a process without a saved state gets ``rng`` None (it is seeded
    afresh).
    """
    saved = per_process_states(state)
    if len(saved) == num_processes:
        return saved[process_index]
    if process_index == 0:
        dropped = ", and its half-finished generation batch is dropped" if saved[0]["pending"][0] is not None else ""
        notices.warn(
            f"The checkpoint was written by {len(saved)} process(es) and is resumed on {num_processes}: the run "
            "continues, but not exactly as an uninterrupted run would (random states and the sharding of prompts "
            f"differ){dropped}.",
        )
    return {"rng": saved[process_index]["rng"] if process_index < len(saved) else None, "pending": None,
            "generation_ahead": None}


def restore_engine(engine, state: dict, rng: dict | None) -> None:
    """Load ``state`` into ``engine``, with ``rng`` this process's random state (None: seed it afresh
    from ``config.seed`` and its rank, as a new run does)."""
    engine.layout.load_optimizer_state(engine.model, engine.optimizer, state["optimizer"],
                                       by_name=state["optimizer_by_name"])
    load_engine_counters(engine, state)
    if state["ref_model"] is not None and engine.ref_model is not None:
        engine.layout.load_full_state(engine.ref_model, state["ref_model"])
    if rng is not None:
        set_rng_state(rng)
    else:
        from grpo_lab.core.hf_trainer_types import set_seed

        set_seed(engine.config.seed + engine.accelerator.process_index)
    engine.publish_weights()
