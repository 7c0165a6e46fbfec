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

import contextlib
import copy
import operator
import sys
import warnings

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed import ProcessGroup
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage, SplitPoint, pipeline
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
from torch.distributed.tensor import DTensor
from torch.export.unflatten import InterpreterModule
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._pytree import tree_flatten, tree_unflatten

from .data import model_call, split_batch
from .init import canonical_name

# plan schedule name -> torch.distributed.pipelining class name
SCHEDULES = {
    "gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B", "looped_bfs": "LoopedBFS",
    "interleaved_zero_bubble": "InterleavedZeroBubble", "zbv_zero_bubble": "ZBVZeroBubble",
}
V_SCHEDULES = ("zbv_zero_bubble",)  # stages placed in a V: rank r holds stages r and 2*pp-1-r
# each backward split into an input pass and a later weight pass (torch's stage_backward_input and
# stage_backward_weight): FSDP stages keep their parameters gathered after forward (keep_gathered)
SPLIT_BACKWARD = ("interleaved_zero_bubble", "zbv_zero_bubble")


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


def split_model(model: nn.Module, *, boundaries: list[str], microbatch: tuple[tuple, dict], loss_head: str = ""
                ) -> tuple[list[nn.Module], nn.Module]:
    """Trace ``model`` on one micro-batch of inputs and cut it before each module in ``boundaries``.

    Returns one module per stage, with the original parameter names and leaf modules, each reading exactly the
    previous stage's outputs (:func:`chain_stages`), and the traced whole that calls them in order (what
    :func:`boundary_values` runs). ``loss_head``: the path of a module the last stage holds but does not run (the
    head ``plan.fused_loss`` fuses with the loss): it is traced as its input, so the last stage returns that
    in place of its output, and :class:`StageLoss` runs it on that input (:func:`hold_loss_head`).
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
    if head is not None:  # its input in its place; what that returned is found among the model's outputs
        _swap(model, loss_head, _HeadInput()).register_forward_hook(lambda m, a, out: seen.append(out))
    try:  # (a Hugging Face model's key/value cache is off: train.switch_off_kv_cache, which the script calls)
        with (masks_as_in_eager(own_positions="position_ids" not in (kwargs or {})),
              weights_on(model, _device_of(microbatch)) as originals):
            pipe = pipeline(model, mb_args=args, mb_kwargs=kwargs or None,
                            split_spec={path: SplitPoint.BEGINNING for path in boundaries})
    except AssertionError as e:  # torch.export's unflatten in torch 2.11 (the GPU image of 2026-12): one clear error
        raise RuntimeError(f"torch {torch.__version__} could not split the model into pipeline stages ({e}); "
                           "pipeline parallelism is tested with torch 2.13: upgrade torch, or plan without "
                           "pipelining (--fix pp=1)") from e
    finally:
        hook.remove()
        if head is not None:
            _swap(model, loss_head, head)
    _without_stand_ins(pipe.split_gm, originals)  # the stages hold the model's meta tensors again
    if pipe.num_stages != len(boundaries) + 1:
        raise ValueError(f"splitting at {boundaries} gave {pipe.num_stages} stages, not {len(boundaries) + 1}: a "
                         "boundary must be a module the forward calls, in order; check the plan's stage numbers")
    chain_stages(pipe.split_gm)
    inputs_read_as_in_eager(pipe.split_gm)  # first: it reads the casts as traced
    inputs_in_order_of_use(pipe.split_gm)
    splits_into_equal_parts(pipe.split_gm)
    casts_as_in_eager(pipe.split_gm)
    casts_follow_parameters(pipe.split_gm)
    pipe.executor = type(pipe.executor)(pipe.split_gm)  # the Pipe runs the rewritten graph
    originals = dict(model.named_modules())
    stages = [pipe.get_stage_module(i) for i in range(pipe.num_stages)]
    called = {path for stage in stages for path, _ in stage.named_modules()} | ({loss_head} if loss_head else set())
    taken: set[int] = set()  # parameters an earlier stage holds
    swapped: list[nn.Module] = []  # the traced leaves the originals replace
    for stage in stages:
        memo: dict = {}  # a tied parameter's copy, shared by this stage's modules
        if head is not None and stage is stages[-1]:  # before the swap below, which would call the head itself
            hold_loss_head(stage, loss_head, head, leaves[-1] if leaves else [], seen, taken=taken, memo=memo)
        for path, module in list(stage.named_modules()):
            original = originals.get(path)
            if (path and original is not None and module is not original and not list(original.children())
                    and list(original.parameters(recurse=False)) and _called_as_itself(module)):
                if any(id(p) in taken for p in original.parameters()):  # tied to an earlier stage's: its own copy
                    original = copy.deepcopy(original, memo)
                parent, _, name = path.rpartition(".")
                stage.get_submodule(parent).register_module(name, original)
                swapped.append(module)
        _keep_first_names(stage, model, called, memo)
        taken |= {id(p) for p in stage.parameters()}
        stage.register_forward_hook(_contiguous_outputs)
    stages[-1].output_spec = specs[-1] if specs else None  # read by build_schedule for StageLoss
    # a replaced leaf may hold pipeline()'s own copy of a parameter several stages use (a tied embedding); torch's
    # executor still refers to it: its memory goes now
    _free_tensors(swapped, keep=_storages(*stages, model))
    return stages, pipe


@contextlib.contextmanager
def weights_on(model: nn.Module, device: torch.device):
    """Run or trace ``model``, built on the meta device (its weights made later, stage by stage: ``materialize``),
    as on ``device``: its meta parameters and buffers are replaced, for the block, by fake tensors on ``device``
    (shapes, no storage) and a ``FakeTensorMode`` runs (real inputs join it). On meta itself the model's code is
    traced as it runs on meta: a device it names is recorded as meta (Hugging Face's position ids,
    ``arange(n, device=inputs_embeds.device)``, made meta in the run among real tensors: "Tensor on device meta is
    not on the expected device cpu"), a real input meeting a meta weight fails the trace (ViT's pixels and its patch
    convolution), and code that branches on the device takes the meta branch (Mixtral's ``histc``: on CPU it counts
    float ids, elsewhere int ones, which CPU's histc cannot). Yields {id(stand-in): the meta tensor} (a model with
    no meta tensors: nothing replaced, no mode)."""
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
                        stand_in[id(t)] = nn.Parameter(fake, t.requires_grad) if isinstance(t, nn.Parameter) else fake
                        originals[id(stand_in[id(t)])] = t
                    replaced.append((table, name, t))
    if not replaced:
        yield originals
        return
    for table, name, t in replaced:
        table[name] = stand_in[id(t)]
    try:
        with mode, warnings.catch_warnings():
            # pipeline() deep-copies a parameter several stages use, which asks a stand-in for its (absent) storage
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            yield originals
    finally:
        for table, name, t in replaced:
            table[name] = t


def _without_stand_ins(root: nn.Module, originals: dict[int, torch.Tensor]) -> None:
    """Give every module below ``root`` back the meta tensors :func:`weights_on` stood in for (``originals``); a
    stand-in the tracer copied (a parameter several stages use) becomes a new meta tensor of its shape."""
    made: dict[int, torch.Tensor] = {}
    for module in root.modules():
        for table in (module._parameters, module._buffers, module.__dict__):
            for name, t in list(table.items()):
                if isinstance(t, FakeTensor) or (isinstance(t, nn.Parameter) and isinstance(t.data, FakeTensor)):
                    if id(t) not in originals and id(t) not in made:
                        meta = _meta_like(t)
                        made[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
                    table[name] = originals.get(id(t), made.get(id(t)))


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor of ``t``'s shape, strides and dtype (``t`` real, meta or fake; call it outside a fake mode)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _device_of(microbatch) -> torch.device:
    """Where the run's inputs are (the first tensor among them; none: the CPU)."""
    return next((t.device for t in tree_flatten(microbatch)[0] if isinstance(t, torch.Tensor)), torch.device("cpu"))


