"""The engine's side of editing a live session's config: the edits that rebuild or reset part of
the run (learning rate, AdamW settings, schedule, entropy weight), called by :mod:`grpo_lab.live_config`."""

from __future__ import annotations

import math
import warnings

from transformers import get_scheduler


class LiveSettings:
    """Methods of :class:`grpo_lab.engine.Engine`."""

    def apply_adamw_settings(self) -> None:
        """Apply the config's AdamW betas, epsilon and weight decay from the next optimizer step on
        (to the optimizer grpo_lab built, where it has them; one passed in ``optimizers=`` keeps its own)."""
        if self.owns_optimizer:
            config = self.config
            settings = {"betas": (config.adam_beta1, config.adam_beta2), "eps": config.adam_epsilon,
                        "weight_decay": config.weight_decay}
            for group in self.optimizer.param_groups:  # another optimizer than AdamW may take other settings
                group.update({key: value for key, value in settings.items() if key in group})

    def _new_scheduler(self):
        """The learning-rate schedule of ``lr_scheduler_type`` over ``total_steps()``, at step 0."""
        config, total = self.config, self.total_steps()
        fraction = config.warmup_steps if 0 < config.warmup_steps < 1 else config.warmup_ratio
        warmup = int(config.warmup_steps) if config.warmup_steps >= 1 else math.ceil(fraction * total)
        return get_scheduler(
            config.lr_scheduler_type, self.optimizer, num_warmup_steps=warmup, num_training_steps=total,
            scheduler_specific_kwargs=config.lr_scheduler_kwargs or {},
        )

    def rebuild_schedule(self) -> None:
        """Rebuild the learning-rate schedule from the config (after ``max_steps``, ``num_train_epochs``,
        ``lr_scheduler_type``, ``lr_scheduler_kwargs``, ``warmup_steps`` or ``warmup_ratio`` changed)
        and move it as far as the old one had gone (skipped updates did not step it), as if the run had
        started with these settings. Only for a schedule grpo_lab built (``owns_scheduler``)."""
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs, strict=True):
            group["initial_lr"] = base  # each group's own base rate
        scheduler = self._new_scheduler()
        with warnings.catch_warnings():  # stepping a fresh schedule forward, not skipping an optimizer step
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            for _ in range(self.scheduler.last_epoch):  # the steps taken: skipped updates did not step it
                scheduler.step()
        self.scheduler = scheduler

    def restart_entropy_weight(self, *, forget_entropy: bool = False) -> None:
        """Restart the entropy bonus's weight from ``entropy_coef``; with ``forget_entropy`` (when
        ``use_adaptive_entropy`` is switched) also drop the last measured step entropy, so that an
        entropy from before the switch does not gate or adapt the weight."""
        self.entropy_coef = self.config.entropy_coef
        if forget_entropy:
            self.last_step_entropy = self._pending_step_entropy = None

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

    # ------------------------------------------------------------------ log-probs
