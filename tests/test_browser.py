"""End to end in a real browser: JupyterLab (headless, offline, 127.0.0.1, random port and token, temp dirs) driven
by Debian's chromium through Playwright. Opens notebooks/01_quickstart.ipynb, runs all, waits for the planner
widgets, picks a layer strategy from the dropdown, clicks a graph node, drags a layer to another pipeline stage,
and checks from the kernel (a cell that writes the sessions' state to a file) that the plans changed accordingly.
Screenshots go to $AUTOPAR_SCREENSHOTS (default: a temporary folder); `AUTOPAR_SCREENSHOTS=docs/img make test`
refreshes the ones the README shows (docs/img/widget.png).

Runs in CI (CI=true: a missing chromium is a failure; .ci/run installs it); elsewhere it skips without chromium.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "01_quickstart.ipynb"
IMG = Path(os.environ.get("AUTOPAR_SCREENSHOTS") or Path(tempfile.gettempdir()) / "autopar-screenshots")
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage"]

pytestmark = pytest.mark.browser


def _require_chromium() -> None:
    if CHROMIUM.exists():
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail("CI=true but /usr/bin/chromium is missing: .ci/run installs it with "
                    "`apt-get install -y chromium`; run it before `make test`")
    pytest.skip("/usr/bin/chromium is not installed (apt-get install -y chromium); this browser test runs in CI")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def lab(tmp_path):
    """A JupyterLab server (see :func:`jupyterlab_server`) whose root holds the quickstart notebook without its
    cells that run worker processes. Yields (base url, token, root dir)."""
    _require_chromium()
    with jupyterlab_server(tmp_path) as (base, token, root):
        # the widget is what this test drives: cells that run worker processes (verify, launch, torchrun; tagged
        # "runs-processes") are left out, so clicks are not queued behind them (test_notebooks runs them all)
        nb = nbformat.read(NOTEBOOK, as_version=4)
        nb.cells = [c for c in nb.cells if "runs-processes" not in c.metadata.get("tags", [])]
        nbformat.write(nb, root / NOTEBOOK.name)
        yield base, token, root


@contextlib.contextmanager
def jupyterlab_server(tmp_path: Path):
    """A JupyterLab server on 127.0.0.1 with its own config/runtime/settings dirs under ``tmp_path``; killed (whole
    process group, kernels included) on exit. Yields (base url, token, root dir)."""
    root = tmp_path / "root"
    root.mkdir()
    settings = tmp_path / "settings"
    for ext, name, value in [
        ("@jupyterlab/apputils-extension", "notification",
         {"fetchNews": "false", "checkForUpdates": False, "doNotDisturbMode": True}),
        ("@jupyterlab/notebook-extension", "tracker", {"windowingMode": "none"}),
    ]:
        (settings / ext).mkdir(parents=True, exist_ok=True)
        (settings / ext / f"{name}.jupyterlab-settings").write_text(json.dumps(value))
    env = dict(os.environ)
    for var, sub in [("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_RUNTIME_DIR", "runtime"),
                     ("JUPYTERLAB_SETTINGS_DIR", "settings"), ("JUPYTERLAB_WORKSPACES_DIR", "ws"),
                     ("IPYTHONDIR", "ipython")]:
        (tmp_path / sub).mkdir(exist_ok=True)
        env[var] = str(tmp_path / sub)
    env["MPLBACKEND"] = "Agg"
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    port, token = _free_port(), secrets.token_hex(16)
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}", "--port-retries=0",
           "--allow-root", f"--ServerApp.root_dir={root}", f"--IdentityProvider.token={token}",
           "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
           "--LabApp.extension_manager=readonly", "--LabApp.expose_app_in_browser=True",
           f"--LabApp.user_settings_dir={settings}", f"--LabApp.workspaces_dir={tmp_path / 'ws'}"]
    log = open(tmp_path / "lab.log", "w")
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    tail = (tmp_path / "lab.log").read_text()[-3000:]
                    raise RuntimeError(f"JupyterLab did not start:\n{tail}") from None
                time.sleep(0.3)
        yield base, token, root
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=10)
                break
            except subprocess.TimeoutExpired:
                continue
        log.close()


KERNEL_IS = ("() => { const w = window.jupyterapp && jupyterapp.shell.currentWidget;"
             " const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;"
             " return k && k.status === '%s'; }")
"""a page function that is true once the open notebook's kernel has the status given with ``%``"""


