"""The launch dashboard's front end (static/dashboard.js) in chromium, rendered from a Run's traits (no JupyterLab,
no worker processes: a stub model fed the traits ``launch/dashboard.py`` computes from a Run fed by hand), in a
card as wide as a notebook's output area in a 1024 px window with the file browser open:

* the rank table of 8 ranks in JupyterLab at 1024 px with the file browser open scrolls inside its card (its last
  column reachable), nothing past the output area;
* before the first step (or sample) a chart says what it waits for instead of drawing empty axes;
* one figure, one meaning: the rank table's peak and the end summary's are the same figure (the one the widget shows,
  ``report.peak_figures``), under the same label, against the same prediction;
"""

from __future__ import annotations

import pytest
import test_browser

pytestmark = pytest.mark.browser

MIB = 2**20
OUTPUT_WIDTH = 640
"""px: a notebook cell's output area in a 1024 px window with the file browser open (measured in JupyterLab 4)"""

PAGE = """async ([esm, css, state, width]) => {
  const style = document.createElement("style");
  style.textContent = css;
  document.head.append(style);
  const mod = await import(URL.createObjectURL(new Blob([esm], {type: "text/javascript"})));
  const el = document.createElement("div");
  el.style.width = `${width}px`;
  document.body.append(el);
  mod.default.render({model: {get: (k) => state[k], on: () => {}, send: () => {}}, el});
  await new Promise((r) => setTimeout(r, 300));
  const text = (s) => [...el.querySelectorAll(s)].map((e) => e.textContent.trim());
  return {
    peaks: [...el.querySelectorAll("tr[data-rank]")].map((tr) => ({
      rank: tr.dataset.rank, peak: tr.children[4].textContent, label: tr.children[4].title,
      pred: tr.children[5].textContent})),
    summary: text(".apd-summary p").find((t) => t.includes("rank 0")) || null,
    cards: Object.fromEntries([...el.querySelectorAll(".apd-card[data-chart]")].map((c) => [c.dataset.chart,
      c.classList.contains("apd-waiting") && getComputedStyle(c.querySelector(".apd-chart")).visibility === "hidden"
        ? c.querySelector(".apd-chart-wait").textContent : "axes"])),
  };
}"""


TABLE = """(dash) => {  // the rank table against its card, before and after scrolling it to its last column
  const card = dash.getBoundingClientRect(), wrap = dash.querySelector(".apd-table-wrap");
  const out = dash.closest(".jp-OutputArea-output") || dash.parentElement;
  const cols = wrap.querySelectorAll("thead th"), last = cols[cols.length - 1];
  const seen = {rows: wrap.querySelectorAll("tr[data-rank]").length, cardRight: card.right,
                outputRight: out.getBoundingClientRect().right, outputScrolls: out.scrollWidth > out.clientWidth + 1,
                wrapRight: wrap.getBoundingClientRect().right, scrolls: wrap.scrollWidth > wrap.clientWidth + 1,
                lastVisible: last.getBoundingClientRect().right <= wrap.getBoundingClientRect().right + 1};
  wrap.scrollLeft = wrap.scrollWidth;
  return {...seen, lastReached: last.getBoundingClientRect().right <= wrap.getBoundingClientRect().right + 1,
          lastLeftOfCard: last.getBoundingClientRect().right <= card.right};
}"""
EIGHT_RANKS = """from pathlib import Path; import tempfile
from test_dashboard_browser import cpu_run
cpu_run(Path(tempfile.mkdtemp()), nproc=8).dashboard()"""


def board_state(board) -> dict:
    """The traits a Dashboard sends its front end."""
    keys = ("status", "message", "error", "hang", "ranks", "info", "timeline", "steps", "summary", "events", "replan")
    return {k: getattr(board, k) for k in keys}


def render(board, width: int = OUTPUT_WIDTH) -> dict:
    """What the dashboard's front end shows for ``board``'s traits in a ``width`` px card."""
    test_browser._require_chromium()
    seen, errors = test_browser.evaluate_in_blank_page(PAGE, [board._esm, board._css, board_state(board), width])
    assert not errors, errors
    return seen


def cpu_run(tmp_path, *, nproc: int = 2, peak: float = 200 * MIB, floor: float = 60 * MIB, steps: int = 3,
            finished: bool = True):
    """A Run of a plan predicting 20 MiB a rank on ``nproc`` CPU processes, fed as its monitor would feed it: each
    rank's baseline, a tick whose VmHWM is ``peak`` above it, ``steps`` step reports whose RSS is ``floor`` above
    it (the step's end: below the peak), and the end."""
    from autopar_nb.launch.channel import Message
    from autopar_nb.launch.run import Run
    from autopar_nb.plan import Cost, MemoryBreakdown, Plan

    plan = Plan(cost=Cost(step_time_s=0.01, memory_by_rank=[MemoryBreakdown(params=20 * MIB)] * nproc))
    run = Run(run_id="0123456789abcdef", run_dir=tmp_path, script=tmp_path / "train.py", nproc=nproc, steps=steps,
              token="t", backend="gloo", max_restarts=0, hang_timeout_s=None, plan=plan)
    base = 300 * MIB
    for r in range(nproc):
        run._ranks[r].baseline = base
    if steps:
        run._record_tick(0, {r: {"rss": base + floor, "rss_peak": base + peak, "cpu_percent": 95.0}
                             for r in range(nproc)})
    run._ingest([Message(r, "data", {"step": s, "loss": 2.0 / (s + 1), "step_time_s": 0.02, "data_wait_s": 0.001,
                                     "samples_per_s": 1600.0, "rss": base + floor + s * MIB}, run.started + s)
                 for s in range(steps) for r in range(nproc)])
    if finished:
        run._status = "finished"
        run._done.set()
    return run


