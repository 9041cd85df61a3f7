"""The completions view: one batch, one prompt group at a time, tokens coloured on one scale."""

from __future__ import annotations

import html

import ipywidgets as widgets

from grpo_lab.views import batch as batches
from grpo_lab.views import data, render
from grpo_lab.views.base import View, guarded


class CompletionsView(View):
    """The current batch (or, once update() has discarded it, the last trained one): an overview
    of its groups, then one prompt group at a time, tokens coloured by a chosen quantity
    ("vllm_logprob_gap" is offered only for a rollout with sampling and old log-probs)."""

    events = ("generate", "score", "advantages", "loss", "update", "undo")

    def __init__(self, session):
        self.group = widgets.Dropdown(description="group", options=[], layout={"width": "60%"})
        self.quantity = widgets.Dropdown(description="colour by", options=data.token_quantities(session.rollout),
                                         value="logprob")
        self.header = widgets.HTML()
        self.overview = widgets.HTML()
        self.groups = widgets.HTML()
        self.table = widgets.HTML()
        super().__init__(session, [self.header, self.groups, widgets.HBox([self.group, self.quantity]), self.overview,
                                   self.table])
        self.add_class("grpo-completions-view")
        self._updating = False
        self.group.observe(lambda change: None if self._updating else self.refresh(), names="value")
        self.quantity.observe(lambda change: None if self._updating else self.refresh(), names="value")
        self.refresh()

    def _set_options(self, dropdown: widgets.Dropdown, options, values) -> None:
        """Replace a dropdown's options without a refresh, keeping its value while it is still offered."""
        current, self._updating = dropdown.value, True
        try:
            dropdown.options = options
            dropdown.value = current if current in values else values[0]
        finally:
            self._updating = False

    @guarded
    def refresh(self) -> None:
        session = self.session
        batch = batches.batch_for(session, "generate")
        self.header.value = render.header_html(batch, session.next_stage, "generate")
        if batch.rollout is None:
            self.groups.value = self.overview.value = ""
            self.table.value = "<p>No completions yet: run session.generate().</p>"
            return
        frame = data.latest_table(batch)
        flags = data.group_flags(frame)
        options = []
        for row in flags.itertuples():
            marks = " [equal rewards]" if getattr(row, "std_zero", False) else ""
            marks += f" [{row.truncated} truncated]" if row.truncated else ""
            options.append((f"{row.group}: {str(row.prompt)[:80]}{marks}", int(row.group)))
        if list(self.group.options) != options:
            self._set_options(self.group, options, [v for _, v in options])
        quantities = data.token_quantities(batch.rollout)
        if tuple(self.quantity.options) != quantities:
            self._set_options(self.quantity, quantities, quantities)
        quantity = self.quantity.value
        values_BT = data.token_values_BT(batch, quantity)
        scale = data.token_scale(values_BT, quantity)
        self.groups.value = render.groups_html(flags)
        record = batch.rollout.dynamic_sampling
        dropped = "" if record is None else render.dropped_html(record)
        self.overview.value = (f"<p style='margin:2px 0'>{self._counts(frame, flags, record is not None)}</p>{dropped}"
                               f"{render.token_legend(quantity, scale)}")
        rows = data.group_table(frame, self.group.value)
        tokens = {
            position: render.token_spans(data.tokens_of(batch, session.tokenizer, position, values_BT), quantity, scale,
                                         data.missing_token_reason(batch, position, quantity))
            for position in rows.index
        }
        images = data.prompt_images(batch.rollout, int(rows.index[0])) if len(rows) else []
        self.table.value = render.group_html(frame, self.group.value, tokens, images)

    @staticmethod
    def _counts(frame, flags, scored_in_generate: bool) -> str:
        """Completions, groups, equal-reward groups (once scored) and truncated completions;
        ``scored_in_generate``: dynamic sampling scored the batch in ``generate()``."""
        if "std_zero" in flags:
            rewards = f"{int(flags['std_zero'].sum())} group(s) with equal rewards (no learning signal)"
        elif any(column.startswith("rewards/") for column in frame.columns):
            rewards = "rewards scored, advantages not computed yet: run session.advantages()"
        elif scored_in_generate:
            rewards = "rewards computed by generate() (dynamic sampling), not taken yet: run session.score()"
        else:
            rewards = "rewards not scored yet: run session.score()"
        return html.escape(
            f"{len(frame)} completions in {len(flags)} groups; {rewards}; {int(frame['truncated'].sum())} truncated."
        )
