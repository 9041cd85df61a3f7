"""Held-out evaluation of a model on a task: greedy accuracy, pass@k, mean reward, mean length."""

from __future__ import annotations

from collections.abc import Callable

import torch

from grpo_lab.rollout.hf import generate, sampling_config
from grpo_lab.rollout.prompts import render_prompts, wrap_completions


def _completions(model, tokenizer, prompts, answers, *, do_sample, repeats, max_new_tokens, batch_size,
                 chat_template_kwargs):
    """Generate ``repeats`` completions per prompt; yield (prompts, answers, completions, lengths) per batch."""
    expanded = [(p, a) for p, a in zip(prompts, answers, strict=True) for _ in range(repeats)]
    config = sampling_config(tokenizer, max_new_tokens=max_new_tokens, do_sample=do_sample)
    for start in range(0, len(expanded), batch_size):
        chunk_prompts = [p for p, _ in expanded[start:start + batch_size]]
        chunk_answers = [a for _, a in expanded[start:start + batch_size]]
        batch = generate(model, tokenizer, render_prompts(chunk_prompts, tokenizer, chat_template_kwargs), config)
        texts = tokenizer.batch_decode(batch.completion_ids_BT, skip_special_tokens=True)
        yield (chunk_prompts, chunk_answers, wrap_completions(chunk_prompts, texts),
               batch.completion_mask_BT.sum(1).tolist())


def evaluate_model(
    model,
    tokenizer,
    dataset,
    *,
    accuracy_func: Callable,
    reward_funcs: list[Callable],
    k: int = 8,
    max_new_tokens: int = 16,
    batch_size: int = 512,
    seed: int = 0,
    chat_template_kwargs: dict | None = None,
) -> dict:
    """Evaluate on ``dataset`` (columns ``prompt`` and ``answer``).

    - ``greedy_accuracy``: share of prompts whose greedy completion ``accuracy_func`` scores 1;
    - ``pass@k``: share of prompts with at least one of ``k`` sampled completions (temperature 1)
      scored 1; ``sample_accuracy``: the mean score of those samples;
    - ``mean_reward``: the summed ``reward_funcs`` on greedy completions, averaged;
    - ``mean_length``: greedy completion length in tokens, averaged.
    Sampling is seeded with ``seed`` without disturbing the caller's random state.
    """
    prompts, answers = list(dataset["prompt"]), list(dataset["answer"])
    common = dict(max_new_tokens=max_new_tokens, batch_size=batch_size, chat_template_kwargs=chat_template_kwargs)
    greedy_hits, rewards, lengths = [], [], []
    for chunk_prompts, chunk_answers, completions, chunk_lengths in _completions(
        model, tokenizer, prompts, answers, do_sample=False, repeats=1, **common
    ):
        kwargs = dict(prompts=chunk_prompts, completions=completions, answer=chunk_answers)
        greedy_hits += accuracy_func(**kwargs)
        per_func = [func(**kwargs) for func in reward_funcs]
        rewards += [sum(r for r in values if r is not None) for values in zip(*per_func)]
        lengths += chunk_lengths
    sample_hits = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for chunk_prompts, chunk_answers, completions, _ in _completions(
            model, tokenizer, prompts, answers, do_sample=True, repeats=k, **common
        ):
            sample_hits += accuracy_func(prompts=chunk_prompts, completions=completions, answer=chunk_answers)
    per_prompt = torch.tensor(sample_hits).view(len(prompts), k)
    return {
        "num_prompts": len(prompts),
        "greedy_accuracy": sum(greedy_hits) / len(prompts),
        f"pass@{k}": (per_prompt.amax(dim=1) > 0).float().mean().item(),
        "sample_accuracy": per_prompt.mean().item(),
        "mean_reward": sum(rewards) / len(rewards),
        "mean_length": sum(lengths) / len(lengths),
    }
