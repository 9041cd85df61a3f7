"""Time of ``session.try_rewards(on="history")`` over a log of real completions.

Trains the shipped model on the embedded addition task with large generation batches until the
completion log holds at least ``--completions`` completions (each a real sample of that step's
policy), then times ``try_rewards`` on the whole history with the task's own two reward
functions (correctness and format, weights 1): every logged batch scored again by the training
runner, its advantages by the engine's function, the statistics, correlations and disagreements.
Also reports the time ``log_entry`` adds to a step (building the entry with the reward inputs).

    OMP_NUM_THREADS=1 python benchmarks/bench_try_rewards.py [--completions 10000] [--batch 512] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--completions", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=512, help="completions per generation batch (64 prompts x 8)")
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from grpo_lab import GRPOSession
    from grpo_lab.session.rewards import log_entry
    from grpo_lab.tasks import default_task

    task = default_task(eval_size=16)
    config = task.config(per_device_train_batch_size=options.batch, num_generations=8, max_steps=10_000,
                         report_to="none", output_dir="outputs/bench_try_rewards", undo_steps=0)
    session = GRPOSession(task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset)
    started = time.perf_counter()
    while sum(len(entry["step"]) for entry in session._completion_log) < options.completions:
        session.step()
    training = time.perf_counter() - started
    logged = sum(len(entry["step"]) for entry in session._completion_log)

    session.generate(), session.score()
    advantages = session.advantages()
    entry_times = []
    for _ in range(20):
        start = time.perf_counter()
        log_entry(advantages, session.global_step + 1)
        entry_times.append(time.perf_counter() - start)
    session.discard_batch()

    times = []
    for _ in range(options.repeats):
        start = time.perf_counter()
        trial = session.try_rewards(task.reward_funcs, on="history")
        times.append(time.perf_counter() - start)
    print(trial)
    print(json.dumps({
        "logged_completions": logged, "logged_batches": len(session._completion_log),
        "training_s": round(training, 1), "try_rewards_history_s_median": round(statistics.median(times), 3),
        "try_rewards_history_s": [round(t, 3) for t in times],
        "log_entry_ms_median": round(1000 * statistics.median(entry_times), 2),
        "torch_threads": __import__("torch").get_num_threads(),
    }, indent=2))


if __name__ == "__main__":
    main()
