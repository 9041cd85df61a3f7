"""``grpo-lab doctor``: the probe of a recipe's run or of a training script's, without training."""

import json
from pathlib import Path

from grpo_lab.cli import main

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
