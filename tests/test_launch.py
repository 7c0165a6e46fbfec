"""launch(): real runs of tests/fixtures/train_fixture.py on 2 local processes (gloo), and their failure modes."""

from __future__ import annotations

import _thread
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from autopar_nb.launch import LaunchError, launch, live_runs
from autopar_nb.launch import launcher as launcher_mod
from autopar_nb.launch.channel import MetricsServer
from autopar_nb.launch.procs import processes_with_token

FIXTURE = Path(__file__).parent / "fixtures" / "train_fixture.py"
REPO = Path(__file__).parent.parent


def wait_for(cond, timeout: float, what: str, poll: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return time.monotonic()
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def assert_no_process_left(run):
    left = processes_with_token(run._token)
    assert not left, f"processes of the run still alive: {left}"


@pytest.fixture(autouse=True)
def _no_leftover_runs():
    yield
    for r in live_runs():  # a failing test must not leave workers behind for the next one
        r.stop("test cleanup")


# ---- the channel alone (no processes) ----------------------------------------------------------------------------
def test_channel_accepts_token_and_drops_everything_else():
    server = MetricsServer()
    host, port = server.address.split(":")
    try:
        def client(lines: list[bytes]) -> socket.socket:
            s = socket.create_connection((host, int(port)))
            s.sendall(b"".join(lines))
            return s

        good = client([json.dumps({"token": server.token, "rank": 1}).encode() + b"\n",
                       b'{"step": 1, "loss": 0.5, "rank": 0}\n'])
        wrong = client([b'{"token": "0000", "rank": 0}\n{"step": 99, "loss": 1.0}\n'])
        pickled = client([b"\x80\x04\x95cos\nsystem\n"])  # a pickle: must be treated as garbage, not loaded
        no_token = client([b'{"rank": 0}\n{"step": 98}\n'])
        msgs = []
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and server.rejected < 3:
            msgs += server.poll(0.05)
        for s in (good, wrong, pickled, no_token):
            s.close()
        msgs += server.poll(0.2)
        data = [(m.rank, m.data) for m in msgs if m.kind == "data"]
        # the authenticated connection's rank wins over the "rank" a later line claims
        assert data == [(1, {"step": 1, "loss": 0.5, "rank": 0})]
        assert [m.rank for m in msgs if m.kind == "hello"] == [1]
        assert server.rejected == 3
    finally:
        server.close()


def test_script_flags_become_command_line_flags():
    assert launcher_mod.script_args(5, {"ckpt_dir": "/x", "ckpt_every": 2, "compile": True, "amp": None,
                                        "fast": False}) == ["--steps", "5", "--ckpt-dir", "/x", "--ckpt-every", "2",
                                                             "--compile"]


def test_cuda_in_kernel_that_breaks_workers_is_refused(monkeypatch, tmp_path):
    monkeypatch.setattr(launcher_mod, "_cuda_state",
                        lambda env: {"initialized": True, "compute_modes": {0: "default", 1: "exclusive_process"}})
    launcher_mod.check_cuda(1, "nccl")  # GPU 0 only: fine
    with pytest.raises(LaunchError, match=r"GPU 1 \(exclusive_process\).*Restart the kernel"):
        launch(FIXTURE, nproc=2, steps=2, backend="nccl", run_dir=tmp_path)
    assert not (tmp_path / "agent.json").exists()  # refused before anything started
    launcher_mod.check_cuda(2, "gloo")  # CPU workers never open the GPU
    gib = 2.0**30
    monkeypatch.setattr(launcher_mod, "_cuda_state", lambda env: {
        "initialized": True, "compute_modes": {0: "default", 1: "default"}, "held": {0: 1 * gib, 1: 100 * gib},
        "total": {0: 140 * gib, 1: 140 * gib}})
    launcher_mod.check_cuda(1, "nccl")  # 1 GiB of GPU 0: the workers still fit
    with pytest.raises(LaunchError, match=r"holds most of the memory of GPU 1 \(100 GiB of 140 GiB\).*empty_cache"):
        launcher_mod.check_cuda(2, "nccl")


# ---- the run's bookkeeping alone (no processes) ------------------------------------------------------------------
def test_summary_leaves_out_each_ranks_first_step_per_attempt():
    from autopar_nb.launch.metrics import step_row, summarize

    rows = [step_row(r, a, {"step": s, "step_time_s": t, "rss": 100.0 + s, "ok": True, "note": "x"}, 0.0)
            for r, a, s, t in [(0, 0, 1, 9.0), (0, 0, 2, 1.0), (0, 0, 3, 3.0), (1, 0, 1, 9.0), (1, 0, 2, 2.0),
                               (0, 1, 3, 8.0), (0, 1, 4, 4.0)]]
    assert list(rows[0]) == ["rank", "attempt", "step", "step_time_s", "rss", "time"]  # no bools, no text
    out = summarize(rows, status="finished")
    assert out["steps"] == 4 and out["step_time_s"] == 2.5  # median of 1, 3, 2, 4: warm-up steps left out
    assert out["memory_by_rank"] == {0: 104.0, 1: 102.0} and out["memory_kind"] == "rss"
    assert summarize(rows[:1], status="running")["step_time_s"] == 9.0  # nothing else to go by


def test_summary_on_cuda_reports_the_allocators_peak_reserve_per_rank():
    from autopar_nb.launch.metrics import step_row, summarize

    rows = [step_row(r, 0, {"step": s, "step_time_s": 1.0, "mem_peak": 100.0 * (s + 1), "mem_peak_reserved": 150.0 * s,
                            "rss": 5.0}, 0.0) for r in (0, 1) for s in (1, 2)]
    out = summarize(rows, status="finished")
    assert out["memory_kind"] == "cuda_peak" and out["memory_by_rank"] == {0: 300.0, 1: 300.0}
    assert out["reserved_by_rank"] == {0: 300.0, 1: 300.0}  # the largest peak reserve a rank reported
    cpu = summarize([step_row(0, 0, {"step": 1, "step_time_s": 1.0, "rss": 5.0}, 0.0)], status="finished")
    assert "reserved_by_rank" not in cpu


def test_torchrun_gets_shutdown_timeout_only_where_it_takes_it(monkeypatch):
    import argparse

    import torch.distributed.run as torchrun

    from autopar_nb.launch.launcher import shutdown_timeout_args

    def parser(with_flag: bool):
        p = argparse.ArgumentParser()
        p.add_argument("--max-restarts")
        if with_flag:
            p.add_argument("--shutdown-timeout")
        return p

    monkeypatch.setattr(torchrun, "get_args_parser", lambda: parser(True))
    assert shutdown_timeout_args() == ["--shutdown-timeout", "1"]
    monkeypatch.setattr(torchrun, "get_args_parser", lambda: parser(False))  # torch 2.11's torchrun (the GPU image)
    assert shutdown_timeout_args() == []


def test_stalled_rank_gives_unconnected_ranks_the_startup_allowance():
    from autopar_nb.launch.hang import STARTUP_TIMEOUT_S, hang_message, stalled_rank
    from autopar_nb.launch.metrics import RankState

    ranks = {0: RankState(0, step=5, last_progress=100.0, connected=True),
             1: RankState(1, last_progress=0.0, connected=False)}
    assert stalled_rank(ranks, now=105.0, t0=0.0, timeout=10.0) is None
    assert stalled_rank(ranks, now=111.0, t0=0.0, timeout=10.0) == (1, 111.0)  # rank 1 longest, rank 0 over
    ranks[0].done = True
    assert stalled_rank(ranks, now=STARTUP_TIMEOUT_S - 1, t0=0.0, timeout=10.0) is None
    assert stalled_rank(ranks, now=STARTUP_TIMEOUT_S, t0=0.0, timeout=10.0) == (1, STARTUP_TIMEOUT_S)
    assert "rank 0: 5, rank 1: -" in hang_message(ranks, 1, 12.0, 10.0)


def test_log_files_by_attempt_and_the_failed_ranks_error(tmp_path):
    from autopar_nb.launch import logfiles

    for attempt, text in ((0, "first\n"), (1, "a\nb\nc")):
        d = tmp_path / "logs" / "rid_x1" / f"attempt_{attempt}" / "1"
        d.mkdir(parents=True)
        (d / "stdout.log").write_text(text)
        (d / "stderr.log").write_text("[rank1]: err\n")
    assert logfiles.latest_attempt(tmp_path, "rid") == 1 and logfiles.latest_attempt(tmp_path, "other") == -1
    assert logfiles.rank_output(logfiles.rank_dir(tmp_path, "rid", 1)) == "a\nb\nc\n[rank1]: err\n"
    assert logfiles.rank_output(logfiles.rank_dir(tmp_path, "rid", 1, 0), tail=1) == "[rank1]: err"
    assert logfiles.rank_dir(tmp_path, "rid", 1, 5) is None
    assert logfiles.tagged(["x", "[rank1]: y"], 1) == ["[rank1] x", "[rank1]: y"]
    err_file = tmp_path / "error.json"
    err_file.write_text(json.dumps({"message": {"message": "boom", "extraInfo": {"py_callstack": "Traceback"}}}))
    result = {"failures": {"1": {"exitcode": 1, "error_file": str(err_file)}, "3": {"exitcode": -9}}}
    assert logfiles.error_from_result(result, lambda rank: "log") == {
        "rank": 1, "attempt": 0, "error": "exit code 1: boom", "traceback": "Traceback"}
    killed = {"failures": {"0": {"exitcode": -9, "signal": "SIGKILL"}}}
    assert logfiles.error_from_result(killed, lambda rank: f"log of {rank}")["traceback"] == "log of 0"
    assert logfiles.error_from_result({}, lambda rank: "") is None


# ---- real runs -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference_run():
    """An uninterrupted 12-step run of about 3 s (so that device samples land while it steps: warm ranks would
    finish the 12 steps within one tick); a hostile client connects while it runs."""
    run = launch(FIXTURE, nproc=2, steps=12, sleep=0.25)
    host, port = run._server.address.split(":")
    intruder = socket.create_connection((host, int(port)))
    intruder.sendall(b'{"token": "not-the-token", "rank": 0}\n{"step": 1000, "loss": 123.0}\n{"event": "error"}\n')
    assert run.wait(120) == "finished", run.message
    intruder.close()
    return run


@pytest.mark.multiprocess
def test_run_finishes_with_metrics_logs_and_no_process_left(reference_run):
    run = reference_run
    assert run.status == "finished" and run.error is None
    table = run.metrics
    assert sorted({(r["rank"], r["step"]) for r in table}) == [(r, s) for r in (0, 1) for s in range(1, 13)]
    assert all(r["loss"] != 123.0 and r["step"] <= 12 for r in table)  # the intruder did not get in
    assert run._server.rejected >= 1
    assert {"loss", "step_time_s", "samples_per_s", "rss"} <= set(table.columns())
    assert "step 12 loss" in run.logs(1)
    assert run.first_step_time is not None and run.first_step_time < 60
    assert "torch.distributed.run" in " ".join(run.command)
    assert_no_process_left(run)
    summary = run.summary()
    assert summary["steps"] == 12 and summary["step_time_s"] > 0 and set(summary["memory_by_rank"]) == {0, 1}


@pytest.mark.multiprocess
def test_samples_cover_start_up_and_every_rank(reference_run):
    """run.samples: a tick a second from launch, one dict per rank, start-up included, step figures joined; the last
    one is taken when the run has ended (however short it was: warm ranks finish these 12 steps within a tick)."""
    from autopar_nb.launch.monitor import SAMPLE_INTERVAL_S
    from autopar_nb.launch.run import SAMPLE_FIELDS

    samples = reference_run.samples
    ticks = sorted({s["t"] for s in samples})
    assert len(samples) == 2 * len(ticks) and {s["rank"] for s in samples} == {0, 1}
    assert ticks[0] < SAMPLE_INTERVAL_S and all(0.5 < b - a < 2.5 for a, b in zip(ticks, ticks[1:-1], strict=False))
    assert ticks[-1] > ticks[-2]
    assert set(samples[0]) == {"t", "rank", "state", "source", *SAMPLE_FIELDS}
    assert samples[0]["state"] == "starting" and samples[0]["step"] is None  # before the first step
    for rank in (0, 1):
        mine = [s for s in samples if s["rank"] == rank]
        measured = [s for s in mine if s["source"] == "psutil"]
        assert measured and all(s["memory_bytes"] > 0 and s["utilization_pct"] is not None for s in measured[1:])
        stepped = [s for s in mine if s["step"] is not None]
        assert stepped and all(s["loss"] is not None and s["samples_per_s"] > 0 for s in stepped)
        assert [s["step"] for s in stepped] == sorted(s["step"] for s in stepped)
    assert samples[-1]["state"] == "finished" and samples[-1]["step"] == 12


@pytest.mark.multiprocess
def test_rank_raising_reports_rank_exception_traceback_and_ends_all(tmp_path):
    run = launch(FIXTURE, nproc=2, steps=200, sleep=0.05, fail_rank=1, fail_step=4, run_dir=tmp_path)
    wait_for(lambda: run.last_steps()[1] == 3, 60, "rank 1 to finish step 3")
    t_step3 = time.monotonic()
    t_failed = wait_for(lambda: run.status == "failed", 5, "status 'failed'")
    assert t_failed - t_step3 < 5
    err = run.error
    assert err["rank"] == 1 and "injected failure on rank 1 at step 4" in err["error"]
    assert "Traceback" in err["traceback"] and "train_fixture.py" in err["traceback"]
    assert "rank 1" in run.message
    wait_for(lambda: run.done, 5, "the run to end")
    assert_no_process_left(run)
    assert max(run.last_steps().values()) < 10  # rank 0 did not run on alone
    assert run.error["rank"] == 1 and all(k["rank"] == 0 for k in run.error["knock_on"])  # rank 0's error follows
    assert run.ranks()[1].state(run.status) == "failed"


@pytest.mark.multiprocess
def test_killed_rank_is_named_not_the_peer_that_lost_it(tmp_path):
    """A rank killed outright leaves no Python traceback; its peer fails right after with gloo's "Connection closed
    by peer". The dead rank is the cause; the peer is listed as a consequence."""
    run = launch(FIXTURE, nproc=2, steps=10_000, sleep=0.05, run_dir=tmp_path)
    wait_for(lambda: (run.last_steps()[1] or 0) >= 3, 60, "rank 1 to pass step 3")
    run.workers()[1].send_signal(signal.SIGKILL)
    assert run.wait(30) == "failed"
    err = run.error
    assert err["rank"] == 1 and "SIGKILL" in err["error"] and "no Python traceback" in err["error"], err
    assert "step 3 loss" in err["traceback"]  # its log's last lines instead
    assert [k["rank"] for k in err["knock_on"]] in ([], [0])
    assert run.message.startswith("failed: rank 1")
    assert_no_process_left(run)


@pytest.mark.multiprocess
def test_verify_in_the_background_marks_each_step_with_its_rule(tmp_path):
    from runtime_cases import GPT_CELL, make_plan, source

    from autopar_nb.launch.dashboard import VerifyView
    from autopar_nb.verify.job import VerifyJob

    src = source(GPT_CELL)
    job = VerifyJob(src, make_plan(src, dp=2), steps=3, nproc=2, work_dir=tmp_path)
    view = job.view()
    phases = []
    job.add_listener(lambda j: phases.append(j.status))
    t0 = time.monotonic()
    report = job.wait(240)
    assert report is not None and report.ok, job.error or str(report)
    assert {"parallel", "reference"} <= set(phases) and job.status == "passed"
    assert time.monotonic() - t0 < 240
    rows = view.rows
    assert [r["step"] for r in rows] == [0, 1, 2] and all(r["ok"] for r in rows)
    assert [r["rule"] for r in rows] == [report.judge(s)[1] for s in report.steps]
    assert all(r["loss"] == s.loss for r, s in zip(rows, report.steps, strict=True))
    assert view.status == "passed" and any(n.startswith(f"{rows[0]['rule']}: ") for n in view.notes)
    assert isinstance(view, VerifyView) and not procs_of(job)


def procs_of(job) -> list:
    return processes_with_token(job._token)


@pytest.mark.multiprocess
def test_verify_in_the_background_stops(tmp_path):
    from runtime_cases import GPT_CELL, make_plan, source

    from autopar_nb.verify.job import VerifyJob

    src = source(GPT_CELL)
    job = VerifyJob(src, make_plan(src, dp=2), steps=2000, nproc=2, work_dir=tmp_path)
    wait_for(lambda: job.status == "parallel", 120, "the parallel run's first step")
    t0 = time.monotonic()
    assert job.stop() == "stopped" and time.monotonic() - t0 < 10
    assert job.report is None and not procs_of(job)


@pytest.mark.multiprocess
def test_stop_and_second_launch_refused(tmp_path):
    run = launch(FIXTURE, nproc=2, steps=10_000, sleep=0.05, run_dir=tmp_path / "a")
    wait_for(lambda: run.status == "running", 60, "the first step")
    with pytest.raises(LaunchError, match=r"still running .*run.stop\(\)"):
        launch(FIXTURE, nproc=2, steps=5, run_dir=tmp_path / "b")
    assert not (tmp_path / "b" / "agent.json").exists()
    workers = list(run.workers().values())
    assert len(workers) == 2
    # the dashboard follows the run from the monitor thread while this thread does something else
    board = run.dashboard()
    step_then = max(r["step"] or 0 for r in board.ranks)
    wait_for(lambda: max(r["step"] or 0 for r in board.ranks) >= step_then + 3, 30, "the dashboard to update")
    wait_for(lambda: board.steps.get("n", 0) >= 3 and board.timeline.get("n", 0) >= 2, 10, "the series to be sent")
    assert board.status == "running" and [r["state"] for r in board.ranks] == ["running", "running"]
    assert board.ranks[1]["memory"] > 0 and board.ranks[1]["memory_source"] == "psutil"
    assert board.info["util_label"].startswith("CPU") and board.info["nproc"] == 2
    t0 = time.monotonic()
    board._on_front_end_msg(board, {"event": "stop"}, [])  # the Stop button
    wait_for(lambda: run.done, 5, "the Stop button to end the run")
    assert time.monotonic() - t0 < 5
    assert run.status == "stopped" and "Stop button" in run.message
    wait_for(lambda: board.status == "stopped", 2, "the dashboard to show the end")
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in workers)
    assert_no_process_left(run)
    assert live_runs() == []


