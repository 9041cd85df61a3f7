"""Shared fixtures: the embedded task on the shipped tiny model, with a small, fast configuration."""

import importlib.util
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SMALL = dict(
    num_generations=4,
    per_device_train_batch_size=8,
    max_completion_length=8,
    learning_rate=1e-3,
    max_steps=10,
    logging_steps=1,
    gradient_checkpointing=False,
    seed=0,
    report_to="none",
)
"""A configuration small enough that one optimizer step takes a fraction of a second on a CPU."""


@pytest.fixture(scope="session")
def task():
    from grpo_lab.tasks import default_task

    return default_task(eval_size=16)


@pytest.fixture
def make_session(task, tmp_path):
    from grpo_lab import GRPOSession

    def make(reward_funcs=None, train_dataset=None, model=None, processing_class=None, **overrides):
        config = task.config(**{**SMALL, "output_dir": str(tmp_path / "out"), **overrides})
        return GRPOSession(
            task.model if model is None else model,
            task.reward_funcs if reward_funcs is None else reward_funcs,
            args=config,
            train_dataset=task.train_dataset if train_dataset is None else train_dataset,
            eval_dataset=task.eval_dataset,
            processing_class=processing_class,
        )

    return make


def pytest_collection_modifyitems(config, items):
    """Tests marked ``vllm`` run in the vLLM environment (``make test-vllm``); elsewhere they are
    deselected (reported as such), not skipped: vLLM cannot be installed beside this transformers."""
    if importlib.util.find_spec("vllm") is not None:
        return
    deselected = [item for item in items if item.get_closest_marker("vllm")]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not item.get_closest_marker("vllm")]
