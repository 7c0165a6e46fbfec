"""Pipeline parallelism with ``torch.distributed.pipelining``.

The model is traced and split at the first layer of every stage (``pipeline()`` with ``SplitPoint.BEGINNING``), so
any model the tracer handles works, not only ones written for pipelining. Stage modules keep the original parameter
names; the leaf modules the tracer turned into graph interpreters are swapped back for the original ones (same
parameters), so TP styles and checkpoint wrappers see real ``nn.Linear``/``nn.Embedding`` modules.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed import ProcessGroup
from torch.distributed.pipelining import PipelineStage, SplitPoint, pipeline
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

# plan schedule name -> torch.distributed.pipelining class name
SCHEDULES = {
    "gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B", "looped_bfs": "LoopedBFS",
    "interleaved_zero_bubble": "InterleavedZeroBubble", "zbv_zero_bubble": "ZBVZeroBubble",
}
V_SCHEDULES = ("zbv_zero_bubble",)  # stages placed in a V: rank r holds stages r and 2*pp-1-r


def stage_boundaries(stage_layers: list[list[str]]) -> list[str]:
    """The first layer of every stage but the first: where the model is cut."""
    for i, layers in enumerate(stage_layers):
        if not layers:
            raise ValueError(f"pipeline stage {i} has no layers; give every stage at least one layer")
    return [layers[0] for layers in stage_layers[1:]]


def stage_ids(pp_rank: int, pp: int, num_stages: int, schedule: str) -> list[int]:
    """The stage indices rank ``pp_rank`` holds: one per rank, or several (looped or V placement) when
    ``num_stages > pp``."""
    if num_stages == pp:
        return [pp_rank]
    if schedule in V_SCHEDULES:
        return [pp_rank, num_stages - 1 - pp_rank]
    return list(range(pp_rank, num_stages, pp))


def split_model(model: nn.Module, *, boundaries: list[str], microbatch: tuple[tuple, dict]) -> list[nn.Module]:
    """Trace ``model`` on one micro-batch of inputs and cut it before each module in ``boundaries``.

    Returns one module per stage, with the original parameter names and leaf modules.
    """
    args, kwargs = microbatch
    pipe = pipeline(model, mb_args=args, mb_kwargs=kwargs or None,
                    split_spec={path: SplitPoint.BEGINNING for path in boundaries})
    if pipe.num_stages != len(boundaries) + 1:
        raise ValueError(f"splitting at {boundaries} gave {pipe.num_stages} stages, not {len(boundaries) + 1}: a "
                         "boundary must be a module the forward calls, in order; check the plan's stage numbers")
    originals = dict(model.named_modules())
    stages = []
    for i in range(pipe.num_stages):
        stage = pipe.get_stage_module(i)
        for path, module in list(stage.named_modules()):
            original = originals.get(path)
            if path and original is not None and not list(original.children()) and module is not original:
                parent, _, name = path.rpartition(".")
                stage.get_submodule(parent).register_module(name, original)
        stages.append(stage)
    return stages


def build_stage(module: nn.Module, stage_id: int, num_stages: int, *, device: torch.device,
                pp_group: ProcessGroup) -> PipelineStage:
    """Wrap one stage module for the schedule."""
    return PipelineStage(module, stage_id, num_stages, device, group=pp_group)


def build_schedule(stages: list[PipelineStage], *, schedule: str, n_microbatches: int, loss_fn):
    """The pipeline schedule the plan names (``loss_fn(output, target)`` runs on the last stage)."""
    cls = get_schedule_class(SCHEDULES[schedule])
    if issubclass(cls, PipelineScheduleSingle):
        if len(stages) != 1:
            raise ValueError(f"schedule {schedule!r} runs one stage per rank; use virtual_stages=1 or an "
                             "interleaved/looped schedule")
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn)
    return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn)
