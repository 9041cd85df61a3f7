"""The dashboard in a real browser: JupyterLab in headless Chromium, driven as a user drives it.

Each test reads what the page shows: point counts and axis ranges of the drawn plots, legends and
axis titles, the text of the views, whether buttons are enabled. Screenshots are written to
``$GRPO_LAB_SCREENSHOTS`` (default: the test's temporary directory); with
``GRPO_LAB_DOCS_IMAGES=1`` the quickstart test also rewrites ``docs/images/dashboard.png``.
"""

import os
import re
import shutil
import time
from pathlib import Path

import pytest

from tests.views import lab

ROOT = Path(__file__).resolve().parents[2]
REASON = lab.missing_browser()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=str(REASON))]

SETUP = """\
from grpo_lab import GRPOSession
from grpo_lab.tasks import default_task

task = default_task(eval_size=4)
session = GRPOSession(task.model, task.reward_funcs, train_dataset=task.train_dataset,
                      args=task.config(per_device_train_batch_size=8, num_generations=4, max_steps=100,
                                       output_dir="outputs/browser"))"""


def slow_setup(seconds: float, max_steps: int = 100) -> str:
    """SETUP with a third reward function that takes ``seconds``, as a verifier may: a step then lasts
    longer than a page sharing the cores with other tests needs to see it (the shipped model alone
    steps in about 0.1 s)."""
    setup = SETUP.replace("max_steps=100", f"max_steps={max_steps}").replace(
        "session = GRPOSession(task.model, task.reward_funcs,",
        f"import time\n\n\ndef waits(completions, **kwargs):\n    time.sleep({seconds})\n"
        "    return [0.0] * len(completions)\n\n\nsession = GRPOSession(task.model, [*task.reward_funcs, waits],")
    assert "waits]" in setup
    return setup


# What a drawn curves plot shows, read from the page: the plot of dashboard ``i`` in page order.
# plotly classes a legend's texts by its id: "legendtext", "legend2text"...
LEGEND_JS = "const LEGEND_TEXT = 'text[class^=\"legend\"][class$=\"text\"]';"

FACTS = """(i) => {
  LEGEND_JS
  const gd = [...document.querySelectorAll('.grpo-curves-plot .js-plotly-plot')][i];
  if (!gd || !gd._fullLayout) return null;
  const outside = [];
  for (const t of gd._fullData) {
    if (t.visible !== true || !t.y) continue;
    const xa = gd._fullLayout[t.xaxis.replace('x', 'xaxis')], ya = gd._fullLayout[t.yaxis.replace('y', 'yaxis')];
    const [y0, y1] = [Math.min(...ya.range), Math.max(...ya.range)];
    const [x0, x1] = [Math.min(...xa.range), Math.max(...xa.range)];
    Array.from(t.y).forEach((v, j) => {
      if (Number.isFinite(v) && (v < y0 || v > y1 || t.x[j] < x0 || t.x[j] > x1)) {
        outside.push(`${t.name}@${t.x[j]}=${v}`);
      }
    });
  }
  const keys = Object.keys(gd.layout);
  return {
    rewardPoints: gd.querySelectorAll('g.subplot.xy path.point').length,
    panels: keys.filter((k) => /^xaxis\\d*$/.test(k)).length,
    legendsWanted: keys.filter((k) => /^legend\\d*$/.test(k)).length,
    legendsDrawn: gd.querySelectorAll('.infolayer > g[class^="legend"]').length,
    legendsFilled: [...gd.querySelectorAll('.infolayer > g[class^="legend"]')]
      .filter((g) => g.querySelector(LEGEND_TEXT)).length,
    xTitles: [...gd.querySelectorAll('.infolayer g[class^="g-x"][class$="title"]')]
      .filter((g) => /optimizer step/.test(g.textContent)).length,
    titles: [...gd.querySelectorAll('.infolayer .annotation-text')].map((a) => a.textContent),
    legendText: [...gd.querySelectorAll(`.infolayer g[class^="legend"] ${LEGEND_TEXT}`)].map((t) => t.textContent),
    outside,
  };
}""".replace("LEGEND_JS", LEGEND_JS)


@pytest.fixture(scope="module")
def jupyter(tmp_path_factory):
    """One JupyterLab server for the module's tests (JupyterLab's default settings); each test opens its
    notebooks in a folder of its own, each notebook in a kernel of its own."""
    with lab.jupyter_lab(tmp_path_factory.mktemp("lab")) as server:
        yield server


