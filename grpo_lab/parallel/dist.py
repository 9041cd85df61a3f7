"""The one place that talks to accelerate and torch.distributed about processes.

Everything else calls these helpers, so the engine reads the same on one process and on many:
``gather`` concatenates a tensor from every process in rank order, ``mean``/``total`` reduce a
scalar, ``local_slice`` says which part of a global batch this process owns. How the model's state
lies over the processes (whole, FSDP's shards, ZeRO's partitions) is the run's layout
(:mod:`grpo_lab.parallel.layout`).
"""

from __future__ import annotations

import os

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list

from grpo_lab import notices


def _has_accelerator_device() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return torch.cuda.is_available() or bool(mps and mps.is_available())


def make_accelerator(precision: str, *, use_cpu: bool = False) -> Accelerator:
    """An Accelerator for ``precision`` in {"bf16", "fp16", "fp32"}; gradient accumulation is done by
    the engine itself, so the accelerator's own accumulation stays at 1.

    On a machine without a GPU the accelerator is told so (``cpu=True``): only then does accelerate
    join the processes of ``accelerate launch --multi_gpu`` into one gloo group (MULTI_CPU) instead
    of running each as a separate single-process job. accelerate has no FSDP or DeepSpeed on CPU: a
    launch with such a config runs there as plain data parallel, with a warning that says so.
    """
    mixed = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}[precision]
    _forget_other_precision(mixed)
    cpu = use_cpu or not _has_accelerator_device()
    asked = [name for name in ("FSDP", "DeepSpeed")
             if os.environ.get(f"ACCELERATE_USE_{name.upper()}", "").lower() == "true"]
    if cpu and asked and os.environ.get("RANK", "0") == "0":  # said once, by the main process
        notices.warn(
            f"accelerate launch asked for {asked[0]}, which shards the model over GPUs; on CPU accelerate runs "
            "the processes as plain data parallel instead (each holds the whole model and optimizer).",
        )
    return Accelerator(mixed_precision=mixed, cpu=cpu)


def _forget_other_precision(mixed: str) -> None:
    """accelerate keeps one process-wide state and refuses a second Accelerator with another mixed
    precision. In a single process (a notebook building a second session) that state is reset; under
    ``accelerate launch`` the precision is the launcher's to decide and is left alone."""
    from accelerate.state import AcceleratorState, PartialState

    if not AcceleratorState._shared_state or PartialState().num_processes > 1:
        return
    if str(AcceleratorState().mixed_precision) != mixed:
        AcceleratorState._reset_state()


def find_unused_parameters(accelerator) -> None:
    """Have DDP (where the run is data parallel) look, each backward pass, for parameters it left
    without gradients; otherwise the next step fails, waiting for their reduction."""
    from accelerate.utils import DistributedDataParallelKwargs

    if accelerator.ddp_handler is None:
        accelerator.ddp_handler = DistributedDataParallelKwargs(find_unused_parameters=True)
    else:
        accelerator.ddp_handler.find_unused_parameters = True


def launched_processes() -> int:
    """How many processes this run has, before or after an Accelerator exists: accelerate's count
    once it is set up, else what the launcher put in ``WORLD_SIZE``."""
    from accelerate.state import PartialState

    if PartialState._shared_state:
        return PartialState().num_processes
    return int(os.environ.get("WORLD_SIZE", "1"))


def gather(accelerator: Accelerator, tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate ``tensor`` (same shape on every process) along dim 0 across processes; the result
    is on ``tensor``'s device (the collective runs on the accelerator's: NCCL takes no CPU tensors)."""
    if accelerator.num_processes == 1:
        return tensor
    return accelerator.gather(tensor.to(accelerator.device).contiguous()).to(tensor.device)


def gather_ragged(accelerator: Accelerator, values: torch.Tensor) -> torch.Tensor:
    """Concatenate 1-D ``values`` of any length per process across processes, in process order."""
    if accelerator.num_processes == 1:
        return values
    counts = gather(accelerator, torch.tensor([values.numel()], device=values.device)).tolist()
    padded = torch.zeros(max(counts), dtype=values.dtype, device=values.device)
    padded[: values.numel()] = values
    rows = gather(accelerator, padded).view(len(counts), -1)
    return torch.cat([row[:count] for row, count in zip(rows, counts)])


def gather_to_main(accelerator: Accelerator, item) -> list | None:
    """``item`` (any picklable object) of every process, in rank order, on the main process; None
    on the others."""
    if accelerator.num_processes == 1:
        return [item]
    items = [None] * accelerator.num_processes if accelerator.is_main_process else None
    torch.distributed.gather_object(item, items, dst=0)
    return items


def from_main(accelerator: Accelerator, value):
    """The main process's ``value`` (any picklable object) on every process."""
    if accelerator.num_processes == 1:
        return value
    box = [value]
    broadcast_object_list(box, from_process=0)
    return box[0]


def on_main(accelerator: Accelerator, what: str, work) -> None:
    """Call ``work()`` on the main process alone; every process returns when it is done, and every
    process raises when it failed: the main process its own error, the others a RuntimeError that
    names ``what`` (e.g. "write checkpoint-4") and the main process's error. Collective.

    With a bare ``wait_for_everyone`` after work on the main process, the others, when that work
    raises, wait until the launcher kills them or fail with a lost connection (gloo's "Connection
    closed by peer"), and a multi-node run's other logs never say why.
    """
    if accelerator.num_processes == 1:
        work()
        return
    failure = None
    if accelerator.is_main_process:
        try:
            work()
        except BaseException as error:  # told to the other processes, then raised here
            failure = error
    told = from_main(accelerator, None if failure is None else f"{type(failure).__name__}: {failure}")
    if failure is not None:
        raise failure
    if told is not None:
        raise RuntimeError(f"The main process failed to {what}: {told}")


def total(accelerator: Accelerator, value: torch.Tensor) -> torch.Tensor:
    """Sum of a scalar tensor over processes."""
    return gather(accelerator, value.reshape(1)).sum()


def mean(accelerator: Accelerator, value: torch.Tensor) -> torch.Tensor:
    """Mean of a scalar tensor over processes."""
    return gather(accelerator, value.reshape(1).float()).mean()


def local_slice(accelerator: Accelerator, global_size: int) -> slice:
    """The contiguous part of a global batch of ``global_size`` rows owned by this process."""
    if global_size % accelerator.num_processes:
        raise ValueError(
            f"A global batch of {global_size} cannot be split evenly over {accelerator.num_processes} processes."
        )
    size = global_size // accelerator.num_processes
    return slice(accelerator.process_index * size, (accelerator.process_index + 1) * size)