@pytest.mark.multiprocess
def test_keyboard_interrupt_in_wait_ends_every_worker(tmp_path):
    run = launch(FIXTURE, nproc=2, steps=10_000, sleep=0.05, run_dir=tmp_path)
    wait_for(lambda: run.status == "running", 60, "the first step")
    threading.Timer(0.3, _thread.interrupt_main).start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        run.wait()
    assert time.monotonic() - t0 < 0.3 + 5
    assert run.status == "stopped" and "KeyboardInterrupt" in run.message
    assert_no_process_left(run)


KERNEL = textwrap.dedent("""
    import sys, time
    from autopar_nb.launch import launch
    run = launch(sys.argv[1], nproc=2, steps=10_000, sleep=0.05)
    while run.status != "running":
        time.sleep(0.05)
    print(run._token, flush=True)
    if sys.argv[2] == "exit":
        sys.stdin.read()     # until the test says so
        sys.exit(0)          # a normal kernel shutdown: atexit stops the run
    time.sleep(600)          # the test SIGKILLs this "kernel"
""")


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_kernel_shutdown_ends_every_worker(how):
    """A kernel that exits (atexit) or is killed outright (the agent watches its parent) leaves no worker."""
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL, str(FIXTURE), how], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True,
                              cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        token = kernel.stdout.readline().strip()
        assert re.fullmatch(r"[0-9a-f]{32}", token), token
        # warm (the default): the agent (the pool's standby), its forkserver and resource tracker, two workers
        assert len(processes_with_token(token)) == 5
        t0 = time.monotonic()
        if how == "sigkill":
            kernel.send_signal(signal.SIGKILL)
        else:
            kernel.stdin.close()  # the "kernel" exits now
        wait_for(lambda: not processes_with_token(token), 5, "every worker to end")
        assert time.monotonic() - t0 < 5
        kernel.wait(10)
    finally:
        kernel.kill()
        kernel.wait()


