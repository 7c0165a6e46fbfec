"""A soak of the launch path: an exported script trained for a long while on local processes under torch's elastic
launcher, with a random kill every few seconds or minutes, against the same script run without interruption.

Each kill is one of:

* ``worker``: SIGKILL to one rank; the elastic agent restarts the whole worker group (``max_restarts``), which
  resumes from the newest complete checkpoint;
* ``agent``: SIGKILL to the elastic agent itself (what a lost node or a killed job step looks like); its ranks end
  with it, the run is marked failed, and the soak starts the same command again, as a scheduler's requeue would,
  which resumes from the same checkpoint folder;
* ``node`` (``--node-kill-every``): the run is two "nodes", network namespaces joined by a veth pair
  (``tests/netns.py``; root only), each running the script's elastic command (``torchrun --nnodes 1:2
  --nproc-per-node 1``), and every process of one node is killed at once. The second node lost: the first goes on
  alone (world 1) from the newest checkpoint, and the soak starts the lost node again after a while (``--node-away``),
  as a replaced host would come back; both restart at world 2 from the newest checkpoint. The first node lost (it
  hosts the rendezvous store): the second must end by itself, leaving no process in its namespace, and the soak
  launches both again (a requeue). Run on the nodes, kills pick from ``--node-kinds``: whole nodes and, by
  default, one node's ``worker`` (its agent and the other node's restart the group) and one node's ``agent`` (its
  torchrun alone: its worker must die with it, by the death signal the script sets, and the rest goes as for that
  node lost; a worker left behind is reported as an orphan). The script's batches are the same on every
  data-parallel rank, so a step trained by one node has the loss and gradients it has when trained by two.

The run is set in minutes (``--minutes``): its ``--steps`` (the learning-rate schedule's length) are more than it
can reach, and once the time is up the soak waits for the run's next complete checkpoint and stops it there (the
launch's ``run.stop()``, as the re-planner stops at a checkpoint; on the nodes, SIGTERM to each torchrun, as a
scheduler ends a job step, and the attached run detached). That checkpoint's step is the run's end: the steps
trained past it before the stop are dropped, and the uninterrupted run, beside it, is stopped once it has trained
up to the same step, so the two are compared over the whole run. ``--steps N`` runs N steps instead (the tests).

At the end the losses of every step (the last attempt's, where a step ran more than once) must equal the
uninterrupted run's (deterministic data order: the script draws each step's batch from the step number), no process
of any run may be left, and this process must hold no more file descriptors than before. Reported: the kills, the
steps redone after each (a step that ran before the kill and again after the resume) and the wall time each cost
(from the kill to the first step past the last one done before it).

    .venv/bin/python bench/soak.py                          # 30 min: kills every 2-4 min, 2 ranks
    .venv/bin/python bench/soak.py --minutes 3 --kill-every 20,40 --kills 3
    sudo .venv/bin/python bench/soak.py --minutes 3 --node-kill-every 20,40 --kills 3    # whole nodes

Unattended (``nohup ... &``): progress lines carry the UTC time and are flushed; ``--report FILE`` writes the report
as JSON (also when the soak fails); a run that makes no step for ``--stall-minutes`` ends the soak as FAILED; SIGTERM
or Ctrl-C ends it too; whichever way it ends, every process it started is killed and its namespaces deleted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this tree's autopar_nb, not an editable install's
sys.path.insert(0, str(ROOT / "tests"))  # netns.py: the namespaces of the node kills

import autopar_nb as ap  # noqa: E402
from autopar_nb.launch import attach, launch  # noqa: E402
from autopar_nb.launch.pool import POOL  # noqa: E402
from autopar_nb.runtime.checkpoint import latest_checkpoint  # noqa: E402
from autopar_nb.source import ModelSource  # noqa: E402

CELL = '''\
import torch
import torch.nn as nn

model = nn.Sequential(nn.Linear({hidden}, {hidden}), nn.GELU(), nn.Linear({hidden}, {hidden}), nn.GELU(),
                      nn.Linear({hidden}, 16))
example_inputs = (torch.randn(32, {hidden}),)
'''
# every data-parallel rank draws the same batch: a step's loss and averaged gradients are then the same whether one
# node or two train it, so a run that went on without a lost node still follows the uninterrupted run
NODE_BATCH = '''

def make_batch(step, rank):
    g = torch.Generator().manual_seed(step)
    return (torch.randn(32, {hidden}, generator=g),)
'''
KINDS = ("worker", "agent", "node")
LOCAL_KINDS = KINDS[:2]
"""what a soak on one machine kills (a node kill needs namespaces: :func:`soak_nodes`)"""
STEPS_BOUND = 1_000_000
"""``--steps`` of a run set in minutes: more than it reaches; the learning-rate schedule spans them"""
UNTIL = "reference-until"
"""the file, in the soak's folder, that tells the uninterrupted run where the soak ended (its step count)"""
PORT = 29400
"""the rendezvous port on the first node: free, as the namespaces are the soak's own"""


