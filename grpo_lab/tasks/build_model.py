"""Rebuild the shipped tiny model from nothing: tokenizer, Llama config, supervised warm-up.

    python -m grpo_lab.tasks.build_model --out grpo_lab/tasks/tiny_model

Deterministic for a given seed and thread count. The warm-up imitates a noisy teacher (see
``grpo_lab.tasks.addition``): the correct sum with probability ``--p-correct``, else the sum with
every carry dropped. It takes about two minutes on 2 CPU cores with the default settings.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from grpo_lab.tasks import addition

PAD, EOS = "<|endoftext|>", "<|im_end|>"
ANSWER_TAGS = ("<answer>", "</answer>")  # one token each: completions stay short
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def render_chatml(messages: list[dict[str, str]]) -> str:
    """The chat template's output with a generation prompt, for the tokenizer's training corpus."""
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return turns + "<|im_start|>assistant\n"


def build_tokenizer(vocab_size: int = 300) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on task text; digits are always single tokens (column arithmetic)."""
    corpus = []
    for a, b in addition.all_problems()[::7]:
        answer = f"<answer>{a + b}</answer>"
        corpus += [addition.standard_prompt(a, b) + answer,
                   render_chatml(addition.conversational_prompt(a, b)) + answer]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, "<|im_start|>", EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer=trainer)
    backend.add_tokens([AddedToken(tag, normalized=False) for tag in ANSWER_TAGS])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS,
        pad_token=PAD,
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def build_model(tokenizer, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,  # one of the head sizes vLLM's CPU backend supports
        max_position_embeddings=128,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    return LlamaForCausalLM(config)


def teacher_answer(a: int, b: int, rng: random.Random, p_correct: float) -> int:
    return a + b if rng.random() < p_correct else addition.no_carry_sum(a, b)


def sft_batch(tokenizer, problems, rng: random.Random, p_correct: float):
    """Right-padded input ids and labels (prompt tokens masked out) for one batch, mixed formats."""
    rows = []
    for a, b in problems:
        if rng.random() < 0.5:
            prompt = addition.standard_prompt(a, b)
        else:
            prompt = tokenizer.apply_chat_template(
                addition.conversational_prompt(a, b), tokenize=False, add_generation_prompt=True
            )
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(f"<answer>{teacher_answer(a, b, rng, p_correct)}</answer>", add_special_tokens=False)[
            "input_ids"
        ] + [tokenizer.eos_token_id]
        rows.append((prompt_ids + answer_ids, [-100] * len(prompt_ids) + answer_ids))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, lab) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(lab)] = torch.tensor(lab)
        attention[i, : len(ids)] = 1
    return input_ids, attention, labels


def warm_up(model, tokenizer, train_problems, *, steps: int, batch_size: int, lr: float, p_correct: float, seed: int,
            log_every: int = 100):
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))),
    )
    model.train()
    start = time.time()
    for step in range(steps):
        problems = rng.sample(train_problems, batch_size)
        input_ids, attention, labels = sft_batch(tokenizer, problems, rng, p_correct)
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % log_every == 0 or step + 1 == steps:
            print(f"step {step + 1}/{steps}  loss {loss.item():.4f}  {time.time() - start:.0f}s", flush=True)
    model.eval()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory to write the model into")
    parser.add_argument("--steps", type=int, default=1500, help="supervised warm-up steps")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--p-correct", type=float, default=0.3, help="how often the teacher carries correctly")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-size", type=int, default=300, help="held-out prompts to report on (0: skip)")
    args = parser.parse_args(argv)

    start = time.time()
    torch.manual_seed(args.seed)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, args.seed)
    train_problems, eval_problems = addition.split_problems()
    warm_up(model, tokenizer, train_problems, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
            p_correct=args.p_correct, seed=args.seed)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    report = {"parameters": sum(p.numel() for p in model.parameters()), "build_seconds": round(time.time() - start, 1)}
    if args.eval_size:
        from grpo_lab.tasks.evaluation import evaluate_model

        dataset = addition.make_dataset(eval_problems[: args.eval_size])
        report.update(evaluate_model(model, tokenizer, dataset, accuracy_func=addition.correctness_reward,
                                     reward_funcs=[addition.correctness_reward, addition.format_reward]))
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
