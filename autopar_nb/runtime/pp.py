"""Pipeline parallelism with ``torch.distributed.pipelining``.

The model is traced and split at the first layer of every stage (``pipeline()`` with ``SplitPoint.BEGINNING``), so
any model the tracer handles works, not only ones written for pipelining. Stage modules keep the original parameter
names; the leaf modules the tracer turned into graph interpreters are swapped back for the original ones (same
parameters), so TP styles and checkpoint wrappers see real ``nn.Linear``/``nn.Embedding`` modules.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup
from torch.distributed.pipelining import PipelineStage, SplitPoint, pipeline
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
from torch.distributed.tensor import DTensor

from .data import model_call, split_batch
from .init import canonical_name

# plan schedule name -> torch.distributed.pipelining class name
SCHEDULES = {
    "gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B", "looped_bfs": "LoopedBFS",
    "interleaved_zero_bubble": "InterleavedZeroBubble", "zbv_zero_bubble": "ZBVZeroBubble",
}
V_SCHEDULES = ("zbv_zero_bubble",)  # stages placed in a V: rank r holds stages r and 2*pp-1-r


def stage_boundaries(stage_layers: list[list[str]]) -> list[str]:  # at export time
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


def split_model(model: nn.Module, *, boundaries: list[str], microbatch: tuple[tuple, dict]
                ) -> tuple[list[nn.Module], nn.Module]:
    """Trace ``model`` on one micro-batch of inputs and cut it before each module in ``boundaries``.

    Returns one module per stage, with the original parameter names and leaf modules, and the traced whole that
    calls them in order (what :func:`boundary_values` runs).
    """
    args, kwargs = microbatch
    pipe = pipeline(model, mb_args=args, mb_kwargs=kwargs or None,
                    split_spec={path: SplitPoint.BEGINNING for path in boundaries})
    if pipe.num_stages != len(boundaries) + 1:
        raise ValueError(f"splitting at {boundaries} gave {pipe.num_stages} stages, not {len(boundaries) + 1}: a "
                         "boundary must be a module the forward calls, in order; check the plan's stage numbers")
    _check_chain(pipe.split_gm)
    originals = dict(model.named_modules())
    stages = []
    for i in range(pipe.num_stages):
        stage = pipe.get_stage_module(i)
        for path, module in list(stage.named_modules()):
            original = originals.get(path)
            if path and original is not None and not list(original.children()) and module is not original:
                parent, _, name = path.rpartition(".")
                stage.get_submodule(parent).register_module(name, original)
        stage.register_forward_hook(_contiguous_outputs)
        stages.append(stage)
    return stages, pipe


def _check_chain(split_gm) -> None:
    """Each stage must read exactly the previous stage's outputs, in order: the schedules send a stage's outputs
    to the next stage as its positional inputs, and nothing else."""
    import operator

    calls = [n for n in split_gm.graph.nodes if n.op == "call_module"]
    for prev, node in zip(calls, calls[1:], strict=False):
        got = list(node.args)
        if got == [prev]:
            continue
        if all(a.op == "call_function" and a.target is operator.getitem and a.args[0] is prev and a.args[1] == j
               for j, a in enumerate(got)) and len(got) == len(prev.users):
            continue
        names = ", ".join(getattr(a, "name", str(a)) for a in got)
        raise NotImplementedError(
            f"the cut before pipeline stage {calls.index(node)} is crossed by values that do not all come from the "
            f"stage before it ({names}; e.g. a model input used again later): choose a stage boundary where only "
            "the previous stage's outputs flow on (for example at a repeated block)")


def _contiguous_outputs(module, args, output):
    """Stage outputs are sent to the next rank as they are, and gloo sends only contiguous tensors (a cut after a
    transpose or an expand would fail)."""
    if isinstance(output, torch.Tensor):
        return output.contiguous()
    if isinstance(output, (tuple, list)):
        return type(output)(t.contiguous() if isinstance(t, torch.Tensor) else t for t in output)
    return output


def boundary_values(whole: nn.Module, stages: list[nn.Module], microbatch: tuple[tuple, dict]
                    ) -> list[tuple[tuple, tuple]]:
    """What enters and leaves each stage, from one micro-batch run through the traced whole (unsharded): the static
    shapes the stages are built with, so no shape inference runs on made-up tensors (integer ids made up for it
    could index out of an embedding)."""
    def leaf(t):  # keeps requires_grad: it tells the stage which gradients travel back
        return t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t

    seen: dict[int, tuple[tuple, tuple]] = {}
    hooks = [stage.register_forward_hook(
        lambda m, args, out, i=i: seen.__setitem__(i, (tuple(leaf(a) for a in args),
                                                       tuple(leaf(t) for t in (out if isinstance(out, tuple)
                                                                               else (out,))))))
        for i, stage in enumerate(stages)]
    try:
        args, kwargs = microbatch
        whole(*args, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    return [seen[i] for i in range(len(stages))]


def build_stage(module: nn.Module, stage_id: int, num_stages: int, *, device: torch.device, pp_group: ProcessGroup,
                values: list[tuple[tuple, tuple]] | None = None) -> PipelineStage:
    """Wrap one stage module (after TP/AC/FSDP) for the schedule; ``values`` from :func:`boundary_values` give
    static input/output shapes (None: the stages infer them at the first step)."""
    if values is None:
        return PipelineStage(module, stage_id, num_stages, device, group=pp_group)
    inputs, outputs = values[stage_id]
    return PipelineStage(module, stage_id, num_stages, device, group=pp_group, input_args=inputs,
                         output_args=outputs)


def build_schedule(stages: list[PipelineStage], *, schedule: str, n_microbatches: int, loss_fn):
    """The pipeline schedule the plan names (``loss_fn(output, target)`` runs on the last stage)."""
    cls = get_schedule_class(SCHEDULES[schedule])
    if issubclass(cls, PipelineScheduleSingle):
        if len(stages) != 1:
            raise ValueError(f"schedule {schedule!r} runs one stage per rank; use virtual_stages=1 or an "
                             "interleaved/looped schedule")
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn)
    return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn)


class StageLoss:
    """The cell's ``loss_fn(model, batch)`` on the last pipeline stage, with the model call answered by the stage's
    output; the schedule passes the micro-batch index as the target (``micro`` holds this step's micro-batches)."""

    def __init__(self, loss_fn):
        self.loss_fn, self.micro = loss_fn, []

    def __call__(self, output, index):
        return self.loss_fn(lambda *args, **kwargs: output, self.micro[int(index)])


def pipeline_step(schedule, stage_loss: StageLoss, batch, *, micro_batches: int, has_first: bool, has_last: bool,
                  context, device: str) -> torch.Tensor:
    """Forward and backward of one batch through the pipeline schedule; returns the mean micro-batch loss on the
    last stage (0 elsewhere). ``context()``: what the stages run under (autocast). ``batch`` is None on a rank that
    holds neither the first nor the last stage: it reads no data."""
    stage_loss.micro = split_batch(batch, micro_batches) if batch is not None else []
    args, kwargs = model_call(stage_loss.loss_fn, batch) if has_first else ((), {})
    target = torch.arange(micro_batches) if has_last else None
    losses: list = []
    with context():
        schedule.step(*args, target=target, losses=losses, **kwargs)
    if not has_last:
        return torch.zeros((), device=device)
    return torch.stack([x.detach().float() for x in losses]).mean()


class TiedGradients:
    """Parameters tied across pipeline stages (an embedding and its output head): every stage that uses one holds its
    own copy, initialised alike; after each backward their gradients are summed over the stages that hold them, so
    the copies stay equal (Megatron-LM's embedding group). Collective to build: every rank of ``mesh`` calls it."""

    def __init__(self, parts: list, ties: list, mesh):
        pp = mesh["pp"]
        held: dict = {}
        for part in parts:
            for name, p in part.named_parameters(remove_duplicate=False):
                held.setdefault(canonical_name(name), p)
        self.groups = []  # (this rank's copy or None, process group of the holders, whether it counts in norms)
        for ties_of_one in ties:
            mine = next((held[p] for p in ties_of_one if p in held), None)
            holders = [None] * pp.size()
            dist.all_gather_object(holders, mine is not None, group=pp.get_group())
            stages = [i for i, h in enumerate(holders) if h]
            if len(stages) < 2:
                continue  # one stage holds every use: autograd sums the gradient already
            group = None
            for column in mesh.mesh.permute(1, 2, 0).reshape(-1, pp.size()).tolist():  # every (dp, tp) position
                ranks = [column[i] for i in stages]
                made = dist.new_group(ranks)  # every rank takes part in creating every group
                if dist.get_rank() in ranks:
                    group = made
            self.groups.append((mine, group, pp.get_local_rank() == stages[0]))

    def sync(self) -> None:
        """Sum the copies' gradients over the stages that hold them."""
        for param, group, _ in self.groups:
            if param is not None and param.grad is not None:
                grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                dist.all_reduce(grad, group=group)

    def repeated(self) -> list:
        """The copies a gradient norm must not count again (all but the first stage's)."""
        return [param for param, _, first in self.groups if param is not None and not first]