class Stalled(RuntimeError):
    """No step for ``--stall-minutes``: the soak ends as failed rather than wait for ever."""


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

    node: int | None = None
    """the node a node kill (or, run on nodes, a worker kill) hit (0: the one hosting the rendezvous)"""
    back_s: float | None = None
    """a node kill: seconds from the kill until the second rank trained again (the node rejoined, or the requeue)"""
    rejoin_redone: int | None = None
    """the second node killed: steps the survivor had trained alone that were run again after the node rejoined (the
    group restarts from the newest checkpoint)"""
    other_end_s: float | None = None
    """the first node killed: seconds until the second node's torchrun ended by itself (None: it did not)"""
    other_end: str = ""
    """the first node killed: the second node's exit code and the last line of its output"""
    dashboard: str = ""
    """the first node killed: the attached run's status and message once the second node had ended"""
    orphans: list[str] = field(default_factory=list)
    """a node's agent killed: the processes still in its namespace a while later (its worker must die with it)"""

    @property
    def redone(self) -> int | None:
        return None if self.resumed_at is None else max(0, self.last_step - self.resumed_at + 1)

    @property
    def lost_node(self) -> bool:
        """The kill took a whole node out of the group: the node, or its agent (its worker dies with it)."""
        return self.kind == "node" or (self.kind == "agent" and self.node is not None)

    @property
    def recovered(self) -> bool:
        """Both the run's progress and (a node lost) its second rank are back: the next kill may come."""
        return self.lost_s is not None and (not self.lost_node or self.back_s is not None)


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
    failure: str = ""
    """why the soak stopped before the run finished ("" when it did not)"""
    minutes: float | None = None
    """the run's length when set in minutes (None: ``steps`` set it)"""
    stopped: str = ""
    """a run set in minutes: the checkpoint it stopped at, and when"""

    @property
    def ok(self) -> bool:
        nodes_ended = all(k.other_end_s is not None for k in self.kills if k.lost_node and k.node == 0)
        return (not self.failure and not self.missing_steps and self.max_loss_diff <= 1e-6 and not self.left_processes
                and self.fds_after <= self.fds_before and nodes_ended and not any(k.orphans for k in self.kills))

    def to_json(self) -> dict:
        """The report as plain data (``--report``)."""
        return {**asdict(self), "ok": self.ok, "kills": [{**asdict(k), "redone": k.redone} for k in self.kills],
                "left_processes": [str(p) for p in self.left_processes]}

    def __str__(self) -> str:
        lines = [f"soak: {self.steps} steps in {self.wall_s / 60:.1f} min, {len(self.kills)} kills "
                 f"({', '.join(f'{sum(k.kind == t for k in self.kills)} {t}' for t in KINDS)}), "
                 f"{self.launches} launches: {'OK' if self.ok else 'FAILED'}"
                 + (f" ({self.failure})" if self.failure else ""),
                 f"  losses against the uninterrupted run: max relative |diff| {self.max_loss_diff:.2e}"
                 + (f", steps never run: {self.missing_steps[:10]}" if self.missing_steps else ""),
                 f"  processes left: {len(self.left_processes)}; this process's file descriptors "
                 f"{self.fds_before} -> {self.fds_after}"]
        if self.stopped:
            lines.insert(1, f"  {self.stopped}")
        for k in self.kills:
            lost = "?" if k.lost_s is None else f"{k.lost_s:.1f}"
            kind = k.kind if k.node is None else f"node {k.node}" if k.kind == "node" else f"{k.kind}@{k.node}"
            line = (f"  {k.at:7.1f} s  {kind:8}  after step {k.last_step}: resumed at {k.resumed_at}, "
                    f"{k.redone} steps redone, {lost} s lost")
            if k.orphans:
                line += f"; ORPHANED: {', '.join(k.orphans)} outlived the agent"
            if k.lost_node:
                line += f"; both ranks again after {'?' if k.back_s is None else f'{k.back_s:.1f}'} s"
            if k.rejoin_redone is not None:
                line += f", {k.rejoin_redone} steps redone at the rejoin"
            if k.lost_node and k.node == 0:
                ended = "did not end" if k.other_end_s is None else f"ended after {k.other_end_s:.1f} s"
                line += f"; node 1 {ended} ({k.other_end}); the dashboard then: {k.dashboard}"
            lines.append(line)
        return "\n".join(lines)


def export_script(workdir: Path, *, hidden: int, steps: int, nodes: bool = False) -> Path:
    """The planner's dp=2 ZeRO-3 plan of a small MLP, exported as the user would (FSDP2 + DCP checkpoints); ``nodes``:
    with the same batch on every data-parallel rank (``NODE_BATCH``), for the node kills."""
    return _export(workdir, hidden=hidden, steps=steps, nodes=nodes).script


def export_for_nodes(workdir: Path, *, hidden: int, steps: int) -> tuple[Path, str]:
    """:func:`export_script` for the node kills and its elastic command (``torchrun --nnodes 1:2 ...``) with
    restarts for every kill: each node lost costs the survivor's agent one restart."""
    exported = _export(workdir, hidden=hidden, steps=steps, nodes=True)
    words = next(c for c in exported.commands if "--nnodes 1:" in c).split()
    words[words.index("--max-restarts") + 1] = "1000"
    return exported.script, " ".join(words)


