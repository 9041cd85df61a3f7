"""How a run's model and optimizer state lie over the processes, chosen once per run
(:func:`layout_for`), with the operations that differ between layouts as its methods:

- :class:`Layout` (plain): every process holds the whole weights, gradients and optimizer state
  (one process, or DDP);
- :class:`FSDPLayout`: FSDP shards the parameters, gradients and optimizer state; grpo_lab gathers
  FSDP 2's shards with ``torch.distributed.checkpoint`` (FSDP 1 is refused at build);
- :class:`ZeROLayout`: DeepSpeed ZeRO partitions the optimizer state (stage 1, refused at build)
  and the gradients (2), and the parameters (3); its engine takes the backward passes and the step
  (:mod:`grpo_lab.parallel.zero`).

A new layout is a subclass that answers the same questions and does the same operations, and a
line in :func:`layout_for`. Every gathering method is collective under a sharded layout: every
process calls it, in the same order.
"""

from __future__ import annotations

import math

import torch

from grpo_lab.parallel import zero


class Layout:
    """Every process holds the whole model, its gradients and the optimizer state (see the module docstring)."""

    name = "plain"
    shards_state = False
    """Whether a process holds only a share of the weights or the optimizer state: in-memory state
    dicts, undo and adapter merges are then refused, and checkpoints gather the shares."""
    shards_parameters = False
    """Whether the parameters themselves are sharded (FSDP, ZeRO-3): every forward pass gathers them."""
    backward_gathers = False
    """Whether a backward pass gathers the shards (FSDP): every process must run it, or none."""
    one_dtype_per_shard = False
    """Whether the trainable parameters sharded together must share a dtype (FSDP's flat units)."""

    def __init__(self, accelerator):
        self.accelerator = accelerator

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    # ------------------------------------------------------------------ questions
    def generates_in_lockstep(self) -> bool:
        """Whether every process must run each generation call together: with several processes and
        sharded parameters, every forward pass gathers them by collectives (transformers' ``generate``
        then runs with ``synced_gpus``), so a process may not skip a call the others make."""
        return self.accelerator.num_processes > 1 and self.shards_parameters

    def whole_model_here(self) -> bool:
        """One process holding the whole model, so that a backward pass moves no gradient elsewhere."""
        return self.accelerator.num_processes == 1 and not self.backward_gathers

    # ------------------------------------------------------------------ building
    def check_savable(self) -> None:
        """Refuse, before any training, a run whose checkpoints could not be written whole."""

    def prepare_settings(self, config) -> None:
        """Settings of the layout that grpo_lab's config decides, made before ``prepare``."""

    def shard_frozen_copy(self, model):
        """``model`` (a frozen copy of the policy, such as the KL reference) laid out as the policy is, in
        place, so that each process holds its share of it and not a whole copy; here ``model`` as it is."""
        return model

    def unwrap(self, model):
        """The model inside what ``accelerator.prepare`` put around it: ``torch.compile``'s module, then
        data parallel's (FSDP 2 shards the model in place and wraps nothing). accelerate's own
        ``unwrap_model`` imports DeepSpeed, when installed, to look for its engine: a run that does not
        use DeepSpeed neither loads it nor prints its start-up notice."""
        model = getattr(model, "_orig_mod", model)
        while isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            model = model.module
        return model

    def reshard(self, model) -> None:
        """Free the whole parameters a forward pass without backward left gathered, so that only each
        process's shards remain; nothing here."""

    # ------------------------------------------------------------------ training
    def backward(self, model, loss: torch.Tensor, *, last: bool) -> None:
        """One micro-batch's backward pass; ``last``: the optimizer step's last micro-batch."""
        self.accelerator.backward(loss)

    def clear_gradients(self, model, optimizer) -> None:
        """Drop the gradients of earlier backward passes before a step's first one."""
        optimizer.zero_grad(set_to_none=True)

    def clip_gradients(self, model, parameters: list, max_norm: float, *, clipped) -> tuple[float, bool]:
        """Clip the gradients to ``max_norm`` and call ``clipped()`` (the trainer's
        ``on_pre_optimizer_step``); returns the gradient norm before clipping and whether the step is
        skipped (a gradient that is not finite). The optimizer step itself follows."""
        grad_norm = float(self.accelerator.clip_grad_norm_(parameters, max_norm))
        clipped()
        return grad_norm, not math.isfinite(grad_norm)

    # ------------------------------------------------------------------ whole states
    def whole_tensors(self, model, *, adapter_only: bool = False):
        """``(name, tensor)`` for the model's state dict (``adapter_only``: its trainable parameters, a
        PEFT model's adapter), each tensor whole (gathered from the shards as it is reached)."""
        if adapter_only:
            yield from ((name, parameter.detach()) for name, parameter in model.named_parameters()
                        if parameter.requires_grad)
        else:
            yield from model.state_dict().items()

    def full_state(self, model) -> dict | None:
        """``model``'s whole state dict, every name (tied aliases included) as ``state_dict()`` has them,
        gathered from the shards onto the main process's CPU (the others get an empty dict); None when
        the model is not sharded."""
        return None

    def load_full_state(self, model, state: dict) -> None:
        """Load a whole state dict (from ``state_dict()`` or :meth:`full_state`) into ``model``; each
        process keeps its shard of every tensor."""
        model.load_state_dict(state)

    def full_model_state(self, model, *, adapter_only: bool = False) -> dict | None:
        """The whole model's state dict (``adapter_only``: a PEFT adapter's, gathered alone) from every
        process's shards, on the main process's CPU (the others get an empty dict); None where each
        process holds the whole weights, so that its own ``state_dict()`` is whole."""
        return None

    def full_optimizer_state(self, model, optimizer) -> dict | None:
        """:meth:`full_model_state` for the optimizer: its whole state, keyed by parameter name, which
        loads however many processes shard the model; None where each process holds it whole, and
        before the first update, when there is none to gather."""
        return None

    def load_optimizer_state(self, model, optimizer, state: dict, *, by_name: bool) -> None:
        """Load a saved optimizer ``state`` into ``optimizer`` (every process calls it, each with the
        whole ``state``). ``by_name``: the state is keyed by parameter name, as
        :meth:`full_optimizer_state` writes it; else it is torch's own, keyed by each parameter's
        position in the optimizer. A parameter without saved state starts afresh, as torch's own
        loading leaves it."""
        state = {key: value for key, value in state.items() if key != zero.MASTER_WEIGHTS}  # ZeRO's own fp32 weights
        if not by_name:
            optimizer.load_state_dict(state)
            return
        _set_optimizer_state(model, optimizer, state)