@pytest.fixture(scope="module")
def chromium():
    with lab.chromium() as browser:
        yield browser


@pytest.fixture
def workdir(jupyter, request) -> Path:
    """This test's folder on the server; its kernels are shut down when it ends."""
    yield jupyter.folder(request.node.name)
    jupyter.shut_down_kernels()


def save(page, path: Path, timeout: float = 30) -> None:
    """Save the notebook (Ctrl+S) and wait until the file on disk is rewritten."""
    before = path.stat().st_mtime_ns
    page.keyboard.press("Control+s")
    deadline = time.time() + timeout
    while path.stat().st_mtime_ns == before:
        assert time.time() < deadline, f"{path.name} was not saved"
        time.sleep(0.1)


def facts(page, dashboard: int = 0):
    return page.evaluate(FACTS, dashboard)


# The first dashboard's reward band, read from the page: {step: [reward - std, reward + std]}.
REWARD_BAND = """() => {
  const gd = document.querySelector('.grpo-dashboard .grpo-curves-plot .js-plotly-plot');
  const traces = gd._fullData.filter((t) => t.xaxis === 'x');
  const upper = traces.findIndex((t) => t.name.startsWith('± reward_std')), lower = traces[upper - 1];
  const high = traces[upper];
  return Object.fromEntries(Array.from(high.x, (step, j) => [String(step), [lower.y[j], high.y[j]]]));
}"""


def wait_reward_points(page, count: int, dashboard: int = 0, timeout: float = 60) -> dict:
    deadline, seen = time.time() + timeout, None
    while time.time() < deadline:
        seen = facts(page, dashboard)
        # plotly draws a figure's legends after its lines: each row of a panel's legend is one, and has entries
        if seen and seen["rewardPoints"] == count and seen["legendsFilled"] == seen["legendsWanted"]:
            return seen
        time.sleep(0.25)
    raise AssertionError(f"dashboard {dashboard}: expected {count} reward points, the page shows {seen}")


def step_button(page, dashboard: int = 0):
    return page.locator(".grpo-dashboard").nth(dashboard).get_by_role("button", name="Step", exact=True)


def controls_text(page, dashboard: int = 0) -> str:
    return page.locator(".grpo-dashboard").nth(dashboard).locator(".grpo-controls").inner_text()


def test_fresh_kernel_cell_by_cell_a_second_show_and_step_pressed_while_a_cell_runs(jupyter, chromium, workdir):
    lab.write_notebook(workdir / "steps.ipynb", [  # run(3) lasts long enough to press Step while it runs
        slow_setup(0.3), "session.show()", "session.step()", "session.run(3)", "session.show()", "session.run(3)",
        "print('global step', session.global_step)", "session.evaluate(task.eval_dataset)['eval_reward']",
    ])
    with lab.new_page(chromium, height=2400) as page:
        lab.open_notebook(page, jupyter, workdir / "steps.ipynb")
        for index in range(4):  # build, show(), step(), run(3): one cell at a time in a new kernel
            lab.run_cell(page, index)
        shown = wait_reward_points(page, 4)
        assert shown["outside"] == [], shown["outside"]
        assert shown["legendsDrawn"] == shown["legendsWanted"] >= 3  # reward ± std, per function, learning signal
        assert shown["xTitles"] == shown["panels"]
        assert "learning signal" in shown["titles"]

        lab.run_cell(page, 4)  # a second show() of the same session starts complete
        wait_reward_points(page, 4, dashboard=1)

        lab.run_cell(page, 5, wait=False)  # run(3) in a cell; the user presses Step meanwhile
        page.wait_for_function(  # both dashboards say so at once: Step is off and the controls say what runs
            "() => [...document.querySelectorAll('.grpo-dashboard')].every(d => [...d.querySelectorAll('button')]"
            ".some(b => b.textContent.trim() === 'Step' && b.disabled)"
            " && /running/i.test(d.querySelector('.grpo-controls').innerText))", timeout=60_000,
        )
        step_button(page).click(force=True)
        deadline = time.time() + 120
        while not lab.cell_done(page, 5):
            assert time.time() < deadline
            time.sleep(0.3)
        lab.run_cell(page, 6)
        assert "global step 7" in lab.cell(page, 6).locator(".jp-OutputArea").inner_text()  # no extra step
        for dashboard in (0, 1):
            wait_reward_points(page, 7, dashboard)
        page.wait_for_function("() => [...document.querySelectorAll('.grpo-dashboard button')]"
                               ".some(b => b.textContent.trim() === 'Step' && !b.disabled)")

        lab.run_cell(page, 7)  # an evaluation is drawn beside the training reward, in both dashboards
        for dashboard in (0, 1):
            shown = wait_reward_points(page, 8, dashboard)  # 7 steps and the evaluation after step 7
            assert "eval reward" in shown["legendText"], shown["legendText"]
            assert shown["outside"] == []
        assert lab.widget_problems(page) == []


