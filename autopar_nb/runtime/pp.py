"""Pipeline stages and schedules with ``torch.distributed.pipelining``: which stages a rank holds,
the stage and schedule objects, the step, and gradients of weights tied across stages.

The model is cut into stages by :mod:`.pp_split`. Every stage output is sent as a contiguous tensor
(a mask made by ``expand`` is sent as its contiguous copy). The last stage returns the tensors of
the model's output, which :class:`StageLoss` gives the cell's loss in the model's own structure (a
Hugging Face ``ModelOutput`` with its ``loss``/``logits``).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._pytree import tree_unflatten

from .data import model_call, split_batch
from .init import canonical_name

# plan schedule name -> torch.distributed.pipelining class name
SCHEDULES = {
    "gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B",
    "looped_bfs": "LoopedBFS", "interleaved_zero_bubble": "InterleavedZeroBubble",
    "zbv_zero_bubble": "ZBVZeroBubble",}


V_SCHEDULES = ("zbv_zero_bubble",)  # stages placed in a V: rank r holds stages r and 2*pp-1-r


# each backward split into an input pass and a later weight pass (torch's stage_backward_input and
# stage_backward_weight): FSDP stages keep their parameters gathered after forward (keep_gathered)
SPLIT_BACKWARD = ("interleaved_zero_bubble", "zbv_zero_bubble")


def stage_boundaries(stage_layers: list[list[str]]) -> list[str]:  # at export time
    """The first layer of every stage but the first: where the model is cut."""
    for i, layers in enumerate(stage_layers):
        if not layers:
            raise ValueError(f"pipeline stage {i} has no layers; give every stage at least one "
                             "layer")
    return [layers[0] for layers in stage_layers[1:]]


def stage_ids(pp_rank: int, pp: int, num_stages: int, schedule: str) -> list[int]:
    """The stage indices rank ``pp_rank`` holds: one per rank, or several (looped or V placement)
    when ``num_stages > pp``."""
    if num_stages == pp:
        return [pp_rank]
    if schedule in V_SCHEDULES:
        return [pp_rank, num_stages - 1 - pp_rank]
    return list(range(pp_rank, num_stages, pp))


class LeanStage(PipelineStage):
    """A :class:`PipelineStage` whose receive buffers hold memory only while their micro-batch is in
    flight.

    Torch's stage allocates, at its first step, a buffer per micro-batch for its inputs and one for
    the gradients coming back, and keeps them all for the run: its memory grows with the number of
    micro-batches (a 1T GPT's boundary, 100 MiB in bf16, times 144 micro-batches is 14 GiB per rank
    for the inputs alone). Here each buffer is emptied (its storage resized to nothing, as FSDP
    frees a resharded parameter) once its micro-batch's backward is done, the weights' part too
    under a zero-bubble schedule, and is allocated again just before its next receive. Where a
    same-rank stage hands its output over instead (V schedules) the stage's own buffer stays empty.

    Under a schedule that runs several stages per rank (torch's ``_PipelineScheduleRuntime``) the
    stage issues its own sends, with the same ``isend`` the schedule would issue, and lets each go
    once its peer has received it (:class:`Sends`): the schedule keeps every send's work, and with
    it the output or input gradient it sends, until the step ends, so a rank's memory grew with the
    number of micro-batches (Megatron-LM frees each once sent)."""

    sends: Sends | None = None
    """the sends this stage issued and the schedule does not hold (None: the schedule holds them),
    shared by the rank's stages (:func:`build_schedule`)"""

    def _prepare_forward_infra(self, *args, **kwargs):
        out = super()._prepare_forward_infra(*args, **kwargs)
        self._remember("fwd", self.args_recv_info)
        return out

    def _prepare_backward_infra(self, *args, **kwargs):
        out = super()._prepare_backward_infra(*args, **kwargs)
        self._remember("bwd", self.grad_recv_info)
        return out

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list:
        return self._issued("F", fwd_chunk_id, super().get_fwd_send_ops(fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list:
        return self._issued("B", bwd_chunk_id, super().get_bwd_send_ops(bwd_chunk_id))

    def _issued(self, kind: str, chunk: int, ops: list) -> list:
        """Send ``ops`` here and give the schedule none to hold (where this stage keeps its
        sends)."""
        if self.sends is None:
            return ops
        self.sends.issue(kind, self.stage_index, chunk, ops)
        return []

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list:
        self._fill(self.args_recv_info.get(fwd_chunk_id, ()))
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list:
        self._fill(getattr(self, "grad_recv_info", {}).get(bwd_chunk_id, ()))
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index: int) -> None:
        # a missing gradient is written into the buffer as zeros
        self._fill(self.grad_recv_info.get(mb_index, ()))
        return super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True,
                           last_backward=False):
        # the schedule waited for this micro-batch's gradient before calling
        if self.sends is not None:
            self.sends.received(self.stage_index, bwd_chunk_id)
        out = super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                         last_backward=last_backward)
        if full_backward:
            self._empty(bwd_chunk_id)
        return out

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward=False):
        out = super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
        self._empty(bwd_chunk_id)
        return out

    def _remember(self, kind: str, recv_info: dict) -> None:
        """The buffers the stage allocated, by (kind, micro-batch): held here, so that one the
        schedule replaced (a same-rank stage's output) is still known and is never taken for
        another."""
        own = self.__dict__.setdefault("_own", {})
        for chunk, infos in recv_info.items():
            # a model input is no buffer: torch 2.12+ marks it is_root_arg, 2.11 gives a placeholder
            # with no buffer
            own[kind, chunk] = [buf for info in infos if not getattr(info, "is_root_arg", False)
                                and isinstance(buf := getattr(info, "buffer", None), torch.Tensor)]
            for buf in own[kind, chunk]:  # allocated when its receive comes
                buf.untyped_storage().resize_(0)

    def _fill(self, infos) -> None:
        mine = {id(b) for bufs in self.__dict__.get("_own", {}).values() for b in bufs}
        for info in infos:
            buf = getattr(info, "buffer", None)
            if id(buf) in mine and buf.untyped_storage().size() == 0:
                buf.untyped_storage().resize_(buf.numel() * buf.element_size())

    def _empty(self, chunk: int) -> None:
        own = self.__dict__.get("_own", {})
        for buf in (*own.get(("fwd", chunk), ()), *own.get(("bwd", chunk), ())):
            # the input's gradient: sent already (the schedule keeps its own reference until then)
            buf.grad = None
            buf.untyped_storage().resize_(0)


