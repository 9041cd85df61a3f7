"""Dynamic sampling (``dynamic_sampling=True``) on the embedded task: what it costs in generation and
what it buys in learning signal and held-out accuracy.

Two measurements, each run with dynamic sampling off and on from the same seed:

1. ``from_base``: 100 steps of the demo's configuration (``grpo_lab.tasks.DEMO_CONFIG``: 8 prompts x
   8 completions a step) from the shipped base model, under ``--seeds`` seeds; the report gives
   held-out greedy accuracy and pass@8 after training, the completion tokens generated in all, per kept group, the mean
   ``frac_reward_zero_std`` of the trained batches and the wall time.
2. ``after_training``: from the model the "off" run of (1) with seed 0 trained (most groups all correct), 10
   more steps; the report gives each step's ``frac_reward_zero_std`` and rounds, and the tokens per
   kept group.

    python benchmarks/bench_dynamic_sampling.py            # about 2 minutes on a 2-core CPU
    python benchmarks/bench_dynamic_sampling.py --steps 20  # a shorter check
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from grpo_lab import GRPOTrainer
from grpo_lab.tasks import DEMO_CONFIG, default_task


def train(task, model, steps: int, dynamic: bool, output_dir: str, max_rounds: int, seed: int = 0) -> dict:
    """Train ``steps`` steps from ``model`` and return the run's figures and its trainer."""
    config = task.config(**{**DEMO_CONFIG, "seed": seed, "max_steps": steps, "save_strategy": "no",
                            "output_dir": output_dir, "report_to": "none", "disable_tqdm": True, "doctor": "off",
                            "dynamic_sampling": dynamic, "dynamic_sampling_max_rounds": max_rounds})
    trainer = GRPOTrainer(model, task.reward_funcs, args=config, train_dataset=task.train_dataset)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    history = trainer.session.history
    completions = trainer.session.engine.batching.generation_batch_size
    groups = completions // config.num_generations
    if dynamic:  # every round's tokens: tokens per kept group x kept groups (x 1 where none was kept)
        kept = ((1 - history["dynamic_sampling/frac_groups_filled"]) * groups).round().clip(lower=1)
        generated = (history["dynamic_sampling/tokens_per_kept_group"] * kept).sum()
    else:
        generated = (history["completions/mean_length"] * completions).sum()
    figures = {
        "seconds": round(seconds, 1),
        "completion_tokens_generated": int(round(generated)),
        "mean_frac_reward_zero_std": round(float(history["frac_reward_zero_std"].mean()), 3),
        "frac_reward_zero_std_by_step": [round(v, 3) for v in history["frac_reward_zero_std"]],
    }
    if dynamic:
        figures["rounds_by_step"] = [int(v) for v in history["dynamic_sampling/rounds"]]
        tokens = history["dynamic_sampling/tokens_per_kept_group"]
        figures["mean_tokens_per_kept_group"] = round(float(tokens.mean()), 1)
        figures["mean_frac_groups_filled"] = round(float(history["dynamic_sampling/frac_groups_filled"].mean()), 3)
    else:  # every group is trained on
        figures["mean_tokens_per_kept_group"] = round(float(generated) / (groups * len(history)), 1)
    return {"figures": figures, "trainer": trainer}


def held_out(task, trainer) -> dict:
    session = trainer.session
    result = task.evaluate(session.model, session.tokenizer, k=8)
    return {"greedy_accuracy": round(result["greedy_accuracy"], 3), "pass@8": round(result["pass@8"], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100, help="steps from the base model")
    parser.add_argument("--after_steps", type=int, default=10, help="steps after training")
    parser.add_argument("--max_rounds", type=int, default=10, help="dynamic_sampling_max_rounds")
    parser.add_argument("--seeds", type=int, default=3, help="seeds of the runs from the base model")
    args = parser.parse_args()
    task = default_task()
    report = {"from_base": {}, "after_training": {}}
    with tempfile.TemporaryDirectory() as folder:
        for seed in range(args.seeds):
            for dynamic in (False, True):
                name = f"{'on' if dynamic else 'off'}/seed{seed}"
                run = train(task, task.model, args.steps, dynamic, f"{folder}/{name}", args.max_rounds, seed)
                report["from_base"][name] = {**run["figures"], **held_out(task, run["trainer"])}
                report["from_base"][name].pop("frac_reward_zero_std_by_step")
                report["from_base"][name].pop("rounds_by_step", None)
                print(json.dumps({f"from_base/{name}": report["from_base"][name]}), flush=True)
                if seed == 0 and not dynamic:
                    off_run = run["trainer"]
        trained = f"{folder}/trained"
        off_run.save_model(trained)
        for dynamic in (False, True):
            name = "on" if dynamic else "off"
            run = train(task, trained, args.after_steps, dynamic, f"{folder}/after-{name}", args.max_rounds)
            report["after_training"][name] = run["figures"]
            print(json.dumps({f"after_training/{name}": run["figures"]}), flush=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