def test_a_reload_mid_run_is_live_again_within_two_updates_from_run_n_and_from_a_cell_arun(jupyter, chromium,
                                                                                             workdir):
    # Runs far longer than a reload can take, ended by the dashboard's Stop; each step lasts longer than the
    # page needs to draw one, on a machine that runs the vLLM suite beside this one too (0.3 s was not).
    setup = slow_setup(0.6, max_steps=2000)
    lab.write_notebook(workdir / "reload.ipynb", [setup, "session.show()", "await session.arun(1000)"])
    with lab.new_page(chromium, height=2400) as page:
        lab.open_notebook(page, jupyter, workdir / "reload.ipynb")
        lab.run_cell(page, 0)
        lab.run_cell(page, 1)
        page.keyboard.press("Control+s")

        # Run N from the dashboard trains on a thread, so the kernel answers a reloaded page at once.
        dashboard = page.locator(".grpo-dashboard").first
        dashboard.locator(".grpo-controls input[type=number]").fill("1000")
        dashboard.locator(".grpo-controls input[type=number]").press("Enter")
        dashboard.get_by_role("button", name="Run N", exact=True).click()
        page.wait_for_function("() => document.querySelectorAll('.grpo-curves-plot g.subplot.xy path.point')"
                               ".length >= 3", timeout=60_000)
        page.reload()
        lab.wait_for_notebook(page)
        assert_caught_up_within_two_updates(page, last_step=1000)
        first = stop_from_the_dashboard(page)
        assert re.search(rf"stopped after {first} step", controls_text(page)), controls_text(page)

        # await session.arun(1000) in a cell trains on a worker thread while the cell awaits: the kernel
        # answers the reloaded page at once, and the dashboard's Stop ends the cell's run between stages.
        lab.run_cell(page, 2, wait=False)
        page.wait_for_function("(n) => document.querySelectorAll('.grpo-curves-plot g.subplot.xy path.point')"
                               ".length >= n", arg=first + 2, timeout=60_000)
        page.keyboard.press("Control+s")
        page.reload()
        lab.wait_for_notebook(page)
        assert_caught_up_within_two_updates(page, last_step=first + 1000)
        stopped = stop_from_the_dashboard(page)
        assert first + 2 <= stopped < first + 1000
        assert lab.widget_problems(page) == []


def test_the_page_shows_user_errors_on_one_screen_the_doctors_causes_first_and_no_red_first_cell(
        jupyter, chromium, workdir):
    zero_reward = SETUP.replace("task.reward_funcs,", "[lambda completions, **kwargs: [0.0] * len(completions)],")
    lab.write_notebook(workdir / "errors.ipynb", [
        SETUP,
        "session.advantages()",  # a stage out of order
        "session.config.temperature = -1.0\nsession.step()",  # a bad value, refused by the next stage
        "session.config.temperature = 1.0\nsession.generate()\nsession.score()\nsession.loss()",  # out of order
        "%tb",
        zero_reward.replace("session = ", "zero = ") + "\nzero.doctor()",
        SETUP.replace("max_steps=100", "max_completion_length=2").replace("session = ", "short = ")
        + "\nshort.doctor()",
    ])
    with lab.new_page(chromium, height=2400) as page:
        lab.open_notebook(page, jupyter, workdir / "errors.ipynb")
        for index in range(7):
            lab.run_cell(page, index)
        # nothing red under the first cell: no dependency's notice on stderr, no error
        first = lab.cell(page, 0)
        red = first.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
        assert red.count() == 0, red.all_inner_texts()
        # each user error is its message and the %tb hint, a screen at most; %tb then shows the traceback
        for index, said in ((1, "advantages() needs"), (2, "temperature"), (3, "loss() needs")):
            shown = lab.cell(page, index).locator(".jp-OutputArea").inner_text()
            assert said in shown and "%tb" in shown, shown
            assert len(shown.strip().splitlines()) <= 12, shown
        traceback = lab.cell(page, 4).locator(".jp-OutputArea").inner_text()
        assert "Traceback" in traceback and len(traceback.splitlines()) > 12
        # the doctor names the cause first: the constant reward, the limit that cuts every answer
        for index, cause in ((5, "reward_constant"), (6, "truncation")):
            table = lab.cell(page, index).locator("table.grpo-findings")
            assert table.locator("tr").nth(1).locator("code").first.inner_text() == cause
        widgets = [text for text in lab.widget_problems(page) if re.search(r"widget|Failed to load model", text)]
        assert widgets == []  # the errors above are this test's own


