"""Trying reward functions on completions already generated: what ``session.try_rewards`` computes.

Each batch of completions is scored by the same runner as training
(:func:`grpo_lab.rewards.score_completions`: TRL's keyword arguments, retries, checks), and its
group-relative advantages are computed by the engine's own
:func:`grpo_lab.ops.compute_advantages` with the session's ``num_generations``, ``scale_rewards``
and ``multi_objective_aggregation``. A prompt group has a learning signal when the values its
advantages normalize vary within it (:func:`groups_with_signal_N`, the engine's test for a group
without spread, ``frac_reward_zero_std``): a function's own rewards; for a weighted total, the total
(``sum_then_normalize``) or, under ``normalize_then_sum`` (GDPO), the sums of the per-function
normalized rewards. Not "some advantage is not 0": GDPO centres the sums over the whole batch, so a
group whose rewards are all equal gets a common advantage of about 1e-8 rather than 0. The trial
counts those groups under each new function alone, under the new functions' weighted total (what
``use_rewards(funcs, weights)`` would train on), and under the current rewards.

The comparison with the current total reward, over the completions where both are numbers:
Pearson's correlation, Spearman's (Pearson's of the ranks, ties given their mean rank), and the
completions whose rank differs most. A completion's rank is scaled to [0, 1] (0: lowest reward,
1: highest, ties at their mean rank), so the rank difference ``new - current`` lies in [-1, 1]:
+1 is the completion the current reward likes least and the new one likes most. Only completions
that the two rewards order oppositely against another are shown (a tie is no order), so that
completions both score alike (0 and 0) are never a "disagreement" of mean ranks.
"""

from __future__ import annotations

import copy
import html
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import pandas as pd
import torch

from grpo_lab.ops import compute_advantages, nanstd
from grpo_lab.ops.advantages import _tied
from grpo_lab.rewards import score_completions

HISTOGRAM_BINS = 20
"""Equal bins from a function's lowest reward to its highest (one bin where every reward is equal)."""


@dataclass
class TrialBatch:
    """One batch of completions to score again, as training scored it: the reward functions'
    inputs and the current rewards to compare with (B completions in consecutive groups)."""

    step: int
    """The optimizer step the batch was (or will be) first trained at."""
    prompts: list
    completions: list
    completion_ids: list[list[int]]
    columns: dict[str, list]
    prompt_texts: list[str]
    completion_texts: list[str]
    current_B: torch.Tensor | None = None
    """The current total reward (weighted sum, NaN where no function scored); None: not scored yet."""
    current_advantages_B: torch.Tensor | None = None


class AdvantageSettings(NamedTuple):
    """The config fields the advantages of a batch read."""

    num_generations: int
    scale_rewards: str | bool
    multi_objective_aggregation: str


class Histogram(NamedTuple):
    edges: list[float]
    """Bin edges, ``len(counts) + 1`` of them."""
    counts: list[int]


@dataclass
class RewardSummary:
    """One new reward function (or the new functions' weighted ``total``) over the tried completions."""

    name: str
    mean: float
    std: float
    """Sample (Bessel-corrected) standard deviation, as TRL's ``rewards/<name>/std``."""
    min: float
    max: float
    none_share: float
    """The share of completions the function returned None for (left out of every other figure)."""
    histogram: Histogram
    groups_with_signal: int
    """Prompt groups in which its rewards vary (see the module docstring)."""
    groups_gained: int | None
    """Groups with a signal under it and none under the current rewards (None: no current rewards)."""
    groups_lost: int | None
    pearson: float
    """Correlation with the current total reward (NaN where either is constant or absent)."""
    spearman: float


def histogram(values: np.ndarray, bins: int = HISTOGRAM_BINS) -> Histogram:
    """Counts of the non-NaN ``values`` in ``bins`` equal bins from their minimum to their maximum;
    one bin [v, v] when every value is v, none without values."""
    values = values[~np.isnan(values)]
    if not len(values):
        return Histogram([], [])
    low, high = float(values.min()), float(values.max())
    if low == high:
        return Histogram([low, high], [len(values)])
    counts, edges = np.histogram(values, bins=bins, range=(low, high))
    return Histogram(edges.tolist(), counts.tolist())


