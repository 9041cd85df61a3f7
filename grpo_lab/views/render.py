"""HTML for the completions and rewards views (plain strings; the widgets only display them)."""

from __future__ import annotations

import html
import math

import pandas as pd

from grpo_lab.views.data import group_table

_DIVERGING = {"advantage_x_ratio", "vllm_logprob_gap"}
_MEANING = {
    "logprob": "log-prob of the token under the policy at the last loss(); redder is likelier",
    "entropy": "entropy of the policy at the token at the last loss(); redder is more uncertain",
    "advantage_x_ratio": "advantage times the token's ratio; red positive, blue negative, white 0",
    "clipped": "red where the clip removed the token's gradient",
    "vllm_logprob_gap": (
        "log π_trainer − log π_vLLM of the token, in nats (old_logprobs − sampling_logprobs); red: the "
        "trainer finds it likelier than vLLM did, blue: less likely, white: they agree"
    ),
}


def _colour(value: float | None, low: float, high: float, diverging: bool) -> str:
    """Background colour of a token: blue (low) to red (high); diverging scales centre white on 0."""
    if value is None or math.isnan(value):
        return "#eeeeee"
    if diverging:
        bound = max(abs(low), abs(high)) or 1.0
        t = max(-1.0, min(1.0, value / bound))
        return f"rgba(214,39,40,{t:.2f})" if t > 0 else f"rgba(31,119,180,{-t:.2f})"
    span = (high - low) or 1.0
    t = max(0.0, min(1.0, (value - low) / span))
    return f"rgba(214,39,40,{0.1 + 0.8 * t:.2f})"


def token_spans(tokens: list[tuple[str, float | None]], quantity: str) -> str:
    """Tokens as coloured spans, the value on hover (the ``title`` attribute)."""
    numbers = [v for _, v in tokens if v is not None and not math.isnan(v)]
    low, high = (min(numbers), max(numbers)) if numbers else (0.0, 1.0)
    spans = []
    for text, value in tokens:
        shown = html.escape(text).replace(" ", "&nbsp;") or "&#8203;"
        hover = f"{quantity} = {value:.4g}" if value is not None else f"{quantity}: not computed yet"
        colour = _colour(value, low, high, quantity in _DIVERGING)
        spans.append(
            f'<span class="grpo-token" title="{html.escape(hover)}" '
            f'style="background:{colour};padding:1px 2px;margin:0 1px;border-radius:3px;font-family:monospace">{shown}</span>'
        )
    return "".join(spans)


def token_legend(quantity: str) -> str:
    """What the token colours mean; the scale is set per completion, the value shows on hover."""
    return (
        f"<p class='grpo-token-legend'><b>colour</b>: {html.escape(_MEANING[quantity])} "
        "(scaled per completion; hover a token for its value).</p>"
    )


def _number(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "<i>None</i>"
    if isinstance(value, bool):
        return "yes" if value else ""
    return f"{value:.4g}" if isinstance(value, float) else html.escape(str(value))


def group_html(frame: pd.DataFrame, group: int, tokens_by_position: dict[int, str]) -> str:
    """The table of one prompt group: completion (coloured tokens), rewards, total, advantage, length,
    truncated; a banner when all rewards are equal (the group teaches nothing)."""
    rows = group_table(frame, group)
    if rows.empty:
        return "<p>No completions yet: run session.generate().</p>"
    prompt = html.escape(str(rows["prompt"].iloc[0]))
    reward_columns = [c for c in rows.columns if c.startswith("rewards/")]
    extra = [c for c in ("reward", "advantage", "ratio", "clipped_fraction", "entropy") if c in rows.columns]
    header = "".join(f"<th>{html.escape(c.removeprefix('rewards/'))}</th>" for c in reward_columns + extra)
    body = []
    for position, row in rows.iterrows():
        flag = ' style="background:#fff4e0"' if row["truncated"] else ""
        cells = "".join(f"<td>{_number(row[c])}</td>" for c in reward_columns + extra)
        body.append(
            f"<tr{flag}><td>{position}</td><td class='grpo-completion'>{tokens_by_position.get(position, html.escape(str(row['completion'])))}</td>"
            f"{cells}<td>{int(row['length'])}</td><td>{'truncated' if row['truncated'] else ''}</td></tr>"
        )
    banner = ""
    if "group_std_zero" in rows.columns and bool(rows["group_std_zero"].all()):
        banner = "<p class='grpo-zero-std' style='color:#b35900'>All rewards in this group are equal: advantages are 0, it adds no gradient.</p>"
    return (
        f"<p><b>Prompt</b> <code>{prompt}</code></p>{banner}"
        "<table class='grpo-completions' style='border-collapse:collapse'>"
        f"<thead><tr><th>#</th><th>completion</th>{header}<th>length</th><th></th></tr></thead>"
        f"<tbody>{''.join(body)}</tbody></table>"
    )


def frame_html(frame: pd.DataFrame, title: str) -> str:
    if frame.empty:
        return f"<p><b>{html.escape(title)}</b>: nothing yet.</p>"
    table = frame.to_html(float_format=lambda v: f"{v:.4g}", border=0, na_rep="None")
    return f"<p><b>{html.escape(title)}</b></p>{table}"
