"""The planner widget's figures in a real browser (JupyterLab + chromium through Playwright; a server from
test_browser.jupyterlab_server), as a new user reads them after using it:

1. after a Launch from the widget, every figure on screen, in the dashboard and in the Python text (``ap.summary()``,
   ``run.summary_line()``, ``run.explain()``) agrees with the others: the headline's memory limit is the memory
   panel's, a measured memory figure is shown beside the prediction it is compared with, the widget's measured step
   time is the run line's, and every size and time is in a unit scaled to it (no "0.01 GiB", no "0.0 ms/step");
2. a cell whose model does not run on its inputs, or does not parse, answers in one line that points at the user's
   line as the notebook numbers it (no torch log before it, no path into the package).
"""

from __future__ import annotations

import re

import pytest
import test_browser
from test_browser import kernel_json, notebook_page
from test_launch_browser import type_in

pytestmark = pytest.mark.browser

SEED_CELLS = [
    "%load_ext autopar_nb",
    """%%autoparallel --gpus 2 --gpu cpu --batch 32
import torch, torch.nn as nn
model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 512))
example_inputs = (torch.randn(32, 1024),)""",
]

FIGURE = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)\s?(B|KiB|MiB|GiB|TiB|ns|µs|ms|s)(?![\w/])|"
                    r"(?<![\w.])(\d+(?:\.\d+)?)\s?(ns|µs|ms|s)/step")
SCALE = {"B": 1024, "KiB": 1024, "MiB": 1024, "GiB": 1024, "TiB": None, "ns": 1000, "µs": 1000, "ms": 1000,
         "s": None}
SMALLEST = {"B", "ns"}


def badly_scaled(text: str, context: int = 0) -> list[str]:
    """The figures in ``text`` whose unit is not the one its value calls for: below 1 in a unit that has a smaller
    one ("0.01 GiB", "0.0 ms"), or 1000 (1024) or more of a unit that has a larger one ("29056.7 ms"); with
    ``context`` characters of the text either side."""
    bad = []
    for m in FIGURE.finditer(text):
        value, unit = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
        x = float(value)
        if (0 < x < 1 or value in ("0.0", "0.00")) and unit not in SMALLEST or (SCALE[unit] and x >= SCALE[unit]):
            bad.append(text[max(0, m.start() - context):m.end() + context])
    return bad


def to_bytes(figure: str) -> float:
    """"16.8 MiB" -> 17616076.8"""
    value, unit = figure.split()
    return float(value) * 1024 ** ["B", "KiB", "MiB", "GiB", "TiB"].index(unit)


def test_badly_scaled_finds_what_the_issue_saw():
    assert badly_scaled("0.01 GiB, 0.0 ms/step, 29056.7 ms/step, 1024 KiB") == [
        "0.01 GiB", "0.0 ms/step", "29056.7 ms/step", "1024 KiB"]
    assert badly_scaled("peak 3.47 MiB of 11.8 GiB, 69.8 µs, 0 B, 12 ns, 1.02 GiB, 2 s, 100 steps, 4.5%") == []


FIGURES = """(root) => {
  const all = (s) => [...root.querySelectorAll(s)];
  const text = (s) => all(s).map((e) => e.textContent.trim());
  return {
    headline: text('.ap-summary')[0], memoryTitle: text('.ap-memory .ap-panel-title')[0],
    bars: all('.ap-bar-row.ap-has-measured').map((r) => ({value: r.querySelector('.ap-bar-value').textContent,
      measured: r.querySelector('.ap-bar-measured').textContent, title: r.querySelector('.ap-bar-measured').title})),
    notes: text('.ap-measured-note'), time: text('.ap-time-measured'), timeTitle: text('.ap-time .ap-panel-title')[0],
  };
}"""
TEXTS = """(root) => { const out = [], walk = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
  while (walk.nextNode()) out.push(walk.currentNode.textContent);
  return out.concat([...root.querySelectorAll('[title]')].map((e) => e.title)).join('\\n'); }"""
"""every text node and tooltip of an element, one a line (innerText runs a legend's "rank 1" into its "144 µs")"""


