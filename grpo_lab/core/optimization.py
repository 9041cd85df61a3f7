"""The engine's optimization: the optimizer (the one grpo_lab builds by ``optim``'s transformers name
when ``optimizers=`` gives none), its learning-rate schedule and the entropy bonus's weight,
with the edits a live session makes to them (learning rate, AdamW settings, schedule, entropy
weight, called by :mod:`grpo_lab.config.live`).

Its ``state_dict()`` holds the schedule's and the entropy weight's state (``{"scheduler",
"entropy_control"}``, the keys a checkpoint keeps them under); the optimizer's own state is saved
apart, whole in one process and gathered from the shards under FSDP or ZeRO (:mod:`grpo_lab.parallel.dist`).
"""

from __future__ import annotations

import math
import warnings

import torch
from transformers import get_scheduler

from grpo_lab import ops

TORCH_ADAMW = ("adamw_torch_fused", "adamw_torch")
"""The names built here as torch's AdamW (fused for the first)."""


def optimizer_for(policy, config) -> torch.optim.Optimizer:
    """``config.optim`` over the trainable parameters of ``policy``, with ``learning_rate``, the Adam
    betas and epsilon and ``weight_decay``. adamw_torch_fused and adamw_torch are torch's AdamW; any
    other of transformers' names (``paged_adamw_8bit``, ``adafactor``, ``sgd``, ...) is built as
    transformers' Trainer builds it (``Trainer.get_optimizer_cls_and_kwargs``), as TRL's trainer does,
    except that ``weight_decay`` applies to every trainable parameter here (transformers leaves biases
    and norms out)."""
    trainable = [parameter for parameter in policy.parameters() if parameter.requires_grad]
    if config.optim in TORCH_ADAMW:
        return torch.optim.AdamW(trainable, lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2),
                                 eps=config.adam_epsilon, weight_decay=config.weight_decay,
                                 fused=config.optim == "adamw_torch_fused")
    from transformers import Trainer

    optimizer_class, kwargs = Trainer.get_optimizer_cls_and_kwargs(config, policy)
    return optimizer_class([{"params": trainable, "weight_decay": config.weight_decay}], **kwargs)


class EntropyWeight:
    """The entropy bonus's weight ``coef`` and the last optimizer step's mean token entropy, which
    the adaptive weight (``use_adaptive_entropy``) follows; a loss pass holds its step's entropy
    until the step is taken."""

    def __init__(self, coef: float):
        self.coef = coef
        self.last_step_entropy: float | None = None
        self.pending_step_entropy: float | None = None  # the held step's, until update() adapts to it

    def applied(self, config) -> float:
        """The weight a loss uses now (:func:`grpo_lab.ops.applied_entropy_coef`)."""
        return ops.applied_entropy_coef(self.coef, self.last_step_entropy, adaptive=config.use_adaptive_entropy,
                                        target=config.entropy_target)

    def after_step(self, config) -> None:
        """Adapt the weight to the step just taken (``use_adaptive_entropy``), whose entropy becomes the last."""
        if config.use_adaptive_entropy and self.pending_step_entropy is not None:
            self.coef = ops.adapt_entropy_coef(
                self.coef, self.pending_step_entropy, target=config.entropy_target, delta=config.entropy_coef_delta,
                coef_min=config.entropy_coef_min, coef_max=config.entropy_coef_max,
            )
            self.last_step_entropy, self.pending_step_entropy = self.pending_step_entropy, None

    def restart(self, coef: float, *, forget_entropy: bool) -> None:
        """Restart from ``coef``; with ``forget_entropy`` also drop the measured step entropy."""
        self.coef = coef
        if forget_entropy:
            self.last_step_entropy = self.pending_step_entropy = None

    def state_dict(self) -> dict:
        return {"coef": self.coef, "last_step_entropy": self.last_step_entropy}

    def load_state_dict(self, state: dict) -> None:
        self.coef, self.last_step_entropy = state["coef"], state["last_step_entropy"]


def check_schedule_kwargs(scheduler_type, kwargs: dict) -> None:
    """Refuse ``lr_scheduler_kwargs`` that transformers' schedule function for ``scheduler_type`` does
    not take, naming those it does take (the ones grpo_lab passes itself left out)."""
    import inspect

    from transformers.optimization import TYPE_TO_SCHEDULER_FUNCTION
    from grpo_lab.core.hf_trainer_types import SchedulerType

    function = TYPE_TO_SCHEDULER_FUNCTION[SchedulerType(scheduler_type)]
    given = {"optimizer", "num_warmup_steps", "num_training_steps"}
    parameters = inspect.signature(function).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    takes = [name for name in parameters if name not in given | {"last_epoch"}]
    unknown = sorted(set(kwargs) - set(takes) - {"last_epoch"})
    if unknown:
        offered = f"the arguments it takes are {', '.join(takes)}" if takes else "it takes no arguments of its own"
        raise ValueError(
            f"lr_scheduler_kwargs={kwargs!r}: the {SchedulerType(scheduler_type).value!r} schedule takes no "
            f"{', '.join(map(repr, unknown))}; {offered}. Remove them, or pick the lr_scheduler_type they "
            "belong to."
        )


