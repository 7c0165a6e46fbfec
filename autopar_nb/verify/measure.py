"""One rank's memory, component by component, as the plan's exported script runs it: the figures the cost model is
checked against.

The script's ``build_model`` builds the model with real, small tensors (before the tracker starts), then its
``main`` runs a few steps in one process as one rank of a fake process group (``torch.testing._internal.
distributed.fake_pg``: every collective returns at once, leaving its output as it was) inside PyTorch's memory
tracker (``MemTracker``; ``FSDPMemTracker`` once the plan's ``parallelize`` returns an FSDP2 module), which counts
every storage the step creates by what it is. So what is measured is what the script does — its ``parallelize``
(TP styles, recompute, DDP/FSDP, pipeline stages), its loss and ``loss_parallel``, autocast, clipping and optimizer
— not a re-creation of it. Values are meaningless (no collective moves data); sizes are not.

Real tensors, not ``FakeTensorMode``: under fake tensors ``model.to(device)`` fails on Hugging Face models
(``_apply(): Couldn't swap``), DDP's parameter check needs storage and the training loop reads ``.item()``. The
models are small enough (hidden 256, 4 layers) for a real CPU step.

The one thing the harness adds: DDP gets a comm hook that returns its bucket as it is (the fake group's all-reduce
future returns None, which DDP's reducer refuses, ``comm.cpp: expected the hook result is either a Tensor or a
TensorList found None``); the bucket, the memory DDP holds, is unchanged.

The trackers label every storage by when it is created (:mod:`.labels`), so the peak splits into the components
the cost model predicts. The peak of the last step is reported (the first creates the optimizer states).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..export import run_script
from .labels import FSDPTracker, Tracker, components
from .node_spans import NodeSpans


class _Session:
    """The tracker a run uses: the plain one until ``parallelize`` returns an FSDP2 module, then an FSDP one over
    it (FSDPMemTracker needs the module; it tracks its parameters and buffers from then on)."""

    def __init__(self, steps: int, census: int = 0, moments: bool = False):
        self.steps, self.census, self.moments = steps, census, moments
        self.spans = NodeSpans(lambda module: self.active._mod_tracker.get_known_fqn(module))
        self.active = Tracker()
        self.active.census, self.active.spans = census, self.spans
        self.active.moment_peaks = {} if moments else None

    def switch_to_fsdp(self, roots: list) -> None:
        """Track the FSDP2 modules ``roots`` from now on: a rank's pipeline stages, one root each (an interleaved
        or V schedule's rank holds several), or the one model."""
        import torch.nn as nn

        self.active.__exit__(None, None, None)
        restart_roots = self.active.restart_roots
        self.active = FSDPTracker(roots[0])
        self.active.restart_roots = restart_roots
        if len(roots) > 1:  # the tracker instruments what its root's modules() lists: every stage
            self.active._root_mod = nn.ModuleList(roots)
        self.active.census, self.active.spans = self.census, self.spans
        self.active.moment_peaks = {} if self.moments else None
        self.active.__enter__()

    def as_setup(self, fn):
        """``fn`` with what it allocates labelled as set-up (buffers): DDP's ``_pre_forward``, which rebuilds the
        gradient buckets in the second step's forward."""

        def inner(*args, **kwargs):
            phase, self.active.phase = self.active.phase, "setup"
            try:
                return fn(*args, **kwargs)
            finally:
                self.active.phase = phase

        return inner

    def name_within(self, modules) -> None:
        """Name the modules inside ``modules`` by their paths under them again: ``parallelize`` wraps a traced
        pipeline stage's layers in checkpoint wrappers after the tracker has seen the stage, and torch's ModTracker
        names a module it meets outside the children it listed as a root of its own ("CheckpointWrapper")."""
        tracker = self.active._mod_tracker
        for mod in modules:
            fqn = tracker.get_known_fqn(mod)
            for name, sub in mod.named_modules() if fqn is not None else ():
                if sub is not mod:
                    tracker._known_modules[sub] = f"{fqn}.{name}"
                    tracker._seen_modules.add(sub)

    # the training loop's observer (runtime/train.py)
    def after_backward(self, step, parts, loss):
        self.active.phase = "step"

    def after_step(self, step, parts):
        self.active.phase = "train"
        if step < self.steps - 1:
            self.active.reset_mod_stats()
            self.active.reset_peak()
            self.spans.new_step()


