"""Length rewards, on the completion's token count ``len(completion_ids[i])``: DAPO's soft overlong
punishment, the cosine length scaling of a correctness reward, and a penalty for straying from a
target length.

Each factory returns an instance of a small class rather than a closure, so that the reward
function pickles (a spawned worker process can receive it); its ``__name__`` names its metrics
(``rewards/<name>/mean``), as TRL's do."""

from __future__ import annotations

import math
from collections.abc import Callable

from grpo_lab.rewards.math_rewards import accuracy_reward

__all__ = ["get_cosine_scaled_reward", "get_soft_overlong_punishment", "target_length_penalty"]


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class SoftOverlongPunishment:
    """DAPO's soft overlong punishment (see ``get_soft_overlong_punishment``)."""

    __name__ = "soft_overlong_punishment_reward"

    def __init__(self, max_completion_len: int, soft_punish_cache: int):
        if not _whole(max_completion_len) or max_completion_len <= 0:
            raise ValueError(f"max_completion_len must be a positive whole number of tokens, got "
                             f"{max_completion_len!r}: give the run's max_completion_length.")
        if not _whole(soft_punish_cache) or not 0 <= soft_punish_cache <= max_completion_len:
            raise ValueError(
                f"soft_punish_cache must be a whole number of tokens from 0 to max_completion_len "
                f"({max_completion_len}), got {soft_punish_cache!r}: it is the stretch before the limit where the "
                "punishment grows (DAPO: 4096 of 20480)."
            )
        self.max_completion_len = max_completion_len
        self.soft_punish_cache = soft_punish_cache

    def __call__(self, completion_ids: list[list[int]], **kwargs) -> list[float]:
        free = self.max_completion_len - self.soft_punish_cache  # longest length punished not at all
        rewards = []
        for ids in completion_ids:
            length = len(ids)
            if length <= free:
                rewards.append(0.0)
            elif length <= self.max_completion_len:
                rewards.append((free - length) / self.soft_punish_cache)
            else:
                rewards.append(-1.0)
        return rewards


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> SoftOverlongPunishment:
    """A reward function that punishes completions that run into the length limit, and never
    rewards short ones.

    Formula, with L = len(completion_ids[i]), L_max = ``max_completion_len`` and L_cache =
    ``soft_punish_cache``:

        r = 0                                   if L <= L_max - L_cache
        r = ((L_max - L_cache) - L) / L_cache   if L_max - L_cache < L <= L_max   (from 0 down to -1)
        r = -1                                  if L > L_max

    ``soft_punish_cache=0`` leaves only the two outer cases.

    Source: Eq. (13) of DAPO (Yu et al. 2025, arXiv:2503.14476); TRL 1.16
    ``trl.rewards.get_soft_overlong_punishment`` (same values, same keyword ``completion_ids``).
    """
    return SoftOverlongPunishment(max_completion_len, soft_punish_cache)


class CosineScaledReward:
    """A correctness reward scaled by length on a cosine schedule (see ``get_cosine_scaled_reward``)."""

    __name__ = "cosine_scaled_reward"

    def __init__(self, max_len: int, min_value_wrong: float, max_value_wrong: float, min_value_correct: float,
                 max_value_correct: float):
        if not _whole(max_len) or max_len <= 0:
            raise ValueError(f"max_len must be a positive whole number of tokens, got {max_len!r}: the length at which "
                             "the scaling reaches its long end (e.g. the run's max_completion_length).")
        values = (min_value_wrong, max_value_wrong, min_value_correct, max_value_correct)
        if not all(isinstance(value, (int, float)) and math.isfinite(value) for value in values):
            raise ValueError(f"the four reward values must be finite numbers, got {values!r}")
        self.max_len = max_len
        self.min_value_wrong, self.max_value_wrong = min_value_wrong, max_value_wrong
        self.min_value_correct, self.max_value_correct = min_value_correct, max_value_correct

    def __call__(self, completions: list, solution: list[str], completion_ids: list[list[int]],
                 log_metric: Callable[[str, float], None] | None = None, **kwargs) -> list[float | None]:
        correct_B = accuracy_reward(completions, solution, log_metric=log_metric)
        rewards = []
        for correct, ids in zip(correct_B, completion_ids, strict=True):
            if correct is None:  # the solution could not be parsed: the sample is skipped
                rewards.append(None)
                continue
            cosine = math.cos(min(len(ids) / self.max_len, 1.0) * math.pi)
            if correct:
                at_long, at_short = self.min_value_correct, self.max_value_correct
            else:
                at_long, at_short = self.max_value_wrong, self.min_value_wrong
            rewards.append(float(at_long + 0.5 * (at_short - at_long) * (1.0 + cosine)))
        return rewards


