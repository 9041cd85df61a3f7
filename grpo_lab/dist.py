"""The one place that talks to accelerate and torch.distributed.

Everything else calls these helpers, so the engine reads the same on one process and on many:
``gather`` concatenates a tensor from every process in rank order, ``mean``/``total`` reduce a
scalar, ``local_slice`` says which part of a global batch this process owns.
"""

from __future__ import annotations

import os

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list

from grpo_lab import notices, zero


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


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP 2 shard (a ``DTensor``; collective: every process must ask for
    the same tensors in the same order), or ``tensor`` itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def sharding(accelerator: Accelerator) -> str | None:
    """"fsdp" when FSDP shards the model's parameters over the processes (grpo_lab gathers FSDP 2's
    shards; ``check_savable`` refuses FSDP 1), "deepspeed" when DeepSpeed
    partitions the optimizer state (ZeRO stages 1 to 3), None when each process holds everything."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.FSDP:
        return "fsdp"
    if accelerator.distributed_type == DistributedType.DEEPSPEED and accelerator.state.deepspeed_plugin.zero_stage > 0:
        return "deepspeed"
    return None


def generates_in_lockstep(accelerator: Accelerator) -> bool:
    """Whether every process must run each generation call together: with several processes, FSDP or
    ZeRO-3 gather the sharded parameters by collectives inside every forward pass (transformers'
    ``generate`` then runs with ``synced_gpus``), so a process may not skip a call the others make."""
    kind = sharding(accelerator)
    zero3 = kind == "deepspeed" and accelerator.state.deepspeed_plugin.zero_stage == 3
    return accelerator.num_processes > 1 and (kind == "fsdp" or zero3)


def check_savable(accelerator: Accelerator) -> None:
    """Refuse, before any training, a run whose checkpoints could not be written whole."""
    if sharding(accelerator) == "fsdp" and not accelerator.is_fsdp2:
        raise NotImplementedError(
            "grpo_lab gathers the shards of FSDP 2 only, and this launch asked for FSDP 1. Set fsdp_version: 2 in "
            "the accelerate config, as examples/accelerate_configs/fsdp.yaml does."
        )
    if sharding(accelerator) == "deepspeed" and zero.stage(accelerator) == 1:
        raise NotImplementedError(
            "grpo_lab gathers the partitions of DeepSpeed ZeRO-2 and ZeRO-3, and this launch asked for ZeRO-1. Set "
            "zero_stage: 2 in the accelerate config (it partitions the gradients too, in no more memory), as "
            "examples/accelerate_configs/deepspeed_zero2.yaml does."
        )


def prepare_settings(accelerator: Accelerator, config) -> None:
    """Settings of the launch's sharding that grpo_lab's config decides, made before ``prepare``
    (under DeepSpeed, its config's "auto" entries: see :func:`grpo_lab.zero.fill_config`)."""
    if sharding(accelerator) == "deepspeed":
        zero.fill_config(accelerator.state.deepspeed_plugin, config)


def backward(accelerator: Accelerator, model, loss: torch.Tensor, *, last: bool) -> None:
    """One micro-batch's backward pass; ``last``: the optimizer step's last micro-batch. Under
    DeepSpeed the engine takes it (:func:`grpo_lab.zero.backward`), and :func:`grpo_lab.zero.step` the step."""
    if sharding(accelerator) == "deepspeed":
        zero.backward(model, loss, last=last)
    else:
        accelerator.backward(loss)


def clear_gradients(accelerator: Accelerator, model, optimizer) -> None:
    """Drop the gradients of earlier backward passes before a step's first one; under DeepSpeed,
    refuse where some are kept for a step not yet taken (:func:`grpo_lab.zero.check_no_gradients`)."""
    if sharding(accelerator) == "deepspeed":
        zero.check_no_gradients(model)
    optimizer.zero_grad(set_to_none=True)


def whole_tensors(accelerator: Accelerator, model, *, adapter_only: bool = False):
    """``(name, tensor)`` for the model's state dict (``adapter_only``: its trainable parameters, a
    PEFT model's adapter), each tensor whole. Under FSDP (or ZeRO-3) each is gathered from the shards
    (or partitions) as it is reached: a collective, so every process must go through all of them in
    the same order."""
    if adapter_only:
        items = ((name, parameter.detach()) for name, parameter in model.named_parameters() if parameter.requires_grad)
    else:
        items = model.state_dict().items()
    if zero.partitioned(model):
        yield from zero.whole_tensors(model, adapter_only=adapter_only)
        return
    if sharding(accelerator) != "fsdp":
        yield from items
        return
    for name, tensor in items:
        yield _parameter_name(name), whole(tensor)


def shard_frozen_copy(accelerator: Accelerator, model):
    """Under FSDP 2, ``model`` (a frozen copy of the policy, such as the KL reference) sharded over the
    processes as accelerate shards the policy, in place, so that each process holds its share of it
    and not a whole copy (under ZeRO-3: :func:`grpo_lab.zero.partition_frozen_copy`); else ``model``
    as it is. Collective."""
    if sharding(accelerator) == "deepspeed":
        return zero.partition_frozen_copy(accelerator, model)
    if sharding(accelerator) != "fsdp" or not accelerator.is_fsdp2:
        return model
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    return fsdp2_prepare_model(accelerator, model)


def reshard(model) -> None:
    """Free the whole parameters FSDP 2 keeps after a forward pass without backward (accelerate leaves
    the embeddings, final norm and output layer, and the root's own, gathered after each forward),
    so that only each process's shards remain; nothing for a model that is not sharded."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def full_state(accelerator: Accelerator, model) -> dict | None:
    """Under FSDP (or ZeRO-3), ``model``'s whole state dict, every name (tied aliases included) as
    ``state_dict()`` has them, gathered from the shards (or partitions) onto the main process's CPU
    (the others get an empty dict); None when the model is not sharded. Collective: every process
    must call it."""
    if sharding(accelerator) != "fsdp":
        return zero.gathered_state(accelerator, model) if zero.partitioned(model) else None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_state(accelerator: Accelerator, model, state: dict) -> None:
    """Load a whole state dict (from ``state_dict()`` or :func:`full_state`) into ``model``; under FSDP
    (or ZeRO-3) each process keeps its shard (or partition) of every tensor. Collective then."""
    if zero.partitioned(model):
        zero.load_whole(model, state)
        return
    if sharding(accelerator) != "fsdp":
        model.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


def full_model_state(accelerator: Accelerator, model, *, adapter_only: bool = False) -> dict | None:
    """Under FSDP (or ZeRO-3), the whole model's state dict (``adapter_only``: a PEFT adapter's,
    gathered alone) from every process's shards, on the main process's CPU (the others get an empty
    dict); None when each process holds the whole weights (no sharding, ZeRO-2), so that its own
    ``state_dict()`` is whole. Collective: every process must call it."""
    if sharding(accelerator) == "deepspeed":
        return zero.full_model_state(accelerator, accelerator.unwrap_model(model), adapter_only=adapter_only)
    if sharding(accelerator) is None:
        return None
    if adapter_only:
        main = accelerator.is_main_process
        return {name: tensor.cpu() for name, tensor in whole_tensors(accelerator, model, adapter_only=True) if main}
    state = full_state(accelerator, model)
    # gathered, tied weights (embeddings and output layer) are separate copies that save_pretrained
    # would write twice: keep each under its first name, as save_pretrained does with shared tensors
    seen, aliases = set(), set()
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if parameter in seen:
            aliases.add(_parameter_name(name))
        seen.add(parameter)
    return {name: tensor for name, tensor in state.items() if name not in aliases}


def full_optimizer_state(accelerator: Accelerator, model, optimizer) -> dict | None:
    """:func:`full_model_state` for the optimizer: under FSDP its whole state, keyed by parameter
    name (``torch.distributed.checkpoint``'s full format), which loads however many processes shard
    the model, or none. Collective.

    None too before the first update, when there is no state to gather: torch's function would
    then run a zero-learning-rate step to create it, which counts as a step for AdamW.
    """
    if sharding(accelerator) == "deepspeed":  # always by name: DeepSpeed's own state dict holds objects
        return zero.full_optimizer_state(accelerator, accelerator.unwrap_model(model), optimizer)
    inner = _torch_optimizer(optimizer)
    if sharding(accelerator) is None or not inner.state:
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, inner, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(accelerator: Accelerator, model, optimizer, state: dict, *, by_name: bool) -> None:
    """Load a saved optimizer ``state`` into ``optimizer`` (every process calls it, each with the
    whole ``state``). ``by_name``: the state is keyed by parameter name, as :func:`full_optimizer_state`
    writes it; else it is torch's own, keyed by each parameter's position in the optimizer.

    Under FSDP each process keeps its shard of every tensor. A positional state (saved without
    sharding, e.g. from a notebook's session) is renamed first, so that a run continues at scale
    from a single-process checkpoint. A parameter without saved state (it never had a gradient)
    starts afresh, as torch's own loading leaves it.
    """
    if sharding(accelerator) == "deepspeed":
        zero.load_optimizer_state(accelerator.unwrap_model(model), optimizer, state, by_name=by_name)
        return
    state = {key: value for key, value in state.items() if key != zero.MASTER_WEIGHTS}  # ZeRO's own fp32 weights
    sharded = sharding(accelerator) == "fsdp"
    if not by_name and (not sharded or not state["state"]):  # no state: only the settings, the same on any layout
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    inner = _torch_optimizer(optimizer)
    if not by_name:
        state = _keyed_by_name(model, inner, state)
    options = StateDictOptions(full_state_dict=True, strict=False)
    set_optimizer_state_dict(model, inner, optim_state_dict=state, options=options)


def _torch_optimizer(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds the torch optimizer


_WRAPPER_NAMES = {"_checkpoint_wrapped_module"}
"""Name components that activation checkpointing (an FSDP option) inserts and that parameter names omit."""


def _parameter_name(name: str) -> str:
    """A parameter's name in a (gathered) state dict: its module path without wrapper modules."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_NAMES)


def _keyed_by_name(model, optimizer, state: dict) -> dict:
    """torch's positional optimizer state re-keyed by parameter name, for an optimizer over the same
    parameters in the same order."""
    names = {parameter: _parameter_name(name) for name, parameter in model.named_parameters()}
    ordered = [names[p] for group in optimizer.param_groups for p in group["params"]]
    return {
        "state": {ordered[index]: value for index, value in state["state"].items()},
        "param_groups": [{**group, "params": [ordered[i] for i in group["params"]]} for group in state["param_groups"]],
    }
