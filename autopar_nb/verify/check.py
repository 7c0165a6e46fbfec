"""Verify's machinery: the plan's exported script on ranks started from this process, the
single-process reference, and the comparison. :mod:`autopar_nb.verify` is the entry point; the warm pool's verify
standby (``verify/job.py``) runs the same functions in its own process.

Each rank runs the exported script's top level and calls its ``main``, with an observer (set on the script's runtime
module, whose ``train`` calls it) that collects the loss, the full gradients and the full parameters of every step;
the single-process reference uses the same seed, data, learning-rate schedule and clipping; the report gives per
step the loss difference and the largest gradient and parameter differences, relative to the largest reference
value. Every random op of the model's forward is switched off in both runs (:mod:`autopar_nb.randomness`: the ranks
would draw other masks than the reference); the report says which. After the parallel run, the reference also takes
each later step's gradients at the parallel run's own parameters (:func:`same_parameter_grads`): the two runs'
parameters drift apart by round-off (Adam turns round-off in near-zero gradients into updates of up to ``lr``), so
gradients at the same parameters are what can be held to ``rtol`` at every step.

The reference reproduces the parallel run's arithmetic, not only its result: each data-parallel rank's batch
(``make_batch(step, rank)``) and each micro-batch is a separate forward/backward whose loss is scaled by
``1 / (dp * micro_batches)``, as DDP/FSDP averaging and pipeline schedules do (with SyncBatchNorm the ranks' batches
are concatenated, since the statistics span them).
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import os
import signal
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record

from ..export import export, run_script
from ..export.values import ScriptValues, script_values
from ..failures import RankFailed
from ..plan import DTYPE_NAMES, Plan
from ..randomness import RandomOff
from ..source import ModelSource

FP32_RTOL = 1e-5
# bf16 keeps 8 significant bits: one rounding is up to 2**-8 = 3.9e-3 relative; the parallel run rounds partial
# sums in a different order (sharded matmuls, reductions across ranks), so a few roundings may add up: 2e-2.
LOW_PRECISION_RTOL = 2e-2
# float8 matmuls keep 3 (e4m3) or 2 (e5m2) significant bits: torchao's own tests hold a float8 LLaMA feed-forward's
# output and gradients to an SQNR above 20 dB against bf16 (test/float8/test_numerics_integration.py), an error of
# 10 % of the signal
FLOAT8_RTOL = 0.1


@dataclass
class StepDiff:
    """Differences at one training step (relative values are divided by the largest reference magnitude)."""

    step: int
    loss: float
    ref_loss: float
    grad_max_diff: float
    grad_rel: float
    param_max_diff: float
    """after the optimizer step"""
    param_rel: float
    grad_same_rel: float | None = None
    """the parallel run's gradients against the reference's at the parallel run's own parameters (the same
    parameters: :func:`same_parameter_grads`); None at step 0 (same parameters anyway) or where not computed"""

    @property
    def loss_diff(self) -> float:
        return abs(self.loss - self.ref_loss)

    @property
    def loss_rel(self) -> float:
        return self.loss_diff / max(abs(self.ref_loss), 1e-12)


@dataclass
class VerifyReport:
    """Result of :func:`verify`: print it for a table; ``ok`` says whether every step is within ``rtol``."""

    plan: str
    nproc: int
    rtol: float
    steps: list[StepDiff] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    """parameters of the reference with no gradient in the parallel run (at any step)"""
    per_rank: list[dict] = field(default_factory=list)
    """what each rank held: ``local_numel`` (parameter elements stored there), ``dtensor_params`` (parameters
    sharded/replicated as DTensors), ``checkpointed`` (checkpoint-wrapped modules), ``stages`` (pipeline stages)"""

    param_floor: float = 0.0
    """extra parameter tolerance per step, relative: Adam-type optimizers divide each gradient element by its running
    RMS, so an element whose gradient is at rounding level (about Adam's eps, or bf16's resolution) moves by ``+lr``
    or ``-lr`` whichever way it rounds; such a difference says nothing about the model. ``2 * lr / max|param|`` per
    step for adam/adamw, else 0."""
    low_precision: bool = False
    """bf16/fp16: gradients are judged at the first step only, where both runs start from the same weights; after an
    update the weights differ by the rounding above and so do later gradients (the losses are still judged)"""
    random_off: list[str] = field(default_factory=list)
    """random ops of one forward switched off in both runs ("2 x dropout p=0.1 (h.0.attn)"): the ranks would draw
    other masks than the reference (:mod:`autopar_nb.randomness`)"""
    random_left: list[str] = field(default_factory=list)
    """random ops of one forward that could not be switched off ("1 x randint (Net)"): the runs draw them apart"""

    def judge(self, s: StepDiff) -> tuple[bool, str]:
        """Whether step ``s`` agrees, and the rule it was judged by:

        * ``rtol``: loss, gradients and parameters within ``rtol``;
        * ``adam``: parameters within ``rtol`` plus ``param_floor`` per step so far; gradients at step 0 within
          ``rtol`` (both runs start from the same parameters), later ones within ``rtol`` plus what the parameters
          were allowed to differ by at the step before (``rtol + step * param_floor``). The runs' parameters differ
          after a step because Adam turns round-off in near-zero gradients into updates of up to ``lr``; gradients at
          different parameters differ by about as much in smooth models, and by more where an activation is not
          smooth (a ReLU unit whose pre-activation crosses zero for one sample switches that sample's contribution,
          about ``1 / batch`` of the gradient), so later gradients get the parameters' allowance, not their
          measured difference. The loss stays within ``rtol`` at every step;
        * ``low precision``: loss and parameters as above; gradients at step 0 only;
        * ``same params`` (whenever :func:`same_parameter_grads` was computed, as verify does): loss and parameters
          as above, and the gradients of every step after the first within ``rtol`` of the reference's gradients at
          the parallel run's own parameters — the allowances above are then needed for the parameters only.
        """
        prev = self.rtol + s.step * self.param_floor if s.step > 0 else 0.0  # the allowed parameter difference
        param_ok = s.param_rel <= self.rtol + (s.step + 1) * self.param_floor
        if not s.loss_rel <= self.rtol or not param_ok:  # (a NaN loss fails)
            return False, "rtol"
        if s.grad_same_rel is not None:  # gradients at the same parameters: rtol at every step
            return s.grad_same_rel <= self.rtol, "same params"
        if s.grad_rel <= self.rtol and s.param_rel <= self.rtol:
            return True, "rtol"
        if self.low_precision:
            return s.step > 0 or s.grad_rel <= self.rtol, "low precision"
        return s.grad_rel <= self.rtol + (prev if self.param_floor else 0.0), "adam" if self.param_floor else "rtol"

    @property
    def ok(self) -> bool:
        return not self.missing and all(self.judge(s)[0] for s in self.steps)

    @property
    def max_loss_rel(self) -> float:
        return max(s.loss_rel for s in self.steps)

    @property
    def max_grad_rel(self) -> float:
        return max(s.grad_rel for s in self.steps)

    @property
    def max_param_rel(self) -> float:
        return max(s.param_rel for s in self.steps)

    @property
    def losses(self) -> list[float]:
        """The parallel run's loss at each step."""
        return [s.loss for s in self.steps]

    def __str__(self) -> str:
        left = (f"random ops verify could not switch off ran in the forward: {', '.join(self.random_left)}; the two "
                "runs draw them differently") if self.random_left else ""
        first = [f"{left}, so this mismatch may come from them rather than from the plan"] if left and not self.ok \
            else []
        head = (f"verify {self.plan} on {self.nproc} processes: "
                f"{'OK' if self.ok else 'MISMATCH'} (rtol {self.rtol:g})")
        rows = [f"{'step':>4} {'loss':>12} {'reference':>12} {'|Δloss|':>10} {'rel':>9} "
                f"{'max|Δgrad|':>11} {'rel':>9} {'same-param':>10} {'max|Δparam|':>12} {'rel':>9}  rule"]
        for s in self.steps:
            ok, rule = self.judge(s)
            same = f"{s.grad_same_rel:>10.2e}" if s.grad_same_rel is not None else f"{'-':>10}"
            rows.append(f"{s.step:>4} {s.loss:>12.6f} {s.ref_loss:>12.6f} {s.loss_diff:>10.2e} {s.loss_rel:>9.2e} "
                        f"{s.grad_max_diff:>11.2e} {s.grad_rel:>9.2e} {same} {s.param_max_diff:>12.2e} "
                        f"{s.param_rel:>9.2e}  {rule}{'' if ok else ' FAILED'}")
        if any(s.grad_same_rel is not None for s in self.steps):
            rows.append("same-param: gradients after step 0 against the reference's at the parallel run's own "
                        "parameters, judged at rtol")
        if self.param_floor:
            what = "parameters" if any(s.grad_same_rel is not None for s in self.steps) else \
                "parameters, and gradients after step 0,"
            rows.append(f"{what} checked against rtol + {self.param_floor:.1e} per step (Adam: see param_floor)")
        if self.low_precision:
            rows.append("low precision: gradients judged at step 0 only (same weights there; see low_precision)")
        if self.random_off:
            rows.append(f"random ops switched off in both runs (per forward): {', '.join(self.random_off)}")
        if left and self.ok:
            rows.append(left)
        if self.missing:
            rows.append(f"no gradient in the parallel run for: {', '.join(self.missing)}")
        return "\n".join([*first, head, *rows])

    def _repr_pretty_(self, p, cycle):
        p.text(str(self))