class _HeadInput(nn.Module):
    """The loss head's stand-in while the pipeline is traced: its input, as a view (one graph node, so that a last
    stage cut before the head, holding nothing else, still has a graph: it passes the head's input on)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)


def _swap(model: nn.Module, path: str, module: nn.Module) -> nn.Module:
    """Register ``module`` at ``path`` of ``model`` (in place of what is there); returns it."""
    parent, _, name = path.rpartition(".")
    (model.get_submodule(parent) if parent else model).register_module(name, module)
    return module


def hold_loss_head(stage: nn.Module, path: str, head: nn.Module, outputs: list, seen: list, *, taken: set[int],
                   memo: dict) -> None:
    """Make the last ``stage`` hold the loss ``head`` at its model path ``path`` (its own copy where an earlier
    stage holds one of its parameters, as a tied parameter is copied: ``taken``, ``memo``), and note which of the
    stage's outputs (the model's output tensors, ``outputs``, as traced) is its input (``seen``: what the stand-in
    traced in its place returned): ``stage.loss_head`` (path, index), read by :class:`StageLoss`."""
    index = next((i for i, t in enumerate(outputs) if seen and t is seen[-1]), None)
    if index is None:
        raise ValueError(f"the loss head {path} ran {len(seen)} times and its output is not one of the "
                         "model's output tensors unchanged (the model transforms it): the head cannot be fused with "
                         "the loss under pipelining; re-plan with fix fused_loss=False")
    if any(id(p) in taken for p in head.parameters()):  # tied to an earlier stage's (GPT-2's wte): its own copy
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
    """Replace the stage's calls of the traced :class:`_HeadInput` at model path ``path`` (where the loss head
    goes) with the view it computes, and drop its traced module."""
    for prefix, module in list(stage.named_modules()):
        if not isinstance(module, fx.GraphModule):
            continue
        for node in list(module.graph.nodes):
            if node.op == "call_module" and f"{prefix}.{node.target}".lstrip(".") == path:
                with module.graph.inserting_before(node):
                    node.replace_all_uses_with(module.graph.call_method("view_as", (node.args[0], node.args[0])))
                module.graph.erase_node(node)
                module.delete_submodule(node.target)
                module.recompile()


@contextlib.contextmanager
def masks_as_in_eager(*, own_positions: bool):
    """While the pipeline is traced, Hugging Face's masking skips a plain causal or bidirectional mask as its eager
    forward does (SDPA's ``is_causal``, or no mask at all; with grouped-query attention SDPA then reads the key/value
    heads as they are). Under ``torch.export`` it never skips: an exported model may later run with other query
    lengths, and the position ids it makes (``own_positions``: the batch has none) cannot be read to rule out packed
    sequences. The pipeline's graph runs only at the shapes it was traced with, and positions the model makes are
    0..n-1 in every row. Without this every layer of a stage would save a float copy of the mask and, with GQA, its
    keys and values repeated to every head: about 12 % more activation memory than the same layers hold unpipelined
    (LLaMA at tests/memcells.py's size); an encoder (ViT, BERT without an attention mask) would send an all-True
    mask between stages and save its float copy in every layer. A padding mask, a sliding window, unequal query and
    key lengths or position ids in the batch go the original way; a model that is not a Hugging Face one is
    untouched."""
    masking = sys.modules.get("transformers.masking_utils")
    skip_causal = getattr(masking, "_ignore_causal_mask_sdpa", None)
    skip_bidirectional = getattr(masking, "_ignore_bidirectional_mask_sdpa", None)
    find_packed = getattr(masking, "find_packed_sequence_indices", None)
    if skip_causal is None or find_packed is None:
        yield
        return

    def causal(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None):
        if padding_mask is None and q_length == kv_length and local_attention_size is None:
            return True
        return skip_causal(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size)

    def bidirectional(padding_mask, kv_length, local_attention_size=None):
        if padding_mask is None and (local_attention_size is None or kv_length < local_attention_size):
            return True
        return skip_bidirectional(padding_mask, kv_length, local_attention_size)

    patches = {"_ignore_causal_mask_sdpa": causal}
    if skip_bidirectional is not None:  # (older transformers have no bidirectional skip)
        patches["_ignore_bidirectional_mask_sdpa"] = bidirectional
    if own_positions:
        patches["find_packed_sequence_indices"] = lambda position_ids: None
    saved = {name: getattr(masking, name) for name in patches}
    for name, fn in patches.items():
        setattr(masking, name, fn)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(masking, name, fn)


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
    inputs (a rotary embedding's unused ``x`` dropped) or outputs (beyond what
    :func:`inputs_read_as_in_eager` gives back), and then the original would not fit the graph."""
    graph = getattr(traced, "graph", None)
    if graph is None:
        return False
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    output = next(n for n in graph.nodes if n.op == "output")
    return len(inputs) == 1 and isinstance(output.args[0], fx.Node)


def inputs_read_as_in_eager(root: nn.Module) -> int:
    """Give back to the caller the reads of a traced leaf's input that the trace put in the leaf.

    ``x.to(dtype)`` of an ``x`` of that dtype returns ``x`` itself, and torch.export then takes
    every later read of ``x`` for a read of the cast: a Hugging Face RMSNorm
    (``hidden_states.to(torch.float32)``) is traced returning its input too, which the block
    reads as its residual. Such a leaf returns two values where the module returns one, so the
    original module cannot take its place again, and a TP style on it (sequence parallelism on
    the norms) meets a list. Each output of a traced module that is its own input (through casts
    that were no-ops when traced) is read from the caller's argument instead, as in eager, and
    the module stops returning it. Applied to every graph below ``root``; returns how many it
    rewrote.
    """
    count = 0
    for module in list(root.modules()):
        graph = getattr(module, "graph", None)
        if not isinstance(graph, fx.Graph):
            continue
        rewrote = 0
        for call in [n for n in graph.nodes if n.op == "call_module"]:
            leaf = module.get_submodule(call.target)  # not a stage: stages pass inputs on
            if isinstance(leaf, InterpreterModule) and not call.kwargs:
                rewrote += _read_inputs_in_caller(graph, call, leaf)
        if rewrote:
            _recompile(module)
            count += rewrote
    return count


def _read_inputs_in_caller(graph: fx.Graph, call: fx.Node, leaf: nn.Module) -> int:
    """:func:`inputs_read_as_in_eager` for one call of ``leaf`` in ``graph``."""
    inner = leaf.graph
    placeholders = [n for n in inner.nodes if n.op == "placeholder"]
    output = next(n for n in inner.nodes if n.op == "output")
    results = output.args[0]
    items = [u for u in call.users if u.op == "call_function" and u.target is operator.getitem]
    if (not isinstance(results, (list, tuple)) or len(placeholders) != len(call.args)
            or len(items) != len(call.users)):
        return 0
    given = {}  # output index -> index of the input it is
    for i, result in enumerate(results):
        source = _passed_through(result)
        if source in placeholders:
            given[i] = placeholders.index(source)
    if not given or len(given) == len(results):
        return 0
    kept = [i for i in range(len(results)) if i not in given]
    for item in items:
        i = item.args[1]
        if i in given or len(kept) == 1:
            item.replace_all_uses_with(call.args[given[i]] if i in given else call)
            graph.erase_node(item)
        else:
            item.args = (call, kept.index(i))
    left = [results[i] for i in kept]
    output.args = (left[0] if len(kept) == 1 else type(results)(left),)
    _recompile(leaf)
    return len(given)


def _passed_through(node):
    """The placeholder ``node`` is, through casts that were no-ops when traced; else None."""
    while (isinstance(node, fx.Node) and node.op == "call_function"
           and node.target is torch.ops.aten.to.dtype):
        before, after = node.args[0].meta.get("val"), node.meta.get("val")
        if not (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor)
                and before.dtype == after.dtype):
            return None
        node = node.args[0]
    return node if isinstance(node, fx.Node) and node.op == "placeholder" else None


