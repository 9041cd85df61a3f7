"""grpo_lab vs TRL's GRPOTrainer on the same model, data, rewards and config.

Each (framework, repetition) trains in a fresh subprocess, in alternating order, so that peak
memory (the process's maximum resident set size) is measured per run and slow phases of a shared
machine hit every framework alike. TRL's and grpo_lab's trainers run their whole ``train()`` loop,
clocked at the end of each optimizer step; the session is stepped with ``step()``. The report gives
the median step time (first steps excluded as warm-up), generated tokens per second and peak
memory, the ratios grpo_lab / TRL, and the step-time ratio within each repetition.

    pip install trl==1.16.0          # benchmark-only dependency
    python benchmarks/bench_trl.py --case tiny --steps 12 --repeats 3
    python benchmarks/bench_trl.py --case large --steps 6 --repeats 2

Cases: ``tiny`` is the embedded task on the shipped 0.9M-parameter model (8 prompts x 8
completions, up to 8 tokens); ``large`` is a randomly initialised Llama of about 30M parameters
with the shipped tokenizer, 2 prompts x 8 completions of up to 128 tokens, where compute dominates;
``long_prompt`` is the larger model on prompts that open with a system message (about 160 prompt
tokens), 4 prompts x 8 completions of up to 32 tokens: the shape of few-shot or instruction-heavy
RL, where a group's shared prompt is most of each sequence. The two cases on the larger model add a
reward that random text earns in varying amounts (``letter_share_reward``), so that their steps
train on a gradient that is not zero.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from large_model import large_model

FRAMEWORKS = ("trl", "grpo_lab_trainer", "grpo_lab_session")

TRACKERS = ("wandb", "trackio", "mlflow", "comet_ml", "tensorboard", "tensorboardX", "clearml", "dvclive", "swanlab")
"""Experiment trackers. Neither run reports to one, but transformers imports the installed ones with
TRL's trainer (and comet_ml patches libraries when imported): the children block them, so that
memory and time are those of training alone."""


INSTRUCTIONS = ("You add two whole numbers. Read both numbers, add them digit by digit from the right, "
                "carry where a column passes nine, and answer with the sum only.")
"""The ``long_prompt`` case's system message: about 160 prompt tokens with the chat template."""


def letter_share_reward(completions, **kwargs) -> list[float]:
    """The share of a completion's characters that are ASCII letters: the random larger model never
    earns the task's rewards, so without this one every group's advantages would be zero, the loss
    pass would compute a gradient of exactly zero, and grpo_lab would skip its backward pass
    (``skip_zero_advantage_backward``) where TRL runs it."""
    from grpo_lab.tasks.addition import completion_text

    texts = [completion_text(c) for c in completions]
    return [sum(c.isascii() and c.isalpha() for c in text) / max(len(text), 1) for text in texts]


def _case(name: str, workdir: Path) -> dict:
    from grpo_lab.tasks import default_task

    task = default_task()
    common = dict(learning_rate=1e-4, num_generations=8, beta=0.0, loss_type="dapo", temperature=1.0,
                  gradient_checkpointing=False, seed=0, logging_steps=1)
    if name == "tiny":
        return dict(rewards=task.reward_funcs, model=task.model, dataset=task.train_dataset,
                    config=dict(common, per_device_train_batch_size=64, max_completion_length=8))
    model = large_model(workdir, task.model)
    rewards = [*task.reward_funcs, letter_share_reward]
    if name == "large":
        return dict(rewards=rewards, model=model, dataset=task.train_dataset,
                    config=dict(common, per_device_train_batch_size=16, max_completion_length=128))
    system = {"role": "system", "content": INSTRUCTIONS}
    dataset = task.train_dataset.map(lambda row: {"prompt": [system, *row["prompt"]]})
    return dict(rewards=rewards, model=model, dataset=dataset,
                config=dict(common, per_device_train_batch_size=32, max_completion_length=32))


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_trl(case: dict, steps: int, output_dir: str) -> tuple[list[float], list[int]]:
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    stamps, tokens = [time.perf_counter()], []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                tokens.append(logs["completions/mean_length"] * case["config"]["per_device_train_batch_size"])

    config = GRPOConfig(output_dir=output_dir, max_steps=steps, use_cpu=True, bf16=False, report_to="none",
                        save_strategy="no", disable_tqdm=True, **case["config"])
    trainer = GRPOTrainer(model=case["model"], reward_funcs=case["rewards"], args=config,
                          train_dataset=case["dataset"], callbacks=[Clock()])
    trainer.train()
    return [b - a for a, b in zip(stamps, stamps[1:])], tokens