class Optimization:
    """The optimizer, its schedule and the entropy weight. ``owns_optimizer`` / ``owns_scheduler``:
    whether grpo_lab built them from the config (else they were passed in ``optimizers=``, and keep
    their own settings)."""

    def __init__(self, optimizer, scheduler, config, total_steps: int, *, owns_optimizer: bool):
        self.optimizer, self.owns_optimizer = optimizer, owns_optimizer
        self.owns_scheduler = scheduler is None
        self.scheduler = self.new_scheduler(config, total_steps) if scheduler is None else scheduler
        self.entropy = EntropyWeight(config.entropy_coef)

    def new_scheduler(self, config, total_steps: int):
        """The learning-rate schedule of ``lr_scheduler_type`` over ``total_steps``, at step 0."""
        fraction = config.warmup_steps if 0 < config.warmup_steps < 1 else config.warmup_ratio
        warmup = int(config.warmup_steps) if config.warmup_steps >= 1 else math.ceil(fraction * total_steps)
        kwargs = config.lr_scheduler_kwargs or {}
        check_schedule_kwargs(config.lr_scheduler_type, kwargs)
        return get_scheduler(
            config.lr_scheduler_type, self.optimizer, num_warmup_steps=warmup, num_training_steps=total_steps,
            scheduler_specific_kwargs=kwargs,
        )

    def rebuild_schedule(self, config, total_steps: int) -> None:
        """Rebuild the learning-rate schedule from the config (after ``max_steps``, ``num_train_epochs``,
        ``lr_scheduler_type``, ``lr_scheduler_kwargs``, ``warmup_steps`` or ``warmup_ratio`` changed)
        and move it as far as the old one had gone (skipped updates did not step it), as if the run had
        started with these settings. Only for a schedule grpo_lab built (``owns_scheduler``)."""
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs, strict=True):
            group["initial_lr"] = base  # each group's own base rate
        scheduler = self.new_scheduler(config, total_steps)
        with warnings.catch_warnings():  # stepping a fresh schedule forward, not skipping an optimizer step
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            for _ in range(self.scheduler.last_epoch):  # the steps taken: skipped updates did not step it
                scheduler.step()
        self.scheduler = scheduler

    def apply_adamw_settings(self, config) -> None:
        """Apply the config's AdamW betas, epsilon and weight decay from the next optimizer step on
        (to the optimizer grpo_lab built, where it has them; one passed in ``optimizers=`` keeps its own)."""
        if self.owns_optimizer:
            settings = {"betas": (config.adam_beta1, config.adam_beta2), "eps": config.adam_epsilon,
                        "weight_decay": config.weight_decay}
            for group in self.optimizer.param_groups:  # another optimizer than AdamW may take other settings
                group.update({key: value for key, value in settings.items() if key in group})

    def set_learning_rate(self, value: float, previous: float) -> None:
        """Apply ``learning_rate`` ``value`` (was ``previous``) from now on, keeping the schedule's current
        factor: each parameter group's base rate is scaled by ``value / previous``, so groups given
        their own rates (``optimizers=``) keep their ratios; from a previous rate of 0, every base is
        ``value`` and the factor is read from the schedule (1 for a scheduler without ``lr_lambdas``)."""
        bases = [base * value / previous if previous else value for base in self.scheduler.base_lrs]
        lambdas = getattr(self.scheduler, "lr_lambdas", None)
        groups = zip(self.optimizer.param_groups, self.scheduler.base_lrs, bases, strict=True)
        for index, (group, base, new) in enumerate(groups):
            if base:
                factor = group["lr"] / base
            else:
                factor = lambdas[index](self.scheduler.last_epoch) if lambdas else 1.0
            group["lr"] = new * factor
        self.scheduler.base_lrs = bases

    def state_dict(self) -> dict:
        """The schedule's and the entropy weight's state (see the module docstring)."""
        return {"scheduler": self.scheduler.state_dict(), "entropy_control": self.entropy.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.entropy.load_state_dict(state["entropy_control"])
