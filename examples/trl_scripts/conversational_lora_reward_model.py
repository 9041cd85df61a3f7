"""A TRL GRPO script with conversational prompts, a LoRA adapter and a reward model beside a rule.

Written for TRL 1.16; the only change for grpo_lab is the import below. ``--reward_model`` is a
sequence-classification model with one label (a path or a hub id):

    python examples/trl_scripts/conversational_lora_reward_model.py --model PATH --reward_model RM_PATH \
        --output_dir runs/lora
"""

import argparse

from datasets import Dataset
from peft import LoraConfig

from grpo_lab import GRPOConfig, GRPOTrainer  # with TRL: from trl import GRPOConfig, GRPOTrainer

QUESTIONS = ["What is 12+30?", "What is 21+14?", "What is 33+41?", "What is 18+27?",
             "What is 40+45?", "What is 11+19?", "What is 25+25?", "What is 36+12?"]


def conversations() -> Dataset:
    return Dataset.from_list([{"prompt": [{"role": "user", "content": question}]} for question in QUESTIONS * 4])


def answer_tags(completions, **kwargs):
    """1.0 for a reply wrapped in <answer></answer>."""
    texts = [completion[0]["content"] for completion in completions]
    return [float(text.strip().startswith("<answer>") and text.strip().endswith("</answer>")) for text in texts]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--reward_model", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_steps", type=int, default=3)
    args = parser.parse_args()

    config = GRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        learning_rate=1e-3,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        logging_steps=1,
        beta=0.04,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        seed=0,
    )
    trainer = GRPOTrainer(
        model=args.model,
        reward_funcs=[args.reward_model, answer_tags],
        args=config,
        train_dataset=conversations(),
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    trainer.train()
    trainer.save_model(args.output_dir)
    trainer.save_state()


if __name__ == "__main__":
    main()