def measure_script(script: str | Path, *, rank: int = 0, steps: int = 2, real: bool = False,
                   census: int = 0, moments: bool = False) -> dict[str, Any]:
    """Run the exported script's ``main`` for ``steps`` steps inside the tracker, as rank ``rank`` of a fake process
    group of the plan's world size, or (``real``) as the rank torchrun started this process as, in a real gloo group
    (a pipelined plan: its stages exchange their boundary shapes with ``recv_object_list``, and every micro-batch's
    activations cross between them, which a fake group would not deliver). Returns ``{"peak": components at the peak
    of the last step, "where": its phase and module, "micro_batch": which of the step's calls of that module,
    "node": the autograd node running (both None outside backward), "world": ..., "rank": ...}``, and with
    ``census`` the ``census`` largest storages alive at the peak under ``"largest"`` (``Labelled.largest``: what
    made each), and with ``moments`` the largest total at each place the last step ran under ``"moments"``:
    [where, micro-batch or None, bytes] (:attr:`Labelled.moment_peaks`). Call it in a fresh process (the
    process group is global state): :func:`measure` does."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    g, runtime = run_script(script, run_name="autopar_measure", build=True)  # the model before the tracker starts
    world = g["PP"] * g["DP"] * g["TP"] * g.get("CP", 1)
    if real:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    else:
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    session = _Session(steps, census, moments)
    if g["PP"] > 1:
        session.active.restart_roots = True
        _label_pipeline_buffers(session)
    _label_gathered_parameters(session)
    parallelize = g["parallelize"]

    def traced(*args, **kwargs):
        out = parallelize(*args, **kwargs)
        parts = out[0] if isinstance(out, tuple) else out
        root = parts[0] if isinstance(parts, list | tuple) else parts
        if hasattr(root, "register_comm_hook"):  # DDP: keep the bucket as it is (see the module docstring)
            root.register_comm_hook(None, _bucket_as_is)
            root._pre_forward = session.as_setup(root._pre_forward)  # its buckets (rebuilt in the 2nd forward)
        if isinstance(root, FSDPModule):
            session.switch_to_fsdp([p for p in (parts if isinstance(parts, list | tuple) else [parts])
                                    if isinstance(p, FSDPModule)])
        session.name_within(parts if isinstance(parts, list | tuple) else [parts])
        session.active.phase = "train"
        return out

    script_globals = g["parallelize"].__globals__  # main reads these (run_path returns a copy): wrappers, this run
    script_globals["parallelize"] = traced
    if "boundary_values" in script_globals:
        script_globals["boundary_values"] = _without_backward_hooks(script_globals["boundary_values"])
    try:
        with _input_hooks_holding_nothing(), session.spans:
            session.active.__enter__()
            try:
                runtime.Run.observer = session  # train() calls it after each backward and step
                g["main"](["--steps", str(steps)])
            finally:
                session.active.__exit__(None, None, None)
        snap = session.active.get_tracker_snapshot("peak").get(torch.device("cpu"), {})
        out = {"peak": components(snap), "where": session.active.where, "micro_batch": session.active.micro_batch,
               "node": session.active.peak_node, "world": world, "rank": rank}
        return (out | ({"largest": session.active.largest()} if census else {})
                | ({"moments": [[where, mb, b] for (where, mb), b in session.active.moment_peaks.items()]}
                   if moments else {}))
    finally:
        del g, script_globals
        gc.collect()  # before destroy: a gloo thread taking the GIL at exit aborts the process now and then
        dist.destroy_process_group()


def _label_pipeline_buffers(session) -> None:
    """The buffers torch's pipeline stages receive activations and gradients into (made at the first step, one per
    micro-batch, kept for the run) labelled as buffers (the cost model's ``pipeline_buffers``), not as the loss's or
    activations, which is when they are made."""
    from torch.distributed.pipelining import stage

    stage._make_tensor_from_meta = session.as_setup(stage._make_tensor_from_meta)


def _label_gathered_parameters(session) -> None:
    """FSDP2 replicate's gathered parameters beside DDP (the experts': ``runtime/ddp.py`` replicate_experts),
    labelled as FSDP's tracker labels its units' for as long as they live: the plain tracker labels a storage by
    the last op that wrote it (the all-gather's copy-out, its own parameter hooks: parameters on one rank,
    activations on another). ``FSDPParam.init_unsharded_param`` follows every all-gather's copy-out."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    from torch.utils.weak import WeakIdKeyDictionary

    init = FSDPParam.init_unsharded_param

    def labelled(self):
        init(self)
        tracker = session.active
        if not isinstance(tracker, FSDPTracker):  # which labels its units' itself
            tracker.gathered = tracker.gathered or WeakIdKeyDictionary()
            for t in self.all_gather_outputs:
                tracker.gathered[t.untyped_storage()] = True
                tracker._update_and_maybe_create_winfos(t, tracker._ref_class.UNSHARDED_PARAM)

    FSDPParam.init_unsharded_param = labelled


