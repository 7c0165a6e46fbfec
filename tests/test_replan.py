"""launch/replan.py (issue 14, points 2 and 5): the decision and the words, and a real CPU run over its memory limit
that re-plans, resumes from its checkpoint under the new plan and matches the single-process losses."""

from __future__ import annotations

import time

import pytest

from autopar_nb import calibration
from autopar_nb.capture import capture
from autopar_nb.hardware import Cluster
from autopar_nb.launch.compare import predicted_memory
from autopar_nb.launch.replan import (
    cause_text,
    check_mode,
    diff_text,
    layers_text,
    measured_peaks,
    trigger_of,
)
from autopar_nb.notebook.session import Session
from autopar_nb.plan import Change
from autopar_nb.source import ModelSource
from autopar_nb.units import fmt_bytes

MIB = 2**20


def test_modes_and_the_trigger():
    assert [check_mode(m) for m in ("ask", "auto", "off")] == ["ask", "auto", "off"]
    with pytest.raises(ValueError, match="choose 'ask'"):
        check_mode("sometimes")
    high = {"kind": "memory_high", "rank": 1, "t": 3.0}
    oom = {"kind": "oom", "rank": 0, "t": 4.0}
    assert trigger_of([{"kind": "straggler"}, high, oom]) is oom  # an out-of-memory first
    assert trigger_of([{"kind": "prediction_error"}, high]) is high
    assert trigger_of([{"kind": "straggler"}]) is None


def test_cause_and_diff_in_words():
    high = {"kind": "memory_high", "rank": 1, "step": 12, "limit_bytes": 3 * 2**30, "share": 0.94}
    assert cause_text(high) == "rank 1 reached 94% of 3.00 GiB at step 12"
    killed = {"kind": "oom", "rank": 0, "step": 3, "limit_bytes": 2**30, "share": 1.05, "killed": True}
    assert cause_text(killed) == "rank 0 exceeded its 1.00 GiB limit (105%) at step 3 and was stopped"
    assert cause_text({"kind": "oom", "rank": 2}) == "rank 2 ran out of memory"
    changes = [Change("mesh.zero_stage", 2, 3), Change("cluster.memory_limit_bytes", 1, 2),
               Change("layers[h.2].recompute", "none", "selective"),
               Change("layers[h.3].recompute", "none", "selective"), Change("layers[h.3].pinned", [], ["x"]),
               Change("batch.micro_batches", 1, 4), Change("layers[lm_head].fsdp", False, True)]
    assert diff_text(changes) == ("ZeRO 2 → 3, micro-batches 1 → 4, recompute none → selective on h.2–3, "
                                  "FSDP off → on on lm_head")
    assert diff_text([Change("cluster.preset", "a", "b")]) == "no change"
    assert layers_text(["h.0", "h.1", "h.2", "h.5", "head", "blocks.7"]) == "h.0–2, h.5, blocks.7, head"


def test_measured_peaks_use_the_peak_rss_above_the_baseline():
    rows = [{"rank": 0, "source": "psutil", "memory_bytes": 2e9, "rss_baseline_bytes": None},  # no baseline yet
            {"rank": 0, "source": "psutil", "memory_bytes": 50 * MIB, "rss_baseline_bytes": 300 * MIB,
             "rss_peak_bytes": 420 * MIB},  # a peak between two samples: 120 MiB above the baseline
            {"rank": 1, "source": "psutil", "memory_bytes": 80 * MIB, "rss_baseline_bytes": 300 * MIB}]
    assert measured_peaks(rows) == {0: 120 * MIB, 1: 80 * MIB}


def test_margin_from_what_the_ranks_held():
    """The rule CUDA runs calibrate by, on the worst rank by measured / predicted."""
    factors, rec = calibration.margin_factors({0: 150.0, 1: 240.0}, {0: 100.0, 1: 120.0},
                                              current={"margin_fraction": 0.05, "margin_fixed_bytes": 0.0})
    assert factors == {"margin_fraction": pytest.approx(1.0)} and rec["rank"] == 1
    with pytest.raises(ValueError, match="needs a rank with a measured peak"):
        calibration.margin_factors({0: 1.0}, {}, current={"margin_fraction": 0.05})