def export_scripts(cases: list[tuple[ModelSource, Plan]], metas: list[bool], directory: str | os.PathLike, *,
                   steps: int, seed: int) -> list[str]:
    """Each case's exported script, written to ``directory`` (``verify_<i>.py``)."""
    return [str(export(src, plan, Path(directory) / f"verify_{i}.py", steps=steps, seed=seed, meta_init=meta,
                       quiet=True).script)
            for i, ((src, plan), meta) in enumerate(zip(cases, metas, strict=True))]


def cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def verify_here(cases: list[tuple[ModelSource, Plan]], metas: list[bool], scripts: list[str], *, steps: int,
                nproc: int, seed: int, rtol: float | None, start_method: str) -> list[VerifyReport]:
    """The parallel run of ``scripts`` on ``nproc`` ranks started from this process (torch elastic,
    ``start_method``), and the single-process reference in this process: in a thread beside the ranks when a core
    is left over for it (the ranks take one each), else after them."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"verify-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.05,
                          start_method=start_method)
    jobs = [(script, src.model_var, plan.to_json(indent=None)) for script, (src, plan) in zip(scripts, cases,
                                                                                               strict=True)]
    values = [script_values(src, plan, seed=seed, meta_init=meta) for (src, plan), meta in zip(cases, metas,
                                                                                              strict=True)]
    refs: list = []
    errors: list = []

    def run_references():
        try:
            refs.extend(reference(src, plan, steps=steps, seed=seed, values=v) for (src, plan), v in zip(cases, values,
                                                                                                          strict=True))
        except BaseException as e:  # raised in the calling thread below
            errors.append(e)

    spare = cores() - nproc
    thread = None
    if spare >= 1:
        threads = torch.get_num_threads()
        torch.set_num_threads(spare)
        thread = threading.Thread(target=run_references, daemon=True, name="autopar-verify-reference")
        thread.start()
    try:
        results = _restoring_signal_handlers(elastic_launch(config, _worker), jobs, steps)
    except ChildFailedError as e:
        raise RankFailed.of(e, [src for src, _ in cases]) from None
    finally:
        if thread is not None:
            thread.join()
            torch.set_num_threads(threads)
    if thread is None:
        run_references()
    if errors:
        raise errors[0]
    reports = []
    for i, (src, plan) in enumerate(cases):
        par = _merge([results[r][i] for r in sorted(results)])
        ref = refs[i]
        ref["same_grads"] = same_parameter_grads(src, plan, par["params"], seed=seed, values=values[i],
                                                 scales=ref["scales"])
        tol = rtol if rtol is not None else default_rtol(plan)
        report = _compare(plan, nproc, tol, par, ref)
        report.per_rank = [results[r][i]["info"] for r in sorted(results)]
        report.random_off, report.random_left = ref["random_off"], ref["random_left"]
        reports.append(report)
    return reports


def default_rtol(plan: Plan) -> float:
    """The tolerance a plan's run is held to against the single-process reference, which runs the model as the cell
    wrote it (no float8): float32's, autocast's, or float8's (:data:`FLOAT8_RTOL`)."""
    p = plan.precision
    return FLOAT8_RTOL if p.float8 != "none" else FP32_RTOL if p.amp == "none" else LOW_PRECISION_RTOL


