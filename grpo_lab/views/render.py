"""HTML for the completions and rewards views (plain strings; the widgets only display them).

Tables: numbers right-aligned with one precision per column, short headers with the full name and
meaning on hover, "—" (with the reason on hover) where a value is missing, a horizontal scroll bar
where the view is narrower than the table. Tokens: one colour scale for the whole batch, drawn as a
colour bar beside its meaning.
"""

from __future__ import annotations

import html
import math
import numbers
from typing import NamedTuple

import numpy as np
import pandas as pd

from grpo_lab.views.batch import Batch, header
from grpo_lab.views.data import Correlation, TokenScale, group_table

_NUMBER_CELL = "text-align:right;font-variant-numeric:tabular-nums;padding:1px 6px"
_TEXT_CELL = "text-align:left;padding:1px 6px"
_LINE = "white-space:nowrap;overflow:hidden;text-overflow:ellipsis;max-width:{width}"
_WRAP = "<div class='grpo-table-wrap' style='overflow-x:auto;max-width:100%'>{}</div>"


def header_html(batch: Batch, next_stage: str, needs: str) -> str:
    """The view's first line (:func:`grpo_lab.views.batch.header`); an older batch gets a badge."""
    text, older = header(batch, next_stage, needs)
    badge = (
        "<span class='grpo-previous-batch' style='background:#b35900;color:white;border-radius:3px;padding:0 4px;"
        "margin-right:6px'>previous batch</span>" if older else ""
    )
    return f"<p class='grpo-view-header' style='margin:2px 0'>{badge}{html.escape(text)}</p>"


class Column(NamedTuple):
    """How a table shows one column of a frame."""

    name: str
    short: str
    full: str
    """Shown on hover over the header: the full name and what the numbers mean."""
    format: str = "{:.3f}"
    missing: str = "no value"
    """Shown on hover over a missing value: why it is missing."""
    text: bool = False
    """Left-aligned text on one line, cut with an ellipsis (the full text on hover)."""


def cell(value, column: Column) -> str:
    """One ``<td>``: text, a yes/blank flag, an integer, or a number in the column's format."""
    if value is None or (isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
                         and math.isnan(value)):
        return f"<td style='{_NUMBER_CELL};color:#888' title='{html.escape(column.missing, quote=True)}'>—</td>"
    if column.text:
        text = html.escape(str(value), quote=True)
        return f"<td style='{_TEXT_CELL};{_LINE.format(width='24em')}' title='{text}'>{text}</td>"
    if isinstance(value, (bool, np.bool_)):
        return f"<td style='{_TEXT_CELL}'>{'yes' if value else ''}</td>"
    if isinstance(value, numbers.Integral):
        return f"<td style='{_NUMBER_CELL}'>{int(value)}</td>"
    if isinstance(value, numbers.Real):
        return f"<td style='{_NUMBER_CELL}'>{column.format.format(float(value))}</td>"
    return f"<td style='{_TEXT_CELL}'>{html.escape(str(value))}</td>"


def header_cell(column: Column) -> str:
    align = "left" if column.text else "right"
    return (f"<th style='text-align:{align};padding:1px 6px' title='{html.escape(column.full, quote=True)}'>"
            f"{html.escape(column.short)}</th>")


def table_html(frame: pd.DataFrame, columns: list[Column], title: str, css_class: str = "grpo-table") -> str:
    """A titled table of ``frame``'s ``columns`` (no index), scrolling sideways where it does not fit."""
    if frame.empty:
        return f"<p><b>{html.escape(title)}</b>: nothing yet.</p>"
    head = "".join(header_cell(c) for c in columns)
    body = "".join("<tr>" + "".join(cell(row[c.name], c) for c in columns) + "</tr>" for _, row in frame.iterrows())
    table = (f"<table class='{css_class}' style='border-collapse:collapse'><thead><tr>{head}</tr></thead>"
             f"<tbody>{body}</tbody></table>")
    return f"<p style='margin:6px 0 2px'><b>{html.escape(title)}</b></p>{_WRAP.format(table)}"


