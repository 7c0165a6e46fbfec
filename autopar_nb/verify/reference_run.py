"""The single-process reference verify holds a plan's run to: the model as the cell wrote it, with
the exported script's data, loss, precision, learning-rate schedule and clipping
(:func:`reference`), and its gradients at the parallel run's own parameters
(:func:`same_parameter_grads`).

It reproduces the parallel run's arithmetic, not only its result: each data-parallel rank's batch
(``make_batch(step, rank)``) and each micro-batch is a separate forward/backward whose loss is
scaled by ``1 / (dp * micro_batches)``, as DDP/FSDP averaging and pipeline schedules do (with
SyncBatchNorm the ranks' batches are concatenated, since the statistics span them).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ..export.values import ScriptValues, script_values
from ..plan import DTYPE_NAMES, Plan
from ..randomness import RandomOff
from ..source import ModelSource


@dataclass
class _Reference:
    """The single-process model with the script's data, loss and precision (what :func:`reference`
    trains and :func:`same_parameter_grads` re-runs)."""

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
        device = device_type(
        )  # the ranks' device type: CPU and GPU kernels differ by more than the tolerance
        exact_fp32()
        # built on the CPU with the seed, as the ranks build it, then moved
        model = ns[source.model_var].to(device)
        model.train()
        switch_off_kv_cache(model)  # as the script does
        d, p, dp = values.defaults, plan.precision, plan.mesh.dp
        loss_fn = ns[source.loss_fn_var] if source.loss_fn_var else functools.partial(
            default_loss, causal=d["causal"])
        if source.make_batch_var:
            make_batch = ns[source.make_batch_var]
        # each data-parallel rank's stream, as the script reads it (in this process)
        elif values.dataset:
            streams = [DataStream(ns[source.dataset_var], batch_size=d["batch_size"], dp=dp,
                                  dp_rank=r, seed=seed, collate_fn=ns[source.collate_fn_var]
                                  if values.collate_fn else None)
                       for r in range(dp)]
            make_batch = lambda step, r: streams[r](step, r)
        else:
            make_batch = functools.partial(synthetic_batch, ns[source.inputs_var],
                                           batch_size=d["batch_size"], int_high=d["int_high"])
        amp_dtype = getattr(torch, DTYPE_NAMES[p.amp]) if p.amp != "none" else None
        op_lists = (functools.partial(OpPrecision, device, amp_dtype, fp32_ops=p.fp32_ops,
                                      low_precision_ops=p.low_precision_ops)
                    if p.fp32_ops or p.low_precision_ops else None)
        return cls(plan, model, make_batch, loss_fn, device, amp_dtype, op_lists, RandomOff(model))

    def pieces(self, step: int) -> list:
        """(micro-batch, divisor) of every data-parallel rank's micro-batches at ``step``, as the
        ranks run them."""
        from ..runtime.data import concat_batches, split_batch

        dp, M = self.plan.mesh.dp, self.plan.batch.micro_batches
        per_rank = [split_batch(self.make_batch(step, r), M) for r in range(dp)]
        if self.plan.sync_batchnorm and dp > 1:
            return [(concat_batches([b[m] for b in per_rank]), M) for m in range(M)]
        return [(mb, M * dp) for b in per_rank for mb in b]

    def backward(self, pieces: list, scale=None) -> float:
        """Forward and backward of every piece (the loss passed through ``scale`` when given:
        GradScaler's ``scale``, or a multiplication by a recorded loss scale); returns the step's
        loss."""
        from ..runtime.amp import step_context
        from ..runtime.data import to_device

        total = 0.0
        with self.random:  # as the ranks run (ranks.worker)
            for mb, k in pieces:
                with step_context(self.device, amp_dtype=self.amp_dtype, op_lists=self.op_lists):
                    loss = self.loss_fn(self.model, to_device(mb, self.device)) / k
                (scale(loss) if scale is not None else loss).backward()
                total += loss.item()
        return total

    def grads(self) -> dict[str, torch.Tensor]:
        return {n: q.grad.detach().float().cpu().clone() for n, q in self.model.named_parameters()
                if q.grad is not None}


def reference(source: ModelSource, plan: Plan, *, steps: int, seed: int = 0,
              values: ScriptValues | None = None) -> dict:
    """The single-process run, with the script's data, loss, learning-rate schedule and clipping:
    losses, gradients and parameters at each step, and the loss scale each step's backward used (see
    the module docstring)."""
    from ..runtime.amp import grad_scaler
    from ..runtime.optim import build_optimizer, clip_grad_norm, lr_factor

    ref = _Reference.build(source, plan, seed, values or script_values(source, plan, seed=seed))
    o, p, model = plan.optimizer, plan.precision, ref.model
    optimizer = build_optimizer(list(model.parameters()), o.name, lr=o.lr,
                                weight_decay=o.weight_decay, betas=o.betas)
    scaler = grad_scaler(ref.device, init_scale=p.init_loss_scale, dynamic=p.dynamic_loss_scale,
                         growth_interval=p.growth_interval,
                         sharded=False) if p.amp == "fp16" else None
    out = {"losses": [], "grads": [], "params": [], "scales": []}
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = o.lr * lr_factor(step, warmup=o.warmup_steps, total=steps,
                                           schedule=o.lr_schedule, min_ratio=o.min_lr_ratio)
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
        out["params"].append({n: q.detach().float().cpu().clone()
                              for n, q in model.named_parameters()})
    out["random_off"], out["random_left"] = ref.random.counts()
    return out


def same_parameter_grads(
        source: ModelSource, plan: Plan, params: list[dict[str, torch.Tensor]], *, seed: int = 0,
        values: ScriptValues | None = None,
        scales: list[float | None] | None = None) -> list[dict[str, torch.Tensor] | None]:
    """The reference's gradients at the PARALLEL run's parameters: for each step k >= 1, the
    single-process gradients of step k's batch at ``params[k - 1]`` (the parallel run's parameters
    after step k - 1, where its own step-k gradients were taken), with the loss scale ``scales[k]``;
    None for step 0, where both runs start from the same parameters anyway. Gradients at the same
    parameters are comparable at every step, however far the two runs' parameters have drifted apart
    by round-off."""
    ref = _Reference.build(source, plan, seed, values or script_values(source, plan, seed=seed))
    own = dict(ref.model.named_parameters())
    out: list = [None]
    ref.pieces(0)  # step 0's batches are made too: a data stream advances with each call
    for step in range(1, len(params)):
        pieces, teacher = ref.pieces(step), params[step - 1]
        # a parameter the parallel run did not report: not comparable
        if any(n not in teacher for n in own):
            out.append(None)
            continue
        with torch.no_grad():
            for n, q in own.items():
                q.copy_(teacher[n].to(q.device, q.dtype))
        ref.model.zero_grad(set_to_none=True)
        factor = scales[step] if scales else None
        ref.backward(pieces,
                     functools.partial(torch.mul, other=factor) if factor is not None else None)
        out.append(ref.grads())
    return out
