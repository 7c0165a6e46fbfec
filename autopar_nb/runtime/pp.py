"""Pipeline parallelism with ``torch.distributed.pipelining``.

The model is traced and split at the first layer of every stage (``pipeline()`` with ``SplitPoint.BEGINNING``), so
any model the tracer handles works, not only ones written for pipelining. Stage modules keep the original parameter
names; the leaf modules the tracer turned into graph interpreters are swapped back for the original ones (same
parameters; a parameter tied to an earlier stage's, a copy of it, as ``pipeline()`` makes) where they are called as
the original was (one tensor in, one out), so TP styles and checkpoint wrappers see real ``nn.Linear``/``nn.Embedding``
modules.

The schedules send a stage's outputs to the next stage as its positional inputs. A value that a later stage reads
from further back (a Hugging Face model's attention mask and rotary cos/sin, made once and read by every layer; the
labels its loss reads; an encoder's output read by every decoder block) is passed on through the stages between
(:func:`chain_stages`), and every stage output is sent as a contiguous tensor (a mask made by ``expand`` is sent as
its contiguous copy). The last stage returns the tensors of the model's output, which :class:`StageLoss` gives the
cell's loss in the model's own structure (a Hugging Face ``ModelOutput`` with its ``loss``/``logits``).
"""

from __future__ import annotations

