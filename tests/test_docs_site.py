"""The documentation site: every notebook runs top to bottom in a real kernel (widgets included), the
site builds from those executed notebooks in strict mode (a broken link or reference fails it), its
pages show what they promise, and Chromium, reading the built site over 127.0.0.1, fetches nothing
from elsewhere and takes the screenshots kept in docs/images/."""

import dataclasses
import functools
import http.server
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from nbclient.exceptions import CellExecutionError

from grpo_lab.config.field_rules import rule_of
from grpo_lab.config.grpo_config import GRPOConfig
from tests.views.lab import chromium, missing_browser, new_page

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs"))
from execute_notebooks import NOTEBOOKS, execute  # noqa: E402

WIDGET = "application/vnd.jupyter.widget-view+json"
SCREENSHOTS = {"site-home.png": "index.html", "site-config-reference.png": "reference/config.html"}
"""Taken from every build; written into docs/images/ (the committed ones) with GRPO_LAB_DOCS_IMAGES=1."""


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """The notebooks, executed once for this module into one folder: (folder, {name: the executed
    notebook, or the error a cell raised})."""
    folder = tmp_path_factory.mktemp("notebooks")
    results = {}
    for path in NOTEBOOKS:
        try:
            results[path.name] = execute(path, folder)
        except CellExecutionError as error:
            results[path.name] = error
    return folder, results


@pytest.fixture(scope="module")
def site(executed, tmp_path_factory):
    folder = tmp_path_factory.mktemp("site")
    env = {**os.environ, "GRPO_LAB_DOCS_NOTEBOOKS": str(executed[0]), "DISABLE_MKDOCS_2_WARNING": "true",
           "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(folder)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("name", [path.name for path in NOTEBOOKS])
def test_notebook_executes(executed, name):
    notebook = executed[1][name]
    assert not isinstance(notebook, CellExecutionError), str(notebook)
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    if "session.show()" in "".join(cell.source for cell in notebook.cells):
        assert any(WIDGET in o.get("data", {}) for o in outputs)
        assert notebook.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]


@pytest.mark.slow
def test_the_site_builds_strict_with_every_page_of_its_navigation(site):
    for page in ["index.html", "guides/session.html", "explanations/grpo-step.html", "reference/config.html",
                 "reference/session.html", "reference/cli.html", "metrics.html", "troubleshooting.html",
                 *(f"tutorials/{path.stem}.html" for path in NOTEBOOKS)]:
        assert (site / page).is_file(), page


@pytest.mark.slow
def test_the_tutorials_show_the_notebooks_outputs_and_no_widget_that_needs_a_kernel(site, executed):
    page = (site / "tutorials" / "01_quickstart.html").read_text()
    assert "grpo-static-fallback" in page and "Not live: a picture of the curves as of step" in page
    assert WIDGET not in page and "widget-state+json" not in page
    assert "RunSummary" in page and "<table" in page  # the cells' own outputs: a run's summary, tables


@pytest.mark.slow
def test_the_config_reference_lists_every_field_with_its_change_rule(site):
    page = (site / "reference" / "config.html").read_text()
    implemented = [f.name for f in dataclasses.fields(GRPOConfig) if not rule_of(f).trainer_argument]
    for name in implemented:  # a heading of its own, with its rule linked to the rules' explanation
        assert f'<h3 id="{name}">' in page, name
    assert '<h2 id="change-rules">' in page and 'change: <a href="#change-rules">live</a>' in page
    assert 'change: <a href="#change-rules">build</a> (model)' in page
    assert "<td><code>push_to_hub</code></td>" in page  # transformers' other fields, in the table


@pytest.mark.slow
def test_the_api_reference_shows_the_docstrings(site):
    session = (site / "reference" / "session.html").read_text()
    for member in ("generate", "what_if", "doctor", "fork"):
        assert f'id="grpo_lab.session.session.GRPOSession.{member}"' in session, member
    assert ":func:" not in session  # Sphinx roles shown as the code they name (docs/hooks.py)
    ops = (site / "reference" / "ops.html").read_text()
    assert 'id="grpo_lab.ops.advantages.compute_advantages"' in ops and "sum_then_normalize" in ops
    trainer = (site / "reference" / "trainer.html").read_text()
    assert 'id="grpo_lab.trainer.trainer.GRPOTrainer.evaluate"' in trainer  # inherited members shown
    assert "vllm-serve" in (site / "reference" / "cli.html").read_text()


@pytest.fixture(scope="module")
def served(site):
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.slow
@pytest.mark.skipif(missing_browser() is not None, reason=str(missing_browser()))
def test_chromium_reads_the_site_offline_and_takes_its_screenshots(served, tmp_path):
    """Every request the home page, the config reference and a tutorial make goes to the site itself
    (no font, script or style from a CDN), search works offline, and the screenshots in docs/images/ are
    taken from this build (``GRPO_LAB_DOCS_IMAGES=1`` writes them over the committed ones)."""
    folder = ROOT / "docs" / "images" if os.environ.get("GRPO_LAB_DOCS_IMAGES") == "1" else tmp_path
    with chromium() as browser, new_page(browser, width=1280, height=900) as page:
        requests = []
        page.on("request", lambda request: requests.append(request.url))
        for image, path in SCREENSHOTS.items():
            page.goto(f"{served}/{path}", wait_until="networkidle")
            page.screenshot(path=str(folder / image))
            assert (folder / image).stat().st_size > 20_000  # a drawn page, not a blank one
        page.goto(f"{served}/tutorials/01_quickstart.html", wait_until="networkidle")
        page.goto(f"{served}/index.html", wait_until="networkidle")
        page.keyboard.press("/")
        page.keyboard.type("num_generations")
        page.wait_for_selector(".md-search-result__item", timeout=15_000)
    assert requests and all(url.startswith(served) for url in requests), \
        [url for url in requests if not url.startswith(served)]
