"""Shared fixtures: the embedded task on the shipped tiny model, with a small, fast configuration."""

import importlib.util
import os
import shutil
import socket
import sys
import tempfile

import pytest

from tests.suite_timing import (  # noqa: F401  (hooks: where the suite's time goes)
    pytest_addoption, pytest_configure, pytest_runtest_logreport, pytest_runtest_makereport, pytest_runtest_setup,
    pytest_terminal_summary,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # One core per worker (`pytest -n 2` on two cores): torch's threads of two workers on the same cores
    # spin against each other, which made a parallel run slower than a serial one. Processes a test starts
    # inherit it; a test whose numbers depend on the thread count sets its own (test_golden.py).
    os.environ["OMP_NUM_THREADS"] = "1"
TRACKIO_DIR = tempfile.mkdtemp(prefix="grpo_lab_tests_trackio_")
os.environ["TRACKIO_DIR"] = TRACKIO_DIR  # trackio reads it once, when imported: not the user's own store
COMET_DIR = tempfile.mkdtemp(prefix="grpo_lab_tests_comet_")
# comet_ml, once imported, may write offline archives for experiments it starts itself: never into the repository
os.environ.setdefault("COMET_OFFLINE_DIRECTORY", COMET_DIR)


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(TRACKIO_DIR, ignore_errors=True)
    shutil.rmtree(COMET_DIR, ignore_errors=True)

def launch_two(*options: str) -> list[str]:
    """``accelerate launch`` of 2 processes on this machine with ``options``, on a free port:
    accelerate refuses its default port (29500) while anything else on the machine listens there."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return [sys.executable, "-m", "accelerate.commands.launch", *options, "--num_processes", "2", "--num_machines", "1",
            "--main_process_port", str(port)]


def launch_plan(config: str, plan: list[dict], folder, *options: str) -> str:
    """Run ``plan`` (runs as ``tests/sharded_on_cpu.py`` describes them) in one 2-process launch with the
    shipped accelerate ``config`` (a file name under examples/accelerate_configs) and ``options``; the plan
    is written to ``folder``. Returns the launch's stderr."""
    import json
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    plan_file = Path(folder) / "plan.json"
    plan_file.write_text(json.dumps(plan, default=str))
    command = [*launch_two("--config_file", str(root / "examples" / "accelerate_configs" / config), *options),
               str(root / "tests" / "sharded_on_cpu.py"), str(plan_file)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(root)}  # a run may import the tests' rewards
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, env=env,
                          timeout=900)  # a collective missed hangs
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stderr


def without_root_write_override():
    """In the child of a process run as root: give up the capability that lets root write into
    folders whose permissions say read-only (CAP_DAC_OVERRIDE), as any other user is refused."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(24, 1, 0, 0, 0) != 0:  # PR_CAPBSET_DROP, CAP_DAC_OVERRIDE: gone from the program it runs
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP, CAP_DAC_OVERRIDE)")


def run_exported_step(script, workdir) -> dict:
    """Run an exported training script for its one step, with this repository importable (the tests'
    functions live in ``tests``), and return its metrics row without the step time."""
    import json
    import subprocess
    from pathlib import Path

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, str(script), "--output_dir", str(workdir / "run")],
                          capture_output=True, text=True, cwd=workdir, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = [json.loads(line) for line in (workdir / "run" / "metrics.jsonl").read_text().splitlines()]
    return {k: v for k, v in row.items() if k != "step_time"}


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


@pytest.fixture(scope="session")
def tool_model(task, tmp_path_factory, worker_id):
    """The shipped model taught to call add and answer after its result (``tests.test_tools.taught_to_add``):
    a directory with the tokenizer. Teaching it takes half a minute, so it is taught once per run: the
    workers of a parallel run share one directory, the first to come teaches it and the others wait."""
    from filelock import FileLock

    from tests.test_tools import taught_to_add

    shared = tmp_path_factory.getbasetemp() if worker_id == "master" else tmp_path_factory.getbasetemp().parent
    directory = shared / "tool_model"
    taught = directory / "TAUGHT"  # written last: a directory without it is a teaching cut short
    with FileLock(str(directory) + ".lock"):
        if not taught.exists():
            taught_to_add(task.model, directory)
            taught.touch()
    return str(directory)


@pytest.fixture(scope="session")
def untied_bf16(task, tmp_path_factory):
    """The shipped model with an output layer of its own (a copy of the embeddings), in bfloat16: a
    directory for ``cast_lm_head_to_fp32``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(task.model, tie_word_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight.copy_(model.get_input_embeddings().weight)
    directory = tmp_path_factory.mktemp("untied_bf16")
    model.to(torch.bfloat16).save_pretrained(directory)
    AutoTokenizer.from_pretrained(task.model).save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="session")
