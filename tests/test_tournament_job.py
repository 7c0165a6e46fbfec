"""The planner widget's Tournament button: ``ap.tournament`` in the background (launch/tournament_job.py), its view,
the refusals that keep its trials from sharing the machine, and the calibration the header names afterwards."""

import sys
import time
import types

import pytest
from test_tournament import seed_mlp

from autopar_nb import calibration
from autopar_nb.launch import tournament_job


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
    launch_pkg = sys.modules["autopar_nb.launch"]  # the package: ``autopar_nb.launch`` is also the function
    monkeypatch.setattr(launch_pkg, "live_runs", lambda: [alive])
    w.handle({"kind": "action", "name": "tournament"})
    msg = w.messages[0]
    assert msg["level"] == "error" and msg["text"].startswith("Tournament refused: a launched run is running "
                                                              "(run abcdef01, 2 processes)"), msg
    assert "Stop it" in msg["text"] and w.tournament_panel is None and not started
    monkeypatch.setattr(launch_pkg, "live_runs", lambda: [])
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
