"""DeepSpeed ZeRO-2 and ZeRO-3 under ``accelerate launch``: what grpo_lab does differently there.

grpo_lab takes each optimizer step in two stages (``loss()`` runs the backward passes of a step's
micro-batches, ``update()`` the optimizer step), while accelerate's DeepSpeed path steps inside
``accelerator.backward``. Here the DeepSpeed engine is driven directly: every micro-batch's backward
pass with the accumulation boundary set on the step's last one (where ZeRO reduces the gradients),
and ``engine.step()`` (clipping, the optimizer step) in ``update()``.

Checkpoints hold no DeepSpeed files: its loader unpickles (``torch.load(weights_only=False)``),
which grpo_lab's checkpoints never need. The whole weights (ZeRO-3's partitions gathered onto the
main process a parameter at a time) are saved as without sharding, and the optimizer state is
gathered from the partitions into the format of FSDP checkpoints (torch's full optimizer state dict,
keyed by parameter name), so a ZeRO checkpoint opens without ZeRO too. Every function here that
gathers or scatters is a collective: every process calls it, in the same order. Nothing imports
``deepspeed`` unless a DeepSpeed run is under way.
"""

from __future__ import annotations

import copy
import weakref

import torch

_AUTO_FROM_CONFIG = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping")

_pending = weakref.WeakSet()
"""DeepSpeed engines whose gradients a backward pass has added to since their last step."""


def fill_config(plugin, config) -> None:
    """Fill the DeepSpeed config's "auto" entries that grpo_lab's config decides, before ``prepare``:
    the micro-batch (``per_device_train_batch_size``), the gradient clipping (``max_grad_norm``, 0 for
    none) and the accumulation, which grpo_lab does itself (1 for DeepSpeed, or it would divide each
    micro-batch's loss again). A set value that disagrees is refused, naming both."""
    wanted = {"train_micro_batch_size_per_gpu": config.per_device_train_batch_size, "gradient_accumulation_steps": 1,
              "gradient_clipping": float(max(config.max_grad_norm, 0.0))}
    ds_config = plugin.deepspeed_config
    for key in _AUTO_FROM_CONFIG:
        value = ds_config.get(key, "auto")
        if value == "auto":
            ds_config[key] = wanted[key]
            continue
        whole = key != "gradient_clipping"
        if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)):
            kind = "a whole number" if whole else "a number (0 for no clipping)"
            raise ValueError(
                f"The DeepSpeed config sets {key}={value!r} ({type(value).__name__}); it takes \"auto\" or {kind}. "
                f"Set it to \"auto\" (grpo_lab fills in {wanted[key]!r} from its config), or write {kind} there, "
                "unquoted."
            )
        if float(value) != float(wanted[key]):
            source = {"train_micro_batch_size_per_gpu": "per_device_train_batch_size",
                      "gradient_accumulation_steps": "gradient_accumulation_steps (grpo_lab accumulates itself; "
                                                     "DeepSpeed's must be 1)",
                      "gradient_clipping": "max_grad_norm"}[key]
            raise ValueError(
                f"The DeepSpeed config sets {key}={value!r}, but grpo_lab's config gives {wanted[key]!r} "
                f"(from {source}). Set it to \"auto\" in the DeepSpeed config, and the value in GRPOConfig."
            )


def backward(model, loss: torch.Tensor, *, last: bool) -> None:
    """One micro-batch's backward pass through the DeepSpeed engine ``model``; ``last``: the step's
    last micro-batch, where ZeRO reduces the accumulated gradients over the processes."""
    model.set_gradient_accumulation_boundary(last)
    model.backward(loss)
    _pending.add(model)


def check_no_gradients(model) -> None:
    """Refuse a second ``loss()`` before ``update()``: ZeRO keeps the gradients it accumulated in
    partitions of its own, which zeroing the parameters' gradients does not clear."""
    if model in _pending:
        raise RuntimeError(
            "Under DeepSpeed ZeRO the gradients of a loss() are kept until update() takes the step: loss() "
            "cannot run again before update() (it would add its gradients to the kept ones)."
        )


