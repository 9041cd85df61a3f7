"""Pure data for the batch views: the session's stage results -> tables and token values. No widgets, no plotly.

Everything here is a plain function of the session's own numbers, so the tests check that what a
view shows equals what the session computed.
"""

from __future__ import annotations

import math

import pandas as pd
import torch

TOKEN_QUANTITIES = ("logprob", "entropy", "advantage_x_ratio", "clipped", "vllm_logprob_gap")


def latest_table(session) -> pd.DataFrame:
    """One row per completion of the current batch, from the furthest stage computed so far
    (rollout, then scores, then advantages, then the loss statistics of the trained completions)."""
    if session.advantages_result is not None:
        frame = session.advantages_result.to_pandas()
        if session.loss_result is not None:
            trained = session.loss_result.to_pandas()[["ratio", "clipped_fraction", "entropy"]]
            frame = frame.join(trained)
        return frame
    if session.scores is not None:
        return session.scores.to_pandas()
    if session.rollout is not None:
        return session.rollout.to_pandas()
    return pd.DataFrame()


def group_table(frame: pd.DataFrame, group: int) -> pd.DataFrame:
    """The rows of one prompt group."""
    return frame[frame["group"] == group] if not frame.empty else frame


def group_flags(frame: pd.DataFrame) -> pd.DataFrame:
    """Per group: prompt, size, mean reward, whether every reward is equal (no learning signal) and
    how many completions were truncated."""
    if frame.empty:
        return pd.DataFrame(columns=["group", "prompt", "size", "reward_mean", "std_zero", "truncated"])
    aggregations = dict(prompt=("prompt", "first"), size=("prompt", "size"), truncated=("truncated", "sum"))
    if "reward" in frame:
        aggregations["reward_mean"] = ("reward", "mean")
        aggregations["std_zero"] = ("group_std_zero", "all")
    return frame.groupby("group").agg(**aggregations).reset_index()


def reward_summary(scores) -> pd.DataFrame:
    """Per reward function: mean, std, min, max over completions where it applied, and the share of
    completions it returned None for."""
    rows = []
    for i, name in enumerate(scores.reward_names):
        column = scores.rewards_BF[:, i].double()
        present = column[~torch.isnan(column)]
        count = len(present)
        rows.append({
            "function": name,
            "mean": float(present.mean()) if count else float("nan"),
            "std": float(present.std()) if count > 1 else float("nan"),
            "min": float(present.min()) if count else float("nan"),
            "max": float(present.max()) if count else float("nan"),
            "none_share": 1 - count / len(column) if len(column) else float("nan"),
        })
    return pd.DataFrame(rows)


def reward_correlation(scores) -> pd.DataFrame:
    """Pearson correlation between reward functions over completions where both returned a number."""
    frame = pd.DataFrame(scores.rewards_BF.double().numpy(), columns=scores.reward_names)
    return frame.corr(method="pearson", min_periods=2)


def token_quantities(rollout) -> tuple[str, ...]:
    """The quantities the tokens of ``rollout`` can be coloured by: "vllm_logprob_gap" only when it
    has both the sampling (vLLM) and the old log-probs."""
    if rollout is not None and rollout.sampling_logprobs_BT is not None and rollout.old_logprobs_BT is not None:
        return TOKEN_QUANTITIES
    return tuple(q for q in TOKEN_QUANTITIES if q != "vllm_logprob_gap")


def vllm_logprob_gap(rollout) -> torch.Tensor:
    """Trainer minus sampler log-prob of every completion token, in nats, shape (B, T):
    ``gap_BT = old_logprobs_BT - sampling_logprobs_BT``, NaN where ``generated_mask_BT == 0``.
    Positive where the trainer finds the token likelier than vLLM did when it sampled it."""
    if rollout.sampling_logprobs_BT is None or rollout.old_logprobs_BT is None:
        raise ValueError(
            "vllm_logprob_gap needs the log-probs vLLM sampled with and the trainer's old log-probs: "
            "generate with use_vllm=True (and vllm_importance_sampling_correction=True)."
        )
    gap_BT = rollout.old_logprobs_BT.float().cpu() - rollout.sampling_logprobs_BT.float().cpu()
    return gap_BT.masked_fill(~rollout.generated_mask_BT.cpu().bool(), float("nan"))


def token_values(session, position: int, quantity: str) -> list[tuple[str, float | None]]:
    """The tokens of completion ``position`` of the current batch with one value each.

    ``quantity``: "logprob" and "entropy" (of the policy at the last loss()), "advantage_x_ratio"
    (the completion's advantage times the token's ratio), "clipped" (1 where the clip removed the
    gradient) or "vllm_logprob_gap" (see :func:`vllm_logprob_gap`, known from generate() on). The
    value is None where that quantity is not computed yet, the completion is not in the optimizer
    step of the last loss(), or an environment inserted the token (a rollout function's env_mask).
    """
    if quantity not in TOKEN_QUANTITIES:
        raise ValueError(f"quantity must be one of {TOKEN_QUANTITIES}, got {quantity!r}.")
    rollout = session.rollout
    if rollout is None:
        return []
    mask_T = rollout.completion_mask_BT[position].bool()
    ids = rollout.completion_ids_BT[position][mask_T].tolist()
    tokens = [session.tokenizer.decode([i]) for i in ids]
    if quantity == "vllm_logprob_gap":  # NaN where an environment inserted the token
        gaps = vllm_logprob_gap(rollout)[position][mask_T.cpu()].tolist()
        return [(token, None if math.isnan(gap) else gap) for token, gap in zip(tokens, gaps, strict=True)]
    result = session.loss_result
    values: list[float | None] = [None] * len(tokens)
    if result is not None:
        where = (result.sample_index_B == position).nonzero()
        if len(where):
            row = int(where[0])
            if quantity == "logprob":
                chosen = result.logprobs_BT[row]
            elif quantity == "entropy":
                chosen = result.entropies_BT[row]
            elif quantity == "clipped":
                chosen = result.clipped_BT[row].float()
            else:
                chosen = result.ratio_BT[row] * result.advantages.advantages_B[position]
            generated = rollout.generated_mask_BT[position][mask_T].tolist()
            values = [float(v) if kept else None for v, kept in zip(chosen[: len(tokens)].tolist(), generated, strict=True)]
    return list(zip(tokens, values))