def test_cpu_margin_is_the_floor_between_steps_plus_what_the_peak_holds_beyond_it():
    """calibration.rss_margin_factors on closed forms: the fixed part is the most a rank held between steps beyond
    its parameters and optimizer state, the fraction what its peak held beyond that and the predicted state."""
    from autopar_nb.plan import MemoryBreakdown

    mb = MemoryBreakdown(params=10 * MIB, grads=10 * MIB, optimizer=20 * MIB, activations=100 * MIB,
                         buffers=10 * MIB, margin=7 * MIB)  # state 150 MiB, 30 MiB of it kept between steps
    factors, rec = calibration.rss_margin_factors({0: 210 * MIB, 1: 200 * MIB}, {0: 80 * MIB, 1: 84 * MIB},
                                                  {0: mb, 1: mb})
    assert factors["margin_fixed_bytes"] == 54 * MIB  # rank 1's 84 - 30
    assert factors["margin_fraction"] == pytest.approx((210 - 54 - 150) / 150)  # rank 0's peak
    assert rec["rank"] == 0 and rec["floor_bytes"] == 80 * MIB
    # so the calibrated prediction of the worst rank is what it held
    assert 150 * MIB * (1 + factors["margin_fraction"]) + factors["margin_fixed_bytes"] == pytest.approx(210 * MIB)
    with pytest.raises(ValueError, match="between steps"):
        calibration.rss_margin_factors({0: MIB}, {}, {0: mb})


def test_a_peak_no_sample_saw_is_known_from_the_step_reports(tmp_path):
    """A short run's monitor may sample a rank only between steps (on a loaded host, once or never): each step's
    report carries the rank's own VmHWM, so its peak is known all the same."""
    from autopar_nb.launch.run import Run
    from autopar_nb.runtime.metrics import memory_stats

    assert memory_stats("cpu")["rss_peak"] >= memory_stats("cpu")["rss"] > 0
    run = Run(run_id="r", run_dir=tmp_path, script=tmp_path / "train.py", nproc=1, steps=2, token="t",
              backend="gloo", max_restarts=0, hang_timeout_s=None, plan=None)
    run._ranks[0].baseline = 300 * MIB
    run._record_tick(0, {0: {"rss": 310 * MIB, "rss_peak": 320 * MIB}})  # before the first step's activations
    run._rows += [{"rank": 0, "attempt": 0, "step": k, "step_time_s": 0.2, "rss": 360 * MIB,
                   "rss_peak": (420 + k) * MIB, "time": 0.0} for k in range(2)]
    assert run.rss_figures() == {0: {"peak": 121 * MIB, "floor": 60 * MIB}}


def test_run_calibrate_on_cpu_stores_the_allocator_margin_it_measured(tmp_path):
    """Issue 21 point 5: a finished CPU run's calibrate() stores the margin from its ranks' RSS (not only the step
    time), and the next plan on that preset uses it and says where it comes from."""
    from autopar_nb.cost.factors import factors_for
    from autopar_nb.launch.compare import predicted_breakdown
    from autopar_nb.launch.run import Run
    from autopar_nb.planner.explain import _margin_source

    calibration.reset("cpu")
    ap, _ = session_with_limit()
    assert "the cost model's default (not calibrated)" in _margin_source(ap.cluster)
    plan = ap.plan
    run = Run(run_id="r", run_dir=tmp_path, script=tmp_path / "train.py", nproc=2, steps=3, token="t",
              backend="gloo", max_restarts=0, hang_timeout_s=None, plan=plan)
    base, mb = 300 * MIB, predicted_breakdown(plan, 0)
    state = mb.total - mb.margin
    fixed = 60 * MIB - calibration.persistent_bytes(mb)  # held between steps beyond params and optimizer state
    for r in (0, 1):
        run._ranks[r].baseline = base
    peak = state * 1.1 + fixed  # 10 % of the state beyond the tensors at the peak
    run._record_tick(0, {r: {"rss": base + 60 * MIB, "rss_peak": base + peak} for r in (0, 1)})
    run._rows += [{"rank": r, "attempt": 0, "step": k, "step_time_s": 0.2, "rss": base + 60 * MIB, "time": 0.0}
                  for k in range(3) for r in (0, 1)]
    run._status = "finished"
    factors = run.calibrate(preset="cpu")
    assert factors["margin_fixed_bytes"] == pytest.approx(fixed)
    assert factors["margin_fraction"] == pytest.approx(0.1) and "eff_fp32_matmul" in factors
    assert calibration.load("cpu")["margin_fixed_bytes"] == pytest.approx(fixed)
    cluster = calibration.apply(ap.cluster)
    assert factors_for(cluster).margin_fixed_bytes == pytest.approx(fixed)
    assert "calibrated for cpu (run of " in _margin_source(cluster)
    calibration.reset("cpu")