def step(model) -> tuple[float, bool]:
    """The optimizer step of the DeepSpeed engine ``model`` (it clips the gradients first):
    ``(gradient norm before clipping, whether the step was skipped)``: DeepSpeed's own check skips
    a step whose gradient is not finite, as grpo_lab does without it."""
    model.step()
    _pending.discard(model)
    norm = model.get_global_grad_norm()
    norm = float("nan") if norm is None else float(norm)
    return norm, not model.was_step_applied()


def partitioned(module) -> bool:
    """Whether ZeRO-3 partitions ``module``'s parameters (each process holds a part of each)."""
    return any(hasattr(parameter, "ds_id") for parameter in module.parameters())


def full_model_state(accelerator, module, *, adapter_only: bool) -> dict | None:
    """``module``'s whole weights (``adapter_only``: its trainable ones, a PEFT adapter) on the main
    process's CPU, the others getting an empty dict; None under ZeRO-2, where every process holds
    them whole. A tied weight is kept under its first name, as ``save_pretrained`` keeps it."""
    if not partitioned(module):
        return None
    main = accelerator.is_main_process
    if adapter_only:
        return {name: tensor.cpu() for name, tensor in whole_tensors(module, adapter_only=True) if main}
    seen, kept = set(), {}
    for name, tensor in gathered_state(accelerator, module).items():
        if id(tensor) not in seen:  # tied weights are one tensor under several names
            seen.add(id(tensor))
            kept[name] = tensor
    return kept


def gathered_state(accelerator, module) -> dict:
    """The whole state dict (every name, tied aliases included, as ``state_dict()`` has them) of a
    ``module`` that ZeRO-3 partitions, on the main process's CPU; the others get an empty dict."""
    main = accelerator.is_main_process
    state = {name: tensor.cpu() for name, tensor in whole_tensors(module) if main}
    if not main:
        return {}
    first: dict = {}
    alias = {name: first.setdefault(parameter, name)
             for name, parameter in module.named_parameters(remove_duplicate=False)}
    return {name: state[alias.get(name, name)] for name in module.state_dict()}


def whole_tensors(module, *, adapter_only: bool = False):
    """``(name, tensor)`` of ``module``'s parameters (``adapter_only``: its trainable ones), each
    gathered whole from ZeRO-3's partitions as it is reached, then its persistent buffers (none with
    ``adapter_only``). Collective."""
    import deepspeed

    for name, parameter in module.named_parameters():
        if adapter_only and not parameter.requires_grad:
            continue
        with deepspeed.zero.GatheredParameters([parameter]):
            yield name, parameter.detach().clone()
    if not adapter_only:
        parameters = dict(module.named_parameters(remove_duplicate=False))
        for name, tensor in module.state_dict().items():
            if name not in parameters:
                yield name, tensor


def whole_copy(module):
    """A copy of ``module`` with plain parameters, whole on every process: the policy copied as the
    KL reference before ``prepare``. ZeRO-3 may have partitioned it already while loading it
    (``zero3_init_flag``), and a copy of such parameters would still gather from the original's, so
    each is gathered whole, copied, and replaced by a plain parameter (ties kept)."""
    if not partitioned(module):
        return copy.deepcopy(module)
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        copied = copy.deepcopy(module)
    plain: dict[int, torch.nn.Parameter] = {}
    for owner in copied.modules():
        for name, parameter in owner._parameters.items():
            if parameter is not None:
                owner._parameters[name] = plain.setdefault(
                    id(parameter), torch.nn.Parameter(parameter.data.clone(), requires_grad=parameter.requires_grad))
    return copied


_frozen_engines = weakref.WeakKeyDictionary()
"""The DeepSpeed engine of each frozen copy partitioned by :func:`partition_frozen_copy`, kept while
the copy lives: its hooks gather the copy's parameters in each forward pass."""