# ---------------------------------------------------------------------------------- token colours
_RED, _BLUE = "214,39,40", "31,119,180"
SIGNED_COLOURS = "red: made likelier, blue: made less likely, white: 0"
"""The one convention for a signed quantity per token, in every view (the completions view's
``advantage_x_ratio``, ``what_if``'s heatmap): red pushes the token's probability up, blue down."""
_MEANING = {
    "logprob": (
        "probability of the token under the policy at the last loss(), exp(log-prob), on a fixed 0..1 scale: "
        "red tokens were unlikely, white ones near certain"
    ),
    "entropy": "entropy of the policy at the token at the last loss(), in nats; redder is more uncertain",
    "advantage_x_ratio": (
        "advantage × ratio: the completion's advantage times the token's ratio π/π_old at the last loss(); "
        + SIGNED_COLOURS
    ),
    "clipped": "red where the clip removed the token's gradient",
    "vllm_logprob_gap": (
        "log π_trainer − log π_vLLM of the token, in nats (old_logprobs − sampling_logprobs); red: the "
        "trainer finds it likelier than vLLM did, blue: less likely, white: they agree"
    ),
}


def _scale_colour(position: float, kind: str) -> str:
    """The colour at ``position`` (0 left .. 1 right) of a colour bar of ``kind``."""
    position = max(0.0, min(1.0, position))
    if kind == "diverging":
        signed = 2 * position - 1
        return f"rgba({_RED},{signed:.2f})" if signed > 0 else f"rgba({_BLUE},{abs(signed):.2f})"
    if kind == "probability":  # left p = 0 (unlikely, strongest), right p = 1
        return f"rgba({_RED},{0.9 - 0.85 * position:.2f})"
    return f"rgba({_RED},{0.05 + 0.85 * position:.2f})"


def token_colour(value: float | None, scale: TokenScale) -> str:
    """Background of a token with ``value`` on ``scale``; grey without a value."""
    if value is None or math.isnan(value) or math.isnan(scale.low):
        return "#eeeeee"
    if scale.kind == "probability":
        return _scale_colour(math.exp(min(value, 0.0)), scale.kind)
    span = scale.high - scale.low
    return _scale_colour((value - scale.low) / span if span > 0 else 0.5 if scale.kind == "diverging" else 0.0,
                         scale.kind)


def colour_bar(quantity: str, scale: TokenScale) -> str:
    """The scale as a gradient strip between its end values."""
    if math.isnan(scale.low):
        return "<span class='grpo-colour-bar' style='color:#888'>(no values yet)</span>"
    if scale.kind == "probability":
        low, high = "p = 0 (unlikely)", "p = 1 (certain)"
    elif quantity == "clipped":
        low, high = "0 kept", "1 clipped"
    else:
        low, high = f"{scale.low:.3g}", f"{scale.high:.3g}"
    stops = ", ".join(_scale_colour(i / 10, scale.kind) for i in range(11))
    middle = " (white = 0)" if scale.kind == "diverging" else ""
    return (
        "<span class='grpo-colour-bar' style='display:inline-flex;align-items:center;gap:6px;white-space:nowrap'>"
        f"<span>{html.escape(low)}</span>"
        "<span style='display:inline-block;width:160px;height:10px;border:1px solid #ccc;"
        f"background:linear-gradient(to right, {stops})'></span><span>{html.escape(high)}{middle}</span></span>"
    )


def token_legend(quantity: str, scale: TokenScale) -> str:
    """What the token colours mean, and their scale, which every completion of the batch shares."""
    return (
        f"<p class='grpo-token-legend' style='margin:2px 0'><b>colour</b>: {html.escape(_MEANING[quantity])}.<br>"
        f"{colour_bar(quantity, scale)} one scale for every completion of this batch; grey: no value; hover a token "
        "for its value.</p>"
    )


