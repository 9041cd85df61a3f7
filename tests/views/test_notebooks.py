"""Every notebook runs top to bottom headlessly (a real kernel through nbclient), widgets included."""

import shutil
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
WIDGET = "application/vnd.jupyter.widget-view+json"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path, tmp_path):
    notebook = nbformat.read(path, as_version=4)
    shutil.copy(path, tmp_path / path.name)
    NotebookClient(
        notebook, timeout=600, kernel_name="python3", store_widget_state=True,
        resources={"metadata": {"path": str(tmp_path)}},
    ).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    if "session.show()" in "".join(cell.source for cell in notebook.cells):
        assert any(WIDGET in o.get("data", {}) for o in outputs)
        assert notebook.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]


def test_there_are_notebooks():
    assert [p.name for p in NOTEBOOKS] == ["01_quickstart.ipynb", "02_anatomy_of_a_step.ipynb",
                                           "03_experiments.ipynb"]


@pytest.mark.parametrize("name", ["01_quickstart.ipynb", "03_experiments.ipynb"])
def test_notebooks_export_to_a_launchable_script(tmp_path, name):
    from grpo_lab.export import export_notebook

    script = export_notebook(ROOT / "notebooks" / name, tmp_path / "train.py")
    source = script.read_text()
    compile(source, str(script), "exec")
    assert "GRPOTrainer(" in source and "session.show()" not in source and "session.run(" not in source
    assert ".fork(" not in source and ".what_if(" not in source  # notebook experiments stay in the notebook
