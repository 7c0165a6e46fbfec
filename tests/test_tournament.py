import random
import time

import pytest

import autopar_nb as ap
from autopar_nb import calibration
from autopar_nb.demo import QUICKSTART_CELL
from autopar_nb.launch import trials
from autopar_nb.launch.standings import kendall_tau, stable, steady_time
from autopar_nb.launch.trials import predicted_need, step_times, tournament
from autopar_nb.notebook.session import Session
from autopar_nb.source import ModelSource


def seed_mlp() -> Session:
    """The seed MLP planned for 2 CPU processes (its alternatives: tp=2, dp=2 ZeRO-2, ...)."""
    source = ModelSource(QUICKSTART_CELL)
    model, inputs, _ = source.build(device="meta")
    s = Session(ap.capture(model, inputs), ap.Cluster.preset("cpu", gpus_per_node=2), source, global_batch=32)
    s.replan()
    return s


@pytest.fixture(scope="module")
def mlp():
    return seed_mlp()


def test_kendall_tau_matches_scipy_with_ties():
    from scipy.stats import kendalltau

    rng = random.Random(0)
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert kendall_tau([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    assert kendall_tau([1.0], [2.0]) == 0.0 and kendall_tau([1, 1, 1], [1, 2, 3]) == 0.0
    for _ in range(20):
        n = rng.randint(2, 7)
        a, b = [rng.randint(0, 3) for _ in range(n)], [rng.randint(0, 3) for _ in range(n)]
        want = kendalltau(a, b).statistic
        assert kendall_tau(a, b) == pytest.approx(0.0 if want != want else want)


def test_a_trial_stops_when_its_steady_steps_vary_little():
    slow_start = [0.5, 0.2] + [0.010, 0.0101, 0.0099, 0.010]
    assert not stable(slow_start, warmup=2, min_steps=5, cv=0.05)  # 4 steady steps: too few
    assert stable([*slow_start, 0.010], warmup=2, min_steps=5, cv=0.05)
    assert not stable([0.5, 0.2, 0.010, 0.020, 0.010, 0.020, 0.010], warmup=2, min_steps=5, cv=0.05)
    assert steady_time([0.5, 0.2, 0.03, 0.01, 0.02], warmup=2) == 0.02 and steady_time([0.4], warmup=2) == 0.4
    rows = [{"rank": 0, "attempt": 0, "step": 1, "step_time_s": 0.3}, {"rank": 1, "attempt": 0, "step": 1,
                                                                      "step_time_s": 0.4},
            {"rank": 1, "attempt": 0, "step": 2, "step_time_s": 0.1}, {"rank": 0, "attempt": 0, "step": 2,
                                                                      "step_time_s": 0.2}]
    assert step_times(rows) == [0.4, 0.2]  # a step is as slow as its slowest rank


def test_fit_components_recovers_scales_and_changes_the_order():
    def part(d, c, o, h, ho):
        return {"device": d, "communication": c, "optimizer": o, "host": h, "host_optimizer": ho}

    # host-bound, device-bound and communication-heavy plans: each scale shows in some of them
    parts = [part(1.0, 0.0, 0.2, 0.5, 0.1), part(0.5, 0.4, 0.2, 0.2, 0.1), part(0.2, 0.1, 0.1, 3.0, 0.5),
             part(0.8, 0.3, 0.1, 0.4, 1.0), part(0.3, 0.6, 0.2, 0.1, 0.0)]
    true = {"device": 2.0, "communication": 10.0, "host": 0.5}
    measured = [calibration.scaled_step(p, true) for p in parts]
    scales = calibration.fit_components(parts, measured)
    assert scales == pytest.approx(true, rel=1e-3)
    ones = dict.fromkeys(calibration.COMPONENTS, 1.0)
    before = [calibration.scaled_step(p, ones) for p in parts]
    assert kendall_tau(before, measured) < 1 and kendall_tau([calibration.scaled_step(p, scales) for p in parts],
                                                             measured) == 1
    f = calibration.factors_from_scales(scales, current={"eff_matmul": 0.8, "eff_link": 0.5, "cpu_op_s": 1e-5,
                                                         "pp_handoff_s": 1e-3})
    # a pipeline handoff's wait is exposed communication: it scales with it
    assert f == pytest.approx({"eff_matmul": 0.4, "eff_link": 0.05, "cpu_op_s": 5e-6, "pp_handoff_s": 1e-2},
                              rel=1e-3)
    # one run: a single ratio, for every component
    assert calibration.fit_components([part(1.0, 1.0, 0.0, 0.5, 0.0)], [4.0]) == dict.fromkeys(
        calibration.COMPONENTS, 2.0)


def test_plans_predicted_not_to_fit_are_skipped_not_run(mlp):
    needs = sorted(predicted_need(p) for p in [mlp.plan, *mlp.plan.alternatives[:2]])
    t = tournament(mlp, k=2, steps=3, memory_limit_bytes=needs[0] - 1)  # nothing fits: no process is started
    assert [e.status for e in t.entries] == ["skipped"] * 3 and all(" per rank > " in e.reason for e in t.entries)
    assert t.tau is None and t.winner is None and t.factors == {} and "no plan measured" in repr(t)
    with pytest.raises(ValueError, match="nothing to adopt"):
        t.adopt()


def test_the_next_plan_says_where_its_step_times_come_from(mlp, monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOPAR_CALIBRATION", str(tmp_path / "c.json"))
    calibration.store("cpu", {"eff_fp32_matmul": 0.5, "cpu_op_s": 2e-5}, {"runs": 5, "tournament": True})
    cluster = calibration.apply(ap.Cluster.preset("cpu", gpus_per_node=2))
    plan = ap.plan(mlp.graph, cluster, global_batch=32)
    assert any(line.startswith("Step times calibrated on ") and "from 5 runs" in line for line in plan.explanation)
    assert not any("calibrated on" in line for line in mlp.plan.explanation)


@pytest.mark.multiprocess
def test_tournament_of_the_seed_mlp_measures_each_plan_that_fits(monkeypatch, tmp_path):
    """k=3 on 2 gloo processes: the chosen plan and its three best alternatives (tp=2 and dp=2 layouts); a memory
    limit under the largest predicted need skips the plans that need it, the others run (a few steps, through the
    warm pool)."""
    monkeypatch.setenv("AUTOPAR_CALIBRATION", str(tmp_path / "c.json"))
    mlp = seed_mlp()  # its own: adopt() changes the session's plan
    plans = [mlp.plan, *mlp.plan.alternatives[:3]]
    needs = [predicted_need(p) for p in plans]
    limit = max(needs) - 1
    assert 2 <= sum(need <= limit for need in needs) < len(plans), needs
    t = tournament(mlp, k=3, steps=4, warmup=1, memory_limit_bytes=limit, run_root=str(tmp_path))
    assert [e.plan for e in t.entries] == plans
    for e, need in zip(t.entries, needs, strict=True):
        if need > limit:
            assert e.status == "skipped" and e.measured_s is None and e.steps == 0
        else:
            assert e.status == "measured", e.reason
            assert e.measured_s > 0 and e.steps >= 2 and set(e.peak_by_rank) == {0, 1} and e.calibrated_s > 0
    assert len(t.measured) == sum(need <= limit for need in needs)
    assert -1 <= t.tau <= 1 and -1 <= t.tau_calibrated <= 1
    winner = min(t.measured, key=lambda e: e.measured_s)
    assert t.winner is winner
    adopted = t.adopt()
    assert adopted.diff(winner.plan) == [] and adopted.cost == winner.plan.cost and mlp.plan is adopted
    assert calibration.load("cpu") == pytest.approx(t.factors) and "measured" in t._repr_html_()


def test_plans_for_gpus_this_machine_lacks_are_not_ranked_here(mlp):
    """Trials run on this machine: plans costed for H100s would be measured on CPU processes (or another GPU), and
    the order and the calibration would compare unlike things. Refused before any process starts, in words that
    say what to do; the widget's button gives the same reason."""
    from autopar_nb.launch.trials import machine_mismatch
    from autopar_nb.widget.actions import refusal

    h100 = ap.Cluster.preset("h100-80gb", gpus_per_node=2)
    plan = ap.plan(mlp.graph, h100, global_batch=32)
    why = machine_mismatch(h100)
    assert why.startswith("the plans were made for h100-80gb GPUs and this machine has no GPU") and "--gpu cpu" in why
    with pytest.raises(ValueError, match="tournament\\(\\) refused: the plans were made for h100-80gb"):
        tournament(plan, k=1, steps=3, source=mlp.source, graph=mlp.graph, cluster=h100)
    assert refusal("tournament", {}, h100) == why and refusal("launch", {}, h100) == ""
    assert machine_mismatch(ap.Cluster.preset("cpu", gpus_per_node=2)) == ""


@pytest.mark.multiprocess
def test_a_stopped_tournament_ends_its_workers_and_keeps_what_it_measured(monkeypatch, tmp_path):
    """The Tournament view's Stop while the second of three plans runs: that trial's workers end (none left,
    psutil), the third plan is not run, the first plan's measurement stays and can be adopted, nothing is
    calibrated from the few points, and the view says "stopped after 1 of 3 plans"."""
    import psutil

    from autopar_nb.launch import launcher
    from autopar_nb.launch.procs import processes_with_token
    from autopar_nb.launch.tournament_job import TournamentJob

    runs = []

    def launch(build, nproc, steps, **kwargs):  # the second trial would run long enough to be stopped in its steps
        runs.append(launcher.launch(build, nproc, steps if not runs else 100_000, **kwargs))
        return runs[-1]

    monkeypatch.setattr(trials, "launch", launch)
    monkeypatch.setenv("AUTOPAR_CALIBRATION", str(tmp_path / "c.json"))
    job = TournamentJob(seed_mlp(), k=2, steps=6, warmup=1, cv=0.0, run_root=str(tmp_path))
    view = job.view()
    deadline = time.monotonic() + 240
    while not (len(runs) == 2 and len(step_times(runs[1].metrics)) >= 2):
        assert time.monotonic() < deadline and not job.done, (job.message, job.error)
        time.sleep(0.05)
    workers = list(runs[1].workers().values())
    assert len(workers) == 2
    view._on_front_end_msg(view, {"event": "stop"}, [])  # the Stop button
    job.wait(30)
    assert job.status == "stopped" and job.message.startswith("stopped after 1 of 3 plans"), job.message
    assert [e.status for e in job.result.entries] == ["measured", "stopped", "stopped"]
    assert job.result.entries[2].reason.startswith("not run") and len(runs) == 2
    assert job.result.stopped and job.result.winner is job.result.entries[0]
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in workers)
    assert not processes_with_token(runs[1]._token) and launcher.live_runs() == []
    assert calibration.load("cpu") == {}
    deadline = time.monotonic() + 5
    while view.status != "stopped" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert view.status == "stopped" and view.summary["verdict"].startswith("stopped after 1 of 3 plans")
    assert job.adopt() == f"{job.result.entries[0].label} is the plan already"


def test_tau_counts_only_the_pairs_that_repeats_tell_apart():
    """Plans 0 and 1 overlap across repeats (no measured order); 2 is slower than both in every repeat."""
    from autopar_nb.launch.standings import tau_over_distinguishable

    predicted = [1.0, 2.0, 3.0]
    assert tau_over_distinguishable(predicted, [[10, 14], [12, 13], [20, 30]]) == (1.0, 2)
    assert tau_over_distinguishable([3.0, 2.0, 1.0], [[10, 14], [12, 13], [20, 30]]) == (-1.0, 2)
    assert tau_over_distinguishable(predicted, [[10, 20], [12, 25], [15, 30]]) == (None, 0)
    assert tau_over_distinguishable(predicted, [[10], [], [5]]) == (-1.0, 1)


@pytest.mark.multiprocess
def test_an_interrupted_tournament_leaves_no_worker_behind(monkeypatch, tmp_path):
    """An interrupt of a blocking ap.tournament() (the kernel's Interrupt: KeyboardInterrupt in the thread that
    waits on the trial) ends the trial's workers before it propagates."""
    from autopar_nb.launch import launcher
    from autopar_nb.launch.procs import processes_with_token

    runs = []

    def interrupted(e, run, t0, **kwargs):
        runs.append(run)
        deadline = time.monotonic() + 240
        while len(step_times(run.metrics)) < 1:
            assert time.monotonic() < deadline and not run.done, run.message
            time.sleep(0.05)
        raise KeyboardInterrupt

    monkeypatch.setattr(trials, "watch_trial", interrupted)
    monkeypatch.setenv("AUTOPAR_CALIBRATION", str(tmp_path / "c.json"))
    with pytest.raises(KeyboardInterrupt):
        tournament(seed_mlp(), k=1, steps=100_000, run_root=str(tmp_path))
    assert runs and runs[0].done and not processes_with_token(runs[0]._token) and launcher.live_runs() == []
