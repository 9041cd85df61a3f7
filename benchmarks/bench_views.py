"""Cost of the dashboard inside a real Jupyter kernel (widget messages serialised and sent).

The headline: training's step time on the shipped model with one displayed dashboard against none,
measured in turns in one kernel (``run(N)`` without a dashboard, then with one, repeated), and
the overhead per step as a share of the step without it (the median over the turns of each
turn's pair, so that the model's drifting step time cancels). Then the kernel time of one curves
refresh with histories of 10, 100 and 1,000 steps, the kernel memory one refresh leaves behind at
a fixed history, and the time to render the completions view of the batch. The
measurements run as cells of an in-memory notebook through nbclient, so comm traffic is real.

    python benchmarks/bench_views.py [--run-steps 20] [--turns 8] [--steps 10 100 1000] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import os

import nbformat
from nbclient import NotebookClient

SETUP = """
import json, statistics, time
from IPython.display import display
from grpo_lab import GRPOSession
from grpo_lab.tasks import default_task
task = default_task(eval_size=16)
session = GRPOSession(task.model, task.reward_funcs, train_dataset=task.train_dataset,
                      args=task.config(max_steps=100_000, output_dir="outputs/bench_views"))
session.run(3, progress=False)  # warm-up
"""

OVERHEAD = """
def per_step(n):
    start = time.perf_counter()
    session.run(n, progress=False)
    return (time.perf_counter() - start) / n

without, shown = [], []
for turn in range({turns}):
    first_without = turn % 2 == 0  # ABBA: a drift of the machine's speed hits both alike
    for with_dashboard in ((False, True) if first_without else (True, False)):
        if with_dashboard:
            dashboard = session.show()
            display(dashboard)
            shown.append(per_step({run_steps}))
            dashboard.close()
        else:
            without.append(per_step({run_steps}))
overhead = {{
    "step_s_without_dashboard_median": statistics.median(without),
    "step_s_with_dashboard_median": statistics.median(shown),
    "overhead_share_of_step": statistics.median(s / w - 1 for s, w in zip(shown, without)),
    "per_turn_overhead_shares": [s / w - 1 for s, w in zip(shown, without)],
    "steps_per_measure": {run_steps}, "turns": {turns},
}}
print(json.dumps(overhead))
"""

REFRESHES = """
import tracemalloc
dashboard = session.show()
display(dashboard)
history = session.record.history
template = dict(history[-1])
def row(i):  # every metric varies from step to step, so that no panel is left out as constant
    return {{k: (v * (1 + 0.01 * ((i * 7) % 13)) + 0.001 * (i % 5) if k != "step" else i + 1)
             for k, v in template.items() if isinstance(v, (int, float))}}
kept = list(history)
curves = dashboard.curves
results = {{}}
for steps in {steps}:
    history[:] = [row(i) for i in range(steps)]
    curves.refresh()
    update = []
    for _ in range({repeats}):
        history.append(row(len(history)))
        start = time.perf_counter(); curves.refresh(); update.append(time.perf_counter() - start)
    results[f"curves_refresh_ms_median_{{steps}}"] = 1000 * statistics.median(update)
    results[f"curves_refresh_ms_max_{{steps}}"] = 1000 * max(update)
    results[f"curves_traces_{{steps}}"] = sum(len(p["series"]) for p in curves.figure.spec["panels"])
# memory: the same history refreshed again and again must not hold on to anything
tracemalloc.start()
for _ in range(5):
    curves.refresh()
before = tracemalloc.get_traced_memory()[0]
for _ in range(100):
    curves.refresh()
results["kernel_bytes_kept_per_refresh"] = (tracemalloc.get_traced_memory()[0] - before) / 100
tracemalloc.stop()
history[:] = kept
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


def _last_json(cell) -> dict:
    text = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
    return json.loads(text.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-steps", type=int, default=20, help="optimizer steps per timed run(N)")
    parser.add_argument("--turns", type=int, default=8, help="timed runs with a dashboard, and as many without")
    parser.add_argument("--steps", type=int, nargs="+", default=[10, 100, 1000], help="history lengths")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(source.format(**vars(args))) for source in (SETUP, OVERHEAD, REFRESHES)]
    NotebookClient(notebook, timeout=1800, kernel_name="python3").execute()
    errors = [o for cell in notebook.cells for o in cell.outputs if o.output_type == "error"]
    if errors:
        raise SystemExit("\n".join(errors[0].traceback))
    print(json.dumps({**_last_json(notebook.cells[1]), **_last_json(notebook.cells[2])}, indent=2))


if __name__ == "__main__":
    main()