def _export(workdir: Path, *, hidden: int, steps: int, nodes: bool):
    cell = CELL + NODE_BATCH if nodes else CELL
    source = ModelSource(cell.format(hidden=hidden), make_batch_var="make_batch" if nodes else None)
    model, example, _ = source.build(device="meta")
    graph = ap.capture(model, example)
    plan = ap.plan(graph, ap.Cluster.preset("cpu", 1, 2), fix={"dp": 2, "zero_stage": 3})
    return ap.export(source, plan, workdir / "train.py", steps=steps, quiet=True)


def stamp(text: str) -> None:
    """A progress line with the UTC time, flushed at once (an unattended soak's log)."""
    print(f"{datetime.now(timezone.utc):%H:%M:%S} {text}", flush=True)


def _fds() -> int:
    """This process's open file descriptors, the launcher's warm standby closed first: it is kept on purpose between
    runs (its pipes and log files), started by whichever launch came first, here the soak's or its reference's."""
    POOL.close()
    return len(os.listdir("/proc/self/fd"))


@dataclass
class Seen:
    """What the runs' metrics said so far."""

    losses: dict[int, tuple[float, float, tuple[int, int]]] = field(default_factory=dict)
    """step -> rank 0's (loss, the time it was sent, (launch, attempt)) of the step's latest run"""
    attempts: dict[tuple[int, int], dict[int, float]] = field(default_factory=dict)
    """(launch, attempt) -> {step: the time rank 0 sent it} of every step that attempt finished (steps run again
    later included)"""
    second: dict[tuple[int, int], float] = field(default_factory=dict)
    """(launch, attempt) -> the time rank 1 sent its first step in it"""

    def read(self, run, launch_no: int) -> None:
        """Take in every step row of ``run`` (launch number ``launch_no``); a later attempt's loss replaces."""
        for row in run.metrics:
            if "loss" not in row or "step" not in row:
                continue
            epoch = (launch_no, row.get("attempt", 0))
            if row.get("rank") == 0:
                if self.losses.get(row["step"], (0, 0, (0, 0)))[2] <= epoch:
                    self.losses[row["step"]] = (row["loss"], row["time"], epoch)
                self.attempts.setdefault(epoch, {})[row["step"]] = row["time"]
            elif row.get("rank") == 1:
                self.second[epoch] = min(self.second.get(epoch, row["time"]), row["time"])

    def step(self) -> int:
        """The newest step rank 0 finished (-1: none yet)."""
        return max(self.losses, default=-1)

    def epoch(self, launch_no: int) -> tuple[int, int]:
        """The newest (launch, attempt) of launch ``launch_no`` that sent a step."""
        return max((e for e in self.attempts if e[0] == launch_no), default=(launch_no, 0))

    def cut(self, steps: int) -> None:
        """The run ends after ``steps`` steps (the checkpoint it stopped at): forget the steps trained past it."""
        self.losses = {s: v for s, v in self.losses.items() if s < steps}
        kept = {e: {s: t for s, t in a.items() if s < steps} for e, a in self.attempts.items()}
        self.attempts = {e: a for e, a in kept.items() if a}


def soak(script: Path, *, steps: int, ckpt_every: int, kill_every: tuple[float, float], kills: int | None,
         kinds=LOCAL_KINDS, seed: int = 0, nproc: int = 2, reference: dict[int, float] | None = None,
         workdir: Path | None = None, stall_s: float = 600.0, progress=print,
         minutes: float | None = None) -> SoakReport:
    """Train ``script`` for ``steps`` with random kills (module docstring); ``kills``: at most this many (None: until
    the run ends). Each kill comes ``kill_every`` (low, high: uniform) seconds after the run made progress again,
    and none in the last tenth of the run. ``minutes``: the run is set in minutes instead (``steps``, e.g.
    :data:`STEPS_BOUND`, only its schedule's length): once they are up it stops at its next complete checkpoint,
    whose step count becomes ``report.steps``. ``reference``: the uninterrupted run's rank-0 losses by step (run
    beside the soak when None: :func:`uninterrupted`). ``stall_s``: no step for this long ends the soak
    (``report.failure``)."""
    workdir = Path(workdir or tempfile.mkdtemp(prefix="soak-"))
    workdir.mkdir(parents=True, exist_ok=True)  # the reference, in its own process, makes its folder later
    ref = reference or uninterrupted(script, nproc=nproc, steps=steps, ckpt_every=ckpt_every, workdir=workdir)
    rng = random.Random(seed)
    report = SoakReport(steps=steps, wall_s=0.0, fds_before=_fds(), minutes=minutes)
    seen = Seen()
    runs: list = []
    t0 = time.time()
    until = None if minutes is None else t0 + minutes * 60
    try:
        while True:
            report.launches += 1
            run = launch(script, nproc=nproc, steps=steps, max_restarts=1000,
                         run_dir=workdir / f"run{report.launches}", ckpt_dir=workdir / "ckpt", ckpt_every=ckpt_every)
            runs.append(run)
            due = dict(rng=rng, kinds=kinds, kill_every=kill_every, kills=kills, steps=steps, stall_s=stall_s,
                       progress=progress, until=until)
            kind = _kill_when_due(run, report, seen, t0, **due)
            while kind == "worker":  # the agent restarts the group: the same run goes on
                kind = _kill_when_due(run, report, seen, t0, **due)
            if kind == "time" and _stop_at_checkpoint(
                    workdir / "ckpt", report, seen, t0, ended=lambda r=run: r.done, read=lambda r=run: seen.read(
                        r, report.launches), stop=lambda r=run: r.stop("the soak's time is up"), stall_s=stall_s,
                    progress=progress):
                seen.read(run, report.launches)
                break
            status = run.wait()
            seen.read(run, report.launches)
            if kind in (None, "time"):  # "time" here: the run ended before its next checkpoint
                if status != "finished":
                    raise RuntimeError(f"the run ended {status}: {run.message}")
                break
        report.wall_s = time.time() - t0
        reference = _compared(ref, report, seen)
    except (Stalled, KeyboardInterrupt) as e:
        report.failure, reference = str(e) or "interrupted", {}
    finally:
        for run in runs:
            if not run.done:
                run.stop("the soak ended")
        left = _stop(ref)
    report.left_processes = [p for r in runs for p in r.processes()] + left
    return _finish(report, reference, seen, t0)


