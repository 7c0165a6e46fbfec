"""End to end in a real browser: JupyterLab (headless, offline, 127.0.0.1, random port and token, temp dirs) driven
by Debian's chromium through Playwright, at 1400 x 1000 as a new user's window. Each test opens a notebook, runs all,
drives the planner widgets as a user would and checks from the kernel (a cell that writes the sessions' state to a
file) that the plans changed accordingly.

* the quickstart: a strategy dropdown, a click on a graph node, search (count, next), expand/fold keeping the depth,
  a drag between pipeline lanes and the boundary handle, undo;
* readable at every size (issue 12): the seed MLP, GPT-2, LLaMA-70B and a ResNet-50 each fit the panel at first with
  every label >= 9 px on screen, no stray scalar nodes, fit on both axes, expanding keeps the depth and a very tall
  view has a minimap; dark theme;
* controls tell the truth: a rejected edit leaves every control on the plan in force, options the planner cannot plan
  are disabled with the reason, Adopt keeps the alternatives and pins nothing, the change list is grouped;
* the sharding board (issue 20): a chip, a multi-selection and a graph node dropped on a legend swatch each re-plan
  once, a refused lane greys out while dragging, the keyboard does the same, latency measured on a LLaMA-7B.

Screenshots go to $AUTOPAR_SCREENSHOTS (default: a temporary folder); `make screenshots` runs this file and
test_launch_browser.py with `AUTOPAR_SCREENSHOTS=docs/img`, which refreshes the ones the README shows.
Figures are printed (run with -s) for BENCHMARKS.md.

The whole suite runs again in a 1024 px window with the file browser open (AUTOPAR_BROWSER_WIDTH=1024) and in
JupyterLab's dark theme (AUTOPAR_BROWSER_THEME=dark); tests that choose their own window keep it. Every run (CI's
too) has the sharding board and the controls at 1024 px in the dark theme as well, and the layout at 1024 px.

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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from widget_models import RESNET50

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "01_quickstart.ipynb"
IMG = Path(os.environ.get("AUTOPAR_SCREENSHOTS") or Path(tempfile.gettempdir()) / "autopar-screenshots")
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage"]
WINDOW = {"width": int(os.environ.get("AUTOPAR_BROWSER_WIDTH", "1400")), "height": 1000}
"""the window the issues measured in: 1400 px, or AUTOPAR_BROWSER_WIDTH (the whole suite again at 1024: issue 42
asks for 1400 and 1024 px with the file browser open, light and dark)"""
THEME = os.environ.get("AUTOPAR_BROWSER_THEME", "light")
"""JupyterLab's theme the notebooks open in: light, or dark (AUTOPAR_BROWSER_THEME=dark)"""

pytestmark = pytest.mark.browser


def _require_chromium() -> None:
    if CHROMIUM.exists():
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail("CI=true but /usr/bin/chromium is missing: .ci/run installs it with "
                    "`apt-get install -y chromium`; run it before `make test`")
    pytest.skip("/usr/bin/chromium is not installed (apt-get install -y chromium); this browser test runs in CI")


