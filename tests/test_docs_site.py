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

from grpo_lab.config.grpo_config import GRPOConfig
from tests.views.lab import chromium, missing_browser, new_page

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs"))
from execute_notebooks import NOTEBOOKS, execute  # noqa: E402

WIDGET = "application/vnd.jupyter.widget-view+json"
SCREENSHOTS = {"site-home.png": "index.html", "site-config-reference.png": "reference/config.html"}


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """The notebooks, executed once for this module: {name: executed notebook}, written into one folder."""
    folder = tmp_path_factory.mktemp("notebooks")
    return folder, {path.name: execute(path, folder) for path in NOTEBOOKS}


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
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
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
    for field in dataclasses.fields(GRPOConfig):
        assert f"<code>{field.name}</code>" in page, field.name
    assert "Change: <strong>live</strong>" in page and "Change: <strong>build</strong> (model)" in page


@pytest.mark.slow
def test_the_api_reference_shows_the_docstrings(site):
    session = (site / "reference" / "session.html").read_text()
    assert "GRPOSession" in session and "what_if" in session and "doctor" in session
    assert "compute_advantages" in (site / "reference" / "ops.html").read_text()
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
def test_chromium_reads_the_site_offline_and_takes_its_screenshots(served):
    """Every request the home page, the config reference and a tutorial make goes to the site itself
    (no font, script or style from a CDN), search works offline, and the screenshots in docs/images/ are
    taken from this build."""
    with chromium() as browser, new_page(browser, width=1280, height=900) as page:
        requests = []
        page.on("request", lambda request: requests.append(request.url))
        for image, path in SCREENSHOTS.items():
            page.goto(f"{served}/{path}", wait_until="networkidle")
            page.screenshot(path=str(ROOT / "docs" / "images" / image))
        page.goto(f"{served}/tutorials/01_quickstart.html", wait_until="networkidle")
        page.goto(f"{served}/index.html", wait_until="networkidle")
        page.keyboard.press("/")
        page.keyboard.type("num_generations")
        page.wait_for_selector(".md-search-result__item", timeout=15_000)
    assert requests and all(url.startswith(served) for url in requests), \
        [url for url in requests if not url.startswith(served)]