@contextlib.contextmanager
def _input_hooks_holding_nothing():
    """The tracker's module tracker with its hooks on each module's inputs (which mark the module's backward done)
    called at the first input gradient, not once every input's exists. Torch's ``ModTracker`` registers them with
    ``register_multi_grad_hook``'s default mode, "all", which keeps each gradient until the module's other inputs
    have theirs: a module that also takes a tensor every block reads (T5's position bias, its encoder's output)
    keeps its hidden states' gradient until that tensor's, summed over every block, exists at the end of backward
    (measured, T5's decoder: one residual gradient per sub-layer, 4.5 MiB at the peak of a pipeline's last rank),
    memory the script never holds without the tracker."""
    import torch.distributed._tools.mod_tracker as mod_tracker

    hook = mod_tracker.register_multi_grad_hook

    def first_gradient(tensors, fn, *, mode="any"):
        return hook(tensors, fn, mode="any")

    mod_tracker.register_multi_grad_hook = first_gradient
    try:
        yield
    finally:
        mod_tracker.register_multi_grad_hook = hook


def _without_backward_hooks(fn):
    """``fn`` with the tracker's module tracker registering no backward hooks: it hooks every module's outputs to
    notice their backward, and a forward that never runs one (a pipeline's :func:`boundary_values`, which reads the
    shapes crossing each cut) would keep its whole autograd graph (a micro-batch's activations) alive through those
    hooks for the rest of the run, which the script without the tracker frees at once."""
    import torch.distributed._tools.mod_tracker as mod_tracker

    def inner(*args, **kwargs):
        hook, mod_tracker.register_multi_grad_hook = mod_tracker.register_multi_grad_hook, lambda *a, **k: None
        try:
            return fn(*args, **kwargs)
        finally:
            mod_tracker.register_multi_grad_hook = hook

    return inner


