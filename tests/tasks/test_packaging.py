"""The built wheel carries the tiny model, and the model loads from the installed location."""

import subprocess
import sys
import zipfile

import pytest

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_wheel_contains_the_model_and_loads_it_from_the_install(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(tmp_path / "dist"), str(ROOT)],
        check=True, capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("grpo_lab-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for name in ["model.safetensors", "config.json", "tokenizer.json", "chat_template.jinja"]:
        assert f"grpo_lab/tasks/tiny_model/{name}" in names
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
    )
    script = (
        "import grpo_lab.tasks as t, transformers as tr;"
        "print(t.default_task().model);"
        "tr.AutoModelForCausalLM.from_pretrained(t.default_task().model);"
        "tr.AutoTokenizer.from_pretrained(t.default_task().model)"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True,
        env={"PYTHONPATH": str(target), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}, cwd=tmp_path,
    )
    assert result.stdout.strip().startswith(str(target))
