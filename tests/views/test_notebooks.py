"""The notebooks: which there are, their export to a script, and usage errors in a kernel (each notebook
is executed top to bottom, widgets included, by tests/test_docs_site.py, which renders them into the site)."""

import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
WIDGET = "application/vnd.jupyter.widget-view+json"


def test_there_are_notebooks():
    assert [p.name for p in NOTEBOOKS] == ["01_quickstart.ipynb", "02_anatomy_of_a_step.ipynb",
                                           "03_experiments.ipynb", "04_vision.ipynb"]


@pytest.mark.parametrize("name", ["01_quickstart.ipynb", "03_experiments.ipynb"])
def test_notebooks_export_to_a_launchable_script(tmp_path, name):
    from grpo_lab.export import export_notebook

    script = export_notebook(ROOT / "notebooks" / name, tmp_path / "train.py")
    source = script.read_text()
    compile(source, str(script), "exec")
    assert "GRPOTrainer(" in source and "session.show()" not in source and "session.run(" not in source
    assert ".fork(" not in source and ".what_if(" not in source  # notebook experiments stay in the notebook


USAGE_ERRORS = [
    # (the cell, the error it raises, a phrase of the fix its message gives)
    ("session.score()", "StageOrderError", "Call session.generate() first"),
    ("session.config.temperature = -1.0\nsession.step()", "ConfigError", "temperature"),
    ("session.config.temperature = 1.0\n"
     "session.reward_funcs = [lambda completions, **kwargs: [0.0] * (len(completions) - 1)]\n"
     "session.generate()\nsession.score()", "RewardFunctionError", "exactly one number"),
    ("def broken_reward(completions, **kwargs):\n    return [completions[99] for _ in completions]\n\n\n"
     "session.reward_funcs = [broken_reward]\nsession.score()", "RewardFunctionError", "broken_reward"),
]


def _lines(output) -> list[str]:
    """The lines of an error output's traceback as the page shows them (colour codes left out)."""
    return re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(output.get("traceback", []))).splitlines()


@pytest.mark.slow
def test_a_usage_error_in_a_notebook_shows_one_screen_and_tb_shows_its_traceback(tmp_path):
    """In a real kernel, each of three user errors shows its message and fix in a few lines instead of
    a traceback through grpo_lab's internals; ``%tb`` then shows that traceback, and an error of the
    user's own code keeps IPython's full traceback."""
    build = ("from grpo_lab import GRPOSession\nfrom grpo_lab.tasks import default_task\n"
             "task = default_task(eval_size=4)\n"
             "session = GRPOSession(task.model, task.reward_funcs, train_dataset=task.train_dataset, "
             "args=task.config(num_generations=4, per_device_train_batch_size=8, max_completion_length=8, "
             f"output_dir={str(tmp_path)!r}))")
    cells = [build]
    for source, _, _ in USAGE_ERRORS:
        cells += [source, "%tb"]
    cells.append("def divide(x):\n    return x / 0\n\ndivide(1)")
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in cells])
    NotebookClient(notebook, timeout=300, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    assert not [o for o in notebook.cells[0].outputs if o.output_type == "error"]
    for index, (_, name, fix) in enumerate(USAGE_ERRORS):
        error_cell, tb_cell = notebook.cells[1 + 2 * index], notebook.cells[2 + 2 * index]
        [error] = [o for o in error_cell.outputs if o.output_type == "error"]
        assert error.ename == name and fix in error.evalue
        shown = _lines(error)
        wraps_user_code = fix == "broken_reward"
        assert len(shown) <= (12 if wraps_user_code else 6) and fix in "\n".join(shown) and "%tb" in shown[-1], shown
        assert not any("grpo_lab/" in line for line in shown)
        if wraps_user_code:  # the user's own frames, to fix it from
            assert "caused by IndexError: list index out of range" in shown
            assert any("in broken_reward" in line for line in shown)
        full = [line for o in tb_cell.outputs for line in _lines(o) + o.get("text", "").splitlines()]
        assert len(full) > 10 and any("grpo_lab/" in line for line in full) and any(name in line for line in full)
    [own] = [o for o in notebook.cells[-1].outputs if o.output_type == "error"]
    assert own.ename == "ZeroDivisionError" and any("return x / 0" in line for line in _lines(own))