def test_near_the_limit_the_run_stops_at_the_first_checkpoint_after_two_timed_steps(tmp_path):
    """The checkpoint written after the first (warm-up) step is not where it stops: the next one is, so a step
    time besides the warm-up one calibrates; a run that ends first leaves the latest checkpoint."""
    import threading

    from autopar_nb.launch.replan import Replanner
    from autopar_nb.launch.run import Run

    def checkpoint(step):
        (tmp_path / "ck" / f"step_{step}").mkdir(parents=True)
        (tmp_path / "ck" / f"step_{step}" / "manifest.json").touch()

    def steps(run, *ks):
        with run._lock:
            run._rows += [{"rank": r, "attempt": 0, "step": k, "step_time_s": 0.1, "time": 0.0} for k in ks
                          for r in (0, 1)]

    def make_run(name):
        return Run(run_id=name, run_dir=tmp_path / name, script=tmp_path / "train.py", nproc=2, steps=6, token="t",
                   backend="gloo", max_restarts=0, hang_timeout_s=None)

    replanner = Replanner("auto", cluster=None, plan_fn=None, launch_fn=None, ckpt_dir=str(tmp_path / "ck"))
    run = make_run("a")

    def training():
        time.sleep(0.2)  # (else it may be all over before the wait starts: then it waits for the timeout)
        steps(run, 0)
        checkpoint(1)
        time.sleep(0.3)
        steps(run, 1)
        checkpoint(2)

    assert replanner.wait_for_checkpoint(make_run("idle"), timeout_s=0) is None  # imports the runtime's reader
    worker = threading.Thread(target=training)
    worker.start()
    assert replanner.wait_for_checkpoint(run, timeout_s=60).endswith("step_2")
    worker.join()
    ended = make_run("b")  # one step, its checkpoint, then the run ends: the latest checkpoint is the one
    steps(ended, 2)
    checkpoint(3)
    ended._done.set()
    assert replanner.wait_for_checkpoint(ended, timeout_s=60).endswith("step_3")


def test_a_replan_calibrates_the_step_time_so_the_plan_predicts_what_was_measured(tmp_path):
    """The stopped run's steady steps (its first, warm-up step left out) against the plan's step time: the speed
    factors that make the same plan, costed again, predict the measured step time; only one step: none."""
    import dataclasses

    from autopar_nb.cost.estimate import estimate
    from autopar_nb.launch.replan import Replanner
    from autopar_nb.launch.run import Run

    ap, _ = session_with_limit()
    plan = ap.plan
    run = Run(run_id="r", run_dir=tmp_path, script=tmp_path / "train.py", nproc=2, steps=6, token="t",
              backend="gloo", max_restarts=0, hang_timeout_s=None, plan=plan)
    current = calibration._current_factors(ap.cluster)
    measured = 3.0 * plan.cost.step_time_s
    run._rows += [{"rank": r, "attempt": 0, "step": 0, "step_time_s": 40 * measured, "time": 0.0} for r in (0, 1)]
    assert Replanner.calibrate_time(run, current) == ({}, "step time not calibrated (only the first, warm-up step "
                                                          "was measured)")
    run._rows += [{"rank": r, "attempt": 0, "step": s, "step_time_s": measured, "time": 0.0} for s in (1, 2)
                  for r in (0, 1)]
    factors, words = Replanner.calibrate_time(run, current)
    assert "(x3.00)" in words and factors["eff_fp32_matmul"] == pytest.approx(current["eff_fp32_matmul"] / 3)
    cluster = dataclasses.replace(ap.cluster, calibration={**(ap.cluster.calibration or {}), **factors})
    assert estimate(ap.graph, cluster, plan).step_time_s == pytest.approx(measured, rel=0.05)


