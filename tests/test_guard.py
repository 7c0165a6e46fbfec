"""The numerics guard (runtime/guard.py, in runtime/train.py's loop): a non-finite loss or gradient, or a loss spike,
skips the step on every rank; steps skipped in a row roll back to the last checkpoint, or stop the run without one.
The rule in one process (a gloo group of one), then the exported script on 2 gloo processes, a NaN batch, an
infinite gradient and a spike injected by the cell itself, against a single-process run that never saw them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from autopar_nb.runtime.guard import SPIKE_WARMUP, SPIKE_WINDOW, NumericsGuard, grads_finite
from autopar_nb.runtime.train import apply_step, roll_back


def test_the_guards_rule_in_one_process(world_of_one):
    guard = NumericsGuard(spike_factor=5.0, max_skips=2)
    assert guard.verdict(100.0, grads_ok=True, device="cpu") is None  # too early for a spike: no median yet
    for _ in range(SPIKE_WARMUP):
        assert guard.verdict(1.0, grads_ok=True, device="cpu") is None
    assert guard.verdict(4.9, grads_ok=True, device="cpu") is None
    assert guard.verdict(float("nan"), grads_ok=True, device="cpu") == "non-finite loss"
    assert guard.verdict(1.0, grads_ok=False, device="cpu") == "non-finite gradients" and guard.skips == 2
    assert guard.verdict(1.0, grads_ok=True, device="cpu") is None and guard.skips == 0
    assert guard.verdict(6.0, grads_ok=True, device="cpu") == "loss spike (6 > 5 x median 1)"
    guard.rolled_back()
    assert guard.skips == 0 and guard.verdict(6.0, grads_ok=True, device="cpu") is None  # the median starts over
    assert NumericsGuard(spike_factor=0, max_skips=1).spike(1e9) is None and not NumericsGuard(
        spike_factor=5, max_skips=0).on


def test_losses_that_swing_widely_are_not_each_others_spikes(world_of_one):
    """A regression near zero loss swings by several times from batch to batch (a 30-minute soak's MLP: 3e-6 to
    2e-5, then 5e-5 to 1.1e-4 for five steps): judged by the factor alone those were spikes, and five in a row
    stopped a healthy run. The window's own spread (in log space) raises the bar; a jump far past it is a spike."""
    guard = NumericsGuard(spike_factor=5.0, max_skips=5)
    for k in range(SPIKE_WINDOW):
        assert guard.verdict(1e-6 * 2.0 ** (k % 3), grads_ok=True, device="cpu") is None  # 1e-6, 2e-6, 4e-6
    assert guard.verdict(8.3e-5, grads_ok=True, device="cpu") is None  # 41 x the median: within its spread
    assert guard.verdict(1e-2, grads_ok=True, device="cpu") == "loss spike (0.01 > 476 x median 2e-06)"

    layer = nn.Linear(4, 4)
    opt = torch.optim.SGD(layer.parameters(), lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler.scale(layer(torch.randn(2, 4)).sum()).backward()
    assert grads_finite(list(layer.parameters()))
    layer.weight.grad[0, 0] = float("inf")
    assert not grads_finite(list(layer.parameters()))
    # a skipped step leaves the weights; with a loss scaler, its update still follows unscale_ (as it requires)
    before = layer.weight.detach().clone()
    scaler.unscale_(opt)
    apply_step(opt, scaler, skip=True)
    assert torch.equal(layer.weight, before) and layer.weight.grad is None
    assert scaler.get_scale() == 4.0  # the scaler saw the infinite gradient: backed off
    with pytest.raises(RuntimeError, match="step 7: 2 steps in a row skipped, and there is no checkpoint to roll back"):
        roll_back(SimpleNamespace(ckpt_dir=None), layer, opt, step=7, why="2 steps in a row skipped", metrics=None)


# ---- the exported script on 2 processes -----------------------------------------------------------------------------
# make_batch's batch holds a NaN at the steps of NAN (rank 0's share only), ten times larger inputs at SPIKE (a loss
# spike), and the model's output an infinite gradient at the steps of INF_GRAD (rank 0: DDP averages it to both)
CELL = '''\
import os

import torch
import torch.nn as nn

NAN, SPIKE, INF_GRAD = {nan}, {spike}, {inf_grad}
ORDER = {order}  # the batches the steps read, in order


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        self.calls = 0  # forward calls: one a step

    def forward(self, x):
        out = self.body(x)
        if self.calls in INF_GRAD and os.environ.get("RANK", "0") == "0":
            out.register_hook(lambda g: g * float("inf"))
        self.calls += 1
        return out


model = Net()


def make_batch(step, rank):
    i = ORDER[step]
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(i * 10 + rank))
    if i in NAN and rank == 0:
        x[0, 0] = float("nan")
    return (x * 10 if i in SPIKE else x,)
'''
STEPS = 14


def _cell(*, nan=(), spike=(), inf_grad=(), skip=()) -> str:
    order = [i for i in range(2 * STEPS) if i not in skip]
    return CELL.format(nan=set(nan) or "()", spike=set(spike) or "()", inf_grad=set(inf_grad) or "()", order=order)


def _plan(src, *, grad_clip: float):
    from runtime_cases import make_plan

    plan = make_plan(src, dp=2, zero=0, lr=1e-2)
    plan.optimizer.lr_schedule, plan.optimizer.warmup_steps, plan.optimizer.grad_clip = "constant", 0, grad_clip
    return plan


def _run(tmp_path: Path, cell: str, *args: str, grad_clip: float) -> tuple[int, str, list[dict]]:
    """The cell's script on 2 gloo processes: (exit code, output, rank 0's metrics records)."""
    from autopar_nb.export import export
    from autopar_nb.launch.channel import MetricsServer
    from autopar_nb.notebook.cell import run_model_cell

    src = run_model_cell(cell, {}).source
    script = export(src, _plan(src, grad_clip=grad_clip), tmp_path / "train_guard.py", steps=STEPS,
                    quiet=True).script
    server = MetricsServer()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                 "--standalone", str(script), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, cwd=tmp_path, env=dict(os.environ, PYTHONWARNINGS="ignore",
                                                                  AUTOPAR_METRICS=server.address,
                                                                  AUTOPAR_TOKEN=server.token))
        messages = []
        while proc.poll() is None:
            messages += server.poll(0.1)
        out = proc.stdout.read()
        messages += server.poll(0.2)
    finally:
        server.close()
    return proc.returncode, out, [m.data for m in messages if m.rank == 0 and m.kind == "data"]