def uninterrupted(script: Path, *, nproc: int, steps: int, ckpt_every: int, workdir: Path) -> subprocess.Popen:
    """The reference, started: ``script`` run without a kill (local processes) beside the soak, saving the soak's
    checkpoints (the numerics guard rolls back to the latest: both runs must have the same ones). Beside the soak
    rather than before it, the two share the host as they would in turn, and the whole takes the soak's time instead
    of twice it. A process of its own (this file, ``--reference-of``): a kernel launches one run at a time;
    :func:`reference_losses` reads its losses at the end."""
    return subprocess.Popen([sys.executable, __file__, "--reference-of", str(script), "--nproc", str(nproc),
                             "--steps", str(steps), "--ckpt-every", str(ckpt_every), "--workdir", str(workdir)])


def reference_losses(reference, steps: int | None = None) -> dict[int, float]:
    """Rank 0's loss of every step of the uninterrupted run (waited for while it runs on), or the losses given;
    ``steps``: the soak's run stopped after that many (set in minutes): the uninterrupted run is told to stop once it
    has trained as many (:data:`UNTIL`), and only those are returned."""
    if not isinstance(reference, dict):
        workdir = Path(reference.args[-1])
        if steps is not None:
            (workdir / f"{UNTIL}.new").write_text(str(steps))
            os.replace(workdir / f"{UNTIL}.new", workdir / UNTIL)  # read whole or not at all
        reference.wait()
        out = json.loads((workdir / "reference.json").read_text())
        if "error" in out:
            raise RuntimeError(f"the uninterrupted run did not finish: {out['error']}")
        reference = {int(step): loss for step, loss in out["losses"].items()}
    return {s: loss for s, loss in reference.items() if steps is None or s < steps}


def _compared(reference, report: SoakReport, seen: Seen) -> dict[int, float]:
    """The uninterrupted run's losses over the soak's run: a run stopped at a checkpoint (set in minutes) ends at its
    step, both sides (the steps trained past it before the stop are dropped)."""
    if not report.stopped:
        return reference_losses(reference)
    seen.cut(report.steps)
    return reference_losses(reference, report.steps)


def _reference(script: Path, *, nproc: int, steps: int, ckpt_every: int, workdir: Path) -> None:
    """``--reference-of``: run :func:`uninterrupted`'s script, its losses (JSON: floats exactly) to
    ``workdir/reference.json``; stopped once it trained the steps :data:`UNTIL` names, when the soak writes it."""
    run = launch(script, nproc=nproc, steps=steps, run_dir=workdir / "reference",
                 ckpt_dir=workdir / "reference-ckpt", ckpt_every=ckpt_every)
    until = workdir / UNTIL
    try:
        while not run.done:
            run.wait(1.0)
            last = int(until.read_text()) if until.exists() else None
            if last is not None and sum(s < last for s, _ in run.loss_curve(0)) >= last:
                run.stop("the soak's run ended at this step")
    finally:
        if not run.done:
            run.stop("the soak ended")
    last = int(until.read_text()) if until.exists() else steps
    losses = {s: loss for s, loss in run.loss_curve(0) if s < last}
    whole = run.status == "finished" or len(losses) == last
    out = {"losses": losses} if whole else {"error": run.message}
    (workdir / "reference.json").write_text(json.dumps(out))


def _stop(reference) -> list:
    """End the reference's process (its run stops its ranks) when it runs on; what of it is left."""
    if isinstance(reference, dict):
        return []
    if reference.poll() is None:
        reference.terminate()
        reference.wait(60)
    return [] if reference.poll() is not None else [reference.pid]


