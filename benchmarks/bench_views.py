"""Cost of the dashboard inside a real Jupyter kernel (widget messages serialised and sent).

Measures the kernel time of one curves update, and of one whole dashboard update (every view
hearing an optimizer step's event: what each step costs the dashboard), with histories of 10, 100
and 1,000 steps, the kernel memory one update leaves behind at a fixed
history, and the time to render the completions view of a 64-completion batch. Runs the
measurements as cells of an in-memory notebook through nbclient, so comm traffic is real.

    python benchmarks/bench_views.py [--steps 10 100 1000] [--repeats 20]
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
import tracemalloc
template = session._history[-1]
def row(i):  # every metric varies from step to step, so that no panel is left out as constant
    return {{k: (v * (1 + 0.01 * ((i * 7) % 13)) + 0.001 * (i % 5) if k != "step" else i + 1)
             for k, v in template.items()}}
curves = dashboard.curves
results = {{}}
for steps in {steps}:
    session._history[:] = [row(i) for i in range(steps)]
    curves.refresh()
    update = []
    for _ in range({repeats}):
        session._history.append(row(len(session._history)))
        start = time.perf_counter(); curves.refresh(); update.append(time.perf_counter() - start)
    results[f"curves_update_ms_median_{{steps}}"] = 1000 * statistics.median(update)
    results[f"curves_update_ms_max_{{steps}}"] = 1000 * max(update)
    whole = []  # every view of the dashboard hears the update, as after a real optimizer step
    for _ in range({repeats}):
        session._history.append(row(len(session._history)))
        start = time.perf_counter()
        session._notify("update", session._history[-1])
        whole.append(time.perf_counter() - start)
    results[f"dashboard_update_ms_median_{{steps}}"] = 1000 * statistics.median(whole)
    results[f"dashboard_update_ms_max_{{steps}}"] = 1000 * max(whole)
    results[f"curves_traces_{{steps}}"] = sum(len(p["series"]) for p in curves.figure.spec["panels"])
# memory: the same history refreshed again and again must not hold on to anything
tracemalloc.start()
for _ in range(5):
    curves.refresh()
before = tracemalloc.get_traced_memory()[0]
for _ in range(100):
    curves.refresh()
results["kernel_bytes_kept_per_update"] = (tracemalloc.get_traced_memory()[0] - before) / 100
tracemalloc.stop()
session.generate(); session.score(); session.advantages(); session.loss()
view = dashboard.completions
render = []
for _ in range({repeats}):
    start = time.perf_counter(); view.refresh(); render.append(time.perf_counter() - start)
switch = []
for group in [v for _, v in view.group.options]:
    start = time.perf_counter(); view.group.value = group; switch.append(time.perf_counter() - start)
print(json.dumps({{
    **results, "completions": len(session.rollout),
    "completions_render_ms_median": 1000 * statistics.median(render), "completions_render_ms_max": 1000 * max(render),
    "group_switch_ms_median": 1000 * statistics.median(switch),
}}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[10, 100, 1000])
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