SIGNED_TOKENS_JS = """(root) => [...root.querySelectorAll('span.grpo-token')].map(span => {
    const value = parseFloat((span.title.split('= ')[1] || 'NaN'));
    return [value, getComputedStyle(span).backgroundColor];
}).filter(([value]) => Number.isFinite(value) && value !== 0)"""
"""Each signed token's value (from its hover text) and its background colour as the page draws it."""


def test_both_signed_token_views_colour_made_likelier_red_under_one_legend(jupyter, chromium, workdir):
    lab.write_notebook(workdir / "colours.ipynb", [
        SETUP,
        "session.step()\nsession.generate(), session.score(), session.advantages(), session.loss()\n"
        "view = session.completions_view()\nview.quantity.value = 'advantage_x_ratio'\nview",
        "from IPython.display import HTML\nHTML(session.what_if(loss_type=['dapo', 'grpo']).heatmap(completions=8))",
    ])
    with lab.new_page(chromium, height=2400) as page:
        lab.open_notebook(page, jupyter, workdir / "colours.ipynb")
        for index in range(3):
            lab.run_cell(page, index)
        legends, tokens = [], []
        for index in (1, 2):
            output = lab.cell(page, index).locator(".jp-OutputArea")
            output.locator("span.grpo-token").first.wait_for(timeout=60_000)
            legends.append(output.locator(".grpo-token-legend").first.inner_text())
            tokens.append(output.evaluate(SIGNED_TOKENS_JS))
        for legend in legends:  # one convention, said the same way in both
            assert "red: made likelier, blue: made less likely" in legend, legend
        signs = {value > 0 for drawn in tokens for value, _ in drawn}
        assert all(tokens) and signs == {True, False}, tokens  # both views colour tokens, of both signs
        for drawn in tokens:  # and draw them as said: positive values red, negative ones blue
            for value, colour in drawn:
                expected = r"rgba?\(214, 39, 40\b" if value > 0 else r"rgba?\(31, 119, 180\b"  # red, blue (any alpha)
                assert re.match(expected, colour), (value, colour)


VLM_SETUP = """\
from grpo_lab import GRPOConfig, GRPOSession
from grpo_lab.tasks.colour_square import colour_reward, make_dataset
from grpo_lab.tasks.tiny_vlm import tiny_vlm

model, processor = tiny_vlm("llava")
session = GRPOSession(model, colour_reward, train_dataset=make_dataset(16), processing_class=processor,
                      args=GRPOConfig(output_dir="outputs/vlm", num_generations=4, per_device_train_batch_size=8,
                                      max_completion_length=6, report_to="none"))"""

# Each thumbnail the page draws: its drawn size, whether the PNG decoded, and its title.
THUMBNAILS_JS = """(output) => [...output.querySelectorAll('img.grpo-thumbnail')].map((img) => ({
  width: img.clientWidth, height: img.clientHeight,
  decoded: img.complete && img.naturalWidth > 0, title: img.title,
}))"""


