"""The command line: the demo end to end, with the option spellings the other commands use."""

import json

import pandas as pd
import pytest

from grpo_lab.cli.commands import main
from tests.conftest import without_root_write_override


def test_demo_trains_saves_and_reports_with_config_style_option_names(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--max_steps", "2", "--eval_size", "8", "--output_dir", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["steps"] == 2 and report["before"]["num_prompts"] == 8 == report["after"]["num_prompts"]
    assert report["improvement_points"] == pytest.approx(
        100 * (report["greedy_accuracy_after"] - report["greedy_accuracy_before"]), abs=0.01)
    assert len(pd.read_csv(report["history"])) == 2
    assert (out / "model" / "config.json").exists() and (out / "reward_curve.html").exists()


@pytest.mark.parametrize("arguments, message", [
    (["demo", "--max_steps", "0"], "argument --steps/--max_steps: must be at least 1, got 0"),
    (["eval", "--eval_size", "0"], "argument --eval-size/--eval_size: must be at least 1, got 0"),
    (["eval", "--eval_size", "-5"], "argument --eval-size/--eval_size: must be at least 1, got -5"),
    (["eval", "--k", "0"], "argument --k: must be at least 1, got 0"),
    (["eval", "--k", "two"], "argument --k: expected a whole number, got 'two'"),
])
def test_counts_below_one_are_refused_before_any_work(arguments, message, capsys):
    # --max_steps 0 used to train the default 100 steps, --eval_size -5 to evaluate 987 problems,
    # and --eval_size 0 or --k 0 to fail with a traceback after the model had loaded
    with pytest.raises(SystemExit) as stopped:
        main(arguments)
    assert stopped.value.code == 2 and capsys.readouterr().err.splitlines()[-1].endswith(f"error: {message}")


REWARDS = '''
CALLS = []


def fails_from_second_call(completions, **kwargs):
    CALLS.append(1)
    if len(CALLS) >= 2:  # and again when the call is retried
        raise ValueError("bad completion in a reward function")
    return [0.0] * len(completions)
'''


def test_train_imports_rewards_beside_the_recipe_and_a_failing_reward_shows_its_traceback(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "my_rewards.py").write_text(REWARDS)
    (recipes / "r.yaml").write_text(
        "reward_funcs:\n  - grpo_lab.tasks.addition:correctness_reward\n  - my_rewards:fails_from_second_call\n"
        f"max_steps: 3\nper_device_train_batch_size: 8\nnum_generations: 4\nmax_completion_length: 8\n"
        f"output_dir: {tmp_path / 'out'}\n"
    )
    command = [str(Path(sys.executable).parent / "grpo-lab"), "train", str(recipes / "r.yaml")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    failed = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert failed.returncode == 1
    assert "Traceback" in failed.stderr and "my_rewards.py" in failed.stderr
    assert "bad completion in a reward function" in failed.stderr.splitlines()[-1]
    assert [json.loads(line)["step"] for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()] == [1]
    # a directory that is not a checkpoint is one line, said before the model loads (this recipe's
    # model does not exist: loading it would fail with another error)
    (recipes / "no_model.yaml").write_text(f"model: {tmp_path / 'no_model'}\n")
    usage = subprocess.run([command[0], "train", str(recipes / "no_model.yaml"),
                            "--resume_from", str(tmp_path / "out")],
                           cwd=tmp_path, env=env, capture_output=True, text=True)
    assert usage.returncode == 2 and "Traceback" not in usage.stderr
    assert usage.stderr.splitlines()[-1].startswith(f"grpo-lab train: error: {tmp_path / 'out'} is not a complete")


SHADOW_CHECK = """
import sys
from pathlib import Path

from grpo_lab.cli.recipes import build_trainer, import_object

recipe = Path(sys.argv[1])
import_object("my_rewards:fails_from_second_call", (recipe.parent, Path.cwd()))  # as the recipe's reward_funcs
import peft  # first imported now: the installed package, not the peft.py beside the recipe

trainer = build_trainer(recipe, ["--output_dir", sys.argv[2]])
config = trainer.session.engine.unwrapped_model.peft_config["default"]
print(type(config).__module__, config.r, peft.__file__)
"""


def test_a_module_beside_the_recipe_does_not_shadow_an_installed_package(tmp_path):
    import os
    import subprocess
    import sys

    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "my_rewards.py").write_text(REWARDS)
    (recipes / "peft.py").write_text('raise ImportError("the peft.py beside the recipe was imported")\n')
    (recipes / "r.yaml").write_text("reward_funcs:\n  - my_rewards:fails_from_second_call\npeft:\n  r: 4\n"
                                    "max_steps: 1\nreport_to: none\n")
    done = subprocess.run([sys.executable, "-c", SHADOW_CHECK, str(recipes / "r.yaml"), str(tmp_path / "out")],
                          cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    module, rank, location = done.stdout.split()[-3:]
    assert module == "peft.tuners.lora.config" and rank == "4" and "site-packages" in location


def test_export_into_a_folder_that_cannot_be_written_is_one_line_naming_it_and_the_fix(tmp_path):
    import os
    import subprocess
    import sys

    import nbformat

    notebook = nbformat.v4.new_notebook()
    notebook.cells.append(nbformat.v4.new_code_cell(
        "# export\nfrom grpo_lab import GRPOSession\nfrom grpo_lab.tasks import default_task\ntask = default_task()\n"
        "session = GRPOSession(task.model, task.reward_funcs, args=task.config(), train_dataset=task.train_dataset)"))
    nbformat.write(notebook, tmp_path / "n.ipynb")
    (tmp_path / "readonly").mkdir()
    (tmp_path / "readonly").chmod(0o555)
    try:
        for output in ("readonly/train.py", "readonly/scripts/train.py"):
            done = subprocess.run(
                [sys.executable, "-m", "grpo_lab.cli", "export", "n.ipynb", "-o", output], cwd=tmp_path,
                env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
                preexec_fn=without_root_write_override if os.geteuid() == 0 else None,
            )
            assert done.returncode == 2 and "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
            written = output if output.count("/") == 1 else "readonly/scripts"  # the folder the export would create
            assert done.stderr == (
                f"grpo-lab export: error: Cannot write {written} (permission denied): give -o a path in a folder you "
                f"can write to (grpo-lab export n.ipynb -o DIR/train.py), or make {tmp_path / 'readonly'} writable.\n"
            )
        assert os.listdir(tmp_path / "readonly") == []
    finally:
        (tmp_path / "readonly").chmod(0o755)


@pytest.mark.parametrize("entries, message", [
    ("  - 3\n", "reward_funcs entry #0 (3) is an int, not a string; give each entry as 'module:function' text, "
                "e.g. '- my_rewards:length_reward'."),
    ("  - grpo_lab.tasks.addition:correctness_reward\n  - my_rewards: length_reward\n",
     "reward_funcs entry #1 ({'my_rewards': 'length_reward'}) is a dict, not a string; give each entry as "
     "'module:function' text, e.g. '- my_rewards:length_reward' (YAML reads '- my_rewards: length_reward' as a "
     "mapping: write '- my_rewards:length_reward', without the space)."),
    ("  my_rewards: length_reward\n", "reward_funcs must be a list of 'module:function' entries, one per line "
                                      "starting with '- ', got a dict: {'my_rewards': 'length_reward'}."),
])
def test_train_names_a_reward_entry_that_is_not_a_string_with_its_type_and_the_fix(tmp_path, capsys, entries, message):
    (tmp_path / "r.yaml").write_text(f"reward_funcs:\n{entries}")
    assert main(["train", str(tmp_path / "r.yaml")]) == 2
    assert capsys.readouterr().err == f"grpo-lab train: error: {tmp_path / 'r.yaml'}: {message}\n"
