"""The levers beside a plan (``plan.levers``): compile, float8, async TP, CPU offload, recompute, the fused loss and
RMSNorms, each flipped alone on the chosen plan and costed; in explain(), the plan file and the widget (rows under its
Alternatives, rendered in chromium)."""

from __future__ import annotations

import json

import pytest
from test_compile import _plan, lm_source

import autopar_nb as ap
from autopar_nb.plan import Lever, Plan, PlanError
from autopar_nb.widget.lever_rows import lever_rows


@pytest.fixture(scope="module")
def lm_plan():
    """The 2-block LM on 2 x H100 at dp=2: eager (its compile would not pay), bf16, float8 on offer."""
    return _plan(lm_source(), ap.Cluster.preset("h100-80gb", 1, 2), fix={"dp": 2})


def test_each_lever_is_the_plan_with_it_flipped_alone(lm_plan):
    """Each lever costs what the planner gives the same split with that lever fixed the other way, and explain()
    says each: sign, speed ratio, memory, and compile's start-up beside its gain over the steps planned."""
    plan = lm_plan
    names = {lv.name: lv for lv in plan.levers}
    assert set(names) == {"compile", "float8", "recompute", "fused_loss"}, names  # ZeRO < 2: no offload
    assert not any(lv.on for lv in plan.levers)
    cluster = ap.Cluster.preset("h100-80gb", 1, 2)
    mesh = {"dp": 2, "zero_stage": plan.mesh.zero_stage, "micro_batches": plan.batch.micro_batches}
    for name, value in (("compile", True), ("float8", "tensorwise"), ("fused_loss", True)):
        fixed = _plan(lm_source(), cluster, fix={**mesh, name: value})
        assert names[name].step_time_s == pytest.approx(fixed.cost.step_time_s, rel=1e-9), name
        assert names[name].peak_memory_bytes == pytest.approx(fixed.cost.peak_memory_bytes, rel=1e-9), name
    compile_ = names["compile"]
    assert compile_.startup_s > 0 and compile_.steps == 10_000
    assert compile_.step_time_s < plan.cost.step_time_s, "compiled is faster per step, yet its start-up does not pay"
    line = next(x for x in plan.explanation if x.startswith("Levers, each flipped alone on this plan: "))
    assert "+Float8: " in line and "+fused loss: " in line, line
    assert "+compile: " in line and "s start-up, −" in line and "(10,000 planned)" in line, line
    assert "+recompute: " in line, line


def test_levers_in_the_plan_file_and_checked(lm_plan):
    back = Plan.from_json(lm_plan.to_json())
    assert back.levers == lm_plan.levers and back.diff(lm_plan) == []
    d = json.loads(lm_plan.to_json())
    d["levers"][0]["name"] = "warp_drive"
    with pytest.raises(PlanError, match="lever.name='warp_drive' is not supported"):
        Plan.from_dict(d)
    with pytest.raises(PlanError, match="lever.steps must be >= 0"):
        Lever("compile", False, 1.0, 2.0, steps=-1)


def test_widget_lists_the_levers_with_the_fix_that_takes_each(lm_plan):
    rows = lever_rows(lm_plan)
    by = {r["lever"]: r for r in rows}
    assert by["float8"]["label"] == "+Float8" and by["float8"]["fix"] == "ap.replan(fix={'float8': 'tensorwise'})"
    assert by["compile"]["fix"] == "ap.replan(fix={'compile': True})"
    assert "s start-up, −" in by["compile"]["trade"] and "pays after" in by["compile"]["trade"], by["compile"]
    assert by["recompute"]["fix"] == "ap.replan(fix={'recompute': 'full'})" and "memory" in by["recompute"]["trade"]
    assert lever_rows(None) == []


LEVERS_PAGE = """async ([esm, css, state]) => {
  const mod = await import(URL.createObjectURL(new Blob([esm], {type: "text/javascript"})));
  const style = document.createElement("style");
  style.textContent = css;
  document.head.append(style);
  const el = document.createElement("div");
  document.body.append(el);
  const model = {get: (k) => state[k], set: (k, v) => { state[k] = v; }, save_changes: () => {}, on: () => {},
                 off: () => {}, send: () => {}};
  mod.default.render({model, el});
  await new Promise((r) => setTimeout(r, 100));
  const rows = [...el.querySelectorAll(".ap-alternatives tr.ap-lever")];
  return {title: (el.querySelector(".ap-levers-title") || {}).textContent || "",
          rows: rows.map((r) => ({lever: r.dataset.lever, text: r.textContent,
                                  fix: r.querySelector(".ap-lever-fix").textContent})),
          adopt: el.querySelectorAll(".ap-alternatives tr.ap-lever button").length};
}"""


