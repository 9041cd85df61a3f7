"""Decoding with products taken weight-first (``compact_forward.WEIGHT_FIRST_MIN_BYTES``) or not.

A decoding step on a CPU multiplies a few rows by every weight. ``compact_forward._linear`` takes
the products of weights of ``WEIGHT_FIRST_MIN_BYTES`` or more as ``(W @ x^T)^T``; this script times
grpo_lab's sampling loop (``rollout.hf.generate`` with ``compact=True``, as the trainer runs it) in
three settings, alternating within each repetition in one process:

- ``default``: weights of ``WEIGHT_FIRST_MIN_BYTES`` or more weight-first;
- ``off``: no product weight-first (the threshold set above every weight);
- ``every``: every bias-free float32 product weight-first (threshold 0).

It reports the median time of a generation call per setting, its ratio to ``off``, and the largest
difference between ``default``'s and ``off``'s logits at one decoding step.

    .venv/bin/python benchmarks/bench_weight_first.py --case tiny --calls 30
    .venv/bin/python benchmarks/bench_weight_first.py --case large --calls 9

Cases: as ``bench_trl.py``'s generation, ``tiny`` is the shipped 0.9M model, 8 prompts x 8
completions of at most 8 tokens; ``large`` a random 30M-parameter Llama, 2 prompts x 8 completions
of up to 128 tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from tempfile import TemporaryDirectory

import torch

from large_model import large_model

SETTINGS = ("default", "off", "every")


def _threshold(setting: str, default: int) -> float:
    return {"default": default, "off": float("inf"), "every": 0}[setting]


def _step_logits(model, ids_BP, mask_BP) -> torch.Tensor:
    """(B, V) logits of one decoding step after the prompts, through ``compact_forward.forward``."""
    from grpo_lab.accel import compact_forward
    from grpo_lab.core.policy_forward import position_ids

    B, P = ids_BP.shape
    valid_BS = torch.cat([mask_BP.bool(), mask_BP.new_ones(B, 1, dtype=torch.bool)], dim=1)
    positions_BP = position_ids(mask_BP)
    cache = compact_forward.new_cache(model)
    compact_forward.forward(model, ids_BP, positions_BP, valid_BS, cache, 0, last_only=True)
    return compact_forward.forward(model, ids_BP[:, -1:], positions_BP[:, -1:] + 1, valid_BS, cache, P, last_only=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=["tiny", "large"], default="tiny")
    parser.add_argument("--calls", type=int, default=9, help="timed generation calls per setting")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from grpo_lab.accel import compact_forward
    from grpo_lab.accel.prefix_sharing import PrefixSharing
    from grpo_lab.core.models import load_tokenizer, prepare_tokenizer
    from grpo_lab.rollout.hf import generate, sampling_config, tokenize_prompts
    from grpo_lab.rollout.prompts import render_prompts
    from grpo_lab.tasks import default_task

    task = default_task()
    with TemporaryDirectory() as workdir:
        path = task.model if args.case == "tiny" else large_model(Path(workdir), task.model)
        model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = prepare_tokenizer(load_tokenizer(task.model))
    prompts, max_new = (8, 8) if args.case == "tiny" else (2, 128)
    rendered = render_prompts(task.train_dataset.select(range(prompts))["prompt"], tokenizer)
    texts = [text for text in rendered for _ in range(8)]
    settings = sampling_config(tokenizer, max_new_tokens=max_new)
    default = compact_forward.WEIGHT_FIRST_MIN_BYTES

    with torch.no_grad():
        ids_BP, mask_BP = tokenize_prompts(tokenizer, texts, torch.device("cpu"))
        logits = {}
        for setting in ("default", "off"):
            compact_forward.WEIGHT_FIRST_MIN_BYTES = _threshold(setting, default)
            logits[setting] = _step_logits(model, ids_BP, mask_BP)
        times: dict[str, list[float]] = {setting: [] for setting in SETTINGS}
        for call in range(args.calls + 1):
            for setting in SETTINGS[call % 3:] + SETTINGS[: call % 3]:
                compact_forward.WEIGHT_FIRST_MIN_BYTES = _threshold(setting, default)
                torch.manual_seed(call)
                start = time.perf_counter()
                generate(model, tokenizer, texts, settings, PrefixSharing(), compact=True)
                if call > 0:  # the first call of each setting warms up
                    times[setting].append(time.perf_counter() - start)
    compact_forward.WEIGHT_FIRST_MIN_BYTES = default

    medians = {setting: statistics.median(values) for setting, values in times.items()}
    weights = {name: p.numel() * 4 for name, p in model.named_parameters() if p.dim() == 2}
    print(f"case {args.case}: {sum(size >= default for size in weights.values())} of {len(weights)} weight matrices "
          f"at or above WEIGHT_FIRST_MIN_BYTES={default}")
    for setting in SETTINGS:
        calls = ", ".join(f"{t * 1000:.0f}" for t in times[setting])
        print(f"{setting:8s} median {medians[setting] * 1000:8.1f} ms  vs off "
              f"{medians[setting] / medians['off']:.2f}x  calls (ms): {calls}")
    difference = (logits["default"] - logits["off"]).abs().max().item()
    print(f"largest logit difference, default vs off, at one decoding step: {difference:.3g}")


if __name__ == "__main__":
    main()