def test_a_vlm_sessions_completions_view_shows_each_groups_image(jupyter, chromium, workdir):
    lab.write_notebook(workdir / "vlm.ipynb", [
        VLM_SETUP,
        "session.generate()\nview = session.completions_view()\nview",
        "view.group.value = 1",
    ])
    with lab.new_page(chromium, height=1600) as page:
        lab.open_notebook(page, jupyter, workdir / "vlm.ipynb")
        for index in range(2):
            lab.run_cell(page, index)
        output = lab.cell(page, 1).locator(".jp-OutputArea")
        output.locator("img.grpo-thumbnail").first.wait_for(timeout=60_000)
        first = output.evaluate(THUMBNAILS_JS)
        lab.run_cell(page, 2)
        deadline = time.time() + 30
        while (second := output.evaluate(THUMBNAILS_JS)) == first and time.time() < deadline:
            time.sleep(0.25)
        for drawn in (first, second):  # one picture of the group's prompt, decoded, drawn at 96 px, named
            assert len(drawn) == 1 and drawn[0]["decoded"], drawn
            assert (drawn[0]["width"], drawn[0]["height"]) == (96, 96), drawn
            assert drawn[0]["title"] == "image 1 of the prompt, 28 x 28 pixels", drawn
        assert output.locator("span.grpo-token").count() > 0  # beside the group's coloured completions
        page.screenshot(path=str(Path(os.environ.get("GRPO_LAB_SCREENSHOTS", workdir)) / "vlm_completions.png"))


def stop_from_the_dashboard(page) -> int:
    """Press the first dashboard's Stop while a run is going on; wait until the run has ended and the
    curves hold each of its steps; return the step it ended at."""
    stop = page.locator(".grpo-dashboard").first.get_by_role("button", name="Stop", exact=True)
    assert stop.is_enabled()
    stop.click()
    # a reloaded page did not send a running cell, so its prompt does not show the end: the controls do
    page.wait_for_function("() => { const c = document.querySelector('.grpo-controls'); return !/running/"
                           ".test(c.innerText) && [...c.querySelectorAll('button')].some(b => b.textContent.trim()"
                           " === 'Step' && !b.disabled); }", timeout=120_000)
    stopped = wait_step_from_status(page)
    time.sleep(2)
    assert wait_step_from_status(page) == stopped  # ended, not paused
    assert wait_reward_points(page, stopped)["outside"] == []
    return stopped


def test_a_reload_during_a_cell_run_with_saved_widget_state_then_a_kernel_restart(chromium, tmp_path):
    shots = Path(os.environ.get("GRPO_LAB_SCREENSHOTS", tmp_path / "shots"))
    shots.mkdir(parents=True, exist_ok=True)
    lab.write_notebook(tmp_path / "reload.ipynb", [SETUP, "session.show()", "session.run(3)", "session.run(6)"])
    # a server of its own: JupyterLab's "Save Widget State Automatically" is not its default
    with lab.jupyter_lab(tmp_path, save_widget_state=True) as server, lab.new_page(chromium, height=2400) as page:
        lab.open_notebook(page, server, tmp_path / "reload.ipynb")
        for index in range(3):
            lab.run_cell(page, index)
        wait_reward_points(page, 3)

        # run(6) in a cell holds the kernel's shell channel, where JupyterLab asks which widgets are live
        # before it restores saved ones: the reloaded page gets its views back when the cell has ended,
        # then the curves hold every step, inside their axes.
        lab.run_cell(page, 3, wait=False)
        page.wait_for_function("() => document.querySelectorAll('.grpo-curves-plot g.subplot.xy path.point')"
                               ".length >= 5", timeout=60_000)
        save(page, tmp_path / "reload.ipynb")
        page.reload()
        lab.wait_for_notebook(page)
        shown = wait_reward_points(page, 9, timeout=180)
        assert shown["outside"] == [], shown["outside"]
        assert page.locator(".grpo-live-note:visible").count() == 0
        page.keyboard.press("Control+s")
        time.sleep(1)

        # A restarted kernel: the reopened notebook draws the saved views and says they are not live.
        lab.restart_kernel(page)
        page.reload()
        lab.wait_for_notebook(page)
        page.wait_for_function("() => document.querySelectorAll('.grpo-curves-plot g.subplot.xy path.point')"
                               ".length === 9", timeout=60_000)
        page.wait_for_function(
            "() => { const notes = [...document.querySelectorAll('.grpo-dashboard .grpo-live-note')];"
            " return notes.length >= 4 && notes.every(n => n.offsetParent !== null && /Not live/.test(n.innerText)); }",
            timeout=30_000,
        )
        assert "as of step 9" in page.locator(".grpo-curves .grpo-live-note").first.inner_text()
        page.locator(".grpo-dashboard").first.screenshot(path=str(shots / "reopened_after_restart.png"))


