"""A soak of the launch path: an exported script trained for a long while on local processes under torch's elastic
launcher, with a random kill every few seconds or minutes, against the same script run without interruption.

Each kill is one of:

* ``worker``: SIGKILL to one rank; the elastic agent restarts the whole worker group (``max_restarts``), which
  resumes from the newest complete checkpoint;
* ``agent``: SIGKILL to the elastic agent itself (what a lost node or a killed job step looks like); its ranks end
  with it, the run is marked failed, and the soak starts the same command again, as a scheduler's requeue would,
  which resumes from the same checkpoint folder.

At the end the losses of every step (the last attempt's, where a step ran more than once) must equal the
uninterrupted run's (deterministic data order: the script draws each step's batch from the step number), no process
of any run may be left, and this process must hold no more file descriptors than before. Reported: the kills, the
steps redone after each (a step that ran before the kill and again after the resume) and the wall time each cost
(from the kill to the first step past the last one done before it).

    .venv/bin/python bench/soak.py                          # about 30 min: kills every 2-4 min, 2 ranks
    .venv/bin/python bench/soak.py --minutes 3 --kill-every 20,40 --kills 3
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this tree's autopar_nb, not an editable install's

import autopar_nb as ap  # noqa: E402
from autopar_nb.launch import launch  # noqa: E402
from autopar_nb.source import ModelSource  # noqa: E402

CELL = '''\
import torch
import torch.nn as nn

model = nn.Sequential(nn.Linear({hidden}, {hidden}), nn.GELU(), nn.Linear({hidden}, {hidden}), nn.GELU(),
                      nn.Linear({hidden}, 16))
example_inputs = (torch.randn(32, {hidden}),)
'''
KINDS = ("worker", "agent")


@dataclass
class Kill:
    kind: str
    at: float
    """seconds since the soak started"""
    epoch: tuple[int, int]
    """(launch, attempt) of the run it hit"""
    last_step: int = -1
    """the newest step rank 0 finished in that attempt"""
    resumed_at: int | None = None
    """the first step the next attempt ran"""
    lost_s: float | None = None
    """seconds from the kill to the first step past ``last_step``"""

    @property
    def redone(self) -> int | None:
        return None if self.resumed_at is None else max(0, self.last_step - self.resumed_at + 1)


@dataclass
class SoakReport:
    steps: int
    wall_s: float
    kills: list[Kill] = field(default_factory=list)
    launches: int = 0
    max_loss_diff: float = float("nan")
    missing_steps: list[int] = field(default_factory=list)
    left_processes: list = field(default_factory=list)
    fds_before: int = 0
    fds_after: int = 0

    @property
    def ok(self) -> bool:
        return (not self.missing_steps and self.max_loss_diff <= 1e-6 and not self.left_processes
                and self.fds_after <= self.fds_before)

    def __str__(self) -> str:
        lines = [f"soak: {self.steps} steps in {self.wall_s / 60:.1f} min, {len(self.kills)} kills "
                 f"({', '.join(f'{sum(k.kind == t for k in self.kills)} {t}' for t in KINDS)}), "
                 f"{self.launches} launches: {'OK' if self.ok else 'FAILED'}",
                 f"  losses against the uninterrupted run: max |diff| {self.max_loss_diff:.2e}"
                 + (f", steps never run: {self.missing_steps[:10]}" if self.missing_steps else ""),
                 f"  processes left: {len(self.left_processes)}; this process's file descriptors "
                 f"{self.fds_before} -> {self.fds_after}"]
        for k in self.kills:
            lost = "?" if k.lost_s is None else f"{k.lost_s:.1f}"
            lines.append(f"  {k.at:7.1f} s  {k.kind:6}  after step {k.last_step}: resumed at {k.resumed_at}, "
                         f"{k.redone} steps redone, {lost} s lost")
        return "\n".join(lines)


def export_script(workdir: Path, *, hidden: int, steps: int) -> Path:
    """The planner's dp=2 ZeRO-3 plan of a small MLP, exported as the user would (FSDP2 + DCP checkpoints)."""
    source = ModelSource(CELL.format(hidden=hidden))
    model, example, _ = source.build(device="meta")
    graph = ap.capture(model, example)
    plan = ap.plan(graph, ap.Cluster.preset("cpu", 1, 2), fix={"dp": 2, "zero_stage": 3})
    return ap.export(source, plan, workdir / "train.py", steps=steps, quiet=True).script


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _losses(run, launch_no: int, into: dict[int, tuple[float, float, tuple[int, int]]]) -> None:
    """Rank 0's loss of every step the run reported, with the time it was sent and its (launch, attempt); a later
    attempt's replaces."""
    for row in run.metrics:
        if row.get("rank") == 0 and "loss" in row and "step" in row:
            epoch = (launch_no, row.get("attempt", 0))
            if into.get(row["step"], (0, 0, (0, 0)))[2] <= epoch:
                into[row["step"]] = (row["loss"], row["time"], epoch)


