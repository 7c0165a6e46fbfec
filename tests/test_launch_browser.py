"""The launch dashboard and the background verify in a real browser (JupyterLab + chromium through Playwright; a
server from test_browser.jupyterlab_server), driven as a user would from the planner widget:

1. Launch (2 processes, from the widget's inputs): the dashboard appears below the planner, fits a 1024 px window;
   while another cell keeps the kernel busy, every chart gains points for every rank; screenshots (light and dark
   theme) go to
   $AUTOPAR_SCREENSHOTS/dashboard.png and dashboard_dark.png (see test_browser.py); Stop ends every worker.
2. A run whose rank 1 raises: the dashboard names rank 1 as the cause, with its traceback.
3. Verify (3 steps): the progress view below the planner ends with one row per step, each marked pass with its rule.
4. Tournament (the seed MLP, k=2, 3 steps): the standings and the chart, Adopt, the header's calibration.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import nbformat
import pytest
import test_browser
from test_browser import (
    CHROMIUM,
    CHROMIUM_FLAGS,
    IMG,
    KERNEL_IS,
    jupyterlab_server,
    kernel_json,
    notebook_page,
    run_cell_writing,
)

FIXTURE = Path(__file__).parent / "fixtures" / "train_fixture.py"

pytestmark = [pytest.mark.browser, pytest.mark.multiprocess]

CELLS = [
    "%load_ext autopar_nb",
    """%%autoparallel --gpus 2 --gpu cpu --batch 32
import torch, torch.nn as nn
model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 512))
example_inputs = (torch.randn(32, 1024),)""",
    """import time