def inputs_in_order_of_use(root: nn.Module) -> int:
    """Give every traced module below ``root`` its inputs in the order its code first reads them.

    torch.export's unflattener inserts each input it finds at the top of the module's graph, so a
    traced module takes its inputs in reverse order of first use: a Hugging Face decoder layer or
    attention module takes the rotary cos/sin first and its hidden states last, and a style that
    prepares a module's first input (``PrepareFirstInput``: where the TP plan shards or gathers
    the hidden states) would lay out the rotary cos. A module that starts on its first argument,
    as these do, takes it first again. Returns how many modules it reordered.
    """
    count = 0
    for module in list(root.modules()):
        graph = getattr(module, "graph", None)
        if not isinstance(graph, fx.Graph):
            continue
        calls: dict[str, list[fx.Node]] = {}
        for node in graph.nodes:
            if node.op == "call_module":
                calls.setdefault(node.target, []).append(node)
        reordered = 0
        for target, nodes in calls.items():
            leaf = module.get_submodule(target)
            if isinstance(leaf, InterpreterModule) and all(not n.kwargs for n in nodes):
                reordered += _order_inputs_by_use(leaf, nodes)
        if reordered:
            _recompile(module)  # its calls pass the inputs in the new order
            count += reordered
    return count


def _order_inputs_by_use(leaf: nn.Module, calls: list[fx.Node]) -> int:
    """:func:`inputs_in_order_of_use` for one traced module and its calls (1: reordered)."""
    graph = leaf.graph
    position = {n: i for i, n in enumerate(graph.nodes)}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if any(len(c.args) != len(placeholders) for c in calls):
        return 0
    first = {p: min((position[u] for u in p.users), default=len(position)) for p in placeholders}
    order = sorted(range(len(placeholders)), key=lambda i: (first[placeholders[i]], i))
    if order == list(range(len(placeholders))):
        return 0
    body = next(n for n in graph.nodes if n.op != "placeholder")  # the output at least
    for i in order:
        body.prepend(placeholders[i])
    for c in calls:
        c.args = tuple(c.args[i] for i in order)
    leaf.arg_names = [placeholders[i].target for i in order]  # how keyword inputs are matched
    _recompile(leaf)
    return 1