def _restoring_signal_handlers(fn, *args):
    # the elastic launcher installs SIGTERM/SIGINT/SIGHUP/SIGQUIT handlers in the calling process and leaves them;
    # in a notebook kernel they would later turn the kernel's own shutdown into a SignalException traceback
    names = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    saved = {n: signal.getsignal(getattr(signal, n)) for n in names if hasattr(signal, n)}
    try:
        return fn(*args)
    finally:
        if threading.current_thread() is threading.main_thread():
            for n, handler in saved.items():
                signal.signal(getattr(signal, n), handler)


def kernel_cwd() -> str:
    """This process's working directory, where a verify's ranks and reference run (the notebook's folder: the cell's
    relative paths hold there, as under launch). Raises RuntimeError, saying what to do, when it was deleted."""
    try:
        return os.getcwd()
    except FileNotFoundError:
        raise RuntimeError("this kernel's working directory was deleted, so verify's processes would have none to "
                           "run in: os.chdir() to an existing directory (the one the cell's relative paths are "
                           "relative to) and verify again") from None


@dataclass
class _Reference:
    """The single-process model with the script's data, loss and precision (what :func:`reference` trains and
    :func:`same_parameter_grads` re-runs)."""

    plan: Plan
    model: nn.Module
    make_batch: Any
    loss_fn: Any
    device: str
    amp_dtype: Any
    op_lists: Any
    random: RandomOff
    """switches the model's random ops off in every forward :meth:`backward` runs"""

    @classmethod
    def build(cls, source: ModelSource, plan: Plan, seed: int, values: ScriptValues) -> _Reference:
        from ..runtime.amp import OpPrecision, exact_fp32
        from ..runtime.data import DataStream, default_loss, synthetic_batch
        from ..runtime.mesh import device_type
        from ..runtime.train import switch_off_kv_cache

        ns = source.run(seed=seed)
        device = device_type()  # the ranks' device type: CPU and GPU kernels differ by more than the tolerance
        exact_fp32()
        model = ns[source.model_var].to(device)  # built on the CPU with the seed, as the ranks build it, then moved
        model.train()
        switch_off_kv_cache(model)  # as the script does
        d, p, dp = values.defaults, plan.precision, plan.mesh.dp
        loss_fn = ns[source.loss_fn_var] if source.loss_fn_var else functools.partial(default_loss,
                                                                                      causal=d["causal"])
        if source.make_batch_var:
            make_batch = ns[source.make_batch_var]
        elif values.dataset:  # each data-parallel rank's stream, as the script reads it (in this process)
            streams = [DataStream(ns[source.dataset_var], batch_size=d["batch_size"], dp=dp, dp_rank=r, seed=seed,
                                  collate_fn=ns[source.collate_fn_var] if values.collate_fn else None)
                       for r in range(dp)]
            make_batch = lambda step, r: streams[r](step, r)
        else:
            make_batch = functools.partial(synthetic_batch, ns[source.inputs_var], batch_size=d["batch_size"],
                                           int_high=d["int_high"])
        amp_dtype = getattr(torch, DTYPE_NAMES[p.amp]) if p.amp != "none" else None
        op_lists = functools.partial(OpPrecision, device, amp_dtype, fp32_ops=p.fp32_ops,
                                     low_precision_ops=p.low_precision_ops) if p.fp32_ops or p.low_precision_ops \
            else None
        return cls(plan, model, make_batch, loss_fn, device, amp_dtype, op_lists, RandomOff(model))

    def pieces(self, step: int) -> list:
        """(micro-batch, divisor) of every data-parallel rank's micro-batches at ``step``, as the ranks run them."""
        from ..runtime.data import concat_batches, split_batch

        dp, M = self.plan.mesh.dp, self.plan.batch.micro_batches
        per_rank = [split_batch(self.make_batch(step, r), M) for r in range(dp)]
        if self.plan.sync_batchnorm and dp > 1:
            return [(concat_batches([b[m] for b in per_rank]), M) for m in range(M)]
        return [(mb, M * dp) for b in per_rank for mb in b]

    def backward(self, pieces: list, scale=None) -> float:
        """Forward and backward of every piece (the loss passed through ``scale`` when given: GradScaler's
        ``scale``, or a multiplication by a recorded loss scale); returns the step's loss."""
        from ..runtime.amp import step_context
        from ..runtime.data import to_device

        total = 0.0
        with self.random:  # as the ranks run (_worker)
            for mb, k in pieces:
                with step_context(self.device, amp_dtype=self.amp_dtype, op_lists=self.op_lists):
                    loss = self.loss_fn(self.model, to_device(mb, self.device)) / k
                (scale(loss) if scale is not None else loss).backward()
                total += loss.item()
        return total

    def grads(self) -> dict[str, torch.Tensor]:
        return {n: q.grad.detach().float().cpu().clone() for n, q in self.model.named_parameters()
                if q.grad is not None}


