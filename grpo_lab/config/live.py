"""Editing a live session's config: which edits apply, how, and which are refused.

Each ``GRPOConfig`` field declares its rule (``change``, and for ``"build"`` fields ``builds``; see
:func:`grpo_lab.config.fields.setting`, :func:`grpo_lab.config.fields.built` and
:mod:`grpo_lab.config.field_rules`). This module reads
those rules: :func:`apply_edits` checks and applies the edits made between two stages of a session,
:func:`rebuilt_fields` the build-time values a saved session is loaded with. A new field picks one of
:data:`CHANGE_KINDS`; a field with no rule or an unknown one fails :func:`change_rules` (and the tests).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from grpo_lab.state.checkpoint import saved_model_dir
from grpo_lab.config.grpo_config import GRPOConfig
from grpo_lab.config.field_rules import rule_of
from grpo_lab.errors import ConfigError

CHANGE_KINDS = {
    "live": "read by the stages that use it: an edit applies from the next stage",
    "build": "read once, when the session is built: an edit is undone and refused (BUILT_PARTS says what it builds)",
    "schedule": "shapes the learning-rate schedule grpo_lab builds, which is rebuilt at the current step; refused "
                "with a scheduler given in optimizers=, which does not read it",
    "run_length": "sets the run's length: grpo_lab's schedule is rebuilt at the current step, a given one goes on",
    "learning_rate": "scales every parameter group's base rate, keeping the schedule's current factor",
    "optimizer": "an AdamW setting, applied to the optimizer grpo_lab built from the next step",
    "entropy_weight": "restarts the entropy bonus's weight from the new value",
    "entropy_switch": "restarts the entropy bonus's weight and forgets the last measured entropy",
    "reference": "may rise above 0 only where the session has a reference model (kept at build, or a PEFT base)",
    "router": "checked against the model, which must return router logits for a non-zero weight",
}
"""When a field may change in a live session, as its rule's ``change`` names it."""

BUILT_PARTS = {
    "model": "the model itself; a model given to load(model=) was built with the saved values",
    "batch_layout": "the layout of a generation batch; a batch saved half-used cannot be fed under new values",
    "saved_state": "what a saved run's random state, prompt order and optimizer state carry; a loaded run keeps it",
    "process": "the generation backend, precision, device or memory allocator; a loaded run may take new values",
}
"""What a ``"build"`` field builds, as its rule's ``builds`` names it: it decides what loading a saved
session with a new value does."""


@functools.cache
def change_rules(config_class=GRPOConfig) -> dict[str, tuple[str, str | None]]:
    """Field name -> ``(change, builds)`` from each field's rule; a ValueError names a field that
    declares no rule or an unknown one."""
    rules = {}
    for field in dataclasses.fields(config_class):
        rule = rule_of(field)
        change, part = rule.change, rule.builds
        if change not in CHANGE_KINDS:
            raise ValueError(  # a config class's own declaration, not a user's value
                f"{config_class.__name__}.{field.name} declares change={change!r}: declare one of "
                f"{', '.join(CHANGE_KINDS)} (grpo_lab.config.fields.setting), or build with its part "
                "(grpo_lab.config.fields.built)."
            )
        if (change == "build") != (part is not None) or (part is not None and part not in BUILT_PARTS):
            raise ValueError(
                f"{config_class.__name__}.{field.name} declares change={change!r} and builds={part!r}: a build-time "
                f"field names what it builds, one of {', '.join(BUILT_PARTS)}, and no other field does."
            )
        rules[field.name] = (change, part)
    return rules


@functools.cache
def fields_of(change: str, part: str | None = None) -> frozenset[str]:
    """The fields whose rule is ``change`` (and, for ``"build"``, builds ``part``, when given)."""
    return frozenset(name for name, (kind, built) in change_rules().items()
                     if kind == change and (part is None or built == part))