def _reference(cell: str, *, grad_clip: float) -> list[float]:
    from autopar_nb.notebook.cell import run_model_cell
    from autopar_nb.verify.reference_run import reference

    src = run_model_cell(cell, {}).source
    return reference(src, _plan(src, grad_clip=grad_clip), steps=STEPS)["losses"]


@pytest.mark.multiprocess
def test_bad_steps_are_skipped_and_the_curve_is_a_run_without_them(tmp_path):
    """A NaN in rank 0's batch at step 3, an infinite gradient on rank 0 at step 6, a loss spike at step 12 (no
    gradient clipping: the guard's own finiteness check): each step is skipped on both ranks, said in the step's log
    line and sent as an event; every other step's loss is that of a single-process run that never read those
    three batches."""
    bad = {"nan": [3], "inf_grad": [6], "spike": [12]}
    rc, out, records = _run(tmp_path, _cell(**bad), grad_clip=0.0)
    assert rc == 0, out[-4000:]
    skipped = {r["step"]: r["message"] for r in records if r.get("event") == "numerics"}
    assert list(skipped) == [3, 6, 12], records
    assert skipped[3] == "step 3 skipped: non-finite loss, 1 in a row"
    assert skipped[6] == "step 6 skipped: non-finite gradients, 1 in a row"
    assert skipped[12].startswith("step 12 skipped: loss spike (")
    assert sum("| skipped: " in line for line in out.splitlines()) == 3
    losses = {r["step"]: r["loss"] for r in records if "step" in r and "event" not in r}
    assert losses[3] is None and losses[6] is not None  # a NaN loss is sent as none
    applied = [losses[s] for s in range(STEPS) if s not in (3, 6, 12)]
    expected = _reference(_cell(skip=[3, 6, 12]), grad_clip=0.0)[:len(applied)]
    assert applied == pytest.approx(expected, rel=1e-5, abs=0)