def splits_into_equal_parts(root: nn.Module) -> int:
    """Make each traced ``split`` that cut a tensor into equal parts cut it into as many equal
    parts whatever its width when it runs.

    The trace fixes the width the code computed from the model's global sizes (GPT-2's
    ``c_attn(x).split(self.split_size, dim=2)``; a ``chunk`` is traced as such a split). Under
    tensor parallelism a packed projection's output holds every part at its per-rank width
    (``PackedColwiseParallel``), which the eager code splits by its per-rank ``split_size``
    (``set_local_sizes``). At the traced shapes nothing changes. Applied to every graph below
    ``root``; returns how many splits it rewrote.
    """
    split = torch.ops.aten.split.Tensor
    count = 0
    for module in list(root.modules()):
        graph = getattr(module, "graph", None)
        if not isinstance(graph, fx.Graph):
            continue
        rewrote = 0
        for node in [n for n in graph.nodes if n.op == "call_function" and n.target is split]:
            x, size = node.args[:2]
            dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
            traced = getattr(x, "meta", {}).get("val")
            if not isinstance(traced, torch.Tensor) or not isinstance(size, int) or size <= 0:
                continue
            width = traced.shape[dim]
            if isinstance(width, int) and width % size == 0 and width // size > 1:
                node.target, node.args, node.kwargs = equal_parts, (x, width // size, dim), {}
                rewrote += 1
        if rewrote:
            _recompile(module)
            count += rewrote
    return count


def equal_parts(x: torch.Tensor, parts: int, dim: int) -> tuple:
    """``x`` split into ``parts`` equal parts along ``dim``."""
    return torch.split(x, x.shape[dim] // parts, dim)


def _recompile(module: nn.Module) -> None:
    """Regenerate a traced module's code after its graph changed (an unflattened module runs its
    graph, and keeps a compiled copy)."""
    compiled = module if isinstance(module, fx.GraphModule) else module.__dict__.get("graph_module")
    if isinstance(compiled, fx.GraphModule):
        compiled.recompile()


def casts_as_in_eager(root: nn.Module) -> int:
    """Give back the dtype casts torch.export drops: traced without autocast, ``x.float()`` of a float32 ``x`` is a
    no-op, left in the graph as ``aten._assert_tensor_metadata(x, dtype=float32)`` only, which fails once the stage
    runs under autocast and ``x`` is 16-bit (Mixtral's router: ``softmax(router_logits.float())``). Each such
    assertion becomes the cast itself (``x.to(dtype)``: nothing when ``x`` has that dtype), read by every later user
    of ``x``, as the eager code's cast was. Applied to every graph below ``root``; returns how many it rewrote."""
    assert_meta = torch.ops.aten._assert_tensor_metadata.default
    count = 0
    for module in root.modules():
        graph = getattr(module, "graph", None)
        if not isinstance(graph, fx.Graph):
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        asserts = [n for n in graph.nodes if n.op == "call_function" and n.target is assert_meta]
        for node in asserts:
            dtype, x = node.kwargs.get("dtype"), node.args[0]
            if dtype is None or not isinstance(x, fx.Node):
                continue
            with graph.inserting_after(node):
                cast = graph.call_function(torch.ops.aten.to.dtype, (x, dtype))
            for user in [u for u in x.users if u is not cast and u is not node and order.get(u, -1) > order[node]]:
                user.replace_input_with(x, cast)
            graph.erase_node(node)
            count += 1
        compiled = module if isinstance(module, fx.GraphModule) else module.__dict__.get("graph_module")
        if asserts and isinstance(compiled, fx.GraphModule):  # an unflattened module's codegen copy, too
            compiled.recompile()
    return count


def casts_follow_parameters(root: nn.Module) -> int:
    """Make each traced cast to the dtype of a parameter it meets follow that parameter's dtype
    when it runs.

    Eager code writes ``x.to(weight.dtype)`` before an op that reads ``weight`` (Mixtral's experts
    before their grouped matmul), and the trace records the dtype the weight had then, float32.
    FSDP's mixed precision gathers the weight in bf16 for the forward: the eager code would cast
    ``x`` to bf16, the traced graph casts it to float32 and the op meets two dtypes. Each cast
    whose result an op reads beside a parameter (or a view of one) of the cast's traced dtype
    becomes :func:`cast_like` of that parameter: the same cast wherever the dtypes are as traced.
    Applied to every graph below ``root``; returns how many casts it rewrote.
    """
    count = 0
    for module in list(root.modules()):
        graph = getattr(module, "graph", None)
        if not isinstance(graph, fx.Graph):
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        rewrote = 0
        for cast in [n for n in graph.nodes if n.op == "call_function"
                     and n.target is torch.ops.aten.to.dtype]:
            like = next((a for u in cast.users for a in u.all_input_nodes
                         if a is not cast and order[a] < order[cast]
                         and _parameter_dtype(module, a) == cast.args[1]), None)
            if like is not None:
                cast.target, cast.args = cast_like, (cast.args[0], like)
                rewrote += 1
        if rewrote:
            _recompile(module)
            count += rewrote
    return count


_VIEWS = {torch.ops.aten.transpose.int, torch.ops.aten.t.default, torch.ops.aten.view.default,
          torch.ops.aten.reshape.default, torch.ops.aten.permute.default,
          torch.ops.aten.select.int, torch.ops.aten.slice.Tensor,
          torch.ops.aten.unsqueeze.default, torch.ops.aten.expand.default}
"""ops that view one tensor (a parameter read through them is still that parameter)"""


def _parameter_dtype(module: nn.Module, node: fx.Node):
    """The dtype of the parameter of ``module`` that ``node`` reads (through views), or None."""
    while node.op == "call_function" and node.target in _VIEWS:
        node = node.args[0]
    if node.op != "get_attr":
        return None
    try:
        return module.get_parameter(node.target).dtype
    except AttributeError:  # a buffer or a constant
        return None


def cast_like(x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``x`` in ``other``'s dtype."""
    return x.to(other.dtype)


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
    def leaf(t):  # shape and dtype only (on meta: nothing kept); requires_grad tells which gradients travel back
        return _meta_like(t).requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t

    seen: dict[int, tuple[tuple, tuple]] = {}
    hooks = [stage.register_forward_hook(  # the last stage's outputs: the tensors of the model's output
        lambda m, args, out, i=i: seen.__setitem__(i, (args, tuple(tree_flatten(out)[0]))))
        for i, stage in enumerate(stages)]
    try:
        args, kwargs = microbatch
        with weights_on(whole.split_gm, _device_of(microbatch)):  # a model built on meta: run as on the inputs' device
            whole(*args, **kwargs)
    finally:
        for h in hooks:
            h.remove()
        # the Pipe's interpreter keeps every value it computed (and the autograd graph behind them) until its next
        # run: a whole micro-batch's activations, on every rank, for as long as the Pipe lives
        whole.executor.env.clear()
        whole.executor.value_remap.clear()
    seen = {i: (tuple(leaf(a) for a in ins), tuple(leaf(t) for t in outs)) for i, (ins, outs) in seen.items()}
    return [seen[i] for i in range(len(stages))]


def release_stages(model: nn.Module, stages: list[nn.Module], keep: list[int]) -> None:
    """Free the parameters and buffers of the stages this rank does not hold (``keep``: those it does): the whole
    ``model`` (the cell's, traced by :func:`split_model`) and those stages' modules register meta tensors of the
    same shapes instead (:func:`_free_tensors`); a tensor a held stage uses stays."""
    mine = {id(m) for i in keep for m in stages[i].modules()}  # a held stage's modules (often the model's own)
    others = (m for i, stage in enumerate(stages) if i not in keep for m in stage.modules())
    _free_tensors([m for m in (*model.modules(), *others) if id(m) not in mine],
                  keep=_storages(*(stages[i] for i in keep)))


def _storages(*modules: nn.Module) -> set[int]:
    """The storages (data pointers) of the real parameters and buffers below ``modules``."""
    return {t.untyped_storage().data_ptr() for m in modules for t in (*m.parameters(), *m.buffers())
            if t.device.type != "meta"}


def _free_tensors(modules: list[nn.Module], *, keep: set[int]) -> None:
    """Replace the real tensors ``modules`` hold (registered, and plain attributes) by meta tensors of the same
    shapes, unless their storage is in ``keep``, and empty their storage: a later use of a freed one raises (a meta
    tensor), never reads freed memory, and the module tree torch.export made, which nothing runs again, holds no
    memory (a memory-mapped checkpoint's storage, which cannot be resized, goes with its last reference)."""
    for module in modules:
        for table in (module._parameters, module._buffers, module.__dict__):
            for name, t in list(table.items()):
                if not isinstance(t, torch.Tensor) or t.device.type == "meta" or t.untyped_storage().data_ptr() in keep:
                    continue
                meta = torch.empty_like(t, device="meta")
                table[name] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
                if t.untyped_storage().resizable():
                    t.untyped_storage().resize_(0)


class LeanStage(PipelineStage):
    """A :class:`PipelineStage` whose receive buffers hold memory only while their micro-batch is in flight.

    Torch's stage allocates, at its first step, a buffer per micro-batch for its inputs and one for the gradients
    coming back, and keeps them all for the run: its memory grows with the number of micro-batches (a 1T GPT's
    boundary, 100 MiB in bf16, times 144 micro-batches is 14 GiB per rank for the inputs alone). Here each buffer is
    emptied (its storage resized to nothing, as FSDP frees a resharded parameter) once its micro-batch's backward
    is done, the weights' part too under a zero-bubble schedule, and is allocated again just before its next
    receive. Where a same-rank stage hands its output over instead (V schedules) the stage's own buffer stays
    empty."""

    def _prepare_forward_infra(self, *args, **kwargs):
        out = super()._prepare_forward_infra(*args, **kwargs)
        self._remember("fwd", self.args_recv_info)
        return out

    def _prepare_backward_infra(self, *args, **kwargs):
        out = super()._prepare_backward_infra(*args, **kwargs)
        self._remember("bwd", self.grad_recv_info)
        return out

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list:
        self._fill(self.args_recv_info.get(fwd_chunk_id, ()))
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list:
        self._fill(getattr(self, "grad_recv_info", {}).get(bwd_chunk_id, ()))
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index: int) -> None:
        self._fill(self.grad_recv_info.get(mb_index, ()))  # a missing gradient is written into the buffer as zeros
        return super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False):
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
        """The buffers the stage allocated, by (kind, micro-batch): held here, so that one the schedule replaced
        (a same-rank stage's output) is still known and is never taken for another."""
        own = self.__dict__.setdefault("_own", {})
        for chunk, infos in recv_info.items():
            # a model input is no buffer: torch 2.12+ marks it is_root_arg, 2.11 gives a placeholder with no buffer
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
            buf.grad = None  # the input's gradient: sent already (the schedule keeps its own reference until then)
            buf.untyped_storage().resize_(0)


def build_stage(module: nn.Module, stage_id: int, num_stages: int, *, device: torch.device, pp_group: ProcessGroup,
                values: list[tuple[tuple, tuple]] | None = None) -> PipelineStage:
    """Wrap one stage module (after TP/AC/FSDP) for the schedule (a :class:`LeanStage`); ``values`` from
    :func:`boundary_values` give static input/output shapes (None: the stages infer them at the first step)."""
    if values is None:
        return LeanStage(module, stage_id, num_stages, device, group=pp_group)
    inputs, outputs = values[stage_id]
    return LeanStage(module, stage_id, num_stages, device, group=pp_group, input_args=inputs, output_args=outputs)


def build_schedule(stages: list[PipelineStage], *, schedule: str, n_microbatches: int, loss_fn):
    """The pipeline schedule the plan names (``loss_fn(output, target)`` runs on the last stage; a
    :class:`StageLoss` learns the model output's structure from the last stage's module, set by :func:`split_model`)."""
    if isinstance(loss_fn, StageLoss):
        loss_fn.learn(next((_unwrapped(s.submod) for s in stages if s.is_last), None))
    keep_gathered(stages, schedule)
    cls = get_schedule_class(SCHEDULES[schedule])
    if issubclass(cls, PipelineScheduleSingle):
        if len(stages) != 1:
            raise ValueError(f"schedule {schedule!r} runs one stage per rank; use virtual_stages=1 or an "
                             "interleaved/looped schedule")
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn)
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
    """The cell's ``loss_fn(model, batch)`` on the last pipeline stage, with the model call answered by the stage's
    output in the structure the model returns (``output_spec``, a pytree spec; None: as the stage returns it); the
    schedule passes the micro-batch index as the target (``micro`` holds this step's micro-batches). Where the last
    stage holds a loss head (``split_model``'s ``loss_head``: ``head``, and ``head_index``, which output is its
    input) the model is a :class:`StageOutput`, which runs the head in the loss (``fused_default_loss`` finds it
    there and gives it the targets)."""

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
            output = tree_unflatten(list(output) if isinstance(output, (tuple, list)) else [output], self.output_spec)
        return self.loss_fn(lambda *args, **kwargs: output, self.micro[int(index)])