def test_every_figure_after_a_launch_agrees_with_the_others(tmp_path):
    """Issue 42, point 4: after a launch the memory panel showed "1.02 GiB 75.9 MiB ×5.05" (a measured figure below
    the bar it was flagged 5x over, because compared with another, 15 MiB, prediction), the headline "of 23.5 GiB"
    where the memory panel said "of 11.8 GiB", the run line "0.1 ms/step" where the widget said 69.8 µs, and
    ``summary()`` "0.0 ms/step"; sizes such as "0.01 GiB"."""
    from playwright.sync_api import expect

    with notebook_page(tmp_path, SEED_CELLS, widgets=1) as (page, errors):
        type_in(page, "input.ap-run-nproc", 2)
        type_in(page, "input.ap-run-launch-steps", 30)
        page.locator("button.ap-action-launch").click()
        dash = page.locator(".ap-run-panel .autopar-dashboard")
        expect(dash.locator(".apd-state")).to_have_attribute("data-state", "finished", timeout=120_000)
        root = page.locator(".ap-root").first
        expect(root.locator(".ap-bar-measured").first).to_be_visible(timeout=10_000)
        page.wait_for_timeout(1500)  # the measured trait's last update (at most once a second, and at the run's end)
        seen = root.evaluate(FIGURES)
        seen["runLine"] = dash.locator(".apd-status").text_content()
        seen["all"], seen["dashboard"] = root.evaluate(TEXTS), dash.evaluate(TEXTS)
        py = kernel_json(page, tmp_path, (
            "(lambda run: {'summary': ap.summary(), 'line': run.summary_line(), 'message': run.message, "
            "'explain': run.explain(), 'step_s': run.summary()['step_time_s'], 'steps': run.steps, "
            "'measured': ap.widget().measured['time']['measured'], "
            "'bars': ap.widget().measured['bars']})(ap.widget().last_result)"))
    print("\nafter a launch:", {k: v for k, v in seen.items() if k not in ("all", "dashboard")}, py)
    assert not errors, errors
    # the steps typed just before the click: ipywidgets held their update back (the processes' update unanswered)
    # and Launch ran the default 50
    assert py["steps"] == 30, py["steps"]
    # the headline's memory limit is the memory panel's (a CPU rank's share of the host)
    limit = re.search(r" of ([\d.]+ \w+)$", seen["headline"]).group(1)
    assert seen["memoryTitle"].endswith(f" of {limit}"), (seen["headline"], seen["memoryTitle"])
    # a measured memory figure names the prediction it is compared with, and the ratio is theirs
    assert seen["bars"], seen
    for bar in seen["bars"]:  # on screen, not in a tooltip only: read as the user reads it
        m = re.search(r"(\S+ \w+) ×([\d.]+) of (\S+ \w+) predicted tensors \(no margin\)", bar["measured"])
        assert m and "RSS above baseline" in bar["measured"], bar
        assert float(m.group(2)) == pytest.approx(to_bytes(m.group(1)) / to_bytes(m.group(3)), rel=0.01), bar
    # the step time: the widget's measured figure is the run line's and run.summary_line()'s
    step = re.search(r"measured ([\d.]+ \w+)", seen["time"][0]).group(1)
    assert f"{step}/step" in seen["runLine"] and f"{step}/step" in py["line"], (step, seen["runLine"], py["line"])
    # units scaled to each value, on screen and in the Python text
    for where, text in [("widget", seen["all"]), ("dashboard", seen["dashboard"]), ("summary", py["summary"]),
                        ("summary_line", py["line"]), ("message", py["message"]), ("explain", py["explain"])]:
        assert not badly_scaled(text), (where, badly_scaled(text, 100))


def _run_cell_output(page, code: str) -> str:
    """Append ``code`` as a new cell, run it, and return its output area's text once the kernel is idle."""
    page.evaluate("""async (code) => {
        const panel = jupyterapp.shell.currentWidget, nb = panel.content, model = nb.model;
        model.sharedModel.insertCell(model.cells.length, {cell_type: 'code', source: code});
        nb.activeCellIndex = model.cells.length - 1;
        await jupyterapp.commands.execute('notebook:run-cell');
    }""", code)
    page.wait_for_timeout(500)
    page.wait_for_function(test_browser.KERNEL_IS % "idle", timeout=120_000)
    page.wait_for_timeout(300)
    return page.evaluate("() => { const cells = jupyterapp.shell.currentWidget.content.widgets;"
                         " return cells[cells.length - 1].node.querySelector('.jp-Cell-outputArea').innerText; }")


SHAPE_ERROR = """%%autoparallel --gpus 2 --gpu cpu
import torch, torch.nn as nn
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 32), nn.Linear(16, 8)
    def forward(self, x):
        return self.b(self.a(x))
model = Net()
example_inputs = (torch.randn(4, 64),)"""
SYNTAX_ERROR = "%%autoparallel --gpus 2 --gpu cpu\nimport torch\nmodel = (\n"


def test_a_cell_error_is_one_line_at_the_users_line(tmp_path):
    """Issue 42, point 8, in JupyterLab: a shape error printed ~20 lines of torch's fake_tensor log before the one-line
    error, which pointed into the package and suggested ``capture()``; a syntax error's line number did not count the
    ``%%autoparallel`` line. Now each is one line naming the user's line as the notebook numbers it."""
    with notebook_page(tmp_path, SEED_CELLS, widgets=1) as (page, errors):
        shape = _run_cell_output(page, SHAPE_ERROR)
        syntax = _run_cell_output(page, SYNTAX_ERROR)
    print("\nshape error:", repr(shape), "\nsyntax error:", repr(syntax))
    assert not errors, errors
    for out in (shape, syntax):
        assert len(out.strip().splitlines()) == 1 and out.startswith("UsageError: %%autoparallel: "), out
        assert "autopar_nb" not in out and "capture()" not in out and "fake_tensor" not in out, out
    assert "module b (Linear)" in shape and "cell line 8: `return self.b(self.a(x))`" in shape, shape
    assert "[4, 32] X [16, 8]" in shape, shape
    assert "syntax error in the cell, line 3 (`model = (`)" in syntax, syntax