def tiny_moe(task, tmp_path_factory):
    """A randomly initialised 2-layer Mixtral (4 experts, 2 per token) with the shipped tokenizer: a
    directory. Its config keeps transformers' router_aux_loss_coef (0.001)."""
    from transformers import AutoTokenizer, MixtralConfig, MixtralForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(task.model)
    config = MixtralConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    directory = tmp_path_factory.mktemp("tiny_moe")
    MixtralForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.fixture
def batch(task):
    """A log-prob pass's input: 3 prompts of different lengths (left padded), 4 completions each of 1 to
    6 tokens (right padded, pad tokens after the end). Returns (prompt_ids, prompt_mask,
    completion_ids, completion_mask)."""
    import torch

    from grpo_lab.core.models import load_tokenizer, prepare_tokenizer
    from grpo_lab.rollout.prompts import render_prompts

    tokenizer = prepare_tokenizer(load_tokenizer(task.model))
    texts = render_prompts([task.train_dataset[i]["prompt"] for i in range(2)], tokenizer) + ["12+3="]
    encoded = tokenizer([t for t in texts for _ in range(4)], return_tensors="pt", padding=True,
                        add_special_tokens=False)
    generator = torch.Generator().manual_seed(0)
    completion_ids = torch.randint(3, 200, (len(texts) * 4, 6), generator=generator)
    completion_mask = (torch.arange(6) < torch.tensor([6, 1, 3, 5] * len(texts))[:, None]).long()
    completion_ids = completion_ids.masked_fill(completion_mask == 0, tokenizer.pad_token_id)
    assert encoded["attention_mask"].min() == 0, "the prompts should need padding"
    return encoded["input_ids"], encoded["attention_mask"], completion_ids, completion_mask


def pytest_ignore_collect(collection_path, config):
    """Under ``-m vllm`` (``make test-vllm``) a test file without ``mark.vllm`` in its text holds no vLLM
    test: it is not imported, which takes that suite's collection from 17 s to 7 s."""
    if config.getoption("markexpr") == "vllm" and collection_path.suffix == ".py" \
            and collection_path.name.startswith("test_") and "mark.vllm" not in collection_path.read_text():
        return True
    return None


def pytest_collection_modifyitems(config, items):
    """Files with ``slow`` tests first, so that parallel workers (``make test``: a file to a worker) do
    not end on one long file while the other waits. Tests marked ``vllm`` run in the vLLM environment
    (``make test-vllm``); elsewhere they are deselected (reported as such), not skipped: vLLM cannot be
    installed beside this transformers."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: each file keeps its order
    if importlib.util.find_spec("vllm") is not None:
        return
    deselected = [item for item in items if item.get_closest_marker("vllm")]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not item.get_closest_marker("vllm")]


def pause_at(session, event: str, global_step: int):
    """Hold the thread that emits ``event`` at ``global_step`` until ``resume`` is set: returns
    (paused, resume), two Events. Subscribe after a view, so that it has refreshed by then."""
    import threading

    paused, resume = threading.Event(), threading.Event()

    def pause(name, payload):
        if name == event and session.global_step == global_step and not paused.is_set():
            paused.set()
            resume.wait(120)

    session.on(pause)
    return paused, resume


@pytest.fixture
def offline_wandb(monkeypatch, tmp_path):
    """wandb logging to local files only, under ``tmp_path/wandb``, its process-wide state torn down
    afterwards (flushing its files) so that no test sees another's."""
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    yield wandb
    if wandb.run is not None:  # a run transformers' callback left open, as a script's exit would end it
        wandb.run.finish()
    wandb.teardown()


@pytest.fixture
def mlflow_store(monkeypatch, tmp_path):
    """MLflow logging to a local file store (mlflow-skinny has no database store), its client."""
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    yield mlflow.MlflowClient()
    while mlflow.active_run() is not None:
        mlflow.end_run()
