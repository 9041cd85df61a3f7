"""Cost of the dashboard inside a real Jupyter kernel (widget messages serialised and sent).

Measures, with a 1,000-step history, the kernel time of one curves update (what every optimizer
step costs the dashboard), and the time to render the completions view of a 64-completion batch.
Runs the measurements as cells of an in-memory notebook through nbclient, so comm traffic is real.

    python benchmarks/bench_views.py [--steps 1000] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import os

import nbformat
from nbclient import NotebookClient

SETUP = """
import copy, json, statistics, time
from grpo_lab import GRPOSession
from grpo_lab.tasks import default_task
task = default_task(eval_size=16)
session = GRPOSession(task.model, task.reward_funcs, train_dataset=task.train_dataset,
                      args=task.config(per_device_train_batch_size=64, num_generations=8, max_steps=10_000,
                                       output_dir="outputs/bench_views"))
session.run(2, progress=False)
dashboard = session.show()
display(dashboard)
"""

MEASURE = """
template = session._history[-1]
session._history[:] = [dict(template, step=i + 1) for i in range({steps})]
curves = dashboard.curves
curves.refresh()  # first call builds the figure for the full layout
update = []
for _ in range({repeats}):
    session._history.append(dict(template, step=len(session._history) + 1))
    start = time.perf_counter(); curves.refresh(); update.append(time.perf_counter() - start)
session.generate(); session.score(); session.advantages(); session.loss()
view = dashboard.completions
render = []
for _ in range({repeats}):
    start = time.perf_counter(); view.refresh(); render.append(time.perf_counter() - start)
switch = []
for group in [v for _, v in view.group.options]:
    start = time.perf_counter(); view.group.value = group; switch.append(time.perf_counter() - start)
print(json.dumps({{
    "history_steps": len(session._history), "completions": len(session.rollout),
    "curves_update_ms_median": 1000 * statistics.median(update), "curves_update_ms_max": 1000 * max(update),
    "completions_render_ms_median": 1000 * statistics.median(render), "completions_render_ms_max": 1000 * max(render),
    "group_switch_ms_median": 1000 * statistics.median(switch),
}}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(SETUP), nbformat.v4.new_code_cell(MEASURE.format(**vars(args)))]
    NotebookClient(notebook, timeout=900, kernel_name="python3").execute()
    text = "".join(o.get("text", "") for o in notebook.cells[-1].outputs if o.output_type == "stream")
    print(json.dumps(json.loads(text.strip().splitlines()[-1]), indent=2))


if __name__ == "__main__":
    main()
