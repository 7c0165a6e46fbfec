"""Dashboard refresh cost, in the kernel and in the browser, for 2 and 64 ranks of a simulated run.

    .venv/bin/python bench/dashboard.py [--seconds 30] [--ranks 2 64] [--write]

A JupyterLab kernel (headless chromium through Playwright, as tests/test_browser.py runs it) displays the dashboard
of a ``Run`` whose monitor is simulated: a thread does what ``monitor.py`` does, with the same intervals, fed by a
stream of made-up ranks (10 steps/s each: loss, step time, throughput, data wait, RSS; a device sample per rank
each second) instead of sockets and psutil. So the figures are the bookkeeping (``Run._ingest``,
``Run._record_tick``), the dashboard's ``refresh`` and the widget messages it sends; not psutil's sampling of real
processes nor the channel's socket reads (bench/launch.py measures the whole monitor on real workers).

* kernel: CPU seconds per second of that thread (``time.thread_time``), and of the whole kernel process
  (``time.process_time``: ipykernel's own threads too, the ZMQ sends included);
* browser: milliseconds per dashboard update (the front end's own timing of each batch of trait changes: the
  table, the status, the six uPlot charts), median and 95th percentile, from ``__apdTimings``.

``--write`` replaces the "## Dashboard" section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

SIMULATION = r'''
import random, threading, time, tempfile
from pathlib import Path
from autopar_nb.launch.channel import Message
from autopar_nb.launch.monitor import PUSH_INTERVAL_S, SAMPLE_INTERVAL_S
from autopar_nb.launch.run import Run
from autopar_nb.plan import Cost, MemoryBreakdown, MeshPlan, Plan

R, SECONDS, HISTORY, STEP_S = {ranks}, {seconds}, {history}, 0.1
plan = Plan(mesh=MeshPlan(dp=R), cluster={{"preset": "cpu", "nodes": 1, "gpus_per_node": R}},
            cost=Cost(step_time_s=STEP_S, memory_by_rank=[MemoryBreakdown(params=2e8, optimizer=4e8)] * R))
run = Run(run_id="bench%08d" % R, run_dir=Path(tempfile.mkdtemp()), script=Path("train.py"), nproc=R, steps=None,
          token="x", backend="gloo", max_restarts=0, hang_timeout_s=None, plan=plan)
board = run.dashboard()
stats = {{}}

def step_msgs(rng, step):
    return [Message(r, "data", {{"step": step, "loss": 2.0 / (1 + 0.01 * step) + rng.random() * 0.05,
                                "step_time_s": STEP_S * (1 + 0.1 * rng.random()),
                                "samples_per_s": 320.0 * (1 + 0.1 * rng.random()), "data_wait_s": 0.002 * rng.random(),
                                "rss": 5e8 + 6e8 + 1e7 * rng.random()}}, time.time()) for r in range(R)]

def device(rng):
    return {{r: {{"cpu_percent": 90 + 10 * rng.random(), "rss": 5e8 + 6e8 + 1e7 * rng.random()}} for r in range(R)}}

def simulate():
    rng = random.Random(0)
    run._ingest([Message(r, "hello", {{}}, time.time()) for r in range(R)])
    run._ingest([Message(r, "data", {{"event": "start", "rss_before_model": 5e8}}, time.time()) for r in range(R)])
    # HISTORY seconds of run before the measurement (one step per second), so every series is at its full size
    for k in range(HISTORY):
        run._ingest(step_msgs(rng, k + 1))
        run._ranks[0].sample = device(rng)[0]
        with run._lock:
            rows = {{r: {{**run._sample_of(run._ranks[r]), "utilization_pct": 95.0, "memory_bytes": 6e8}}
                    for r in range(R)}}
            run._timeline.add(k, float(k), rows)
    t0 = time.monotonic()
    run._t0 = t0 - HISTORY
    step, next_tick, last_push = HISTORY, HISTORY, 0.0
    cpu0, proc0, refresh0 = time.thread_time(), time.process_time(), board.refresh_cpu_s
    while time.monotonic() - t0 < SECONDS:
        time.sleep(0.2)  # the monitor's poll
        now = time.monotonic()
        msgs = []
        while (step - HISTORY + 1) * STEP_S <= now - t0:
            step += 1
            msgs += step_msgs(rng, step)
        changed = run._ingest(msgs)
        tick = int((now - run._t0) / SAMPLE_INTERVAL_S)
        if tick >= next_tick:
            next_tick = tick + 1
            run._record_tick(tick, device(rng))
            changed = True
        if changed and now - last_push >= PUSH_INTERVAL_S:
            last_push = now
            run._notify()
    wall = time.monotonic() - t0
    stats.update(thread_cpu_per_s=(time.thread_time() - cpu0) / wall, process_cpu_per_s=(time.process_time() - proc0)
                 / wall, refresh_cpu_per_s=(board.refresh_cpu_s - refresh0) / wall, refreshes=board.refreshes,
                 steps=step, timeline_points=len(run._timeline), step_points=len(run._steps))

threading.Thread(target=simulate, daemon=True).start()
board
'''


def measure(page, ranks: int, seconds: float, history: int, out: Path) -> dict:
    from test_browser import run_cell_writing

    page.evaluate("""async (code) => {
        const panel = jupyterapp.shell.currentWidget, nb = panel.content, model = nb.model;
        model.sharedModel.insertCell(model.cells.length, {cell_type: 'code', source: code});
        nb.activeCellIndex = model.cells.length - 1;
        await jupyterapp.commands.execute('notebook:run-cell');
    }""", SIMULATION.format(ranks=ranks, seconds=seconds, history=history))
    board = page.locator(".autopar-dashboard").last
    board.wait_for(timeout=60_000)
    page.wait_for_function("() => Array.from(document.querySelectorAll('.autopar-dashboard')).pop().__apdCounts"
                           ".charts > 1", timeout=600_000)  # the history is fed: the live part begins
    board.evaluate("(e) => { e.__apdTimings.length = 0; e.__apdChartTimings.length = 0; e.__apdCounts = {}; }")
    time.sleep(seconds + 2)
    browser = board.evaluate("(e) => ({timings: e.__apdTimings, charts: e.__apdChartTimings, counts: e.__apdCounts})")
    kernel = run_cell_writing(page, f"import json\njson.dump(stats, open({str(out)!r}, 'w'))", out)
    t, c = sorted(browser["timings"]), sorted(browser["charts"])
    return {"ranks": ranks, **kernel, "updates": len(t), "chart_updates": len(c),
            "ms_median": statistics.median(t), "ms_p95": t[int(0.95 * (len(t) - 1))], "ms_max": t[-1],
            "chart_ms_median": statistics.median(c), "chart_ms_max": c[-1]}


def main() -> None:
    import nbformat
    from playwright.sync_api import sync_playwright
    from test_browser import CHROMIUM, CHROMIUM_FLAGS, KERNEL_IS, jupyterlab_server

    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 64])
    p.add_argument("--history", type=int, default=3600, help="seconds of run fed before measuring (1 step/s)")
    p.add_argument("--write", action="store_true")
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="autopar-bench-dash-"))
    results = []
    load = os.getloadavg()
    with jupyterlab_server(tmp) as (base, token, root), sync_playwright() as pw:
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import autopar_nb")], metadata={
            "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}})
        nbformat.write(nb, root / "bench.ipynb")
        ctx = pw.chromium.launch_persistent_context(str(tmp / "chromium"), executable_path=str(CHROMIUM),
                                                    headless=True, args=CHROMIUM_FLAGS,
                                                    viewport={"width": 1200, "height": 1400})
        try:
            page = ctx.new_page()
            page.goto(f"{base}/lab/tree/bench.ipynb?token={token}")
            page.wait_for_function(KERNEL_IS % "idle", timeout=60_000)
            for ranks in a.ranks:
                r = measure(page, ranks, a.seconds, a.history, tmp / f"stats_{ranks}.json")
                results.append(r)
                print(json.dumps(r), flush=True)
        finally:
            ctx.close()
    for r in results:
        print(f"{r['ranks']:>3} ranks: kernel {100 * r['thread_cpu_per_s']:.2f} % of a core (monitor thread, "
              f"refresh {100 * r['refresh_cpu_per_s']:.2f} %), whole kernel {100 * r['process_cpu_per_s']:.2f} %; "
              f"browser {r['ms_median']:.1f} ms per update (p95 {r['ms_p95']:.1f}, {r['updates']} updates; "
              f"{r['chart_updates']} redrew the charts: median {r['chart_ms_median']:.1f} ms, max "
              f"{r['chart_ms_max']:.1f} ms)")
    if a.write:
        write(results, a.seconds, a.history, load)


def write(results: list[dict], seconds: float, history: int, load: tuple) -> None:
    from launch import write_section  # bench/launch.py

    rows = [f"| {r['ranks']} | {100 * r['thread_cpu_per_s']:.2f} % | {100 * r['refresh_cpu_per_s']:.2f} % | "
            f"{100 * r['process_cpu_per_s']:.2f} % | {r['ms_median']:.1f} ms | {r['ms_p95']:.1f} ms | "
            f"{r['chart_ms_median']:.1f} ms (max {r['chart_ms_max']:.1f}) | {r['updates']} ({r['chart_updates']}) | "
            f"{r['timeline_points']} + {r['step_points']} |"
            for r in results]
    section = "\n".join([
        "## Dashboard",
        "",
        f"`.venv/bin/python bench/dashboard.py --seconds {seconds:g} --history {history}` — "
        f"{datetime.date.today().isoformat()}, "
        f"{os.cpu_count()}-core CPU container shared with other jobs ({platform.machine()}), load average "
        f"{load[0]:.1f} before the run, JupyterLab + headless chromium (Playwright), Python "
        f"{platform.python_version()}. A run of N simulated ranks at 10 steps/s each (one step message per rank "
        f"per step, a device sample per rank per second) for each N, measured for {seconds:g} s after "
        f"{history} s of history (so every line is at its full, decimated size); the dashboard displayed in the "
        "notebook. "
        "Kernel: CPU seconds per second of the simulated monitor thread (bookkeeping, the dashboard's refresh and "
        "the widget messages it sends), of the refresh alone, and of the whole kernel process. Browser: the front "
        "end's time per update (table and status at most 4 times a second, the six uPlot charts once a second).",
        "",
        "| ranks | kernel: monitor thread | of which refresh | whole kernel | browser: ms per update (median) | "
        "p95 | ms per chart redraw (median) | updates (with charts) | points per line (time + steps) |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "Goal: monitoring costs at most 2 % of step time. The kernel's share of one core above is what the dashboard "
        "takes from the workers at most (when every core is busy); the worker side is one JSON line per step "
        "(see Launch). The series are decimated at 1000 points per line, so an hour-long run costs no more than a "
        "17-minute one (1000 ticks of a second).",
        "",
    ])
    write_section(ROOT / "BENCHMARKS.md", "## Dashboard", section)
    print("wrote the Dashboard section of BENCHMARKS.md")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "bench"))
    main()
