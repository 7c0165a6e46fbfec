"""launch/watch.py: events from synthetic per-rank samples, failures and predictions (issue 14, point 1)."""

from __future__ import annotations

import pytest

from autopar_nb.launch.watch import Watch, WatchSettings, detect, settings_for

GIB = 2**30


def samples(ranks: int, ticks: int, *, memory=lambda r, i: 1 * GIB, step_time=lambda r, i: 0.1) -> list[dict]:
    """``Run.samples``-shaped dicts: one per tick and rank, a step per tick (step i at tick i)."""
    return [{"t": float(i), "rank": r, "state": "running", "source": "psutil", "memory_bytes": memory(r, i),
             "rss_baseline_bytes": 0.3 * GIB,
             "step": i, "step_time_s": step_time(r, i), "loss": 1.0} for i in range(ticks) for r in range(ranks)]


def kinds(events):
    return [(e["kind"], e["rank"]) for e in events]


def test_a_steady_run_within_its_prediction_has_no_events():
    s = WatchSettings(memory_limit_bytes=8 * GIB, predicted_memory=[1.1 * GIB] * 2, predicted_step_time_s=0.11)
    assert detect(samples(2, 10), settings=s) == []


def test_memory_above_the_threshold_names_the_rank_the_step_and_the_share():
    mem = lambda r, i: (1 + i) * GIB if r == 1 else GIB  # rank 1 grows 1 GiB a step
    (e,) = detect(samples(2, 10, memory=mem), settings=WatchSettings(memory_limit_bytes=8 * GIB))
    assert (e["kind"], e["rank"], e["step"], e["t"]) == ("memory_high", 1, 7, 7.0)  # 8 GiB >= 92 % of 8 GiB
    assert e["reason"] == "rank 1 reached 100% of 8.00 GiB at step 7 (threshold 92%)"
    assert detect(samples(2, 10, memory=mem), settings=WatchSettings(memory_limit_bytes=8 * GIB,
                                                                     memory_threshold=0.5))[0]["step"] == 3
    assert detect(samples(2, 10, memory=mem), settings=WatchSettings()) == []  # no limit known: no memory events
    gpu = [dict(x, source="nvml", nvml_total_bytes=8 * GIB) for x in samples(2, 10, memory=mem)]
    assert kinds(detect(gpu)) == [("memory_high", 1)]  # a GPU's own memory (NVML) is its limit


def test_settings_from_the_runs_comparison():
    s = settings_for({"predicted_memory": [GIB, None], "predicted_step_time_s": None}, memory_limit_bytes=4 * GIB)
    assert (s.predicted_memory, s.predicted_step_time_s, s.memory_limit_bytes) == ([GIB, None], None, 4 * GIB)
    assert detect(samples(2, 6), settings=s) == []  # rank 0 as predicted; rank 1 has no prediction