def reference(source: ModelSource, plan: Plan, *, steps: int, seed: int = 0, values: ScriptValues | None = None
              ) -> dict:
    """The single-process run, with the script's data, loss, learning-rate schedule and clipping: losses, gradients
    and parameters at each step, and the loss scale each step's backward used (see the module docstring)."""
    from ..runtime.amp import grad_scaler
    from ..runtime.optim import build_optimizer, clip_grad_norm, lr_factor

    ref = _Reference.build(source, plan, seed, values or script_values(source, plan, seed=seed))
    o, p, model = plan.optimizer, plan.precision, ref.model
    optimizer = build_optimizer(list(model.parameters()), o.name, lr=o.lr, weight_decay=o.weight_decay, betas=o.betas)
    scaler = grad_scaler(ref.device, init_scale=p.init_loss_scale, dynamic=p.dynamic_loss_scale,
                         growth_interval=p.growth_interval, sharded=False) if p.amp == "fp16" else None
    out = {"losses": [], "grads": [], "params": [], "scales": []}
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = o.lr * lr_factor(step, warmup=o.warmup_steps, total=steps, schedule=o.lr_schedule,
                                           min_ratio=o.min_lr_ratio)
        out["scales"].append(scaler.get_scale() if scaler else None)
        out["losses"].append(ref.backward(ref.pieces(step), scaler.scale if scaler else None))
        out["grads"].append(ref.grads())
        if scaler:
            scaler.unscale_(optimizer)
        if o.grad_clip:
            clip_grad_norm(list(model.parameters()), o.grad_clip)
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()
        out["params"].append({n: q.detach().float().cpu().clone() for n, q in model.named_parameters()})
    out["random_off"], out["random_left"] = ref.random.counts()
    return out


