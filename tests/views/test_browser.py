"""The dashboard in a real browser: JupyterLab in headless Chromium runs 01_quickstart.ipynb.

Checks that every part rendered, that the curves gain points while ``session.run(50)`` executes
(live, in place), and that the Step button adds one more. Screenshots are written to
``$GRPO_LAB_SCREENSHOTS`` (default: the test's temporary directory).
"""

import os
import shutil
import time
from pathlib import Path

import pytest

from tests.views import lab

ROOT = Path(__file__).resolve().parents[2]
REASON = lab.missing_browser()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=str(REASON))]

POINTS = "() => document.querySelector('.grpo-curves .js-plotly-plot .scatterlayer .trace')?.querySelectorAll('path.point').length ?? 0"


def test_quickstart_dashboard_renders_updates_live_and_steps(tmp_path):
    shots = Path(os.environ.get("GRPO_LAB_SCREENSHOTS", tmp_path / "shots"))
    shots.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "notebooks" / "01_quickstart.ipynb", tmp_path / "quickstart.ipynb")
    with lab.jupyter_lab(tmp_path) as (base, token), lab.browser_page(height=2800) as page:
        lab.open_notebook(page, base, token, "quickstart.ipynb")
        lab.run_all(page)
        seen, deadline = [], time.time() + 600
        while not lab.all_cells_done(page):
            assert time.time() < deadline, "the notebook did not finish within 10 minutes"
            seen.append(page.evaluate(POINTS))
            time.sleep(0.5)
        assert lab.widget_problems(page) == []

        dashboard = page.locator(".grpo-dashboard")
        dashboard.scroll_into_view_if_needed()
        # 1 step by update() + 50 by run(50): 51 points in the reward trace.
        page.wait_for_function(f"() => ({POINTS})() === 51", timeout=30_000)
        growth = sorted(set(n for n in seen if 1 < n < 51))
        assert len(growth) >= 3, f"curves did not grow while run(50) executed: point counts seen {sorted(set(seen))}"
        assert page.locator(".grpo-curves .js-plotly-plot .scatterlayer .trace").count() >= 10
        assert page.locator(".grpo-completions tbody tr").count() == 8  # one group of num_generations
        assert page.locator(".grpo-completions .grpo-token").count() > 8
        assert "rewards per function" in page.locator(".grpo-rewards-view").inner_text()
        assert "next stage: generate()" in page.locator(".grpo-controls").inner_text()
        page.evaluate("() => document.querySelector('.grpo-dashboard').scrollIntoView()")
        dashboard.screenshot(path=str(shots / "dashboard.png"))

        page.locator(".grpo-controls button", has_text="Step").click()
        page.wait_for_function(f"() => ({POINTS})() === 52", timeout=60_000)
        assert "step 52" in page.locator(".grpo-controls").inner_text()
        page.locator(".grpo-curves").screenshot(path=str(shots / "curves_after_step.png"))
        page.locator(".grpo-completions-view").screenshot(path=str(shots / "completions.png"))
