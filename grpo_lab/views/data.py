"""Pure data for the batch views: a batch's stage results -> tables and token values. No widgets, no plotly.

Everything here is a plain function of the session's own numbers, so the tests check that what a
view shows equals what the session computed. A batch is a :class:`grpo_lab.views.batch.Batch`
(the current one, or the last trained one).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import pandas as pd
import torch

from grpo_lab.rollout.vision import image_column, row_images
from grpo_lab.views.batch import current_batch

TOKEN_QUANTITIES = ("logprob", "entropy", "advantage_x_ratio", "clipped", "vllm_logprob_gap")


def latest_table(batch) -> pd.DataFrame:
    """One row per completion of ``batch``, from the furthest stage computed on it (rollout, then
    scores, then advantages, then the loss statistics of the completions of the last loss())."""
    if batch.advantages is not None:
        frame = batch.advantages.to_pandas()
        if batch.loss is not None:
            frame = frame.join(batch.loss.to_pandas()[["ratio", "clipped_fraction", "entropy"]])
        return frame
    if batch.scores is not None:
        return batch.scores.to_pandas()
    if batch.rollout is not None:
        return batch.rollout.to_pandas()
    return pd.DataFrame()


def group_table(frame: pd.DataFrame, group: int) -> pd.DataFrame:
    """The rows of one prompt group."""
    return frame[frame["group"] == group] if not frame.empty else frame


def prompt_images(rollout, position: int) -> list:
    """The images of completion ``position``'s prompt (a vision-language model's row: its ``image`` or
    ``images`` column, as the model was given them); [] for a row without, or a text batch."""
    column = image_column(rollout.columns)
    if column is None:
        return []
    return row_images({column: [rollout.columns[column][position]]}, column, 1)[0]


def group_flags(frame: pd.DataFrame) -> pd.DataFrame:
    """Per group: prompt, size, distinct completions (the number of different completion texts: the
    group's diversity is ``distinct / size``), truncated completions and, once rewards are known,
    the mean reward and whether every reward is equal (no learning signal)."""
    if frame.empty:
        return pd.DataFrame(columns=["group", "prompt", "size", "distinct", "truncated", "reward_mean", "std_zero"])
    # One pass over the rows: a pandas groupby-aggregate costs ~5 ms on a 64-row batch, every refresh.
    scored = "reward" in frame
    groups: dict = {}
    columns = ["group", "prompt", "completion", "truncated", *(["reward", "group_std_zero"] if scored else [])]
    for row in frame[columns].itertuples(index=False):
        entry = groups.setdefault(row.group, {"group": row.group, "prompt": row.prompt, "size": 0, "texts": set(),
                                              "truncated": 0, "rewards": [], "std_zero": True})
        entry["size"] += 1
        entry["texts"].add(row.completion)
        entry["truncated"] += int(row.truncated)
        if scored:
            entry["rewards"].append(row.reward)
            entry["std_zero"] = entry["std_zero"] and bool(row.group_std_zero)
    rows = []
    for group in sorted(groups):
        entry = groups[group]
        row = {"group": group, "prompt": entry["prompt"], "size": entry["size"], "distinct": len(entry["texts"]),
               "truncated": entry["truncated"]}
        if scored:
            rewards = [r for r in entry["rewards"] if r == r]  # NaN (no reward) left out, as pandas' mean does
            row["reward_mean"] = sum(rewards) / len(rewards) if rewards else float("nan")
            row["std_zero"] = entry["std_zero"]
        rows.append(row)
    return pd.DataFrame(rows)


def pass_rule(rewards: torch.Tensor) -> tuple[str, torch.Tensor]:
    """Which of one function's rewards (None already left out) count as a pass, and the rule in words.

    A binary function (every value 0 or 1) passes where it returned 1 (``> 0``); any other passes
    where it returned its maximum over the batch, the best any completion reached (so a function
    that returned one value for every completion passes everywhere).
    """
    if bool(((rewards == 0) | (rewards == 1)).all()):
        return "> 0 (binary)", rewards > 0
    best = float(rewards.max())
    return f"= {best:.3g} (batch max)", rewards == best


def reward_summary(scores) -> pd.DataFrame:
    """Per reward function: mean, std, min and max over the completions it returned a number for,
    the share it returned None for, and its pass rate over the numbers (see :func:`pass_rule`)."""
    rows = []
    for i, name in enumerate(scores.reward_names):
        column = scores.rewards_BF[:, i].double().cpu()
        present = column[~torch.isnan(column)]
        count = len(present)
        rule, passed = pass_rule(present) if count else ("", torch.zeros(0, dtype=torch.bool))
        rows.append({
            "function": name,
            "mean": float(present.mean()) if count else math.nan,
            "std": float(present.std()) if count > 1 else math.nan,
            "min": float(present.min()) if count else math.nan,
            "max": float(present.max()) if count else math.nan,
            "none_share": 1 - count / len(column) if len(column) else math.nan,
            "pass_rule": rule,
            "pass_rate": float(passed.double().mean()) if count else math.nan,
        })
    return pd.DataFrame(rows)


class Correlation(NamedTuple):
    matrix: pd.DataFrame
    """Pearson correlation between reward functions over the completions where both returned a
    number; NaN where it is undefined."""
    constant: list[str]
    """Functions that returned the same number for every completion (None left out): they have no
    correlation, and add nothing to the advantages."""


def reward_correlation(scores) -> Correlation:
    """Pearson correlation between reward functions over completions where both returned a number."""
    frame = pd.DataFrame(scores.rewards_BF.double().cpu().numpy(), columns=scores.reward_names)
    constant = [name for name in frame.columns if frame[name].nunique(dropna=True) == 1]
    return Correlation(frame.corr(method="pearson", min_periods=2), constant)


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


def _check_quantity(quantity: str) -> None:
    if quantity not in TOKEN_QUANTITIES:
        raise ValueError(f"quantity must be one of {TOKEN_QUANTITIES}, got {quantity!r}.")


def token_values_BT(batch, quantity: str) -> torch.Tensor:
    """``quantity`` at every completion token of ``batch``, float32 on the CPU, shape (B, T).

    "logprob" and "entropy" (of the policy at the last loss()), "advantage_x_ratio" (the
    completion's advantage times the token's ratio), "clipped" (1 where the clip removed the
    gradient) or "vllm_logprob_gap" (see :func:`vllm_logprob_gap`, known from generate() on). NaN
    where that quantity is not computed yet, the completion is not in the optimizer step of the last
    loss(), or an environment inserted the token (a rollout function's env_mask), and on padding.
    """
    _check_quantity(quantity)
    rollout = batch.rollout
    if quantity == "vllm_logprob_gap":
        return vllm_logprob_gap(rollout)
    values_BT = torch.full(rollout.completion_ids_BT.shape, float("nan"))
    loss = batch.loss
    if loss is None:
        return values_BT
    rows_B = loss.sample_index_B.cpu()
    if quantity == "logprob":
        chosen_BT = loss.logprobs_BT
    elif quantity == "entropy":
        chosen_BT = loss.entropies_BT
    elif quantity == "clipped":
        chosen_BT = loss.clipped_BT
    else:
        chosen_BT = loss.ratio_BT.detach().float().cpu() * loss.advantages.advantages_B.float().cpu()[rows_B, None]
    chosen_BT = chosen_BT.detach().float().cpu()
    width = min(values_BT.shape[1], chosen_BT.shape[1])
    values_BT[rows_B, :width] = chosen_BT[:, :width]
    return values_BT.masked_fill(~rollout.generated_mask_BT.cpu().bool(), float("nan"))


def tokens_of(batch, tokenizer, position: int, values_BT: torch.Tensor) -> list[tuple[str, float | None]]:
    """The tokens of completion ``position`` of ``batch`` (padding left out), each with its value in
    ``values_BT`` (from :func:`token_values_BT`), None where it has none."""
    rollout = batch.rollout
    mask_T = rollout.completion_mask_BT[position].cpu().bool()
    ids = rollout.completion_ids_BT[position].cpu()[mask_T].tolist()
    values = values_BT[position][mask_T].tolist()
    return [(tokenizer.decode([i]), None if math.isnan(v) else v) for i, v in zip(ids, values, strict=True)]


def token_values(session, position: int, quantity: str, batch=None) -> list[tuple[str, float | None]]:
    """The tokens of completion ``position`` of ``batch`` (by default the session's current batch)
    with one value each, None where it has none (see :func:`token_values_BT`)."""
    _check_quantity(quantity)
    batch = current_batch(session) if batch is None else batch
    if batch.rollout is None:
        return []
    return tokens_of(batch, session.tokenizer, position, token_values_BT(batch, quantity))


def missing_token_reason(batch, position: int, quantity: str) -> str:
    """Why a generated token of completion ``position`` has no value of ``quantity``."""
    if quantity == "vllm_logprob_gap":
        return "inserted by the environment (env_mask): vLLM did not sample it"
    if batch.loss is None:
        return "not computed yet: run session.loss()"
    if position not in batch.loss.sample_index_B.tolist():
        return "the completion is not in the optimizer step of the last loss()"
    return "inserted by the environment (env_mask): not trained on"


class TokenScale(NamedTuple):
    """The colour scale of one quantity, shared by every token of a batch."""

    low: float
    high: float
    kind: str
    """"probability": coloured by exp(value) on a fixed 0..1 scale; "diverging": centred on 0,
    from -high to high; "sequential": from low to high. low and high are NaN with no value at all."""


def token_scale(values_BT: torch.Tensor, quantity: str) -> TokenScale:
    """The scale ``quantity`` is coloured on over a whole batch (``values_BT``, NaN where no value):
    log-probs as probabilities on 0..1, "clipped" on 0..1, signed quantities on ±(largest magnitude),
    entropy from its smallest to its largest value."""
    if quantity == "logprob":
        return TokenScale(0.0, 1.0, "probability")
    if quantity == "clipped":
        return TokenScale(0.0, 1.0, "sequential")
    known = values_BT[~torch.isnan(values_BT)]
    if quantity in ("advantage_x_ratio", "vllm_logprob_gap"):
        bound = float(known.abs().max()) if len(known) else math.nan
        return TokenScale(-bound, bound, "diverging")
    if not len(known):
        return TokenScale(math.nan, math.nan, "sequential")
    return TokenScale(float(known.min()), float(known.max()), "sequential")