# ---- a real run over its limit ---------------------------------------------------------------------------------
# activations dominate (2048 x 4096 floats per GELU): more micro-batches cut them, and a CPU rank's peak RSS above
# its baseline is about twice the predicted training state (torch's first-use allocations, checkpoint staging)
CELL = """\
import torch, torch.nn as nn
model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 4096), nn.GELU(), nn.Linear(4096, 16)) for _ in range(4)])
example_inputs = (torch.randn(2048, 16),)
"""
STEPS = 6
THRESHOLD = 0.6
"""memory_high at 60 % of the limit, the kill at 100 %: the run goes on to its next checkpoint, then re-plans"""


def session_with_limit() -> tuple[Session, float]:
    """The planner's choice with the host's RAM, then a limit 1.6x its predicted peak: room enough for the planner
    to keep that plan, not for what the ranks really hold."""
    src = ModelSource(CELL)
    model, inputs, _ = src.build(device="meta")
    graph = capture(model, inputs)
    free = Session(graph, Cluster.preset("cpu", gpus_per_node=2), src).replan()
    limit = 1.6 * free.cost.peak_memory_bytes
    ap = Session(graph, Cluster.preset("cpu", gpus_per_node=2, memory_gb=limit / 2**30), src)
    assert [c for c in free.diff(ap.replan()) if not c.path.startswith("cluster.")] == []
    return ap, limit