def _finish(report: SoakReport, reference: dict[int, float], seen: Seen, t0: float) -> SoakReport:
    """The losses against the reference (relative differences: the losses fall far below 1), the kills' figures and
    this process's file descriptors."""
    report.wall_s = report.wall_s or time.time() - t0  # the soak's own time, not the wait for its reference
    _settle(report.kills, seen, t0)
    losses = seen.losses
    report.missing_steps = sorted(set(reference) - set(losses))
    diffs = [abs(losses[s][0] - v) / (abs(v) or 1.0) for s, v in reference.items() if s in losses]
    report.max_loss_diff = max(diffs, default=float("inf"))
    report.fds_after = _fds()
    return report


def _stalled(seen: Seen, since: float, stall_s: float) -> None:
    """Raise :class:`Stalled` when no step came for ``stall_s`` (counted from ``since`` at the latest)."""
    last = max([since, *(t for _, t, _ in seen.losses.values())])
    if time.time() - last > stall_s:
        raise Stalled(f"no step for {time.time() - last:.0f} s (--stall-minutes)")


def soak_nodes(script: Path, command: str, *, steps: int, ckpt_every: int, kill_every: tuple[float, float],
               away: tuple[float, float], kills: int | None, seed: int = 0, reference: dict[int, float] | None = None,
               workdir: Path | None = None, stall_s: float = 600.0, progress=print,
               kinds: tuple[str, ...] = ("node",), minutes: float | None = None) -> SoakReport:
    """:func:`soak` with whole nodes killed: two network namespaces, one process each under ``command`` (the
    script's elastic torchrun line, :func:`export_for_nodes`), followed by an attached run (``ap.attach``) in the
    first node's namespace. A node kill SIGKILLs every process in one namespace (module docstring); the second node,
    lost, comes back ``away`` (low, high: uniform) seconds after the first trained on alone. ``kinds``: what each
    kill picks from: ``node``, ``worker`` (SIGKILL to one node's rank: both nodes' agents restart the group) and
    ``agent`` (SIGKILL to one node's torchrun: its worker must die with it, and the node is lost). ``minutes``: as
    for :func:`soak`; the nodes' torchruns are then ended with SIGTERM at the checkpoint."""
    from netns import two_nodes, unavailable

    why = unavailable()
    if why:
        raise SystemExit(f"the node kills need network namespaces: {why}")
    workdir = Path(workdir or tempfile.mkdtemp(prefix="soak-"))
    workdir.mkdir(parents=True, exist_ok=True)  # the reference, in its own process, makes its folder later
    ref = reference or uninterrupted(script, nproc=2, steps=steps, ckpt_every=ckpt_every, workdir=workdir)
    rng = random.Random(seed)
    report = SoakReport(steps=steps, wall_s=0.0, fds_before=_fds(), minutes=minutes)
    seen = Seen()
    t0 = time.time()
    until = None if minutes is None else t0 + minutes * 60
    with two_nodes() as nodes:
        pair = _Pair(nodes, script, command, ckpt_every=ckpt_every, workdir=workdir)
        try:
            while True:
                report.launches += 1
                run = pair.launch(report.launches, steps)
                finished = _drive_nodes(run, pair, report, seen, t0, rng=rng, kill_every=kill_every, kinds=kinds,
                                        away=away, kills=kills, steps=steps, stall_s=stall_s, progress=progress,
                                        until=until)
                seen.read(run, report.launches)
                if finished:
                    break
            report.wall_s = time.time() - t0
            reference = _compared(ref, report, seen)
        except (Stalled, KeyboardInterrupt) as e:
            report.failure, reference = str(e) or "interrupted", {}
        finally:
            report.left_processes = pair.left() + _stop(ref)
            pair.stop()
    _settle(report.kills, seen, t0)
    return _finish(report, reference, seen, t0)


