"""A line that says when a view is not live.

A notebook reopened with its widgets' saved state, or a page reloaded after the kernel restarted,
draws the views as they were saved, with no kernel behind them. On opening, the note's browser
side asks the kernel for an answer; while none has come (and no update has arrived) it says that
what is shown may not be live, and at which step it was drawn. As it draws, it hides the static
picture a dashboard displays beside its widget (the one thing shown where no widget can be drawn).
"""

from __future__ import annotations

import anywidget
import traitlets

_ESM = """
function render({ model, el }) {
  el.className = "grpo-live-note";
  el.style.cssText = "display:none;color:#8a5a00;background:#fff4e0;padding:3px 6px;margin:2px 0;font-size:12px";
  let heard = false;
  const hear = () => { heard = true; el.style.display = "none"; };
  const onMessage = (message) => { if (message && message.type === "alive") hear(); };
  model.on("msg:custom", onMessage);
  model.on("change:beat", hear);
  const timer = setTimeout(() => {
    if (heard) return;
    el.textContent = `Not live: no word from the kernel since this page opened (it is busy running a cell, or it `
      + `was restarted). Shown: the view as of step ${model.get("step")}.`;
    el.style.display = "block";
  }, model.get("wait_ms"));
  model.send({ type: "hello" });
  // A drawn widget stands in for the static picture its dashboard put beside it (dashboard.py): a rule
  // on the cell's output area, which also hides the picture each time the kernel redraws it.
  if (!document.getElementById("grpo-live-output-style")) {
    const style = document.createElement("style");
    style.id = "grpo-live-output-style";
    style.textContent = ".grpo-live-output .grpo-static-fallback { display: none; }";
    document.head.appendChild(style);
  }
  const markLive = () => { el.closest(".jp-OutputArea, .output")?.classList.add("grpo-live-output"); };
  markLive();
  const again = setTimeout(markLive, 1000);
  return () => {
    clearTimeout(timer); clearTimeout(again); model.off("msg:custom", onMessage); model.off("change:beat", hear);
  };
}
export default { render };
"""


class LiveNote(anywidget.AnyWidget):
    """Hidden while the kernel answers or events arrive; ``step`` is the optimizer step the view's
    data is from."""

    _esm = _ESM
    step = traitlets.Int(0).tag(sync=True)
    beat = traitlets.Int(0).tag(sync=True)  # counts the session's events: any change means a live kernel
    wait_ms = traitlets.Int(5000).tag(sync=True)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.on_msg(self._answer)

    def heard(self, step: int) -> None:
        """The session sent an event: hide the note in every view of it, and record the step shown."""
        with self.hold_sync():
            self.step = step
            self.beat += 1

    def _answer(self, _widget, content, _buffers) -> None:
        if isinstance(content, dict) and content.get("type") == "hello":
            self.send({"type": "alive", "step": self.step})
