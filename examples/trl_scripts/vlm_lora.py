"""A TRL GRPO script for a vision-language model, in the manner of TRL's ``examples/scripts/grpo_vlm.py``:
a dataset with an image column and conversational prompts, the model's processor, LoRA adapters.

Written for TRL 1.16; the only change for grpo_lab is the import below. Run it on any model that
``AutoModelForImageTextToText`` loads, with its processor saved beside it:

    python examples/trl_scripts/vlm_lora.py --model PATH --output_dir runs/vlm
"""

import argparse
import random
import re

from datasets import Dataset, Image
from peft import LoraConfig
from PIL import Image as PILImage, ImageDraw
from transformers import AutoModelForImageTextToText, AutoProcessor

from grpo_lab import GRPOConfig, GRPOTrainer  # with TRL: from trl import GRPOConfig, GRPOTrainer

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220)}


def squares(count: int, seed: int) -> Dataset:
    """Pictures of one coloured square each, and the question which colour it is."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        colour = rng.choice(list(COLOURS))
        image = PILImage.new("RGB", (28, 28), (128, 128, 128))
        left, top = rng.randint(0, 14), rng.randint(0, 14)
        ImageDraw.Draw(image).rectangle([left, top, left + 13, top + 13], fill=COLOURS[colour])
        question = "Which colour is the square? Answer in <answer></answer>."
        rows.append({"prompt": [{"role": "user", "content": question}], "image": image, "solution": colour})
    return Dataset.from_list(rows).cast_column("image", Image())


def accuracy(completions, solution, **kwargs):
    """1.0 when the answer tags hold the square's colour."""
    found = [re.search(r"<answer>\s*(\w+)\s*</answer>", completion[0]["content"]) for completion in completions]
    return [float(match is not None and match.group(1) == expected) for match, expected in zip(found, solution)]


def letters(completions, **kwargs):
    """The share of letters in the answer: a signal a random model's completions differ in."""
    texts = [completion[0]["content"] for completion in completions]
    return [sum(ch.isalpha() for ch in text) / max(len(text), 1) for text in texts]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_steps", type=int, default=3)
    args = parser.parse_args()

    model = AutoModelForImageTextToText.from_pretrained(args.model)
    processor = AutoProcessor.from_pretrained(args.model, padding_side="left")
    config = GRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        learning_rate=1e-3,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        seed=0,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[accuracy, letters],
        args=config,
        train_dataset=squares(32, seed=0),
        processing_class=processor,
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    )
    result = trainer.train()
    trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", result.metrics)
    trainer.save_state()
    trainer.save_model(args.output_dir)


if __name__ == "__main__":
    main()