class _Pair:
    """The two nodes' torchrun processes and the attached run that follows them."""

    def __init__(self, nodes, script: Path, command: str, *, ckpt_every: int, workdir: Path):
        self.nodes, self.script, self.command, self.workdir = nodes, script, command, workdir
        self.args = ["--ckpt-every", str(ckpt_every)]  # the command ends in --ckpt-dir ckpt, beside the script
        self.procs: list = [None, None]
        self.run = None
        self.logs = 0

    def launch(self, number: int, steps: int):
        """A new attached run in the first node's namespace and both nodes started (a first launch or a requeue)."""
        from netns import in_namespace

        if self.run is not None:
            self.run.stop("requeued")
        self.run = in_namespace(self.nodes[0], lambda: attach(
            self.script, 2, steps, host=self.nodes[0].addr, lost_after_s=300, restart_wait_s=300,
            rendezvous=f"{self.nodes[0].addr}:{PORT}", run_dir=self.workdir / f"run{number}"))
        for i in (0, 1):
            self.start(i)
        return self.run

    def start(self, i: int) -> None:
        """Start node ``i``'s torchrun (its output in a log file of its own beside the script)."""
        from netns import node_argv

        self.logs += 1
        with open(self.workdir / f"node{i}.{self.logs}.log", "w") as log:
            argv = node_argv(self.command, i, self.nodes, script_dir=self.script.parent, port=PORT) + self.args
            self.procs[i] = self.nodes[i].popen(argv, env=dict(os.environ, PYTHONWARNINGS="ignore", **self.run.env),
                                                stdout=log, stderr=subprocess.STDOUT, cwd=self.script.parent)
        self.procs[i].log = log.name

    def alive(self, i: int) -> bool:
        return self.procs[i] is not None and self.procs[i].poll() is None

    def worker(self, i: int):
        """Node ``i``'s rank: the child of its torchrun that runs the script."""
        import psutil

        agent = psutil.Process(self.procs[i].pid)
        return next(p for p in agent.children() if str(self.script) in " ".join(p.cmdline()))

    def kill(self, i: int) -> None:
        """Every process in node ``i``'s namespace, at once: the node is gone."""
        from netns import kill_namespace_processes

        kill_namespace_processes(self.nodes[i])
        self.procs[i].wait()

    def kill_agent(self, i: int, *, within_s: float = 10.0) -> list[str]:
        """SIGKILL node ``i``'s torchrun alone (``nsenter`` and ``env`` exec it: the process started is torchrun).
        Its worker must die with it (the death signal the script sets); what is still in the namespace after
        ``within_s`` (orphans: then killed, so the soak goes on as for the node lost)."""
        self.procs[i].send_signal(signal.SIGKILL)
        self.procs[i].wait()
        deadline = time.time() + within_s
        while (left := _namespace_pids(self.nodes[i])) and time.time() < deadline:
            time.sleep(0.1)
        if left:
            self.kill(i)
        return [f"pid {pid}" for pid in left]

    def end(self) -> None:
        """SIGTERM to each node's torchrun, as a scheduler ends a job step (the agent stops its worker, then exits),
        waited for (what is left shows in :meth:`left`); then the attached run is detached."""
        for i in (0, 1):
            if self.alive(i):
                self.procs[i].send_signal(signal.SIGTERM)
        for i in (0, 1):
            with contextlib.suppress(subprocess.TimeoutExpired, AttributeError):
                self.procs[i].wait(60)
        self.run.stop("the soak's time is up")

    def left(self) -> list[str]:
        """Processes still in either namespace."""
        return [f"{n.name}: pid {pid}" for n in self.nodes for pid in _namespace_pids(n)]

    def stop(self) -> None:
        """Kill what is left in the namespaces and detach the run."""
        from netns import kill_namespace_processes, kill_tree

        for i, node in enumerate(self.nodes):
            kill_namespace_processes(node)
            if self.procs[i] is not None:
                kill_tree(self.procs[i])
        if self.run is not None and not self.run.done:
            self.run.stop("the soak ended")


def _namespace_pids(node) -> list[str]:
    return subprocess.run(["ip", "netns", "pids", node.name], capture_output=True, text=True).stdout.split()


def _drive_nodes(run, pair: _Pair, report: SoakReport, seen: Seen, t0: float, *, rng, kill_every, kinds, away,
                 kills, steps, stall_s, progress, until=None) -> bool:
    """Follow one launch on the two nodes: kill a node when due, bring the second back when it is away, and wait for
    the second to end by itself when the first was killed; once ``until`` came, stop at the next checkpoint. True
    when the run finished (or stopped there), False when it must be launched again (the first node was lost)."""
    due, back_at, since, grace = None, None, time.time(), None
    while pair.alive(0) or pair.alive(1):
        if not pair.alive(0) and pair.procs[0].returncode == 0:  # finished alone while the second was coming back
            grace = grace or time.time() + 60
            if time.time() > grace:
                pair.kill(1)
                progress(f"  {time.time() - t0:7.1f} s: node 1 killed: the run had finished without it")
        seen.read(run, report.launches)
        _settle(report.kills, seen, t0)
        _stalled(seen, since, stall_s)
        if until is not None and time.time() >= until and _stop_at_checkpoint(
                pair.script.parent / "ckpt", report, seen, t0, ended=lambda: not (pair.alive(0) or pair.alive(1)),
                read=lambda: seen.read(run, report.launches), stop=pair.end, stall_s=stall_s, progress=progress):
            return True
        newest, last = seen.step(), report.kills[-1] if report.kills else None
        node_1_away = last is not None and last.lost_node and last.node == 1 and not pair.alive(1)
        if node_1_away and last.lost_s is not None and pair.alive(0):
            back_at = back_at or time.time() + rng.uniform(*away)
            if time.time() >= back_at:
                pair.start(1)
                back_at = None
                progress(f"  {time.time() - t0:7.1f} s: node 1 started again")
        if not _may_kill(report, newest, kills=kills, steps=steps, t0=t0, until=until):
            due = None  # one drawn before the last tenth is not made in it
        elif due is None and newest >= 0 and (last is None or last.recovered):
            due = time.time() + rng.uniform(*kill_every)
        if due is not None and time.time() >= due and pair.alive(0) and pair.alive(1):
            due, node, kind = None, rng.choice((0, 1)), rng.choice(kinds)
            kill = Kill(kind, time.time() - t0, seen.epoch(report.launches), node=node)
            if kind == "node":
                pair.kill(node)
            elif kind == "agent":
                kill.orphans = pair.kill_agent(node)
            else:
                pair.worker(node).send_signal(signal.SIGKILL)
            report.kills.append(kill)
            progress(f"  {kill.at:7.1f} s: killed {'node' if kind == 'node' else f'the {kind} on node'} {node} after "
                     f"step {newest}" + (f"; ORPHANED: {', '.join(kill.orphans)}" if kill.orphans else ""))
            if kill.lost_node and node == 0:
                _other_node_ends(pair, kill, t0, stall_s=stall_s, progress=progress)
                return False
        time.sleep(1.0)  # a poll reads every row of the run's metrics
    run.wait(60)
    if run.status != "finished":
        raise RuntimeError(f"the run on the nodes ended {run.status}: {run.message}")
    return True