import copy
import operator

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.distributed import ProcessGroup
from torch.distributed.pipelining import PipelineStage, SplitPoint, pipeline
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_unflatten

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

    Returns one module per stage, with the original parameter names and leaf modules, each reading exactly the
    previous stage's outputs (:func:`chain_stages`), and the traced whole that calls them in order (what
    :func:`boundary_values` runs).
    """
    args, kwargs = microbatch
    specs: list = []  # the structure of the model's output, seen while it is traced
    hook = model.register_forward_hook(lambda m, a, out: specs.append(tree_flatten(out)[1]))
    try:  # (a Hugging Face model's key/value cache is off: train.switch_off_kv_cache, which the script calls)
        pipe = pipeline(model, mb_args=args, mb_kwargs=kwargs or None,
                        split_spec={path: SplitPoint.BEGINNING for path in boundaries})
    finally:
        hook.remove()
    if pipe.num_stages != len(boundaries) + 1:
        raise ValueError(f"splitting at {boundaries} gave {pipe.num_stages} stages, not {len(boundaries) + 1}: a "
                         "boundary must be a module the forward calls, in order; check the plan's stage numbers")
    chain_stages(pipe.split_gm)
    pipe.executor = type(pipe.executor)(pipe.split_gm)  # the Pipe runs the rewritten graph
    originals = dict(model.named_modules())
    stages = [pipe.get_stage_module(i) for i in range(pipe.num_stages)]
    called = {path for stage in stages for path, _ in stage.named_modules()}
    taken: set[int] = set()  # parameters an earlier stage holds
    for stage in stages:
        memo: dict = {}  # a tied parameter's copy, shared by this stage's modules
        for path, module in list(stage.named_modules()):
            original = originals.get(path)
            if (path and original is not None and module is not original and not list(original.children())
                    and list(original.parameters(recurse=False)) and _called_as_itself(module)):
                if any(id(p) in taken for p in original.parameters()):  # tied to an earlier stage's: its own copy
                    original = copy.deepcopy(original, memo)
                parent, _, name = path.rpartition(".")
                stage.get_submodule(parent).register_module(name, original)
        _keep_first_names(stage, model, called, memo)
        taken |= {id(p) for p in stage.parameters()}
        stage.register_forward_hook(_contiguous_outputs)
    stages[-1].output_spec = specs[-1] if specs else None  # read by build_schedule for StageLoss
    return stages, pipe


def _keep_first_names(stage: nn.Module, model: nn.Module, called: set[str], copies: dict) -> None:
    """Name a stage's tied parameters as the model does (its first name: what checkpoints and the single-process
    run use), where the stage holds one (or its copy: ``copies``, a deepcopy memo) under another: on its owner module
    when the stage has it (BERT's ``cls.predictions.bias``, also the called decoder's bias); a top-level module no
    stage calls (T5's ``shared``, tied to the embeddings that are called) joins the stage under its own path, first."""
    held = {id(p): p for p in stage.parameters()}
    names = {n for n, _ in stage.named_parameters()}
    have = dict(stage.named_modules())
    for name, p in model.named_parameters():
        mine = held.get(id(p), held.get(id(copies.get(id(p)))))
        owner, _, attr = name.rpartition(".")
        if mine is not None and name not in names and owner in have and attr not in have[owner]._parameters:
            have[owner].register_parameter(attr, mine)
    first = [(path, module) for path, module in model.named_children()
             if path not in called and (own := list(module.parameters())) and all(id(p) in held for p in own)]
    if first:
        stage._modules = dict(first) | stage._modules  # named_parameters() meets them first


def _called_as_itself(traced: nn.Module) -> bool:
    """Whether a traced leaf module takes one tensor and returns one, as the original did: export may give it other
    inputs (a rotary embedding's unused ``x`` dropped) or outputs (an RMSNorm's float32 input, also the block's
    residual), and then the original module would not fit the stage's graph."""
    graph = getattr(traced, "graph", None)
    if graph is None:
        return False
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    output = next(n for n in graph.nodes if n.op == "output")
    return len(inputs) == 1 and isinstance(output.args[0], fx.Node)


def chain_stages(split_gm: fx.GraphModule) -> None:
    """Rewrite the traced pipeline so that every stage reads exactly the previous stage's outputs, in order, and the
    first stage every model input: a value read further on than the next stage (made once and read by every layer;
    a model input only the loss reads) is passed on, unchanged, by each stage between (its gradient, where it has
    one, flows back the same way). Every stage returns a tuple; the last one the model's outputs, in order."""
    g = split_gm.graph
    calls = [n for n in g.nodes if n.op == "call_module"]
    roots = [n for n in g.nodes if n.op == "placeholder"]
    stage_of = {c: i for i, c in enumerate(calls)}
    produced = {r: -1 for r in roots}  # outer value -> the stage that makes it (-1: a model input)
    for n in g.nodes:
        if n.op == "call_function" and n.target is operator.getitem and n.args[0] in stage_of:
            produced[n] = stage_of[n.args[0]]
        elif n in stage_of and not any(u.op == "call_function" and u.target is operator.getitem for u in n.users):
            produced[n] = stage_of[n]  # a stage returning one value
    last_read: dict = {}  # outer value -> the last stage reading it (len(calls): the model's output)
    for c in calls:
        for a in c.args:
            if a not in produced:
                raise NotImplementedError(f"pipeline stage {stage_of[c]} reads {a} ({a.op}), which no stage returns; "
                                          "choose other stage boundaries")
            last_read[a] = max(last_read.get(a, -1), stage_of[c])
    output = next(n for n in g.nodes if n.op == "output")
    outs = list(output.args[0]) if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    for a in outs:
        if a not in produced:
            raise NotImplementedError(f"the model returns {a} ({a.op}), which no pipeline stage returns")
        last_read[a] = len(calls)
    order = {n: i for i, n in enumerate(g.nodes)}
    # live[k]: the values crossing the cut before stage k (k = len(calls): the model's outputs, in order)
    live = [roots] + [sorted((v for v, last in last_read.items() if produced[v] < k <= last), key=order.__getitem__)
                      for k in range(1, len(calls))] + [outs]
    for k, c in enumerate(calls):
        _rewire_stage(split_gm.get_submodule(c.target), c, live[k], live[k + 1], produced, stage=k)
    new = fx.Graph()
    new._codegen = g._codegen
    value = {r: new.placeholder(r.target) for r in roots}
    for k, c in enumerate(calls):
        call = new.call_module(c.target, tuple(value[v] for v in live[k]))
        value = {v: new.call_function(operator.getitem, (call, i)) for i, v in enumerate(live[k + 1])}
    new.output(tuple(value[v] for v in outs))
    split_gm.graph = new
    split_gm.recompile()


def _rewire_stage(sub: fx.GraphModule, call: fx.Node, inputs: list, outputs: list, produced: dict, *,
                  stage: int) -> None:
    """Give stage module ``sub`` (called by outer node ``call``) the placeholders ``inputs`` (outer values, in
    order) and the outputs ``outputs``: its own results, or inputs passed on."""
    g = sub.graph
    old = [n for n in g.nodes if n.op == "placeholder"]  # 1:1 with call.args
    inner_out = next(n for n in g.nodes if n.op == "output")
    results = inner_out.args[0]
    mine = {v: results[v.args[1]] if v.op == "call_function" else results  # a getitem of this stage's call
            for v in produced if produced[v] == stage and (v is call or v.args[0] is call)}
    had = dict(zip(call.args, old, strict=True))  # outer value -> the placeholder it arrives at
    if stage > 0 or list(call.args) != list(inputs):  # later stages: names no model keyword can take
        with g.inserting_before(next(iter(g.nodes))):
            fresh = {v: g.placeholder(v.target if stage == 0 else f"recv_{v.name}") for v in inputs}
        for v, ph in zip(call.args, old, strict=True):
            ph.replace_all_uses_with(fresh[v])
            g.erase_node(ph)
        had = fresh
        g._codegen = fx.graph.CodeGen()  # plain positional/keyword arguments, one per placeholder
    if stage > 0:  # the schedules hand a rank's keyword inputs to each stage it holds: only the first reads them
        with g.inserting_after([n for n in g.nodes if n.op == "placeholder"][-1]):
            g.placeholder("**model_kwargs")
    with g.inserting_before(inner_out):
        g.output(tuple(had[v] if v in had else mine[v] for v in outputs))
    g.erase_node(inner_out)
    g.lint()
    sub.recompile()


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
    hooks = [stage.register_forward_hook(  # the last stage's outputs: the tensors of the model's output
        lambda m, args, out, i=i: seen.__setitem__(i, (tuple(leaf(a) for a in args),
                                                       tuple(leaf(t) for t in tree_flatten(out)[0]))))
        for i, stage in enumerate(stages)]
    try:
        args, kwargs = microbatch
        whole(*args, **kwargs)
    finally:
        for h in hooks:
            h.remove()
        # the Pipe's interpreter keeps every value it computed (and the autograd graph behind them) until its next
        # run: a whole micro-batch's activations, on every rank, for as long as the Pipe lives
        whole.executor.env.clear()
        whole.executor.value_remap.clear()
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
    """The pipeline schedule the plan names (``loss_fn(output, target)`` runs on the last stage; a
    :class:`StageLoss` learns the model output's structure from the last stage's module, set by :func:`split_model`)."""
    if isinstance(loss_fn, StageLoss):
        loss_fn.output_spec = next((getattr(s.submod, "output_spec", None) for s in stages if s.is_last), None)
    cls = get_schedule_class(SCHEDULES[schedule])
    if issubclass(cls, PipelineScheduleSingle):
        if len(stages) != 1:
            raise ValueError(f"schedule {schedule!r} runs one stage per rank; use virtual_stages=1 or an "
                             "interleaved/looped schedule")
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn)
    return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn)