@pytest.mark.multiprocess
def test_hang_is_reported_with_last_step_per_rank_then_torn_down(tmp_path):
    run = launch(FIXTURE, nproc=2, steps=100, fail_rank=-1, hang_rank=1, hang_step=4, hang_timeout_s=4.0,
                 run_dir=tmp_path)
    wait_for(lambda: run.status == "hung", 60, "the hang to be detected")
    # rank 1 stalls before step 4; rank 0 waits for it in the all-reduce of step 4
    assert run.last_steps() == {0: 3, 1: 3}
    assert "rank 0: 3, rank 1: 3" in run.message and "hang_timeout_s=4.0" in run.message
    wait_for(lambda: run.done, 5, "the teardown")
    assert run.status == "hung"
    assert_no_process_left(run)


@pytest.mark.multiprocess
def test_sigkilled_worker_restarts_from_checkpoint_and_loss_continues_exactly(tmp_path, reference_run):
    ckpt = tmp_path / "ckpt"
    run = launch(FIXTURE, nproc=2, steps=12, sleep=0.15, max_restarts=1, ckpt_dir=ckpt, ckpt_every=3,
                 run_dir=tmp_path / "run")
    statuses = []
    run.add_listener(lambda r: statuses.append(r.status))
    wait_for(lambda: (run.last_steps()[1] or 0) >= 5, 60, "rank 1 to pass step 5")
    run.workers()[1].send_signal(signal.SIGKILL)
    assert run.wait(120) == "finished", run.message
    assert "restarting" in statuses and statuses[-1] == "finished", statuses
    resumed = int(re.search(r"resumed from step (\d+)", run.logs(0)).group(1))
    assert resumed >= 3 and resumed % 3 == 0
    rows = run.metrics
    first = [r for r in rows if r["attempt"] == 0]
    second = [r for r in rows if r["attempt"] == 1]
    assert first and second, "the worker group was not restarted"
    # nothing before the checkpoint is redone, nothing after it is lost
    assert min(r["step"] for r in second) == resumed + 1
    assert sorted(r["step"] for r in second if r["rank"] == 0) == list(range(resumed + 1, 13))
    # the curve continues exactly: every step's loss equals the uninterrupted run's, per rank
    for rank in (0, 1):
        assert run.loss_curve(rank) == reference_run.loss_curve(rank)
    for r in first:  # and the steps redone after the restart give the same losses as before the kill
        redo = [s for s in second if s["rank"] == r["rank"] and s["step"] == r["step"]]
        assert not redo or redo[0]["loss"] == r["loss"]
    assert_no_process_left(run)


