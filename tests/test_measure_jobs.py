"""``verify.measure.measure_many``: several plans' measurements from one child process, whose measured processes
are forked from one forkserver (torch and the models imported once), each job's failure its own."""

from __future__ import annotations

import json

import pytest

from autopar_nb.verify import measure as m


def test_a_failed_job_is_reported_as_its_own_and_the_others_still_run(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(m, "measure_script", lambda script, *, rank, **k: ran.append(script) or
                        ({"rank": rank} if script != "broken.py" else 1 / 0))
    jobs = tmp_path / "jobs.json"
    jobs.write_text(json.dumps({"steps": 2, "census": 0, "moments": False, "jobs": [
        {"script": "broken.py", "ranks": [0], "world": 2, "real": False},
        {"script": "fine.py", "ranks": [1], "world": 2, "real": False}]}))
    monkeypatch.setattr(m, "_start_forkserver", lambda scripts: None)
    monkeypatch.setattr(m, "_run_job", lambda job, *, forked, **o: [m.measure_script(job["script"], rank=r, **o)
                                                                      for r in job["ranks"]])
    m.run_jobs(jobs)
    results = json.loads((tmp_path / "results.json").read_text())
    assert ran == ["broken.py", "fine.py"]
    assert "ZeroDivisionError" in results[0]["error"] and results[1] == {"ok": [{"rank": 1}]}


def test_the_child_s_failures_come_back_per_job(tmp_path, monkeypatch):
    def child(args, *, timeout):
        (tmp_path / "results.json").write_text(json.dumps([{"error": "rank 1 died"}, {"ok": [{"rank": 0}]}]))
        return type("Proc", (), {"returncode": 0, "stderr": ""})()

    monkeypatch.setattr(m, "_child", child)
    specs = [{"script": "a.py", "ranks": [1], "world": 2, "real": True}, {"script": "b.py", "ranks": [0], "world": 1,
                                                                          "real": False}]
    failed, fine = m._run_in_child(specs, tmp_path, steps=2, timeout=1, census=0, moments=False)
    assert isinstance(failed, RuntimeError) and "a.py" in str(failed) and "rank 1 died" in str(failed)
    assert fine == [{"rank": 0}]
    with pytest.raises(RuntimeError, match="rank 1 died"):
        monkeypatch.setattr(m, "measure_many", lambda jobs, **k: [failed])
        m.measure(None, None)


def test_batched_measures_the_selected_cases_a_few_at_a_time():
    from batched import Batched

    calls = []
    got = Batched(["a", "b", "c", "d", "e"], lambda cases: calls.append(cases) or {c: c.upper() for c in cases},
                  size=2)
    assert (got["c"], got["a"], got["b"], got["e"]) == ("C", "A", "B", "E")
    assert calls == [["c", "a"], ["b", "d"], ["e"]]
