import pytest

import autopar_nb as ap
from autopar_nb.notebook.session import Session
from autopar_nb.plan import Plan, PlanError
from autopar_nb.source import ModelSource

CELL = """
import torch
from autopar_nb.zoo import GPT, GPTConfig
model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=256, block_size=128, vocab_size=4096))
example_inputs = (torch.randint(0, 4096, (8, 128)),)
"""


@pytest.fixture
def session():
    source = ModelSource(CELL)
    model, inputs, _ = source.build(device="meta")
    return Session(ap.capture(model, inputs), ap.Cluster.preset("h100-80gb", gpus_per_node=4), source,
                   global_batch=32)


def test_replan_override_undo_redo(session):
    first = session.replan()
    assert session.plan is first and first.mesh.world_size == 4
    pinned = session.override("h.1", stage=1)
    assert pinned.layer("h.1").stage == 1 and "stage" in pinned.layer("h.1").pinned
    assert session.overrides == {"h.1": {"stage": 1}}
    assert session.undo() is first and session.overrides == {}
    assert session.redo() is pinned
    with pytest.raises(IndexError, match="nothing to redo"):
        session.redo()


def test_rejected_constraints_leave_the_session_as_it_was(session):
    good = session.replan()
    with pytest.raises(PlanError):
        session.replan(fix={"tp": 3})  # 3 divides neither the 4 heads nor the 4 GPUs
    assert session.plan is good and session.fix == {}
    with pytest.raises(PlanError):
        session.override("no_such_layer*", recompute="full")
    assert session.plan is good and session.overrides == {}


def test_cluster_change_is_undoable(session):
    session.replan()
    before = session.cluster
    session.replan(cluster=ap.Cluster.preset("a100-40gb", gpus_per_node=2))
    assert session.plan.mesh.world_size == 2 and session.cluster.name == "a100-40gb"
    session.undo()
    assert session.cluster is before and session.plan.mesh.world_size == 4


def test_plan_for_fewer_processes_keeps_the_model_parallel_layout(session):
    session.replan(fix={"dp": 2, "tp": 2, "pp": 1})
    small = session.plan_for(2)
    assert (small.mesh.dp, small.mesh.tp, small.mesh.pp) == (1, 2, 1)
    assert small.batch.global_batch == 16  # per-replica batch kept: 32 / 2 replicas
    assert small.tp_plan == session.plan.tp_plan
    assert session.plan_for(None) is session.plan
    with pytest.raises(PlanError, match=r"multiples of tp\(2\) \* pp\(1\) = 2"):
        session.plan_for(3)


def test_launch_on_another_process_count_says_so_and_keeps_a_cost(session, monkeypatch, capsys):
    """Issue 42, point 7: launching a 4-process plan on 3 processes used to scale it silently, without a cost, so
    the dashboard had nothing to compare. It says in one line what it runs and how to plan for 3 instead, and the
    scaled plan has the cost model's figures for 3 processes, which the run's comparison uses."""
    import sys

    from autopar_nb.launch.compare import comparison

    launch_pkg = sys.modules["autopar_nb.launch"]  # the package: ``autopar_nb.launch`` is also the function

    session.replan(fix={"dp": 4, "tp": 1, "pp": 1})
    started = []
    monkeypatch.setattr(launch_pkg, "launch", lambda make, nproc, steps, *, plan, **kw: started.append(plan) or plan)
    session.launch(nproc=3, steps=5, replan="off")
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("The plan is for 4 processes; running it on 3: the same tp(1) x pp(1) layout with dp "
                           "4 -> 3 (global batch 32 -> 24), its cost re-estimated for 3"), line
    assert "ap.replan(cluster=Cluster.preset('h100-80gb', gpus_per_node=3))" in line
    (scaled,) = started
    assert Plan.from_json(scaled.to_json()).cluster["scaled_from"] == 4  # what the ranks read back (check.py)
    assert scaled.mesh.world_size == 3 and scaled.cost is not None and scaled.cost.step_time_s > 0
    assert scaled.cost.memory_by_rank and session.plan.mesh.world_size == 4  # the session's plan is unchanged
    c = comparison(scaled, backend="nccl", nproc=3, gpu_name="NVIDIA H100 80GB HBM3")
    assert c["compare_time"] and all(m for m in c["predicted_memory"]), c
    assert not any("no cost" in n for n in c["notes"]) and "made for 4 processes" in c["notes"][0], c["notes"]
    session.launch(nproc=4, steps=5, replan="off")  # the plan's own count: nothing to say
    assert capsys.readouterr().out == "" and started[-1] is session.plan