t_busy = time.time()
time.sleep(12)  # a long cell: the dashboard must keep updating meanwhile
t_free = time.time()""",
]
CHARTS = ("memory", "util", "loss", "throughput", "step_time", "data_wait")

# points with a value, per chart and rank series, of a dashboard (the element)
POINTS = """(root) => {
  const out = {};
  for (const [key, u] of Object.entries(root.__apdCharts || {})) {
    out[key] = u.data.slice(1, 1 + u.series.filter((s) => (s.label || '').startsWith('rank ')).length)
      .map((col) => col.filter((v) => v !== null && v !== undefined).length);
  }
  return out;
}"""


def test_launch_and_verify_from_the_widget(tmp_path):
    from playwright.sync_api import expect, sync_playwright

    test_browser._require_chromium()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS], metadata={
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}})
    errors: list[str] = []
    with jupyterlab_server(tmp_path) as (base, token, root), sync_playwright() as pw:
        nbformat.write(nb, root / "launch.ipynb")
        ctx = pw.chromium.launch_persistent_context(
            str(tmp_path / "chromium"), executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_FLAGS,
            viewport={"width": 1024, "height": 1500})  # the narrow case
        try:
            page = ctx.new_page()
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.goto(f"{base}/lab/tree/launch.ipynb?token={token}")
            page.wait_for_function(KERNEL_IS % "idle", timeout=60_000)
            page.evaluate("jupyterapp.commands.execute('application:toggle-left-area')")  # the notebook: ~1000 px
            for _ in range(2):  # the extension, then the planner
                page.evaluate("jupyterapp.commands.execute('notebook:run-cell-and-select-next')")
            planner = page.locator(".ap-root")
            expect(planner).to_have_count(1, timeout=60_000)

            # 1. Launch from the widget with its inputs: 2 processes, a long run
            type_in(page, "input.ap-run-nproc", 2)
            type_in(page, "input.ap-run-launch-steps", 100_000)
            page.locator("button.ap-action-launch").click()
            dash = page.locator(".ap-run-panel .autopar-dashboard")
            expect(dash.locator(".apd-state")).to_have_attribute("data-state", "running", timeout=90_000)
            expect(dash.locator("tr[data-rank]")).to_have_count(2)
            deadline = time.time() + 30
            while time.time() < deadline:  # every chart has a line with points for each rank
                p = dash.evaluate(POINTS)
                if len(p) == len(CHARTS) and all(len(c) == 2 and min(c) >= 2 for c in p.values()):
                    break
                page.wait_for_timeout(500)
            page.wait_for_timeout(1000)
            # another cell keeps the kernel busy for 12 s: the charts still gain points for every rank
            page.evaluate("() => { jupyterapp.shell.currentWidget.content.activeCellIndex = 2;"  # (clicks moved it)
                          " jupyterapp.commands.execute('notebook:run-cell'); }")
            page.wait_for_function(KERNEL_IS % "busy", timeout=10_000)
            before = dash.evaluate(POINTS)
            t_before = time.time()
            page.wait_for_timeout(6000)
            after = dash.evaluate(POINTS)
            t_after = time.time()
            fits = dash.evaluate("e => e.scrollWidth <= e.clientWidth + 1")  # nothing cut at 1024 px
            IMG.mkdir(parents=True, exist_ok=True)
            dash.scroll_into_view_if_needed()
            page.mouse.move(0, 0)  # not hovering a chart: the legends show the latest values
            page.wait_for_timeout(1200)
            dash.screenshot(path=str(IMG / "dashboard.png"))
            page.evaluate("jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Dark'})")
            page.wait_for_function("() => document.body.dataset.jpThemeLight === 'false'", timeout=20_000)
            page.wait_for_timeout(1500)  # a redraw in the new colours
            dash.screenshot(path=str(IMG / "dashboard_dark.png"))
            dark_bg = dash.evaluate("e => getComputedStyle(e).backgroundColor")
            page.evaluate("jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Light'})")
            page.wait_for_function(KERNEL_IS % "idle", timeout=30_000)

            # the Stop button
            dash.locator("button.apd-stop").click()
            expect(dash.locator(".apd-state")).to_have_attribute("data-state", "stopped", timeout=30_000)
            # the event timeline (issue 14): the launch and the stop, each with its reason
            expect(dash.locator('.apd-events li[data-kind="launch"]')).to_contain_text("2 warm processes")
            expect(dash.locator('.apd-events li[data-kind="stop"]')).to_contain_text("Stop button")
            page.wait_for_function(KERNEL_IS % "idle", timeout=30_000)
            state = run_cell_writing(page, (
                "import json\nrun = ap.widget().last_result\n"
                "json.dump({'status': run.status, 'message': run.message, 'left': len(run.processes()), "
                "'busy': [t_busy, t_free], 'samples': len(run.samples)}, "
                f"open({str(tmp_path / 'stop.json')!r}, 'w'))"), tmp_path / "stop.json")

            # 2. a rank that raises: named as the cause, with its traceback
            run_cell_writing(page, (
                "import autopar_nb, json\n"
                f"bad = autopar_nb.launch({str(FIXTURE)!r}, nproc=2, steps=200, sleep=0.05, fail_rank=1, "
                "fail_step=4)\n"
                f"display(bad)\njson.dump({{}}, open({str(tmp_path / 'bad.json')!r}, 'w'))"), tmp_path / "bad.json")
            bad = page.locator(".jp-OutputArea .autopar-dashboard").last
            expect(bad.locator(".apd-state")).to_have_attribute("data-state", "failed", timeout=90_000)
            expect(bad.locator(".apd-error-head")).to_contain_text("Rank 1 failed first")
            expect(bad.locator(".apd-error-head")).to_contain_text("injected failure on rank 1 at step 4")
            expect(bad.locator(".apd-traceback")).to_contain_text("Traceback (most recent call last)")
            expect(bad.locator('tr[data-rank="1"]')).to_have_attribute("data-state", "failed")
            # the event list follows the dashboard's refresh, later than the error head under load (5 s was short)
            expect(bad.locator('.apd-events li[data-kind="fail"]')).to_contain_text("rank 1", timeout=30_000)

            # 3. Verify from the widget: 3 steps, in the background, each row marked with its rule
            type_in(page, "input.ap-run-verify-steps", 3)
            page.locator("button.ap-action-verify").click()
            verify = page.locator(".ap-run-panel .apd-verify")
            expect(verify.locator(".apd-state")).to_have_attribute("data-state", "passed", timeout=180_000)
            expect(verify.locator("tr[data-step]")).to_have_count(3)
            expect(verify.locator('tr[data-ok="true"] td.apd-pass')).to_have_count(3)
            rules = verify.locator("tr[data-step] td:last-child").all_inner_texts()
            verify.screenshot(path=str(IMG / "verify.png"))
        finally:
            ctx.close()

    t_busy, t_free = state["busy"]
    assert t_busy < t_before and t_after < t_free, (state, t_before, t_after)  # sampled while the cell ran
    for key in CHARTS:
        assert all(a > b for a, b in zip(after[key], before[key], strict=True)), (key, before, after)
    assert state["status"] == "stopped" and "Stop button" in state["message"], state
    assert state["left"] == 0 and state["samples"] > 0, state
    assert fits
    assert dark_bg not in ("rgb(255, 255, 255)", "rgba(0, 0, 0, 0)"), dark_bg  # the theme's colours
    assert all(r in ("rtol", "adam", "low precision", "same params") for r in rules), rules
    assert not [e for e in errors if "apd" in e or "uPlot" in e or "dashboard" in e.lower()], errors


def type_in(page, selector: str, value: int) -> None:
    """Type a number into one of the widget's inputs, as a user does (the change event sends it to the kernel)."""
    page.locator(selector).fill(str(value))
    page.locator(selector).dispatch_event("change")