def _changed_of(changed: dict, *kinds: str) -> list[str]:
    return sorted(name for name in changed if change_rules()[name][0] in kinds)


def _undo(config, applied: dict, names: list[str]) -> None:
    for name in names:
        setattr(config, name, applied[name])


def fixed_fields_message(fixed: list[str]) -> str:
    return (
        f"{', '.join(fixed)} cannot change after the session is built (they load the model, start the "
        "generation backend, build the optimizer, seed the run, lay out its batches or set the process's "
        "memory allocator); the edit was undone. Build a new GRPOSession with the new value."
    )


# ---------------------------------------------------------------------- edits between stages
def apply_edits(config, applied: dict, engine) -> dict[str, tuple]:
    """Check the edits made to ``config`` since ``applied`` (the values the stages ran with) and apply
    them to ``engine``; returns them as ``{name: (old, new)}``. An edit that cannot apply is undone
    (set back to its applied value) and raises ``ValueError`` saying why."""
    edited = config.to_dict()
    try:
        config.validate()  # also normalises (scale_rewards=False -> "none"), so compare afterwards
    except ValueError:
        # An invalid value of a field that cannot change anyway: that is the error to see.
        fixed = sorted(name for name in fields_of("build") if edited.get(name) != applied.get(name))
        if fixed:
            _undo(config, applied, fixed)
            raise ConfigError(fixed_fields_message(fixed)) from None
        raise
    changed = {k: (applied.get(k), v) for k, v in config.to_dict().items() if applied.get(k) != v}
    fixed = _changed_of(changed, "build")
    if fixed:
        _undo(config, applied, fixed)
        raise ConfigError(fixed_fields_message(fixed))
    _check_model_needs(config, applied, engine, changed)
    _apply_schedule(config, applied, engine, changed)
    for name in _changed_of(changed, "learning_rate"):
        old, new = changed[name]
        engine.optimization.set_learning_rate(new, old)
    if _changed_of(changed, "entropy_weight", "entropy_switch"):
        engine.optimization.entropy.restart(config.entropy_coef,
                                            forget_entropy=bool(_changed_of(changed, "entropy_switch")))
    if _changed_of(changed, "optimizer"):
        engine.optimization.apply_adamw_settings(config)
    return changed


def _check_model_needs(config, applied: dict, engine, changed: dict) -> None:
    """Refuse a KL weight without a reference model, and a router weight the model cannot use."""
    for name in _changed_of(changed, "reference"):
        if getattr(config, name) > 0 and engine.ref_model is None and not engine.is_peft:
            _undo(config, applied, [name])
            raise ConfigError(
                f"{name} > 0 needs a reference model, and this session was built with {name}=0, so none was kept; the "
                f"edit was undone. Build a new GRPOSession with {name} > 0 (its reference is the model it starts from)."
            )
    router = _changed_of(changed, "router")
    if router:
        try:
            engine.router_aux_loss_weight()
        except ValueError as error:
            _undo(config, applied, router)
            raise ConfigError(f"{error} The edit was undone.") from None


def _apply_schedule(config, applied: dict, engine, changed: dict) -> None:
    """Rebuild grpo_lab's schedule at the current step; refuse schedule settings a given scheduler would ignore."""
    schedule = _changed_of(changed, "schedule", "run_length")
    shape = _changed_of(changed, "schedule")
    if shape and not engine.optimization.owns_scheduler:
        _undo(config, applied, schedule)
        raise ConfigError(
            f"{', '.join(shape)}: these configure the schedule grpo_lab "
            "builds, and this session's scheduler was given in optimizers=(optimizer, scheduler), which does not "
            "read them, so the change would have no effect; it was undone. Change your own scheduler instead. "
            "(max_steps and num_train_epochs can change: they set the run's length, and your scheduler goes on.)"
        )
    if schedule and engine.optimization.owns_scheduler:
        try:
            engine.optimization.rebuild_schedule(config, engine.total_steps())
        except Exception:  # e.g. lr_scheduler_kwargs the schedule does not take: the old schedule stays
            _undo(config, applied, schedule)
            raise