@pytest.fixture(scope="module")
def seed_graph():
    """test_widget's seed MLP."""
    import torch
    from test_widget import _graph
    from torch import nn

    return _graph(lambda: nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 512)),
                  lambda: (torch.randn(32, 1024),))


@pytest.mark.browser
def test_lever_rows_in_chromium(seed_graph):
    """The Alternatives panel (planner.js) lists the levers under the alternatives: one row each with its sign and
    name, what it trades, and the fix that takes it (no adopt button: a lever is a fix, not a plan)."""
    import test_browser
    from test_widget import _session

    test_browser._require_chromium()
    w = _session(seed_graph).widget()
    state = json.loads(json.dumps(w.get_state(), default=str))
    assert w.levers == lever_rows(w.session.plan) and w.levers
    seen, errors = test_browser.evaluate_in_blank_page(LEVERS_PAGE, [w._esm, w._css, state])
    assert not errors, errors
    assert seen["title"].startswith("Levers") and seen["adopt"] == 0, seen
    assert [r["lever"] for r in seen["rows"]] == [r["lever"] for r in w.levers]
    for row, lv in zip(seen["rows"], w.levers, strict=True):
        assert lv["label"] in row["text"] and lv["trade"] in row["text"] and row["fix"] == lv["fix"], (row, lv)


def test_a_pipelined_best_gives_way_to_a_flat_plan_its_levers_make_faster():
    """Compile, float8 and async TP run with pp=1 only and the search ranks without the first two: 02_llm's 7B on
    8 H100s ranked pp=2 first (3.37 s/step, no lever offered) over dp=8 eager (3.39 s), which compiled with float8
    takes 2.57 s. The planner levers the fastest flat candidate too and takes it; the pipelined plan stays an
    alternative, and explain() says why the levered plan leads."""
    import torch

    from autopar_nb import zoo

    cfg = zoo.LlamaConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008)
    with torch.device("meta"):
        model = zoo.Llama(cfg)
    graph = ap.capture(model, (torch.randint(0, 32000, (1, 4096)),))
    cluster = ap.Cluster.preset("h100-80gb", 1, 8)
    plan = ap.plan(graph, cluster, global_batch=64)
    piped = ap.plan(graph, cluster, global_batch=64, fix={"pp": 2})
    assert plan.mesh.pp == 1 and plan.precision.float8 == "tensorwise" and any(lp.compile for lp in plan.layers)
    assert plan.cost.step_time_s < 0.8 * piped.cost.step_time_s, (plan.summary(), piped.summary())
    assert any(alt.mesh.pp == 2 for alt in plan.alternatives)
    names = {lv.name for lv in plan.levers}
    assert {"compile", "float8"} <= names, names


def test_every_plan_shown_is_compared_levered():
    """The alternatives and explain()'s runner-up get the levers the chosen plan got (compile and float8 where they
    pay), so the margins compare plans as they would run: a 1.5B LLaMA shape on 8 H100s pinned to DDP had its
    runner-up (one micro-batch, the fused loss) at 392 ms, "22% slower", while levered it takes 322 ms, 1% slower.
    The fused loss is chosen levered too: one micro-batch unfused (selective recompute) takes 319 ms but needs 74.4
    of the 74.5 GiB (tight: levers.roomier), so two micro-batches (320 ms, 60.4 GiB) lead and one micro-batch with
    the fused loss (322 ms) is the runner-up."""
    import torch

    from autopar_nb import zoo

    with torch.device("meta"):
        model = zoo.Llama(zoo.LlamaConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192))
    graph = ap.capture(model, (torch.randint(0, 128256, (8, 2048), device="meta"),))
    plan = ap.plan(graph, ap.Cluster.preset("h100-80gb", 1, 8), global_batch=64, fix={"zero_stage": 0, "dp": 8})
    runner = plan.alternatives[0]
    assert all(any(lp.compile for lp in alt.layers) for alt in plan.alternatives), [a.summary() for a in
                                                                                   plan.alternatives]
    assert plan.cost.step_time_s <= runner.cost.step_time_s < 1.02 * plan.cost.step_time_s, runner.summary()
    line = next(x for x in plan.explanation if x.startswith("Runner-up: "))
    assert (" is 0% slower" in line or " is 1% slower" in line) and runner.fused_loss, line
    assert runner.batch.micro_batches == 1, line
    assert not plan.fused_loss and plan.batch.micro_batches == 2, plan.summary()