def run_grpo_lab(case: dict, steps: int, output_dir: str, *, session: bool) -> tuple[list[float], list[int]]:
    from grpo_lab.config.grpo_config import GRPOConfig
    from grpo_lab.session.session import GRPOSession
    from grpo_lab.trainer.trainer import GRPOTrainer

    config = GRPOConfig(output_dir=output_dir, max_steps=steps, save_steps=10**9, disable_tqdm=True, **case["config"])
    args = (case["model"], case["rewards"])
    kwargs = dict(args=config, train_dataset=case["dataset"])
    if session:
        runner = GRPOSession(*args, **kwargs)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            runner.step()
            times.append(time.perf_counter() - start)
    else:
        # The whole train() loop (metrics file, progress, logging), clocked at the end of every
        # optimizer step as the TRL run is.
        trainer = GRPOTrainer(*args, **kwargs)
        runner = trainer.session
        stamps = [time.perf_counter()]
        runner.on(lambda stage, result: stamps.append(time.perf_counter()) if stage == "update" else None)
        trainer.train()
        times = [b - a for a, b in zip(stamps, stamps[1:])]
    history = runner.history
    return times, list(history["completions/mean_length"] * case["config"]["per_device_train_batch_size"])


def child(framework: str, case_name: str, steps: int, workdir: str) -> None:
    for name in TRACKERS:  # before transformers looks for them: None in sys.modules reads as not installed
        sys.modules.setdefault(name, None)
    case = _case(case_name, Path(workdir))
    with tempfile.TemporaryDirectory() as out:
        if framework == "trl":
            times, tokens = run_trl(case, steps, out)
        else:
            times, tokens = run_grpo_lab(case, steps, out, session=framework == "grpo_lab_session")
    print(json.dumps({"times": times, "tokens": tokens, "peak_rss_mib": _peak_rss_mib()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=["tiny", "large", "long_prompt"], default="tiny")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the median")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", nargs=2, metavar=("FRAMEWORK", "WORKDIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.case, args.steps, args.child[1])
        return
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    results: dict[str, list[dict]] = {f: [] for f in FRAMEWORKS}
    with tempfile.TemporaryDirectory() as workdir:
        _case(args.case, Path(workdir))  # build the large model once, outside the timed runs
        for repeat in range(args.repeats):
            order = FRAMEWORKS if repeat % 2 == 0 else FRAMEWORKS[::-1]
            for framework in order:
                out = subprocess.run(
                    [sys.executable, __file__, "--case", args.case, "--steps", str(args.steps),
                     "--child", framework, workdir],
                    check=True, capture_output=True, text=True, env=env,
                ).stdout.strip().splitlines()[-1]
                results[framework].append(json.loads(out))
                print(f"repeat {repeat} {framework}: median step "
                      f"{statistics.median(results[framework][-1]['times'][args.warmup:]):.3f}s",
                      file=sys.stderr)
    summary = {}
    for framework, runs in results.items():
        step_times = [t for run in runs for t in run["times"][args.warmup:]]
        generated = sum(sum(run["tokens"][args.warmup:]) for run in runs)
        summary[framework] = {
            "median_step_s": statistics.median(step_times),
            "generated_tokens_per_s": generated / sum(step_times),
            "peak_rss_mib": max(run["peak_rss_mib"] for run in runs),
        }
    repeat_medians = {f: [statistics.median(run["times"][args.warmup:]) for run in runs] for f, runs in results.items()}
    for framework in FRAMEWORKS[1:]:
        summary[framework]["step_time_vs_trl"] = summary[framework]["median_step_s"] / summary["trl"]["median_step_s"]
        summary[framework]["peak_memory_vs_trl"] = summary[framework]["peak_rss_mib"] / summary["trl"]["peak_rss_mib"]
        # Each repetition runs the frameworks back to back, so its ratio is the least touched by the
        # machine's slower and faster phases, which shift the pooled medians above.
        summary[framework]["step_time_vs_trl_per_repeat"] = [
            round(mine / theirs, 3) for mine, theirs in zip(repeat_medians[framework], repeat_medians["trl"])
        ]
    print(json.dumps({"case": args.case, "steps": args.steps, "repeats": args.repeats, **summary}, indent=2))


if __name__ == "__main__":
    main()