def scaled_ranks(values: np.ndarray) -> np.ndarray:
    """Each value's rank among ``values`` scaled to [0, 1] (ties at their mean rank; one value: 0.5)."""
    ranks = pd.Series(values).rank(method="average").to_numpy()
    return (ranks - 1) / (len(values) - 1) if len(values) > 1 else np.full(len(values), 0.5)


def correlations(new: np.ndarray, current: np.ndarray) -> tuple[float, float]:
    """(Pearson, Spearman) over the positions where both are numbers; NaN where undefined."""
    both = ~np.isnan(new) & ~np.isnan(current)
    new, current = new[both], current[both]
    if len(new) < 2 or np.ptp(new) == 0 or np.ptp(current) == 0:
        return math.nan, math.nan
    pearson = float(np.corrcoef(new, current)[0, 1])
    spearman = float(np.corrcoef(scaled_ranks(new), scaled_ranks(current))[0, 1])
    return pearson, spearman


def disagreements(new: np.ndarray, current: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The positions of the (at most) ``k`` completions whose scaled ranks differ most, among those
    where both are numbers, the ranks differ and the two rewards order the completion oppositely
    against some other one (ties in the difference keep the earlier position first), and their
    differences ``new - current``.

    A rank difference alone is not a disagreement where rewards tie: two rewards with different
    shares of zeros give a completion that both score 0 different mean ranks. Only a completion in
    a discordant pair (``new_i > new_j`` while ``current_i < current_j``, or the reverse) is one."""
    kept = np.flatnonzero(~np.isnan(new) & ~np.isnan(current))
    difference = scaled_ranks(new[kept]) - scaled_ranks(current[kept])
    order = np.argsort(-np.abs(difference), kind="stable")
    order = order[(difference[order] != 0) & in_a_discordant_pair(new[kept], current[kept])[order]][:k]
    return kept[order], difference[order]


def in_a_discordant_pair(new: np.ndarray, current: np.ndarray) -> np.ndarray:
    """Per completion, whether some other completion j is ordered oppositely: ``new_j > new_i`` and
    ``current_j < current_i``, or ``new_j < new_i`` and ``current_j > current_i`` (a tie in either
    is no order). Sorted by ``new``: the smallest ``current`` above a completion's ``new`` and the
    largest below it, O(N log N)."""
    order = np.argsort(new, kind="stable")
    new_sorted, current_sorted = new[order], current[order]
    smallest_from = np.append(np.minimum.accumulate(current_sorted[::-1])[::-1], np.inf)  # min of current_sorted[k:]
    largest_before = np.insert(np.maximum.accumulate(current_sorted), 0, -np.inf)  # max of current_sorted[:k]
    above = np.searchsorted(new_sorted, new, side="right")  # the first position with a larger new reward
    below = np.searchsorted(new_sorted, new, side="left")  # the completions with a smaller one
    return (smallest_from[above] < current) | (largest_before[below] > current)


def batch_advantages(rewards_BF: torch.Tensor, weights_F: torch.Tensor | None, settings: AdvantageSettings):
    """The engine's advantage function on one batch's (B, F) rewards (an ``AdvantageStats``)."""
    return compute_advantages(
        rewards_BF, num_generations=settings.num_generations, reward_weights_F=weights_F,
        scale_rewards=settings.scale_rewards, multi_objective_aggregation=settings.multi_objective_aggregation,
    )


def groups_with_signal_N(values_B: torch.Tensor, num_generations: int) -> torch.Tensor:
    """(N,) whether each prompt group's non-NaN ``values_B`` vary: as the engine tells a group without
    spread (``is_std_zero_B``), not all equal and a standard deviation not close to 0."""
    grouped_NG = values_B.view(-1, num_generations)
    std_N = nanstd(grouped_NG, dim=1)
    return ~(_tied(grouped_NG, dim=1) | torch.isclose(std_N, torch.zeros_like(std_N)))


def signal_values_B(rewards_B: torch.Tensor, advantages_B: torch.Tensor, aggregation: str) -> torch.Tensor:
    """The values whose spread within a group is its learning signal, for a weighted total reward
    ``rewards_B`` and its advantages: the total itself (``sum_then_normalize``); under
    ``normalize_then_sum`` the advantages of the completions with a reward, an increasing function of
    the sums of normalized rewards (NaN where no function scored the completion)."""
    if aggregation == "normalize_then_sum":
        return advantages_B.masked_fill(torch.isnan(rewards_B), float("nan"))
    return rewards_B


def _state_at(trainer_state, step: int):
    """``trainer_state`` as the scoring of a batch first trained at ``step`` saw it."""
    state = copy.copy(trainer_state)
    state.global_step = step - 1
    return state


def score_batches(batches: list[TrialBatch], funcs, processing_classes, names, *, trainer_state, reward_timeout,
                  timeout_sync: bool = False) -> tuple[list[torch.Tensor], dict[str, list], dict[str, list[float]]]:
    """Each batch's (B, F) rewards from the training runner, and what the functions logged: extra
    columns over every completion (None where a batch's call did not log one) and metrics.
    ``timeout_sync``: ``GRPOConfig.reward_timeout_sync``."""
    rewards, extras, metrics, done = [], {}, {}, 0
    for batch in batches:
        rewards_BF, logs = score_completions(
            funcs, processing_classes, names, prompts=batch.prompts, completions=batch.completions,
            completion_ids=batch.completion_ids, columns=batch.columns,
            trainer_state=_state_at(trainer_state, batch.step), reward_timeout=reward_timeout,
            timeout_sync=timeout_sync,
        )
        rewards.append(rewards_BF)
        for name in set(extras) | set(logs.extras):
            extras.setdefault(name, [None] * done).extend(logs.extras.get(name, [None] * len(batch.prompts)))
        done += len(batch.prompts)
        for name, values in logs.metrics.items():
            metrics.setdefault(name, []).extend(values)
    return rewards, extras, metrics


def run_trial(batches: list[TrialBatch], funcs, processing_classes, names: list[str], weights: list[float] | None,
              *, settings: AdvantageSettings, trainer_state, reward_timeout, on: str, k: int,
              timeout_sync: bool = False) -> RewardTrial:
    """Score ``batches`` with ``funcs`` and compare with their current rewards (module docstring)."""
    rewards, extras, metrics = score_batches(batches, funcs, processing_classes, names, trainer_state=trainer_state,
                                             reward_timeout=reward_timeout, timeout_sync=timeout_sync)
    weights_F = None if weights is None else torch.tensor(weights, dtype=torch.float32)
    total = "total" if "total" not in names else "total (weighted sum)"
    shown = [*names, total] if len(names) > 1 else list(names)
    values = {name: [] for name in shown}
    signal = {name: [] for name in shown}
    G, aggregation = settings.num_generations, settings.multi_objective_aggregation
    for rewards_BF in rewards:
        for f, name in enumerate(names):
            values[name].append(rewards_BF[:, f])
            signal[name].append(groups_with_signal_N(rewards_BF[:, f].float(), G))
        if len(names) > 1:
            stats = batch_advantages(rewards_BF, weights_F, settings)
            values[total].append(stats.rewards_B)
            signal[total].append(groups_with_signal_N(signal_values_B(stats.rewards_B, stats.advantages_B,
                                                                      aggregation), G))
    scored = all(batch.current_B is not None for batch in batches)
    current = np.concatenate([b.current_B.double().numpy() for b in batches]) if scored else None
    current_signal = (torch.cat([
        groups_with_signal_N(signal_values_B(b.current_B, b.current_advantages_B, aggregation), G) for b in batches
    ]).numpy() if scored else None)
    frame = _completions_frame(batches, settings.num_generations, current)
    summaries, examples = [], {}
    for name in shown:
        new = torch.cat(values[name]).double().numpy()
        frame[f"new/{name}"] = new
        summaries.append(_summary(name, new, torch.cat(signal[name]).numpy(), current, current_signal))
        if current is not None:
            positions, difference = disagreements(new, current, k)
            examples[name] = frame.iloc[positions][["step", "group", "prompt", "completion", "current_reward"]].assign(
                new_reward=new[positions], rank_difference=difference)
    return RewardTrial(on, summaries, len(frame) // settings.num_generations,
                       None if current_signal is None else int(current_signal.sum()), frame, examples,
                       None if current is None else histogram(current), weights, extras, metrics)


def _completions_frame(batches: list[TrialBatch], num_generations: int, current: np.ndarray | None) -> pd.DataFrame:
    rows = [len(batch.prompts) for batch in batches]
    return pd.DataFrame({
        "step": np.repeat([batch.step for batch in batches], rows),
        "group": np.concatenate([np.arange(count) // num_generations for count in rows]),
        "prompt": [text for batch in batches for text in batch.prompt_texts],
        "completion": [text for batch in batches for text in batch.completion_texts],
        "current_reward": np.full(sum(rows), np.nan) if current is None else current,
    })


def _summary(name: str, new: np.ndarray, signal: np.ndarray, current, current_signal) -> RewardSummary:
    numbers = new[~np.isnan(new)]
    stat = (lambda reduce: float(reduce(numbers)) if len(numbers) else math.nan)  # noqa: E731
    std = float(numbers.std(ddof=1)) if len(numbers) > 1 else (0.0 if len(numbers) else math.nan)
    pearson, spearman = (math.nan, math.nan) if current is None else correlations(new, current)
    gained = lost = None
    if current_signal is not None:
        gained, lost = int((signal & ~current_signal).sum()), int((~signal & current_signal).sum())
    return RewardSummary(name, stat(np.mean), std, stat(np.min), stat(np.max), float(np.isnan(new).mean()),
                         histogram(new), int(signal.sum()), gained, lost, pearson, spearman)


@dataclass
class RewardTrial:
    """The outcome of ``session.try_rewards``: one :class:`RewardSummary` per new function (and
    their weighted ``total`` when there are several), against the current rewards."""

    on: str
    """"batch" (the held batch) or "history" (every logged completion)."""
    summaries: list[RewardSummary]
    groups: int
    current_groups_with_signal: int | None
    """Groups in which the current rewards vary (None: the batch is not scored yet)."""
    completions: pd.DataFrame = field(repr=False)
    """One row per completion: step, group, prompt, completion, current_reward, new/<name>..."""
    disagreements: dict[str, pd.DataFrame] = field(repr=False)
    """Per name, the completions whose new and current ranks differ most (``rank_difference``)."""
    current_histogram: Histogram | None = field(default=None, repr=False)
    weights: list[float] | None = None
    extras: dict[str, list] = field(default_factory=dict, repr=False)
    """Columns the functions logged with ``log_extra``, one value per completion."""
    metrics: dict[str, list[float]] = field(default_factory=dict, repr=False)

    def to_pandas(self) -> pd.DataFrame:
        """One row per function: its distribution, groups with a signal, and correlations."""
        rows = []
        for s in self.summaries:
            rows.append({
                "name": s.name, "mean": s.mean, "std": s.std, "min": s.min, "max": s.max, "none_share": s.none_share,
                "groups_with_signal": s.groups_with_signal, "signal_share": s.groups_with_signal / max(self.groups, 1),
                "current_groups_with_signal": self.current_groups_with_signal, "groups_gained": s.groups_gained,
                "groups_lost": s.groups_lost, "pearson": s.pearson, "spearman": s.spearman,
            })
        return pd.DataFrame(rows).set_index("name")

    def summary(self) -> str:
        where = "of the held batch" if self.on == "batch" else "logged so far"
        text = f"{len(self.completions)} completions {where}, in {self.groups} prompt groups."
        if self.current_groups_with_signal is None:
            return f"{text} The batch is not scored yet: call session.score() to compare with the current rewards."
        share = self.current_groups_with_signal / max(self.groups, 1)
        return (f"{text} The current rewards give a learning signal in {self.current_groups_with_signal} of "
                f"{self.groups} groups ({share:.0%}).")

    def __repr__(self) -> str:
        parts = [f"RewardTrial: {self.summary()}", self.to_pandas().to_string(float_format=lambda v: f"{v:.4g}")]
        for name, frame in self.disagreements.items():
            shown = frame[["step", "group", "completion", "current_reward", "new_reward", "rank_difference"]]
            parts += [f"Largest rank differences, {name} vs current:",
                      shown.to_string(max_colwidth=40) if len(shown) else "  none: it ranks every completion alike"]
        return "\n".join(parts)

    def figure(self):
        """A plotly figure: the histogram of the current total reward and of each new function."""
        from plotly import graph_objects as go
        from plotly.subplots import make_subplots

        panels = [("current reward", self.current_histogram)] if self.current_histogram is not None else []
        panels += [(s.name, s.histogram) for s in self.summaries]
        columns = min(4, len(panels))
        rows = math.ceil(len(panels) / columns)
        figure = make_subplots(rows=rows, cols=columns, subplot_titles=[title for title, _ in panels])
        for position, (title, (edges, counts)) in enumerate(panels):
            left, right = np.array(edges[:-1]), np.array(edges[1:])
            figure.add_trace(go.Bar(
                x=(left + right) / 2, y=counts, width=np.maximum(right - left, 1e-9) * 0.95, name=title,
                showlegend=False, customdata=np.stack([left, right], axis=1) if len(counts) else None,
                hovertemplate="[%{customdata[0]:.3g}, %{customdata[1]:.3g}]: %{y}<extra></extra>",
                marker_color="#7f7f7f" if title == "current reward" else "#1f77b4",
            ), row=position // columns + 1, col=position % columns + 1)
        figure.update_layout(height=240 * rows, margin=dict(l=40, r=20, t=40, b=30), bargap=0.05)
        return figure

    def _tables_html(self) -> str:
        # one column per function (its statistics as rows): a screen wide for the functions a trial compares
        table = self.to_pandas().T.to_html(float_format=_number, border=0)
        examples = "".join(
            f"<p>Largest rank differences, <code>{html.escape(name)}</code> vs the current reward"
            + (f"</p>{frame.to_html(float_format=lambda v: f'{v:.4g}', border=0)}" if len(frame)
               else ": none, it ranks every completion alike</p>")
            for name, frame in self.disagreements.items()
        )
        return f"<p><b>RewardTrial</b>: {html.escape(self.summary())}</p>{table}{examples}"

    def _repr_html_(self) -> str:
        """The tables, and each histogram as a static SVG (front ends without plotly, exports)."""
        from grpo_lab.views import batch, charts

        panels = [("current reward", self.current_histogram)] if self.current_histogram is not None else []
        panels += [(s.name, s.histogram) for s in self.summaries]
        charts_html = "".join(charts.histogram_svg(batch.Histogram(*h), title) for title, h in panels)
        return f"{self._tables_html()}<div>{charts_html}</div>"

    def _ipython_display_(self) -> None:
        """In a notebook: the tables, then the histograms drawn by plotly."""
        from IPython.display import HTML, display

        display(HTML(self._tables_html()))
        display(self.figure())


def _number(value: float) -> str:
    """A table's number: a count as a whole number (a transposed table makes counts floats), the rest to 4 digits."""
    return f"{value:.0f}" if float(value).is_integer() and abs(value) < 1e15 else f"{value:.4g}"