def soak(script: Path, *, steps: int, ckpt_every: int, kill_every: tuple[float, float], kills: int | None,
         kinds=KINDS, seed: int = 0, nproc: int = 2, reference: dict[int, float] | None = None,
         workdir: Path | None = None, progress=print) -> SoakReport:
    """Train ``script`` for ``steps`` with random kills (module docstring); ``kills``: at most this many (None: until
    the steps are done). Each kill comes ``kill_every`` (low, high: uniform) seconds after the run made progress
    again, and none in the last tenth of the steps. ``reference``: the uninterrupted run's rank-0 losses by step
    (run here when None)."""
    workdir = Path(workdir or tempfile.mkdtemp(prefix="soak-"))
    if reference is None:
        run = launch(script, nproc=nproc, steps=steps, run_dir=workdir / "reference")
        if run.wait() != "finished":
            raise RuntimeError(f"the uninterrupted run did not finish: {run.message}")
        reference = dict(run.loss_curve(0))
    rng = random.Random(seed)
    report = SoakReport(steps=steps, wall_s=0.0, fds_before=_fds())
    seen: dict[int, tuple[float, float]] = {}
    runs: list = []
    t0 = time.time()
    while True:
        report.launches += 1
        run = launch(script, nproc=nproc, steps=steps, max_restarts=1000, run_dir=workdir / f"run{report.launches}",
                     ckpt_dir=workdir / "ckpt", ckpt_every=ckpt_every)
        runs.append(run)
        kind = _kill_when_due(run, report, seen, t0, rng=rng, kinds=kinds, kill_every=kill_every, kills=kills,
                              steps=steps, progress=progress)
        while kind == "worker":  # the agent restarts the group: the same run goes on
            kind = _kill_when_due(run, report, seen, t0, rng=rng, kinds=kinds, kill_every=kill_every, kills=kills,
                                  steps=steps, progress=progress)
        status = run.wait()
        _losses(run, report.launches, seen)
        if kind is None:
            if status != "finished":
                raise RuntimeError(f"the run ended {status}: {run.message}")
            break
    report.wall_s = time.time() - t0
    _settle(report.kills, seen, t0)
    report.missing_steps = sorted(set(reference) - set(seen))
    diffs = [abs(seen[s][0] - v) / max(1.0, abs(v)) for s, v in reference.items() if s in seen]
    report.max_loss_diff = max(diffs, default=float("inf"))
    report.left_processes = [p for r in runs for p in r.processes()]
    report.fds_after = _fds()
    return report


def _kill_when_due(run, report: SoakReport, seen: dict, t0: float, *, rng, kinds, kill_every, kills, steps,
                   progress) -> str | None:
    """Wait until the run has made progress past the last kill, then ``kill_every`` seconds more; kill one of its
    processes and return the kind killed, or None when the run ended (or no kill is left to make)."""
    if kills is not None and len(report.kills) >= kills:
        return None
    due = None
    while not run.done:
        _losses(run, report.launches, seen)
        _settle(report.kills, seen, t0)
        newest = max(seen, default=-1)
        if newest >= 0.9 * steps:
            return None  # let it finish
        if due is None and newest >= 0 and (not report.kills or report.kills[-1].lost_s is not None):
            due = time.time() + rng.uniform(*kill_every)
        if due is not None and time.time() >= due:
            kind = rng.choice(kinds)
            workers = list(run.workers().values())
            if workers:
                target = _agent_of(workers[0]) if kind == "agent" else rng.choice(workers)
                epoch = max((e for _, _, e in seen.values() if e[0] == report.launches), default=(report.launches, 0))
                kill = Kill(kind, time.time() - t0, epoch)
                target.send_signal(signal.SIGKILL)
                report.kills.append(kill)
                progress(f"  {kill.at:7.1f} s: killed the {kind} after step {newest}")
                return kind
        time.sleep(0.1)
    return None


def _agent_of(worker):
    """The elastic agent above ``worker``: its ancestor that this process started (a warm run's workers are
    children of the agent's forkserver, a cold run's of the agent itself)."""
    proc = worker
    while proc is not None and proc.ppid() != os.getpid():
        proc = proc.parent()
    return proc or worker


def _settle(kills: list[Kill], seen: dict[int, tuple[float, float, tuple[int, int]]], t0: float) -> None:
    """Each kill's last step (its attempt's newest), the step the next attempt resumed at, and the seconds from the
    kill to the first step past the last one."""
    for k in kills:
        k.last_step = max((s for s, (_, _, e) in seen.items() if e == k.epoch), default=k.last_step)
        after = [(s, t - t0) for s, (_, t, e) in seen.items() if e > k.epoch]
        if after:
            k.resumed_at = min(s for s, _ in after)
            past = [t for s, t in after if s > k.last_step]
            k.lost_s = min(past) - k.at if past else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="about how long the interrupted run trains")
    parser.add_argument("--kill-every", default="120,240", help="seconds between kills: low,high (uniform)")
    parser.add_argument("--kills", type=int, default=None, help="at most this many kills")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ckpt-every", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="soak-"))
    probe = export_script(workdir, hidden=args.hidden, steps=40)
    run = launch(probe, nproc=2, steps=40, run_dir=workdir / "probe")
    if run.wait() != "finished":
        raise SystemExit(f"the probe run failed: {run.message}")
    step_s = run.summary()["step_time_s"]
    steps = max(50, int(args.minutes * 60 / step_s))
    print(f"{step_s * 1e3:.1f} ms a step uninterrupted: {steps} steps for about {args.minutes:g} min", flush=True)
    (workdir / "soak").mkdir(exist_ok=True)
    script = export_script(workdir / "soak", hidden=args.hidden, steps=steps)
    lo, hi = (float(x) for x in args.kill_every.split(","))
    report = soak(script, steps=steps, ckpt_every=args.ckpt_every, kill_every=(lo, hi), kills=args.kills,
                  seed=args.seed, workdir=workdir / "soak")
    print(report)
    raise SystemExit(0 if report.ok else 1)


if __name__ == "__main__":
    main()