class StageOutput(nn.Module):
    """The model as the loss sees it on a last stage holding the loss head: called (its arguments are the
    micro-batch's, ignored), it runs ``head`` on output ``index`` of the stage (the head's input) and returns the
    model's output with the head's result in that place (``spec``: its structure, a pytree spec, or None)."""

    def __init__(self, output, spec, *, head: nn.Module, index: int):
        super().__init__()
        self.output, self.spec, self.head, self.index = output, spec, head, index

    def forward(self, *args, **kwargs):
        leaves = list(self.output) if isinstance(self.output, (tuple, list)) else [self.output]
        leaves[self.index] = self.head(leaves[self.index])
        if self.spec is not None:
            return tree_unflatten(leaves, self.spec)
        return type(self.output)(leaves) if isinstance(self.output, (tuple, list)) else leaves[0]


def pipeline_step(schedule, stage_loss: StageLoss, batch, *, micro_batches: int, has_first: bool, has_last: bool,
                  context, device: str) -> torch.Tensor:
    """Forward and backward of one batch through the pipeline schedule; returns the mean micro-batch loss on the
    last stage (0 elsewhere; under loss_parallel a replicated DTensor's local value). ``context()``: what the
    stages run under (autocast). ``batch`` is None on a rank that holds neither end stage: it reads no data."""
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
    return torch.stack([_local(x).detach().float() for x in losses]).mean()


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
            for p in copies:
                _grad_laid_out_as(p)
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


def _grad_laid_out_as(p) -> None:
    """Give a DTensor parameter's gradient the parameter's own placements. The copies of a tied
    weight on other stages hold theirs so (a vocabulary-split head's is split), while DTensor's
    embedding backward may leave a vocabulary-split embedding's gradient whole (replicated), and
    the copies' gradients are summed as local tensors."""
    if isinstance(p, DTensor) and isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
        p.grad = p.grad.redistribute(p.device_mesh, p.placements)


def _local(p):
    return p.to_local() if isinstance(p, DTensor) else p
