"""The launch dashboard in a real browser (JupyterLab + chromium through Playwright; the ``lab`` fixture of
test_browser.py): it renders, keeps updating while another cell runs, and its Stop button ends every worker.
A screenshot goes to $AUTOPAR_SCREENSHOTS/dashboard.png (see test_browser.py)."""

from __future__ import annotations

import time
from pathlib import Path

import nbformat
import pytest
import test_browser
from test_browser import CHROMIUM, CHROMIUM_FLAGS, IMG, run_cell_writing

jupyterlab = test_browser.lab  # registers test_browser's `lab` fixture (JupyterLab on 127.0.0.1) here

FIXTURE = Path(__file__).parent / "fixtures" / "train_fixture.py"

pytestmark = [pytest.mark.browser, pytest.mark.multiprocess]

CELLS = [
    f"""import json, time
import autopar_nb as ap
run = ap.launch({str(FIXTURE)!r}, nproc=2, steps=100_000, sleep=0.05, hang_timeout_s=None)
t_cell1 = time.time()
run""",
    """while run.status != "running":
    time.sleep(0.1)
t_busy = time.time()
time.sleep(12)  # a long cell: the dashboard must keep updating meanwhile
t_free = time.time()""",
]


def test_dashboard_updates_while_a_cell_runs_and_stop_button_ends_the_run(jupyterlab, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    base, token, root = jupyterlab
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS], metadata={
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}})
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
            # cell 1 launches and shows the dashboard; once it runs, cell 2 keeps the kernel busy for 12 s
            t_cmd1 = time.time()
            page.evaluate("jupyterapp.commands.execute('notebook:run-cell-and-select-next')")
            status = page.locator(".autopar-dashboard .apd-status")
            expect(status).to_contain_text("running: step", timeout=90_000)
            t_seen = time.time()
            # not awaited: the command's promise settles only when the cell has finished
            page.evaluate("() => { jupyterapp.commands.execute('notebook:run-cell-and-select-next'); }")
            t_cmd2 = time.time()
            # sample the step shown for a while; the kernel says afterwards when its sleep cell ran

            def shown_step() -> int:
                text = status.inner_text()
                return int(text.split("step ")[1].split("/")[0]) if "step " in text else -1

            samples = []
            for _ in range(12):
                samples.append((time.time(), shown_step()))
                time.sleep(0.5)
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
            code = (f"json.dump({{'status': run.status, 'left': len(run.processes()), 'message': run.message, "
                    f"'busy': [t_busy, t_free], 't_cell1': t_cell1}}, open({str(state_path)!r}, 'w'))")
            state = run_cell_writing(page, code, state_path)
        finally:
            ctx.close()
    t_busy, t_free = state["busy"]
    during = [step for t, step in samples if t_busy < t < t_free]
    times = {"cmd1": t_cmd1, "seen": t_seen, "cmd2": t_cmd2}
    assert len(during) >= 4 and during[-1] > during[0] >= 0, f"no update while a cell ran: {samples} {state} {times}"
    assert state["status"] == "stopped" and "Stop button" in state["message"], state
    assert state["left"] == 0, state
    assert not [e for e in errors if "dashboard" in e.lower()], errors
