"""What each GRPO stage produces: dataclasses with shape-suffixed tensor fields.

B completions in the (local) generation batch, G completions per prompt, P prompt tokens, T
completion tokens, F reward functions. Every result renders as a table in a notebook
(``_repr_html_``), prints a one-paragraph summary (``__repr__``) and converts to columns with one
value per completion (``to_dict()``) or a pandas DataFrame of them (``to_pandas()``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd
import torch

_HTML_ROWS = 16


class _Table:
    """Shared display: a summary line plus the per-completion table."""

    def to_dict(self) -> dict[str, list]:
        """The table as columns: name -> one value per row."""
        raise NotImplementedError

    def to_pandas(self) -> pd.DataFrame:
        return pd.DataFrame(self.to_dict())

    def summary(self) -> str:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.summary()})"

    def previous_stage(self) -> _Table | None:
        """The earlier stage's result whose columns this table repeats (None for ``generate()``'s)."""
        return None

    def _repr_html_(self) -> str:
        frame = self.to_pandas()
        frame = frame[newest_first(self, list(frame.columns))]
        shown = frame.head(_HTML_ROWS)
        more = f"<p>... {len(frame) - _HTML_ROWS} more rows: use .to_pandas()</p>" if len(frame) > _HTML_ROWS else ""
        table = shown.to_html(index=True, float_format=lambda v: f"{v:.4g}", escape=True, border=0)
        return f"<p><b>{type(self).__name__}</b>: {self.summary()}</p>{table}{more}"


def newest_first(table: _Table, columns: list[str]) -> list[str]:
    """``columns`` with ``group`` first, then what ``table``'s stage added, then what each earlier stage
    added, newest first: the stage's own numbers are on screen without scrolling sideways."""
    stages = [table]
    while stages[-1].previous_stage() is not None:
        stages.append(stages[-1].previous_stage())
    order = {"group": -1}
    for age, stage in enumerate(reversed(stages)):
        for name in stage.to_dict():
            order.setdefault(name, len(stages) - age)
    return sorted(columns, key=lambda name: order.get(name, 0))


_ROLLOUT_COLUMNS = ("group", "prompt", "completion", "length", "truncated")


def generated_mask(completion_mask_BT: torch.Tensor, env_mask_BT: torch.Tensor | None) -> torch.Tensor:
    """1 for the completion tokens the model generated: ``completion_mask_BT * env_mask_BT`` (a rollout
    function's env_mask; None when the model wrote every token)."""
    if env_mask_BT is None:
        return completion_mask_BT
    return completion_mask_BT * env_mask_BT.to(completion_mask_BT.device)


@dataclass
class DynamicSampling:
    """How dynamic sampling (``GRPOConfig.dynamic_sampling``) filled a generation batch: the rewards
    ``generate()`` scored its completions with (``score()`` returns them while the reward functions
    are the same), the groups filled in from dropped ones, and the dropped groups themselves, kept
    for inspection and never trained on."""

    rounds: int
    """Generation rounds drawn for this batch (the first included)."""
    rewards_BF: torch.Tensor
    reward_names: list[str]
    scored_by: str
    """The ``Engine.reward_funcs_token`` of the reward functions that scored them: replaced functions,
    or another engine (a loaded run, a fork), call theirs again."""
    extras: dict[str, list]
    reward_metrics: dict[str, list[float]]
    filler_B: torch.Tensor
    """(B,) True for the completions of a dropped group taken in because the rounds ran out."""
    dropped: dict[str, list]
    """One value per dropped completion (this process's): round, group, prompt (as text), completion,
    value (what ``dynamic_sampling_metric`` decides on) and why ("too easy" or "too hard")."""
    metrics: dict[str, float]
    """The ``dynamic_sampling/*`` metrics of the batch, over all processes."""

    def dropped_frame(self) -> pd.DataFrame:
        """The dropped groups' completions as a table."""
        return pd.DataFrame(self.dropped)


