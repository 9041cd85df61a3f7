"""Peak memory and time of one training log-prob pass, with and without ``compact_forward``.

With ``compact_forward`` the pass runs and scores only the completion tokens the mask keeps; on
transformers' path (``compact_forward=False``, prompt still shared) the padding after each
completion's end is run too, and log-probs are taken over (B, T, V) logits. The case is built for
what that costs: a 32,000-token vocabulary (the logits dominate memory) and completions of 16 to
256 tokens, so that about half of the (B, T) positions are padding. Each pass runs in a fresh
subprocess (peak resident memory is per process), the two paths alternating.

    python benchmarks/bench_logprob_pass.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

PATHS = ("compact", "transformers")


def child(path: str) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpo_lab import ops
    from grpo_lab.accel.prefix_sharing import PrefixSharing

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        head_dim=32, max_position_embeddings=512, pad_token_id=0,
    ))
    B, P, T, group = 16, 16, 256, 8
    prompt_ids = torch.randint(3, 32000, (B // group, P)).repeat_interleave(group, 0)
    lengths = torch.randint(16, T + 1, (B,))
    completion_mask = (torch.arange(T) < lengths[:, None]).long()
    completion_ids = torch.randint(3, 32000, (B, T)).masked_fill(completion_mask == 0, 0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    logits, slots_N = PrefixSharing().logits(
        model, prompt_ids, torch.ones_like(prompt_ids), completion_ids, completion_mask, compact=path == "compact"
    )
    if slots_N is None:
        logprobs = ops.selective_log_softmax(logits, completion_ids) * completion_mask
    else:
        logprobs = ops.selective_log_softmax(logits[None], completion_ids.flatten()[slots_N][None])
    logprobs.sum().backward()
    seconds = time.perf_counter() - start
    growth_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    return dict(seconds=seconds, peak_growth_mib=growth_mib, kept=int(completion_mask.sum()), positions=B * T)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", choices=PATHS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    runs = {path: [] for path in PATHS}
    for repeat in range(args.repeats):
        for path in PATHS if repeat % 2 == 0 else PATHS[::-1]:
            out = subprocess.run([sys.executable, __file__, "--child", path], capture_output=True, text=True,
                                 check=True)
            runs[path].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"repeat {repeat} {path}: {runs[path][-1]}", file=sys.stderr)
    summary = {
        path: {
            "median_seconds": statistics.median(r["seconds"] for r in results),
            "median_peak_growth_mib": statistics.median(r["peak_growth_mib"] for r in results),
            "kept_positions": results[0]["kept"],
            "positions": results[0]["positions"],
        }
        for path, results in runs.items()
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
