"""Test harness: a JupyterLab server on loopback driven by headless Chromium through Playwright.

Uses the system Chromium (``apt-get install chromium``; Playwright's own browser download is never
needed). All Jupyter, IPython and browser state lives in a temporary directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

CHROMIUM = os.environ.get("CHROMIUM",
                          shutil.which("chromium") or shutil.which("chromium-browser") or "/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
]
# No news toast over the notebook; every cell kept in the page (no virtual scrolling), so that the
# dashboard stays in the DOM while later cells run.
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/apputils-extension:announcements": {"fetchNews": "false"},
    "@jupyterlab/notebook-extension:tracker": {"windowingMode": "none"},
}


def missing_browser() -> str | None:
    """Why the browser tests cannot run here, or None."""
    if not Path(CHROMIUM).exists():
        return f"Chromium not found at {CHROMIUM} (apt-get install chromium, or set CHROMIUM)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install -e '.[dev]')"
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclasses.dataclass
class Lab:
    """A running JupyterLab server: its base URL, token and the folder it serves."""

    base: str
    token: str
    root: Path

    def folder(self, name: str) -> Path:
        """A new folder under the served one (a test's own, for its notebooks and their outputs)."""
        folder = self.root / re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:80]
        folder.mkdir()
        return folder

    def shut_down_kernels(self) -> None:
        """End every kernel the server runs (the notebooks of a test that is over)."""
        for kernel in self._api("GET", "/api/kernels"):
            self._api("DELETE", f"/api/kernels/{kernel['id']}")

    def _api(self, method: str, path: str):
        request = urllib.request.Request(f"{self.base}{path}", method=method,
                                         headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=30) as answer:
            body = answer.read()
        return json.loads(body) if body else None


@contextlib.contextmanager
def jupyter_lab(root_dir: Path, timeout: float = 90, save_widget_state: bool = False):
    """Start JupyterLab serving ``root_dir``; yield a :class:`Lab`; stop it and its kernels.
    ``save_widget_state``: a notebook saves its widgets' state with it (JupyterLab's "Save Widget
    State Automatically"), so that a reopened notebook draws them without a kernel."""
    port, token = _free_port(), secrets.token_hex(16)
    state = Path(tempfile.mkdtemp(prefix="grpo-lab-jupyter-"))
    env = dict(
        os.environ, JUPYTER_RUNTIME_DIR=str(state / "runtime"), JUPYTER_CONFIG_DIR=str(state / "config"),
        JUPYTER_DATA_DIR=str(state / "data"), IPYTHONDIR=str(state / "ipython"), JUPYTER_PLATFORM_DIRS="1",
        XDG_CONFIG_HOME=str(state / "xdg-config"), XDG_CACHE_HOME=str(state / "xdg-cache"),
        XDG_DATA_HOME=str(state / "xdg-data"), HF_HUB_OFFLINE="1",
    )
    (state / "settings").mkdir()
    settings = dict(LAB_SETTINGS)
    if save_widget_state:
        settings["@jupyter-widgets/jupyterlab-manager:plugin"] = {"saveState": True}
    (state / "settings" / "overrides.json").write_text(json.dumps(settings))
    command = [
        sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip", "127.0.0.1", f"--port={port}",
        f"--IdentityProvider.token={token}", "--allow-root", f"--ServerApp.root_dir={root_dir}",
        f"--LabApp.app_settings_dir={state / 'settings'}", "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]
    log = open(state / "lab.log", "w")
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with {server.returncode}:\n"
                                   f"{(state / 'lab.log').read_text()[-3000:]}")
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if time.time() > deadline:
                    raise TimeoutError("jupyter lab did not start") from None
                time.sleep(0.3)
        yield Lab(base, token, Path(root_dir))
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
        shutil.rmtree(state, ignore_errors=True)