@pytest.mark.multiprocess
def test_dashboard_and_calibration_of_a_finished_run(reference_run, tmp_path, monkeypatch):
    factors_mod = pytest.importorskip("autopar_nb.cost.factors")
    from autopar_nb import calibration
    from autopar_nb.hardware import Cluster
    from autopar_nb.plan import Cost, MemoryBreakdown, Plan

    board = reference_run.dashboard()
    assert board.status == "finished" and board.steps["n"] == 12
    loss = series_columns(board.steps, "loss")
    assert [sum(v == v for v in col) for col in loss] == [12, 12]  # every step of every rank (NaN != NaN)
    assert loss[0] == [v for _, v in reference_run.loss_curve(0)] or all(
        abs(a - b) < 1e-6 * max(1.0, abs(b)) for a, (_, b) in zip(loss[0], reference_run.loss_curve(0), strict=True))
    assert board.summary["steps"] == 12 and board.summary["step_time_s"] > 0
    assert board.summary["calibration"]["text"].startswith("not calibrated")  # no plan: nothing to calibrate
    assert [r["state"] for r in board.ranks] == ["finished", "finished"]
    assert any("[rank1]" in line for line in board.ranks[1]["log"])
    assert "export default { render }" in board._esm  # anywidget loaded static/dashboard.js

    monkeypatch.setenv("AUTOPAR_CALIBRATION", str(tmp_path / "calibration.json"))
    measured = reference_run.summary()["step_time_s"]
    reference_run.plan = Plan(cost=Cost(step_time_s=2 * measured, memory_by_rank=[MemoryBreakdown(params=1e6)] * 2))
    try:
        cluster = Cluster.preset("cpu", gpus_per_node=2)
        factors = reference_run.calibrate(cluster)
        # no cluster given: the prediction is taken to have used the stored factors, so they are the start
        again = reference_run.calibrate(preset="cpu", save=False)
    finally:
        reference_run.plan = None
    assert again["eff_matmul"] == pytest.approx(factors["eff_matmul"] * 2)
    default = factors_mod.DEFAULT
    assert factors["eff_matmul"] == pytest.approx(default.eff_matmul * 2)  # twice as fast as predicted
    assert factors["op_overhead_s"] == pytest.approx(default.op_overhead_s / 2)
    assert "margin_fraction" not in factors  # RSS says nothing about the allocator margin
    assert calibration.load("cpu") == factors and "[cpu]" in calibration.show()
    calibrated = calibration.apply(cluster)
    assert factors_mod.factors_for(calibrated).eff_matmul == pytest.approx(default.eff_matmul * 2)
    calibration.reset("cpu")
    assert calibration.load("cpu") == {} and calibration.apply(cluster).calibration == {}