@dataclass(repr=False)
class Rollout(_Table):
    """Output of ``generate()``: the completions of one generation batch (this process's share)."""

    prompts: list
    completions: list
    completion_texts: list[str]
    columns: dict[str, list]
    prompt_ids_BP: torch.Tensor
    prompt_mask_BP: torch.Tensor
    completion_ids_BT: torch.Tensor
    completion_mask_BT: torch.Tensor
    is_truncated_B: torch.Tensor
    group_index_B: torch.Tensor
    old_logprobs_BT: torch.Tensor | None = None
    ref_logprobs_BT: torch.Tensor | None = None
    step: int = 0
    sampling_logprobs_BT: torch.Tensor | None = None
    """Log-probs the inference engine (vLLM) sampled each token with; None with transformers."""
    importance_weights_BT: torch.Tensor | None = None
    """vLLM importance-sampling weights, (B, T) in token modes or (B, 1) in sequence modes."""
    sampling_stats: dict[str, torch.Tensor] = field(default_factory=dict)
    policy_version: int | None = None
    """Optimizer step of the weights or adapter the engine generated with (vLLM)."""
    env_mask_BT: torch.Tensor | None = None
    """From a rollout function: 1 where the model generated the token, 0 where an environment or a
    tool inserted it (context for later tokens, never trained on); None when the model wrote them all."""
    extra_keys: tuple[str, ...] = ()
    """The keys of ``columns`` a rollout function returned, which the tables show (a class-level
    default, so that a batch pickled before this field existed loads)."""
    environments: list | None = field(default=None, compare=False)
    """With ``environment_factory``: the environment instance each completion ran in, which reward
    functions receive as ``environments=``. Live objects: a copy, a checkpoint or a state_dict of
    the batch leaves them out (None)."""

    dynamic_sampling: DynamicSampling | None = None
    """With ``dynamic_sampling``: how the batch was filled and what was dropped; None without."""
    image_inputs_B: list | None = None
    """For a vision-language model: each completion's prompt's processor outputs besides its token ids
    (:class:`grpo_lab.rollout.vision.ImageInputs`: pixel values and the like), which every log-prob
    pass gives the model again; None for text (a class-level default, so that a batch pickled before
    this field existed loads)."""
    async_timing: dict[str, float] | None = None
    """With ``async_generation``: how long the trainer waited for the batch, and how long the generator
    was idle before the next launch (seconds); None without (a class-level default, so that a batch
    pickled before this field existed loads)."""

    def __getstate__(self) -> dict:
        return {**self.__dict__, "environments": None}

    @property
    def generated_mask_BT(self) -> torch.Tensor:
        """1 for the completion tokens the model generated: ``completion_mask_BT * env_mask_BT``."""
        return generated_mask(self.completion_mask_BT, self.env_mask_BT)

    @property
    def completion_lengths_B(self) -> torch.Tensor:
        """Tokens the model generated per completion (those an environment inserted left out)."""
        return self.generated_mask_BT.sum(dim=1)

    def __len__(self) -> int:
        return len(self.completions)

    def summary(self) -> str:
        lengths = self.completion_lengths_B.float()
        return (
            f"{len(self)} completions of {len(set(self.group_index_B.tolist()))} prompts, "
            f"mean length {lengths.mean():.2f} tokens, {int(self.is_truncated_B.sum())} truncated"
        )

    def to_dict(self) -> dict[str, list]:
        return {
            "group": self.group_index_B.tolist(),
            "prompt": [prompt_text(p) for p in self.prompts],
            "completion": list(self.completion_texts),
            "length": self.completion_lengths_B.tolist(),
            "truncated": self.is_truncated_B.tolist(),
            **{key: list(self.columns[key]) for key in self.extra_keys if key not in _ROLLOUT_COLUMNS},
        }


@dataclass(repr=False)
class Scores(_Table):
    """Output of ``score()``: one reward per completion and reward function (NaN where None)."""

    rollout: Rollout
    rewards_BF: torch.Tensor
    reward_names: list[str]
    extras: dict[str, list] = field(default_factory=dict)
    metrics: dict[str, list[float]] = field(default_factory=dict)

    def previous_stage(self) -> _Table:
        return self.rollout

    def summary(self) -> str:
        means = ", ".join(
            f"{name} {torch.nanmean(self.rewards_BF[:, i]):.3f}" for i, name in enumerate(self.reward_names)
        )
        return f"{len(self.rollout)} completions scored; mean reward per function: {means}"

    def to_dict(self) -> dict[str, list]:
        columns = self.rollout.to_dict()
        for i, name in enumerate(self.reward_names):
            columns[f"rewards/{name}"] = self.rewards_BF[:, i].tolist()
        columns.update((name, list(values)) for name, values in self.extras.items())
        return columns


@dataclass(repr=False)
class Advantages(_Table):
    """Output of ``advantages()``: weighted total reward and the group-relative advantage."""

    scores: Scores
    rewards_B: torch.Tensor
    advantages_B: torch.Tensor
    group_mean_B: torch.Tensor
    group_std_B: torch.Tensor
    is_std_zero_B: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)

    def previous_stage(self) -> _Table:
        return self.scores

    def summary(self) -> str:
        return (
            f"mean reward {torch.nanmean(self.rewards_B):.3f}, advantages in [{self.advantages_B.min():.3f}, "
            f"{self.advantages_B.max():.3f}], {float(self.is_std_zero_B.float().mean()):.0%} of completions in "
            "groups with equal rewards (no signal)"
        )

    def to_dict(self) -> dict[str, list]:
        columns = self.scores.to_dict()
        columns["reward"] = self.rewards_B.tolist()
        columns["advantage"] = self.advantages_B.tolist()
        columns["group_std_zero"] = self.is_std_zero_B.tolist()
        return columns