def same_parameter_grads(source: ModelSource, plan: Plan, params: list[dict[str, torch.Tensor]], *, seed: int = 0,
                         values: ScriptValues | None = None, scales: list[float | None] | None = None
                         ) -> list[dict[str, torch.Tensor] | None]:
    """The reference's gradients at the PARALLEL run's parameters: for each step k >= 1, the single-process
    gradients of step k's batch at ``params[k - 1]`` (the parallel run's parameters after step k - 1, where its own
    step-k gradients were taken), with the loss scale ``scales[k]``; None for step 0, where both runs start from the
    same parameters anyway. Gradients at the same parameters are comparable at every step, however far the two
    runs' parameters have drifted apart by round-off."""
    ref = _Reference.build(source, plan, seed, values or script_values(source, plan, seed=seed))
    own = dict(ref.model.named_parameters())
    out: list = [None]
    ref.pieces(0)  # step 0's batches are made too: a data stream advances with each call
    for step in range(1, len(params)):
        pieces, teacher = ref.pieces(step), params[step - 1]
        if any(n not in teacher for n in own):  # a parameter the parallel run did not report: not comparable
            out.append(None)
            continue
        with torch.no_grad():
            for n, q in own.items():
                q.copy_(teacher[n].to(q.device, q.dtype))
        ref.model.zero_grad(set_to_none=True)
        factor = scales[step] if scales else None
        ref.backward(pieces, functools.partial(torch.mul, other=factor) if factor is not None else None)
        out.append(ref.grads())
    return out


