"""Generation throughput: the transformers backend vs vLLM on the same model, prompts and settings.

Each backend runs in a fresh subprocess (vLLM binds threads and keeps an engine), backends
alternating within each repetition; a run reports the median time of ``--calls`` timed generation
calls after one warm-up call, and generated tokens per second (completion tokens up to and
including EOS). Needs vLLM, so run it from the vLLM environment:

    .venv-vllm/bin/python benchmarks/bench_generation.py --case tiny --repeats 3
    .venv-vllm/bin/python benchmarks/bench_generation.py --case large --repeats 3

Cases: ``tiny``, the shipped 0.9M model, 64 prompts x 8 completions of at most 8 tokens (the
demo's generation batch); ``large``, a random 30M-parameter Llama (as in bench_trl.py), 4 prompts
x 8 completions of exactly 128 tokens (EOS ignored, so that both backends do the same work).
Both sample at temperature 1 in float32; vLLM also returns each token's log-prob. The
transformers backend runs as the trainer runs it by default: a group's prompt pre-filled once
(``share_prompt_prefix``), decoding steps written into the key/value cache in place. ``--lora R``
generates through a LoRA adapter of rank R on both sides, as training with ``peft_config`` does
(on CPU the only way to train with vLLM).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from large_model import large_model

BACKENDS = ("transformers", "vllm")


def _case(name: str, workdir: Path) -> dict:
    from grpo_lab.tasks import default_task

    task = default_task()
    if name == "tiny":
        return dict(model=task.model, prompts=task.train_dataset.select(range(64))["prompt"], repeat=8, max_tokens=8,
                    fixed_length=False)
    return dict(model=large_model(workdir, task.model), prompts=task.train_dataset.select(range(4))["prompt"], repeat=8,
                max_tokens=128, fixed_length=True)


def _adapter(model, rank: int):
    """A LoRA adapter of ``rank`` on every linear layer, as training with peft_config would add."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model,
                          LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", task_type="CAUSAL_LM"))


def _generator(backend: str, case: dict, tokenizer, lora: int):
    """A function generating the case's batch once and returning the number of completion tokens."""
    import tempfile

    import torch

    from grpo_lab.rollout.batch import draw_seeds, prompt_token_lists
    from grpo_lab.rollout.prompts import render_prompts

    texts = [t for t in render_prompts(case["prompts"], tokenizer) for _ in range(case["repeat"])]
    if backend == "transformers":
        from transformers import AutoModelForCausalLM

        from grpo_lab.accel.prefix_sharing import PrefixSharing
        from grpo_lab.rollout.hf import generate, sampling_config

        model = AutoModelForCausalLM.from_pretrained(case["model"], dtype=torch.float32)
        model = _adapter(model, lora) if lora else model
        extra = {"min_new_tokens": case["max_tokens"]} if case["fixed_length"] else {}
        config = sampling_config(tokenizer, max_new_tokens=case["max_tokens"], generation_kwargs=extra)
        sharing = PrefixSharing()  # as the trainer generates by default (share_prompt_prefix)
        return lambda: int(generate(model, tokenizer, texts, config, sharing).completion_mask_BT.sum())

    from grpo_lab.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(case["model"], dtype="float32", max_lora_rank=lora)
    if lora:
        from transformers import AutoModelForCausalLM

        directory = tempfile.mkdtemp()
        _adapter(AutoModelForCausalLM.from_pretrained(case["model"]), lora).save_pretrained(directory)
        engine.load_adapter(directory, 0)  # moves the directory into the engine's own
    _, _, prompts = prompt_token_lists(tokenizer, texts)
    settings = dict(max_tokens=case["max_tokens"], temperature=1.0, top_p=1.0, top_k=0, min_p=0.0,
                    repetition_penalty=1.0,
                    generation_kwargs={"min_tokens": case["max_tokens"]} if case["fixed_length"] else None)
    return lambda: sum(len(ids) for ids in engine.generate(prompts, settings, draw_seeds(len(prompts)))[0])


def child(backend: str, case_name: str, calls: int, workdir: str, lora: int) -> None:
    import torch

    from grpo_lab.core.models import load_tokenizer

    case = _case(case_name, Path(workdir))
    tokenizer = load_tokenizer(case["model"])
    torch.manual_seed(0)
    run = _generator(backend, case, tokenizer, lora)
    run()  # warm-up
    times, tokens = [], []
    for _ in range(calls):
        start = time.perf_counter()
        tokens.append(run())
        times.append(time.perf_counter() - start)
    print("RESULT " + json.dumps({"times": times, "tokens": tokens}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=["tiny", "large"], default="tiny")
    parser.add_argument("--calls", type=int, default=5, help="timed generation calls per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each backend, alternating")
    parser.add_argument("--lora", type=int, default=0, help="generate through a LoRA adapter of this rank (0: none)")
    parser.add_argument("--workdir", default="outputs/bench_generation")
    parser.add_argument("--child", nargs=2, metavar=("BACKEND", "CASE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.calls, args.workdir, args.lora)
        return
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    _case(args.case, Path(args.workdir))  # build the large model once, outside the timed runs
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    runs = {backend: [] for backend in BACKENDS}
    for repeat in range(args.repeats):
        for backend in BACKENDS:
            out = subprocess.run(
                [sys.executable, __file__, "--child", backend, args.case, "--calls", str(args.calls),
                 "--workdir", args.workdir, "--lora", str(args.lora)],
                capture_output=True, text=True, env=env,
            )
            line = next((text for text in out.stdout.splitlines() if text.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"{backend} failed:\n{out.stderr[-3000:]}")
            result = json.loads(line[len("RESULT "):])
            median = statistics.median(result["times"])
            tokens = statistics.median(result["tokens"])
            runs[backend].append((median, tokens))
            print(f"repeat {repeat + 1} {backend:12s} median {median * 1000:8.1f} ms  {tokens / median:9.0f} tokens/s",
                  flush=True)
    adapter = f", LoRA rank {args.lora}" if args.lora else ""
    print(f"\ncase {args.case}{adapter}: median over {args.repeats} runs of the per-run median "
          f"({args.calls} calls each)")
    base = None
    for backend in BACKENDS:
        median = statistics.median(m for m, _ in runs[backend])
        rate = statistics.median(t / m for m, t in runs[backend])
        base = base or rate
        print(f"{backend:12s} {median * 1000:8.1f} ms per call  {rate:9.0f} tokens/s  "
              f"({rate / base:.2f}x transformers)")


if __name__ == "__main__":
    main()
