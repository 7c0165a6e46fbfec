"""verify(source, plan): did parallelism change my model? (seed §5.3)

Runs the plan for real on ``nproc`` local processes (torch.distributed elastic launch; gloo on CPU, NCCL on GPUs)
and a single-process reference with the same seed and the same data, then reports per step the loss difference and
the largest gradient and parameter differences, relative to the largest reference value.

The reference reproduces the parallel run's arithmetic, not only its result: each data-parallel rank's batch
(``make_batch(step, rank)``) and each micro-batch is a separate forward/backward whose loss is scaled by
``1 / (dp * micro_batches)``, as DDP/FSDP averaging and pipeline schedules do (with SyncBatchNorm the ranks' batches
are concatenated, since the statistics span them).
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import uuid
from dataclasses import dataclass, field
from datetime import timedelta

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from .plan import Plan
from .source import ModelSource

FP32_RTOL = 1e-5
# bf16 keeps 8 significant bits: one rounding is up to 2**-8 = 3.9e-3 relative; the parallel run rounds partial
# sums in a different order (sharded matmuls, reductions across ranks), so a few roundings may add up: 2e-2.
LOW_PRECISION_RTOL = 2e-2


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
    """parameters of the reference with no gradient in the parallel run"""
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

    def _step_ok(self, s: StepDiff) -> bool:
        grad_ok = s.grad_rel <= self.rtol or (self.low_precision and s.step > 0)
        return s.loss_rel <= self.rtol and grad_ok and s.param_rel <= self.rtol + (s.step + 1) * self.param_floor

    @property
    def ok(self) -> bool:
        return not self.missing and all(self._step_ok(s) for s in self.steps)

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
        head = (f"verify {self.plan} on {self.nproc} processes: "
                f"{'OK' if self.ok else 'MISMATCH'} (rtol {self.rtol:g})")
        rows = [f"{'step':>4} {'loss':>12} {'reference':>12} {'|Δloss|':>10} {'rel':>9} "
                f"{'max|Δgrad|':>11} {'rel':>9} {'max|Δparam|':>12} {'rel':>9}"]
        for s in self.steps:
            rows.append(f"{s.step:>4} {s.loss:>12.6f} {s.ref_loss:>12.6f} {s.loss_diff:>10.2e} {s.loss_rel:>9.2e} "
                        f"{s.grad_max_diff:>11.2e} {s.grad_rel:>9.2e} {s.param_max_diff:>12.2e} {s.param_rel:>9.2e}")
        if self.param_floor:
            rows.append(f"parameters checked against rtol + {self.param_floor:.1e} per step (Adam: see param_floor)")
        if self.low_precision:
            rows.append("low precision: gradients judged at step 0 only (same weights there; see low_precision)")
        if self.missing:
            rows.append(f"no gradient in the parallel run for: {', '.join(self.missing)}")
        return "\n".join([head, *rows])

    def _repr_pretty_(self, p, cycle):
        p.text(str(self))


def verify(source: ModelSource, plan: Plan, *, steps: int = 5, nproc: int | None = None, seed: int = 0,
           rtol: float | None = None, meta_init: bool = False, start_method: str = "spawn") -> VerifyReport:
    """Run ``plan`` on ``nproc`` local processes and a single-process reference; compare ``steps`` steps.

    ``nproc`` defaults to the plan's world size (dp * tp * pp) and must equal it. ``meta_init`` builds the parallel
    model on the meta device and initialises it shard by shard (the path for models larger than host memory).
    """
    return verify_many([(source, plan)], steps=steps, nproc=nproc, seed=seed, rtol=rtol, meta_init=meta_init,
                       start_method=start_method)[0]


def verify_many(cases: list[tuple[ModelSource, Plan]], *, steps: int = 5, nproc: int | None = None, seed: int = 0,
                rtol: float | None = None, meta_init: bool | list[bool] = False, start_method: str = "spawn"
                ) -> list[VerifyReport]:
    """:func:`verify` for several (source, plan) pairs of the same world size in ONE launch of processes
    (starting processes costs seconds; running a small plan costs less). ``meta_init`` may be one flag per case."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if not cases:
        return []
    if nproc is None:
        nproc = cases[0][1].mesh.world_size
    for _, plan in cases:
        if plan.mesh.world_size != nproc:
            raise ValueError(f"plan {plan.summary()} needs {plan.mesh.world_size} processes, not nproc={nproc}; "
                             "verify plans of different world sizes in separate calls")
    metas = meta_init if isinstance(meta_init, list) else [meta_init] * len(cases)
    payload = [(src, plan.to_json(indent=None), meta) for (src, plan), meta in zip(cases, metas, strict=True)]
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"verify-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.05,
                          start_method=start_method)
    results = _restoring_signal_handlers(elastic_launch(config, _worker), payload, steps, seed)
    reports = []
    for i, (src, plan) in enumerate(cases):
        par = _merge([results[r][i] for r in sorted(results)])
        ref = reference(src, plan, steps=steps, seed=seed)
        tol = rtol if rtol is not None else (FP32_RTOL if plan.precision.amp == "none" else LOW_PRECISION_RTOL)
        report = _compare(plan, nproc, tol, par, ref)
        report.per_rank = [results[r][i]["info"] for r in sorted(results)]
        reports.append(report)
    return reports


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