class Recorder:
    """The observer verify hands to the script's ``main``: after each backward the loss and the full gradients,
    after each optimizer step the full parameters (DTensors gathered: every rank takes part). Only the ranks at
    data-parallel and tensor-parallel index 0 keep them (one per pipeline stage). Expert parallelism splits the dp
    dim into (dp_mod_ep, ep) without reordering ranks, so the dp index stays ``(rank // tp) % dp``; the experts,
    DTensors over their ep ranks, are gathered like any other."""

    def __init__(self, plan: Plan, rank: int):
        m, self.plan = plan.mesh, plan
        self.keeps = (rank // m.tp) % m.dp == 0 and rank % m.tp == 0
        self.result: dict = {"losses": [], "grads": [], "params": [], "info": {}}

    def after_backward(self, step: int, parts: list, loss: float) -> None:
        self.result["losses"].append(loss)
        grads = named_tensors(parts, "grad")
        if self.keeps:
            self.result["grads"].append(grads)

    def after_step(self, step: int, parts: list) -> None:
        params = named_tensors(parts, "param")
        if self.keeps:
            self.result["params"].append(params)
        self.result["info"] = rank_info(parts, self.plan)


def named_tensors(parts: list, what: str) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters or gradients of this rank's parts, by the names of the single-process model.
    Collective: every rank of the mesh calls it (CPU offload's host shards are reduced on the mesh's device)."""
    from torch.distributed.tensor import DTensor

    from ..runtime.fsdp import on_mesh_device
    from ..runtime.init import canonical_name

    named = [(n, p.grad if what == "grad" else p.detach()) for part in parts for n, p in part.named_parameters()]
    return {canonical_name(n): (on_mesh_device(t).full_tensor() if isinstance(t, DTensor) else t).detach().float()
            .cpu().clone() for n, t in named if t is not None}


def rank_info(parts: list, plan: Plan) -> dict:
    """What this rank holds: ``local_numel`` (parameter elements stored here), ``dtensor_params`` (parameters
    sharded/replicated as DTensors), ``checkpointed`` (checkpoint-wrapped modules), ``stages`` (the pipeline stages
    whose first layer one of its parts holds), ``offloaded`` (FSDP units under ``CPUOffloadPolicy``)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
    from torch.distributed.tensor import DTensor

    from ..runtime.init import canonical_name

    params = [p for part in parts for p in part.parameters()]
    names = [canonical_name(n) for part in parts for n, _ in part.named_parameters()]
    firsts = [layers[0] for layers in plan.stage_layers()] if plan.mesh.pp > 1 else []
    return {
        "local_numel": sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params),
        "dtensor_params": sum(isinstance(p, DTensor) for p in params),
        "checkpointed": sum(isinstance(m, CheckpointWrapper) for part in parts for m in part.modules()),
        "stages": [i for i, first in enumerate(firsts) if any(n.startswith(first + ".") for n in names)],
        "offloaded": sum(isinstance(getattr(m._get_fsdp_state()._fsdp_param_group, "offload_policy", None),
                                    CPUOffloadPolicy) for part in parts for m in part.modules()
                         if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_group)}