def test_calibration_memory_margin_from_cuda_peak():
    pytest.importorskip("autopar_nb.cost.factors")
    from autopar_nb import calibration

    current = {"eff_matmul": 0.7, "op_overhead_s": 4e-6, "margin_fraction": 0.05, "margin_fixed_bytes": 1e9}
    measured = {"step_time_s": 0.3, "predicted_step_time_s": 0.2, "memory_kind": "cuda_peak",
                "memory_by_rank": {0: 13e9, 1: 12e9}, "predicted_memory_by_rank": {0: 11.5e9, 1: 11.5e9},
                "predicted_breakdown_by_rank": {0: {"margin": 1.5e9}, 1: {"margin": 1.5e9}}}
    factors, record = calibration.factors_from(measured, current=current)
    assert factors["eff_matmul"] == pytest.approx(0.7 / 1.5)
    assert factors["op_overhead_s"] == pytest.approx(6e-6)
    # a summary without the reserve: the allocated peak is what the allocator held; base = 11.5 - 1.5 = 10 GB, and
    # the CUDA context (the fixed 1 GB) lies outside it: 13 = 10 * (1 + f)  ->  f = 0.3
    assert factors["margin_fraction"] == pytest.approx(0.3)
    assert record["ratio"] == pytest.approx(1.5) and record["margin_rank"] == 0
    # the peak reserve, where the run reported it, is what the margin covers (fragmentation included): the worst
    # rank is 0, 13.2 GB reserved, 13.2 = 10 * (1 + f)  ->  f = 0.32 (rank 1's 12.5 GB would give 0.25)
    reserved, record = calibration.factors_from({**measured, "reserved_by_rank": {0: 13.2e9, 1: 12.5e9}},
                                                current=current)
    assert reserved["margin_fraction"] == pytest.approx(0.32) and record["measured_reserved_bytes"] == 13.2e9
    # the H200's full-recompute run (BENCHMARKS.md "GPU"): 31.885 GiB predicted before the margin, 31.941 GiB
    # allocated, 41.695 GiB reserved -> the margin that covers it is 30.8 %, where the allocated peak gave 0.2 %
    gib = 2**30
    h200 = {**measured, "memory_by_rank": {0: 31.941 * gib}, "reserved_by_rank": {0: 41.695 * gib},
            "predicted_memory_by_rank": {0: 34.479 * gib}, "predicted_breakdown_by_rank": {0: {"margin": 2.594 * gib}}}
    assert calibration.factors_from(h200, current=current)[0]["margin_fraction"] == pytest.approx(0.3077, abs=1e-3)
    # that run's plan recomputed every layer: its reserve sets full recompute's margin, not every plan's
    full, _ = calibration.factors_from(h200, current=current, full_recompute=1.0)
    assert "margin_fraction" not in full and full["margin_full_recompute"] == pytest.approx(0.3077, abs=1e-3)
    h200.pop("reserved_by_rank")
    assert calibration.factors_from(h200, current=current)[0]["margin_fraction"] == pytest.approx(0.0018, abs=1e-3)
    with pytest.raises(ValueError, match="plan=<a Plan with a cost>"):
        calibration.factors_from({"step_time_s": 0.3}, current=current)


# ---- the real exported script --------------------------------------------------------------------------------------
HANG_CELL = """\
import time
import torch, torch.nn as nn
model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))
example_inputs = (torch.randn(8, 32),)


def make_batch(step, rank):
    if step == 3 and rank == 1:
        time.sleep(3600)  # a data loader that never returns
    return (torch.randn(8, 32, generator=torch.Generator().manual_seed(10 * step + rank)),)
"""


@pytest.mark.multiprocess
def test_exported_script_hang_shows_where_every_rank_waits(tmp_path):
    """Rank 1's data loader never returns at step 3; rank 0 waits for it in the gradients' all-reduce. The run is
    reported hung, and every rank printed its threads' stacks (faulthandler on SIGUSR1, registered by the exported
    script's Metrics when launched): rank 1's shows the cell's make_batch asleep."""
    export = pytest.importorskip("autopar_nb.export").export
    from runtime_cases import make_plan, source

    src = source(HANG_CELL)
    plan = make_plan(src, dp=2)
    run = launch(lambda path: export(src, plan, path, steps=20, quiet=True).script, nproc=2, steps=20, plan=plan,
                 run_dir=tmp_path, hang_timeout_s=4.0)
    wait_for(lambda: run.status == "hung", 120, "the hang to be detected")
    wait_for(lambda: run.done, 10, "the teardown")
    assert run.last_steps() == {0: 2, 1: 2} and run.hang["rank"] == 1  # the stacks tell who waits for whom
    assert "rank 1 stopped reporting first (after step 2" in run.message
    assert "it is in make_batch, while rank 0 waits inside torch" in run.message
    stacks = run.hang["stacks"]
    assert set(stacks) == {0, 1}, run.hang
    assert "make_batch" in stacks[1] and "time.sleep" in HANG_CELL and "most recent call first" in stacks[1]
    assert "in train" in stacks[0] and "make_batch" not in stacks[0]  # rank 0 got past its batch
    board = run.dashboard()
    assert board.status == "hung" and set(board.hang["stacks"]) == {"0", "1"}
    assert_no_process_left(run)

@pytest.mark.multiprocess
def test_exported_script_runs_under_launch_with_metrics(tmp_path):
    export = pytest.importorskip("autopar_nb.export").export
    from runtime_cases import GPT_CELL, make_plan, source

    src = source(GPT_CELL)
    plan = make_plan(src, dp=2)
    # cold ranks (a fresh interpreter each): a warm run of these 6 steps may end within the first 1 s tick, and the
    # memory samples below need ranks alive at a tick (test_pool.py runs the exported script warm)
    run = launch(lambda path: export(src, plan, path, steps=6, quiet=True).script, nproc=2, steps=6, plan=plan,
                 run_dir=tmp_path, ckpt_dir=tmp_path / "ckpt", ckpt_every=3, warm=False)
    assert run.wait(180) == "finished", f"{run.message}\n{run.logs(0, tail=30)}\n{run.logs(1, tail=30)}"
    assert run.script == (tmp_path / "train.py").resolve() and (tmp_path / "plan.json").exists()
    rows = run.metrics
    assert sorted({(r["rank"], r["step"]) for r in rows}) == [(r, s) for r in (0, 1) for s in range(6)]
    assert all(r["tokens_per_s"] > 0 and r["rss"] > 0 and 0 <= r["data_wait_s"] < r["step_time_s"] for r in rows)
    # memory is counted above what each rank held before building its model (the script's RSS_BEFORE_MODEL)
    base = {r: st.baseline for r, st in run.ranks().items()}
    assert all(b and b > 100 * 2**20 for b in base.values()), base  # Python + torch: hundreds of MiB
    measured = [s for s in run.samples if s["source"] == "psutil"]
    assert measured and all(s["memory_bytes"] == max(0, s["rss_bytes"] - base[s["rank"]]) for s in measured)
    assert all(s["rss_baseline_bytes"] == base[s["rank"]] for s in measured)
    assert run.summary()["memory_kind"] == "rss_above_baseline"
    # the script reports the global loss: every rank sees the same curve
    assert run.loss_curve(0) == run.loss_curve(1)
    assert (tmp_path / "ckpt" / "step_6").is_dir()
    assert_no_process_left(run)