class StageLoss:
    """The cell's ``loss_fn(model, batch)`` on the last pipeline stage, with the model call answered by the stage's
    output in the structure the model returns (``output_spec``, a pytree spec; None: as the stage returns it); the
    schedule passes the micro-batch index as the target (``micro`` holds this step's micro-batches)."""

    def __init__(self, loss_fn):
        self.loss_fn, self.micro, self.output_spec = loss_fn, [], None

    def __call__(self, output, index):
        if self.output_spec is not None:
            output = tree_unflatten(list(output) if isinstance(output, (tuple, list)) else [output], self.output_spec)
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
        # the losses are all the step needs: the last stage keeps no outputs (a scalar loss in a model's output
        # could not be merged over the micro-batches, and the logits of every micro-batch would stay alive)
        schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
    if not has_last:
        return torch.zeros((), device=device)
    return torch.stack([x.detach().float() for x in losses]).mean()


class TiedGradients:
    """Parameters tied across pipeline stages (an embedding and its output head): every stage that uses one holds its
    own copy, initialised alike; after each backward their gradients are summed over the stages that hold them, so
    the copies stay equal (Megatron-LM's embedding group). A rank holding several stages may hold several copies:
    they are summed here first. Collective to build: every rank of ``mesh`` calls it."""

    def __init__(self, parts: list, ties: list, mesh):
        pp = mesh["pp"]
        self.groups = []  # (this rank's copies, process group of the holders or None, whether its first counts)
        for ties_of_one in ties:
            names = set(ties_of_one)
            mine = list({id(p): p for part in parts for name, p in part.named_parameters(remove_duplicate=False)
                         if canonical_name(name) in names}.values())  # every stage's copy, also under one name
            holders = [None] * pp.size()
            dist.all_gather_object(holders, bool(mine), group=pp.get_group())
            stages = [i for i, h in enumerate(holders) if h]
            if len(stages) < 2 and len(mine) < 2:
                continue  # one copy holds every use: autograd sums the gradient already
            group = None
            if len(stages) > 1:
                for column in mesh.mesh.permute(1, 2, 0).reshape(-1, pp.size()).tolist():  # every (dp, tp) position
                    ranks = [column[i] for i in stages]
                    made = dist.new_group(ranks)  # every rank takes part in creating every group
                    if dist.get_rank() in ranks:
                        group = made
            self.groups.append((mine, group, pp.get_local_rank() == stages[0]))

    def sync(self) -> None:
        """Sum the copies' gradients over the stages that hold them; every copy gets the sum."""
        for copies, group, _ in self.groups:
            grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in copies
                     if p.grad is not None]
            if not grads and group is None:
                continue
            total = torch.stack(grads).sum(0) if grads else torch.zeros_like(_local(copies[0]))
            if group is not None:
                dist.all_reduce(total, group=group)
            for p in copies:  # a copy no stage computed with (a module the pipe carries along) moves alike
                if p.grad is None and not isinstance(p, DTensor):
                    p.grad = total.clone()
                else:
                    (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).copy_(total)

    def repeated(self) -> list:
        """The copies a gradient norm must not count again (all but the first stage's first)."""
        return [p for copies, _, first in self.groups for p in (copies[1:] if first else copies)]


def _local(p):
    return p.to_local() if isinstance(p, DTensor) else p