@dataclass(repr=False)
class LossResult(_Table):
    """Output of ``loss()``: the loss of one optimizer step (gradients are accumulated in the model).

    ``sample_index_B`` says which completions of the generation batch this step used; the per-sample
    fields are aligned with it.
    """

    advantages: Advantages
    loss: float
    sample_index_B: torch.Tensor
    logprobs_BT: torch.Tensor
    entropies_BT: torch.Tensor
    ratio_BT: torch.Tensor
    clipped_BT: torch.Tensor
    metrics: dict[str, float]
    micro_batches: int = 1
    backward_skipped: int = 0
    """Micro-batches of this step (on this process) whose advantages were all zero, so that their
    backward pass, which adds nothing to the gradient, did not run (``skip_zero_advantage_backward``)."""

    def previous_stage(self) -> _Table:
        return self.advantages

    def summary(self) -> str:
        shown = ", ".join(f"{k} {v:.4g}" for k, v in self.metrics.items()
                          if k in {"entropy", "clip_ratio/region_mean", "kl"})
        skipped = (f"; {self.backward_skipped} of {self.micro_batches} micro-batches had zero advantages "
                   "and no backward pass"
                   if self.backward_skipped else "")
        return f"loss {self.loss:.6g} over {len(self.sample_index_B)} completions; {shown}{skipped}"

    def to_dict(self) -> dict[str, list]:
        rows = self.sample_index_B.tolist()
        columns = {name: [values[row] for row in rows] for name, values in self.advantages.to_dict().items()}
        mask_BT = self.advantages.scores.rollout.generated_mask_BT[self.sample_index_B].to(self.ratio_BT.dtype)
        tokens = mask_BT.sum(1).clamp(min=1)
        columns["ratio"] = ((self.ratio_BT * mask_BT).sum(1) / tokens).tolist()
        columns["clipped_fraction"] = ((self.clipped_BT.to(mask_BT.dtype) * mask_BT).sum(1) / tokens).tolist()
        columns["entropy"] = ((self.entropies_BT * mask_BT).sum(1) / tokens).tolist()
        return columns

    def to_pandas(self) -> pd.DataFrame:
        """Indexed by the completions' rows in the generation batch."""
        return pd.DataFrame(self.to_dict(), index=self.sample_index_B.tolist())


def prompt_text(prompt) -> str:
    """A prompt as text: itself, or its messages' contents joined by " | "."""
    if isinstance(prompt, list):
        return " | ".join(str(m.get("content", "")) for m in prompt if isinstance(m, dict))
    return str(prompt)


_RUN_SUMMARY_METRICS = ("reward", "reward_std", "loss", "grad_norm", "entropy", "clip_ratio/region_mean", "kl",
                        "step_time")


@dataclass(repr=False)
class RunSummary:
    """What ``session.run(n)`` and ``await session.arun(n)`` return: the steps they ran and how the
    headline metrics moved, short enough to read as a cell's last line. Every metric of every step
    is in ``to_pandas()`` (these steps) and ``session.history`` (the whole run)."""

    rows: list[dict]
    """The history rows of the steps this call ran, as ``session.history`` holds them."""
    requested: int
    next_stage: str

    def to_pandas(self) -> pd.DataFrame:
        """One row per step this call ran, every logged metric (TRL's names)."""
        return pd.DataFrame(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def headline(self) -> pd.DataFrame:
        """The headline metrics the steps logged: first, last, min and max of each."""
        frame = self.to_pandas()
        shown = [name for name in _RUN_SUMMARY_METRICS if name in frame]
        return pd.DataFrame({"first": frame[shown].iloc[0], "last": frame[shown].iloc[-1],
                             "min": frame[shown].min(), "max": frame[shown].max()}) if len(frame) else pd.DataFrame()

    def summary(self) -> str:
        if not self.rows:
            return f"ran no optimizer step of {self.requested}; next stage: {self.next_stage}()"
        first, last = self.rows[0]["step"], self.rows[-1]["step"]
        stopped = "" if len(self.rows) == self.requested else f" (stopped; next stage: {self.next_stage}())"
        return (f"ran {len(self.rows)} of {self.requested} optimizer steps, {first} to {last}{stopped}; every "
                "metric: .to_pandas() or session.history")

    def __repr__(self) -> str:
        headline = self.headline()
        table = f"\n{headline.to_string(float_format=lambda v: f'{v:.4g}')}" if len(headline) else ""
        return f"RunSummary: {self.summary()}{table}"

    def _repr_html_(self) -> str:
        headline = self.headline()
        table = headline.to_html(float_format=lambda v: f"{v:.4g}", border=0) if len(headline) else ""
        return f"<p><b>RunSummary</b>: {self.summary()}</p>{table}"