@pytest.mark.multiprocess
def test_a_run_over_its_cpu_limit_replans_and_resumes_from_its_checkpoint(tmp_path):
    import dataclasses

    from autopar_nb.cost.estimate import estimate
    from autopar_nb.launch.metrics import steady_step_time
    from autopar_nb.verify import FP32_RTOL, reference

    ap, limit = session_with_limit()
    first = ap.plan
    run = ap.launch(2, STEPS, replan="auto", memory_threshold=THRESHOLD, ckpt_dir=str(tmp_path / "ckpt"),
                    ckpt_every=1, run_dir=str(tmp_path / "run"), hang_timeout_s=300)
    dash = run.dashboard()
    assert run.wait(timeout=600) == "finished", [(leg.status, leg.message, leg.events) for leg in run.legs()]
    legs = run.legs()
    # one re-plan suffices: the first calibration is right (the margin's fixed part is what a rank holds between
    # steps, and under the limit glibc returns freed activations at once, so the peak does not grow over the steps)
    assert len(legs) == 2 and legs[0].status == "stopped" and legs[-1].status == "finished"
    held = max(v["peak"] for v in legs[1].rss_figures().values())
    calibrated = max(predicted_memory(legs[1].plan, r, model_state=False) for r in range(2))
    print(f"second leg: held {held / 2**20:.1f} MiB, calibrated prediction {calibrated / 2**20:.1f} MiB")
    assert 0.8 * calibrated <= held <= 1.1 * calibrated
    for leg, nxt in zip(legs, legs[1:], strict=False):
        (ev,) = [e for e in leg.events if e["kind"] == "replan"]
        print(ev["reason"])
        resumed_at = int(ev["checkpoint"].rsplit("_", 1)[1]) if ev["checkpoint"] else 0
        assert min(s for s, _ in nxt.loss_curve()) == resumed_at
        done = max(s for s, _ in leg.loss_curve())
        if ev["cause"].startswith(f"rank {ev['rank']} reached"):  # near the limit: it went on to its next checkpoint
            assert ev["checkpoint"] and done == resumed_at - 1, ev  # and stopped there: no step lost, none redone
        else:  # over it (stopped at once): rolled back, at most ckpt_every (1) step redone
            assert "exceeded its" in ev["cause"] and done - resumed_at + 1 <= 1, ev
        assert "because rank" in ev["reason"] and fmt_bytes(limit) in ev["reason"]
        assert ev["diff_text"] != "no change" and ev["calibration"]["margin_fixed_bytes"] > 0
        # it stopped after a timed step besides the warm-up one: the speed factors make the stopped plan, costed
        # again on the calibrated cluster, predict the step time it measured
        assert "steps took" in ev["reason"] and "eff_fp32_matmul" in ev["calibration"], ev["reason"]
        calibrated = dataclasses.replace(ap.cluster, calibration=ev["calibration"])
        assert estimate(ap.graph, calibrated, leg.plan).step_time_s == pytest.approx(
            steady_step_time(list(leg.metrics)), rel=0.05)
        # a remedy (here more micro-batches, or ZeRO-3): the new plan predicts less training state per rank
        assert predicted_memory(nxt.plan, 0, model_state=True) < predicted_memory(leg.plan, 0, model_state=True)
        (resume,) = [e for e in nxt.events if e["kind"] == "resume"]
        assert resume["step"] == resumed_at and resume["seconds_from_trigger"] > 0
    assert not [e for e in legs[-1].events if e["kind"] in ("memory_high", "oom", "replan")]
    # the dashboard followed every leg, and its timeline has each one's launch, re-plan, end and resume in order
    assert dash._run is legs[-1]
    kinds = [e["kind"] for e in dash.events if e["kind"] in ("launch", "replan", "stop", "resume", "finish")]
    assert kinds == ["launch"] + ["stop", "replan", "launch", "resume"] * (len(legs) - 1) + ["finish"], kinds
    assert [e["t"] for e in dash.events] == sorted(e["t"] for e in dash.events)
    assert ap.plan.diff(legs[-1].plan) == [] and ap.plan.cluster["memory_limit_bytes"] == int(limit)  # it follows
    ap.undo()
    assert ap.plan.diff(legs[-2].plan) == []
    losses = {}
    for leg in legs:
        losses.update(leg.loss_curve())
    assert sorted(losses) == list(range(STEPS))
    expected = reference(ap.source, first, steps=STEPS)["losses"]
    assert [losses[s] for s in range(STEPS)] == pytest.approx(expected, rel=FP32_RTOL, abs=0)


def test_ask_proposes_and_replan_from_code_continues_with_the_sessions_new_plan(tmp_path):
    """replan="ask": an event makes a proposal (the dashboard offers Re-plan & resume / Stop) and nothing else;
    run.replan() then calibrates, re-plans with the session's pins and continues in the run launch_fn starts (here
    a Run that is never started: the launching itself is the multiprocess test's)."""
    from autopar_nb.launch.dashboard import events_of, replan_state
    from autopar_nb.launch.replan import Replanner
    from autopar_nb.launch.run import Run

    ap, limit = session_with_limit()
    ap.fix = {"dp": 2}  # a user's pin, kept by the re-plan
    plan = ap.replan()

    def make_run(run_id, p):
        return Run(run_id=run_id, run_dir=tmp_path / run_id, script=tmp_path / "train.py", nproc=2, steps=6,
                   token="t", backend="gloo", max_restarts=0, hang_timeout_s=None, plan=p)

    started = []
    run = make_run("first", plan)
    run.memory_threshold = THRESHOLD
    Replanner("ask", cluster=ap.cluster, ckpt_dir=None, launch_fn=lambda p, d: started.append(make_run("next", p))
              or started[-1], plan_fn=lambda c, t, pins: ap.replan_for_memory(c, t, pins, 2)).attach(run)
    for st in run._ranks.values():
        st.baseline = 300 * MIB
    run._record_tick(0, {r: {"rss": 300 * MIB + 0.9 * limit, "rss_peak": 300 * MIB + 0.9 * limit} for r in (0, 1)})
    assert [e["kind"] for e in run.events] == ["memory_high", "memory_high"]
    assert run.replan_proposal["cause"].startswith("rank 0 reached 90% of") and not started
    assert replan_state(run)["pending"] and "re-plan for less memory" in replan_state(run)["text"]
    run._status = "failed"
    run._done.set()  # as after an out-of-memory: nothing left to stop
    nxt = run.replan()
    assert nxt is started[0] and run.continued_by is nxt and nxt.continues is run and run.legs() == [run, nxt]
    (ev,) = [e for e in run.events if e["kind"] == "replan"]
    assert ev["reason"].startswith(f"{ev['diff_text']} because rank 0 reached 90% of {fmt_bytes(limit)}")
    assert "no checkpoint yet" in ev["reason"] and ev["calibration"]["margin_fraction"] > 0
    assert ap.plan.mesh.dp == 2 and ap.fix == {"dp": 2} and nxt.plan.mesh.dp == 2
    assert nxt.plan.cost.peak_memory_bytes <= THRESHOLD * limit < plan.cost.peak_memory_bytes
    assert not replan_state(run)["pending"] and run.replan() is nxt  # once
    assert [e["kind"] for e in events_of(nxt)] == ["memory_high", "memory_high", "replan"]


