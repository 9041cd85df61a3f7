"""One-step-off generation (``async_generation=True``) against synchronous generation, step time on
the same machine in one run.

A ``grpo-lab vllm-serve`` server (vLLM's CPU backend) generates for a LoRA session on the shipped
model, the session stepped stage by stage: in synchronous mode the step is generation then scoring,
advantages, loss and update; with ``async_generation`` the server generates the next batch while the
trainer does the rest. Sync and async runs alternate, ``--repeats`` pairs, each a fresh session on
the same server; the report gives the median step time of each (the first two steps of a run left
out), the ratio async / sync per pair and overall, and, from the sync runs, the median time of
generation and of the rest of the step (the overlap can save at most the smaller). The same pair is
also run with the in-process transformers backend, where nothing can overlap.

The server and the trainer each get one thread (``OMP_NUM_THREADS=1`` and ``torch.set_num_threads(1)``)
so that on a 2-core machine each has a core of its own, as a server on its own device would.

    .venv-vllm/bin/python benchmarks/bench_async_generation.py --steps 12 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import torch

from grpo_lab import GRPOSession
from grpo_lab.tasks import TINY_MODEL_DIR, default_task

SETTINGS = dict(num_generations=8, per_device_train_batch_size=8, gradient_accumulation_steps=8, learning_rate=1e-4,
                beta=0.04, logging_steps=1, gradient_checkpointing=False, seed=0, report_to="none", doctor="off",
                undo_steps=0, temperature=1.0)
"""8 prompts x 8 completions a step (of up to ``--max_completion_length`` tokens), trained in 8 micro-batches
with a KL term (the base model's log-probs, the adapter off): a step whose training takes about as long
as the server's generation on a 2-core CPU."""


def start_server() -> tuple[subprocess.Popen, int]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "grpo_lab.cli", "vllm-serve", "--model", str(TINY_MODEL_DIR), "--host", "127.0.0.1",
         "--port", str(port), "--max-lora-rank", "16", "--dtype", "float32"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
            return server, port
        except OSError:
            if server.poll() is not None:
                raise RuntimeError(f"grpo-lab vllm-serve exited with {server.returncode}") from None
            time.sleep(1)
    server.kill()
    raise RuntimeError("grpo-lab vllm-serve did not answer /health within 300 s")


def run(task, port: int | None, async_generation: bool, steps: int, folder: str, length: int) -> dict:
    """Step a fresh session ``steps`` times, clocking each step and, in sync mode, its generation."""
    from peft import LoraConfig

    server = {} if port is None else dict(use_vllm=True, vllm_mode="server", vllm_server_host="127.0.0.1",
                                          vllm_server_port=port)
    config = task.config(**SETTINGS, **server, max_steps=steps, output_dir=folder, async_generation=async_generation,
                         max_completion_length=length)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    session = GRPOSession(task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset,
                          peft_config=lora)
    step_times, generation_times = [], []
    for _ in range(steps):
        start = time.perf_counter()
        session.generate()
        generated = time.perf_counter()
        session.score(), session.advantages(), session.loss(), session.update()
        step_times.append(time.perf_counter() - start)
        generation_times.append(generated - start)
    session.close()
    kept = slice(2, None)  # the first steps warm up the server's and the trainer's caches
    return {"step": statistics.median(step_times[kept]), "generate": statistics.median(generation_times[kept]),
            "rest": statistics.median([s - g for s, g in zip(step_times[kept], generation_times[kept])]),
            "last staleness": float(session.history["async_generation/staleness"].iloc[-1] if async_generation else 0)}


def pairs(task, port, steps: int, repeats: int, folder: str, length: int) -> dict:
    results = {"sync": [], "async": []}
    for repeat in range(repeats):
        order = (False, True) if repeat % 2 == 0 else (True, False)  # alternating: slow phases hit both
        for async_generation in order:
            name = "async" if async_generation else "sync"
            results[name].append(run(task, port, async_generation, steps, f"{folder}/{name}-{repeat}", length))
            print(json.dumps({"backend": "vllm-server" if port else "transformers", "run": name, "repeat": repeat,
                              **results[name][-1]}), flush=True)
    sync = [r["step"] for r in results["sync"]]
    async_ = [r["step"] for r in results["async"]]
    return {
        "sync step (s)": round(statistics.median(sync), 3),
        "async step (s)": round(statistics.median(async_), 3),
        "async / sync": round(statistics.median(async_) / statistics.median(sync), 3),
        "async / sync per pair": [round(a / s, 3) for a, s in zip(async_, sync)],
        "sync generate (s)": round(statistics.median(r["generate"] for r in results["sync"]), 3),
        "sync rest of step (s)": round(statistics.median(r["rest"] for r in results["sync"]), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max_completion_length", type=int, default=16,
                        help="16: generation and the rest of a step take similar time on a 2-core CPU")
    args = parser.parse_args()
    torch.set_num_threads(1)
    task = default_task()
    report = {}
    server, port = start_server()
    try:
        with tempfile.TemporaryDirectory() as folder:
            report["vllm-server"] = pairs(task, port, args.steps, args.repeats, folder, args.max_completion_length)
            report["transformers"] = pairs(task, None, args.steps, args.repeats, folder, args.max_completion_length)
    finally:
        server.terminate()
        server.wait(timeout=60)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