def evaluate_in_blank_page(script: str, args) -> tuple[object, list[str]]:
    """``page.evaluate(script, args)`` in a blank chromium page (a widget's ESM rendered against a plain model, with
    no Jupyter): what it returned, and the page errors it raised."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.set_content("<html><body></body></html>")
            return page.evaluate(script, args), errors
        finally:
            browser.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _settled_box(page, locator, timeout_s: float = 10.0):
    """The locator's bounding box once it has one: a graph redrawn after a click replaces its nodes, and
    between the old node's removal and the new one's layout there is no box to read."""
    deadline = time.monotonic() + timeout_s
    while (box := locator.bounding_box()) is None and time.monotonic() < deadline:
        page.wait_for_timeout(100)
    return box


@contextlib.contextmanager
def jupyterlab_server(tmp_path: Path, *, theme: str | None = None):
    """A JupyterLab server on 127.0.0.1 with its own config/runtime/settings dirs under ``tmp_path``, its notebooks
    opening in ``theme`` ("light" or "dark"; default THEME); killed (whole process group, kernels included) on exit.
    Yields (base url, token, root dir)."""
    root = tmp_path / "root"
    root.mkdir()
    settings = tmp_path / "settings"
    for ext, name, value in [
        ("@jupyterlab/apputils-extension", "notification",
         {"fetchNews": "false", "checkForUpdates": False, "doNotDisturbMode": True}),
        ("@jupyterlab/notebook-extension", "tracker", {"windowingMode": "none"}),
        ("@jupyterlab/apputils-extension", "themes",
         {"theme": "JupyterLab Dark" if (theme or THEME) == "dark" else "JupyterLab Light"}),
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
    # a kernel's tournament saves step-time factors: in a file of this server's, not the suite's (later tests plan)
    env["AUTOPAR_CALIBRATION"] = str(tmp_path / "calibration.json")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent), env.get("PYTHONPATH", "")])
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


@contextlib.contextmanager
def notebook_page(tmp_path: Path, cells: list[str] | nbformat.NotebookNode, *, widgets: int,
                  window: dict | None = None, theme: str | None = None, timeout_ms: int = 120_000):
    """JupyterLab (in ``theme``, default THEME) with a notebook of ``cells`` (or a notebook) run all, until
    ``widgets`` planner widgets show a graph. Yields (page, errors) where errors collects page errors and the
    planner's console errors."""
    from playwright.sync_api import sync_playwright

    _require_chromium()
    nb = cells if isinstance(cells, nbformat.NotebookNode) else nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(c) for c in cells],
        metadata={"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}})
    errors: list[str] = []
    with jupyterlab_server(tmp_path, theme=theme) as (base, token, root), sync_playwright() as pw:
        nbformat.write(nb, root / "nb.ipynb")
        ctx = pw.chromium.launch_persistent_context(
            str(tmp_path / "chromium"), executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_FLAGS,
            viewport=window or WINDOW)
        try:
            page = ctx.new_page()
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" and "planner" in m.text else None)
            page.goto(f"{base}/lab/tree/nb.ipynb?token={token}")
            page.wait_for_function(KERNEL_IS % "idle", timeout=60_000)
            if (window or WINDOW)["width"] < 1400:  # the narrow case of issue 42: the file browser open beside
                page.evaluate("jupyterapp.commands.execute('filebrowser:activate')")
            page.evaluate("jupyterapp.commands.execute('notebook:run-all-cells')")
            page.wait_for_function(f"document.querySelectorAll('.ap-root .ap-svg svg g.node').length > 0 && "
                                   f"document.querySelectorAll('.ap-root .ap-svg svg').length >= {widgets}",
                                   timeout=timeout_ms)
            page.wait_for_function(KERNEL_IS % "idle", timeout=timeout_ms)
            page.wait_for_timeout(800)  # the viewport's size reached Python and the view was chosen for it
            yield page, errors
        finally:
            ctx.close()


STATE_CELL = """
import json
_seed, _gpt = ap.plan, gpt.plan
json.dump({
    "seed_overrides": ap.overrides, "seed_tp": {lp.path: lp.tp for lp in _seed.layers},
    "seed_mesh": [_seed.mesh.dp, _seed.mesh.tp, _seed.mesh.pp], "selection": ap.widget().selection,
    "gpt_overrides": gpt.overrides, "gpt_stages": {lp.path: lp.stage for lp in _gpt.layers}, "gpt_fix": gpt.fix,
}, open(STATE_PATH, "w"))
print("state written")
"""


def test_quickstart_widget_in_jupyterlab(tmp_path):
    from playwright.sync_api import expect

    state_path = tmp_path / "state.json"
    IMG.mkdir(parents=True, exist_ok=True)
    # the widget is what this test drives: cells that run worker processes (verify, launch, torchrun; tagged
    # "runs-processes") are left out, so clicks are not queued behind them (test_notebooks runs them all)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nb.cells = [c for c in nb.cells if "runs-processes" not in c.metadata.get("tags", [])]
    with notebook_page(tmp_path, nb, widgets=2, window={"width": 1400, "height": 1700}) as (page, errors):
        widgets = page.locator(".ap-root")
        expect(widgets).to_have_count(2, timeout=60_000)
        seed, gpt = widgets.nth(0), widgets.nth(1)
        expect(seed.locator("tr[data-layer]")).to_have_count(3)
        # issue 42, point 1: the GPT cell's plan is fresh (no edit yet), so there is nothing to undo
        expect(gpt.locator("button.ap-undo")).to_be_disabled()
        shoot(page, seed, "widget_seed.png")

        # 1. strategy dropdown: pin the first Linear ("0") column-wise
        strat = seed.locator('select.ap-strategy[data-layer="0"]')
        options = strat.locator("option").all_inner_texts()
        assert "TP column" in options, options
        strat.select_option("colwise")
        expect(seed.locator(".ap-msg").first).to_contain_text("strategy TP column", timeout=30_000)
        expect(seed.locator('select.ap-strategy[data-layer="0"]')).to_have_value("colwise", timeout=10_000)

        # 2. click a graph node: the second Linear selects its layer ("2") in the editor
        node = seed.locator('.ap-svg g.node[id="op-linear_1"]')
        node.hover()
        expect(seed.locator(".ap-tooltip")).to_contain_text("aten.linear", timeout=5_000)
        scrolled = page.evaluate(NOTEBOOK_SCROLL)
        node.click()
        expect(seed.locator('tr.ap-selected[data-layer="2"]')).to_have_count(1, timeout=10_000)
        # issue 42, point 3: the click selects without scrolling the notebook (it scrolled to the layer table)
        assert page.evaluate(NOTEBOOK_SCROLL) == scrolled, (scrolled, page.evaluate(NOTEBOOK_SCROLL))
        expect(node).to_be_visible(timeout=10_000)  # the selection redraws the graph: the node is drawn anew
        nb = _settled_box(page, node)
        assert nb and 0 <= nb["y"] and nb["y"] + nb["height"] <= page.viewport_size["height"], nb
        page.wait_for_timeout(300)
        shoot(page, seed, "widget_edit.png")

        # search: typing is not taken as notebook shortcuts (the cell count stays); a count, next and previous
        cells = page.locator(".jp-Notebook .jp-Cell").count()
        gpt.locator(".ap-search").fill("")
        gpt.locator(".ap-search").type("embedding")
        expect(gpt.locator(".ap-search-count")).to_have_text("– of 2", timeout=5_000)
        gpt.locator(".ap-search").press("Enter")
        expect(gpt.locator(".ap-search-count")).to_have_text("1 of 2")
        gpt.locator("button.ap-search-next").click()
        expect(gpt.locator(".ap-search-count")).to_have_text("2 of 2")
        gpt.locator("button.ap-search-prev").click()
        expect(gpt.locator(".ap-search-count")).to_have_text("1 of 2")
        expect(gpt.locator(".ap-svg g.node.ap-match")).to_have_count(2)
        assert page.locator(".jp-Notebook .jp-Cell").count() == cells
        gpt.locator(".ap-search").fill("")
        # expand the folded block: the depth stays what it was
        depth = gpt.locator(".ap-depth-label").inner_text().split(" ")[0]
        folded = gpt.locator(".ap-svg g.node").count()
        gpt.locator("button.ap-fold", has_text="expand h").click()
        expect(gpt.locator("button.ap-fold", has_text="fold h")).to_be_visible(timeout=30_000)
        assert gpt.locator(".ap-svg g.node").count() > folded
        assert gpt.locator(".ap-depth-label").inner_text().split(" ")[0] == depth
        gpt.locator("button.ap-fold", has_text="fold h").click()
        expect(gpt.locator("button.ap-fold", has_text="expand h")).to_be_visible(timeout=30_000)

        # 3. drag a layer to another pipeline stage (GPT, pp=2): h.3 onto lane 0; the lanes say which rank they are
        gpt.scroll_into_view_if_needed()
        assert "pp rank" in gpt.locator(".ap-lane-label").first.inner_text()
        start_stage = int(gpt.locator('.ap-lane:has(.ap-chip[data-layer="h.3"])').get_attribute("data-stage"))
        assert start_stage > 0, "the planner put h.3 on stage 0 already"
        gpt.locator('.ap-chip[data-layer="h.3"]').drag_to(gpt.locator('.ap-lane[data-stage="0"]'))
        expect(gpt.locator(".ap-msg").first).to_contain_text("h.3 -> stage 0", timeout=30_000)
        expect(gpt.locator('.ap-lane[data-stage="0"] .ap-chip[data-layer="h.3"]')).to_have_count(1, timeout=10_000)
        message = gpt.locator(".ap-msg").first.inner_text()
        page.wait_for_timeout(300)
        shoot(page, gpt, "widget.png")
        page.screenshot(path=str(IMG / "jupyterlab.png"), full_page=False)

        # 4. from the kernel: a cell that writes both sessions' state
        state = _kernel_state(page, state_path)

        # 5. drag the boundary in front of the last stage onto h.2, then undo it from the button
        last = gpt.locator(".ap-lane").count() - 1
        gpt.locator(f'.ap-lane[data-stage="{last}"] .ap-boundary').drag_to(gpt.locator('.ap-chip[data-layer="h.2"]'))
        expect(gpt.locator(".ap-msg").first).to_contain_text(f"stage {last} starts at h.2", timeout=30_000)
        moved = _kernel_state(page, tmp_path / "state2.json")
        gpt.locator("button.ap-undo").click()
        expect(gpt.locator(".ap-msg").first).to_contain_text("ap.undo()", timeout=30_000)
        undone = _kernel_state(page, tmp_path / "state3.json")

    assert state["seed_overrides"].get("0") == {"tp": "colwise"}, state
    assert state["seed_tp"]["0"].get("0") == "colwise", state
    assert state["seed_mesh"][1] == 2, f"a colwise layer needs tp=2: {state}"
    assert state["selection"] == "2", state
    assert state["gpt_stages"]["h.3"] == 0, state
    assert state["gpt_overrides"]["h.3"] == {"stage": 0}, state
    # the lanes were kept (pp and its schedule fixed), or the message says what the planner changed
    assert "lanes are kept" in message or "also changed" in message, message
    assert moved["gpt_stages"]["h.2"] == last and moved["gpt_stages"]["h.1"] < last, moved
    assert undone["gpt_stages"] == state["gpt_stages"] and undone["gpt_overrides"] == state["gpt_overrides"]
    assert not errors, errors


NOTEBOOK_SCROLL = """() => [...document.querySelectorAll('.jp-NotebookPanel *')].filter((e) => e.scrollTop > 0 ||
  (e.scrollHeight > e.clientHeight + 1 && /auto|scroll/.test(getComputedStyle(e).overflowY)))
  .map((e) => [e.className, Math.round(e.scrollTop)])"""
"""the notebook's scrolling boxes and how far each is scrolled"""


def shoot(page, locator, name: str, folder: Path | None = None) -> None:
    """Screenshot ``locator`` whole into IMG/name (or ``folder``/name): the window grows to hold it when it is taller
    (an element taller than the window comes out clipped under JupyterLab's toolbars), then goes back to its size."""
    size = page.viewport_size
    need = int(locator.bounding_box()["height"]) + 300
    if need > size["height"]:
        page.set_viewport_size({"width": size["width"], "height": need})
        page.wait_for_timeout(600)
    locator.scroll_into_view_if_needed()
    locator.screenshot(path=str((folder or IMG) / name))
    if need > size["height"]:
        page.set_viewport_size(size)
        page.wait_for_timeout(600)
        page.wait_for_function(KERNEL_IS % "idle", timeout=30_000)


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


def kernel_json(page, tmp_path: Path, expr: str) -> dict:
    """The value of the Python expression ``expr`` in the notebook's kernel (JSON-serialisable)."""
    path = tmp_path / f"k{time.time_ns()}.json"
    return run_cell_writing(page, f"import json; json.dump({expr}, open({str(path)!r}, 'w'))", path)


# ---- issue 12: readable at every size, controls that tell the truth --------------------------------------------------
GRAPH_FACTS = """(root) => {
  const vp = root.querySelector('.ap-viewport').getBoundingClientRect();
  const svg = root.querySelector('.ap-svg svg');
  const box = svg.getBoundingClientRect();
  const sizes = [...svg.querySelectorAll('text')].map((t) => parseFloat(getComputedStyle(t).fontSize) *
    t.getScreenCTM().a);
  return {minFont: Math.min(...sizes), texts: sizes.length, nodes: svg.querySelectorAll('g.node').length,
    inside: box.left >= vp.left - 1 && box.top >= vp.top - 1 && box.right <= vp.right + 1 &&
      box.bottom <= vp.bottom + 1, graph: [Math.round(box.width), Math.round(box.height)],
    viewport: [Math.round(vp.width), Math.round(vp.height)],
    depth: root.querySelector('.ap-depth-label').textContent,
    minimap: getComputedStyle(root.querySelector('.ap-minimap')).display !== 'none',
    clusterLabels: svg.querySelectorAll('.ap-cluster-labels text').length,
    labelBoxes: svg.querySelectorAll('.ap-cluster-labels rect.ap-clabel-bg').length,
    labelsOnTop: svg.lastElementChild.classList.contains('ap-cluster-labels')
      || (svg.querySelector('g.graph') || svg).lastElementChild.classList.contains('ap-cluster-labels'),
    labels: [...svg.querySelectorAll('g.node text')].map((t) => t.textContent)};
}"""

SIZES_CELLS = [
    "%load_ext autopar_nb",
    """%%autoparallel --gpus 2 --gpu h100-80gb --batch 32 --name mlp
import torch, torch.nn as nn
model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 512))
example_inputs = (torch.randn(32, 1024),)""",
    """%%autoparallel --gpus 8 --gpu h100-80gb --batch 64 --name gpt2
import torch
from autopar_nb.zoo import GPT, GPTConfig
model = GPT(GPTConfig())   # GPT-2 124M
example_inputs = (torch.randint(0, 50257, (8, 1024)),)""",
    """%%autoparallel --nodes 8 --gpus 8 --gpu h100-80gb --batch 512 --name llama70b
import torch
from autopar_nb.zoo import Llama, LLAMA_70B
model = Llama(LLAMA_70B)
example_inputs = (torch.randint(0, 128256, (1, 4096)),)""",
    "%%autoparallel --gpus 8 --gpu a100-80gb --batch 256 --name resnet50\n" + RESNET50,
]


def test_readable_at_every_size(tmp_path):
    """Issue 12 points 1 and 7: the first view of four models fits the panel with labels >= 9 px; no stray scalar
    nodes; expanding keeps the depth and a tall view has a minimap; fit works on both axes; dark theme readable."""
    from playwright.sync_api import expect

    IMG.mkdir(parents=True, exist_ok=True)
    with notebook_page(tmp_path, SIZES_CELLS, widgets=4, timeout_ms=240_000) as (page, errors):
        roots = page.locator(".ap-root")
        expect(roots).to_have_count(4)
        facts = {}
        for i, name in enumerate(("mlp", "gpt2", "llama70b", "resnet50")):
            root = roots.nth(i)
            root.scroll_into_view_if_needed()
            facts[name] = root.evaluate(GRAPH_FACTS)
        print("\nfirst view at 1400x1000:", json.dumps({k: {x: v[x] for x in ("minFont", "texts", "nodes", "graph",
                                                                                  "viewport", "depth", "inside")}
                                                       for k, v in facts.items()}))
        for name, f in facts.items():
            assert f["minFont"] >= 9, (name, f)
            assert f["inside"], (name, f)
            # cluster labels drawn after the edges, each on a box of its cluster's fill: no edge runs through one
            assert f["labelsOnTop"] and f["labelBoxes"] == f["clusterLabels"] > 0, (name, f)
        assert not any(t.startswith("add_") for t in facts["resnet50"]["labels"]), "stray add_ nodes"
        roots.nth(3).scroll_into_view_if_needed()
        roots.nth(3).locator(".ap-graph").screenshot(path=str(IMG / "widget_resnet50.png"))

        # GPT-2: pick the full depth, then expand the 12 blocks: the depth stays, the tall view gets a minimap
        gpt = roots.nth(1)
        gpt.scroll_into_view_if_needed()
        depth = gpt.locator("input.ap-depth")
        depth.evaluate("(e) => { e.value = e.max; e.dispatchEvent(new Event('change')); }")
        expect(gpt.locator(".ap-depth-label")).to_contain_text("3/3", timeout=30_000)
        gpt.locator("button.ap-fold", has_text="expand h").click()
        expect(gpt.locator("button.ap-fold", has_text="fold h")).to_be_visible(timeout=30_000)
        page.wait_for_timeout(500)
        expanded = gpt.evaluate(GRAPH_FACTS)
        assert expanded["depth"].startswith("3/3"), expanded["depth"]
        assert expanded["minFont"] >= 9 and expanded["minimap"], expanded
        assert expanded["labelBoxes"] == expanded["clusterLabels"] > 12, "submodule clusters' labels get boxes too"
        gpt.locator(".ap-graph").screenshot(path=str(IMG / "widget_minimap.png"))
        gpt.locator("button.ap-fit").click()
        page.wait_for_timeout(200)
        whole = gpt.evaluate(GRAPH_FACTS)
        assert whole["inside"], whole
        print("GPT-2 expanded at depth 3:", {k: expanded[k] for k in ("graph", "depth", "minimap", "minFont")},
              "fit:", whole["graph"], "in", whole["viewport"])

        # dark theme: every text readable against what is behind it
        page.evaluate("jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Dark'})")
        page.wait_for_function("() => document.body.dataset.jpThemeLight === 'false'", timeout=20_000)
        page.wait_for_timeout(1200)
        mlp = roots.nth(0)
        mlp.locator('select.ap-global[data-key="zero_stage"]').select_option("3")
        expect(mlp.locator(".ap-msg").first).to_contain_text("ZeRO = 3", timeout=30_000)
        low = mlp.evaluate(CONTRAST)
        shoot(page, mlp, "widget_dark.png")
        roots.nth(3).locator(".ap-graph").scroll_into_view_if_needed()
        roots.nth(3).locator(".ap-graph").screenshot(path=str(IMG / "widget_resnet50_dark.png"))
        page.evaluate("jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Light'})")
    assert not low, low
    assert not errors, errors


# the texts of the widget's controls whose colour is too close to their background (WCAG contrast < 3)
CONTRAST = """(root) => {
  const rgb = (s) => (s.match(/[\\d.]+/g) || []).map(Number);
  const lum = (c) => { const [r, g, b] = c.slice(0, 3).map((v) => { v /= 255;
    return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; }); return 0.2126 * r + 0.7152 * g + 0.0722 * b; };
  const bg = (e) => { for (let x = e; x; x = x.parentElement) { const c = rgb(getComputedStyle(x).backgroundColor);
    if (c.length === 3 || (c.length === 4 && c[3] > 0.5)) return c; } return [255, 255, 255]; };
  const out = [];
  for (const e of root.querySelectorAll('button, select, input, .ap-summary, .ap-slane-label, .ap-schip, .ap-chip, '
                                        + '.ap-panel-title, .ap-legend-item')) {
    if (!e.offsetParent || e.disabled) continue;
    const a = lum(rgb(getComputedStyle(e).color)), b = lum(bg(e));
    const ratio = (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05);
    if (ratio < 3) out.push(`${e.className || e.tagName}: ${ratio.toFixed(2)}`);
  }
  return out;
}"""

WHY_CONTRAST = """(e) => {
  const rgb = (s) => (s.match(/[\\d.]+/g) || []).map(Number);
  const lum = (c) => { const [r, g, b] = c.slice(0, 3).map((v) => { v /= 255;
    return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; }); return 0.2126 * r + 0.7152 * g + 0.0722 * b; };
  let back = [255, 255, 255], alpha = 1;
  for (let x = e; x; x = x.parentElement) { const c = rgb(getComputedStyle(x).backgroundColor);
    if (c.length === 3 || (c.length === 4 && c[3] > 0.5)) { back = c.slice(0, 3); break; } }
  for (let x = e; x; x = x.parentElement) alpha *= parseFloat(getComputedStyle(x).opacity);
  const seen = rgb(getComputedStyle(e).color).slice(0, 3).map((v, i) => alpha * v + (1 - alpha) * back[i]);
  const a = lum(seen), b = lum(back);
  return (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05);
}"""
"""the contrast of an element's text with the background under it, its own and its ancestors' opacity applied"""

TRUTH_CELLS = [
    "%load_ext autopar_nb",
    """%%autoparallel --gpus 8 --gpu h100-80gb --batch 32 --name ap
import torch, torch.nn as nn
model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 512))
example_inputs = (torch.randn(32, 1024),)""",
    """%%autoparallel --gpus 4 --gpu h100-80gb --batch 16 --name llama
import torch
from autopar_nb.zoo import Llama, LlamaConfig
model = Llama(LlamaConfig(vocab_size=8192, dim=512, n_layers=8, n_heads=8, n_kv_heads=8, ffn_dim=1024))
example_inputs = (torch.randint(0, 8192, (4, 256)),)""",
]


@pytest.mark.parametrize("window, theme", [(None, None), ({"width": 1024, "height": 1000}, "dark")],
                         ids=["default", "1024px-dark"])
def test_controls_tell_the_truth(tmp_path, window, theme):
    """Issue 12 points 3-5: a rejected edit leaves every control on the plan in force; options the planner cannot plan
    are disabled with the reason; Adopt keeps the alternatives and pins nothing; the change list is grouped with the
    raw list behind a disclosure; units are chosen per value. Issue 42: also at 1024 px (the file browser open) in
    the dark theme; the README's picture is the default case's."""
    from playwright.sync_api import expect

    with notebook_page(tmp_path, TRUTH_CELLS, widgets=2, window=window, theme=theme) as (page, errors):
        seed, llama = page.locator(".ap-root").nth(0), page.locator(".ap-root").nth(1)
        header = seed.locator(".ap-summary").inner_text()
        assert "µs/step" in header and "0.00 GiB" not in header, header
        canvas = seed.locator(".ap-svg")
        fitted = canvas.evaluate("(e) => e.style.transform")
        # zoomed by the user: a re-plan keeps the view where it is
        seed.locator("button.ap-zoom-in").click()
        zoomed = canvas.evaluate("(e) => e.style.transform")
        assert zoomed != fitted, zoomed
        # pin layer 0 column-wise (tp >= 2), then ask for tp=1: refused, and the tp control shows the plan's
        seed.locator('select.ap-strategy[data-layer="0"]').select_option("colwise")
        expect(seed.locator(".ap-msg").first).to_contain_text("TP column", timeout=30_000)
        page.wait_for_timeout(300)
        assert canvas.evaluate("(e) => e.style.transform") == zoomed, "a re-plan moved the view the user zoomed"
        # "fit": from now on a re-plan re-fits the view (the whole graph, output node included, stays in view)
        seed.locator("button.ap-fit").click()
        tp = seed.locator('select.ap-global[data-key="tp"]')
        expect(tp.locator('option[value="1"]')).to_be_disabled()
        assert "tensor-parallel style" in tp.locator('option[value="1"]').inner_text()
        tp.evaluate("(e) => { e.value = '1'; e.dispatchEvent(new Event('change')); }")  # as if it were offered
        expect(seed.locator(".ap-msg-error")).to_contain_text("was not applied", timeout=30_000)
        expect(tp).to_have_value("auto")
        planned_tp = kernel_json(page, tmp_path, "ap.plan.mesh.tp")
        assert planned_tp >= 2 and tp.locator("option:checked").inner_text() == f"auto ({planned_tp})"
        # fixed tp=2 on 8 GPUs: pp=8 cannot be planned, offered disabled with the reason
        tp.select_option("2")
        expect(seed.locator(".ap-msg").first).to_contain_text("tp = 2", timeout=30_000)
        page.wait_for_timeout(300)
        refit = seed.evaluate(GRAPH_FACTS)
        assert refit["inside"] and "output" in refit["labels"], refit
        pp8 = seed.locator('select.ap-global[data-key="pp"] option[value="8"]')
        expect(pp8).to_be_disabled()
        reason = pp8.inner_text()
        # Adopt: the alternative becomes the plan, nothing new is pinned, the panel stays
        fix_before = kernel_json(page, tmp_path, "ap.fix")
        alt = kernel_json(page, tmp_path, "ap.plan.alternatives[0].summary().split(' | ')[0]")
        seed.locator("button.ap-adopt").first.click()
        expect(seed.locator(".ap-msg").first).to_contain_text("ap.adopt(0)", timeout=30_000)
        expect(seed.locator(".ap-alternatives")).to_be_visible()
        after = kernel_json(page, tmp_path, "[ap.fix, ap.plan.summary().split(' | ')[0]]")
        assert after == [fix_before, alt], (after, fix_before, alt)
        shoot(page, seed, "widget_alternatives.png", None if window is None else tmp_path)

        # LLaMA: tp 1 -> 4 changes hundreds of fields; the panel groups them, the raw list is behind a disclosure
        llama.scroll_into_view_if_needed()
        llama.locator('select.ap-global[data-key="tp"]').select_option("4")
        expect(llama.locator(".ap-msg").first).to_contain_text("tp = 4", timeout=30_000)
        groups = llama.locator(".ap-change-groups li").all_inner_texts()
        raw = llama.locator(".ap-raw-changes")
        assert raw.evaluate("e => !e.open")
        n_raw = int(raw.locator("summary").inner_text().split()[1])
        assert len(groups) <= 9 and n_raw > 60, (groups, n_raw)
        assert any("replicate → colwise on" in g and "(wq, wk, wv, w1, w3" in g for g in groups), groups
        llama.locator(".ap-changes").screenshot(path=str(IMG / "widget_changes.png"))
        # every layer changed: the graph outlines none (it would mark everything)
        assert llama.locator(".ap-svg g.ap-changed-node").count() == 0
        print(f"\nchange list: {n_raw} raw changes shown as {len(groups)} groups; pp=8 option: {reason!r}")
    assert not errors, errors


# ---- issue 20: the sharding board ------------------------------------------------------------------------------------
# dp=2 pinned: the board's FSDP lane needs data parallelism, which this host-bound model's plan trades for pp=2
BOARD_CELLS = [
    "%load_ext autopar_nb",
    """%%autoparallel --gpus 4 --gpu h100-80gb --batch 32 --fix dp=2,tp=2,zero=3 --name gpt
import torch
from autopar_nb.zoo import GPT, GPTConfig
model = GPT(GPTConfig(n_layer=12, n_embd=256, n_head=4, vocab_size=8192, block_size=256))
example_inputs = (torch.randint(0, 8192, (8, 256)),)""",
]
STRATEGY = "__import__('autopar_nb.widget.editor', fromlist=['x']).current_strategy"
BOARD_STATE = ("{'overrides': gpt.overrides, 'undo': len(gpt._undo), "
               f"'split': {{lp.path: {STRATEGY}(lp, gpt.plan) for lp in gpt.plan.layers}}, "
               "'recompute': {lp.path: lp.recompute for lp in gpt.plan.layers}}")


def _drop_timer(page) -> None:
    """Start a clock at the next drop (or Enter) and stop it at the next re-render of a planner widget."""
    page.evaluate("""() => {
      window.__apT0 = null; window.__apT1 = null;
      const start = () => { if (window.__apT0 === null) window.__apT0 = performance.now(); };
      document.addEventListener('drop', start, {capture: true, once: true});
      document.addEventListener('keydown', (e) => { if (e.key === 'Enter') start(); }, {capture: true, once: true});
      const board = document.querySelector('.ap-board');
      const mo = new MutationObserver(() => { if (window.__apT0 !== null && window.__apT1 === null &&
        !document.querySelector('.ap-root.ap-busy')) { window.__apT1 = performance.now(); mo.disconnect(); } });
      mo.observe(board, {childList: true, subtree: true});
    }""")


def _drop_ms(page) -> float:
    page.wait_for_function("() => window.__apT1 !== null", timeout=30_000)
    return page.evaluate("() => window.__apT1 - window.__apT0")


@pytest.mark.parametrize("window, theme", [(None, None), ({"width": 1024, "height": 1000}, "dark")],
                         ids=["default", "1024px-dark"])
def test_sharding_board(tmp_path, window, theme):
    """Issue 20: drag a chip (a folded block), a multi-selection and a graph node onto a swatch; a refused lane greys
    out with the reason while dragging and takes no drop; the keyboard does what a drag does; one drop is one
    re-plan and one undo step; each message shows the Python call. Issue 42: the same in the window and theme the
    suite runs in, and at 1024 px (the file browser open) in the dark theme."""
    from playwright.sync_api import expect

    def shot(path: Path) -> str:  # the README's pictures are the default case's; the other case's stay in tmp_path
        return str(path if window is None else tmp_path / path.name)

    IMG.mkdir(parents=True, exist_ok=True)
    with notebook_page(tmp_path, BOARD_CELLS, widgets=1, window=window, theme=theme) as (page, errors):
        w = page.locator(".ap-root").first
        board = w.locator(".ap-board")
        lanes = board.locator(".ap-slane[data-lane]").evaluate_all("(ls) => ls.map((l) => l.dataset.lane)")
        assert lanes[:3] == ["replicate", "fsdp", "colwise-rowwise"] and "vocab" in lanes, lanes
        before = kernel_json(page, tmp_path, BOARD_STATE)
        # the state cell scrolls the notebook; a lane left partly under the notebook's toolbar is scrolled by
        # drag_to while the button is down, and Chromium then starts no drag (no dragstart: seen at 1024 px)
        board.scroll_into_view_if_needed()
        block = board.locator('.ap-schip[data-key="h.0"]')
        expect(block).to_contain_text("h.0–11")

        # 1. the folded block's chip onto "FSDP unit": every member, one re-plan, one undo step
        _drop_timer(page)
        block.drag_to(board.locator('.ap-slane[data-lane="fsdp"]'))
        expect(w.locator(".ap-msg").first).to_contain_text("ap.override('h.*', tp='replicate', fsdp=True)",
                                                          timeout=30_000)
        one = kernel_json(page, tmp_path, BOARD_STATE)
        assert all(one["split"][f"h.{i}"] == "fsdp" for i in range(12)), one["split"]
        assert one["undo"] == before["undo"] + 1 and one["overrides"] == {"h.*": {"tp": "replicate", "fsdp": True}}
        t_block = _drop_ms(page)

        # 2. split the block apart, select h.3..h.7 (click, shift-click), drag them onto "TP col → row"
        board.locator('.ap-schip[data-key="h.0"] button.ap-split-apart').click()
        expect(board.locator(".ap-schip[data-key]")).to_have_count(12 + 4, timeout=5_000)  # + wte wpe ln_f lm_head
        board.locator('.ap-schip[data-key="h.3"]').click()
        board.locator('.ap-schip[data-key="h.7"]').click(modifiers=["Shift"])
        expect(board.locator(".ap-schip.ap-selected")).to_have_count(5)
        _drop_timer(page)
        board.scroll_into_view_if_needed()
        board.locator('.ap-schip[data-key="h.5"]').drag_to(board.locator('.ap-slane[data-lane="colwise-rowwise"]'))
        expect(w.locator(".ap-msg").first).to_contain_text("ap.override('h.[3-7]', tp='colwise-rowwise')",
                                                          timeout=30_000)
        many = kernel_json(page, tmp_path, BOARD_STATE)
        assert [many["split"][f"h.{i}"] for i in range(12)] == ["fsdp"] * 3 + ["colwise-rowwise"] * 5 + ["fsdp"] * 4
        assert many["undo"] == one["undo"] + 1, "five layers, one undo step"
        t_many = _drop_ms(page)
        expect(board.locator('.ap-slane[data-lane="colwise-rowwise"] .ap-schip')).to_have_count(5)
        board.screenshot(path=shot(IMG / "widget_board.png"))

        # the folded block in the graph says its members differ, in colour and words, and opens on a click
        graph = w.locator(".ap-graph")
        graph.scroll_into_view_if_needed()
        label = w.locator(".ap-svg text.ap-clabel", has_text="7 FSDP unit, 5 TP col → row")
        expect(label).to_have_count(1, timeout=10_000)
        assert w.locator(".ap-svg g.cluster.ap-differs").count() == 1
        assert w.locator(".ap-svg g.node polygon[fill^='url(']").count() + w.locator(
            ".ap-svg g.node path[fill^='url(']").count() > 0, "a member split shows as a two-colour fill"
        graph.screenshot(path=shot(IMG / "widget_fold_differs.png"))
        label.click()
        expect(w.locator("button.ap-fold", has_text="fold h")).to_be_visible(timeout=30_000)
        assert w.locator(".ap-svg text.ap-clabel", has_text="h.5").count() >= 1
        w.locator("button.ap-fold", has_text="fold h").click()
        expect(w.locator("button.ap-fold", has_text="expand h")).to_be_visible(timeout=30_000)
        board.scroll_into_view_if_needed()

        # 3. a refused lane: while wte is dragged, "TP col → row" greys out with the planner's reason; no drop
        wte = board.locator('.ap-schip[data-key="wte"]')
        target = board.locator('.ap-slane[data-lane="colwise-rowwise"]')
        # the drag's events dispatched one by one: with Debian's chromium 150 and playwright 1.65 a native drag held
        # open by page.mouse (down, move, inspect, up) never returns from the move (drag_to still works)
        dt = page.evaluate_handle("() => new DataTransfer()")
        wte.dispatch_event("dragstart", {"dataTransfer": dt})
        target.dispatch_event("dragenter", {"dataTransfer": dt})
        target.dispatch_event("dragover", {"dataTransfer": dt})
        refused_class = target.get_attribute("class")
        why = target.locator(".ap-slane-why").inner_text()
        why_contrast = target.locator(".ap-slane-why").evaluate(WHY_CONTRAST)  # the lane greys; its reason must not
        board.screenshot(path=shot(IMG / "widget_board_refused.png"))
        target.dispatch_event("drop", {"dataTransfer": dt})
        wte.dispatch_event("dragend", {"dataTransfer": dt})
        assert "ap-refused" in refused_class and "Linear pair" in why, (refused_class, why)
        page.wait_for_timeout(500)
        assert kernel_json(page, tmp_path, BOARD_STATE)["undo"] == many["undo"], "a refused drop sends nothing"

        # 4. keyboard: focus h.9, space, arrow down to "TP col → row", Enter
        chip = board.locator('.ap-schip[data-key="h.8"]')
        chip.click()
        page.keyboard.press("ArrowRight")
        page.keyboard.press("Space")
        expect(board.locator(".ap-schip.ap-selected")).to_have_count(2)  # h.8 and h.9
        for _ in range(8):
            page.keyboard.press("ArrowDown")
            if board.locator('.ap-slane.ap-kbd-target[data-lane="colwise-rowwise"]').count():
                break
        expect(board.locator('.ap-slane.ap-kbd-target[data-lane="colwise-rowwise"]')).to_have_count(1)
        _drop_timer(page)
        page.keyboard.press("Enter")
        expect(w.locator(".ap-msg").first).to_contain_text("ap.override('h.[8-9]', tp='colwise-rowwise')",
                                                          timeout=30_000)
        keys = kernel_json(page, tmp_path, BOARD_STATE)
        assert keys["split"]["h.8"] == keys["split"]["h.9"] == "colwise-rowwise"
        t_keys = _drop_ms(page)

        # 5. a rubber band over h.10, then one with shift over h.11, selects both (one band each: in a narrow lane
        # the two chips may sit on two rows, and one box over both then touches the chips between them)
        fsdp_lane = board.locator('.ap-slane[data-lane="fsdp"]')
        fsdp_lane.scroll_into_view_if_needed()  # the mouse reaches only what is inside the window
        for i, key in ((10, None), (11, "Shift")):
            c = board.locator(f'.ap-schip[data-key="h.{i}"]').bounding_box()
            page.mouse.move(c["x"] + 2, c["y"] - 2)  # the gap above the chip: the board's background
            if key:
                page.keyboard.down(key)
            page.mouse.down()
            page.mouse.move(c["x"] + c["width"] - 2, c["y"] + c["height"] / 2, steps=8)
            page.mouse.up()
            if key:
                page.keyboard.up(key)
        expect(board.locator(".ap-schip.ap-selected")).to_have_count(2)
        assert sorted(board.locator(".ap-schip.ap-selected").evaluate_all("(c) => c.map((x) => x.dataset.key)")) == [
            "h.10", "h.11"]

        # 6. a graph node onto a legend swatch: lm_head's node onto "vocab-parallel"
        w.locator(".ap-graph").scroll_into_view_if_needed()
        head = w.locator(".ap-svg g.node", has_text="linear").last
        swatch = w.locator('.ap-legend-item[data-strategy="vocab"]')
        hb, sb = head.bounding_box(), swatch.bounding_box()
        page.mouse.move(hb["x"] + hb["width"] / 2, hb["y"] + hb["height"] / 2)
        page.mouse.down()
        page.mouse.move(sb["x"] + 6, sb["y"] + sb["height"] / 2, steps=10)
        ghost = w.locator(".ap-ghost").inner_text()
        page.mouse.up()
        expect(w.locator(".ap-msg").first).to_contain_text("ap.override('lm_head', tp='vocab')", timeout=30_000)
        node = kernel_json(page, tmp_path, BOARD_STATE)
        assert node["overrides"]["lm_head"] == {"tp": "vocab"} and node["split"]["lm_head"] == "vocab", node
        assert "vocab" in ghost, ghost

        # 6b. a cluster (the folded block, by its label) onto "replicated": every member, one re-plan
        w.locator(".ap-graph").scroll_into_view_if_needed()
        label = w.locator(".ap-svg text.ap-clabel", has_text="h × 12").first
        lb, rb = label.bounding_box(), w.locator('.ap-legend-item[data-strategy="replicate"]').bounding_box()
        page.mouse.move(lb["x"] + 8, lb["y"] + lb["height"] / 2)
        page.mouse.down()
        page.mouse.move(rb["x"] + 6, rb["y"] + rb["height"] / 2, steps=10)
        page.mouse.up()
        expect(w.locator(".ap-msg").first).to_contain_text("ap.override('h.*', tp='replicate', fsdp=False)",
                                                          timeout=30_000)
        cluster = kernel_json(page, tmp_path, BOARD_STATE)
        assert all(cluster["split"][f"h.{i}"] == "replicate" for i in range(12)), cluster["split"]
        assert cluster["undo"] == node["undo"] + 1

        # long press on a node (touch, or a held button) opens the same menu as a right click
        w.locator(".ap-graph").scroll_into_view_if_needed()  # the state cell scrolled the notebook down
        ln = w.locator(".ap-svg g.node", has_text="layer_norm").first.bounding_box()
        page.mouse.move(ln["x"] + ln["width"] / 2, ln["y"] + ln["height"] / 2)
        page.mouse.down()
        page.wait_for_timeout(900)
        expect(w.locator(".ap-menu")).to_be_visible()
        page.mouse.up()
        page.keyboard.press("Escape")
        expect(w.locator(".ap-menu")).to_be_hidden()

        # 7. the right-click menu on a node: valid splits enabled, the others disabled with the reason
        w.locator(".ap-svg g.node", has_text="layer_norm").first.click(button="right")
        menu = w.locator(".ap-menu")
        expect(menu).to_be_visible()
        assert page.locator(".lm-Menu:visible").count() == 0, "JupyterLab's own context menu opened over ours"
        pair = menu.locator('.ap-menu-item[data-strategy="colwise-rowwise"]')
        assert pair.is_disabled() and "Linear pair" in pair.inner_text(), pair.inner_text()
        assert menu.locator('.ap-menu-item[data-strategy="replicate"]').is_enabled()
        # a norm takes sequence parallelism: GPT's learned positions are added before the blocks, where the
        # activations are whole (the planner's rule, cost/tp_sequence.py), so the menu offers it
        sp_item = menu.locator('.ap-menu-item[data-strategy="sequence_parallel"]')
        assert sp_item.is_enabled() and "cannot" not in sp_item.inner_text(), sp_item.inner_text()
        w.locator(".ap-graph").screenshot(path=shot(IMG / "widget_menu.png"))
        page.keyboard.press("Escape")

        # dark theme screenshot of the board
        page.evaluate("jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Dark'})")
        page.wait_for_function("() => document.body.dataset.jpThemeLight === 'false'", timeout=20_000)
        page.wait_for_timeout(1000)
        board.scroll_into_view_if_needed()
        board.screenshot(path=shot(IMG / "widget_board_dark.png"))
        low = w.evaluate(CONTRAST)
        page.evaluate("jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Light'})")
        print(f"\nboard drop -> re-rendered (GPT 12 layers): block {t_block:.0f} ms, 5 chips {t_many:.0f} ms, "
              f"keyboard {t_keys:.0f} ms; a refused lane's reason at {why_contrast:.2f}:1 contrast")
    assert not low, low
    assert why_contrast >= 3, why_contrast
    assert not errors, errors


LATENCY_CELLS = [
    "%load_ext autopar_nb",
    """%%autoparallel --gpus 8 --gpu h100-80gb --batch 64 --name llama7b
import torch
from autopar_nb.zoo import Llama, LlamaConfig
model = Llama(LlamaConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008))
example_inputs = (torch.randint(0, 32000, (1, 4096)),)""",
]


@pytest.mark.serial
def test_board_latency_llama7b(tmp_path):
    """Issue 20 point 7: from the drop to the re-rendered widget, for a LLaMA-7B-sized graph (goal: <= 0.3 s)."""
    from playwright.sync_api import expect

    from autopar_nb.units import parse_time

    with notebook_page(tmp_path, LATENCY_CELLS, widgets=1) as (page, errors):
        w = page.locator(".ap-root").first
        board = w.locator(".ap-board")
        board.scroll_into_view_if_needed()
        board.locator('.ap-schip[data-key="layers.0"] button.ap-split-apart').click()
        times, replans, renders, kernel, parts = [], [], [], [], []
        for i, lane in enumerate(("fsdp", "replicate", "fsdp", "replicate", "fsdp")):
            board.locator(f'.ap-schip[data-key="layers.{i + 10}"]').click()
            board.locator(f'.ap-schip[data-key="layers.{i + 20}"]').click(modifiers=["Control"])
            _drop_timer(page)
            board.locator(f'.ap-schip[data-key="layers.{i + 10}"]').drag_to(
                board.locator(f'.ap-slane[data-lane="{lane}"]'))
            expect(w.locator(".ap-msg").first).to_contain_text("re-planned", timeout=30_000)
            times.append(_drop_ms(page))
            said = w.locator(".ap-msg").first.inner_text().split("re-planned in ")[1].split(" (")[0]
            replans.append(parse_time(said) * 1e3)
            renders.append(float(w.get_attribute("data-render-ms")))
            parts.append(w.get_attribute("data-render-parts"))
            kernel.append(float(w.get_attribute("data-kernel-ms")))
            page.wait_for_timeout(300)
        state = kernel_json(page, tmp_path, f"{{p: {STRATEGY}(llama7b.plan.layer(p), llama7b.plan) "
                            "for p in ('layers.14', 'layers.24', 'layers.13')}")
        times.sort()
        print(f"\nLLaMA-7B drop -> re-rendered: median {times[len(times) // 2]:.0f} ms, all {[round(t) for t in times]}"
              f" ms; planner re-plan {sorted(replans)} ms; kernel (re-plan + refresh) {sorted(kernel)} ms; "
              f"front-end re-render {sorted(renders)} ms (per part: {'; '.join(parts)})")
    assert state == {"layers.14": "fsdp", "layers.24": "fsdp", "layers.13": "replicate"}, state
    assert times[len(times) // 2] < 1000, times  # the goal is 300 ms; the 2-core CI box is shared
    assert not errors, errors


NARROW_CELLS = [TRUTH_CELLS[0], TRUTH_CELLS[2]]


def test_the_layout_holds_at_1024_px_with_the_file_browser_open(tmp_path):
    """Issue 42, point 2, in JupyterLab itself: at 1024 px with the file browser open the graph column shrank to
    186 px, the search ↑/↓ buttons lay over the "Memory per rank" title, the legend spilled out, the side column
    scrolled on its own and tables were cut. The blank-page checks (test_widget
    test_the_layout_holds_in_a_narrow_notebook_column) run at the same ~700 px; this one is the real column."""
    from test_widget import LAYOUT

    with notebook_page(tmp_path, NARROW_CELLS, widgets=1, window={"width": 1024, "height": 900}) as (page, errors):
        page.evaluate("jupyterapp.commands.execute('filebrowser:activate')")
        page.wait_for_function("() => { const b = document.querySelector('#filebrowser');"
                               " return b && b.getBoundingClientRect().width > 100; }")
        page.wait_for_timeout(800)  # the notebook column took its new width; the planner re-laid itself out
        root = page.locator(".ap-root").first
        root.scroll_into_view_if_needed()
        seen = page.evaluate(LAYOUT)
        root.screenshot(path=str(tmp_path / "narrow.png"))
        # the memory timeline's chart (static/timeline.js, bundled with uPlot) drew, its peak labelled in the widget
        page.locator(".ap-timeline").scroll_into_view_if_needed()
        peak = page.evaluate("""() => { const b = (s) => document.querySelector(s).getBoundingClientRect();
          const l = b('.ap-tl-peak'), p = b('.ap-timeline .u-over'), r = b('.ap-root');
          return {text: document.querySelector('.ap-tl-peak').textContent, w: l.width, inPlot: l.left >= p.left - 1
            && l.right <= p.right + 1 && l.top >= p.top - 1 && l.bottom <= p.bottom + 1, chart: p.width,
            inRoot: p.right <= r.right + 1}; }""")
        page.locator(".ap-timeline").screenshot(path=str(tmp_path / "timeline.png"))
    assert not errors, errors
    print("\nlayout at 1024 px with the file browser open:", seen, "timeline:", peak)
    assert peak["text"].startswith("peak ") and peak["w"] > 20 and peak["inPlot"] and peak["inRoot"], peak
    assert peak["chart"] > 0.5 * seen["root"], peak  # the timeline spans the narrow widget's columns
    assert seen["root"] < 800, seen  # the narrow column this test is about
    assert seen["graph"] >= 0.6 * seen["root"], seen
    assert not seen["overlaps"] and not seen["toolbarOut"] and not seen["spill"], seen
    assert not seen["sideScrolls"] and not seen["clipped"], seen