def _other_node_ends(pair: _Pair, kill: Kill, t0: float, *, stall_s: float, progress) -> None:
    """The first node (the rendezvous host) is gone: the second node's torchrun must end by itself, leaving nothing
    in its namespace; waited for up to ``stall_s``, then killed (and noted: ``other_end_s`` stays None)."""
    proc, deadline = pair.procs[1], time.time() + stall_s
    while proc.poll() is None and time.time() < deadline:
        time.sleep(1.0)  # a poll reads every row of the run's metrics
    if proc.poll() is None:
        kill.other_end = f"still running after {stall_s:.0f} s: killed"
        pair.kill(1)
        return
    kill.other_end_s = time.time() - t0 - kill.at
    for _ in range(50):  # its workers end with it (torchrun's death signal), within a moment
        if not _namespace_pids(pair.nodes[1]):
            break
        time.sleep(0.1)
    left = _namespace_pids(pair.nodes[1])
    lines = [ln for ln in Path(proc.log).read_text(errors="replace").splitlines() if ln.strip()]
    kill.other_end = (f"exit {proc.returncode}" + (f", {len(left)} process(es) left" if left else "")
                      + (f": {lines[-1].strip()[:200]}" if lines else ""))
    settle = time.time() + 30  # the closed connections reach the attached run: seconds, more on a loaded machine
    while pair.run.status == "restarting" and time.time() < settle:
        time.sleep(0.5)
    kill.dashboard = f"{pair.run.status}: {pair.run.message}"
    progress(f"  {time.time() - t0:7.1f} s: node 1 ended by itself: {kill.other_end}; the dashboard: {kill.dashboard}")


def _kill_when_due(run, report: SoakReport, seen: Seen, t0: float, *, rng, kinds, kill_every, kills, steps,
                   stall_s, progress, until: float | None = None) -> str | None:
    """Wait until the run has made progress past the last kill, then ``kill_every`` seconds more; kill one of its
    processes and return the kind killed, None when the run ended (or, set in steps, no kill is left to make), or
    "time" once ``until`` (a ``time.time()``) came."""
    due, since = None, time.time()
    while not run.done:
        seen.read(run, report.launches)
        _settle(report.kills, seen, t0)
        _stalled(seen, since, stall_s)
        newest = seen.step()
        if until is not None and time.time() >= until:
            return "time"
        if not _may_kill(report, newest, kills=kills, steps=steps, t0=t0, until=until):
            if until is None:
                return None  # let it finish
            due = None  # one drawn before the last tenth is not made in it
        elif due is None and newest >= 0 and (not report.kills or report.kills[-1].recovered):
            due = time.time() + rng.uniform(*kill_every)
        if due is not None and time.time() >= due:
            kind = rng.choice(kinds)
            workers = list(run.workers().values())
            if workers:
                target = _agent_of(workers[0]) if kind == "agent" else rng.choice(workers)
                epoch = seen.epoch(report.launches)
                kill = Kill(kind, time.time() - t0, epoch)
                target.send_signal(signal.SIGKILL)
                report.kills.append(kill)
                progress(f"  {kill.at:7.1f} s: killed the {kind} after step {newest}")
                return kind
        time.sleep(1.0)  # a poll reads every row of the run's metrics
    return None


def _may_kill(report: SoakReport, newest: int, *, kills: int | None, steps: int, t0: float,
              until: float | None) -> bool:
    """Another kill may come: one is left to make, and the run is not in its last tenth (of its steps, or of its
    minutes when ``until`` is set), which it ends as it would."""
    if kills is not None and len(report.kills) >= kills:
        return False
    return newest < 0.9 * steps if until is None else time.time() < until - 0.1 * (until - t0)