@pytest.mark.multiprocess
@pytest.mark.parametrize("async_checkpoint", ["off", "on"])
def test_skips_in_a_row_roll_back_to_the_last_checkpoint(tmp_path, async_checkpoint):
    """NaN batches at steps 5 and 6 with --max-skips 2 and a checkpoint every 4 steps (gradient clipping on: its norm
    is the check): step 6 rolls the weights back to step_4 and training goes on with batch 7, the losses of a run
    that never read batches 4, 5 and 6 (step 4's update was undone). Saved in the background too: the roll-back
    waits for step_4's save to be whole."""
    ckpt = tmp_path / "ckpt"
    rc, out, records = _run(tmp_path, _cell(nan=[5, 6]), "--max-skips", "2", "--ckpt-dir", str(ckpt),
                            "--ckpt-every", "4", "--async-checkpoint", async_checkpoint, grad_clip=1.0)
    assert rc == 0, out[-4000:]
    rolled = [r for r in records if r.get("action") == "rollback"]
    assert len(rolled) == 1 and rolled[0]["step"] == 6 and rolled[0]["checkpoint"] == str(ckpt / "step_4")
    line = next(x for x in out.splitlines() if "rolled back" in x)
    assert line == (f"step 6 | rolled back to {ckpt / 'step_4'} (2 steps in a row skipped, the last for non-finite "
                    "loss); going on with the next batches")
    losses = {r["step"]: r["loss"] for r in records if "step" in r and "event" not in r}
    kept = [losses[s] for s in range(STEPS) if s not in (4, 5, 6)]
    expected = _reference(_cell(skip=[4, 5, 6]), grad_clip=1.0)[:len(kept)]
    assert kept == pytest.approx(expected, rel=1e-5, abs=0)


def test_the_ranks_events_reach_run_events_and_the_dashboard(tmp_path):
    """The messages the runtime sends (a skip, a roll-back, a checkpoint not saved) are events of the run, with the
    step, the action and the line as the reason, and the dashboard's event list shows them."""
    from autopar_nb.launch.channel import Message
    from autopar_nb.launch.dashboard import events_of
    from autopar_nb.launch.run import Run

    run = Run(run_id="0" * 16, run_dir=tmp_path, script=Path(__file__), nproc=2, steps=12, token="t", backend="gloo",
              max_restarts=0, hang_timeout_s=None)
    t = run.started + 2.0
    run._ingest([Message(0, "hello", {"attempt": 0}, t),
                 Message(0, "data", {"event": "numerics", "step": 3, "action": "skip",
                                     "message": "step 3 skipped: non-finite loss, 1 in a row"}, t),
                 Message(0, "data", {"event": "numerics", "step": 6, "action": "rollback", "checkpoint": "c/step_4",
                                     "message": "step 6 | rolled back to c/step_4 (...)"}, t + 1),
                 Message(0, "data", {"event": "checkpoint", "step": 8, "action": "failed", "message": "x" * 900},
                         t + 2)])
    got = [(e["kind"], e["rank"], e["step"], e["action"], e["t"]) for e in run.events]
    assert got == [("numerics", 0, 3, "skip", 2.0), ("numerics", 0, 6, "rollback", 3.0),
                   ("checkpoint", 0, 8, "failed", 4.0)]
    assert run.events[0]["reason"] == "step 3 skipped: non-finite loss, 1 in a row"
    assert len(run.events[2]["reason"]) == 500
    assert [e["kind"] for e in events_of(run)] == ["numerics", "numerics", "checkpoint"]