def test_the_steps_launched_reach_the_plan(session, monkeypatch, capsys):
    """Compile pays on this GPT after ~20,000 steps: planned for a run of 100,000 it is compiled; launched for 20
    steps, the plan weighs compile's start-up over those 20 (eager) and says so; undo() goes back. A launch whose
    steps the plan already weighed, or whose re-plan chooses the same, prints nothing and keeps the undo stack."""
    import sys

    launch_pkg = sys.modules["autopar_nb.launch"]
    started = []
    monkeypatch.setattr(launch_pkg, "launch", lambda make, nproc, steps, *, plan, **kw: started.append(plan) or plan)
    session.steps = 100_000
    first = session.replan()
    weighed = {lv.name: lv for lv in first.levers}["compile"]
    assert weighed.on and weighed.steps == 100_000 and any(lp.compile for lp in first.layers)
    session.launch(steps=20, replan="off")
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("Re-planned for the 20 steps launched (the plan weighed compile's start-up over 100,000 "
                           "steps): ") and line.endswith("; ap.undo() goes back."), line
    (ran,) = started
    assert ran is session.plan and session.steps == 20 and not any(lp.compile for lp in ran.layers)
    assert {lv.name: lv for lv in ran.levers}["compile"].steps == 20
    assert any("it would not pay within the 20 steps planned" in x for x in ran.explanation)
    assert session.undo() is first and session.steps == 100_000
    session.redo()
    undo = list(session._undo)
    session.launch(steps=20, replan="off")  # weighed already
    session.launch(steps=30, replan="off")  # planned again, the same choices: in place
    assert capsys.readouterr().out == "" and session._undo == undo and started[1] is ran
    assert started[2] is ran is session.plan and {lv.name: lv for lv in ran.levers}["compile"].steps == 30
    with pytest.raises(PlanError, match="steps must be a positive integer, got 0"):
        session.replan(steps=0)
    assert session.steps == 30


def test_the_launch_button_says_its_re_plan_in_the_widget(session, monkeypatch, capsys):
    """Launch clicked in the widget: the line saying the plan was made again for the steps launched leads the
    widget's message (a warning: the user did not ask for the change), and nothing goes to the kernel's stdout."""
    import importlib
    import sys

    launch_pkg = sys.modules["autopar_nb.launch"]
    started = []
    monkeypatch.setattr(launch_pkg, "launch", lambda make, nproc, steps, *, plan, **kw: started.append(plan) or plan)
    monkeypatch.setattr(importlib.import_module("autopar_nb.launch.replan").Replanner, "attach", lambda s, run: None)
    session.steps = 100_000
    first = session.replan()
    w = session.widget()
    w.handle({"kind": "action", "name": "launch", "run_options": {"nproc": 4, "launch_steps": 20}})
    assert capsys.readouterr().out == ""
    (message,) = w.messages
    replanned, launched = message["text"].split("\n")
    assert message["level"] == "warning" and replanned.startswith(
        "Re-planned for the 20 steps launched (the plan weighed compile's start-up over 100,000 steps): "), message
    assert launched.startswith("ap.launch(nproc=4, steps=20)"), message
    assert started == [session.plan] and session.steps == 20 and session.undo() is first
    w.handle({"kind": "action", "name": "launch", "run_options": {"nproc": 4, "launch_steps": 100_000}})
    assert w.messages[0]["level"] == "info" and "Re-planned" not in w.messages[0]["text"], w.messages


def test_attach_runs_the_steps_planned(session, tmp_path):
    session.steps = 300
    run = session.attach(str(tmp_path / "train.py"), host="127.0.0.1", quiet=True)
    try:
        assert run.steps == 300
        assert 'p.add_argument("--steps", type=int, default=300,' in (tmp_path / "train.py").read_text()
    finally:
        run.stop()


def test_the_exported_script_runs_the_steps_planned(session, tmp_path):
    session.steps = 300
    script = session.export(str(tmp_path / "train.py"), quiet=True).script.read_text()
    assert 'p.add_argument("--steps", type=int, default=300,' in script
    seven = session.export(str(tmp_path / "t7.py"), steps=7, quiet=True).script.read_text()
    assert 'p.add_argument("--steps", type=int, default=7,' in seven


def test_manual_mode_needs_the_mesh(session):
    session.mode = "manual"
    with pytest.raises(PlanError, match="add pp=N to --fix"):
        session.replan(fix={"dp": 2, "tp": 2})
    assert session.replan(fix={"dp": 2, "tp": 2, "pp": 1}).mesh.dp == 2


def test_summary_and_html(session):
    session.replan()
    assert "plan: dp=" in session.summary()
    assert "<table>" in session._repr_html_() and "h.[0–3]" in session._repr_html_()


def test_fix_aliases_are_stored_by_their_full_names(session):
    plan = session.replan(fix={"zero": 3, "mb": 2, "tp": 1})
    assert session.fix == {"zero_stage": 3, "micro_batches": 2, "tp": 1}
    assert plan.mesh.zero_stage == 3 and plan.batch.micro_batches == 2
    with pytest.raises(PlanError, match=r"fix\['sequence_parallel'\]='false' is not supported"):
        session.replan(fix={"sp": "false"})  # a word, not a bool: refused rather than taken as true
    assert session.fix == {"zero_stage": 3, "micro_batches": 2, "tp": 1}


def test_attach_exports_and_prints_the_commands_with_the_address_and_token(session, tmp_path, capsys):
    """``ap.attach``: a bad host is refused before anything is written; a good one writes the script and prints its
    torchrun commands with AUTOPAR_METRICS and AUTOPAR_TOKEN in front."""
    from autopar_nb.launch import LaunchError

    with pytest.raises(LaunchError, match="needs host="):
        session.attach(str(tmp_path / "train.py"))
    assert not (tmp_path / "train.py").exists()
    run = session.attach(str(tmp_path / "train.py"), host="127.0.0.1", steps=7)
    try:
        out = capsys.readouterr().out
        assert (tmp_path / "train.py").exists() and run.nproc == session.plan.mesh.world_size and run.steps == 7
        assert run.backend == "nccl"  # the plan is for h100-80gb
        assert run.commands[0].startswith(f"AUTOPAR_METRICS={run.address} AUTOPAR_TOKEN={run.env['AUTOPAR_TOKEN']} "
                                          "torchrun ")
        assert all(c in out for c in run.commands) and f"listening on {run.address}" in out
    finally:
        run.stop()