STEP_AND_POINTS = """() => {
  const status = document.querySelector('.grpo-controls')?.innerText.match(/step (\\d+)/);
  return {step: status ? Number(status[1]) : null,
          points: document.querySelectorAll('.grpo-curves-plot g.subplot.xy path.point').length};
}"""


def assert_caught_up_within_two_updates(page, last_step: int) -> None:
    """After a reload mid-run: the views come back while the run goes on (before ``last_step``), and
    within two updates of the restore the curves hold every step so far, inside their axes (the
    step in the controls and the points in the plot read in one go). An update is a round of the
    views' refreshes (``grpo_lab.views.base.Pacer``), which may span several steps: the step the
    controls show moves once per round."""
    restored = wait_step_from_status(page)
    assert restored < last_step, f"the views came back only at step {restored}, when the run had ended"
    deadline, caught_up, updates = time.time() + 120, None, [restored]
    while caught_up is None:
        assert time.time() < deadline, "the curves did not catch up with the steps after the reload"
        now = page.evaluate(STEP_AND_POINTS)
        if now["step"] is not None and now["step"] != updates[-1]:
            updates.append(now["step"])
        if now["step"] is not None and now["points"] == now["step"] and len(updates) <= 3:
            caught_up = now
        elif len(updates) > 3:
            raise AssertionError(f"two updates after the reload at step {restored} (steps {updates}), the page "
                                 f"shows {now}")
        time.sleep(0.1)
    assert facts(page)["outside"] == []


def wait_step_from_status(page, timeout: float = 60) -> int:
    """The step the dashboard's controls report, once they are drawn."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if page.locator(".grpo-controls").count():
            found = re.search(r"step (\d+)", page.locator(".grpo-controls").first.inner_text())
            if found:
                return int(found.group(1))
        time.sleep(0.25)
    raise AssertionError("the dashboard's controls did not appear")


def test_quickstart_dashboard_renders_updates_live_and_steps(jupyter, chromium, workdir):
    shots = Path(os.environ.get("GRPO_LAB_SCREENSHOTS", workdir / "shots"))
    shots.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "notebooks" / "01_quickstart.ipynb", workdir / "quickstart.ipynb")
    with lab.new_page(chromium, height=2800) as page:
        lab.open_notebook(page, jupyter, workdir / "quickstart.ipynb")
        lab.run_all(page)
        seen, pictured, deadline = [], False, time.time() + 600
        while not lab.all_cells_done(page):
            assert time.time() < deadline, "the notebook did not finish within 10 minutes"
            shown = facts(page, 0)
            seen.append(shown["rewardPoints"] if shown else 0)
            if not pictured and seen[-1] >= 50:  # the picture in the docs: the dashboard at step 50 (or 51)
                page.evaluate("() => document.querySelector('.grpo-dashboard').scrollIntoView()")
                page.locator(".grpo-dashboard").screenshot(path=str(shots / "dashboard.png"))
                pictured = True
            time.sleep(0.2)
        assert lab.widget_problems(page) == []
        assert pictured, f"the reward curve never showed 50 points while arun(50) ran: {sorted(set(seen))}"
        if os.environ.get("GRPO_LAB_DOCS_IMAGES") == "1":
            shutil.copy(shots / "dashboard.png", ROOT / "docs" / "images" / "dashboard.png")

        # 1 step by update() + 50 by arun(50): 51 points in the reward trace, grown while arun(50) ran.
        shown = wait_reward_points(page, 51)
        growth = sorted(set(n for n in seen if 1 < n < 51))
        # The views refresh in rounds (grpo_lab.views.base.Pacer), each at least 39x its own cost after the last:
        # on a fast machine arun(50) lasts a few seconds and holds one or two rounds (a fresh clone's CI saw only
        # 9), on a slow one more (15 and 43). A count between 1 and 51 seen while the cell ran is the live update.
        assert growth, f"curves did not grow while arun(50) executed: point counts seen {sorted(set(seen))}"
        assert (shown["outside"] == [] and shown["legendsDrawn"] == shown["legendsWanted"]
                and shown["xTitles"] == shown["panels"])
        assert page.locator(".grpo-completions-view .grpo-token").count() > 8
        assert "next stage: generate()" in controls_text(page)
        # the reward panel's band is labelled as what it is, and is reward ± reward_std of the notebook's history
        # (its last cell prints the last five steps: step, reward, reward_std, ...)
        assert "± reward_std (the whole batch)" in shown["legendText"]
        band = page.evaluate(REWARD_BAND)
        last = page.locator(".jp-Notebook .jp-Cell").count() - 1
        printed = lab.cell(page, last).locator(".jp-OutputArea").inner_text()
        rows = [line.split() for line in printed.splitlines() if re.match(r"\s*\d+\s+\d+\s", line)]
        assert len(rows) == 5
        for _, step, reward, reward_std, *_ in rows:
            low, high = band[str(int(step))]
            assert low == pytest.approx(float(reward) - float(reward_std), abs=1e-5)
            assert high == pytest.approx(float(reward) + float(reward_std), abs=1e-5)

        step_button(page).click()
        wait_reward_points(page, 52)
        assert "step 52" in controls_text(page)
        page.locator(".grpo-curves").screenshot(path=str(shots / "curves_after_step.png"))
        page.locator(".grpo-completions-view").screenshot(path=str(shots / "completions.png"))

        # Beside the widget, a picture of the curves for where no widget can be drawn: hidden while the
        # widget is live, redrawn when a call ends (the Step press included), and what a notebook reopened
        # after a kernel restart shows with JupyterLab's defaults, where the widget says "Error displaying".
        pictures = page.locator(".grpo-static-fallback")
        assert pictures.count() == 1 and page.locator(".grpo-static-fallback:visible").count() == 0
        page.wait_for_function("() => /as of step 52/.test(document.querySelector('.grpo-static-fallback')"
                               ".textContent)", timeout=30_000)
        save(page, workdir / "quickstart.ipynb")
        lab.restart_kernel(page)
        page.reload()
        lab.wait_for_notebook(page)
        pictures.first.wait_for(state="visible", timeout=60_000)
        shown = pictures.first.inner_text()
        assert "Not live" in shown and "as of step 52" in shown
        assert pictures.first.locator("svg polyline").count() >= 5 and "reward" in shown
        pictures.first.screenshot(path=str(shots / "reopened_after_restart_default.png"))


COMPARE_SETUP = """\
import grpo_lab
from grpo_lab import GRPOSession
from grpo_lab.tasks import default_task

