"""apply_plan: read a :class:`~autopar_nb.plan.Plan` and apply each technique with plain values, in order."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..plan import Plan
from .ac import apply_ac
from .amp import DTYPES
from .batchnorm import apply_sync_batchnorm
from .ddp import apply_ddp
from .fsdp import apply_fsdp
from .pp import boundary_values, build_stage, split_model, stage_boundaries, stage_ids
from .tp import apply_tp, tp_styles


@dataclass
class ParallelModel:
    """The pieces of the model this rank holds after :func:`apply_plan`."""

    parts: list[nn.Module]
    """one module, or one per pipeline stage held by this rank"""
    stages: list = field(default_factory=list)
    """``PipelineStage`` objects (empty without pipelining)"""
    stage_ids: list[int] = field(default_factory=list)
    num_stages: int = 1

    @property
    def has_first_stage(self) -> bool:
        return not self.stages or 0 in self.stage_ids

    @property
    def has_last_stage(self) -> bool:
        return not self.stages or self.num_stages - 1 in self.stage_ids


def apply_plan(model: nn.Module, plan: Plan, mesh: DeviceMesh, *, device: str | torch.device = "cpu",
               microbatch: tuple[tuple, dict] | None = None) -> ParallelModel:
    """Apply ``plan`` to ``model`` on ``mesh`` (dims ``("pp", "dp", "tp")``) with PyTorch's own APIs.

    ``microbatch``: ``(args, kwargs)`` of one pipeline micro-batch, needed to trace the model when ``mesh.pp > 1``.
    """
    m = plan.mesh
    dp_mesh, tp_mesh, pp_mesh = mesh["dp"], mesh["tp"], mesh["pp"]
    # TP styles are decided on the whole model, before any pipeline split (the output head is found model-wide)
    styles = tp_styles(model, plan.tp_plan, sp_layers=[lp.path for lp in plan.layers if lp.sequence_parallel],
                       layers=[lp.path for lp in plan.layers], loss_parallel=plan.loss_parallel) if m.tp > 1 else {}
    if m.tp > 1 and m.dp > 1 and m.zero_stage < 2:
        raise NotImplementedError(f"dp({m.dp}) x tp({m.tp}) needs FSDP over dp: set mesh.zero_stage to 2 or 3 "
                                  "(DDP does not take DTensor parameters)")
    if plan.sync_batchnorm and m.dp > 1:  # nn.SyncBatchNorm on GPUs, CPUSyncBatchNorm on CPU
        model = apply_sync_batchnorm(model, dp_mesh.get_group(), device=device)

    if m.pp > 1:
        if microbatch is None:
            raise ValueError("pipelining traces the model: pass microbatch=(args, kwargs) of one micro-batch")
        num_stages = m.pp * plan.pipeline.virtual_stages
        all_parts, whole = split_model(model, boundaries=stage_boundaries(plan.stage_layers()), microbatch=microbatch)
        # static boundary shapes, unless sequence parallelism cuts the activations crossing them
        sp = any("Shard(1)" in text for text in styles.values())
        values = None if sp else boundary_values(whole, all_parts, microbatch)
        ids = stage_ids(pp_mesh.get_local_rank(), m.pp, num_stages, plan.pipeline.schedule)
        parts = [all_parts[i] for i in ids]
    else:
        num_stages, ids, parts, values = 1, [], [model], None

    recompute = {lp.path: lp.recompute for lp in plan.layers if lp.recompute != "none"}
    fsdp_units = [lp.path for lp in plan.layers if lp.fsdp]
    out = []
    for part in parts:
        names = dict(part.named_modules())
        # 1. TP first: it replaces parameters with DTensors, which everything after must see.
        if styles:
            apply_tp(part, tp_mesh, styles={k: v for k, v in styles.items() if k in names})
        # 2. AC next, around whole layers, so that 3. FSDP wraps the checkpointed layer: FSDP's all-gather stays
        #    outside the recomputed region and its backward pre-hook gathers the parameters before recompute.
        apply_ac(part, recompute={k: v for k, v in recompute.items() if k in names})
        # 3. Data parallelism last, over the (TP-sharded, checkpoint-wrapped) modules.
        if m.dp > 1 and m.zero_stage >= 2:
            units = [u for u in fsdp_units if u in names and any(True for _ in part.get_submodule(u).parameters())]
            apply_fsdp(part, dp_mesh, units=units, reshard_after_forward=m.zero_stage == 3,
                       param_dtype=DTYPES[plan.precision.param_dtype],
                       reduce_dtype=DTYPES[plan.precision.reduce_dtype])
        elif m.dp > 1:
            part = apply_ddp(part, dp_mesh.get_group(), device=str(device))
        out.append(part)

    stages = [build_stage(part, i, num_stages, device=torch.device(device), pp_group=pp_mesh.get_group(),
                          values=values)
              for part, i in zip(out, ids, strict=True)] if m.pp > 1 else []
    return ParallelModel(parts=out, stages=stages, stage_ids=ids, num_stages=num_stages)