@contextlib.contextmanager
def chromium():
    """Headless Chromium (the system one) under Playwright; yields the browser."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        try:
            yield browser
        finally:
            browser.close()


@contextlib.contextmanager
def new_page(browser, width: int = 1400, height: int = 1000):
    """A page in a context of its own (no storage shared with another test's pages)."""
    context = browser.new_context(viewport={"width": width, "height": height})
    try:
        yield context.new_page()
    finally:
        context.close()


def open_notebook(page, server: Lab, notebook: Path, timeout_ms: int = 120_000) -> None:
    """Open ``notebook`` (a path under the served folder) and wait until its kernel is connected and idle."""
    name = notebook.relative_to(server.root).as_posix()
    page.goto(f"{server.base}/lab/tree/{name}?reset&token={server.token}")
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=timeout_ms)
    page.wait_for_function(
        "() => /Idle/.test(document.querySelector('#jp-main-statusbar')?.innerText || '')", timeout=timeout_ms
    )


def run_all(page, attempts: int = 6) -> None:
    """Run > Run All Cells, retried until a prompt shows execution (an early request is dropped)."""
    for _ in range(attempts):
        page.click(".lm-MenuBar-itemLabel:text-is('Run')")
        page.click(".lm-Menu-itemLabel:text-is('Run All Cells')")
        try:
            page.wait_for_function(
                "() => [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')]"
                ".some(p => /\\[[*0-9]+\\]/.test(p.innerText))",
                timeout=10_000,
            )
            return
        except Exception:
            time.sleep(1)
    raise RuntimeError("Run All Cells never started executing")


def all_cells_done(page) -> bool:
    return page.evaluate(
        "() => { const p = [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')].map(e => e.textContent);"
        " return p.length > 0 && p.every(t => /\\[\\d+\\]/.test(t)); }"
    )


def widget_problems(page) -> list[str]:
    """Output texts that mean a widget (or a cell) failed."""
    return page.evaluate(
        "() => [...document.querySelectorAll('.jp-OutputArea-output')].map(e => e.innerText)"
        ".filter(t => /Loading widget|Error displaying widget|Failed to load model|Traceback/i.test(t))"
        ".map(t => t.slice(0, 400))"
    )


def write_notebook(path: Path, cells: list[str]) -> None:
    """A notebook of code cells, with the python3 kernel."""
    import nbformat

    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in cells]
    nbformat.write(notebook, str(path))


def cell(page, index: int):
    return page.locator(".jp-Notebook .jp-Cell").nth(index)


def cell_done(page, index: int) -> bool:
    """Whether code cell ``index`` shows an execution count (it ran and finished)."""
    text = cell(page, index).locator(".jp-InputPrompt").inner_text()
    return bool(re.search(r"\[\d+\]", text))


def run_cell(page, index: int, wait: bool = True, timeout: float = 300) -> None:
    """Run one cell as a user does (click into it, Shift+Enter); wait until it finished."""
    target = cell(page, index)
    target.locator(".jp-InputArea-editor").click()
    page.keyboard.press("Shift+Enter")
    page.wait_for_function(
        "(i) => /\\[[*0-9]+\\]/.test(document.querySelectorAll('.jp-Notebook .jp-Cell')[i]"
        ".querySelector('.jp-InputPrompt').innerText)", arg=index, timeout=30_000,
    )
    if wait:
        deadline = time.time() + timeout
        while not cell_done(page, index):
            if time.time() > deadline:
                raise TimeoutError(f"cell {index} did not finish within {timeout} s")
            time.sleep(0.3)


def wait_for_notebook(page, timeout_ms: int = 120_000) -> None:
    """After a reload: the notebook's cells are drawn (the kernel may still be busy)."""
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=timeout_ms)


def restart_kernel(page, timeout_ms: int = 120_000) -> None:
    """Kernel > Restart Kernel…, confirmed; returns once the new kernel is idle."""
    page.click(".lm-MenuBar-itemLabel:text-is('Kernel')")
    page.locator(".lm-Menu-itemLabel").filter(has_text=re.compile(r"^Restart Kernel…$")).click()
    page.locator(".jp-Dialog button").filter(has_text=re.compile(r"^Restart$")).click()
    page.wait_for_function(
        "() => /Idle/.test(document.querySelector('#jp-main-statusbar')?.innerText || '')", timeout=timeout_ms
    )