STATE_CELL = """
import json
_seed, _gpt = ap.plan, gpt.plan
json.dump({
    "seed_overrides": ap.overrides, "seed_tp": {lp.path: lp.tp for lp in _seed.layers},
    "seed_mesh": [_seed.mesh.dp, _seed.mesh.tp, _seed.mesh.pp], "selection": ap.widget().selection,
    "gpt_overrides": gpt.overrides, "gpt_stages": {lp.path: lp.stage for lp in _gpt.layers},
}, open(STATE_PATH, "w"))
print("state written")
"""


def test_quickstart_widget_in_jupyterlab(lab, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    base, token, root = lab
    state_path = tmp_path / "state.json"
    IMG.mkdir(parents=True, exist_ok=True)
    errors: list[str] = []
    with sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(
            str(tmp_path / "chromium"), executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_FLAGS,
            viewport={"width": 1400, "height": 1700})
        try:
            page = ctx.new_page()
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" and "planner" in m.text else None)
            page.goto(f"{base}/lab/tree/{NOTEBOOK.name}?token={token}")
            page.wait_for_function(
                "() => { const w = window.jupyterapp && jupyterapp.shell.currentWidget;"
                " const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;"
                " return k && k.status === 'idle'; }", timeout=60_000)
            page.evaluate("jupyterapp.commands.execute('notebook:run-all-cells')")

            # both widgets rendered with a laid-out graph
            widgets = page.locator(".ap-root")
            expect(widgets).to_have_count(2, timeout=60_000)
            seed, gpt = widgets.nth(0), widgets.nth(1)
            for w in (seed, gpt):
                expect(w.locator(".ap-svg svg g.node").first).to_be_visible(timeout=30_000)
            expect(seed.locator("tr[data-layer]")).to_have_count(3)
            page.wait_for_timeout(500)
            seed.screenshot(path=str(IMG / "widget_seed.png"))

            # 1. strategy dropdown: pin the first Linear ("0") column-wise
            strat = seed.locator('select.ap-strategy[data-layer="0"]')
            options = strat.locator("option").all_inner_texts()
            assert any("tp-colwise" in o for o in options), options
            strat.select_option("colwise")
            expect(seed.locator(".ap-msg").first).to_contain_text("strategy tp-colwise", timeout=30_000)
            expect(seed.locator('select.ap-strategy[data-layer="0"]')).to_have_value("colwise", timeout=10_000)

            # 2. click a graph node: the second Linear selects its layer ("2") in the editor
            node = seed.locator('.ap-svg g.node[id="op-linear_1"]')
            node.hover()
            expect(seed.locator(".ap-tooltip")).to_contain_text("aten.linear", timeout=5_000)
            node.click()
            expect(seed.locator('tr.ap-selected[data-layer="2"]')).to_have_count(1, timeout=10_000)
            page.wait_for_timeout(300)
            seed.screenshot(path=str(IMG / "widget_edit.png"))

            # search (typing is not taken as notebook shortcuts: the cell count stays), expand the folded block
            cells = page.locator(".jp-Notebook .jp-Cell").count()
            gpt.locator(".ap-search").fill("")
            gpt.locator(".ap-search").type("sdpa")
            expect(gpt.locator(".ap-svg g.node.ap-match")).to_have_count(1, timeout=5_000)
            assert page.locator(".jp-Notebook .jp-Cell").count() == cells
            folded = gpt.locator(".ap-svg g.node").count()
            gpt.locator("button.ap-fold", has_text="expand h").click()
            expect(gpt.locator("button.ap-fold", has_text="fold h")).to_be_visible(timeout=30_000)
            assert gpt.locator(".ap-svg g.node").count() > folded
            expect(gpt.locator(".ap-svg g.node.ap-match")).to_have_count(4)
            gpt.locator("button.ap-fold", has_text="fold h").click()
            expect(gpt.locator("button.ap-fold", has_text="expand h")).to_be_visible(timeout=30_000)
            gpt.locator(".ap-search").fill("")

            # 3. drag a layer to another pipeline stage (GPT, pp=2): h.3 onto lane 0
            gpt.scroll_into_view_if_needed()
            chip = gpt.locator('.ap-chip[data-layer="h.3"]')
            start_stage = int(gpt.locator('.ap-lane:has(.ap-chip[data-layer="h.3"])').get_attribute("data-stage"))
            assert start_stage > 0, "the planner put h.3 on stage 0 already"
            chip.drag_to(gpt.locator('.ap-lane[data-stage="0"]'))
            expect(gpt.locator(".ap-msg").first).to_contain_text("h.3 -> stage 0", timeout=30_000)
            expect(gpt.locator('.ap-lane[data-stage="0"] .ap-chip[data-layer="h.3"]')).to_have_count(1, timeout=10_000)
            page.wait_for_timeout(300)
            gpt.screenshot(path=str(IMG / "widget.png"))
            page.screenshot(path=str(IMG / "jupyterlab.png"), full_page=False)

            # 4. from the kernel: a cell that writes both sessions' state
            state = _kernel_state(page, state_path)

            # 5. drag the boundary in front of the last stage onto h.2, then undo it from the button
            last = gpt.locator(".ap-lane").count() - 1
            gpt.locator(f'.ap-lane[data-stage="{last}"] .ap-boundary').drag_to(
                gpt.locator('.ap-chip[data-layer="h.2"]'))
            expect(gpt.locator(".ap-msg").first).to_contain_text(f"stage {last} starts at h.2", timeout=30_000)
            moved = _kernel_state(page, tmp_path / "state2.json")
            gpt.locator("button.ap-undo").click()
            expect(gpt.locator(".ap-msg").first).to_contain_text("ap.undo()", timeout=30_000)
            undone = _kernel_state(page, tmp_path / "state3.json")
        finally:
            ctx.close()

    assert state["seed_overrides"].get("0") == {"tp": "colwise"}, state
    assert state["seed_tp"]["0"].get("0") == "colwise", state
    assert state["seed_mesh"][1] == 2, f"a colwise layer needs tp=2: {state}"
    assert state["selection"] == "2", state
    assert state["gpt_stages"]["h.3"] == 0, state
    assert state["gpt_overrides"]["h.3"] == {"stage": 0}, state
    assert moved["gpt_stages"]["h.2"] == last and moved["gpt_stages"]["h.1"] < last, moved
    assert undone["gpt_stages"] == state["gpt_stages"] and undone["gpt_overrides"] == state["gpt_overrides"]
    assert not errors, errors


def _kernel_state(page, path: Path) -> dict:
    """Run a new last cell in the notebook that writes the sessions' state to ``path``; return it."""
    return run_cell_writing(page, f"STATE_PATH = {str(path)!r}\n" + STATE_CELL, path)


def run_cell_writing(page, code: str, path: Path) -> dict:
    """Append a code cell to the open notebook, run it, wait until it has written the JSON file ``path``; return
    the file's content (how the browser tests read the kernel's state)."""
    page.evaluate("""async (code) => {
        const panel = jupyterapp.shell.currentWidget, nb = panel.content, model = nb.model;
        model.sharedModel.insertCell(model.cells.length, {cell_type: 'code', source: code});
        nb.activeCellIndex = model.cells.length - 1;
        await jupyterapp.commands.execute('notebook:run-cell');
    }""", code)
    deadline = time.time() + 30
    while not path.exists() and time.time() < deadline:
        time.sleep(0.2)
    assert path.exists(), "the state cell did not run"
    time.sleep(0.2)  # the file may still be being written
    return json.loads(path.read_text())
