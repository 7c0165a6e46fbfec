"""A model cut into pipeline stages with ``torch.distributed.pipelining``.

The model is traced and split at the first layer of every stage (``pipeline()`` with
``SplitPoint.BEGINNING``), so any model the tracer handles works, not only ones written for
pipelining. Stage modules keep the original parameter names; the leaf modules the tracer turned into
graph interpreters are swapped back for the original ones (same parameters; a parameter tied to an
earlier stage's, a copy of it, as ``pipeline()`` makes) where they are called as the original was
(one tensor in, one out), so TP styles and checkpoint wrappers see real
``nn.Linear``/``nn.Embedding`` modules. The traced graph is first made to compute what eager does
(:mod:`.pp_graph`).
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed.pipelining import SplitPoint, pipeline
from torch.utils._pytree import tree_flatten

from .pp_graph import (
    attention_called_late,
    casts_as_in_eager,
    casts_follow_parameters,
    chain_stages,
    inputs_in_order_of_use,
    inputs_read_as_in_eager,
    masks_as_in_eager,
    splits_into_equal_parts,
)


def split_model(model: nn.Module, *, boundaries: list[str], microbatch: tuple[tuple, dict],
                loss_head: str = "",
                one_sequence_per_row: bool = False) -> tuple[list[nn.Module], nn.Module]:
    """Trace ``model`` on one micro-batch of inputs and cut it before each module in ``boundaries``.

    Returns one module per stage, with the original parameter names and leaf modules, each reading
    exactly the previous stage's outputs (:func:`chain_stages`), and the traced whole that calls
    them in order (what :func:`boundary_values` runs). ``loss_head``: the path of a module the last
    stage holds but does not run (the head ``plan.fused_loss`` fuses with the loss): it is traced as
    its input, so the last stage returns that in place of its output, and :class:`StageLoss` runs it
    on that input (:func:`hold_loss_head`). ``one_sequence_per_row``: the ``position_ids`` given
    number one sequence per row, though not from 0 in order (context parallelism's part of each
    sequence): masked as positions the model makes itself, causal attention.
    """
    args, kwargs = microbatch
    specs: list = []  # the structure of the model's output, seen while it is traced
    leaves: list = []  # its tensors, to find the loss head's output among them

    def seen_output(module, args, out) -> None:
        tensors, spec = tree_flatten(out)
        leaves.append(tensors)
        specs.append(spec)

    hook = model.register_forward_hook(seen_output)
    head, seen = (model.get_submodule(loss_head), []) if loss_head else (None, [])
    # its input in its place; what that returned is found among the model's outputs
    if head is not None:
        _swap(model, loss_head,
              _HeadInput()).register_forward_hook(lambda m, a, out: seen.append(out))
    # (a Hugging Face model's key/value cache is off: train.switch_off_kv_cache, which the script
    # calls)
    try:
        with (masks_as_in_eager(
                own_positions=one_sequence_per_row or "position_ids" not in (kwargs or {})),
              weights_on(model, _device_of(microbatch)) as originals):
            pipe = pipeline(model, mb_args=args, mb_kwargs=kwargs or None,
                            split_spec={path: SplitPoint.BEGINNING for path in boundaries})
    # torch.export's unflatten in torch 2.11 (the GPU image of 2026-12): one clear error
    except AssertionError as e:
        raise RuntimeError(f"torch {torch.__version__} could not split the model into pipeline "
                           f"stages ({e}); pipeline parallelism is tested with torch 2.13: upgrade "
                           "torch, or plan without pipelining (--fix pp=1)") from e
    finally:
        hook.remove()
        if head is not None:
            _swap(model, loss_head, head)
    _without_stand_ins(pipe.split_gm, originals)  # the stages hold the model's meta tensors again
    if pipe.num_stages != len(boundaries) + 1:
        raise ValueError(f"splitting at {boundaries} gave {pipe.num_stages} stages, not "
                         f"{len(boundaries) + 1}: a boundary must be a module the forward calls, "
                         "in order; check the plan's stage numbers")
    refuse_unrunnable_stages(pipe, boundaries, head)
    chain_stages(pipe.split_gm)
    inputs_read_as_in_eager(pipe.split_gm)  # first: it reads the casts as traced
    inputs_in_order_of_use(pipe.split_gm)
    splits_into_equal_parts(pipe.split_gm)
    casts_as_in_eager(pipe.split_gm)
    casts_follow_parameters(pipe.split_gm)
    attention_called_late(pipe.split_gm)
    pipe.executor = type(pipe.executor)(pipe.split_gm)  # the Pipe runs the rewritten graph
    originals = dict(model.named_modules())
    stages = [pipe.get_stage_module(i) for i in range(pipe.num_stages)]
    called = ({path for stage in stages
               for path, _ in stage.named_modules()} | ({loss_head} if loss_head else set()))
    taken: set[int] = set()  # parameters an earlier stage holds
    swapped: list[nn.Module] = []  # the traced leaves the originals replace
    for stage in stages:
        memo: dict = {}  # a tied parameter's copy, shared by this stage's modules
        # before the swap below, which would call the head itself
        if head is not None and stage is stages[-1]:
            hold_loss_head(stage, loss_head, head, leaves[-1] if leaves else [], seen, taken=taken,
                           memo=memo)
        for path, module in list(stage.named_modules()):
            original = originals.get(path)
            if (path and original is not None and module is not original
                and not list(original.children())
                    and list(original.parameters(recurse=False)) and _called_as_itself(module)):
                # tied to an earlier stage's: its own copy
                if any(id(p) in taken for p in original.parameters()):
                    original = copy.deepcopy(original, memo)
                parent, _, name = path.rpartition(".")
                stage.get_submodule(parent).register_module(name, original)
                swapped.append(module)
        _keep_first_names(stage, model, called, memo)
        taken |= {id(p) for p in stage.parameters()}
        stage.register_forward_hook(_contiguous_outputs)
    stages[-1].output_spec = specs[-1] if specs else None  # read by build_schedule for StageLoss
    # a replaced leaf may hold pipeline()'s own copy of a parameter several stages use (a tied
    # embedding); torch's executor still refers to it: its memory goes now
    _free_tensors(swapped, keep=_storages(*stages, model))
    return stages, pipe


_WHERE = "; STAGE_BOUNDARIES (plan.layers[*].stage) lists each stage's first layer"


def refuse_unrunnable_stages(pipe, boundaries: list[str], head: nn.Module | None = None) -> None:
    """One sentence naming the layer and what to do, before any stage is built, where the cut at
    ``boundaries`` gave stages the runtime cannot run: a stage that reads nothing the stage before
    computes, which torch's ``split_module`` then orders before it (its successor is called without
    the hidden states), and a stage that holds no parameters (DDP refuses to wrap it; a rank holding
    only it would build an optimizer over nothing). ``head``: the loss head the last stage holds but
    does not trace (its parameters count as the last stage's)."""
    stages = [pipe.get_stage_module(i) for i in range(pipe.num_stages)]
    order = [pipe.split_gm.get_submodule(n.target) for n in pipe.split_gm.graph.nodes
             if n.op == "call_module"]
    early = next((c for c, s in zip(order, stages, strict=True) if c is not s), None)
    if early is not None:
        m = next(i for i, s in enumerate(stages) if s is early)
        raise ValueError(f"pipeline stage {m} starts at {boundaries[m - 1]} but reads nothing "
                         f"stage {m - 1} computes, so the split runs it before stage {m - 1}: "
                         f"start stage {m} at a later layer, one that reads what stage {m - 1} "
                         f"computes, or keep {boundaries[m - 1]} on stage {m - 1}" + _WHERE)
    for i, stage in enumerate(stages):
        if not [*stage.parameters(),
                *(head.parameters() if head is not None and i == len(stages) - 1 else ())]:
            _no_parameters(i, boundaries)


def _no_parameters(i: int, boundaries: list[str]) -> None:
    at = f"starts at {boundaries[i - 1]}" if i else f"ends before {boundaries[0]}"
    fix = (f"keep {boundaries[i - 1]} on stage {i - 1}, or start stage {i} at a later layer" if i
           else f"start stage 1 at a later layer than {boundaries[0]}")
    raise ValueError(f"pipeline stage {i} {at} and holds no parameters, so DDP cannot wrap it and "
                     f"a rank holding only it has nothing to optimise: {fix}, so that every stage "
                     "holds some" + _WHERE)


@contextlib.contextmanager
def weights_on(model: nn.Module, device: torch.device):
    """Run or trace ``model``, built on the meta device (its weights made later, stage by stage:
    ``materialize``), as on ``device``: its meta parameters and buffers are replaced, for the block,
    by fake tensors on ``device`` (shapes, no storage) and a ``FakeTensorMode`` runs (real inputs
    join it). On meta itself the model's code is traced as it runs on meta: a device it names is
    recorded as meta (Hugging Face's position ids, ``arange(n, device=inputs_embeds.device)``, made
    meta in the run among real tensors: "Tensor on device meta is not on the expected device cpu"),
    a real input meeting a meta weight fails the trace (ViT's pixels and its patch convolution), and
    code that branches on the device takes the meta branch (Mixtral's ``histc``: on CPU it counts
    float ids, elsewhere int ones, which CPU's histc cannot). Yields {id(stand-in): the meta tensor}
    (a model with no meta tensors: nothing replaced, no mode)."""
    originals: dict[int, torch.Tensor] = {}
    stand_in: dict[int, torch.Tensor] = {}  # by the meta tensor: a tied one gets one stand-in
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    replaced = []
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if isinstance(t, torch.Tensor) and t.is_meta and not isinstance(t, FakeTensor):
                    if id(t) not in stand_in:
                        fake = FakeTensor(mode, t.detach(), device)
                        stand_in[id(t)] = (nn.Parameter(fake, t.requires_grad)
                                           if isinstance(t, nn.Parameter) else fake)
                        originals[id(stand_in[id(t)])] = t
                    replaced.append((table, name, t))
    if not replaced:
        yield originals
        return
    for table, name, t in replaced:
        table[name] = stand_in[id(t)]
    try:
        with mode, warnings.catch_warnings():
            # pipeline() deep-copies a parameter several stages use, which asks a stand-in for its
            # (absent) storage
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            yield originals
    finally:
        for table, name, t in replaced:
            table[name] = t


def _without_stand_ins(root: nn.Module, originals: dict[int, torch.Tensor]) -> None:
    """Give every module below ``root`` back the meta tensors :func:`weights_on` stood in for
    (``originals``); a stand-in the tracer copied (a parameter several stages use) becomes a new
    meta tensor of its shape."""
    made: dict[int, torch.Tensor] = {}
    for module in root.modules():
        for table in (module._parameters, module._buffers, module.__dict__):
            for name, t in list(table.items()):
                if isinstance(t, FakeTensor) or (isinstance(t, nn.Parameter)
                                                 and isinstance(t.data, FakeTensor)):
                    if id(t) not in originals and id(t) not in made:
                        meta = _meta_like(t)
                        made[id(t)] = (nn.Parameter(meta, t.requires_grad)
                                       if isinstance(t, nn.Parameter) else meta)
                    table[name] = originals.get(id(t), made.get(id(t)))


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor of ``t``'s shape, strides and dtype (``t`` real, meta or fake; call it outside
    a fake mode)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _device_of(microbatch) -> torch.device:
    """Where the run's inputs are (the first tensor among them; none: the CPU)."""
    return next((t.device for t in tree_flatten(microbatch)[0] if isinstance(t, torch.Tensor)),
                torch.device("cpu"))


