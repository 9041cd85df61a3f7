"""A small image task for vision-language models: "which colour is the square?", with a verifiable
answer, drawn with PIL (nothing to download).

Each row holds a picture of one coloured square on a grey ground (the ``image`` column, a PIL image),
a conversational prompt that asks for the square's colour in ``<answer>...</answer>`` tags, and the
colour's name (``answer``). The square's colour, place and size come from the row's seed.
"""

from __future__ import annotations

import random
import re

from datasets import Dataset, Image

from grpo_lab.tasks.addition import completion_text

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40)}
QUESTION = "Which colour is the square? Answer with <answer>colour</answer>."
_ANSWER_RE = re.compile(r"<answer>\s*([a-z]+)\s*</answer>")


def square_image(colour: str, *, size: int = 28, seed: int = 0):
    """A ``size`` x ``size`` grey picture with one square of ``colour`` (a name of :data:`COLOURS`),
    placed and sized by ``seed``."""
    from PIL import Image as PILImage, ImageDraw

    draw_random = random.Random(seed)
    image = PILImage.new("RGB", (size, size), (128, 128, 128))
    side = draw_random.randint(size // 3, size // 2)
    left, top = draw_random.randint(0, size - side), draw_random.randint(0, size - side)
    ImageDraw.Draw(image).rectangle([left, top, left + side - 1, top + side - 1], fill=COLOURS[colour])
    return image


def make_dataset(rows: int = 64, *, seed: int = 0, size: int = 28) -> Dataset:
    """``rows`` rows of the task: ``prompt`` (chat messages), ``image`` (a ``datasets.Image`` feature)
    and ``answer`` (the colour's name), the colours taken in turn."""
    names = list(COLOURS)
    colours = [names[row % len(names)] for row in range(rows)]
    dataset = Dataset.from_dict({
        "prompt": [[{"role": "user", "content": QUESTION}] for _ in range(rows)],
        "image": [square_image(colour, size=size, seed=seed * 100_003 + row) for row, colour in enumerate(colours)],
        "answer": colours,
    })
    return dataset.cast_column("image", Image())


def colour_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the last ``<answer>...</answer>`` holds the square's colour, else 0.0.

    >>> colour_reward(["<answer>red</answer>", "<answer>blue</answer>", "red"], ["red"] * 3)
    [1.0, 0.0, 0.0]
    """
    rewards = []
    for completion, reference in zip(completions, answer, strict=True):
        matches = _ANSWER_RE.findall(completion_text(completion))
        rewards.append(1.0 if matches and matches[-1] == reference else 0.0)
    return rewards