def script_argv(ns: dict, steps: int) -> list[str]:
    """The flags verify runs an exported script with (``ns``: its namespace): ``steps`` steps, and for a script that
    reads the cell's dataset no DataLoader worker processes (``--num-workers 0``): the reference reads the samples
    in-process, and workers forked from every rank would only add start-up time and processes to a short check."""
    return ["--steps", str(steps)] + (["--num-workers", "0"] if "DataStream" in ns else [])


@record
def _worker(jobs: list[tuple[str, str, str]], steps: int) -> list[dict]:
    """One rank: import each exported script and run its ``main`` with a :class:`Recorder`, its model's random ops
    switched off as in the reference; every script shares one process group."""
    import gc

    import torch.distributed as dist

    from ..runtime.amp import exact_fp32
    from ..runtime.mesh import init_distributed

    torch.set_num_threads(1)  # 2+ ranks on a few cores: more threads only oversubscribe
    exact_fp32()  # as the reference: no TF32 on a GPU
    results = []
    init_distributed(timeout_s=300)  # one group for every script (each main() finds it and leaves it open)
    try:
        for script, _, plan_json in jobs:
            ns, runtime = run_script(script, run_name="__autopar_verify__")
            recorder = Recorder(Plan.from_json(plan_json), int(os.environ["RANK"]))
            runtime.Run.observer = recorder  # train() calls it on every rank
            # active in module forwards only: meta_init's initialisation and the batches keep their randomness
            with RandomOff(), contextlib.redirect_stdout(io.StringIO()):  # the script's per-step lines
                ns["main"](script_argv(ns, steps))
            results.append(recorder.result)
            del ns, runtime
            gc.collect()
    finally:
        gc.collect()  # a gloo thread taking the GIL during shutdown aborts ~20% of exits otherwise
        if dist.is_initialized():
            dist.destroy_process_group()
    return results


def _merge(per_rank: list[dict]) -> dict:
    out = {"losses": per_rank[0]["losses"], "grads": [], "params": []}
    steps = len(out["losses"])
    for key in ("grads", "params"):
        for s in range(steps):
            merged: dict = {}
            for r in per_rank:
                if r[key]:
                    merged.update(r[key][s])
            out[key].append(merged)
    return out


def _max_diff(par: dict, ref: dict) -> tuple[float, float]:
    diff = scale = 0.0
    for name, r in ref.items():
        if name in par:
            d = (par[name] - r).abs().max().item()
            diff = max(diff, math.inf if math.isnan(d) else d)  # max() would pass over a NaN
            scale = max(scale, r.abs().max().item())
    return diff, diff / max(scale, 1e-12)


def _compare(plan: Plan, nproc: int, rtol: float, par: dict, ref: dict) -> VerifyReport:
    report = VerifyReport(plan=plan.summary(), nproc=nproc, rtol=rtol)
    if plan.optimizer.name in ("adam", "adamw") and ref["params"]:
        scale = max(t.abs().max().item() for t in ref["params"][0].values())
        report.param_floor = 2 * plan.optimizer.lr / max(scale, 1e-12)
    report.low_precision = plan.precision.amp != "none"
    # at every step: a gradient dropped after the first is not compared (_max_diff passes over it)
    steps = zip(ref["grads"], par["grads"], strict=False)
    report.missing = sorted({n for r, q in steps for n in set(r) - set(q)})
    same = ref.get("same_grads") or []
    for s, (lp, lr) in enumerate(zip(par["losses"], ref["losses"], strict=True)):
        gd, gr = _max_diff(par["grads"][s], ref["grads"][s])
        pd, pr = _max_diff(par["params"][s], ref["params"][s])
        forced = same[s] if s < len(same) else None
        report.steps.append(StepDiff(step=s, loss=lp, ref_loss=lr, grad_max_diff=gd, grad_rel=gr,
                                     param_max_diff=pd, param_rel=pr,
                                     grad_same_rel=_max_diff(par["grads"][s], forced)[1] if forced else None))
    return report