def test_the_fused_rmsnorm_choice_is_made_on_the_levered_variants():
    """levered_variant levers a candidate and its fused-loss / fused-RMSNorm variants and keeps the one that fits and
    takes the least time over the run: here the search's choice (norms fused, 100 ms unlevered) levers to 80 ms while
    its eager variant (105 ms) levers to 70, unless a compile start-up costs it more over the run than it saves; a
    variant that does not fit is never taken. Each variant keeps the candidate as its other choice of
    what it flips, for explain()."""
    import dataclasses

    from autopar_nb.cost.setting import Setting
    from autopar_nb.plan.cost import Cost
    from autopar_nb.planner.levers import levered_variant
    from autopar_nb.planner.search import Candidate

    def cand(fused_norm, fused_loss, ms, peak=1.0):
        return Candidate(Setting(fused_norm=fused_norm, fused_loss=fused_loss), [],
                         Cost(step_time_s=ms / 1e3, peak_memory_bytes=peak), limit=2.0)

    chosen, eager, unfused = cand(True, True, 100), cand(False, True, 105), cand(True, False, 90, peak=3.0)
    chosen.norm_other, chosen.other = eager, unfused
    levered = {(True, True): 80, (False, True): 70, (True, False): 60}

    def with_levers(c):
        ms = levered[c.setting.fused_norm, c.setting.fused_loss]
        return dataclasses.replace(c, cost=dataclasses.replace(c.cost, step_time_s=ms / 1e3)), None

    def run_s(c):  # 100 steps, and a start-up where one was compiled
        return c.cost.step_time_s * 100 + startup.get((c.setting.fused_norm, c.setting.fused_loss), 0)

    startup = {}
    best, _ = levered_variant(chosen, with_levers, run_s)
    assert (best.setting.fused_norm, best.setting.fused_loss, best.cost.step_time_s) == (False, True, 0.07)
    assert best.norm_other is chosen and best.other is unfused
    startup[False, True] = 2.0  # faster per step, but its compile's start-up costs more than that saves
    assert levered_variant(chosen, with_levers, run_s)[0].setting.fused_norm
    startup.clear()
    levered[False, True] = 90
    assert levered_variant(chosen, with_levers, run_s)[0].setting.fused_norm


def test_a_tight_plan_is_not_taken_for_a_gain_the_time_model_cannot_resolve():
    """levers.roomier: the fastest plan, unless it is predicted above 95 % of a rank's memory (per-rank memory is
    predicted within 5 %) and another that fits with headroom takes at most 1 % more; that one is then chosen and
    remembers the one it was chosen over (for explain's Headroom line). A gain of 2 % keeps the tight plan, and a
    plan with headroom is never replaced."""
    from autopar_nb.cost.setting import Setting
    from autopar_nb.plan.cost import Cost
    from autopar_nb.planner.levers import headroom_lines, roomier
    from autopar_nb.planner.search import Candidate

    def cand(ms, gib):
        return Candidate(Setting(), [], Cost(step_time_s=ms / 1e3, peak_memory_bytes=gib * 2**30), limit=100 * 2**30)

    tight, close, far, over = cand(100, 99), cand(100.9, 80), cand(102, 60), cand(90, 101)
    assert roomier(tight, [tight, far, over]) is tight and not headroom_lines(tight)
    chosen = roomier(tight, [tight, close, far, over])
    assert chosen is close and close.roomier_than is tight
    assert "0.9% faster needs 99.0 GiB" in headroom_lines(close)[0] and "leaves 20% free" in headroom_lines(close)[0]
    roomy = cand(100, 90)
    assert roomier(roomy, [roomy, cand(100.5, 10)]) is roomy