GONE = """() => [...document.querySelectorAll('.ap-root')].map((r) => ({
  banner: (r.querySelector('.ap-kernel-gone') || {}).textContent || null,
  launch: r.querySelector('button.ap-action-launch').disabled, undo: r.querySelector('button.ap-undo').disabled,
  fit: r.querySelector('button.ap-fit').disabled}))"""
# a launch dashboard of a run that was never started (no worker processes): its Stop button is live
DASHBOARD_CELL = """from pathlib import Path; import tempfile
from autopar_nb.launch.run import Run
from autopar_nb.launch.dashboard import Dashboard
d = Path(tempfile.mkdtemp())
Dashboard(Run(run_id="r", run_dir=d, script=d / "train.py", nproc=2, steps=6, token="t", backend="gloo",
              max_restarts=0, hang_timeout_s=None, plan=ap.plan))"""
DASHBOARD_GONE = """() => [...document.querySelectorAll('.apd')].map((r) => ({
  banner: (r.querySelector('.apd-kernel-gone') || {}).textContent || null,
  stop: r.querySelector('button.apd-stop').disabled}))"""


def test_the_widget_says_when_its_kernel_has_died(tmp_path):
    """Issue 42, point 10: when the kernel died the widget still looked alive and Launch did nothing. Now it says
    the kernel stopped and disables what needs the kernel (the graph's own view controls stay), after a death
    (``os._exit`` in a cell; the server restarts the kernel) and after a restart; the cell run again is live. The
    launch dashboard (static/kernel.js's watch, shared) says so too and disables its Stop button."""
    with notebook_page(tmp_path, SEED_CELLS, widgets=1) as (page, errors):
        _run_cell_output(page, DASHBOARD_CELL)
        page.wait_for_selector(".apd button.apd-stop", timeout=30_000)
        alive, dash_alive = page.evaluate(GONE), page.evaluate(DASHBOARD_GONE)
        page.evaluate("""() => { const nb = jupyterapp.shell.currentWidget.content, model = nb.model;
            model.sharedModel.insertCell(model.cells.length, {cell_type: 'code', source: 'import os; os._exit(1)'});
            nb.activeCellIndex = model.cells.length - 1;
            jupyterapp.commands.execute('notebook:run-cell'); }""")
        page.wait_for_selector(".ap-root .ap-kernel-gone", timeout=60_000)
        page.wait_for_selector(".apd .apd-kernel-gone", timeout=10_000)
        died, dash_died = page.evaluate(GONE), page.evaluate(DASHBOARD_GONE)
        page.screenshot(path=str(tmp_path / "died.png"))
        page.keyboard.press("Escape")  # JupyterLab's "Kernel Restarting" dialog
        page.wait_for_function(test_browser.KERNEL_IS % "idle", timeout=60_000)
        page.evaluate("async () => { jupyterapp.shell.currentWidget.content.activeCellIndex = 0;"  # the extension,
                      " for (const _ of [0, 1]) await jupyterapp.commands.execute("  # then the planner's cell
                      "'notebook:run-cell-and-select-next'); }")
        page.wait_for_selector(".ap-root:not(.ap-gone) .ap-svg svg g.node", timeout=120_000)
        page.wait_for_function(test_browser.KERNEL_IS % "idle", timeout=60_000)
        again = page.evaluate(GONE)
        page.evaluate("() => jupyterapp.shell.currentWidget.sessionContext.session.kernel.restart()")
        page.wait_for_selector(".ap-root .ap-kernel-gone", timeout=60_000)
        restarted = page.evaluate(GONE)
    print("\nkernel gone:", alive, died, again, restarted, "\ndashboard:", dash_alive, dash_died)
    assert not errors, errors
    assert dash_alive == [{"banner": None, "stop": False}], dash_alive
    assert len(dash_died) == 1 and dash_died[0]["stop"], dash_died
    assert dash_died[0]["banner"].startswith("The kernel stopped (it died or was restarted)"), dash_died
    assert alive == [{"banner": None, "launch": False, "undo": True, "fit": False}], alive
    for seen in (died, restarted):
        assert len(seen) == 1 and seen[0]["banner"].startswith("The kernel stopped (it died or was restarted)"), seen
        assert seen[0]["launch"] and seen[0]["undo"] and not seen[0]["fit"], seen
    assert again == alive, again
