"""What ``skip_zero_advantage_backward`` saves: a session's steps with it on and off.

A micro-batch whose advantages are all zero (every completion of its groups got the same reward)
adds nothing to the gradient; with the setting on, its backward pass does not run. Micro-batches
are one group each here (``per_device_train_batch_size == num_generations``, TRL's default), the
layout where whole micro-batches are zero most often. Each (setting, repetition) runs in a fresh
subprocess, the two settings alternating; the report gives the median step and loss-stage times
(warm-up steps left out) and the share of micro-batches whose backward pass was skipped.

    python benchmarks/bench_zero_advantage.py --case tiny --steps 14 --repeats 3
    python benchmarks/bench_zero_advantage.py --case large --steps 8 --repeats 3

Cases: ``tiny`` is the embedded task on the shipped model (8 prompts x 8 completions of up to 8
tokens, the task's rewards: groups the model answers all right or all wrong are zero);
``large`` is the 30M-parameter random Llama of ``bench_trl.py`` (2 prompts x 8 completions of up
to 128 tokens) with a constructed reward: the share of ASCII letters in a completion for prompts
whose answer is odd, and 1 for the others, so that the groups of even answers are zero, as in a
run whose model solves some prompts every time or never (13 of the 16 prompts a run of 8 steps
draws with seed 0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_trl import letter_share_reward
from large_model import large_model

SETTINGS = ("skip", "run")
STAGES = ("generate", "score", "advantages", "loss", "update")


def letters_if_odd_reward(completions, answer, **kwargs) -> list[float]:
    """1 for a prompt whose answer is even; else ``bench_trl.letter_share_reward``, which random text
    earns in varying amounts."""
    shares = letter_share_reward(completions)
    return [1.0 if int(reference) % 2 == 0 else share for reference, share in zip(answer, shares, strict=True)]


def child(setting: str, case: str, steps: int, workdir: str) -> dict:
    from grpo_lab import GRPOConfig, GRPOSession
    from grpo_lab.tasks import default_task

    task = default_task()
    common = dict(learning_rate=1e-4, num_generations=8, per_device_train_batch_size=8, beta=0.0, loss_type="dapo",
                  gradient_checkpointing=False, seed=0, max_steps=steps, disable_tqdm=True,
                  skip_zero_advantage_backward=setting == "skip")
    if case == "tiny":
        model, rewards = task.model, task.reward_funcs
        config = dict(common, gradient_accumulation_steps=8, max_completion_length=8)
    else:
        model, rewards = large_model(Path(workdir), task.model), [letters_if_odd_reward]
        config = dict(common, gradient_accumulation_steps=2, max_completion_length=128)
    with tempfile.TemporaryDirectory() as out:
        session = GRPOSession(model, rewards, args=GRPOConfig(output_dir=out, **config),
                              train_dataset=task.train_dataset)
        times = {stage: [] for stage in (*STAGES, "step")}
        skipped = micro_batches = 0
        for _ in range(steps):
            begin = time.perf_counter()
            for stage in STAGES:
                start = time.perf_counter()
                result = getattr(session, stage)()
                times[stage].append(time.perf_counter() - start)
                if stage == "loss":
                    skipped, micro_batches = skipped + result.backward_skipped, micro_batches + result.micro_batches
            times["step"].append(time.perf_counter() - begin)
        session.close()
    return {"times": times, "skipped": skipped, "micro_batches": micro_batches}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=["tiny", "large"], default="tiny")
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", nargs=2, metavar=("SETTING", "WORKDIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.case, args.steps, args.child[1])))
        return
    runs: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    with tempfile.TemporaryDirectory() as workdir:
        if args.case == "large":
            from grpo_lab.tasks import default_task

            large_model(Path(workdir), default_task().model)  # built once, outside the timed runs
        for repeat in range(args.repeats):
            for setting in SETTINGS if repeat % 2 == 0 else SETTINGS[::-1]:
                out = subprocess.run(
                    [sys.executable, __file__, "--case", args.case, "--steps", str(args.steps),
                     "--child", setting, workdir],
                    check=True, capture_output=True, text=True,
                    env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"},
                ).stdout.strip().splitlines()[-1]
                runs[setting].append(json.loads(out))
                print(f"repeat {repeat} {setting}: median step "
                      f"{statistics.median(runs[setting][-1]['times']['step'][args.warmup:]):.4f}s", file=sys.stderr)
    summary = {}
    for setting, results in runs.items():
        median = lambda stage: statistics.median(t for r in results for t in r["times"][stage][args.warmup:])  # noqa: E731
        summary[setting] = {
            "median_step_s": median("step"),
            "median_loss_stage_s": median("loss"),
            "per_repeat_step_s": [round(statistics.median(r["times"]["step"][args.warmup:]), 4) for r in results],
            "skipped_micro_batches": f"{sum(r['skipped'] for r in results)} of "
                                     f"{sum(r['micro_batches'] for r in results)}",
        }
    summary["step_time_skip_vs_run"] = summary["skip"]["median_step_s"] / summary["run"]["median_step_s"]
    print(json.dumps({"case": args.case, "steps": args.steps, "repeats": args.repeats, **summary}, indent=2))


if __name__ == "__main__":
    main()