class FSDPLayout(Layout):
    """FSDP shards the parameters, gradients and optimizer state over the processes."""

    name = "fsdp"
    shards_state = shards_parameters = backward_gathers = one_dtype_per_shard = True

    def check_savable(self) -> None:
        if not self.accelerator.is_fsdp2:
            raise NotImplementedError(
                "grpo_lab gathers the shards of FSDP 2 only, and this launch asked for FSDP 1. Set fsdp_version: 2 in "
                "the accelerate config, as examples/accelerate_configs/fsdp.yaml does."
            )

    def shard_frozen_copy(self, model):
        if not self.accelerator.is_fsdp2:
            return model
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        return fsdp2_prepare_model(self.accelerator, model)

    def reshard(self, model) -> None:
        """FSDP 2 keeps the whole parameters after a forward pass without backward (accelerate leaves the
        embeddings, final norm and output layer, and the root's own, gathered after each forward)."""
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def whole_tensors(self, model, *, adapter_only: bool = False):
        for name, tensor in super().whole_tensors(model, adapter_only=adapter_only):
            yield parameter_name(name), whole(tensor)

    def full_state(self, model) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_full_state(self, model, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))

    def full_model_state(self, model, *, adapter_only: bool = False) -> dict:
        if adapter_only:
            main = self.accelerator.is_main_process
            return {name: tensor.cpu() for name, tensor in self.whole_tensors(model, adapter_only=True) if main}
        state = self.full_state(model)
        # gathered, tied weights (embeddings and output layer) are separate copies that save_pretrained
        # would write twice: keep each under its first name, as save_pretrained does with shared tensors
        seen, aliases = set(), set()
        for name, parameter in model.named_parameters(remove_duplicate=False):
            if parameter in seen:
                aliases.add(parameter_name(name))
            seen.add(parameter)
        return {name: tensor for name, tensor in state.items() if name not in aliases}

    def full_optimizer_state(self, model, optimizer) -> dict | None:
        # none before the first update: torch's function would run a zero-learning-rate step to create
        # it, which counts as a step for AdamW
        inner = torch_optimizer(optimizer)
        if not inner.state:
            return None
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(model, inner, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_optimizer_state(self, model, optimizer, state: dict, *, by_name: bool) -> None:
        """As :meth:`Layout.load_optimizer_state`; each process keeps its shard of every tensor. A
        positional state (saved without sharding, e.g. from a notebook's session) is renamed first, so
        that a run continues at scale from a single-process checkpoint."""
        state = {key: value for key, value in state.items() if key != zero.MASTER_WEIGHTS}
        if not by_name and not state["state"]:  # no state: only the settings, the same on any layout
            optimizer.load_state_dict(state)
            return
        if not by_name:
            state = _keyed_by_name(model, torch_optimizer(optimizer), state)
        _set_optimizer_state(model, optimizer, state)


class ZeROLayout(Layout):
    """DeepSpeed ZeRO (stage 1 to 3) partitions the optimizer state, the gradients from stage 2 and
    the parameters at stage 3; its engine takes the backward passes and the step."""

    name = "deepspeed"
    shards_state = True

    def __init__(self, accelerator):
        super().__init__(accelerator)
        self.stage = zero.stage(accelerator)
        self.shards_parameters = self.stage == 3

    def __repr__(self) -> str:
        return f"ZeROLayout(stage={self.stage})"

    def unwrap(self, model):
        return self.accelerator.unwrap_model(model)  # DeepSpeed's engine

    def check_savable(self) -> None:
        if self.stage == 1:
            raise NotImplementedError(
                "grpo_lab gathers the partitions of DeepSpeed ZeRO-2 and ZeRO-3, and this launch asked for ZeRO-1. Set "
                "zero_stage: 2 in the accelerate config (it partitions the gradients too, in no more memory), as "
                "examples/accelerate_configs/deepspeed_zero2.yaml does."
            )

    def prepare_settings(self, config) -> None:
        """DeepSpeed's config's "auto" entries (:func:`grpo_lab.parallel.zero.fill_config`)."""
        zero.fill_config(self.accelerator.state.deepspeed_plugin, config)

    def shard_frozen_copy(self, model):
        return zero.partition_frozen_copy(self.accelerator, model)

    def backward(self, model, loss: torch.Tensor, *, last: bool) -> None:
        zero.backward(model, loss, last=last)

    def clear_gradients(self, model, optimizer) -> None:
        """Refuse where gradients are kept for a step not yet taken
        (:func:`grpo_lab.parallel.zero.check_no_gradients`)."""
        zero.check_no_gradients(model)
        optimizer.zero_grad(set_to_none=True)

    def clip_gradients(self, model, parameters: list, max_norm: float, *, clipped) -> tuple[float, bool]:
        """DeepSpeed's engine clips and steps in one call (:func:`grpo_lab.parallel.zero.step`), after ``clipped()``;
        the optimizer's own step that follows is a no-op, which tells the scheduler that a step was taken."""
        clipped()
        return zero.step(model)

    def whole_tensors(self, model, *, adapter_only: bool = False):
        if zero.partitioned(model):
            yield from zero.whole_tensors(model, adapter_only=adapter_only)
        else:
            yield from super().whole_tensors(model, adapter_only=adapter_only)

    def full_state(self, model) -> dict | None:
        return zero.gathered_state(self.accelerator, model) if zero.partitioned(model) else None

    def load_full_state(self, model, state: dict) -> None:
        if zero.partitioned(model):
            zero.load_whole(model, state)
        else:
            model.load_state_dict(state)

    def full_model_state(self, model, *, adapter_only: bool = False) -> dict | None:
        return zero.full_model_state(self.accelerator, self.unwrap(model), adapter_only=adapter_only)

    def full_optimizer_state(self, model, optimizer) -> dict | None:
        # always by name: DeepSpeed's own state dict holds objects
        return zero.full_optimizer_state(self.accelerator, self.unwrap(model), optimizer)

    def load_optimizer_state(self, model, optimizer, state: dict, *, by_name: bool) -> None:
        zero.load_optimizer_state(self.unwrap(model), optimizer, state, by_name=by_name)


def layout_for(accelerator) -> Layout:
    """The layout an ``accelerate.Accelerator``'s launch gives the run (see the module docstring)."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.FSDP:
        return FSDPLayout(accelerator)
    if accelerator.distributed_type == DistributedType.DEEPSPEED and accelerator.state.deepspeed_plugin.zero_stage > 0:
        return ZeROLayout(accelerator)
    return Layout(accelerator)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP 2 shard (a ``DTensor``; collective: every process must ask for
    the same tensors in the same order), or ``tensor`` itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def torch_optimizer(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds the torch optimizer


_WRAPPER_NAMES = {"_checkpoint_wrapped_module"}
"""Name components that activation checkpointing (an FSDP option) inserts and that parameter names omit."""


def parameter_name(name: str) -> str:
    """A parameter's name in a (gathered) state dict: its module path without wrapper modules."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_NAMES)


def _keyed_by_name(model, optimizer, state: dict) -> dict:
    """torch's positional optimizer state re-keyed by parameter name, for an optimizer over the same
    parameters in the same order."""
    names = {parameter: parameter_name(name) for name, parameter in model.named_parameters()}
    ordered = [names[p] for group in optimizer.param_groups for p in group["params"]]
    return {
        "state": {ordered[index]: value for index, value in state["state"].items()},
        "param_groups": [{**group, "params": [ordered[i] for i in group["params"]]} for group in state["param_groups"]],
    }


def _set_optimizer_state(model, optimizer, state: dict) -> None:
    """Load an optimizer state keyed by parameter name (``torch.distributed.checkpoint``'s full format)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, torch_optimizer(optimizer), optim_state_dict=state,
                             options=StateDictOptions(full_state_dict=True, strict=False))