def series_columns(data: dict, key: str) -> list[list[float]]:
    """A dashboard series trait's per-rank columns (float32 bytes, rank after rank) as lists."""
    from array import array

    values = array("f", data[key]).tolist()
    n = data["n"]
    return [values[r * n:(r + 1) * n] for r in range(data["ranks"])]


def test_step_series_is_decimated_and_cut_back_on_restart():
    from autopar_nb.launch.series import StepSeries

    s = StepSeries(2, ("loss",), max_points=10)
    for step in range(1, 101):
        s.add(0, step, 0, {"loss": float(step)})
        if step < 100:
            s.add(1, step, 0, {"loss": -float(step)})  # rank 1 reports one step less
    assert len(s) <= 11 and s.stride == 16 and s.x[-1] == 100
    assert all(x % 16 == 0 for x in s.x[:-1])
    assert s.curve("loss", 0)[-1] == (100, 100.0) and s.curve("loss", 1)[-1] == (96, -96.0)  # 99 was not kept
    s.add(1, 50, 0, {"loss": 1.0})  # a step whose row was decimated away: ignored
    assert s.curve("loss", 1)[-1] == (96, -96.0)
    for step in range(91, 96):  # restart 1 resumes from step 90 and redoes 91..
        s.add(0, step, 1, {"loss": -float(step)})
    assert s.curve("loss", 0)[-1] == (95, -95.0) and max(s.x[:-1]) <= 80  # 96.. cut, 91..94 not on the stride
    s.add(0, 200, 0, {"loss": 0.0})  # a late line of attempt 0: ignored
    assert s.x[-1] == 95


def test_timeline_keeps_ticks_bounded_with_the_latest():
    from autopar_nb.launch.series import Timeline

    tl = Timeline(2, ("memory_bytes",), ("source",), max_points=8)
    for k in range(50):
        tl.add(k, k * 1.0, {0: {"memory_bytes": 10 * k, "source": "psutil"}, 1: {"memory_bytes": None}})
    ticks = list(tl.ticks)
    assert len(ticks) <= 9 and ticks[-1] == 49 and all(t % tl.stride == 0 for t in ticks[:-1])
    samples = tl.samples()
    assert len(samples) == 2 * len(ticks) and samples[-2] == {"t": 49.0, "rank": 0, "source": "psutil",
                                                               "memory_bytes": 490}
    assert samples[-1]["memory_bytes"] is None and samples[-1]["source"] is None


def test_first_failure_is_the_cause_not_the_knock_on():
    from autopar_nb.launch.failure import failure_order
    from autopar_nb.launch.metrics import RankState

    peer_gone = "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1240"
    ranks = {0: RankState(0, error={"error": peer_gone}, failed_at=10.00),
             1: RankState(1, error={"error": "the process ended without reporting an error"}, failed_at=10.02),
             2: RankState(2)}
    assert failure_order(ranks) == [1, 0]  # seen together: the vanished peer is the cause
    ranks[1].failed_at = 10.5
    assert failure_order(ranks) == [0, 1]  # half a second apart: time decides
    ranks[2].error, ranks[2].failed_at = {"error": "ValueError: bad batch"}, 9.0
    assert failure_order(ranks)[0] == 2


def test_hang_names_the_rank_that_stopped_first():
    from autopar_nb.launch.hang import hang_message, stalled_rank
    from autopar_nb.launch.metrics import RankState

    ranks = {0: RankState(0, step=7, last_progress=50.0, connected=True),
             1: RankState(1, step=5, last_progress=40.0, connected=True),
             2: RankState(2, step=5, last_progress=41.0, connected=True)}
    assert stalled_rank(ranks, now=100.0, t0=0.0, timeout=30.0) == (1, 60.0)  # lowest step, then earliest
    assert "rank 1 stopped reporting first (after step 5" in hang_message(ranks, 1, 60.0, 30.0)
    # ranks 1 and 2 stopped after the same step: their stacks say which one the other waits for
    from autopar_nb.launch.hang import waited_for

    def stack(*frames):
        return "Current thread 0x1 (most recent call first):\n" + "".join(
            f'  File "{f}", line 1 in {fn}\n' for f, fn in frames)

    stacks = {1: stack(("/venv/torch/autograd/graph.py", "_engine_run_backward"), ("/run/train.py", "train")),
              2: stack(("/run/train.py", "make_batch"), ("/run/train.py", "train")),
              0: stack(("/venv/torch/distributed/distributed_c10d.py", "all_reduce"))}
    assert waited_for(ranks, 1, stacks) == 2 and waited_for(ranks, 1, {}) == 1
    assert "it is in make_batch, while ranks 1, 0 wait inside torch" in hang_message(ranks, 2, 60.0, 30.0, stacks)


