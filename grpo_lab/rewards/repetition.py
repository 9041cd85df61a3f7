"""A penalty for repeated n-grams of completion tokens: degenerate, looping text is a common failure,
and a common way to game length or format rewards."""

from __future__ import annotations

__all__ = ["get_repetition_penalty_reward"]


class RepetitionPenalty:
    """The share of repeated token n-grams times a penalty (see ``get_repetition_penalty_reward``).
    A class rather than a closure, so that it pickles (a spawned worker process can receive it)."""

    __name__ = "repetition_penalty_reward"

    def __init__(self, ngram_size: int, max_penalty: float):
        if max_penalty > 0:
            raise ValueError(f"max_penalty must not be positive (it is a penalty), got {max_penalty}")
        if not isinstance(ngram_size, int) or ngram_size < 1:
            raise ValueError(f"ngram_size must be a positive integer, got {ngram_size!r}")
        self.ngram_size, self.max_penalty = ngram_size, max_penalty

    def __call__(self, completion_ids: list[list[int]], **kwargs) -> list[float]:
        n = self.ngram_size
        rewards = []
        for ids in completion_ids:
            ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)  # a tensor's ints, not 0-d tensors
            total = len(ids) - n + 1
            if total < 1:
                rewards.append(0.0)
                continue
            distinct = len({tuple(ids[i:i + n]) for i in range(total)})
            repeated_share = 1 - distinct / total
            rewards.append(repeated_share * self.max_penalty if repeated_share else 0.0)
        return rewards


def get_repetition_penalty_reward(ngram_size: int = 3, max_penalty: float = -1.0) -> RepetitionPenalty:
    """A reward function that penalises repeated n-grams of the completion's token ids.

    Formula, over the N = L - n + 1 n-grams of a completion of L tokens (n = ``ngram_size``):

        r = (1 - distinct n-grams / N) * max_penalty

    0 for a completion without a repeated n-gram or shorter than n tokens, approaching
    ``max_penalty`` (must be <= 0) for one that repeats itself throughout. On token ids, so it is
    the tokenizer's notion of repetition and works in any language.

    ``completion_ids`` holds one sequence of token ids per completion: lists of ints (as trainers
    pass them), arrays or tensors, whose values are counted (``.tolist()``).

    Source: Appendix C.2 of "Demystifying Long Chain-of-Thought Reasoning in LLMs" (Yeo et al. 2025,
    arXiv:2502.03373); TRL 1.16 ``trl.rewards.get_repetition_penalty_reward``, same keyword
    ``completion_ids``: the same values for lists of ints (what GRPOTrainer passes) and NumPy
    arrays. For tensors (one per completion, or a 2-D tensor) they differ: TRL's builds n-grams of
    0-d tensors, which compare by identity, so it finds no repeat and gives 0.0 whatever the text.
    An ``ngram_size`` below 1 is refused here when the function is made.
    """
    return RepetitionPenalty(ngram_size, max_penalty)
