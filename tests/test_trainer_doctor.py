"""GRPOTrainer's doctor: the preflight probe of GRPOConfig(doctor=...) and the log of every finding in
findings.jsonl (grpo_lab/trainer/doctor.py)."""

import json

import pytest

from grpo_lab.config.grpo_config import GRPOConfig
from grpo_lab.trainer.doctor import DoctorStop
from tests.test_trainer import _trainer


def _logged(path):
    return [json.loads(line) for line in (path / "findings.jsonl").read_text().splitlines()]


def test_doctor_stop_refuses_to_train_on_an_error_and_names_it(task, tmp_path):
    trainer = _trainer(task, tmp_path, max_completion_length=2, doctor="stop")
    with pytest.raises(DoctorStop) as raised:
        trainer.train()
    message = str(raised.value)
    assert "truncation" in raised.value.codes and "[error] truncation:" in message
    assert "doctor='warn'" in message
    assert trainer.session.global_step == 0
    assert list(tmp_path.glob("checkpoint-*")) == [] and not (tmp_path / "metrics.jsonl").exists()
    assert {"step": 0, "source": "doctor", "code": "truncation", "severity": "error"}.items() <= _logged(tmp_path)[
        0].items()


def test_doctor_warn_prints_the_findings_and_trains_with_live_ones_logged(task, tmp_path, capsys):
    trainer = _trainer(task, tmp_path, max_completion_length=2, doctor="warn", max_steps=5)
    trainer.train()
    printed = capsys.readouterr().out
    assert "doctor, before step 1" in printed and "[error] truncation:" in printed
    assert "doctor, at step 5" in printed and "[error] truncation_in_training:" in printed
    assert trainer.session.global_step == 5 and (tmp_path / "checkpoint-5").exists()
    logged = [(entry["step"], entry["source"], entry["code"]) for entry in _logged(tmp_path)]
    assert (0, "doctor", "truncation") in logged and (5, "live", "truncation_in_training") in logged
    assert all(step in (0, 5) for step, _, _ in logged)
    assert all("findings" not in json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines())


def test_doctor_off_by_default_runs_no_probe(task, tmp_path, capsys):
    trainer = _trainer(task, tmp_path, max_steps=2)
    assert trainer.args.doctor == "off"
    trainer.train()
    assert trainer.session.findings == [] and not (tmp_path / "findings.jsonl").exists()
    assert "doctor" not in capsys.readouterr().out


def test_an_unknown_doctor_mode_is_refused():
    with pytest.raises(ValueError, match="doctor='sometimes' is not supported. Allowed values: 'off', 'warn', 'stop'"):
        GRPOConfig(doctor="sometimes")
    assert "grpo_lab only" in GRPOConfig.field_help("doctor")


TWO_PROCESSES = """
import sys

from grpo_lab import GRPOConfig, GRPOTrainer
from grpo_lab.tasks import default_task
from grpo_lab.trainer.doctor import DoctorStop

task = default_task()
config = GRPOConfig(output_dir=sys.argv[1], max_steps=2, per_device_train_batch_size=4, num_generations=4,
                    max_completion_length=2, disable_tqdm=True, doctor="stop")
trainer = GRPOTrainer(task.model, task.reward_funcs, args=config, train_dataset=task.train_dataset)
try:
    trainer.train()
except DoctorStop as error:  # each process's own file: the two share one stdout
    with open(f"{sys.argv[1]}-stop-{trainer.accelerator.process_index}.txt", "w") as report:
        report.write(",".join(error.codes))
trainer.close()
"""


@pytest.mark.slow
def test_doctor_stop_under_two_processes_stops_both_and_prints_once(tmp_path):
    import os
    import subprocess

    from tests.conftest import launch_two

    (tmp_path / "run.py").write_text(TWO_PROCESSES)
    out = tmp_path / "out"
    launch = launch_two("--multi_gpu", "--mixed_precision", "no", "--dynamo_backend", "no")
    done = subprocess.run([*launch, str(tmp_path / "run.py"), str(out)], capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)  # the timeout catches a hang
    assert done.returncode == 0, done.stderr[-4000:]
    stops = [(tmp_path / f"out-stop-{rank}.txt").read_text().split(",") for rank in (0, 1)]
    assert stops[0] == stops[1] and "truncation" in stops[0]  # the main process's decision on both
    assert done.stdout.count("doctor, before step 1") == 1
    assert {entry["source"] for entry in _logged(out)} == {"doctor"} and list(out.glob("checkpoint-*")) == []


def test_a_resume_drops_the_findings_logged_after_its_checkpoint_and_logs_them_once(task, tmp_path):
    _trainer(task, tmp_path, max_completion_length=2, doctor="warn", max_steps=6, save_steps=4).train()
    first = [(entry["step"], entry["source"], entry["code"]) for entry in _logged(tmp_path)]
    assert (5, "live", "truncation_in_training") in first
    with pytest.warns(UserWarning, match=r"findings.jsonl held \d+ row\(s\) logged after step 4"):
        resumed = _trainer(task, tmp_path, max_completion_length=2, doctor="warn", max_steps=6, save_steps=4)
        resumed.train(resume_from_checkpoint=tmp_path / "checkpoint-4")
    again = [(entry["step"], entry["source"], entry["code"]) for entry in _logged(tmp_path)]
    assert [e for e in again if e[0] == 0] == [e for e in first if e[0] == 0]
    assert [step for step, _, _ in again] == sorted(step for step, _, _ in again)
    assert [e for e in again if e[0] > 4] == [e for e in first if e[0] > 4]  # the live ones, once
    assert {e for e in again if e[0] == 4} and all(source == "doctor" for step, source, _ in again if step == 4)
    assert [f.code for f in resumed.session.live_findings].count("truncation_in_training") == 1
