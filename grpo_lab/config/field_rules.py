"""The rule each ``GRPOConfig`` field declares (when it may change in a live session, what a build-time
field builds, whether it is one of transformers' other ``TrainingArguments`` fields), kept beside the
dataclass fields instead of in their metadata.

transformers' ``HfArgumentParser``, and TRL's ``TrlParser`` after it, hands every key of a field's
metadata but ``aliases`` to argparse's ``add_argument``, which refuses any keyword it does not know. So a
field's metadata holds only its ``help``, which argparse takes and ``--help`` prints, and the rule lives
here, looked up by the field object itself (the same object on ``GRPOFields`` and every subclass).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class FieldRule:
    """``change``: one of :data:`grpo_lab.config.live.CHANGE_KINDS`; ``builds``: for ``change="build"``,
    one of :data:`grpo_lab.config.live.BUILT_PARTS`; ``trainer_argument``: one of transformers'
    ``TrainingArguments`` fields added by :mod:`grpo_lab.config.trainer_args`."""

    change: str | None
    builds: str | None = None
    trainer_argument: bool = False


_RULES: dict[dataclasses.Field, FieldRule] = {}
"""Field -> its rule; a Field hashes by identity, and the classes that declare it keep it alive."""


def ruled(field: dataclasses.Field, rule: FieldRule) -> dataclasses.Field:
    """``field``, with ``rule`` recorded for it."""
    _RULES[field] = rule
    return field


def rule_of(field: dataclasses.Field) -> FieldRule:
    """The rule declared for ``field`` (``FieldRule(None)`` where it declares none)."""
    return _RULES.get(field, FieldRule(None))