def reference(source: ModelSource, plan: Plan, *, steps: int, seed: int = 0) -> dict:
    """The single-process run: losses, gradients and parameters at each step (see the module docstring)."""
    from .runtime.amp import autocast, grad_scaler
    from .runtime.data import concat_batches, split_batch
    from .runtime.train import OPTIMIZERS, build_namespace, optimizer_kwargs

    ns = build_namespace(source, plan, seed=seed)
    model, loss_fn, make_batch = ns[source.model_var], ns["__loss_fn"], ns["__make_batch"]
    model.train()
    o, p, dp, M = plan.optimizer, plan.precision, plan.mesh.dp, plan.batch.micro_batches
    optimizer = OPTIMIZERS[o.name](model.parameters(), **optimizer_kwargs(o.name, lr=o.lr,
                                                                          weight_decay=o.weight_decay, betas=o.betas))
    scaler = grad_scaler(p.amp, "cpu", init_scale=p.init_loss_scale, dynamic=p.dynamic_loss_scale,
                         growth_interval=p.growth_interval, sharded=False)
    out = {"losses": [], "grads": [], "params": []}
    for step in range(steps):
        per_rank = [split_batch(make_batch(step, r), M) for r in range(dp)]
        if plan.sync_batchnorm and dp > 1:
            pieces = [(concat_batches([b[m] for b in per_rank]), M) for m in range(M)]
        else:
            pieces = [(mb, M * dp) for b in per_rank for mb in b]
        total = 0.0
        for mb, k in pieces:
            with autocast(p.amp, "cpu"):
                loss = loss_fn(model, mb) / k
            (scaler.scale(loss) if scaler else loss).backward()
            total += loss.item()
        out["losses"].append(total)
        out["grads"].append({n: q.grad.detach().float().clone() for n, q in model.named_parameters()
                             if q.grad is not None})
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()
        out["params"].append({n: q.detach().float().clone() for n, q in model.named_parameters()})
    return out


@record
def _worker(payload: list[tuple[ModelSource, str, bool]], steps: int, seed: int) -> list[dict]:
    """One rank: run every plan in turn on one process group."""
    import torch.distributed as dist

    from .runtime.mesh import backend_for, build_mesh, device_type
    from .runtime.train import Trainer

    torch.set_num_threads(1)  # 2+ ranks on a few cores: more threads only oversubscribe
    device = device_type()
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend_for(device), timeout=timedelta(seconds=300))
    results = []
    try:
        for source, plan_json, meta_init in payload:
            plan = Plan.from_json(plan_json)
            m = plan.mesh
            mesh = build_mesh(m.pp, m.dp, m.tp, device=device)
            trainer = Trainer(source, plan, mesh, seed=seed, device=device, meta_init=meta_init)
            reporter = trainer.dp_rank == 0 and trainer.tp_rank == 0
            res = {"losses": [], "grads": [], "params": []}
            for step in range(steps):
                local = trainer.forward_backward(step)
                res["losses"].append(trainer.global_loss(local))
                grads = trainer.named_tensors("grad")
                trainer.optimizer_step()
                params = trainer.named_tensors("param")
                if reporter:
                    res["grads"].append(grads)
                    res["params"].append(params)
            res["info"] = _rank_info(trainer)
            results.append(res)
            del trainer
            gc.collect()
    finally:
        gc.collect()  # a gloo thread taking the GIL during shutdown aborts ~20% of exits otherwise
        dist.destroy_process_group()
    return results


def _rank_info(trainer) -> dict:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.tensor import DTensor

    params = [p for part in trainer.parts for p in part.parameters()]
    return {
        "local_numel": sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params),
        "dtensor_params": sum(isinstance(p, DTensor) for p in params),
        "checkpointed": sum(isinstance(m, CheckpointWrapper) for part in trainer.parts for m in part.modules()),
        "stages": list(trainer.pm.stage_ids),
    }


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
            diff = max(diff, (par[name] - r).abs().max().item())
            scale = max(scale, r.abs().max().item())
    return diff, diff / max(scale, 1e-12)


def _compare(plan: Plan, nproc: int, rtol: float, par: dict, ref: dict) -> VerifyReport:
    report = VerifyReport(plan=plan.summary(), nproc=nproc, rtol=rtol)
    if plan.optimizer.name in ("adam", "adamw") and ref["params"]:
        scale = max(t.abs().max().item() for t in ref["params"][0].values())
        report.param_floor = 2 * plan.optimizer.lr / max(scale, 1e-12)
    report.low_precision = plan.precision.amp != "none"
    report.missing = sorted(set(ref["grads"][0]) - set(par["grads"][0])) if ref["grads"] else []
    for s, (lp, lr) in enumerate(zip(par["losses"], ref["losses"], strict=True)):
        gd, gr = _max_diff(par["grads"][s], ref["grads"][s])
        pd, pr = _max_diff(par["params"][s], ref["params"][s])
        report.steps.append(StepDiff(step=s, loss=lp, ref_loss=lr, grad_max_diff=gd, grad_rel=gr,
                                     param_max_diff=pd, param_rel=pr))
    return report
