"""A TRL GRPO script whose model calls a Python function while it generates.

Written for TRL 1.16; the only change for grpo_lab is the import below. As in TRL, the model's
tokenizer must render tools (its chat template) and parse the model's calls (its
``response_template``):

    python examples/trl_scripts/tools.py --model PATH --output_dir runs/tools
"""

import argparse

from datasets import Dataset

from grpo_lab import GRPOConfig, GRPOTrainer  # with TRL: from trl import GRPOConfig, GRPOTrainer


def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def used_a_tool(completions, **kwargs):
    """1.0 for a completion that called a tool and answered after its result."""
    return [float(any(message["role"] == "tool" for message in completion)) for completion in completions]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_steps", type=int, default=2)
    args = parser.parse_args()

    questions = [f"What is {a}+{b}?" for a, b in [(12, 30), (21, 14), (33, 41), (18, 27)]]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": question}]} for question in questions * 4])
    config = GRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        learning_rate=1e-4,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=64,
        max_tool_calling_iterations=2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        seed=0,
    )
    trainer = GRPOTrainer(model=args.model, reward_funcs=[used_a_tool], args=config, train_dataset=dataset, tools=[add])
    trainer.train()
    trainer.save_state()


if __name__ == "__main__":
    main()