def partition_frozen_copy(accelerator, module):
    """Under ZeRO-3, ``module`` (a frozen copy of the policy, the KL reference) partitioned over the
    processes as the policy is, by an engine without optimizer (as TRL prepares its reference), so
    that each process holds its part and its forward passes gather a layer at a time; under ZeRO-2,
    whose weights are whole on every process, ``module`` itself. Either way in the dtype
    DeepSpeed gives the policy (bf16 or fp16 under its mixed precision), whatever dtype the copy was
    loaded in: a resumed run, which loads the saved 16-bit weights, then holds the same reference as
    the uninterrupted one. Collective."""
    ds_config = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
    if stage(accelerator) != 3:
        half = [dtype for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16))
                if ds_config.get(key, {}).get("enabled") is True]
        return module.to(half[0]) if half else module
    import deepspeed

    for key in ("optimizer", "scheduler"):
        ds_config.pop(key, None)
    engine, *_ = deepspeed.initialize(model=module, config=ds_config)
    engine.eval()
    _frozen_engines[engine.module] = engine
    return engine.module


def stage(accelerator) -> int:
    return accelerator.state.deepspeed_plugin.zero_stage


def parameter_pairs(first, second):
    """The parameters of two models built alike, pairwise and whole: where ZeRO-3 partitions them,
    each pair is gathered while the caller changes the first (the main process's change is kept and
    partitioned again). Collective then."""
    pairs = zip(first.parameters(), second.parameters(), strict=True)
    if not partitioned(first):
        yield from pairs
        return
    import deepspeed

    for pair in pairs:
        with deepspeed.zero.GatheredParameters(list(pair), modifier_rank=0):
            yield pair


def load_whole(module, state: dict) -> None:
    """Load a whole state dict (every process passes all of it) into ``module``, whose parameters
    ZeRO-3 partitions: each is gathered, overwritten on the main process, and partitioned again."""
    import deepspeed

    with torch.no_grad():
        for name, parameter in module.named_parameters():
            with deepspeed.zero.GatheredParameters([parameter], modifier_rank=0):
                parameter.copy_(state[name])
        for name, buffer in module.named_buffers():
            if name in state:
                buffer.copy_(state[name])


def _groups(optimizer) -> list[tuple[int, list, torch.Tensor]]:
    """For each partition the ZeRO ``optimizer`` steps (a flat fp32 tensor, one per parameter group,
    or per sub-group under ZeRO-3): ``(index of the parameter group, its model parameters, in order)``
    with the flat tensor, as ``[(group, parameters, flat)]``."""
    if hasattr(optimizer, "fp32_partitioned_groups_flat"):  # ZeRO-3
        return [(optimizer.sub_group_to_group_id[i], params, optimizer.fp32_partitioned_groups_flat[i])
                for i, params in enumerate(optimizer.fp16_groups)]
    flats = optimizer.single_partition_of_fp32_groups
    return [(i, params, flats[i]) for i, params in enumerate(optimizer.bit16_groups)]


