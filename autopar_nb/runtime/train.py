"""One training step of a plan on this rank: data, forward/backward or pipeline schedule, optimizer.

Used by :func:`autopar_nb.verify`; the exported script writes the same steps out as plain code.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from ..plan import Plan
from ..source import ModelSource
from .amp import autocast, grad_scaler
from .apply import ParallelModel, apply_plan
from .data import add_default_data_loss, concat_batches, default_constants, model_call, split_batch, tree_map
from .ddp import zero1_optimizer
from .init import canonical_name, materialize
from .pp import build_schedule

OPTIMIZERS = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


def optimizer_kwargs(name: str, *, lr: float, weight_decay: float, betas: tuple[float, float]) -> dict[str, Any]:
    """Keyword arguments of ``OPTIMIZERS[name]`` for the plan's optimizer settings."""
    if name == "sgd":
        return {"lr": lr, "weight_decay": weight_decay}
    return {"lr": lr, "weight_decay": weight_decay, "betas": tuple(betas)}


def build_namespace(source: ModelSource, plan: Plan, *, seed: int, device: Any = None) -> dict[str, Any]:
    """Run the cell (with ``seed``) and make sure it defines ``make_batch`` and ``loss_fn``."""
    ns = source.run(device=device, seed=seed)
    if source.loss_fn_var is None or source.make_batch_var is None:
        constants = default_constants(ns[source.model_var], ns[source.inputs_var], dp=plan.mesh.dp,
                                      global_batch=plan.batch.global_batch)
        defaults: dict[str, Any] = dict(ns)
        add_default_data_loss(defaults, inputs_var=source.inputs_var, constants=constants)
        ns.setdefault("__loss_fn", ns[source.loss_fn_var] if source.loss_fn_var else defaults["loss_fn"])
        ns.setdefault("__make_batch", ns[source.make_batch_var] if source.make_batch_var else defaults["make_batch"])
    else:
        ns["__loss_fn"], ns["__make_batch"] = ns[source.loss_fn_var], ns[source.make_batch_var]
    return ns


class Trainer:
    """The plan applied to the cell's model on this rank, ready to run steps."""

    def __init__(self, source: ModelSource, plan: Plan, mesh: DeviceMesh, *, seed: int = 0, device: str = "cpu",
                 meta_init: bool = False, lr: float | None = None):
        self.plan, self.mesh, self.device = plan, mesh, device
        ns = build_namespace(source, plan, seed=seed, device="meta" if meta_init else None)
        model: nn.Module = ns[source.model_var]
        if not meta_init:
            model = model.to(device)
        self.loss_fn, self.make_batch = ns["__loss_fn"], ns["__make_batch"]
        self.dp_rank = mesh["dp"].get_local_rank()
        self.tp_rank = mesh["tp"].get_local_rank()
        microbatch = None
        if plan.mesh.pp > 1:
            first = split_batch(self._batch(0), plan.batch.micro_batches)[0]
            # real inputs even for a meta model: devices the trace bakes in (torch.arange(...)) are the run's
            microbatch = model_call(self.loss_fn, first)
        # on the meta path the plan is applied to a copy; the untouched model is the skeleton materialize() reads
        skeleton = model
        self.pm: ParallelModel = apply_plan(copy.deepcopy(model) if meta_init else model, plan, mesh,
                                            device=device, microbatch=microbatch)
        if meta_init:
            materialize(self.pm.parts, skeleton, device=device, seed=seed)
        self.parts = self.pm.parts
        params = [p for part in self.parts for p in part.parameters()]
        o = plan.optimizer
        kwargs = optimizer_kwargs(o.name, lr=lr if lr is not None else o.lr, weight_decay=o.weight_decay,
                                  betas=o.betas)
        fsdp = plan.mesh.dp > 1 and plan.mesh.zero_stage >= 2
        if plan.mesh.dp > 1 and plan.mesh.zero_stage == 1:
            self.optimizer = zero1_optimizer(params, mesh["dp"].get_group(), OPTIMIZERS[o.name], **kwargs)
        else:
            # foreach kernels cannot mix DTensor and plain tensor parameters (TP without FSDP)
            self.optimizer = OPTIMIZERS[o.name](params, foreach=not (plan.mesh.tp > 1 and not fsdp), **kwargs)
        p = plan.precision
        self.scaler = grad_scaler(p.amp, device, init_scale=p.init_loss_scale, dynamic=p.dynamic_loss_scale,
                                  growth_interval=p.growth_interval, sharded=fsdp)
        self.schedule = None
        if self.pm.stages:
            if p.amp == "fp16" or plan.loss_parallel:
                raise NotImplementedError("pipelining with fp16 loss scaling or loss_parallel is not supported; "
                                          "use bf16 and a replicated output head with pp > 1")
            self._micro: list[Any] = []
            self.schedule = build_schedule(self.pm.stages, schedule=plan.pipeline.schedule,
                                           n_microbatches=plan.batch.micro_batches, loss_fn=self._stage_loss)

    def _batch(self, step: int):
        return tree_map(lambda t: t.to(self.device), self.make_batch(step, self.dp_rank))

    def _stage_loss(self, output, index):
        return self.loss_fn(lambda *a, **k: output, self._micro[int(index)])

    def _context(self):
        stack = contextlib.ExitStack()
        stack.enter_context(autocast(self.plan.precision.amp, self.device))
        if self.plan.loss_parallel and self.plan.mesh.tp > 1:
            stack.enter_context(loss_parallel())
        return stack

    def forward_backward(self, step: int) -> torch.Tensor:
        """Forward and backward of one step; returns this rank's loss (0 where it has none)."""
        M = self.plan.batch.micro_batches
        micro = split_batch(self._batch(step), M)
        total = torch.zeros((), device=self.device)
        if self.schedule is not None:
            self._micro = micro
            losses: list[torch.Tensor] = []
            args, kwargs = model_call(self.loss_fn, concat_batches(micro)) if self.pm.has_first_stage else ((), {})
            target = torch.arange(M) if self.pm.has_last_stage else None
            with autocast(self.plan.precision.amp, self.device):
                self.schedule.step(*args, target=target, losses=losses, **kwargs)
            if self.pm.has_last_stage:
                total = torch.stack([x.detach().float() for x in losses]).mean()
            return total
        model = self.parts[0]
        for mb in micro:
            with self._context():
                loss = self.loss_fn(model, mb) / M
                if self.scaler is not None:
                    self.scaler.scale(loss).backward()
                else:
                    loss.backward()
            total += (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach().float()
        return total

    def global_loss(self, local: torch.Tensor) -> float:
        """The loss over the whole global batch: mean over data-parallel ranks of the last stage's loss."""
        mine = local if (self.pm.has_last_stage and self.tp_rank == 0) else torch.zeros_like(local)
        buf = mine.detach().clone()
        dist.all_reduce(buf)
        return buf.item() / self.plan.mesh.dp

    def optimizer_step(self) -> None:
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad()

    def step(self, step: int) -> float:
        """Forward, backward and optimizer step; returns the global loss (same on every rank)."""
        loss = self.global_loss(self.forward_backward(step))
        self.optimizer_step()
        return loss

    def named_tensors(self, what: str) -> dict[str, torch.Tensor]:
        """Full (unsharded) parameters or gradients held by this rank, by canonical name. Collective: every rank
        of the mesh calls it."""
        out = {}
        for part in self.parts:
            for name, p in part.named_parameters():
                t = p.grad if what == "grad" else p.detach()
                if t is None:
                    continue
                if isinstance(t, DTensor):
                    t = t.full_tensor()
                out[canonical_name(name)] = t.detach().float().cpu().clone()
        return out
