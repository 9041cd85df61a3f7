"""What-if on a frozen batch: the advantages, loss and gradient each of several settings would give
the session's scored batch, computed by the engine's own ``advantages`` and ``loss`` inside
``engine.scratch()``, which undoes what they change, so that the session is left bitwise as it was
(weights, gradients, random state, pending batch, records). Each setting starts from the same
random state.

For every setting: the loss and its gradient norm, the loss metrics it would log (entropy, kl, clip
ratios...), its advantages' spread, and the cosine between every two settings' gradients; two
settings whose gradients are equal to a relative 1e-6 are flagged, since they are the same update on
this batch whatever their formulas look like.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import html
import itertools

import pandas as pd
import torch

from grpo_lab.interrupts import deferred_interrupts
from grpo_lab.ops.registry import LossSettings

EQUAL_GRADIENTS = 1e-6
"""Two gradients are flagged equal when ``||g_a - g_b|| <= EQUAL_GRADIENTS x max(||g_a||, ||g_b||)``."""

WHAT_IF_FIELDS = frozenset(
    {f.name for f in dataclasses.fields(LossSettings) if f.name not in ("epsilon_low", "max_completion_length")}
    | {"epsilon", "scale_rewards", "multi_objective_aggregation", "reward_weights", "top_entropy_quantile",
       "mask_truncated_completions", "off_policy_mask_threshold", "entropy_coef"}
)
"""The config fields the advantages and the loss of a scored batch read: what ``what_if`` varies.
(``max_completion_length`` is left out: on a batch already generated it would change dr_grpo's
divisor but not where completions were cut.)"""


def settings_grid(cases, settings: dict) -> list[dict]:
    """The settings to try: ``cases`` (a list of dicts) as given, or every combination of the keyword
    values (a list is a set of values to try, anything else one value)."""
    if cases is not None:
        if settings:
            raise TypeError("what_if takes a list of settings or keyword values, not both.")
        if not isinstance(cases, (list, tuple)) or not all(isinstance(case, dict) for case in cases) or not cases:
            raise TypeError(f"what_if(cases): give a list of dicts of settings, got {cases!r}.")
        return [dict(case) for case in cases]
    if not settings:
        raise TypeError("what_if needs settings to try, e.g. what_if(loss_type=['dapo', 'grpo'], epsilon=[0.2, 0.28]).")
    names = list(settings)
    values = [value if isinstance(value, list) else [value] for value in settings.values()]
    empty = [name for name, tried in zip(names, values) if not tried]
    if empty:
        raise ValueError(f"what_if({empty[0]}=[]): a list holds the values to try, and this one holds none; give at "
                         f"least one, e.g. what_if({empty[0]}=[...]).")
    return [dict(zip(names, combination)) for combination in itertools.product(*values)]


def case_config(config, case: dict, engine, rollout):
    """A checked copy of ``config`` with ``case`` applied; refuses fields the frozen batch's loss does
    not read, and settings the batch or model cannot serve."""
    unknown = sorted(set(case) - WHAT_IF_FIELDS)
    if unknown:
        raise ValueError(
            f"what_if varies the settings the advantages and the loss of a scored batch read; {', '.join(unknown)} "
            f"{'is' if len(unknown) == 1 else 'are'} not among them ({', '.join(sorted(WHAT_IF_FIELDS))}). To see "
            "what other settings do, fork the session (session.fork(name, **edits)) and step it."
        )
    edited = copy.deepcopy(config)
    for name, value in case.items():
        setattr(edited, name, value)
    try:
        edited.validate()
    except ValueError as error:
        raise ValueError(f"what_if setting {_label(case)}: {error}") from None
    if (edited.mask_truncated_completions != config.mask_truncated_completions
            and rollout.importance_weights_BT is not None):
        raise ValueError(
            f"what_if({case}): this batch's vLLM importance weights were computed with mask_truncated_completions="
            f"{config.mask_truncated_completions}, and changing it here would leave them as they are. Fork the "
            "session with the other value and generate a batch there."
        )
    if edited.beta > 0 and engine.ref_model is None and not engine.is_peft:
        raise ValueError(
            f"what_if({case}): beta > 0 needs a reference model, which this session (built with beta=0, full "
            "model) does not keep. Build the session with beta > 0 (or use LoRA, whose base model is the reference)."
        )
    return edited


@dataclasses.dataclass
class WhatIf:
    """The outcome of ``session.what_if``: one row per setting (``to_pandas()``), the gradients'
    pairwise cosines (``cosine``) and the pairs of settings whose gradients are equal (``equal``)."""

    cases: list[dict]
    rows: list[dict]
    cosine: pd.DataFrame
    equal: list[tuple[int, int]]
    token_weights: list[torch.Tensor]
    """Per setting, (B, T): d loss / d log-prob of each token of the step's completions, the weight
    the update gives it (negative: made likelier, since the loss is minimised)."""
    sample_index_B: torch.Tensor
    """The batch positions of the step's completions, the rows of each ``token_weights``."""
    completion_ids: list[list[int]] = dataclasses.field(default_factory=list, repr=False)
    """The step's completions' generated token ids, in ``sample_index_B``'s order, for the heatmap."""
    tokenizer: object = dataclasses.field(default=None, repr=False)

    def to_pandas(self) -> pd.DataFrame:
        """One row per setting: the setting's fields, then its loss, gradient norm and metrics."""
        return pd.DataFrame(self.rows)

    def summary(self) -> str:
        pairs = "; ".join(f"{_label(self.cases[a])} = {_label(self.cases[b])}" for a, b in self.equal)
        same = f" Equal gradients (the same update on this batch): {pairs}." if pairs else ""
        return f"{len(self.cases)} settings tried on the frozen batch.{same}"

    def __repr__(self) -> str:
        return f"{self.summary()}\n{self.to_pandas().to_string()}"

    def heatmap(self, completions: int = 2) -> str:
        """HTML: the first ``completions`` completions of the step, once per setting, each token
        coloured by the update's push on its log-prob, ``-token_weights`` (positive: made likelier), on
        one diverging scale for all and in the colours of every signed token view (hover for the value)."""
        from grpo_lab.views import data, render

        quantity = "push (−d loss / d logprob)"
        stacked = torch.stack(self.token_weights)
        scale = data.TokenScale(-float(stacked.abs().max()), float(stacked.abs().max()), "diverging")
        rows = []
        for row in range(min(completions, len(self.completion_ids))):
            ids = self.completion_ids[row]
            rows.append(f"<p><b>completion {int(self.sample_index_B[row])}</b></p>")
            for case, weights_BT in zip(self.cases, self.token_weights):
                tokens = [(self.tokenizer.decode([i]), -float(w)) for i, w in zip(ids, weights_BT[row])]
                rows.append(f"<div><code>{_label(case)}</code>: {render.token_spans(tokens, quantity, scale)}</div>")
        legend = render.colour_bar(quantity, scale)
        return (f"<p class='grpo-token-legend'>Each token's push in the update, −d loss / d log-prob "
                f"({render.SIGNED_COLOURS}) {legend}</p>" + "".join(rows))

    def _repr_html_(self) -> str:
        """The settings and what differs between them as a table that fits a screen; what is the same
        for every setting on one line under it (``to_pandas()`` has every column)."""
        frame = self.to_pandas()
        fields = {name for case in self.cases for name in case}
        # one setting has nothing to tell apart: every column is shown
        varied = [c for c in frame.columns if len(frame) < 2 or c in fields or frame[c].astype(str).nunique() > 1]
        same = [c for c in frame.columns if c not in varied]
        table = frame[varied].to_html(float_format=lambda v: f"{v:.4g}", border=0)
        alike = ("<p>The same for every setting: " + ", ".join(
            f"{html.escape(c)} {_shown(frame[c].iloc[0])}" for c in same) + "</p>") if same else ""
        cosine = self.cosine.to_html(float_format=lambda v: f"{v:.6f}", border=0)
        heatmap = self.heatmap() if self.tokenizer is not None else ""
        return (f"<p><b>WhatIf</b>: {self.summary()}</p>{table}{alike}<p>Cosine between the settings' gradients</p>"
                f"{cosine}{heatmap}")