task = default_task(eval_size=4)
a = GRPOSession(task.model, task.reward_funcs, train_dataset=task.train_dataset,
                args=task.config(per_device_train_batch_size=8, num_generations=4, max_steps=100, learning_rate=1e-3,
                                 output_dir="outputs/browser"))"""

# The comparison's first panel (reward), read from the page: each drawn trace's legend name and its
# point and line path counts, every legend text and every annotation (titles, fork marks) of the plot.
COMPARED_REWARD = """() => {
  LEGEND_JS
  const gd = document.querySelector('.grpo-compare .grpo-curves-plot .js-plotly-plot');
  if (!gd || !gd._fullLayout) return null;
  const traces = [...gd.querySelectorAll('g.subplot.xy .scatterlayer g.trace')].map((g) => ({
    name: g.__data__?.[0]?.trace?.name ?? null,
    points: g.querySelectorAll('path.point').length,
    line: (g.querySelector('path.js-line')?.getAttribute('d') || '').length,
  }));
  return {
    annotations: [...gd.querySelectorAll('.infolayer .annotation-text')].map((a) => a.textContent),
    legendText: [...gd.querySelectorAll(`.infolayer g[class^="legend"] ${LEGEND_TEXT}`)].map((t) => t.textContent),
    traces,
  };
}""".replace("LEGEND_JS", LEGEND_JS)


# Every box of the comparison's figure that must not overlap another: each legend (one per row of a
# panel's legend), each annotation (panel titles, fork labels) and each panel's plot area.
COMPARED_BOXES = """() => {
  const gd = document.querySelector('.grpo-compare .grpo-curves-plot .js-plotly-plot');
  if (!gd || !gd._fullLayout) return null;
  const box = (element, kind) => {
    const r = element.getBoundingClientRect();
    return { kind, text: element.textContent, left: r.left, right: r.right, top: r.top, bottom: r.bottom };
  };
  const legends = [...gd.querySelector('.infolayer').children].filter((g) => /^legend/.test(g.getAttribute('class')));
  return [
    ...legends.map((g) => box(g, 'legend')),
    ...[...gd.querySelectorAll('.infolayer .annotation-text')].map((a) => box(a, 'annotation')),
    ...[...gd.querySelectorAll('.draglayer .nsewdrag')].map((d) => box(d, 'plot')),
  ].filter((b) => b.right > b.left && b.bottom > b.top);
}"""


def overlapping(boxes: list[dict], slack: float = 1.0) -> list[tuple[str, str]]:
    """The pairs of boxes that overlap (by more than ``slack`` pixels each way); a fork label may lie
    inside a plot area (it marks a step there), nothing else may."""
    pairs = []
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            if {a["kind"], b["kind"]} == {"annotation", "plot"} or a["kind"] == b["kind"] == "plot":
                continue
            if min(a["right"], b["right"]) - max(a["left"], b["left"]) > slack and \
                    min(a["bottom"], b["bottom"]) - max(a["top"], b["top"]) > slack:
                pairs.append((f"{a['kind']} {a['text'][:40]!r}", f"{b['kind']} {b['text'][:40]!r}"))
    return pairs


def test_compare_labels_forks_of_one_step_once_and_keeps_each_legend_in_its_panel(jupyter, chromium, workdir):
    lab.write_notebook(workdir / "forks.ipynb", [
        COMPARE_SETUP, "a.step()\na.step()",
        "b = a.fork('a-fork-with-a-rather-long-name', learning_rate=5e-4)\n"
        "c = a.fork('another-fork-named-at-length', learning_rate=2e-4)",
        "b.step()\nc.step()", "view = grpo_lab.compare(a, b, c)\nview",
    ])
    with lab.new_page(chromium, height=2400) as page:
        lab.open_notebook(page, jupyter, workdir / "forks.ipynb")
        for index in range(5):
            lab.run_cell(page, index)
        page.wait_for_function("() => document.querySelectorAll('.grpo-compare .grpo-curves-plot "
                               "g.subplot.xy path.point').length > 0", timeout=60_000)
        shown = page.evaluate(COMPARED_REWARD)
        forked = [text for text in shown["annotations"] if text.startswith("forked:")]
        # the two forks of step 2 named together, once a panel
        assert forked and set(forked) == {"forked: a-fork-with-a-rather-long-name, another-fork-named-at-length"}
        boxes = page.evaluate(COMPARED_BOXES)
        assert sum(b["kind"] == "legend" for b in boxes) >= 2 and sum(b["kind"] == "plot" for b in boxes) >= 3
        assert overlapping(boxes) == [], [b for b in boxes if b["kind"] != "plot"][:12]
        assert lab.widget_problems(page) == []


def wait_compared_points(page, wanted: dict[str, int], timeout: float = 60) -> dict:
    """Wait until the comparison's reward panel draws ``wanted[name]`` points for each run's trace."""
    deadline, seen = time.time() + timeout, None
    while time.time() < deadline:
        seen = page.evaluate(COMPARED_REWARD)
        if seen and {t["name"]: t["points"] for t in seen["traces"]} == wanted:
            return seen
        time.sleep(0.25)
    raise AssertionError(f"expected the reward panel to draw {wanted} points, the page shows {seen}")


def test_compare_draws_a_session_and_its_fork_on_shared_axes_and_follows_one_as_it_trains(jupyter, chromium, workdir):
    lab.write_notebook(workdir / "compare.ipynb", [
        COMPARE_SETUP, "a.step()\na.step()", "b = a.fork(learning_rate=5e-4)", "a.run(2)\nb.run(3)",
        "view = grpo_lab.compare(a, b)\nview", "print('names', view.names)", "a.step()",
    ])
    with lab.new_page(chromium, height=2400) as page:
        lab.open_notebook(page, jupyter, workdir / "compare.ipynb")
        for index in range(6):
            lab.run_cell(page, index)
        names = re.search(r"names \['(.+)', '(.+)'\]", lab.cell(page, 5).locator(".jp-OutputArea").inner_text())
        first, second = names.groups()
        assert first != second
        shown = wait_compared_points(page, {first: 4, second: 5})  # the fork holds the 2 steps before it, then 3
        assert shown["annotations"][0] == "reward" and f"forked: {second}" in shown["annotations"]
        assert first in shown["legendText"] and second in shown["legendText"], shown["legendText"]
        assert all(trace["line"] > 0 for trace in shown["traces"]), shown["traces"]  # both lines drawn

        lab.run_cell(page, 6)  # a step of the live session redraws the comparison
        wait_compared_points(page, {first: 5, second: 5})
        assert lab.widget_problems(page) == []
