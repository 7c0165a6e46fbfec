"""One rank's memory, component by component, as the plan's exported script runs it: the figures the
cost model is checked against.

The script's ``build_model`` builds the model with real, small tensors (before the tracker starts),
then its ``main`` runs a few steps in one process as one rank of a fake process group
(``torch.testing._internal. distributed.fake_pg``: every collective returns at once, leaving its
output as it was) inside PyTorch's memory tracker (``MemTracker``; ``FSDPMemTracker`` once the
plan's ``parallelize`` returns an FSDP2 module), which counts every storage the step creates by what
it is. So what is measured is what the script does — its ``parallelize`` (TP styles, recompute,
DDP/FSDP, pipeline stages), its loss and ``loss_parallel``, autocast, clipping and optimizer — not a
re-creation of it. Values are meaningless (no collective moves data); sizes are not.

Real tensors, not ``FakeTensorMode``: under fake tensors ``model.to(device)`` fails on Hugging Face
models (``_apply(): Couldn't swap``), DDP's parameter check needs storage and the training loop
reads ``.item()``. The models are small enough (hidden 256, 4 layers) for a real CPU step.

What the harness adds: DDP gets a comm hook that returns its bucket as it is (the fake group's
all-reduce future returns None, which DDP's reducer refuses, ``comm.cpp: expected the hook result is
either a Tensor or a TensorList found None``); the bucket, the memory DDP holds, is unchanged. And
the numerics guard is off (``--max-skips 0``): a gradient norm reduced through the fake group reads
whatever memory held, often non-finite, and the guard would skip the step, leaving the rank without
optimizer states (ZeRO-1 beside TP, last rank: 0 of 1.6 MiB measured).

The trackers label every storage by when it is created (:mod:`.labels`), so the peak splits into the
components the cost model predicts. The peak of the last step is reported (the first creates the
optimizer states).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

from ..export.files import run_script
from .labels import FSDPTracker, Tracker, components
from .moments import layer_of
from .node_spans import NodeSpans


class _Session:
    """The tracker a run uses: the plain one until ``parallelize`` returns an FSDP2 module, then an
    FSDP one over it (FSDPMemTracker needs the module; it tracks its parameters and buffers from
    then on)."""

    def __init__(self, steps: int, census: int = 0, moments: bool = False):
        self.steps, self.census, self.moments = steps, census, moments
        self.spans = NodeSpans(lambda module: self.active._mod_tracker.get_known_fqn(module))
        self.active = Tracker()
        self.active.census, self.active.spans = census, self.spans
        self.active.moment_peaks = {} if moments else None
        self.routed: list[list] = []
        """[experts module (the tracker's name), rows its local experts received, the rows this
        rank routed] per call of the measured step (:func:`_record_routing`)"""

    def switch_to_fsdp(self, roots: list) -> None:
        """Track the FSDP2 modules ``roots`` from now on: a rank's pipeline stages, one root each
        (an interleaved or V schedule's rank holds several), or the one model."""
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
        """``fn`` with what it allocates labelled as set-up (buffers): DDP's ``_pre_forward``, which
        rebuilds the gradient buckets in the second step's forward."""

        def inner(*args, **kwargs):
            phase, self.active.phase = self.active.phase, "setup"
            try:
                return fn(*args, **kwargs)
            finally:
                self.active.phase = phase

        return inner

    def name_within(self, modules) -> None:
        """Name the modules inside ``modules`` by their paths under them again: ``parallelize``
        wraps a traced pipeline stage's layers in checkpoint wrappers after the tracker has seen the
        stage, and torch's ModTracker names a module it meets outside the children it listed as a
        root of its own ("CheckpointWrapper")."""
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
            self.routed.clear()


def measure_script(script: str | Path, *, rank: int = 0, steps: int = 2, real: bool = False,
                   census: int = 0, moments: bool = False) -> dict[str, Any]:
    """Run the exported script's ``main`` for ``steps`` steps inside the tracker, as rank ``rank``
    of a fake process group of the plan's world size, or (``real``) as the rank torchrun started
    this process as, in a real gloo group (a pipelined plan: its stages exchange their boundary
    shapes with ``recv_object_list``, and every micro-batch's activations cross between them, which
    a fake group would not deliver). Returns ``{"peak": components at the peak of the last step,
    "where": its phase and module, "micro_batch": which of the step's calls of that module, "node":
    the autograd node running (both None outside backward), "world": ..., "rank": ...}``, and with
    ``census`` the ``census`` largest storages alive at the peak under ``"largest"``
    (``Labelled.largest``: what made each), and with ``moments`` the largest total at each place the
    last step ran under ``"moments"``: [where, micro-batch or None, bytes]
    (:attr:`Labelled.moment_peaks`); ``"routed"``: :func:`_record_routing`'s census. Call it in a
    fresh process (the process group is global state): :func:`measure` does."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    # the model before the tracker starts
    g, runtime = run_script(script, run_name="autopar_measure", build=True)
    world = g["PP"] * g["DP"] * g["TP"] * g.get("CP", 1)
    if real:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    else:
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    session = _Session(steps, census, moments)
    # a pipeline stage, and a model under gradient accumulation, is a root called once per
    # micro-batch
    session.active.restart_roots = g["PP"] > 1 or g.get("MICRO_BATCHES", 1) > 1
    _instrument(session, runtime, pipelined=g["PP"] > 1)
    parallelize = g["parallelize"]

    def traced(*args, **kwargs):
        out = parallelize(*args, **kwargs)
        parts = out[0] if isinstance(out, tuple) else out
        root = parts[0] if isinstance(parts, list | tuple) else parts
        # DDP: keep the bucket as it is (see the module docstring)
        if hasattr(root, "register_comm_hook"):
            root.register_comm_hook(None, _bucket_as_is)
            # its buckets (rebuilt in the 2nd forward)
            root._pre_forward = session.as_setup(root._pre_forward)
        if isinstance(root, FSDPModule):
            session.switch_to_fsdp([p
                                    for p in (parts if isinstance(parts, list | tuple) else [parts])
                                    if isinstance(p, FSDPModule)])
        session.name_within(parts if isinstance(parts, list | tuple) else [parts])
        session.active.phase = "train"
        return out

    # main reads these (run_path returns a copy): wrappers, this run
    script_globals = g["parallelize"].__globals__
    script_globals["parallelize"] = traced
    if "boundary_values" in script_globals:
        script_globals["boundary_values"] = _without_backward_hooks(
            script_globals["boundary_values"])
    try:
        with _input_hooks_holding_nothing(), session.spans:
            session.active.__enter__()
            try:
                runtime.Run.observer = session  # train() calls it after each backward and step
                g["main"](["--steps", str(steps), "--max-skips", "0"])
            finally:
                session.active.__exit__(None, None, None)
        snap = session.active.get_tracker_snapshot("peak").get(torch.device("cpu"), {})
        out = {"peak": components(snap), "where": session.active.where,
               "micro_batch": session.active.micro_batch, "node": session.active.peak_node,
               "world": world, "rank": rank, "routed": session.routed}
        return (out | ({"largest": session.active.largest()} if census else {})
                | ({
                    "moments": [[where, mb, b]
                                for (where, mb), b in session.active.moment_peaks.items()]
                } if moments else {}))
    finally:
        del g, script_globals
        # before destroy: a gloo thread taking the GIL at exit aborts the process now and then
        gc.collect()
        dist.destroy_process_group()


def _instrument(session, runtime, *, pipelined: bool) -> None:
    """What the harness adds to torch's and the script's runtime before ``main`` runs: a pipeline's
    receive buffers and FSDP2 replicate's gathered parameters labelled as what they are, and the
    rows each experts module's local experts receive recorded."""
    if pipelined:
        _label_pipeline_buffers(session)
    _label_gathered_parameters(session)
    if runtime is not None and hasattr(runtime, "_ep_forward"):
        runtime._ep_forward = _record_routing(runtime._ep_forward, session)


def _record_routing(ep_forward, session):
    """The script's expert-parallel forward (``runtime/ep.py`` ``_ep_forward``, looked up when
    ``parallelize`` shards an experts module), noting in ``session.routed`` for each call of the
    last step [the experts module (the tracker's name), the rows its local experts received (the
    all-to-all's output), the (token, choice) rows this rank routed]: what a router really sent,
    which the cost model takes as ``estimate(routed=...)`` (:func:`routed_rows`); the two are
    equal on average, and each rank's under balanced routing."""

    def recording(module, hidden, top_k_index, top_k_weights, *, ep_mesh, local_forward):
        def local(mod, routed, *args):
            name = session.active._mod_tracker.get_known_fqn(mod) or ""
            session.routed.append([name, int(routed.shape[0]), int(top_k_index.numel())])
            return local_forward(mod, routed, *args)

        return ep_forward(module, hidden, top_k_index, top_k_weights, ep_mesh=ep_mesh,
                          local_forward=local)

    return recording


def routed_rows(routed: list, layer_paths: list[str], *, busiest: bool = False) -> dict[str, float]:
    """A rank's ``"routed"`` census (:func:`measure_script`) as the cost model's input: layer path
    -> the rows its experts received over the rows balanced routing gives them (the rank's own
    (token, choice) rows), averaged over the step's calls (its micro-batches; a recompute repeats
    a call's counts), or with ``busiest`` the most of one call: under full recompute a rank holds
    one micro-batch's routed tensors at a time (the one whose layer runs again), and its peak is
    at the busiest one's (measured: Mixtral dp 2 x ep 2 x pp 2, rank 3 peaked in layer 2's
    recompute on 1515 rows where its 4 micro-batches averaged 1.23 x 1024)."""
    got: dict[str, list[float]] = {}
    for module, received, sent in routed:
        k = layer_of(module, layer_paths)
        if k is not None and sent:
            got.setdefault(layer_paths[k], []).append(received / sent)
    return {path: max(r) if busiest else sum(r) / len(r) for path, r in got.items()}


def _label_pipeline_buffers(session) -> None:
    """The buffers torch's pipeline stages receive activations and gradients into (made at the first
    step, one per micro-batch, kept for the run) labelled as buffers (the cost model's
    ``pipeline_buffers``), not as the loss's or activations, which is when they are made."""
    from torch.distributed.pipelining import stage

    stage._make_tensor_from_meta = session.as_setup(stage._make_tensor_from_meta)


def _label_gathered_parameters(session) -> None:
    """FSDP2 replicate's gathered parameters beside DDP (the experts': ``runtime/ddp.py``
    replicate_experts), labelled as FSDP's tracker labels its units' for as long as they live: the
    plain tracker labels a storage by the last op that wrote it (the all-gather's copy-out, its own
    parameter hooks: parameters on one rank, activations on another).
    ``FSDPParam.init_unsharded_param`` follows every all-gather's copy-out."""
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
    """The tracker's module tracker with its hooks on each module's inputs (which mark the module's
    backward done) called at the first input gradient, not once every input's exists. Torch's
    ``ModTracker`` registers them with ``register_multi_grad_hook``'s default mode, "all", which
    keeps each gradient until the module's other inputs have theirs: a module that also takes a
    tensor every block reads (T5's position bias, its encoder's output) keeps its hidden states'
    gradient until that tensor's, summed over every block, exists at the end of backward (measured,
    T5's decoder: one residual gradient per sub-layer, 4.5 MiB at the peak of a pipeline's last
    rank), memory the script never holds without the tracker."""
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
    """``fn`` with the tracker's module tracker registering no backward hooks: it hooks every
    module's outputs to notice their backward, and a forward that never runs one (a pipeline's
    :func:`boundary_values`, which reads the shapes crossing each cut) would keep its whole autograd
    graph (a micro-batch's activations) alive through those hooks for the rest of the run, which the
    script without the tracker frees at once."""
    import torch.distributed._tools.mod_tracker as mod_tracker

    def inner(*args, **kwargs):
        hook, mod_tracker.register_multi_grad_hook = (mod_tracker.register_multi_grad_hook,
                                                      lambda *a, **k: None)
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
    """Measure ``plan`` on ``source`` (a :class:`~autopar_nb.source.ModelSource`) for each of
    ``ranks``: the plan's script is exported to a temporary directory and :func:`measure_script`
    runs it, each rank in a fresh process of a fake group, or every rank of a real gloo group
    (torch's elastic launcher, as torchrun starts them) for a plan whose ranks need each other's
    data: a pipeline (its stages' boundary shapes and activations) and expert parallelism (the token
    counts each rank routes to the others' experts: a fake group leaves the all-to-all's output as
    it was allocated, so the received counts, and with them the experts' activations, were whatever
    memory held; Mixtral under DDP had 3270 to 5362 tokens per expert group where routing sends
    about 4096). ``census``: also list that many of the largest storages at each rank's peak;
    ``moments``: also the largest total at each place the step ran (:func:`measure_script`). Several
    plans: :func:`measure_many`."""
    got = measure_many([(source, plan, ranks)], steps=steps, timeout=timeout, census=census,
                       moments=moments)[0]
    if isinstance(got, Exception):
        raise got
    return got


def measure_many(jobs, *, steps: int = 2, timeout: float = 600, census: int = 0,
                 moments: bool = False) -> list[list[dict] | RuntimeError]:
    """:func:`measure` of each ``(source, plan, ranks)`` of ``jobs``, all from one child process
    (:func:`run_jobs`): where it starts more than one process, torch, the models' libraries and
    autopar_nb are imported once, in multiprocessing's forkserver, and every measured process is
    forked from it, a fresh process but for those imports (each one's start-up otherwise costs more
    than its two steps). ``timeout``: seconds per job. Each job's results, or the RuntimeError
    saying why it failed (the other jobs still run)."""
    from ..export import export

    with tempfile.TemporaryDirectory(prefix="autopar-measure-") as tmp:
        specs = [{
            "script": str(
                Path(export(source, plan,
                            Path(tmp) / f"train_{i}.py", quiet=True).script).resolve()),
            "ranks": list(ranks), "world": plan.mesh.world_size, "real": needs_real_group(plan)
        } for i, (source, plan, ranks) in enumerate(jobs)]
        return _run_in_child(specs, Path(tmp), steps=steps, timeout=timeout * max(1, len(jobs)),
                             census=census, moments=moments)


def needs_real_group(plan) -> bool:
    """:func:`measure` runs ``plan`` on a real gloo group, every rank (its ranks need each other's
    data), not as one rank of a fake group."""
    return plan.mesh.pp > 1 or plan.mesh.ep > 1


def _child(args: list[str], *, timeout: float) -> subprocess.CompletedProcess:
    """``python args...`` in this process's working directory (a notebook kernel's: the cell's
    relative paths hold there, as in verify's and launch's ranks), one thread per process."""
    from .check import kernel_cwd

    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=kernel_cwd())


def _run_in_child(specs: list[dict], folder: Path, *, steps: int, timeout: float, census: int,
                  moments: bool) -> list[list[dict] | RuntimeError]:
    """:func:`run_jobs` of ``specs`` in a child process; its results, in order."""
    jobs = folder / "jobs.json"
    jobs.write_text(json.dumps({"jobs": specs, "steps": steps, "census": census,
                                "moments": moments}))
    proc = _child(["-m", "autopar_nb.verify.measure", str(jobs)], timeout=timeout)
    out = folder / "results.json"
    if proc.returncode or not out.exists():
        raise RuntimeError(f"memory measurement of {len(specs)} plan(s) failed "
                           f"(rc={proc.returncode}):\n{proc.stderr[-3000:]}")
    return [got["ok"] if "ok" in got else
            RuntimeError(f"memory measurement of {spec['script']} ({spec['world']} ranks) failed:\n"
                         f"{got['error'][-3000:]}")
            for spec, got in zip(specs, json.loads(out.read_text()), strict=True)]


def run_jobs(jobs_file: str | Path) -> None:
    """Measure the jobs ``jobs_file`` lists (:func:`_run_in_child`), writing ``results.json`` beside
    it: per job ``{"ok": each rank's result}`` or ``{"error": why}``. More than one process to
    start: the forkserver first, with torch, the scripts' imports and this module preloaded; one:
    :func:`measure_script` here (a fresh process)."""
    spec = json.loads(Path(jobs_file).read_text())
    options = {k: spec[k] for k in ("steps", "census", "moments")}
    forked = sum(job["world"] if job["real"] else len(job["ranks"]) for job in spec["jobs"]) > 1
    if forked:
        _start_forkserver([job["script"] for job in spec["jobs"]])
    results = []
    for job in spec["jobs"]:
        try:
            results.append({"ok": _run_job(job, forked=forked, **options)})
        except Exception as e:  # reported as this job's failure: the others still run
            results.append({"error": e.format_msg() if hasattr(e, "format_msg")
                            else traceback.format_exc()})
    Path(jobs_file).with_name("results.json").write_text(json.dumps(results))


def _start_forkserver(scripts: list[str]) -> None:
    """multiprocessing's forkserver, with torch, what ``scripts`` import and this module imported in
    it."""
    import multiprocessing
    from multiprocessing import forkserver

    # here, not at the top: the measured processes forked with this module need none of launch
    from ..launch.pool import script_preload

    preload = {m for script in scripts for m in script_preload(script)}  # and what they load lazily
    multiprocessing.set_forkserver_preload(sorted(preload | {__name__}))
    forkserver.ensure_running()


def _run_job(job: dict, *, forked: bool, **options) -> list[dict]:
    """One job's ranks measured: every rank of a real gloo group, or each asked rank in a process of
    its own."""
    if job["real"]:
        got = _on_real_group(job["script"], world=job["world"], **options)
        return [got[r] for r in job["ranks"]]
    if not forked:
        return [measure_script(job["script"], rank=r, **options) for r in job["ranks"]]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    out = []
    # one process each (the process group and the tracker's patches are global state)
    for r in job["ranks"]:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("forkserver"),
                                 max_tasks_per_child=1) as pool:
            out.append(pool.submit(measure_script, job["script"], rank=r, **options).result())
    return out


def _on_real_group(script: str, *, world: int, **options) -> dict[int, dict]:
    """:func:`measure_script` on every rank of a real gloo group of ``world`` processes on this
    machine, started as torchrun starts them (torch's elastic launcher, c10d rendezvous on
    localhost) from the forkserver: rank -> its result."""
    import uuid

    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world,
                          run_id=f"measure-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
                          rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.05,
                          start_method="forkserver")
    got = elastic_launch(config, _real_rank)(script, options)
    return {d["rank"]: d for d in got.values()}


def _real_rank(script: str, options: dict) -> dict:
    return measure_script(script, real=True, **options)


if __name__ == "__main__":
    # by its own name: what the forked processes unpickle
    from autopar_nb.verify.measure import run_jobs as _run

    _run(sys.argv[1])