def token_spans(tokens: list[tuple[str, float | None]], quantity: str, scale: TokenScale,
                missing: str = "no value") -> str:
    """Tokens as coloured spans, the value on hover (the ``title`` attribute); ``missing`` says why
    a token has no value."""
    spans = []
    for text, value in tokens:
        shown = html.escape(text).replace(" ", "&nbsp;").replace("\n", "↵") or "&#8203;"
        if value is None:
            hover = f"{quantity}: {missing}"
        elif quantity == "logprob":
            hover = f"logprob = {value:.4g} (p = {math.exp(value):.3f})"
        else:
            hover = f"{quantity} = {value:.4g}"
        spans.append(
            f'<span class="grpo-token" title="{html.escape(hover)}" style="background:{token_colour(value, scale)};'
            f'padding:1px 2px;margin:0 1px;border-radius:3px;font-family:monospace">{shown}</span>'
        )
    return "".join(spans)


# ---------------------------------------------------------------------------------- completions
_LOSS_MISSING = "the completion is not in the optimizer step of the last loss()"
_STANDARD_COLUMNS = {
    "reward": Column("reward", "reward", "reward: the reward functions' values weighted by reward_weights and summed"),
    "advantage": Column("advantage", "adv",
                        "advantage: the reward minus its group's mean, scaled as scale_rewards says"),
    "ratio": Column("ratio", "ratio", "ratio: mean π/π_old over the completion's tokens at the last loss()",
                    missing=_LOSS_MISSING),
    "clipped_fraction": Column("clipped_fraction", "clip", "clipped_fraction: share of the completion's tokens whose "
                               "gradient the clip removed, at the last loss()", missing=_LOSS_MISSING),
    "entropy": Column("entropy", "entropy", "entropy: mean entropy of the policy over the completion's tokens at the "
                      "last loss(), in nats", missing=_LOSS_MISSING),
    "length": Column("length", "len", "length: tokens the model generated"),
}


def reward_column(name: str) -> Column:
    """The column of one reward function (``rewards/<name>``): a short header, its name on hover."""
    function = name.removeprefix("rewards/")
    short = function.removesuffix("_reward")
    short = short if len(short) <= 12 else short[:11] + "…"
    return Column(name, short, f"{name}: what {function} returned",
                  missing=f"{function} returned None for this completion")


def completion_columns(frame: pd.DataFrame) -> list[Column]:
    """The numeric columns of the completions table that ``frame`` has, reward functions first."""
    columns = [reward_column(c) for c in frame.columns if c.startswith("rewards/")]
    return columns + [column for name, column in _STANDARD_COLUMNS.items() if name in frame.columns]


def thumbnails_html(images: list, size: int = 96) -> str:
    """Each image as a thumbnail at most ``size`` pixels on its longer side (a small picture drawn at
    that size, pixels kept square), embedded as PNG; its size on hover."""
    import base64
    import io

    shown = []
    for number, image in enumerate(images, start=1):
        buffer = io.BytesIO()
        picture = image.convert("RGB")
        picture.thumbnail((size, size))
        picture.save(buffer, format="PNG")
        scale = size / max(image.size)
        width, height = (round(side * scale) for side in image.size)
        title = html.escape(f"image {number} of the prompt, {image.size[0]} x {image.size[1]} pixels")
        shown.append(f"<img class='grpo-thumbnail' alt='{title}' title='{title}' width='{width}' height='{height}' "
                     "style='image-rendering:pixelated;border:1px solid #ccc;margin-right:4px' "
                     f"src='data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()}'>")
    return "".join(shown)