def test_comparison_is_honest_about_the_device():
    from autopar_nb.launch.compare import comparison
    from autopar_nb.plan import BatchPlan, Cost, MemoryBreakdown, MeshPlan, Plan

    def plan(preset, pp=1, per_pp=False):
        mem = [MemoryBreakdown(params=100.0 * (i + 1), margin=10.0) for i in range(pp if per_pp else 4)]
        return Plan(mesh=MeshPlan(dp=4 // pp, pp=pp), batch=BatchPlan(global_batch=4, micro_batches=2),
                    cluster={"preset": preset}, cost=Cost(step_time_s=0.5, memory_by_rank=mem))

    c = comparison(plan("h100-80gb"), backend="gloo", nproc=4)
    assert not c["compare_time"] and c["predicted_step_time_s"] is None
    assert c["predicted_memory"] == [100.0, 200.0, 300.0, 400.0]  # the training state: no allocator margin
    assert "made for h100-80gb" in c["notes"][0] and "not compared" in c["notes"][0]
    assert c["other_device"] == "h100-80gb" and c["memory_slack_bytes"] > 0  # the watch raises no prediction error
    c = comparison(plan("cpu", pp=2, per_pp=True), backend="gloo", nproc=4)
    assert c["compare_time"] and c["predicted_step_time_s"] == 0.5
    assert c["predicted_memory"] == [100.0, 100.0, 200.0, 200.0]  # each rank gets its pipeline stage's figure
    c = comparison(plan("h100-80gb"), backend="nccl", nproc=4, gpu_name="NVIDIA H100 80GB HBM3")
    assert c["compare_time"] and c["predicted_memory"][0] == 110.0  # on the GPU: the whole prediction
    c = comparison(plan("h100-80gb"), backend="nccl", nproc=4, gpu_name="NVIDIA L4")
    assert not c["compare_time"] and "NVIDIA L4" in c["notes"][0] and c["other_device"] == "h100-80gb"


def test_vendored_uplot_is_the_npm_release():
    """static/vendor/uplot holds uPlot 1.6.32's own build files, unmodified (README.md there says how)."""
    import hashlib

    d = REPO / "autopar_nb" / "static" / "vendor" / "uplot"
    digest = {f: hashlib.sha256((d / f).read_bytes()).hexdigest() for f in ("uPlot.iife.min.js", "uPlot.min.css")}
    assert digest == {"uPlot.iife.min.js": "19c8d4c6ad88929a79f4ae49d6f7161566dfd0ba3d15cc495e974f787eb78f1f",
                      "uPlot.min.css": "df630c6a8d6f8eeaff264b50f73ce5b114f646ffd9a0bb74f049b0a00135fa04"}
    assert "MIT License" in (d / "LICENSE").read_text() and all(v in (d / "README.md").read_text()
                                                               for v in digest.values())
    from autopar_nb.launch.dashboard import Dashboard

    assert Dashboard._esm.startswith("/*! https://github.com/leeoniya/uPlot (v1.6.32) */")
    assert "export default { render }" in Dashboard._esm and ".uplot" in Dashboard._css


def test_agent_imports_only_the_standard_library_and_torch():
    """Worker-side processes never import autopar_nb, IPython or widgets (the agent runs as a plain script)."""
    import ast

    tree = ast.parse((REPO / "autopar_nb" / "launch" / "agent.py").read_text())
    roots = {(n.module if isinstance(n, ast.ImportFrom) else a.name).split(".")[0]
             for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    assert roots <= {"__future__", "json", "multiprocessing", "os", "select", "signal", "sys", "threading", "time",
                     "torch"}, roots


def test_planner_launch_and_verify_buttons_show_the_live_view_below(monkeypatch):
    """Launch/Verify read the processes/steps inputs (the run_options trait the front end writes); the run's
    dashboard, or the background verify's progress, becomes the widget's panel (rendered below it); nothing
    blocks the kernel (verify runs in a child process: here a stand-in records the call)."""
    import ipywidgets
    import torch
    import torch.nn as nn

    from autopar_nb import Cluster, capture
    from autopar_nb.notebook.session import Session
    from autopar_nb.source import ModelSource
    from autopar_nb.verify import job as verify_job

    calls = []

    class FakeRun:
        def __init__(self):
            self.board = ipywidgets.HTML("dashboard")

        def dashboard(self):
            return self.board

    class FakeJob:
        def __init__(self, source, plan, *, steps, nproc):
            calls.append(("verify", plan.mesh.world_size, steps, nproc))
            self.board = ipywidgets.HTML("verify progress")

        def view(self):
            return self.board

    class Launching(Session):
        def launch(self, nproc=None, steps=50, **flags):
            calls.append(("launch", nproc, steps))
            return FakeRun()

    monkeypatch.setattr(verify_job, "VerifyJob", FakeJob)
    with torch.device("meta"):
        graph = capture(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32)), (torch.randn(32, 64),))
    s = Launching(graph, Cluster.preset("h100-80gb", gpus_per_node=2), ModelSource("# test"))
    w = s.widget()
    assert w.run_defaults == {"nproc": 2} and w.panel is None
    w.run_options = {**w.run_options, "launch_steps": 20}
    w.handle({"kind": "action", "name": "launch"})
    assert calls[-1] == ("launch", 2, 20) and w.panel is w.last_result.board
    assert w.messages[0]["level"] == "info" and "ap.launch(nproc=2, steps=20)" in w.messages[0]["text"]
    w.run_options = {"nproc": 1, "verify_steps": 3, "launch_steps": 20}
    dashboard = w.panel
    w.handle({"kind": "action", "name": "verify"})
    assert calls[-1] == ("verify", 1, 3, 1)  # plan_for(1): dp=1
    assert w.verify_panel is w.last_result.board and w.panel is dashboard  # each in its own slot
    assert any("runs in the background" in m["text"] for m in w.messages), w.messages
    # the click carries the inputs as the user left them: ipywidgets may still hold their trait update back (an
    # earlier update unanswered) while the click's message goes at once; Launch ran 50 steps with 100,000 typed
    w.handle({"kind": "action", "name": "launch", "run_options": {"nproc": 2, "verify_steps": 3, "launch_steps": 7}})
    assert calls[-1] == ("launch", 2, 7) and w.run_options["launch_steps"] == 7, (calls[-1], w.run_options)


def _bare_run(tmp_path, nproc=2, backend="gloo", plan=None):
    """A Run with no processes behind it: its bookkeeping fed by hand."""
    from autopar_nb.launch.run import Run

    return Run(run_id="0123456789abcdef", run_dir=tmp_path, script=tmp_path / "train.py", nproc=nproc, steps=10,
               token="t", backend=backend, max_restarts=0, hang_timeout_s=None, plan=plan)