PAGE = """async ([esm, state]) => {
  const mod = await import(URL.createObjectURL(new Blob([esm], {type: "text/javascript"})));
  const el = document.createElement("div");
  document.body.append(el);
  const sent = [];
  mod.default.render({model: {get: (k) => state[k], on: () => {}, send: (m) => sent.push(m)}, el});
  await new Promise((r) => setTimeout(r, 200));
  const banner = el.querySelector(".apd-replan").textContent;
  const items = [...el.querySelectorAll(".apd-events li")].map((li) => [li.dataset.kind, li.textContent]);
  const dots = el.querySelectorAll(".apd-ev-dot").length;
  el.querySelector("button.apd-replan-go").click();
  return {banner, items, dots, sent};
}"""


@pytest.mark.browser
def test_the_dashboard_offers_replan_and_shows_the_timeline(tmp_path):
    """The front end (dashboard.js in chromium, a stub model; no JupyterLab): a proposal shows its cause with
    Re-plan & resume / Stop, the button sends "replan" (the kernel side calls run.replan()), and the event timeline
    lists the run's events with their reasons."""
    import test_browser

    from autopar_nb.launch.dashboard import Dashboard
    from autopar_nb.launch.replan import Replanner
    from autopar_nb.launch.run import Run

    test_browser._require_chromium()
    ap, limit = session_with_limit()
    run = Run(run_id="first", run_dir=tmp_path, script=tmp_path / "train.py", nproc=2, steps=6, token="t",
              backend="gloo", max_restarts=0, hang_timeout_s=None, plan=ap.plan)
    Replanner("ask", cluster=ap.cluster, launch_fn=None, plan_fn=None).attach(run)
    run._lifecycle("launch", "2 warm processes: " + ap.plan.summary(), t=0.0)
    for st in run._ranks.values():
        st.baseline = 300 * MIB
    run._record_tick(0, {r: {"rss": 300 * MIB + 0.95 * limit} for r in (0, 1)})
    board = Dashboard(run)
    state = {k: getattr(board, k) for k in ("status", "message", "error", "hang", "ranks", "info", "summary",
                                            "events", "replan")}
    state.update(timeline={}, steps={})
    seen, errors = test_browser.evaluate_in_blank_page(PAGE, [board._esm, state])
    assert not errors, errors
    assert "rank 0 reached 95% of" in seen["banner"] and "Re-plan & resume" in seen["banner"]
    assert [k for k, _ in seen["items"]] == ["launch", "memory_high", "memory_high"] and seen["dots"] == 3
    assert "2 warm processes: dp=2" in seen["items"][0][1] and "rank 1 reached 95%" in seen["items"][2][1]
    assert seen["sent"] == [{"event": "replan"}]
