"""The command line: the demo end to end, with the option spellings the other commands use."""

import json

import pandas as pd
import pytest

from grpo_lab.cli import main


def test_demo_trains_saves_and_reports_with_config_style_option_names(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--max_steps", "2", "--eval_size", "8", "--output_dir", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["steps"] == 2 and report["before"]["num_prompts"] == 8 == report["after"]["num_prompts"]
    assert report["improvement_points"] == pytest.approx(100 * (report["greedy_accuracy_after"] - report["greedy_accuracy_before"]), abs=0.01)
    assert len(pd.read_csv(report["history"])) == 2
    assert (out / "model" / "config.json").exists() and (out / "reward_curve.html").exists()