def _zero_optimizer(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds DeepSpeed's optimizer


def full_optimizer_state(accelerator, module, optimizer) -> dict:
    """The optimizer state gathered from ZeRO's partitions, keyed by parameter name as torch's full
    optimizer state dict is (``{"state": {name: {"step", "exp_avg", ...}}, "param_groups": [...]}``),
    on the main process (the others get it with an empty "state"). Before the first step its "state"
    is empty: the settings alone, as torch's own state then holds.

    Where the model's weights are in bf16 or fp16 (DeepSpeed's mixed precision), the fp32 weights the
    optimizer steps are kept too, by name under ``MASTER_WEIGHTS``: the saved 16-bit weights alone
    would round them, and a resumed run would drift from the uninterrupted one."""
    from deepspeed.utils import safe_get_full_optimizer_state

    zero = _zero_optimizer(optimizer)
    inner = zero.optimizer
    names = {parameter: name for name, parameter in module.named_parameters()}
    group_names: dict[int, list[str]] = {}
    state = {}
    for group, params, flat in _groups(zero):
        group_names.setdefault(group, []).extend(names[p] for p in params)
        saved = inner.state.get(flat, {})
        keys = [key for key, value in saved.items() if torch.is_tensor(value) and value.shape == flat.shape]
        for parameter in params:
            entry = {key: safe_get_full_optimizer_state(parameter, key) for key in keys}  # collective
            if saved and accelerator.is_main_process:
                scalars = {key: value.clone() if torch.is_tensor(value) else value
                           for key, value in saved.items() if key not in keys}
                state[names[parameter]] = {**scalars, **{key: value.cpu() for key, value in entry.items()}}
    param_groups = [{**{k: v for k, v in settings.items() if k != "params"}, "params": group_names.get(i, [])}
                    for i, settings in enumerate(inner.param_groups)]
    masters = _master_weights(zero, names, main=accelerator.is_main_process)
    return {"state": state, "param_groups": param_groups, **({} if masters is None else {MASTER_WEIGHTS: masters})}


MASTER_WEIGHTS = "zero_master_weights"
"""The entry of a ZeRO optimizer state (:func:`full_optimizer_state`) that holds the fp32 weights
under DeepSpeed's mixed precision; loading under another layout leaves it out."""


def _master_weights(zero, names: dict, *, main: bool) -> dict | None:
    """The fp32 weights ZeRO steps, by parameter name, gathered onto the main process (the others get
    an empty dict), where the model's own are in 16 bits; else None. Collective."""
    from deepspeed.utils import safe_get_full_fp32_param

    parameters = [parameter for _, params, _ in _groups(zero) for parameter in params]
    if all(parameter.dtype == torch.float32 for parameter in parameters):
        return None
    gathered = ((names[parameter], safe_get_full_fp32_param(parameter)) for parameter in parameters)
    return {name: tensor.cpu() for name, tensor in gathered if main}


def load_optimizer_state(module, optimizer, state: dict, *, by_name: bool) -> None:
    """Put a saved optimizer ``state`` (every process passes the whole of it) into ZeRO's partitions:
    keyed by parameter name (:func:`full_optimizer_state`, an FSDP checkpoint's), or torch's own,
    keyed by position (a checkpoint saved without sharding), for the same parameters in the same
    order. A parameter without saved state starts afresh (zeros), as torch's own loading leaves it."""
    from deepspeed.utils import safe_set_full_optimizer_state

    zero = _zero_optimizer(optimizer)
    inner = zero.optimizer
    names = {parameter: name for name, parameter in module.named_parameters()}
    ordered = [names[p] for _, params, _ in sorted(_groups(zero), key=lambda item: item[0]) for p in params]
    saved = state["state"] if by_name else {ordered[index]: value for index, value in state["state"].items()}
    for settings, group in zip(state["param_groups"], inner.param_groups, strict=True):
        group.update({key: value for key, value in settings.items() if key != "params"})
    _load_master_weights(zero, names, state.get(MASTER_WEIGHTS, {}))
    if not saved:
        return
    for _, params, flat in _groups(zero):
        entries = [saved[names[p]] for p in params if names[p] in saved]
        if not entries:
            continue
        kept = inner.state.setdefault(flat, {})
        for key, value in entries[0].items():
            if torch.is_tensor(value) and value.dim() > 0:
                kept.setdefault(key, torch.zeros_like(flat))
            else:  # the step count: one per partition, the same for every parameter in it
                kept[key] = value.clone() if torch.is_tensor(value) else value
    _link_state(zero)
    for _, params, _ in _groups(zero):
        for parameter in params:
            for key, value in saved.get(names[parameter], {}).items():
                if torch.is_tensor(value) and value.dim() > 0:
                    safe_set_full_optimizer_state(parameter, value.to(parameter.device), key)


def _load_master_weights(zero, names: dict, masters: dict) -> None:
    """Put saved fp32 weights (``MASTER_WEIGHTS``) into ZeRO's partitions; the model's 16-bit
    weights, loaded from the checkpoint's model files, are these rounded already."""
    from deepspeed.utils import safe_set_full_fp32_param

    for _, params, _ in _groups(zero):
        for parameter in params:
            if names[parameter] in masters:
                safe_set_full_fp32_param(parameter, masters[names[parameter]].to(parameter.device))


def _link_state(zero) -> None:
    """Have ZeRO-2 map each parameter to its slice of the optimizer state just created (done after
    the first step otherwise); ZeRO-3 reads the state by the partition each time."""
    if hasattr(zero, "_lazy_init_hp_params_optimizer_state"):
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()