def group_html(frame: pd.DataFrame, group: int, tokens_by_position: dict[int, str], images: list = ()) -> str:
    """The table of one prompt group, one line per completion (coloured tokens, cut with an
    ellipsis; click it for the whole text), then its rewards, total, advantage, loss statistics and
    length; a banner when all rewards are equal (the group teaches nothing). ``images``: the
    prompt's images (a vision-language model's), shown as thumbnails beside the prompt."""
    rows = group_table(frame, group)
    if rows.empty:
        return "<p>No completions yet: run session.generate().</p>"
    prompt = html.escape(str(rows["prompt"].iloc[0]))
    columns = completion_columns(rows)
    body = []
    for position, row in rows.iterrows():
        flag = " style='background:#fff4e0' title='truncated at max_completion_length'" if row["truncated"] else ""
        text = html.escape(str(row["completion"]))
        line = tokens_by_position.get(position, text)
        completion = (
            # width 100% with max-width 0: the completion takes the room the numbers leave, never more
            "<td class='grpo-completion' "
            f"style='{_TEXT_CELL};width:100%;min-width:10em;max-width:0;overflow:hidden'><details>"
            f"<summary style='display:block;cursor:pointer;{_LINE.format(width='100%')}'>{line}</summary>"
            f"<div style='white-space:pre-wrap;overflow-wrap:anywhere;font-family:monospace;padding:2px 0'>{text}</div>"
            "</details></td>"
        )
        cells = "".join(cell(row[c.name], c) for c in columns)
        body.append(f"<tr{flag}><td style='{_NUMBER_CELL}'>{position}</td>{completion}{cells}</tr>")
    banner = ""
    if "group_std_zero" in rows.columns and bool(rows["group_std_zero"].all()):
        banner = ("<p class='grpo-zero-std' style='color:#b35900'>All rewards in this group are equal: "
                  "advantages are 0, it adds no gradient.</p>")
    head = "".join(header_cell(c) for c in columns)
    table = (
        "<table class='grpo-completions' style='border-collapse:collapse;width:100%'>"
        f"<thead><tr><th title='position in the batch' style='text-align:right;padding:1px 6px'>#</th>"
        f"<th style='{_TEXT_CELL}' title='click a completion for its whole text'>completion</th>{head}</tr></thead>"
        f"<tbody>{''.join(body)}</tbody></table>"
    )
    prompt_line = f"<p><b>Prompt</b> <code>{prompt}</code></p>"
    if images:
        prompt_line = (f"<div style='display:flex;align-items:center;gap:8px'><div>{thumbnails_html(images)}</div>"
                       f"{prompt_line}</div>")
    return f"{prompt_line}{banner}{_WRAP.format(table)}"


_GROUP_COLUMNS = [
    Column("group", "group", "prompt group"),
    Column("prompt", "prompt", "the group's prompt", text=True),
    Column("size", "size", "completions in the group"),
    Column("distinct", "distinct", "distinct completions: how many different completion texts the group has (as many "
           "as its size: all differ; 1: the model wrote one completion every time)"),
    Column("reward_mean", "reward", "mean total reward of the group"),
    Column("std_zero", "equal", "every reward of the group is equal: advantages 0, no learning signal"),
    Column("truncated", "trunc", "completions cut at max_completion_length"),
]


def groups_html(flags: pd.DataFrame) -> str:
    """Every group of the batch on one line: size, distinct completions, mean reward, flags."""
    columns = [c for c in _GROUP_COLUMNS if c.name in flags.columns]
    table = table_html(flags, columns, "groups of this batch", css_class="grpo-groups")
    return f"<div style='max-height:14em;overflow-y:auto'>{table}</div>"


_DROPPED_COLUMNS = [
    Column("round", "round", "the generation round that drew the group (0: the first)", format="{:.0f}"),
    Column("group", "group", "the group's place in its round", format="{:.0f}"),
    Column("prompt", "prompt", "the group's prompt", text=True),
    Column("completion", "completion", "the completion's text", text=True),
    Column("value", "value", "the value dynamic_sampling_metric decides on (the same for every completion of a "
           "dropped group; the weighted reward where a function decides)"),
    Column("why", "why", "too easy: nearer the highest value drawn for the batch than the lowest (where all are "
           "equal: at or above eval_pass_threshold); too hard: the others; by the metric: a function given as "
           "dynamic_sampling_metric dropped a group whose values differ", text=True),
]


def dropped_html(record) -> str:
    """A batch's dynamic-sampling record: the rounds it took, then its dropped groups' completions
    folded away under a summary line (they were not trained on)."""
    frame = record.dropped_frame()
    groups = len(frame.drop_duplicates(["round", "group"])) if len(frame) else 0
    filled = int(record.filler_B.sum())
    summary = html.escape(
        f"dynamic sampling: {record.rounds} round(s) drawn; {groups} group(s) dropped for equal values, not trained on"
        + (f"; {filled} completions of dropped groups filled in (the rounds ran out)" if filled else "")
    )
    if frame.empty:
        return f"<p style='margin:2px 0'>{summary}.</p>"
    table = table_html(frame, _DROPPED_COLUMNS, "dropped groups", css_class="grpo-dropped")
    return (f"<details class='grpo-dropped-groups'><summary>{summary} (show them)</summary>"
            f"<div style='max-height:14em;overflow-y:auto'>{table}</div></details>")


