"""Golden runs: fixed training runs whose full history and final weights are kept as test data, so
that a change meant to leave behaviour alone (a restructure) can be checked bit for bit.

    python -m tests.golden.runs record   # records this machine's runs (only for an intended change)

Three runs: 20 session steps of the embedded task with its defaults; 20 with LoRA, beta 0.04,
num_iterations 2, loss_type "cispo" (epsilon_high 5) and gradient accumulation 2; and 6 trainer steps on 2
processes. Each record holds the history (step times left out), a SHA-256 of the final trainable
weights, and the machine facts that decide the floating-point results (torch version, CPU
capability, thread count, and the CPU itself: two CPUs with the same instruction set can still round
differently). A run's file keeps one record per kind of machine it was recorded on; ``record``
replaces this machine's and keeps the others. A record without the CPU fact was made before CPUs
were told apart: it stands for the machines with its other facts that have no record of their own.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TIMINGS = {"step_time"}

SESSION_RUNS = {
    "defaults": {},
    "lora_cispo": dict(beta=0.04, num_iterations=2, loss_type="cispo", epsilon_high=5.0, gradient_accumulation_steps=2),
}

TRAINER_SCRIPT = """
import json, sys
from grpo_lab import GRPOTrainer
from grpo_lab.tasks import default_task
from tests.golden.runs import weights_digest
task = default_task(eval_size=4)
trainer = GRPOTrainer(task.model, task.reward_funcs, train_dataset=task.train_dataset,
                      args=task.config(max_steps=6, output_dir=sys.argv[1], save_steps=500, report_to="none"))
trainer.train()
if trainer.accelerator.is_main_process:
    rows = [{k: v for k, v in row.items() if k != "step_time"} for row in trainer.session.history.to_dict("records")]
    json.dump({"history": rows, "weights_sha256": weights_digest(trainer.model)}, open(sys.argv[2], "w"))
trainer.close()  # as a script should: see GRPOTrainer.close
"""


def cpu() -> str:
    """The CPU, as /proc/cpuinfo names it (vendor, family, model, stepping and name), or as Python's
    platform module does elsewhere."""
    import platform

    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return platform.processor() or platform.machine()
    facts = dict(line.split(":", 1) for line in first.splitlines() if ":" in line)
    facts = {key.strip(): value.strip() for key, value in facts.items()}
    return " / ".join(facts.get(key, "?") for key in ("vendor_id", "cpu family", "model", "stepping", "model name"))


def machine() -> dict:
    import torch

    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(), "cpu": cpu()}


def records(name: str) -> list[dict]:
    """The records of run ``name``, one per kind of machine."""
    kept = json.loads((HERE / f"{name}.json").read_text())
    return kept["records"] if "records" in kept else [kept]  # a file of one record, as first written


def recorded(name: str, threads: int | None = None) -> dict | None:
    """The record of run ``name`` made on a machine like this one (with ``threads`` torch threads: by
    default this process's), or None. A record without the CPU fact stands for the machines with its
    other facts where no record names the CPU (see the module docstring)."""
    here = machine()
    if threads is not None:
        here["threads"] = threads
    kept = records(name)
    exact = [record for record in kept if record["machine"] == here]
    if exact:
        return exact[0]
    without_cpu = {key: value for key, value in here.items() if key != "cpu"}
    return next((record for record in kept if record["machine"] == without_cpu), None)


def weights_digest(model) -> str:
    """SHA-256 over the trainable parameters' names, shapes and bytes, in name order."""
    import torch

    digest = hashlib.sha256()
    for name, parameter in sorted(model.named_parameters()):
        if parameter.requires_grad:
            tensor = parameter.detach().to("cpu", torch.float32).contiguous()
            digest.update(name.encode())
            digest.update(str(tuple(tensor.shape)).encode())
            digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


def session_run(name: str, output_dir: str) -> dict:
    from grpo_lab import GRPOSession
    from grpo_lab.tasks import default_task

    task = default_task(eval_size=4)
    edits = SESSION_RUNS[name]
    peft_config = None
    if name == "lora_cispo":
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    session = GRPOSession(task.model, task.reward_funcs, train_dataset=task.train_dataset, peft_config=peft_config,
                          args=task.config(max_steps=20, output_dir=output_dir, report_to="none", **edits))
    session.run(20, progress=False)
    rows = [{k: v for k, v in row.items() if k not in TIMINGS} for row in session.history.to_dict("records")]
    return {"history": rows, "weights_sha256": weights_digest(session.model)}


def trainer_run(output_dir: str) -> dict:
    out = Path(output_dir) / "golden.json"
    script = Path(output_dir) / "run.py"
    script.write_text(TRAINER_SCRIPT)
    from tests.conftest import launch_two

    launch = launch_two("--multi_gpu", "--mixed_precision", "no", "--dynamo_backend", "no")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([*launch, str(script), str(Path(output_dir) / "run"), str(out)],
                          capture_output=True, text=True, env=env, timeout=900, cwd=output_dir)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-4000:])
    return json.loads(out.read_text())


def run(name: str, output_dir: str) -> dict:
    result = trainer_run(output_dir) if name == "trainer_2proc" else session_run(name, output_dir)
    return {"machine": machine(), **result}


NAMES = (*SESSION_RUNS, "trainer_2proc")


def record() -> None:
    """Record every run on this machine, at one thread (a test worker's), in place of this machine's
    earlier record."""
    import torch

    torch.set_num_threads(1)
    for name in NAMES:
        with tempfile.TemporaryDirectory() as scratch:
            new = run(name, scratch)
        kept = [old for old in records(name) if old["machine"] != new["machine"]]
        (HERE / f"{name}.json").write_text(json.dumps({"records": [*kept, new]}, indent=1) + "\n")
        print("recorded", name, "on", new["machine"])


if __name__ == "__main__":
    if sys.argv[1:] != ["record"]:
        sys.exit(__doc__)
    record()
