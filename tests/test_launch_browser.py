"""The launch dashboard in a real browser (JupyterLab + chromium through Playwright; the ``lab`` fixture of
test_browser.py): it renders, keeps updating while another cell runs, and its Stop button ends every worker.
A screenshot goes to docs/img/dashboard.png."""

from __future__ import annotations

import json
import time
from pathlib import Path

import nbformat
import pytest
import test_browser
from test_browser import CHROMIUM, CHROMIUM_FLAGS, IMG

_lab_fixture = test_browser.lab  # registers test_browser's `lab` fixture (JupyterLab on 127.0.0.1) here

FIXTURE = Path(__file__).parent / "fixtures" / "train_fixture.py"

pytestmark = [pytest.mark.browser, pytest.mark.multiprocess]

CELLS = [
    f"""import json, time
import autopar_nb as ap
run = ap.launch({str(FIXTURE)!r}, nproc=2, steps=100_000, sleep=0.05, hang_timeout_s=None)
run""",
    "time.sleep(10)  # a long cell: the dashboard must keep updating meanwhile",
]


def test_dashboard_updates_while_a_cell_runs_and_stop_button_ends_the_run(lab, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    base, token, root = lab
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    nbformat.write(nb, root / "launch.ipynb")
    state_path = tmp_path / "state.json"
    errors: list[str] = []
    with sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(
            str(tmp_path / "chromium"), executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_FLAGS,
            viewport={"width": 1300, "height": 1000})
        try:
            page = ctx.new_page()
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{base}/lab/tree/launch.ipynb?token={token}")
            kernel = ("() => { const w = window.jupyterapp && jupyterapp.shell.currentWidget;"
                      " const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;"
                      " return k && k.status === '%s'; }")
            page.wait_for_function(kernel % "idle", timeout=60_000)
            page.evaluate("jupyterapp.commands.execute('notebook:run-all-cells')")

            status = page.locator(".autopar-dashboard .apd-status")
            expect(status).to_contain_text("running: step", timeout=90_000)
            # while the sleep cell runs (kernel busy), the step shown keeps growing
            page.wait_for_function(kernel % "busy", timeout=30_000)

            def shown_step() -> int:
                text = status.inner_text()
                return int(text.split("step ")[1].split("/")[0]) if "step " in text else -1

            s1 = shown_step()
            time.sleep(3)
            s2 = shown_step()
            assert page.evaluate(kernel % "busy"), "the sleep cell ended too early for the check"
            assert s2 > s1 >= 0, f"dashboard did not update while a cell ran: {s1} -> {s2}"
            dash = page.locator(".autopar-dashboard")
            expect(dash.locator("tr[data-rank]")).to_have_count(2)
            expect(dash.locator("polyline[data-series='rank 0']")).to_have_count(1)
            expect(dash.locator(".apd-logs")).to_contain_text("[rank0]")
            IMG.mkdir(parents=True, exist_ok=True)
            dash.screenshot(path=str(IMG / "dashboard.png"))

            # the Stop button (its message is handled once the sleep cell has ended)
            dash.locator("button.apd-stop").click()
            expect(status).to_contain_text("stopped", timeout=30_000)
            page.wait_for_function(kernel % "idle", timeout=30_000)
            code = (f"json.dump({{'status': run.status, 'left': len(run.processes()), 'message': run.message}}, "
                    f"open({str(state_path)!r}, 'w'))")
            page.evaluate("""async (code) => {
                const panel = jupyterapp.shell.currentWidget, nb = panel.content, model = nb.model;
                model.sharedModel.insertCell(model.cells.length, {cell_type: 'code', source: code});
                nb.activeCellIndex = model.cells.length - 1;
                await jupyterapp.commands.execute('notebook:run-cell');
            }""", code)
            deadline = time.time() + 30
            while not state_path.exists() and time.time() < deadline:
                time.sleep(0.2)
            state = json.loads(state_path.read_text())
        finally:
            ctx.close()
    assert state["status"] == "stopped" and "Stop button" in state["message"], state
    assert state["left"] == 0, state
    assert not [e for e in errors if "dashboard" in e.lower()], errors
