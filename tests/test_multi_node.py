"""The shipped multi-node config (examples/accelerate_configs/multi_node_ddp.yaml) run for real: two
"machines" on loopback, one process each (``--num_machines 2``, ranks 0 and 1, the main process at
127.0.0.1). It trains, checkpoints, resumes, and reproduces the one-machine two-process run bitwise:
the same world size runs the same collectives."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import launch_two
from tests.golden import runs

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "accelerate_configs" / "multi_node_ddp.yaml"

SCRIPT = """
import json, sys
from grpo_lab import GRPOTrainer
from grpo_lab.tasks import default_task
from tests.golden.runs import weights_digest
task = default_task(eval_size=4)
trainer = GRPOTrainer(task.model, task.reward_funcs, train_dataset=task.train_dataset,
                      args=task.config(max_steps=6, output_dir=sys.argv[1], save_steps=3, report_to="none"))
trainer.train(resume_from_checkpoint=sys.argv[3] if len(sys.argv) > 3 else None)
if trainer.accelerator.is_main_process:
    rows = [{k: v for k, v in row.items() if k != "step_time"} for row in trainer.session.history.to_dict("records")]
    world = trainer.accelerator.num_processes
    result = {"history": rows, "weights_sha256": weights_digest(trainer.model), "world": world}
    json.dump(result, open(sys.argv[2], "w"))
trainer.close()  # as a script should: see GRPOTrainer.close
"""


def _two_machines(tmp_path: Path, *args: str) -> None:
    """Run the script as machine 0 and machine 1 of a two-machine job, on this machine's loopback."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # one torch thread a process, as the one-machine record ran (torchrun sets it only for several processes a node)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    machines = [
        subprocess.Popen(
            [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIG), "--num_processes", "2",
             "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
             str(tmp_path / "run.py"), *args],
            env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [machine.communicate(timeout=600)[0] for machine in machines]
    for rank, (machine, output) in enumerate(zip(machines, outputs)):
        assert machine.returncode == 0, f"machine {rank}:\n{output[-4000:]}"


def _one_machine_two_processes(tmp_path: Path) -> dict:
    """The same run on one machine, two processes: the golden run ``trainer_2proc`` (this script without its
    checkpoints, which leave a run as it was) as recorded, where it was recorded on a machine like this one
    (test_golden.py checks that it reproduces); else run here."""
    recorded = runs.recorded("trainer_2proc", threads=1)  # the launched processes run one thread each
    if recorded is not None:
        return recorded
    one_machine = launch_two("--multi_gpu", "--mixed_precision", "no", "--dynamo_backend", "no")
    done = subprocess.run([*one_machine, "run.py", str(tmp_path / "one"), str(tmp_path / "one.json")], cwd=tmp_path,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                          capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((tmp_path / "one.json").read_text())


@pytest.mark.slow
def test_two_machines_on_loopback_train_checkpoint_resume_and_track_one_machine(tmp_path):
    (tmp_path / "run.py").write_text(SCRIPT)
    reference = _one_machine_two_processes(tmp_path)

    _two_machines(tmp_path, str(tmp_path / "run"), str(tmp_path / "two.json"))
    two = json.loads((tmp_path / "two.json").read_text())
    assert two["world"] == 2 and len(two["history"]) == 6
    assert two["history"] == reference["history"] and two["weights_sha256"] == reference["weights_sha256"]
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6"]

    _two_machines(tmp_path, str(tmp_path / "resumed"), str(tmp_path / "resumed.json"),
                  str(tmp_path / "run" / "checkpoint-3"))
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert resumed["history"] == reference["history"] and resumed["weights_sha256"] == reference["weights_sha256"]
