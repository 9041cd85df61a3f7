"""A TRL GRPO script with plain-text prompts, two reward functions and evaluation while training.

Written for TRL 1.16; the only change for grpo_lab is the import below. Run it on any causal LM:

    python examples/trl_scripts/prompts_two_rewards_eval.py --model PATH --output_dir runs/prompts
"""

import argparse
import random
import re

from datasets import Dataset

from grpo_lab import GRPOConfig, GRPOTrainer  # with TRL: from trl import GRPOConfig, GRPOTrainer


def addition_problems(count: int, seed: int) -> Dataset:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(10, 49), rng.randint(10, 49)
        rows.append({"prompt": f"What is {a}+{b}? Answer:", "answer": str(a + b)})
    return Dataset.from_list(rows)


def correctness(completions, answer, **kwargs):
    """1.0 when the first number of the completion is the answer."""
    found = [re.search(r"\d+", completion) for completion in completions]
    return [float(match is not None and match.group() == expected) for match, expected in zip(found, answer)]


def brevity(completions, **kwargs):
    """Shorter completions score higher."""
    return [1.0 / (1.0 + len(completion)) for completion in completions]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_steps", type=int, default=4)
    args = parser.parse_args()

    config = GRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        learning_rate=1e-4,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        logging_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        per_device_eval_batch_size=4,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        seed=0,
    )
    trainer = GRPOTrainer(
        model=args.model,
        reward_funcs=[correctness, brevity],
        args=config,
        train_dataset=addition_problems(64, seed=0),
        eval_dataset=addition_problems(8, seed=1),
    )
    result = trainer.train()
    trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", result.metrics)
    trainer.save_state()


if __name__ == "__main__":
    main()