def _bucket_as_is(state, bucket):
    """DDP comm hook for the fake group: the bucket, unreduced."""
    import torch

    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def measure(source, plan, *, ranks: tuple[int, ...] = (0,), steps: int = 2, timeout: float = 600,
            census: int = 0, moments: bool = False) -> list[dict]:
    """Measure ``plan`` on ``source`` (a :class:`~autopar_nb.source.ModelSource`) for each of ``ranks``: the plan's
    script is exported to a temporary directory and :func:`measure_script` runs it, each rank in a fresh process of
    a fake group, or every rank of a real one started by torchrun (:func:`measure_real`) for a plan whose ranks
    need each other's data: a pipeline (its stages' boundary shapes and activations) and expert parallelism (the
    token counts each rank routes to the others' experts: a fake group leaves the all-to-all's output as it was
    allocated, so the received counts, and with them the experts' activations, were whatever memory held; Mixtral
    under DDP had 3270 to 5362 tokens per expert group where routing sends about 4096), and ZeRO-1 beside TP (in a
    fake group, rank 3 of dp 2 x tp 2 held no optimizer state where, on real processes, it holds half as rank 1 does).
    ``census``: also list that many of the largest storages at each rank's peak; ``moments``: also the largest
    total at each place the step ran (:func:`measure_script`)."""
    from ..export import export

    with tempfile.TemporaryDirectory(prefix="autopar-measure-") as tmp:
        script = export(source, plan, Path(tmp) / "train.py", quiet=True).script
        if needs_real_group(plan):
            got = measure_real(script, world=plan.mesh.world_size, steps=steps, timeout=timeout, census=census,
                               moments=moments)
            return [got[r] for r in ranks]
        return [measure_in_subprocess(script, rank=r, steps=steps, timeout=timeout, census=census, moments=moments)
                for r in ranks]


def needs_real_group(plan) -> bool:
    """:func:`measure` runs ``plan`` on a real gloo group, every rank (its ranks need each other's data), not as
    one rank of a fake group."""
    return plan.mesh.pp > 1 or plan.mesh.ep > 1 or (plan.mesh.zero_stage == 1 and plan.mesh.tp > 1)


def _child(args: list[str], *, timeout: float) -> subprocess.CompletedProcess:
    """``python args...`` in this process's working directory (a notebook kernel's: the cell's relative paths hold
    there, as in verify's and launch's ranks), one thread per process."""
    from .check import kernel_cwd

    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=kernel_cwd())


def _results(proc: subprocess.CompletedProcess, what: str) -> list[dict]:
    got = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if not got or proc.returncode:
        raise RuntimeError(f"memory measurement of {what} failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
    return got


def measure_in_subprocess(script, *, rank: int = 0, steps: int = 2, timeout: float = 600, census: int = 0,
                          moments: bool = False) -> dict:
    """:func:`measure_script` in a child process, one rank of a fake group (one JSON line back)."""
    proc = _child(["-m", "autopar_nb.verify.measure", str(Path(script).resolve()), str(rank), str(steps), str(census),
                   str(int(moments))], timeout=timeout)
    return _results(proc, f"{script} (rank {rank})")[-1]


def measure_real(script, *, world: int, steps: int = 2, timeout: float = 600, census: int = 0,
                 moments: bool = False) -> dict[int, dict]:
    """:func:`measure_script` on every rank of a real gloo group of ``world`` processes on this machine (torchrun,
    loopback only): rank -> its result (each rank writes its own file: the ranks' printed lines can interleave)."""
    with tempfile.TemporaryDirectory(prefix="autopar-measure-ranks-") as out:
        proc = _child(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
                       "-m", "autopar_nb.verify.measure", str(Path(script).resolve()), "real", str(steps), str(census),
                       str(int(moments)), out],
                      timeout=timeout)
        got = {}
        for f in Path(out).glob("rank*.json"):
            d = json.loads(f.read_text())
            got[d["rank"]] = d
    if proc.returncode or len(got) != world:
        raise RuntimeError(f"memory measurement of {script} ({world} processes, {len(got)} reported) failed "
                           f"(rc={proc.returncode}):\n{proc.stderr[-3000:]}")
    return got


if __name__ == "__main__":
    # script, rank (or "real": torchrun's, then the folder its result goes to), steps, census, moments (0 or 1)
    _script, _rank, _steps, _census = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    _moments = bool(int(sys.argv[5]))
    if _rank == "real":
        _out = measure_script(_script, steps=_steps, real=True, census=_census, moments=_moments)
        (Path(sys.argv[6]) / f"rank{_out['rank']}.json").write_text(json.dumps(_out))
    else:
        print(json.dumps(measure_script(_script, rank=int(_rank), steps=_steps, census=_census, moments=_moments)),
              flush=True)
