"""``grpo-lab doctor``: the probe of a recipe's run or of a training script's, without training."""

import json
import os
import subprocess
import sys
from pathlib import Path

from grpo_lab.cli.commands import main

ROOT = Path(__file__).resolve().parent.parent


def _report(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_a_recipe_with_completions_cut_short_is_an_error_and_nothing_trains(tmp_path, capsys):
    out = tmp_path / "run"
    status = main(["doctor", str(ROOT / "examples" / "recipe.yaml"), "--max_completion_length", "3",
                   "--output_dir", str(out), "--json"])
    report = _report(capsys)
    assert status == 1
    truncation = next(f for f in report["findings"] if f["code"] == "truncation")
    assert truncation["severity"] == "error" and truncation["fix"].startswith("max_completion_length=")
    assert "1 error" in report["summary"]
    assert not list(out.glob("checkpoint-*")) and not (out / "metrics.jsonl").exists()


def test_the_recipe_as_shipped_has_no_error_and_prints_the_findings_as_text(tmp_path, capsys):
    status = main(["doctor", str(ROOT / "examples" / "recipe.yaml"), "--output_dir", str(tmp_path / "run")])
    printed = capsys.readouterr().out
    assert status == 0 and printed.startswith("Findings(") and "[error]" not in printed


def test_a_trl_script_runs_up_to_train_which_probes_instead(task, tmp_path, capsys):
    out = tmp_path / "run"
    script = ROOT / "examples" / "trl_scripts" / "prompts_two_rewards_eval.py"
    status = main(["doctor", str(script), "--model", task.model, "--output_dir", str(out), "--json"])
    report = _report(capsys)
    assert status == (1 if any(f["severity"] == "error" for f in report["findings"]) else 0)
    assert report["summary"] and not (out / "trainer_state.json").exists() and not list(out.glob("checkpoint-*"))


def test_a_script_that_never_trains_and_a_wrong_target_are_named(tmp_path, capsys):
    script = tmp_path / "no_training.py"
    script.write_text("print('building nothing')\n")
    assert main(["doctor", str(script)]) == 2
    assert "ended without calling grpo_lab's GRPOTrainer.train()" in capsys.readouterr().err
    assert main(["doctor", str(tmp_path / "notes.txt")]) == 2
    assert "neither a recipe (.yaml) nor a training script (.py)" in capsys.readouterr().err
    assert main(["doctor", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml: no such file" in capsys.readouterr().err


def test_a_script_that_fails_or_exits_before_train_is_status_2_not_a_finding(tmp_path, capsys):
    raising = tmp_path / "raising.py"
    raising.write_text("import json\njson.loads('{not json')\n")
    assert main(["doctor", str(raising)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "JSONDecodeError" in err and "raised before its GRPOTrainer.train()" in err
    exiting = tmp_path / "exiting.py"
    exiting.write_text("import sys\nsys.exit(3)\n")
    assert main(["doctor", str(exiting)]) == 2
    assert "exited (status 3) before calling GRPOTrainer.train()" in capsys.readouterr().err


def test_json_output_is_the_one_object_on_stdout_in_a_fresh_process(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "grpo_lab.cli", "doctor", str(ROOT / "examples" / "recipe.yaml"), "--output_dir",
         str(tmp_path / "run"), "--json"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["summary"]  # the whole of stdout parses: library notices went to stderr


def test_train_with_doctor_stop_ends_with_the_findings_and_the_cli_fix(tmp_path, capsys):
    status = main(["train", str(ROOT / "examples" / "recipe.yaml"), "--max_completion_length", "3", "--doctor", "stop",
                   "--output_dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert status == 1 and "grpo-lab train: doctor='stop'" in err and "[error] truncation:" in err
    assert "pass --doctor warn" in err and not list((tmp_path / "run").glob("checkpoint-*"))


def test_a_script_that_catches_exceptions_around_train_runs_nothing_after_it(tmp_path, capsys):
    # grpo-lab doctor stops a script at train(): an `except Exception` there does not catch it, so the
    # script's code after train() (here, a save over the user's model) does not run; a finally block that
    # saves is refused too
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "model.safetensors").write_bytes(b"the user's trained weights")
    script = tmp_path / "guarded.py"
    script.write_text(
        "from pathlib import Path\n"
        "from grpo_lab import GRPOConfig, GRPOTrainer\n"
        "from grpo_lab.tasks import default_task\n"
        "task = default_task()\n"
        f"trainer = GRPOTrainer(task.model, task.reward_funcs, train_dataset=task.train_dataset,\n"
        f"                      args=task.config(output_dir={str(tmp_path / 'run')!r}, max_steps=2))\n"
        "try:\n"
        "    try:\n"
        "        trainer.train()\n"
        "    except Exception as error:\n"
        f"        Path({str(tmp_path / 'caught.txt')!r}).write_text(repr(error))\n"
        f"    trainer.save_model({str(saved)!r})\n"
        "finally:\n"
        f"    trainer.save_model({str(saved)!r})\n"
    )
    assert main(["doctor", str(script), "--json"]) in (0, 1)
    assert _report(capsys)["summary"]
    assert not (tmp_path / "caught.txt").exists()
    assert [p.name for p in saved.iterdir()] == ["model.safetensors"]
    assert (saved / "model.safetensors").read_bytes() == b"the user's trained weights"