# ---------------------------------------------------------------------- loading a saved session
def rebuilt_fields(
    directory: Path, saved: dict, built: dict, own_optimizer: bool, own_scheduler: bool, given_model: bool,
    half_used: bool,
) -> dict:
    """Build-time fields whose value in ``built`` (the config a session is about to be built with)
    differs from ``saved`` (the saved run's applied config), as ``{name: (old, new)}``; they are in
    effect from the next step.

    Refused, before anything is loaded: new seeds, prompt order or optimizer (the saved state carries
    the old ones; an optimizer given in ``optimizers=`` is the caller's), new settings of a model given
    to load into (it was built with the old ones), a new schedule shape for a scheduler given in
    ``optimizers=`` (grpo_lab cannot rebuild it), and a new batch layout for a half-used batch
    (``half_used``: the saved run stopped inside a generation batch that the loaded one continues).
    """
    schedule = sorted(name for name in fields_of("schedule") if saved.get(name) != built[name]) if own_scheduler else []
    if schedule:
        raise ConfigError(
            f"{', '.join(f'{name}={built[name]!r}' for name in schedule)}: {directory} was saved with "
            f"{', '.join(f'{name}={saved.get(name)!r}' for name in schedule)}; these configure the schedule grpo_lab "
            "builds, and the scheduler given in optimizers=(optimizer, scheduler) does not read them, so the change "
            "would have no effect. Load it with the saved values (your scheduler continues from its saved state; "
            "max_steps and num_train_epochs can change)."
        )
    changed = {name: (saved.get(name), built[name])
               for name in sorted(fields_of("build")) if saved.get(name) != built[name]}
    _refuse_rebuilt(directory, changed, saved, built, own_optimizer, given_model, half_used)
    return changed


def _refuse_rebuilt(directory: Path, changed: dict, saved: dict, built: dict, own_optimizer: bool,
                    given_model: bool, half_used: bool) -> None:
    carried = [
        name for name in sorted(set(changed) & fields_of("build", "saved_state"))
        if _in_effect(name, saved) != _in_effect(name, built) and (name != "optim" or not own_optimizer)
    ]
    if carried:
        raise ConfigError(
            f"{', '.join(f'{name}={changed[name][1]!r}' for name in carried)}: {directory} was saved with "
            f"{', '.join(f'{name}={changed[name][0]!r}' for name in carried)}, which its random state, prompt order "
            "and optimizer state carry, so a loaded run cannot change them. Load it with the saved values, or start a "
            f"new run from its weights ({saved_model_dir(directory)})."
        )
    kept = sorted(set(changed) & fields_of("build", "model")) if given_model else []
    if kept:
        raise ConfigError(
            f"{', '.join(kept)} changed, but the model given to load {directory} into (by a trainer: its own model, "
            "which the optimizer passed in optimizers= holds) was built with the saved values and keeps them. Load it "
            "with the saved values, or without model= (a new model is built with the new ones)."
        )
    layout = sorted(set(changed) & fields_of("build", "batch_layout"))
    if layout and half_used:
        raise ConfigError(
            f"{directory} was saved in the middle of a generation batch, and {', '.join(layout)} changed, so the rest "
            "of that batch cannot be fed. Load it with the saved values, finish the batch (or discard_batch()) and "
            "save again, then change them."
        )


def _in_effect(name: str, config: dict):
    """The value of ``name`` that the engine acts on, given the config fields ``config``: prompt order
    is seeded by ``seed`` without a ``data_seed`` and shuffled unless ``shuffle_dataset`` is False."""
    if name == "data_seed":
        return config.get("seed") if config.get("data_seed") is None else config["data_seed"]
    if name == "shuffle_dataset":
        return config.get("shuffle_dataset") is not False
    return config.get(name)