# ---------------------------------------------------------------------------------- rewards
_SUMMARY_COLUMNS = [
    Column("function", "function", "reward function", text=True),
    Column("mean", "mean", "mean over the completions it returned a number for",
           missing="it returned None for every completion"),
    Column("std", "std", "sample standard deviation over those completions", missing="fewer than 2 numbers"),
    Column("min", "min", "smallest value", missing="it returned None for every completion"),
    Column("max", "max", "largest value", missing="it returned None for every completion"),
    Column("none_share", "None", "share of completions it returned None for (left out of every other column)",
           format="{:.1%}"),
    Column("pass_rule", "pass if", "what counts as a pass: > 0 for a function that returns only 0 and 1, else "
           "reaching the largest value any completion of the batch got", text=True),
    Column("pass_rate", "pass", "share of the completions it returned a number for that pass", format="{:.1%}",
           missing="it returned None for every completion"),
]


def reward_summary_html(summary: pd.DataFrame) -> str:
    return table_html(summary, _SUMMARY_COLUMNS, "rewards per function", css_class="grpo-reward-summary")


def correlation_html(correlation: Correlation) -> str:
    """The correlation matrix; a constant function's cells say "constant", and a note says why."""
    matrix, constant = correlation
    names = list(matrix.columns)
    columns = [reward_column(f"rewards/{name}") for name in names]
    head = "<th></th>" + "".join(header_cell(c) for c in columns)
    body = []
    for name, column in zip(names, columns, strict=True):
        cells = []
        for other in names:
            if name in constant or other in constant:
                cells.append(f"<td style='{_NUMBER_CELL};color:#888' "
                             "title='a constant function has no correlation'>constant</td>")
            else:
                value = matrix.loc[name, other]
                cells.append(cell(value, Column(other, other, other, format="{:.3f}",
                                                missing="fewer than 2 completions where both returned a number")))
        body.append(f"<tr><th style='{_TEXT_CELL}' "
                    f"title='{html.escape(column.full, quote=True)}'>{html.escape(column.short)}</th>"
                    f"{''.join(cells)}</tr>")
    note = ""
    if constant:
        note = (f"<p style='margin:2px 0;color:#555'>constant: {html.escape(', '.join(constant))} returned the same "
                "value for every completion of the batch, so it correlates with nothing and adds nothing to the "
                "advantages.</p>")
    table = (f"<table class='grpo-correlation' style='border-collapse:collapse'><thead><tr>{head}</tr></thead>"
             f"<tbody>{''.join(body)}</tbody></table>")
    return f"<p style='margin:6px 0 2px'><b>correlation between functions</b> (Pearson)</p>{_WRAP.format(table)}{note}"


def logged_extras_html(extras: pd.DataFrame) -> str:
    """Per-completion columns reward functions added with ``log_extra``."""
    columns = [Column(name, name if len(name) <= 16 else name[:15] + "…", name,
                      text=not pd.api.types.is_numeric_dtype(extras[name]))
               for name in extras.columns]
    return table_html(extras, columns, "logged with log_extra (first 16 rows)", css_class="grpo-extras")


def logged_metrics_html(metrics: dict[str, list[float]]) -> str:
    """Scalars reward functions logged with ``log_metric`` in the last score(): mean and count."""
    frame = pd.DataFrame([{"metric": k, "mean": sum(v) / len(v), "calls": len(v)} for k, v in metrics.items() if v])
    columns = [Column("metric", "metric", "name given to log_metric", text=True),
               Column("mean", "mean", "mean of the values logged under this name"),
               Column("calls", "calls", "values logged under this name")]
    return table_html(frame, columns, "logged with log_metric", css_class="grpo-logged-metrics")
