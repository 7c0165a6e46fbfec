"""The planner widget's Tournament button: ``ap.tournament`` in the background (launch/tournament_job.py), its view,
the refusals that keep its trials from sharing the machine, and the calibration the header names afterwards."""

import time
import types

import pytest
from test_tournament import seed_mlp

from autopar_nb import calibration
from autopar_nb.launch import launcher, tournament_job


def tournament_widget(monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOPAR_CALIBRATION", str(tmp_path / "c.json"))
    s = seed_mlp()
    w = s.widget()
    w.run_options = {**w.run_options, "tournament_k": 2, "tournament_steps": 3}
    return s, w


def test_tournament_is_refused_while_a_launch_or_a_tournament_runs(monkeypatch, tmp_path):
    s, w = tournament_widget(monkeypatch, tmp_path)
    assert "tournament" in w.actions and w.calibrated == {}
    started = []
    monkeypatch.setattr(tournament_job, "tournament", lambda *a, **kw: started.append(a) or time.sleep(60))
    alive = types.SimpleNamespace(status="running", run_id="abcdef0123", nproc=2, done=False)
    monkeypatch.setattr(launcher, "live_runs", lambda: [alive])
    w.handle({"kind": "action", "name": "tournament"})
    msg = w.messages[0]
    assert msg["level"] == "error" and msg["text"].startswith("Tournament refused: a launched run is running "
                                                              "(run abcdef01, 2 processes)"), msg
    assert "Stop it" in msg["text"] and w.tournament_panel is None and not started
    monkeypatch.setattr(launcher, "live_runs", lambda: [])
    w.handle({"kind": "action", "name": "tournament"})  # a tournament that takes its time: the kernel is free
    assert w.messages[0]["level"] == "info" and "ap.tournament(k=2, steps=3) runs in the background" in \
        w.messages[0]["text"], w.messages
    assert w.tournament_panel is not None and w.tournament_panel.status == "running"
    for name in ("launch", "verify", "tournament"):  # nothing else measures beside its trials
        w.handle({"kind": "action", "name": name})
        assert w.messages[0]["text"].startswith(f"{name.capitalize()} refused: a tournament is running"), w.messages
    assert len(started) == 1


def test_a_failed_tournament_says_why_and_the_widget_works_on(monkeypatch, tmp_path):
    s, w = tournament_widget(monkeypatch, tmp_path)

    def fails(*a, **kw):
        raise RuntimeError("no room for the trials")

    monkeypatch.setattr(tournament_job, "tournament", fails)
    w.handle({"kind": "action", "name": "tournament"})
    job = w.last_result
    assert job.wait(30) is None and job.status == "failed"
    view = w.tournament_panel
    assert view.status == "failed" and view.message == "the tournament failed: RuntimeError: no room for the trials"
    assert "Traceback" in view.error and view.summary == {}
    view._on_front_end_msg(view, {"event": "adopt"}, [])
    assert view.adopted == "not adopted: no plan was measured: nothing to adopt"
    w.handle({"kind": "undo"})  # the widget still answers
    w.handle({"kind": "action", "name": "tournament"})  # and a tournament may start again
    assert w.last_result is not job



def test_the_header_names_the_calibration_the_session_plans_with(monkeypatch, tmp_path):
    s, w = tournament_widget(monkeypatch, tmp_path)
    assert w.calibrated == {}  # the cost model's defaults
    calibration.store("cpu", {"eff_fp32_matmul": 0.5, "cpu_op_s": 2e-5}, {"runs": 5, "tournament": True})
    s.replan(cluster=calibration.apply(s.cluster))
    today = time.strftime("%Y-%m-%d")
    assert w.calibrated == {"text": f"calibrated on {today} from 5 runs", "title": calibration.speed_text("cpu")}
    assert w.calibrated["title"].startswith(f"Step times calibrated on {today} from 5 runs on this machine (cpu; ")
    s.undo()
    assert w.calibrated == {}

@pytest.mark.multiprocess
def test_the_tournament_button_measures_in_the_background_and_adopts_the_winner(monkeypatch, tmp_path):
    """k=2, 3 steps on 2 gloo processes through the widget's message: the handler returns at once, the view shows
    each trial as it starts and ends, then the standings, the chart's data and the verdict; the calibration is saved
    for the cpu preset and named in the header; Adopt makes the measured winner the session's plan."""
    s, w = tournament_widget(monkeypatch, tmp_path)
    plans = [s.plan, *s.plan.alternatives[:2]]
    t0 = time.perf_counter()
    w.handle({"kind": "action", "name": "tournament"})
    returned_s = time.perf_counter() - t0
    job, view = w.last_result, w.tournament_panel
    seen = []
    job.add_listener(lambda j: seen.append(j.message))
    assert not job.done, "the handler waits for nothing"
    result = job.wait(600)
    assert result is not None, job.error
    assert [e.plan for e in result.entries] == plans
    assert any(m.startswith("trial 3 of 3: ") for m in seen), seen  # each trial as it starts
    assert view.progress == {"done": 3, "total": 3, "k": 2, "steps": 3}
    assert view.status == "finished" and view.message.startswith("3 of 3 plans measured on 2 processes in ")
    assert view.summary["verdict"] == result.verdict() and view.error == ""
    assert [r["status"] for r in view.rows] == ["measured"] * 3, view.rows
    assert all(r["measured_s"] > 0 and r["calibrated_s"] > 0 and r["rank_measured"] for r in view.rows)
    winner = result.entries.index(result.winner)
    assert view.summary["winner"] == winner and view.summary["nproc"] == 2
    assert view.summary["saved"] == "calibration saved for the cpu preset on this machine: the next plan uses it"
    assert calibration.load("cpu") == pytest.approx(result.factors)
    badge = w.calibrated["text"]
    assert badge.startswith("calibrated on ") and badge.endswith(" from 3 runs"), w.calibrated
    s.replan()  # the session's next plan is made with the measured factors, and says so
    assert any(line.startswith("Step times calibrated on ") for line in s.plan.explanation), s.plan.explanation
    s.undo()
    view._on_front_end_msg(view, {"event": "adopt"}, [])
    assert s.plan.diff(result.winner.plan) == [], view.adopted
    assert view.adopted in (f"adopted {result.winner.label} (ap.undo() goes back)",
                            f"{result.winner.label} is the plan already"), view.adopted
    print(f"tournament through the widget: handler {returned_s * 1e3:.0f} ms, tournament {result.wall_s:.1f} s; "
          f"{result.verdict()}")


def fake_job(status: str, rows: list[dict]) -> types.SimpleNamespace:
    """What a TournamentView reads of a job, without processes."""
    done = [types.SimpleNamespace(status=r["status"]) for r in rows]
    return types.SimpleNamespace(status=status, message="3 of 3 plans measured on 2 processes in 85.3 s", error=None,
                                 entries=done, k=2, steps=3, result=None, adopted="", add_listener=lambda fn: None,
                                 rows=lambda: rows)


ROWS = [{"plan": p, "status": "measured", "predicted_s": pred, "measured_s": meas, "calibrated_s": cal,
         "predicted_peak": 16.0 * 2**20, "measured_peak": 59.3 * 2**20, "rank_predicted": i + 1,
         "rank_measured": rm, "rank_calibrated": i + 1, "steps": 3, "note": ""}
        for i, (p, pred, meas, cal, rm) in enumerate([("dp=1 tp=2 pp=1 zero=0", 3.35e-3, 17.2e-3, 20.8e-3, 1),
                                                      ("dp=1 tp=1 pp=2 zero=0 1f1b x8", 4.56e-3, 0.292, 29.6e-3, 3),
                                                      ("dp=1 tp=1 pp=2 zero=0 1f1b x4", 4.67e-3, 0.171, 30.5e-3, 2)])]
VIEW_STATE = """(root) => ({rows: root.querySelectorAll('tr[data-row]').length,
  winner: [...root.querySelectorAll('tr[data-winner="true"]')].map((r) => r.dataset.row),
  predicted: root.querySelectorAll('circle.apt-pred').length,
  calibrated: root.querySelectorAll('circle.apt-cal').length,
  adopt: root.querySelector('button.apt-adopt').disabled, bg: getComputedStyle(root).backgroundColor,
  gone: (root.querySelector('.apd-kernel-gone') || {}).textContent || null})"""


@pytest.mark.parametrize("dark", [False, True], ids=["light", "dark"])
def test_the_tournament_view_draws_the_standings_and_the_chart(dark):
    """The view's front end (static/tournament.js) in chromium, without Jupyter: a row and a point per measured plan
    (a hollow one for its calibrated prediction), the winner marked, Adopt only once the tournament ended, the
    theme's colours, and the kernel's end said (Adopt then reaches nothing, so it is disabled)."""
    from test_widget import JL_DARK, JL_LIGHT, widget_page

    from autopar_nb.launch.tournament_job import TournamentView

    view = TournamentView(fake_job("finished", ROWS))
    view.summary = {"tau": 1 / 3, "tau_calibrated": 1.0, "winner": 0, "margin": 0.9, "wall_s": 85.3, "nproc": 2,
                    "verdict": "winner: the planner's choice", "saved": "calibration saved for the cpu preset"}
    with widget_page(view, JL_DARK if dark else JL_LIGHT, width=1024) as (page, errors):
        root = page.locator(".apd-tournament")
        ended = root.evaluate(VIEW_STATE)
        root.locator("button.apt-adopt").click()
        sent = page.evaluate("() => window.__sent")
        page.evaluate("() => window.__set('status', 'running')")
        running = root.evaluate(VIEW_STATE)
        page.evaluate("() => window.__set('status', 'finished')")
        page.evaluate("() => document.querySelector('.apd-tournament').parentElement.classList"
                      ".add('jupyter-widgets-disconnected')")
        page.wait_for_selector(".apd-kernel-gone")
        gone = root.evaluate(VIEW_STATE)
    assert not errors, errors
    assert ended["rows"] == 3 and ended["predicted"] == 3 and ended["calibrated"] == 3, ended
    assert ended["winner"] == ["0"] and not ended["adopt"] and ended["gone"] is None, ended
    assert sent == [{"event": "adopt"}] and running["adopt"], (sent, running)
    assert (ended["bg"] == "rgb(33, 33, 33)") == dark and ended["bg"] != "rgba(0, 0, 0, 0)", ended
    assert gone["adopt"] and gone["gone"].startswith("The kernel stopped"), gone


def test_the_tournament_views_stop_sends_stop_and_a_stopped_one_keeps_its_standings():
    """Stop (static/tournament.js) in chromium, without Jupyter: enabled while the tournament runs, pressed it
    says so and sends {"event": "stop"}; once stopped it is disabled, the standings measured until then stay and
    their winner can be adopted."""
    from test_widget import JL_LIGHT, widget_page

    from autopar_nb.launch.tournament_job import TournamentView

    rows = [ROWS[0], {**ROWS[1], "status": "running", "measured_s": None, "calibrated_s": None,
                      "rank_measured": None}, {**ROWS[2], "status": "pending", "measured_s": None}]
    view = TournamentView(fake_job("running", rows))
    state = """(root) => ({stop: root.querySelector('button.apd-stop').disabled,
      text: root.querySelector('button.apd-stop').textContent,
      adopt: root.querySelector('button.apt-adopt').disabled, rows: root.querySelectorAll('tr[data-row]').length})"""
    with widget_page(view, JL_LIGHT, width=1024) as (page, errors):
        root = page.locator(".apd-tournament")
        running = root.evaluate(state)
        root.locator("button.apd-stop").click()
        pressed = root.evaluate(state)
        sent = page.evaluate("() => window.__sent")
        page.evaluate("() => window.__set('summary', {winner: 0, verdict: 'stopped after 1 of 3 plans; winner'})")
        page.evaluate("() => window.__set('status', 'stopped')")
        stopped = root.evaluate(state)
    assert not errors, errors
    assert not running["stop"] and running["adopt"] and running["rows"] == 3, running
    assert pressed["stop"] and pressed["text"] == "Stopping…" and sent == [{"event": "stop"}], (pressed, sent)
    assert stopped["stop"] and stopped["text"] == "Stop" and not stopped["adopt"] and stopped["rows"] == 3, stopped
