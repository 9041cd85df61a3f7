"""Embedded tasks: a tiny shipped model and a verifiable task it can improve on, fully offline.

>>> from grpo_lab.tasks import default_task
>>> task = default_task()
>>> task.model                      # a local directory for from_pretrained   # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from datasets import Dataset

from grpo_lab.tasks import addition

TINY_MODEL_DIR = Path(__file__).parent / "tiny_model"
"""The shipped model: a Llama-architecture causal LM with its tokenizer and chat template."""

DEMO_CONFIG: dict[str, Any] = dict(
    learning_rate=1e-4,
    num_generations=8,
    per_device_train_batch_size=64,
    max_completion_length=8,
    temperature=1.0,
    beta=0.0,
    loss_type="dapo",
    max_steps=100,
    logging_steps=1,
    save_steps=50,
    gradient_checkpointing=False,
    warmup_ratio=0.0,
    lr_scheduler_type="constant",
    seed=0,
)
"""GRPOConfig overrides under which the shipped model learns the task within minutes on a CPU.

A model this small takes a learning rate a hundred times TRL's default for billion-parameter
models (one step at 2e-3 already wrecks it); gradient checkpointing costs compute and saves no memory that matters here;
completions are ``<answer>N</answer>`` plus EOS (at most 6 tokens), so 8 tokens leave room to fail.
"""


@dataclass
class Task:
    """A task bundle: model path, datasets, reward functions, a tuned config, and an evaluator."""

    name: str
    model: str
    train_dataset: Dataset
    eval_dataset: Dataset
    reward_funcs: list[Callable]
    accuracy_func: Callable
    config_overrides: dict[str, Any] = field(default_factory=dict)

    def config(self, **overrides):
        """A ``GRPOConfig`` tuned for this task; keyword arguments override any field."""
        from grpo_lab.config.grpo_config import GRPOConfig

        return GRPOConfig(**{**self.config_overrides, **overrides})

    def evaluate(self, model, tokenizer, dataset: Dataset | None = None, **kwargs) -> dict:
        """Greedy accuracy, pass@k, sample accuracy, mean reward and mean length on ``dataset``.

        ``dataset`` defaults to the held-out split; keyword arguments go to
        :func:`grpo_lab.tasks.evaluation.evaluate_model` (``k``, ``batch_size``, ``seed`` ...).
        """
        from grpo_lab.tasks.evaluation import evaluate_model

        kwargs.setdefault("max_new_tokens", self.config_overrides.get("max_completion_length", 16))
        return evaluate_model(
            model,
            tokenizer,
            self.eval_dataset if dataset is None else dataset,
            accuracy_func=self.accuracy_func,
            reward_funcs=self.reward_funcs,
            **kwargs,
        )


def default_task(*, conversational: bool = True, seed: int = 0, eval_size: int = 200) -> Task:
    """Two-digit addition on the shipped tiny model (see :mod:`grpo_lab.tasks.addition`).

    ``conversational`` picks TRL's chat-message prompt format (True) or plain text (False); the
    model was warmed up on both. ``seed`` fixes the train/held-out split; ``eval_size`` is the
    number of held-out problems in ``eval_dataset``.
    """
    train, held_out = addition.split_problems(seed=seed)
    return Task(
        name="addition",
        model=str(TINY_MODEL_DIR),
        train_dataset=addition.make_dataset(train, conversational=conversational),
        eval_dataset=addition.make_dataset(held_out[:eval_size], conversational=conversational),
        reward_funcs=[addition.correctness_reward, addition.format_reward],
        accuracy_func=addition.correctness_reward,
        config_overrides=dict(DEMO_CONFIG),
    )


__all__ = ["Task", "default_task", "TINY_MODEL_DIR"]