def test_memory_source_is_the_process_on_nvml_then_cuda_then_the_device_then_rss_above_the_baseline(tmp_path):
    from autopar_nb.launch.channel import Message

    run = _bare_run(tmp_path, nproc=4)
    run._ingest([Message(r, "hello", {}, 0.0) for r in range(4)])
    run._record_tick(0, {0: {"rss": 900.0, "cpu_percent": None}})  # start-up: no baseline yet, no CPU % yet
    assert run.samples[0]["memory_bytes"] == 900 and run.samples[0]["utilization_pct"] is None
    run._ingest([Message(0, "data", {"event": "start", "rss_before_model": 600.0}, 0.0),
                 Message(1, "data", {"step": 0, "loss": 1.0, "mem_allocated": 10.0, "mem_reserved": 20.0,
                                     "mem_peak": 15.0, "rss": 5000.0, "data_wait_s": 0.01}, 0.0)])
    run._record_tick(1, {0: {"rss": 1000.0, "cpu_percent": 50.0}, 1: {"rss": 5000.0, "cpu_percent": 99.0},
                         2: {"rss": 7000.0, "gpu_util": 87.0, "gpu_mem_used": 3e9, "gpu_mem_total": 8e10},
                         3: {"rss": 7000.0, "gpu_util": 80.0, "gpu_mem_used": 3e9, "gpu_proc_mem": 1e9}})
    s = {(i >= 4, x["rank"]): x for i, x in enumerate(run.samples)}  # (second tick, rank)
    assert s[(False, 0)]["memory_bytes"] == 300 and s[(False, 0)]["rss_baseline_bytes"] == 600  # set afterwards
    assert (s[(True, 0)]["source"], s[(True, 0)]["memory_bytes"], s[(True, 0)]["utilization_pct"]) == ("psutil", 400,
                                                                                                         50)
    assert (s[(True, 1)]["source"], s[(True, 1)]["memory_bytes"], s[(True, 1)]["cuda_peak_bytes"]) == ("cuda", 20, 15)
    assert s[(True, 1)]["data_wait_s"] == 0.01 and s[(True, 1)]["state"] == "running"
    # the whole GPU's figure (every process on it) only while nothing closer to the rank is known
    assert (s[(True, 2)]["source"], s[(True, 2)]["memory_bytes"], s[(True, 2)]["utilization_pct"]) == (
        "nvml-device", 3e9, 87)
    assert (s[(True, 3)]["source"], s[(True, 3)]["memory_bytes"], s[(True, 3)]["nvml_used_bytes"]) == ("nvml", 1e9, 3e9)


def test_calibration_is_refused_across_devices_and_the_summary_says_where_it_went(tmp_path, monkeypatch):
    pytest.importorskip("autopar_nb.cost.factors")
    from autopar_nb.launch.channel import Message
    from autopar_nb.launch.dashboard import _calibration_text
    from autopar_nb.plan import Cost, MemoryBreakdown, Plan

    monkeypatch.setenv("AUTOPAR_CALIBRATION", str(tmp_path / "calibration.json"))
    run = _bare_run(tmp_path, plan=Plan(cluster={"preset": "h100-80gb"}, cost=Cost(
        step_time_s=0.01, memory_by_rank=[MemoryBreakdown(params=1e6)] * 2)))
    run._ingest([Message(r, "data", {"step": s, "step_time_s": 0.02}, 0.0) for s in range(3) for r in range(2)])
    run._status = "finished"
    with pytest.raises(ValueError, match="say nothing about h100-80gb"):
        run.calibrate()
    assert "made for h100-80gb, this run used 2 CPU processes" in _calibration_text(run, run.comparison())["text"]
    run.plan.cluster = {"preset": "cpu"}
    text = _calibration_text(run, run.comparison())
    assert text["can"] and str(tmp_path / "calibration.json") in text["text"]
    run.calibrate()
    text = _calibration_text(run, run.comparison())
    assert text["done"] and "calibrated for cpu: eff_" in text["text"] and "2.00" in text["text"]


SLOW_DATA_CELL = """\
import time

import torch
import torch.nn as nn

model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
example_inputs = (torch.randn(8, 16),)


def make_batch(step, rank):
    time.sleep(0.2)  # a slow loader: most of each step waits for its batch
    return (torch.randn(8, 16, generator=torch.Generator().manual_seed(step)),)
"""


@pytest.mark.multiprocess
def test_data_loading_bottleneck_reaches_the_run_and_its_dashboard(tmp_path):
    """Issue 18 point 2: the exported script's data-wait verdict (the slowest rank's share of step time waiting for
    batches) is recorded on the Run, said in its end message and summary, and shown on the dashboard."""
    from runtime_cases import make_plan

    from autopar_nb.export import export
    from autopar_nb.source import ModelSource

    src = ModelSource(SLOW_DATA_CELL, make_batch_var="make_batch")
    plan = make_plan(src, dp=2)
    run = launch(lambda p: export(src, plan, p, quiet=True), 2, 4, plan=plan, warm=False, run_dir=tmp_path)
    assert run.wait(120) == "finished", run.message
    assert run.data is not None and run.data["bottleneck"] and run.data["share"] > 0.5, run.data
    assert "data loading is the bottleneck" in run.message and "--num-workers" not in run.message  # make_batch's fix
    assert run.summary()["data"] == run.data
    assert run.dashboard().summary["data"]["bottleneck"] is True


RESTART_CELL = """\
import os

import torch
import torch.nn as nn

model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
example_inputs = (torch.randn(8, 16),)


def make_batch(step, rank):
    if step == 2 and rank == 1 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        raise RuntimeError("injected: rank 1 fails at step 2 of the first attempt")
    return (torch.randn(8, 16, generator=torch.Generator().manual_seed(step)),)
"""


@pytest.mark.multiprocess
def test_an_exported_scripts_restart_is_counted_from_its_hello(tmp_path):
    """The exported script's hello carries torchrun's restart count, limit and world size (what an attached run
    follows restarts by); a warm local run of it that restarts once counts the same attempts as its logs."""
    from runtime_cases import make_plan

    from autopar_nb.export import export
    from autopar_nb.source import ModelSource

    src = ModelSource(RESTART_CELL, make_batch_var="make_batch")
    plan = make_plan(src, dp=2)
    run = launch(lambda p: export(src, plan, p, quiet=True), 2, 4, plan=plan, max_restarts=1, run_dir=tmp_path)
    assert run.wait(120) == "finished", run.message
    assert run._latest_attempt() == 1 and {st.attempt for st in run.ranks().values()} == {1}
    assert {r["attempt"] for r in run.metrics if r["step"] == 3} == {1}
    text = (tmp_path / "train_runtime.py").read_text()  # the hello: in the runtime module train.py imports
    assert '"rank": rank, **elastic}' in text and '"TORCHELASTIC_RESTART_COUNT"' in text