@pytest.mark.parametrize("error", [
    {"error": "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "traceback": "..."},
    {"error": "RuntimeError", "traceback": "RuntimeError: [enforce fail at alloc_cpu.cpp:117] . "
                                            "DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 GB"},
])
def test_out_of_memory_in_a_traceback(error):
    (e,) = detect(samples(2, 3), errors={0: error})
    assert (e["kind"], e["rank"], e["step"]) == ("oom", 0, 2)


def test_a_worker_killed_near_the_limit_is_out_of_memory_and_far_from_it_is_not():
    killed = {"error": "exit code -9 (SIGKILL): Signal 9 (SIGKILL) received by PID 123", "traceback": ""}
    near = lambda r, i: 7 * GIB if r == 1 else GIB
    s = WatchSettings(memory_limit_bytes=8 * GIB, memory_threshold=0.95)
    (e,) = detect(samples(2, 3, memory=near), errors={1: killed}, settings=s)
    assert (e["kind"], e["rank"]) == ("oom", 1) and "88%" in e["reason"] and "SIGKILL" in e["reason"]
    assert detect(samples(2, 3), errors={1: killed}, settings=s) == []  # 1 GiB of 8: killed for another reason
    assert detect(samples(2, 3, memory=near), errors={1: killed}) == []  # no limit known


def test_a_straggler_is_persistently_slower_not_once():
    slow = lambda r, i: 0.25 if r == 2 and i >= 4 else 0.1
    (e,) = detect(samples(4, 12, step_time=slow), settings=WatchSettings(straggler_steps=5))
    assert (e["kind"], e["rank"], e["step"]) == ("straggler", 2, 8) and e["ratio"] == pytest.approx(2.5)
    blip = lambda r, i: 0.25 if r == 2 and i in (4, 5, 6, 8, 9, 10) else 0.1  # never 5 in a row
    assert detect(samples(4, 12, step_time=blip), settings=WatchSettings(straggler_steps=5)) == []
    assert detect(samples(1, 12, step_time=slow)) == []  # one rank: nothing to compare with


def test_prediction_error_for_memory_and_step_time_beyond_the_tolerance():
    s = WatchSettings(predicted_memory=[1 * GIB, 0.5 * GIB], predicted_step_time_s=0.05, prediction_tolerance=0.3)
    events = detect(samples(2, 6), settings=s)
    assert sorted((e["rank"], e["what"]) for e in events) == [(0, "step_time"), (1, "memory"), (1, "step_time")]
    mem = next(e for e in events if e["what"] == "memory")
    assert mem["ratio"] == pytest.approx(2.0) and mem["reason"] == \
        "rank 1's peak memory is 1.00 GiB, 2.00x the plan's 0.50 GiB"
    assert detect(samples(2, 2), settings=s) == []  # fewer than min_steps steps: too early to tell
    # the first step (start-up) is left out of the median
    slow_start = lambda r, i: 5.0 if i == 0 else 0.05
    assert detect(samples(2, 6, step_time=slow_start), settings=WatchSettings(predicted_step_time_s=0.05)) == []


def test_watch_reports_each_event_once_as_the_run_goes_on():
    mem = lambda r, i: (1 + i) * GIB if r == 0 else GIB
    watch, seen = Watch(WatchSettings(memory_limit_bytes=8 * GIB)), []
    all_samples = samples(2, 12, memory=mem)
    for tick in range(12):
        seen.append(kinds(watch.update(all_samples[: 2 * (tick + 1)])))
    assert seen == [[]] * 7 + [[("memory_high", 0)]] + [[]] * 4
    assert kinds(watch.update(all_samples, errors={0: {"error": "CUDA out of memory", "traceback": ""}})) == \
        [("oom", 0)]


def test_run_fills_events_at_each_monitor_tick(tmp_path):
    """The Run's monitor tick hands its samples to the watch: a rank whose memory above its baseline crosses the
    line is an event; before its baseline is known (raw RSS: Python and torch included) it is not."""
    from autopar_nb.launch.run import Run

    run = Run(run_id="r", run_dir=tmp_path, script=tmp_path / "train.py", nproc=2, steps=4, token="t",
              backend="gloo", max_restarts=0, hang_timeout_s=None)
    run._watch = Watch(WatchSettings(memory_limit_bytes=4 * GIB))
    run._record_tick(0, {0: {"rss": GIB}, 1: {"rss": 4 * GIB}})
    assert run.events == []  # no baseline yet
    for st in run._ranks.values():
        st.baseline = 0.5 * GIB
    run._record_tick(1, {0: {"rss": GIB}, 1: {"rss": 4.4 * GIB}})
    assert kinds(run.events) == [("memory_high", 1)] and "rank 1 reached 98% of 4.00 GiB" in run.events[0]["reason"]
    run._record_tick(2, {0: {"rss": GIB}, 1: {"rss": 4.4 * GIB}})
    assert len(run.events) == 1
    plain = Run(run_id="p", run_dir=tmp_path, script=tmp_path / "train.py", nproc=2, steps=4, token="t",
                backend="gloo", max_restarts=0, hang_timeout_s=None)  # no plan, no limit: settings from comparison()
    plain._record_tick(0, {0: {"rss": 3.9 * GIB}, 1: {"rss": GIB}})
    assert plain.events == [] and plain._watch.settings.memory_limit_bytes is None


def test_a_cpu_rank_above_the_plans_limit_is_stopped_as_an_oom(tmp_path):
    """A CPU run of a plan made with a per-rank limit (issue 14, point 5) enforces it: the rank whose RSS above its
    baseline exceeds it is killed (a real process here) and an ``oom`` event says why; memory_high came first."""
    import subprocess
    import sys
    from types import SimpleNamespace

    import psutil

    from autopar_nb.launch.run import Run

    plan = SimpleNamespace(cluster={"preset": "cpu", "nodes": 1, "gpus_per_node": 2, "memory_limit_bytes": 2 * GIB},
                           cost=None)
    run = Run(run_id="r", run_dir=tmp_path, script=tmp_path / "train.py", nproc=2, steps=4, token="t",
              backend="gloo", max_restarts=0, hang_timeout_s=None, plan=plan)
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        run._workers = {1: psutil.Process(victim.pid)}
        for st in run._ranks.values():
            st.baseline = 0.5 * GIB
        run._record_tick(0, {0: {"rss": GIB}, 1: {"rss": 2.4 * GIB}})  # 1.9 GiB: 95 %, not over
        assert kinds(run.events) == [("memory_high", 1)] and victim.poll() is None
        run._record_tick(1, {0: {"rss": GIB}, 1: {"rss": 2.6 * GIB}})  # 2.1 GiB: over
        assert kinds(run.events) == [("memory_high", 1), ("oom", 1)]
        e = run.events[1]
        assert e["killed"] and e["limit_bytes"] == 2 * GIB
        assert e["reason"] == ("rank 1 exceeded its memory limit: 2.10 GiB above its baseline, 105% of 2.00 GiB; "
                               "stopped (SIGKILL) as an out-of-memory would")
        assert victim.wait(timeout=10) == -9
    finally:
        victim.kill()
    gpu = Run(run_id="g", run_dir=tmp_path, script=tmp_path / "train.py", nproc=2, steps=4, token="t",
              backend="nccl", max_restarts=0, hang_timeout_s=None, plan=plan)
    gpu._record_tick(0, {0: {"rss": GIB}, 1: {"rss": GIB}})
    assert gpu._watch.settings.memory_limit_bytes == 2 * GIB and not gpu._watch.settings.enforce_limit
