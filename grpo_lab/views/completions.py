"""The completions view: the current batch, one prompt group at a time, tokens coloured."""

from __future__ import annotations

import ipywidgets as widgets

from grpo_lab.views import data, render
from grpo_lab.views.base import View, guarded


class CompletionsView(View):
    """The current batch, one prompt group at a time, tokens coloured by a chosen quantity
    ("vllm_logprob_gap" is offered only for a rollout with sampling and old log-probs)."""

    events = ("generate", "score", "advantages", "loss", "update")

    def __init__(self, session):
        self.group = widgets.Dropdown(description="group", options=[], layout={"width": "60%"})
        self.quantity = widgets.Dropdown(description="colour by", options=data.token_quantities(session.rollout),
                                         value="logprob")
        self.overview = widgets.HTML()
        self.table = widgets.HTML()
        super().__init__(session, [widgets.HBox([self.group, self.quantity]), self.overview, self.table])
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
        if self.session.rollout is None:
            if not self.table.value:
                self.table.value = "<p>No completions yet: run session.generate().</p>"
            else:
                self.overview.value = (
                    f"<p>step {self.session.global_step}: the batch below has been trained on; next stage "
                    "<b>generate()</b>.</p>"
                )
            return
        frame = data.latest_table(self.session)
        flags = data.group_flags(frame)
        options = []
        for row in flags.itertuples():
            marks = " [equal rewards]" if getattr(row, "std_zero", False) else ""
            marks += f" [{row.truncated} truncated]" if row.truncated else ""
            options.append((f"{row.group}: {row.prompt}{marks}", int(row.group)))
        if list(self.group.options) != options:
            self._set_options(self.group, options, [v for _, v in options])
        quantities = data.token_quantities(self.session.rollout)
        if tuple(self.quantity.options) != quantities:
            self._set_options(self.quantity, quantities, quantities)
        zero = int(flags["std_zero"].sum()) if "std_zero" in flags else 0
        self.overview.value = (
            f"<p>step {self.session.global_step}, next stage <b>{self.session.next_stage}()</b>: {len(frame)} completions "
            f"in {len(flags)} groups; {zero} group(s) with equal rewards; {int(frame['truncated'].sum())} truncated.</p>"
            f"{render.token_legend(self.quantity.value)}"
        )
        group = self.group.value
        rows = data.group_table(frame, group)
        tokens = {
            position: render.token_spans(data.token_values(self.session, position, self.quantity.value), self.quantity.value)
            for position in rows.index
        }
        self.table.value = render.group_html(frame, group, tokens)