def test_the_table_and_the_summary_show_one_peak(tmp_path):
    """Issue 42, "one figure, one meaning": the end summary said "Peak memory (RSS above the pre-model RSS vs
    predicted): rank 0 62.0 MiB vs 20.0 MiB" (the largest RSS a step's end reported, against the prediction with the
    allocator margin) where the rank table, in the same card, said 200 MiB (VmHWM, against the training state). Now
    both show the widget's figure, ``run.measured()``'s, under its label."""
    run = cpu_run(tmp_path)
    board = run.dashboard()
    seen = render(board)
    m = run.measured()["by_rank"]
    print("\ntable:", seen["peaks"], "\nsummary:", seen["summary"])
    assert [p["peak"] for p in seen["peaks"]] == ["200 MiB", "200 MiB"], seen
    assert [board.ranks[r]["memory_peak"] for r in (0, 1)] == [m[r]["peak"]["measured"] for r in (0, 1)]
    assert [board.ranks[r]["memory_pred"] for r in (0, 1)] == [m[r]["peak"]["predicted"] for r in (0, 1)]
    assert all(p["label"] == "measured peak (RSS above baseline)" for p in seen["peaks"]), seen
    assert seen["summary"].startswith("measured peak (RSS above baseline) vs predicted tensors (no margin): "), seen
    for p in seen["peaks"]:  # the summary repeats each rank's row: figure, prediction, ratio
        assert f"rank {p['rank']} {p['peak']} vs {p['pred']}" in seen["summary"], (p, seen)


def test_eight_ranks_scroll_inside_the_card_at_1024_px(tmp_path):
    """Issue 42, point 2 ("tables are clipped on the right" at 1024 px with the file browser open), for the launch
    dashboard of an 8-rank run displayed in a cell: its rank table is wider than the card and scrolls inside it, to
    its last column; the card stays inside the output area, which does not scroll."""
    from playwright.sync_api import expect
    from test_browser_figures import SEED_CELLS

    window = {"width": 1024, "height": 1000}  # the narrow case, whatever the suite's width
    with test_browser.notebook_page(tmp_path, [*SEED_CELLS, EIGHT_RANKS], widgets=1, window=window) as (page, errors):
        dash = page.locator(".jp-OutputArea .autopar-dashboard").last
        expect(dash.locator("tr[data-rank]")).to_have_count(8, timeout=30_000)
        dash.scroll_into_view_if_needed()
        seen = dash.evaluate(TABLE)
        dash.screenshot(path=str(tmp_path / "eight_ranks.png"))
    print("\n8 ranks at 1024 px:", seen)
    assert not errors, errors
    assert seen["rows"] == 8 and seen["scrolls"] and not seen["lastVisible"], seen  # wider than the card: it scrolls
    assert seen["lastReached"] and seen["lastLeftOfCard"], seen
    assert seen["wrapRight"] <= seen["cardRight"] <= seen["outputRight"] + 1 and not seen["outputScrolls"], seen


STEP_CHARTS = ("loss", "throughput", "step_time", "data_wait")


def test_charts_say_they_wait_for_the_first_step(tmp_path):
    """Issue 42: early in a run (before the first step) the step charts were empty axes from 0 to 1 with no unit,
    which read as broken charts. Now each says what it waits for, until a rank has a value; a run that ended
    before its first step says none was reported."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir(), (tmp_path / "c").mkdir()
    starting = cpu_run(tmp_path / "a", steps=0, finished=False)
    sampled = cpu_run(tmp_path / "b", steps=0, finished=False)
    sampled._status = "running"
    sampled._record_tick(0, {r: {"rss": 400 * MIB, "cpu_percent": 90.0} for r in (0, 1)})
    ended = cpu_run(tmp_path / "c", steps=0)
    seen = {name: render(run.dashboard())["cards"] for name, run in
            [("starting", starting), ("sampled", sampled), ("ended", ended), ("stepped", cpu_run(tmp_path))]}
    print("\nwhat each chart shows:", seen)
    assert seen["starting"] == {"memory": "waiting for the first sample", "util": "waiting for the first sample",
                                **{k: "waiting for the first step" for k in STEP_CHARTS}}, seen
    assert seen["sampled"] == {"memory": "axes", "util": "axes", **{k: "waiting for the first step" for k in
                                                                    STEP_CHARTS}}, seen
    assert all(seen["ended"][k] == "no step was reported" for k in STEP_CHARTS), seen
    assert set(seen["stepped"].values()) == {"axes"}, seen
