"""What the experiment layer costs on the shipped model: a fork (LoRA and full), and the undo
snapshot each step takes.

    python benchmarks/bench_experiments.py [--steps 20] [--repeats 5]

Reports the seconds a ``fork()`` takes and the bytes of new tensors it holds (the fork's own
parameters and optimizer state, against those of the adapter and its AdamW moments), and the mean
step time with ``undo_steps=2`` against ``undo_steps=0``, measured in turns in one process.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from peft import LoraConfig

from grpo_lab import GRPOSession
from grpo_lab.tasks import default_task


def _session(task, peft: bool, **overrides):
    config = task.config(num_generations=4, per_device_train_batch_size=8, max_completion_length=16,
                         report_to="none", max_steps=1000, **overrides)
    lora = LoraConfig(r=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM") if peft else None
    return GRPOSession(task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset, peft_config=lora)


def _new_bytes(parent, fork) -> int:
    """Bytes of the fork's parameters and optimizer state that are not the parent's tensors."""
    shared = {p.data_ptr() for p in parent.model.parameters()}
    own = sum(p.numel() * p.element_size() for p in fork.model.parameters() if p.data_ptr() not in shared)
    moments = fork.engine.optimizer.state.values()
    return own + sum(t.numel() * t.element_size() for state in moments for t in state.values()
                     if isinstance(t, torch.Tensor))


def fork_cost(task, peft: bool, repeats: int) -> None:
    parent = _session(task, peft)
    parent.run(2, progress=False)
    times, forks = [], []
    for i in range(repeats):
        start = time.perf_counter()
        forks.append(parent.fork(f"f{i}"))
        times.append(time.perf_counter() - start)
    trainable = [p for p in parent.model.parameters() if p.requires_grad]
    adapter = sum(p.numel() * p.element_size() for p in trainable)
    print(f"{'LoRA' if peft else 'full'} fork: median {statistics.median(times):.3f} s (min {min(times):.3f}, max "
          f"{max(times):.3f}); new tensors {_new_bytes(parent, forks[-1]) / 2**20:.2f} MiB; trainable weights plus "
          f"two AdamW moments {3 * adapter / 2**20:.2f} MiB")


def snapshot_cost(task, steps: int) -> None:
    sessions = {keep: _session(task, False, undo_steps=keep) for keep in (2, 0)}
    times = {keep: [] for keep in sessions}
    for _ in range(steps):  # in turns, so that load on the machine falls on both alike
        for keep, session in sessions.items():
            start = time.perf_counter()
            session.step()
            times[keep].append(time.perf_counter() - start)
    with_undo, without = statistics.mean(times[2][2:]), statistics.mean(times[0][2:])
    print(f"step time: undo_steps=2 {with_undo * 1000:.1f} ms, undo_steps=0 {without * 1000:.1f} ms "
          f"(ratio {with_undo / without:.3f}); snapshot size {sessions[2].snapshots[-1].nbytes / 2**20:.1f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    task = default_task()
    fork_cost(task, peft=True, repeats=args.repeats)
    fork_cost(task, peft=False, repeats=args.repeats)
    snapshot_cost(task, args.steps)


if __name__ == "__main__":
    main()