class _HeadInput(nn.Module):
    """The loss head's stand-in while the pipeline is traced: its input, as a view (one graph node,
    so that a last stage cut before the head, holding nothing else, still has a graph: it passes the
    head's input on)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)


def _swap(model: nn.Module, path: str, module: nn.Module) -> nn.Module:
    """Register ``module`` at ``path`` of ``model`` (in place of what is there); returns it."""
    parent, _, name = path.rpartition(".")
    (model.get_submodule(parent) if parent else model).register_module(name, module)
    return module


def hold_loss_head(stage: nn.Module, path: str, head: nn.Module, outputs: list, seen: list, *,
                   taken: set[int], memo: dict) -> None:
    """Make the last ``stage`` hold the loss ``head`` at its model path ``path`` (its own copy where
    an earlier stage holds one of its parameters, as a tied parameter is copied: ``taken``,
    ``memo``), and note which of the stage's outputs (the model's output tensors, ``outputs``, as
    traced) is its input (``seen``: what the stand-in traced in its place returned):
    ``stage.loss_head`` (path, index), read by :class:`StageLoss`."""
    index = next((i for i, t in enumerate(outputs) if seen and t is seen[-1]), None)
    if index is None:
        raise ValueError(f"the loss head {path} ran {len(seen)} times and its output is not one of "
                         "the model's output tensors unchanged (the model transforms it): the head "
                         "cannot be fused with the loss under pipelining; re-plan with fix "
                         "fused_loss=False")
    # tied to an earlier stage's (GPT-2's wte): its own copy
    if any(id(p) in taken for p in head.parameters()):
        head = copy.deepcopy(head, memo)
    _inline_stand_in(stage, path)
    parent = stage
    *within, name = path.split(".")
    for part in within:  # its parents, where the stage's graph has none: empty modules (names kept)
        if part not in parent._modules:
            parent.register_module(part, nn.Module())
        parent = parent._modules[part]
    parent.register_module(name, head)
    stage.loss_head = (path, index)


def _inline_stand_in(stage: nn.Module, path: str) -> None:
    """Replace the stage's calls of the traced :class:`_HeadInput` at model path ``path`` (where the
    loss head goes) with the view it computes, and drop its traced module."""
    for prefix, module in list(stage.named_modules()):
        if not isinstance(module, fx.GraphModule):
            continue
        for node in list(module.graph.nodes):
            if node.op == "call_module" and f"{prefix}.{node.target}".lstrip(".") == path:
                with module.graph.inserting_before(node):
                    node.replace_all_uses_with(module.graph.call_method("view_as",
                                                                        (node.args[0],
                                                                         node.args[0])))
                module.graph.erase_node(node)
                module.delete_submodule(node.target)
                module.recompile()


def _keep_first_names(stage: nn.Module, model: nn.Module, called: set[str], copies: dict) -> None:
    """Name a stage's tied parameters as the model does (its first name: what checkpoints and the
    single-process run use), where the stage holds one (or its copy: ``copies``, a deepcopy memo)
    under another: on its owner module when the stage has it (BERT's ``cls.predictions.bias``, also
    the called decoder's bias); a top-level module no stage calls (T5's ``shared``, tied to the
    embeddings that are called) joins the stage under its own path, first."""
    held = {id(p): p for p in stage.parameters()}
    names = {n for n, _ in stage.named_parameters()}
    have = dict(stage.named_modules())
    for name, p in model.named_parameters():
        mine = held.get(id(p), held.get(id(copies.get(id(p)))))
        owner, _, attr = name.rpartition(".")
        if (mine is not None and name not in names and owner in have
            and attr not in have[owner]._parameters):
            have[owner].register_parameter(attr, mine)
    first = [(path, module) for path, module in model.named_children()
             if path not in called and (own := list(module.parameters()))
             and all(id(p) in held for p in own)]
    if first:
        stage._modules = dict(first) | stage._modules  # named_parameters() meets them first


def _called_as_itself(traced: nn.Module) -> bool:
    """Whether a traced leaf module takes one tensor and returns one, as the original did: export
    may give it other inputs (a rotary embedding's unused ``x`` dropped) or outputs (beyond what
    :func:`inputs_read_as_in_eager` gives back), and then the original would not fit the graph."""
    graph = getattr(traced, "graph", None)
    if graph is None:
        return False
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    output = next(n for n in graph.nodes if n.op == "output")
    return len(inputs) == 1 and isinstance(output.args[0], fx.Node)


def _contiguous_outputs(module, args, output):
    """Stage outputs are sent to the next rank as they are, and gloo sends only contiguous tensors
    (a cut after a transpose or an expand would fail)."""
    if isinstance(output, torch.Tensor):
        return output.contiguous()
    if isinstance(output, (tuple, list)):
        return type(output)(t.contiguous() if isinstance(t, torch.Tensor) else t for t in output)
    return output


def boundary_values(whole: nn.Module, stages: list[nn.Module], microbatch: tuple[tuple, dict]
                    ) -> list[tuple[tuple, tuple]]:
    """What enters and leaves each stage, from one micro-batch run through the traced whole
    (unsharded): the static shapes the stages are built with, so no shape inference runs on made-up
    tensors (integer ids made up for it could index out of an embedding)."""
    # shape and dtype only (on meta: nothing kept); requires_grad tells which gradients travel back
    def leaf(t):
        return _meta_like(t).requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t

    seen: dict[int, tuple[tuple, tuple]] = {}
    # the last stage's outputs: the tensors of the model's output
    hooks = [stage.register_forward_hook(
        lambda m, args, out, i=i: seen.__setitem__(i, (args, tuple(tree_flatten(out)[0]))))
        for i, stage in enumerate(stages)]
    try:
        args, kwargs = microbatch
        # a model built on meta: run as on the inputs' device
        with weights_on(whole.split_gm, _device_of(microbatch)):
            whole(*args, **kwargs)
    finally:
        for h in hooks:
            h.remove()
        # the Pipe's interpreter keeps every value it computed (and the autograd graph behind them)
        # until its next run: a whole micro-batch's activations, on every rank, for as long as the
        # Pipe lives
        whole.executor.env.clear()
        whole.executor.value_remap.clear()
    seen = {i: (tuple(leaf(a) for a in ins), tuple(leaf(t) for t in outs))
            for i, (ins, outs) in seen.items()}
    return [seen[i] for i in range(len(stages))]


def release_stages(model: nn.Module, stages: list[nn.Module], keep: list[int]) -> None:
    """Free the parameters and buffers of the stages this rank does not hold (``keep``: those it
    does): the whole ``model`` (the cell's, traced by :func:`split_model`) and those stages' modules
    register meta tensors of the same shapes instead (:func:`_free_tensors`); a tensor a held stage
    uses stays."""
    # a held stage's modules (often the model's own)
    mine = {id(m) for i in keep for m in stages[i].modules()}
    others = (m for i, stage in enumerate(stages) if i not in keep for m in stage.modules())
    _free_tensors([m for m in (*model.modules(), *others) if id(m) not in mine],
                  keep=_storages(*(stages[i] for i in keep)))


def _storages(*modules: nn.Module) -> set[int]:
    """The storages (data pointers) of the real parameters and buffers below ``modules``."""
    return {t.untyped_storage().data_ptr() for m in modules for t in (*m.parameters(), *m.buffers())
            if t.device.type != "meta"}


def _free_tensors(modules: list[nn.Module], *, keep: set[int]) -> None:
    """Replace the real tensors ``modules`` hold (registered, and plain attributes) by meta tensors
    of the same shapes, unless their storage is in ``keep``, and empty their storage: a later use of
    a freed one raises (a meta tensor), never reads freed memory, and the module tree torch.export
    made, which nothing runs again, holds no memory (a memory-mapped checkpoint's storage, which
    cannot be resized, goes with its last reference)."""
    for module in modules:
        for table in (module._parameters, module._buffers, module.__dict__):
            for name, t in list(table.items()):
                if (not isinstance(t, torch.Tensor) or t.device.type == "meta"
                    or t.untyped_storage().data_ptr() in keep):
                    continue
                meta = torch.empty_like(t, device="meta")
                table[name] = (nn.Parameter(meta, requires_grad=t.requires_grad)
                               if isinstance(t, nn.Parameter) else meta)
                if t.untyped_storage().resizable():
                    t.untyped_storage().resize_(0)