def _stop_at_checkpoint(ckpt_dir: Path, report: SoakReport, seen: Seen, t0: float, *, ended, read, stop, stall_s,
                        progress) -> bool:
    """The time is up: wait for the run's next complete checkpoint in ``ckpt_dir`` (the runtime's own rule:
    :func:`latest_checkpoint`), then ``stop()`` the run there; that checkpoint's step count becomes the run's
    (``report.steps``, said in ``report.stopped``). False, stopping nothing, when the run ``ended()`` first.
    ``read()`` takes in the run's metrics meanwhile (for ``stall_s``)."""
    up, since, before = time.time() - t0, time.time(), latest_checkpoint(str(ckpt_dir))
    while (now := latest_checkpoint(str(ckpt_dir))) == before:
        if ended():
            return False
        read()
        _stalled(seen, since, stall_s)
        time.sleep(0.2)
    stop()
    report.steps = int(Path(now).name.removeprefix("step_"))
    report.stopped = (f"set in minutes: time up after {up:.0f} s, stopped {time.time() - t0 - up:.1f} s later at "
                      f"the next complete checkpoint ({Path(now).name}): {report.steps} steps")
    progress(f"  {time.time() - t0:7.1f} s: {report.stopped}")
    return True


def _agent_of(worker):
    """The elastic agent above ``worker``: its ancestor that this process started (a warm run's workers are
    children of the agent's forkserver, a cold run's of the agent itself)."""
    proc = worker
    while proc is not None and proc.ppid() != os.getpid():
        proc = proc.parent()
    return proc or worker


def _settle(kills: list[Kill], seen: Seen, t0: float) -> None:
    """Each kill's last step (the newest its attempt finished), the step the next attempt resumed at, the seconds
    from the kill to the first step past the last one (in any later attempt) and, for a node kill, to rank 1's first
    step after it and the steps redone when the second node rejoined."""
    for k in kills:
        k.last_step = max(seen.attempts.get(k.epoch, {}), default=k.last_step)
        later = sorted(e for e in seen.attempts if e > k.epoch)
        if not later:
            continue
        k.resumed_at = min(seen.attempts[later[0]])
        past = [t - t0 for e in later for s, t in seen.attempts[e].items() if s > k.last_step]
        k.lost_s = min(past) - k.at if past else None
        back = sorted((t - t0, e) for e, t in seen.second.items() if e > k.epoch)
        if k.lost_node and back:
            k.back_s = back[0][0] - k.at
            if back[0][1] != later[0] and back[0][1] in seen.attempts:  # the survivor trained alone in between
                k.rejoin_redone = max(0, max(seen.attempts[later[0]]) - min(seen.attempts[back[0][1]]) + 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0,
                        help="how long the interrupted run trains: it stops at its first checkpoint after that")
    parser.add_argument("--steps", type=int, default=0, help="train this many steps instead of --minutes")
    parser.add_argument("--kill-every", default="120,240", help="seconds between kills: low,high (uniform)")
    parser.add_argument("--node-kill-every", default=None,
                        help="kill whole nodes instead (2 network namespaces x 1 process; root): low,high seconds")
    parser.add_argument("--node-away", default="10,30", help="seconds a lost second node stays away: low,high")
    parser.add_argument("--node-kinds", default="node,worker,agent",
                        help="with --node-kill-every, what each kill picks from: node, worker (one node's rank), "
                        "agent (one node's torchrun alone)")
    parser.add_argument("--kills", type=int, default=None, help="at most this many kills")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ckpt-every", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stall-minutes", type=float, default=10.0, help="no step for this long ends the soak")
    parser.add_argument("--report", type=Path, default=None, help="write the report here as JSON")
    parser.add_argument("--reference-of", type=Path, default=None, help=argparse.SUPPRESS)  # uninterrupted()'s
    parser.add_argument("--nproc", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _interrupt)  # a scheduler's or `kill`'s end: clean up as for Ctrl-C
    if args.reference_of:
        _reference(args.reference_of, nproc=args.nproc, steps=args.steps, ckpt_every=args.ckpt_every,
                   workdir=args.workdir)
        return
    workdir = Path(tempfile.mkdtemp(prefix="soak-"))
    steps, minutes = (args.steps, None) if args.steps else (STEPS_BOUND, args.minutes)
    stamp(f"soak in {workdir}: " + (f"{steps} steps" if minutes is None else f"{minutes:g} min, then the next "
                                    f"checkpoint (every {args.ckpt_every} steps)"))
    (workdir / "soak").mkdir(exist_ok=True)
    common = dict(steps=steps, minutes=minutes, ckpt_every=args.ckpt_every, kills=args.kills, seed=args.seed,
                  workdir=workdir / "soak", stall_s=args.stall_minutes * 60, progress=stamp)
    if args.node_kill_every:
        script, command = export_for_nodes(workdir / "soak", hidden=args.hidden, steps=steps)
        report = soak_nodes(script, command, kill_every=_pair(args.node_kill_every), away=_pair(args.node_away),
                            kinds=tuple(args.node_kinds.split(",")), **common)
    else:
        script = export_script(workdir / "soak", hidden=args.hidden, steps=steps)
        report = soak(script, kill_every=_pair(args.kill_every), **common)
    print(report, flush=True)
    if args.report:
        args.report.write_text(json.dumps(report.to_json(), indent=1))
    raise SystemExit(0 if report.ok else 1)


def _pair(text: str) -> tuple[float, float]:
    lo, hi = (float(x) for x in text.split(","))
    return lo, hi


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    main()