class Sends:
    """The sends a rank's stages issued themselves (:class:`LeanStage`), each waited for, and let go
    with the tensor it sends, once its peer has certainly received it; the rest at the end of the
    step, as the schedule waits.

    A send is waited for only where its receive has completed (a gloo send's work reports completion
    only once waited for, and waiting on one the peer has not yet posted a receive for could
    deadlock the pair): a stage's output of micro-batch i once that micro-batch's gradient came back
    to it (its backward, which torch's schedule runs after waiting for that gradient), an input
    gradient once a lower stage of the same rank runs that micro-batch's backward (every stage in
    between received its gradient then). A rank's lowest stage's input gradients have no such point
    and are waited for at the end of the step."""

    def __init__(self):
        self.works: dict[tuple[str, int, int], list[dist.Work]] = {}
        """("F" or "B", stage, micro-batch) -> the works of its output's or input gradient's
        sends"""

    def issue(self, kind: str, stage: int, chunk: int, ops: list[dist.P2POp]) -> None:
        """Send each of ``ops`` (all sends) as the schedule does: one ``isend`` each, not
        coalesced."""
        works = [dist.isend(op.tensor, group=op.group, tag=op.tag, group_dst=op.group_peer)
                 for op in ops]
        self.works.setdefault((kind, stage, chunk), []).extend(works)

    def received(self, stage: int, chunk: int) -> None:
        """Micro-batch ``chunk``'s gradient reached ``stage``: wait for and let go of its output's
        sends and of the input gradients of the rank's higher stages for it."""
        for key in [k for k in self.works if k[2] == chunk and (k[:2] == ("F", stage) or
                                                                 (k[0] == "B" and k[1] > stage))]:
            for work in self.works.pop(key):
                work.wait()

    def wait(self) -> None:
        """Wait for every send left (the end of the step)."""
        for works in self.works.values():
            for work in works:
                work.wait()
        self.works.clear()


def build_stage(module: nn.Module, stage_id: int, num_stages: int, *, device: torch.device,
                pp_group: ProcessGroup,
                values: list[tuple[tuple, tuple]] | None = None) -> PipelineStage:
    """Wrap one stage module (after TP/AC/FSDP) for the schedule (a :class:`LeanStage`); ``values``
    from :func:`boundary_values` give static input/output shapes (None: the stages infer them at the
    first step)."""
    if values is None:
        return LeanStage(module, stage_id, num_stages, device, group=pp_group)
    inputs, outputs = values[stage_id]
    return LeanStage(module, stage_id, num_stages, device, group=pp_group, input_args=inputs,
                     output_args=outputs)


