"""Which batch a view shows, the line that says so, and the batch-wide numbers the charts draw.
Pure: no widgets, no HTML.

A view shows the current generation batch once it has reached the stage the view needs (the
rewards view needs score()). Before that, and after update() has discarded the batch, it shows the
last trained batch, which the session keeps in ``session.last_trained`` (the loss() result of the
last update(), which holds its advantages, scores and rollout). Every view's header says the step
and stage of what it shows, and marks a batch older than the session's current one.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

STAGES = ("generate", "score", "advantages", "loss", "update")


class Batch(NamedTuple):
    """The stage results of one generation batch, as far as they were computed."""

    rollout: object | None
    scores: object | None
    advantages: object | None
    loss: object | None
    step: int
    """The optimizer step the batch feeds next; for a trained batch (stage "update") the step that
    trained it last."""
    stage: str | None
    """The last stage computed on it: "generate", "score", "advantages", "loss" or "update"; None
    when there is no batch yet."""
    previous: bool = False
    """True for the last trained batch shown while the session holds a newer batch that has not yet
    reached the stage the view needs."""


EMPTY = Batch(None, None, None, None, 0, None)


def last_trained(session):
    """The loss() result of the session's last update(), None before the first (and after load())."""
    return session.last_trained


def trained_batch(session) -> Batch | None:
    """The batch of the last update(), trained at step ``session.global_step`` (only update()
    changes the step, so the last update() made the current one)."""
    loss = last_trained(session)
    if loss is None:
        return None
    advantages = loss.advantages
    return Batch(advantages.scores.rollout, advantages.scores, advantages, loss, session.global_step, "update")


def current_batch(session) -> Batch:
    """The session's current batch. Between the update()s of a batch that feeds several optimizer
    steps, its last loss() result (that of the last update()) stands in for the one to come."""
    if session.rollout is None:
        return EMPTY
    loss, stage = session.loss_result, "loss"
    trained = last_trained(session)
    if loss is None and trained is not None and session.advantages_result is not None \
            and trained.advantages is session.advantages_result:
        loss, stage = trained, "update"
    if loss is None:
        stage = ("advantages" if session.advantages_result is not None
                 else "score" if session.scores is not None else "generate")
    step = session.global_step if stage == "update" else session.global_step + 1
    return Batch(session.rollout, session.scores, session.advantages_result, loss, step, stage)


def batch_for(session, needs: str) -> Batch:
    """What a view that needs the result of stage ``needs`` shows: the current batch once it has
    reached ``needs``, else the last trained batch (marked ``previous`` while a newer batch exists),
    else :data:`EMPTY`."""
    current = current_batch(session)
    if current.stage is not None and STAGES.index(current.stage) >= STAGES.index(needs):
        return current
    trained = trained_batch(session)
    if trained is None:
        return EMPTY
    return trained._replace(previous=current.stage is not None)


def header(batch: Batch, next_stage: str, needs: str) -> tuple[str, bool]:
    """The line a view opens with, and whether it marks data older than the session's batch.

    ``next_stage``: the session's next stage; ``needs``: the stage whose result the view shows.
    """
    if batch.stage is None:
        return f"Nothing to show yet: run session.{needs}().", False
    if batch.previous:
        return (
            f"From the previous batch (trained at step {batch.step}): the current batch has not reached "
            f"{needs}() yet; run session.{next_stage}().", True
        )
    if batch.stage == "update":
        return f"Batch trained at step {batch.step} (after update()); next stage: {next_stage}().", False
    return f"Batch for step {batch.step}, after {batch.stage}(); next stage: {next_stage}().", False



class GroupValues(NamedTuple):
    """One number per completion, by prompt group: what the reward strip draws."""

    groups: list[int]
    values: list[list[float]]
    """Per group (in the order of ``groups``), the numbers of its completions, NaN left out."""
    missing: int
    """Completions without a number (a reward function returned None)."""


def group_values(group_B, values_B) -> GroupValues:
    """``values_B`` (one number per completion, NaN where none) split by ``group_B``, groups in
    ascending order."""
    by_group: dict[int, list[float]] = {}
    missing = 0
    for group, value in zip((int(g) for g in group_B), (float(v) for v in values_B), strict=True):
        kept = by_group.setdefault(group, [])
        if math.isnan(value):
            missing += 1
        else:
            kept.append(value)
    groups = sorted(by_group)
    return GroupValues(groups, [by_group[g] for g in groups], missing)


class Histogram(NamedTuple):
    edges: list[float]
    """Bin edges, ``len(counts) + 1`` of them; each bin holds [left, right), the last [left, right]."""
    counts: list[int]


def histogram(values, bins: int = 10) -> Histogram:
    """Counts of ``values`` in ``bins`` equal bins from their minimum to their maximum; one bin
    [v, v] when every value is v, none without values."""
    array = np.asarray(values, dtype=float)
    array = array[~np.isnan(array)]
    if not len(array):
        return Histogram([], [])
    low, high = float(array.min()), float(array.max())
    if low == high:
        return Histogram([low, high], [len(array)])
    counts, edges = np.histogram(array, bins=bins, range=(low, high))
    return Histogram(edges.tolist(), counts.tolist())