def get_cosine_scaled_reward(max_len: int, min_value_wrong: float = -1.0, max_value_wrong: float = -0.5,
                             min_value_correct: float = 0.5, max_value_correct: float = 1.0) -> CosineScaledReward:
    """A reward function that scores correctness (``accuracy_reward``, math-verify) and scales it by
    the completion's length on a cosine schedule: short correct answers earn most, short wrong
    answers are punished most (a long wrong answer at least explored).

    Formula, with L = len(completion_ids[i]) and p = min(L / ``max_len``, 1):

        r = v_long + (v_short - v_long) * (1 + cos(p * pi)) / 2

    where (v_short, v_long) = (``max_value_correct``, ``min_value_correct``) for a correct answer
    and (``min_value_wrong``, ``max_value_wrong``) for a wrong one. So a correct answer earns 1.0
    at L = 0, 0.75 at L = max_len / 2 and 0.5 from L = max_len on; a wrong one -1.0, -0.75, -0.5
    (defaults). None where the solution cannot be parsed, as ``accuracy_reward``, whose
    ``math_verify/*`` metrics it logs too. Requires the ``math`` extra (math-verify).

    Source: Appendix C.1 of "Demystifying Long Chain-of-Thought Reasoning in LLMs" (Yeo et al.
    2025, arXiv:2502.03373); TRL 1.16 ``trl.rewards.get_cosine_scaled_reward`` (same defaults, and
    the same values for one-message completions; lengths past ``max_len`` held at the long end).
    Correctness is :func:`~grpo_lab.rewards.accuracy_reward`'s, which reads the last assistant
    message of a completion of several messages where TRL reads the first.
    """
    return CosineScaledReward(max_len, min_value_wrong, max_value_wrong, min_value_correct, max_value_correct)


class TargetLengthPenalty:
    """A penalty for the distance of the token count from a target (see ``target_length_penalty``)."""

    __name__ = "target_length_penalty"

    def __init__(self, target: int, scale: float | None):
        scale = target if scale is None else scale
        if not (target > 0 and scale > 0 and math.isfinite(target) and math.isfinite(scale)):
            raise ValueError(f"target and scale must be positive finite numbers of tokens, got target={target!r}, "
                             f"scale={scale!r}")
        self.target, self.scale = target, float(scale)

    def __call__(self, completion_ids: list[list[int]], **kwargs) -> list[float]:
        return [-min(abs(len(ids) - self.target) / self.scale, 1.0) for ids in completion_ids]


def target_length_penalty(target: int, scale: float | None = None) -> TargetLengthPenalty:
    """A reward function that penalises a completion for its distance from a target length, in
    either direction.

    Formula, with L = len(completion_ids[i]), T = ``target`` and S = ``scale`` (tokens; defaults
    to T):

        r = -min(|L - T| / S, 1)

    0 at the target, falling linearly by 1/S per token of distance, and held at -1 from S tokens
    away on. With T = 100 and S = 50: L = 100 gives 0, L = 75 and L = 125 give -0.5, L = 0 and
    L = 300 give -1. Weight it against correctness with ``reward_weights``.

    Source: grpo_lab's own; the linear distance penalty of length-controlled RL (e.g. L1, Aggarwal
    and Welleck 2025, arXiv:2503.04697, which uses r = -alpha * |L - T| inside its correctness
    reward), here bounded to [-1, 0] so that it cannot outweigh the other rewards without a weight.
    """
    return TargetLengthPenalty(target, scale)