def _shown(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else html.escape(str(value))


def _label(case: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in case.items())


def _token_weights(sink: list, result) -> torch.Tensor:
    """(B, T) d loss / d log-prob of each token of the step's completions (in ``sample_index_B``'s
    order); 0 for a micro-batch whose backward pass was skipped (its gradient is exactly 0)."""
    weights_BT = torch.zeros_like(result.logprobs_BT, dtype=torch.float32, device="cpu")
    position = {int(index): row for row, index in enumerate(result.sample_index_B.tolist())}
    for index_B, grad_BT in sink:
        rows = torch.tensor([position[int(i)] for i in index_B.tolist()])
        weights_BT[rows, : grad_BT.shape[1]] = grad_BT
    return weights_BT


def _gradient(model) -> torch.Tensor:
    grads = [p.grad.detach().flatten().float().cpu() for p in model.parameters() if p.grad is not None]
    return torch.cat(grads) if grads else torch.zeros(0)


def _compare(gradients: list[torch.Tensor]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    count = len(gradients)
    cosine, equal = torch.ones(count, count, dtype=torch.float64), []
    norms = [float(g.double().norm()) for g in gradients]
    for a, b in itertools.combinations(range(count), 2):
        ga, gb = gradients[a].double(), gradients[b].double()
        scale = max(norms[a], norms[b])
        cosine[a, b] = cosine[b, a] = float(ga @ gb) / (norms[a] * norms[b]) if norms[a] and norms[b] else float("nan")
        if float((ga - gb).norm()) <= EQUAL_GRADIENTS * scale or scale == 0.0:
            equal.append((a, b))
    return cosine, equal


def _lookahead(engine, rollout, result, advantages, before_BT: torch.Tensor, state: dict) -> dict[str, float]:
    """Take the engine's own optimizer step with the gradient just computed, score the step's
    completions again and put the engine back to ``state``: the mean change of a completion's
    log-probability (summed over its counted tokens) among those with positive and with negative
    advantage, and the k3 estimate of KL(current || stepped) per counted token."""
    from grpo_lab.ops import k3_kl
    from grpo_lab.state.run_state import load_engine_state_dict

    try:
        engine.update()
        with torch.no_grad():
            after_BT = engine.batch_logprobs(engine.model, rollout).float().cpu()
    finally:
        with deferred_interrupts(torn=functools.partial(engine.mark_torn, "putting the run back after a lookahead")):
            load_engine_state_dict(engine, state)
    index_B = result.sample_index_B
    mask_BT = rollout.generated_mask_BT[index_B].float().cpu()
    change_B = ((after_BT[index_B] - before_BT[index_B]) * mask_BT).sum(1)
    advantages_B = advantages.advantages_B[index_B].cpu()
    kl = float((k3_kl(before_BT[index_B], after_BT[index_B]) * mask_BT).sum() / mask_BT.sum().clamp(min=1.0))
    mean = lambda values: float(values.mean()) if len(values) else float("nan")  # noqa: E731
    return {"lookahead/logprob_change_positive": mean(change_B[advantages_B > 0]),
            "lookahead/logprob_change_negative": mean(change_B[advantages_B < 0]), "lookahead/kl": kl}


def _check_room(engine, settings: int) -> None:
    """Refuse, with the figures, where the settings' gradients (kept on the CPU in float32 to compare
    them) would not fit in the host's available memory."""
    import psutil

    trainable = sum(p.numel() for p in engine.model.parameters() if p.requires_grad)
    needed, free = 4 * trainable * settings, psutil.virtual_memory().available
    if needed > free:
        raise MemoryError(
            f"what_if keeps each setting's gradient on the CPU to compare them: {settings} x "
            f"{4 * trainable / 2**30:.2f} GiB = {needed / 2**30:.2f} GiB, and the host has {free / 2**30:.2f} GiB "
            "available. Try fewer settings "
            "at once, or use LoRA (a gradient the adapter's size)."
        )


def run_what_if(session, cases: list[dict], *, lookahead: bool = False) -> WhatIf:
    """Each case's advantages, loss and gradient on the session's scored batch, the session restored
    after each (see the module docstring); with ``lookahead``, also what one optimizer step with that
    gradient does (:func:`_lookahead`)."""
    from grpo_lab.state.run_state import engine_state_dict

    engine = session.engine
    configs = [case_config(session.config, case, engine, session.rollout) for case in cases]  # all checked first
    _check_room(engine, len(cases))
    rows, gradients, weights = [], [], []
    varied = {name: getattr(session.config, name) for case in cases for name in case}
    state = before_BT = None
    if lookahead:
        state = engine_state_dict(engine)
        with torch.no_grad():
            before_BT = engine.batch_logprobs(engine.model, session.rollout).float().cpu()
    for case, config in zip(cases, configs):
        with engine.scratch(config), _token_weights_kept(engine) as sink, _reference_kept(session.rollout):
            advantages = engine.advantages(session.scores)
            result = engine.loss(advantages, session.batch_step)
            gradient = _gradient(engine.model)
            ahead = _lookahead(engine, session.rollout, result, advantages, before_BT, state) if lookahead else {}
        weights.append(_token_weights(sink, result))
        spread = advantages.advantages_B.float()
        rows.append({**varied, **case, "loss": result.loss, "grad_norm": float(gradient.double().norm()),
                     "advantage_abs_mean": float(spread.abs().mean()),
                     "advantage_zero_share": float((spread == 0).float().mean()),
                     **{k: v for k, v in result.metrics.items() if k != "loss"}, **ahead})
        gradients.append(gradient)
    cosine, equal = _compare(gradients)
    labels = [_label(case) for case in cases]
    rollout = session.rollout
    ids = [rollout.completion_ids_BT[i][rollout.completion_mask_BT[i].bool()].tolist() for i in result.sample_index_B]
    return WhatIf(cases, rows, pd.DataFrame(cosine.numpy(), index=labels, columns=labels), equal, weights,
                  result.sample_index_B, ids, session.tokenizer)


@contextlib.contextmanager
def _token_weights_kept(engine):
    """Have the engine's loss pass keep each token's weight in the gradient (the heatmap's), in a
    list the block receives."""
    engine.loss_stage.token_weight_sink = []
    try:
        yield engine.loss_stage.token_weight_sink
    finally:
        engine.loss_stage.token_weight_sink = None


@contextlib.contextmanager
def _reference_kept(rollout):
    """Put back the batch's reference log-probs, which a loss pass under a case's ``beta`` may compute
    and cache on the rollout."""
    reference = rollout.ref_logprobs_BT
    try:
        yield
    finally:
        rollout.ref_logprobs_BT = reference