def build_schedule(stages: list[PipelineStage], *, schedule: str, n_microbatches: int, loss_fn):
    """The pipeline schedule the plan names (``loss_fn(output, target)`` runs on the last stage; a
    :class:`StageLoss` learns the model output's structure from the last stage's module, set by
    :func:`split_model`)."""
    if isinstance(loss_fn, StageLoss):
        loss_fn.learn(next((_unwrapped(s.submod) for s in stages if s.is_last), None))
    keep_gathered(stages, schedule)
    cls = get_schedule_class(SCHEDULES[schedule])
    if issubclass(cls, PipelineScheduleSingle):
        if len(stages) != 1:
            raise ValueError(f"schedule {schedule!r} runs one stage per rank; use virtual_stages=1 "
                             "or an interleaved/looped schedule")
        # a one-stage schedule fuses a send with the next receive (batch_isend_irecv), which keeps a
        # pair of ranks that each send before receiving out of a deadlock: it keeps its sends (1F1B
        # lets each go a micro-batch later)
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn)
    # a multi-stage schedule issues every send alone and holds all of them until the step ends: the
    # stages keep them
    sends = Sends()
    for stage in stages:
        if isinstance(stage, LeanStage):
            stage.sends = sends
    return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn)


def keep_gathered(stages: list[PipelineStage], schedule: str) -> None:
    """Under a schedule that splits the backward (:data:`SPLIT_BACKWARD`), FSDP stages keep
    their units' parameters gathered from forward to the step's reduction, as ZeRO-2 does,
    whatever ``apply_fsdp`` was told.

    The input pass (torch's ``stage_backward_input``) takes ``submod.parameters()`` before
    autograd runs, to hook the graph nodes the weight pass will start from. A unit resharded
    after its forward has its sharded parameters registered then, which the graph (built from
    the gathered ones) does not hold: nothing is hooked, the input pass lets the graph go, and
    the weight pass computes no gradient. Gathered, the registered parameters are the ones the
    forward used."""
    if schedule not in SPLIT_BACKWARD:
        return
    for stage in stages:
        if isinstance(stage.submod, FSDPModule):
            stage.submod.set_reshard_after_forward(False)  # every unit inside it too


def _unwrapped(module: nn.Module) -> nn.Module:
    """The stage module inside a DDP wrapper (``apply_ddp``), or the module."""
    return module.module if isinstance(module, DDP) else module


class StageLoss:
    """The cell's ``loss_fn(model, batch)`` on the last pipeline stage, with the model call answered
    by the stage's output in the structure the model returns (``output_spec``, a pytree spec; None:
    as the stage returns it); the schedule passes the micro-batch index as the target (``micro``
    holds this step's micro-batches). Where the last stage holds a loss head (``split_model``'s
    ``loss_head``: ``head``, and ``head_index``, which output is its input) the model is a
    :class:`StageOutput`, which runs the head in the loss (``fused_default_loss`` finds it there and
    gives it the targets)."""

    def __init__(self, loss_fn):
        self.loss_fn, self.micro, self.output_spec = loss_fn, [], None
        self.head: nn.Module | None = None
        self.head_index: int | None = None

    def learn(self, last: nn.Module | None) -> None:
        """The model output's structure and the loss head from the last stage's module (set by
        :func:`split_model`; None: this rank holds no last stage)."""
        self.output_spec = getattr(last, "output_spec", None)
        path, index = getattr(last, "loss_head", ("", None))
        self.head, self.head_index = (last.get_submodule(path), index) if path else (None, None)

    def __call__(self, output, index):
        if self.head is not None:
            model = StageOutput(output, self.output_spec, head=self.head, index=self.head_index)
            return self.loss_fn(model, self.micro[int(index)])
        if self.output_spec is not None:
            output = tree_unflatten(list(output) if isinstance(output, (tuple, list)) else [output],
                                    self.output_spec)
        return self.loss_fn(lambda *args, **kwargs: output, self.micro[int(index)])


class StageOutput(nn.Module):
    """The model as the loss sees it on a last stage holding the loss head: called (its arguments
    are the micro-batch's, ignored), it runs ``head`` on output ``index`` of the stage (the head's
    input) and returns the model's output with the head's result in that place (``spec``: its
    structure, a pytree spec, or None)."""

    def __init__(self, output, spec, *, head: nn.Module, index: int):
        super().__init__()
        self.output, self.spec, self.head, self.index = output, spec, head, index

    def forward(self, *args, **kwargs):
        leaves = list(self.output) if isinstance(self.output, (tuple, list)) else [self.output]
        leaves[self.index] = self.head(leaves[self.index])
        if self.spec is not None:
            return tree_unflatten(leaves, self.spec)
        return type(self.output)(leaves) if isinstance(self.output, (tuple, list)) else leaves[0]