def test_tournament_from_the_widget(tmp_path):
    """The Tournament button on the seed MLP (k=2, 3 steps, 2 processes): the kernel stays free while it runs, the
    standings end with a row per plan and a point per plan on the chart, in the light and the dark theme (screenshots
    tournament.png, tournament_dark.png); Adopt answers; the header names the calibration the next plan uses."""
    from playwright.sync_api import expect

    from autopar_nb.demo import QUICKSTART_CELL

    cells = ["%load_ext autopar_nb", "%%autoparallel --gpu cpu --gpus 2 --batch 32\n" + QUICKSTART_CELL]
    with notebook_page(tmp_path, cells, widgets=1) as (page, errors):
        type_in(page, "input.ap-run-tournament-k", 2)
        type_in(page, "input.ap-run-tournament-steps", 3)
        page.locator("button.ap-action-tournament").click()
        view = page.locator(".ap-run-panel .apd-tournament")
        expect(view.locator(".apd-state")).to_have_attribute("data-state", "running", timeout=60_000)
        page.wait_for_function(KERNEL_IS % "idle", timeout=30_000)  # the trials run; the kernel is free
        free_while_running = view.locator(".apd-state").get_attribute("data-state") == "running"
        expect(view.locator(".apd-state")).to_have_attribute("data-state", "finished", timeout=400_000)
        expect(view.locator("tr[data-row]")).to_have_count(3)
        expect(view.locator('tr[data-status="measured"]')).to_have_count(3)
        expect(view.locator("circle.apt-pred")).to_have_count(3)
        expect(view.locator(".apt-verdict")).to_contain_text("Kendall's tau")
        expect(page.locator(".ap-header .ap-calibrated")).to_contain_text("from 3 runs")
        IMG.mkdir(parents=True, exist_ok=True)
        view.scroll_into_view_if_needed()
        view.screenshot(path=str(IMG / "tournament.png"))
        page.evaluate("jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Dark'})")
        page.wait_for_function("() => document.body.dataset.jpThemeLight === 'false'", timeout=20_000)
        page.wait_for_timeout(1000)
        view.screenshot(path=str(IMG / "tournament_dark.png"))
        dark_bg = view.evaluate("e => getComputedStyle(e).backgroundColor")
        page.evaluate("jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Light'})")
        view.locator("button.apt-adopt").click()
        # the measured winner is the plan or an alternative, as the trials' noise decides: either answer
        expect(view.locator(".apt-adopted")).to_contain_text(re.compile(r"^adopted |is the plan already"),
                                                               timeout=30_000)
        adopted = view.locator(".apt-adopted").inner_text()
    assert free_while_running
    assert dark_bg not in ("rgb(255, 255, 255)", "rgba(0, 0, 0, 0)"), dark_bg
    assert adopted.startswith("adopted ") or adopted.endswith(" is the plan already"), adopted
    assert not [e for e in errors if "apd" in e or "apt" in e or "planner" in e], errors


def test_launch_on_another_process_count_says_so_in_the_widget(tmp_path):
    """Issue 42, point 7, as a user meets it: the processes field set to 1 for a plan made for 2, then Launch. The
    run is the plan scaled to 1 data-parallel replica, and the widget's message leads with a warning that says so
    (what was planned, what runs, how to run or plan either way); the dashboard's notes say it too. The session's plan
    is not re-planned behind the user's back: it is still the 2-process plan."""
    from playwright.sync_api import expect

    cells = [CELLS[0], CELLS[1].replace("--batch 32", "--batch 32 --fix tp=1,pp=1")]  # dp 2: it scales to 1
    with notebook_page(tmp_path, cells, widgets=1) as (page, errors):
        before = kernel_json(page, tmp_path, "{'world': ap.plan.mesh.world_size, 'summary': ap.plan.summary()}")
        page.locator(".ap-root").first.scroll_into_view_if_needed()
        type_in(page, "input.ap-run-nproc", 1)
        type_in(page, "input.ap-run-launch-steps", 5)
        page.locator("button.ap-action-launch").click()
        msg = page.locator(".ap-root .ap-msg").first
        expect(msg).to_contain_text("The plan is for 2 processes; running it on 1", timeout=90_000)
        level = msg.get_attribute("class")
        text = msg.inner_text()
        dash = page.locator(".ap-run-panel .autopar-dashboard")
        expect(dash.locator("tr[data-rank]")).to_have_count(1, timeout=90_000)
        expect(dash.locator(".apd-notes")).to_contain_text("made for 2 processes; this run scales it to 1")
        expect(dash.locator(".apd-state")).to_have_attribute("data-state", "finished", timeout=120_000)
        page.wait_for_function(KERNEL_IS % "idle", timeout=30_000)
        after = kernel_json(page, tmp_path, (
            "{'world': ap.plan.mesh.world_size, 'summary': ap.plan.summary(), "
            "'ran': ap.widget().last_result.plan.mesh.world_size, "
            "'scaled_from': ap.widget().last_result.plan.cluster.get('scaled_from')}"))
    assert "ap-msg-warning" in level, level
    assert "dp 2 -> 1" in text and "nproc=2" in text and "gpus_per_node=1" in text, text
    assert "ap.launch(nproc=1" in text, text
    assert after == {**before, "ran": 1, "scaled_from": 2}, (before, after)  # no silent re-plan
    assert not [e for e in errors if "apd" in e or "planner" in e], errors