def pipeline_step(schedule, stage_loss: StageLoss, batch, *, micro_batches: int, has_first: bool,
                  has_last: bool, context, device: str, shard=None) -> torch.Tensor:
    """Forward and backward of one batch through the pipeline schedule; returns the mean micro-batch
    loss on the last stage (0 elsewhere; under loss_parallel a replicated DTensor's local value).
    ``context()``: what the stages run under (autocast). ``batch`` is None on a rank that holds
    neither end stage: it reads no data. ``shard(batch)``: what the step runs inside, yielding this
    rank's part of the batch (context parallelism's ``sequence_shards``: the sequences split before
    the schedule splits the micro-batches, the ring attention on for every stage, the middle ones'
    too)."""
    with shard(batch) if shard is not None else contextlib.nullcontext(batch) as batch:
        stage_loss.micro = split_batch(batch, micro_batches) if batch is not None else []
        args, kwargs = model_call(stage_loss.loss_fn, batch) if has_first else ((), {})
        target = torch.arange(micro_batches) if has_last else None
        losses: list = []
        with context():
            # the losses are all the step needs: the last stage keeps no outputs (a scalar loss in a
            # model's output could not be merged over the micro-batches, and the logits of every
            # micro-batch would stay alive)
            schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        sends = next((s.sends for s in _stages(schedule) if getattr(s, "sends", None) is not None),
                     None)
        if sends is not None:
            # the step's last sends, before the optimizer step, as the schedule waits for its own
            sends.wait()
    if not has_last:
        return torch.zeros((), device=device)
    return torch.stack([_local(x).detach().float() for x in losses]).mean()


class TiedGradients:
    """Parameters tied across pipeline stages (an embedding and its output head): every stage that
    uses one holds its own copy, initialised alike; after each backward their gradients are summed
    over the stages that hold them, so the copies stay equal (Megatron-LM's embedding group). A rank
    holding several stages may hold several copies: they are summed here first. Collective to build:
    every rank of ``mesh`` calls it."""

    def __init__(self, parts: list, ties: list, mesh):
        pp = mesh["pp"]
        # (this rank's copies, process group of the holders or None, whether its first counts)
        self.groups = []
        for ties_of_one in ties:
            names = set(ties_of_one)
            mine = list({id(p): p for part in parts
                         for name, p in part.named_parameters(remove_duplicate=False)
                         # every stage's copy, also under one name
                         if canonical_name(name) in names}.values())
            holders = [None] * pp.size()
            dist.all_gather_object(holders, bool(mine), group=pp.get_group())
            stages = [i for i, h in enumerate(holders) if h]
            if len(stages) < 2 and len(mine) < 2:
                continue  # one copy holds every use: autograd sums the gradient already
            group = None
            if len(stages) > 1:
                # every (dp, [cp,] tp) place
                for column in mesh.mesh.movedim(0, -1).reshape(-1, pp.size()).tolist():
                    ranks = [column[i] for i in stages]
                    made = dist.new_group(ranks)  # every rank takes part in creating every group
                    if dist.get_rank() in ranks:
                        group = made
            self.groups.append((mine, group, pp.get_local_rank() == stages[0]))

    def sync(self) -> None:
        """Sum the copies' gradients over the stages that hold them; every copy gets the sum."""
        for copies, group, _ in self.groups:
            for p in copies:
                _grad_laid_out_as(p)
            grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in copies
                     if p.grad is not None]
            if not grads and group is None:
                continue
            total = torch.stack(grads).sum(0) if grads else torch.zeros_like(_local(copies[0]))
            if group is not None:
                dist.all_reduce(total, group=group)
            # a copy no stage computed with (a module the pipe carries along) moves alike
            for p in copies:
                if p.grad is None and not isinstance(p, DTensor):
                    p.grad = total.clone()
                else:
                    (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).copy_(total)

    def repeated(self) -> list:
        """The copies a gradient norm must not count again (all but the first stage's first)."""
        return [p for copies, _, first in self.groups for p in (copies[1:] if first else copies)]


def _grad_laid_out_as(p) -> None:
    """Give a DTensor parameter's gradient the parameter's own placements. The copies of a tied
    weight on other stages hold theirs so (a vocabulary-split head's is split), while DTensor's
    embedding backward may leave a vocabulary-split embedding's gradient whole (replicated), and
    the copies' gradients are summed as local tensors."""
    if isinstance(p, DTensor) and isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
        p.grad = p.grad.redistribute(p.device_mesh, p.placements)


def _stages(schedule) -> list:
    """The stages a torch schedule runs (one-stage schedules hold theirs as ``_stage``)."""
    return list(getattr(schedule, "_stages", None) or [schedule._stage])


def _local(p):
    return p.to_local() if isinstance(p, DTensor) else p
