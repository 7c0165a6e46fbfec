"""A Plan as the plain values an exported script is written with: mesh sizes, styles per module,
recompute and FSDP units as patterns over repeated blocks, stage boundaries, tied parameters.

Everything here is decided once, at export time, from the plan and the model (built on the meta
device); the script holds the values as literals, and the runtime functions it carries read them.
"""

from __future__ import annotations

import copy
import functools
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from ..capture import split_inputs
from ..capture.meta_stand_in import StandIn
from ..plan import Plan, PlanError, within
from ..planner.degrees import stage_refusal
from ..planner.forward_run import call
from ..planner.styles import head_tables, local_sizes, tp_styles
from ..runtime.cp import sequence_tensor
from ..runtime.data import (
    default_batch_size,
    default_loss,
    first_tensor,
    is_causal_lm,
    smallest_table,
)
from ..runtime.ep import experts_modules_to_split
from ..runtime.float8 import float8_linears
from ..runtime.fused_norm import apply_fused_norm
from ..runtime.pp import SCHEDULES, SPLIT_BACKWARD, stage_boundaries
from ..runtime.pretrained import check_pretrained, tied_parameters
from ..runtime.tp import REPLICATE, TPStyle
from ..runtime.train import switch_off_kv_cache
from ..source import PRETRAINED_KEY, ModelSource
from .stages import check_stage_starts
from .synthetic_ids import id_ranges

META_INIT_PARAMS = 2**30
"""models with more parameters than this are built on the meta device and initialised shard by shard
by default"""


@dataclass
class ScriptValues:
    """What the script of one plan is written with (see the module docstring)."""

    pp: int
    dp: int
    tp: int
    zero_stage: int
    micro_batches: int
    cp: int = 1
    """context-parallel degree (plan.mesh.cp): ranks of a replica that split every sequence
    (runtime/cp.py)"""
    ep: int = 1
    """expert-parallel degree (plan.mesh.ep): 1, or the data-parallel ranks each experts module is
    split over"""
    experts: list[str] = field(default_factory=list)
    """expert module patterns (plan.experts), when ep > 1"""
    num_stages: int = 1
    schedule: str = "1f1b"
    boundaries: list[str] = field(default_factory=list)
    """pipeline cut points: the first layer of every stage but the first"""
    static_shapes: bool = True
    """pipeline stages get their boundary shapes from one traced micro-batch (False: the stages
    infer them at the first step, where sequence shards cross a cut or FSDP's mixed precision
    computes the activations in another dtype than the trace, run in the parameters' own)"""
    tp_plan: dict[str, TPStyle] = field(default_factory=dict)
    """module path -> style, for modules outside repeated blocks (and blocks' own entry/exit
    styles)"""
    block_tp_plans: dict[str, dict[str, TPStyle]] = field(default_factory=dict)
    """blocks pattern ("layers.*") -> relative path -> style: one plan applied to every block"""
    vocab_parallel: bool = False
    local_sizes: dict[str, dict[str, int]] = field(default_factory=dict)
    """module pattern -> attribute -> per-rank value: head counts and widths the model's code reads
    (TP)"""
    head_tables: dict[str, dict[str, int | tuple[int, int]]] = field(default_factory=dict)
    """module pattern -> parameter, buffer or keyword input name -> its heads dim, or (dim, heads)
    where that dim holds the batch and the heads flattened: head-indexed tables split with the heads
    (TP)"""
    ties: list[list[str]] = field(default_factory=list)
    """groups of parameter paths that are one parameter (an embedding tied to its output head)"""
    recompute: dict[str, str] = field(default_factory=dict)
    """pattern -> "full" | "selective\""""
    async_tp: bool = False
    """plan.async_tp: Inductor's micro-pipelined TP turned on before the blocks are compiled
    (runtime/async_tp.py)"""
    compile: list[str] = field(default_factory=list)
    """patterns of the layers compiled with torch.compile (plan.layers[*].compile), each module on
    its own"""
    fsdp_units: list[Any] = field(default_factory=list)
    """patterns (each match its own unit) or lists of paths (one unit together)"""
    sync_batchnorm: bool = False
    meta_init: bool = False
    save_hf: bool = False
    """the cell loads a Hugging Face model ``from_pretrained``: ``--save-hf`` writes the trained
    weights back in that format"""
    pretrained: str = ""
    """the checkpoint ``main`` reads into the model: the one the cell's ``from_pretrained`` names,
    shard by shard after parallelising (meta_init; a model built whole reads it in the cell), or
    ``weights``"""
    weights: str = ""
    """``export(weights=...)`` (``ModelSource.weights``): the checkpoint a model the cell builds
    from a config starts from, read whole before parallelising, or shard by shard after it under
    meta_init"""
    amp: str = "none"
    fp32_ops: list[str] = field(default_factory=list)
    """plan.precision.fp32_ops: ops kept in float32 under autocast"""
    low_precision_ops: list[str] = field(default_factory=list)
    """plan.precision.low_precision_ops: ops run in the autocast dtype beyond autocast's own list"""
    param_dtype: str = "float32"
    reduce_dtype: str = "float32"
    defaults: dict[str, Any] = field(default_factory=dict)
    """synthetic data and the default loss, when the cell defines none: batch_size, int_high,
    causal"""
    dataset: bool = False
    """batches come from the cell's dataset (a DataLoader over the data-parallel ranks; not when it
    has make_batch)"""
    collate_fn: bool = False
    """the cell defines the dataset's collate_fn"""
    default_loss: bool = True
    """the cell defines no loss_fn: the script uses runtime.data.default_loss"""
    fused_loss: str = ""
    """plan.fused_loss: the output head the script fuses with the default loss
    (runtime/fused_loss.py); empty: unfused"""
    fused_head_tp: bool = False
    """with TP and plan.fused_loss: the head is split on the vocabulary (``shard_fused_head``)"""
    fused_head_sequence: bool = False
    """with TP and plan.fused_loss: the head's input arrives sequence-sharded (gathered by
    ``shard_fused_head``)"""
    fused_norm: list[str] = field(default_factory=list)
    """plan.fused_norm: the RMSNorm modules the script runs with kernels_ext's fused RMSNorm
    (runtime/fused_norm.py finds them again; listed in a comment); empty: eager norms"""
    float8: str = ""
    """plan.precision.float8: torchao's recipe the script converts Linear layers with
    (runtime/float8.py); empty: none"""
    float8_linears: list[str] = field(default_factory=list)
    """the modules it converts (found again by the runtime; listed in a comment)"""
    tokens: bool = False
    """the inputs are token ids (throughput in tokens/s)"""
    kv_cache: bool = False
    """the model keeps a Hugging Face key/value cache (``config.use_cache``): the script switches it
    off"""
    model_class: str = ""
    offload: bool = False
    """plan.mesh.offload: FSDP keeps its shards and the optimizer states in host memory
    (``offload_policy``), the model stays there until FSDP takes its parameters, the optimizer steps
    fused on the CPU"""

    @property
    def replicas(self) -> int:
        """ranks holding the same parameters, over which gradients are averaged: dp * cp"""
        return self.dp * self.cp

    @property
    def dp_mesh(self) -> str:
        """the script's expression for the mesh of those ranks"""
        return 'mesh["dp_cp"]' if self.cp > 1 else 'mesh["dp"]'

    @property
    def fsdp(self) -> bool:
        """FSDP2 units: ZeRO 1-3 over data-parallel ranks (ZeRO-1: gradients reduce-scattered once
        per step, see ``runtime/train.py``'s ``set_grad_sync``), or over one rank to offload its
        states to the host"""
        return (self.replicas > 1 and self.zero_stage >= 1) or (self.offload
                                                                and self.zero_stage >= 2)

    @property
    def fsdp_policies(self) -> dict[str, str]:
        """``apply_fsdp``'s and ``shard_experts``' policy arguments as the script spells them: mixed
        precision where the dtypes are not float32, CPU offload"""
        mixed = {"param_dtype": "PARAM_DTYPE", "reduce_dtype": "REDUCE_DTYPE"} if (
            self.param_dtype, self.reduce_dtype) != ("float32", "float32") else {}
        return mixed | ({"offload": "True"} if self.offload else {})

    @property
    def reshard_after_forward(self) -> bool:
        """FSDP units reshard after forward: ZeRO-3, but not in pipeline stages whose
        schedule splits the backward, whose input pass must find the parameters the forward
        used (``runtime/pp.py``'s ``keep_gathered``): those keep them gathered, as ZeRO-2"""
        return self.zero_stage == 3 and not (self.pp > 1 and self.schedule in SPLIT_BACKWARD)

    @property
    def ddp(self) -> bool:
        return self.replicas > 1 and self.zero_stage == 0 and self.tp == 1

    @property
    def replicate(self) -> bool:
        """data parallelism beside TP without sharding anything (ZeRO-0): FSDP2's replicate (DDP
        takes no DTensors)"""
        return self.replicas > 1 and self.zero_stage == 0 and self.tp > 1

    @property
    def from_config(self) -> bool:
        """The cell's ``from_pretrained`` builds the model from the checkpoint's config
        (``FromConfig``), and ``main`` reads the weights after parallelising."""
        return bool(self.pretrained) and not self.weights


def _sequence_shards_cross(v: ScriptValues) -> bool:
    """Whether a TP style leaves activations split on the sequence (sequence parallelism), so
    that shards cross the pipeline's cuts."""
    blocks = [style for plan in v.block_tp_plans.values() for style in plan.values()]
    return any(s.output_layout == 1 for s in [*v.tp_plan.values(), *blocks])


def _samples_divide(plan: Plan, per_sample: int) -> int:
    """The rows a dataset's collate_fn makes of each sample, once the global batch is seen to split
    into the same number of samples on every data-parallel rank."""
    dp, rows = plan.mesh.dp, plan.batch.global_batch
    if rows > 1 and rows % (dp * per_sample):
        raise PlanError(f"batch.global_batch({rows}) must be a multiple of the data-parallel ranks "
                        f"(mesh.dp={dp}) x the rows collate_fn makes of each sample "
                        f"({per_sample}): each rank reads the same number of the dataset's samples "
                        "per step")
    return per_sample


def script_values(source: ModelSource, plan: Plan, *, seed: int = 0,
                  meta_init: bool | None = None) -> ScriptValues:
    """The values of ``plan``'s script for the model ``source`` builds; raises PlanError (or
    NotImplementedError for what PyTorch cannot run) before anything is written."""
    m, pr = plan.mesh, plan.precision
    model, inputs, ns = source.build(device="meta", seed=seed)
    _check_runnable(plan)
    check_stage_starts(model, inputs, plan)
    v = ScriptValues(pp=m.pp, dp=m.dp, tp=m.tp, cp=m.cp, zero_stage=m.zero_stage,
                     micro_batches=plan.batch.micro_batches, offload=m.offload != "none",
                     sync_batchnorm=plan.sync_batchnorm and m.dp > 1, amp=pr.amp,
                     param_dtype=pr.param_dtype, reduce_dtype=pr.reduce_dtype,
                     model_class=type(model).__name__, fp32_ops=list(pr.fp32_ops),
                     low_precision_ops=list(pr.low_precision_ops))
    num_params = sum(p.numel() for p in model.parameters())
    v.meta_init = num_params > META_INIT_PARAMS if meta_init is None else meta_init
    v.weights = _weights(source, ns[PRETRAINED_KEY])
    v.pretrained = v.weights or (ns[PRETRAINED_KEY][-1] if ns[PRETRAINED_KEY] and v.meta_init
                                 else "")
    v.save_hf = bool(ns[PRETRAINED_KEY] or v.weights) and callable(
        getattr(getattr(model, "config", None), "save_pretrained", 0))
    first = first_tensor(inputs)
    v.tokens = first.dim() == 2 and not first.is_floating_point()
    v.kv_cache = bool(switch_off_kv_cache(model))  # a meta copy of the cell's model: only read here
    v.dataset = source.dataset_var is not None and source.make_batch_var is None
    v.collate_fn = v.dataset and source.collate_fn_var is not None
    v.default_loss = source.loss_fn_var is None
    if plan.fused_loss:
        _check_fused_loss(model, plan.fused_loss, source)
        v.fused_loss = plan.fused_loss
    v.fused_norm = _fused_norms(model) if plan.fused_norm else []
    v.float8, v.float8_linears = _float8(model, pr.float8)
    per_sample = _samples_divide(plan, source.rows_per_sample) if v.dataset else 1
    if source.loss_fn_var is None or source.make_batch_var is None:
        causal = is_causal_lm(model)
        loss_fn = (ns[source.loss_fn_var] if source.loss_fn_var
                   else functools.partial(default_loss, causal=causal))
        # (one meta forward: only where ids are drawn)
        synthetic = source.make_batch_var is None and not v.dataset
        rows = default_batch_size(inputs, dp=m.dp, global_batch=plan.batch.global_batch)
        v.defaults = {
            # the plan's rows, as samples the dataset gives
            "batch_size": max(1, rows // per_sample),
            "int_high": id_ranges(model, inputs, loss_fn=loss_fn)
            if synthetic else smallest_table(model), "causal": causal
        }
    v.ties = tied_parameters(model)
    if v.pretrained:
        check_pretrained(v.pretrained, model, ties=v.ties,
                         what="weights" if v.weights else "from_pretrained")
    if m.cp > 1:
        _check_cp(source, inputs, v)
    if m.ep > 1:
        v.ep, v.experts = m.ep, list(plan.experts)
        _check_experts(model, plan)
    if m.tp > 1:
        styles = tp_styles(model, plan.tp_plan,
                           sp_layers=[lp.path for lp in plan.layers if lp.sequence_parallel],
                           layers=[lp.path for lp in plan.layers], loss_parallel=plan.loss_parallel,
                           parts=plan.tp_parts, tp=m.tp)
        head_style = styles.pop(plan.fused_loss, None) if plan.fused_loss else None
        # the fused head splits its own weight (runtime/fused_loss.py shard_fused_head)
        if head_style is not None:
            v.fused_head_tp, v.fused_head_sequence = True, head_style.input_layout != REPLICATE
        v.tp_plan, v.block_tp_plans = relative_plans(model, styles)
        v.local_sizes = block_patterns(model, local_sizes(model, styles, tp=m.tp))
        stand = StandIn(model, *split_inputs(inputs))
        v.head_tables = block_patterns(model,
                                       head_tables(model, styles, tp=m.tp, parts=plan.tp_parts,
                                                   call=lambda model: call(model, stand)))
        if m.pp > 1 and (why := stage_refusal(v.local_sizes, v.head_tables)):
            raise NotImplementedError(why)
        v.vocab_parallel = plan.loss_parallel
    if m.pp > 1:
        _pipeline(v, plan)
    by_mode: dict[str, list[str]] = {}
    for lp in plan.layers:
        if lp.recompute != "none":
            by_mode.setdefault(lp.recompute, []).append(lp.path)
    v.recompute = {pattern: mode for mode, paths in by_mode.items()
                   for pattern in compress(model, paths)}
    v.compile, v.async_tp = (compress(model, [lp.path for lp in plan.layers if lp.compile]),
                             plan.async_tp)
    if v.fsdp or v.replicate:
        v.fsdp_units = fsdp_units(model, plan, v.ties)
    return v


def _pipeline(v: ScriptValues, plan: Plan) -> None:
    """The pipeline's values: its stages, their first layers (where the model is cut), its schedule,
    and whether the values between stages keep one shape (``static_shapes``)."""
    v.num_stages = plan.mesh.pp * plan.pipeline.virtual_stages
    v.schedule = plan.pipeline.schedule
    v.boundaries = stage_boundaries(plan.stage_layers())
    mixed = v.fsdp and plan.precision.param_dtype != "float32"
    v.static_shapes = not _sequence_shards_cross(v) and not mixed


def _weights(source: ModelSource, found: list[str]) -> str:
    """``source.weights`` checked: a folder, for a cell that does not name its own checkpoint
    (``from_pretrained``)."""
    if not source.weights:
        return ""
    if found:
        raise ValueError(f"weights={source.weights!r}, but the cell starts from its own checkpoint "
                         f"(from_pretrained({found[-1]!r})): weights= is for a cell that builds "
                         "its model from a config; name one of the two")
    if not os.path.isdir(source.weights):
        raise FileNotFoundError(f"weights={source.weights!r}: no such folder; name a folder of "
                                "safetensors files (what save_pretrained writes)")
    return source.weights


def _check_runnable(plan: Plan) -> None:
    m, pr = plan.mesh, plan.precision
    if m.ep > 1 and m.tp > 1:
        raise NotImplementedError(
            f"expert parallelism (ep={m.ep}) runs beside data parallelism (and pipelining) without "
            f"TP, not with tp={m.tp}: the experts' all-to-all is not split by TP (no expert-TP)")
    if plan.sync_batchnorm and m.dp > 1 and m.pp > 1:
        raise NotImplementedError("sync_batchnorm with pipelining is not supported")
    if m.pp > 1 and pr.amp == "fp16":
        raise NotImplementedError("pipelining with fp16 loss scaling is not supported; use bf16")
    if plan.pipeline.schedule not in SCHEDULES:
        raise PlanError(f"pipeline.schedule {plan.pipeline.schedule!r} unknown")


def _check_cp(source: ModelSource, inputs, v: ScriptValues) -> None:
    """PlanError unless context parallelism can run the cell: the default loss (``sequence_loss``
    computes it on each rank's part of the sequence) on batches of one (batch, seq) tensor of token
    ids."""
    if source.loss_fn_var:
        raise PlanError(f"mesh.cp > 1, but the cell defines its own {source.loss_fn_var}: context "
                        "parallelism computes the default loss on each rank's part of the sequence "
                        "(a loss of the whole sequence cannot run there); drop it from the cell, "
                        "or use cp=1")
    try:
        sequence_tensor(inputs)
    except ValueError as e:
        raise PlanError(f"mesh.cp > 1: {e}") from None
    if not v.tokens:
        raise PlanError("mesh.cp > 1 needs token ids as the model's input; use cp=1")


def _check_fused_loss(model: nn.Module, head: str, source: ModelSource) -> None:
    """PlanError unless ``plan.fused_loss`` can run: the default loss (no ``loss_fn`` in the cell,
    whose loss the fused op would not compute) and a bias-free nn.Linear at that path (what
    ``apply_fused_loss`` checks)."""
    if source.loss_fn_var:
        raise PlanError(f"plan.fused_loss={head!r}, but the cell defines its own "
                        f"{source.loss_fn_var}: the fused head computes the default next-token "
                        "cross-entropy only; re-plan (the planner does not fuse a cell's own loss) "
                        "or set fused_loss to \"\"")
    try:
        linear = model.get_submodule(head)
    except AttributeError:
        linear = None
    if not isinstance(linear, nn.Linear) or linear.bias is not None:
        raise PlanError(f"plan.fused_loss={head!r} must name a bias-free nn.Linear of the model, "
                        f"found {type(linear).__name__ if linear is not None else 'no such module'}"
                        + (" with a bias" if isinstance(linear, nn.Linear)
                           and linear.bias is not None else ""))


def _float8(model: nn.Module, recipe: str) -> tuple[str, list[str]]:
    """(the recipe, the Linear modules ``apply_float8`` will convert), ("", []) without float8;
    PlanError when it would convert none."""
    if recipe == "none":
        return "", []
    found = float8_linears(model)
    if not found:
        raise PlanError(f"precision.float8={recipe!r}, but the model has no nn.Linear with both "
                        "dimensions multiples of 16 besides its output head: set precision.float8 "
                        "to 'none'")
    return recipe, found


def _fused_norms(model: nn.Module) -> list[str]:
    """The RMSNorm modules ``apply_fused_norm`` will fuse (found on a copy of the meta model);
    PlanError when there are none."""
    try:
        return apply_fused_norm(copy.deepcopy(model))
    except ValueError as e:
        raise PlanError(str(e)) from None


def _check_experts(model: nn.Module, plan: Plan) -> None:
    """PlanError unless every ``plan.experts`` pattern names experts modules that ``apply_ep`` can
    split over ``mesh.ep`` ranks (the checks the script would make, before it is written)."""
    try:
        paths = experts_modules_to_split(model, plan.experts, ep=plan.mesh.ep)
    except (TypeError, ValueError) as e:
        raise PlanError(f"experts: {e}") from None
    selective = [lp.path for lp in plan.layers
                 if lp.recompute == "selective" and any(within(p, lp.path) for p in paths)]
    if selective and plan.mesh.zero_stage >= 1:
        raise NotImplementedError(
            f"selective recompute of layers holding experts ({', '.join(selective[:3])}) with "
            f"ep={plan.mesh.ep} and ZeRO-{plan.mesh.zero_stage} is not supported: the experts' own "
            "FSDP unit sits inside the selectively checkpointed region, and torch's selective "
            "checkpointing then meets FSDP calls in recompute that the forward did not make; use "
            "full recompute for those layers, or ZeRO 0")


def _containers(model: nn.Module) -> dict[str, list[str]]:
    """Paths of module lists/dicts (repeated blocks) -> their children's paths."""
    out = {}
    for path, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and len(module) > 1:
            out[path] = [f"{path}.{name}" if path else name for name, _ in module.named_children()]
    return out


def compress(model: nn.Module, paths: list[str]) -> list[str]:
    """``paths`` (in model order) with every complete set of blocks of a module list written as one
    pattern (``"layers.*"``), where its first block was."""
    complete = {c: f"{c}.*" if c else "*" for c, children in _containers(model).items()
                if set(children) <= set(paths)}
    out: list[str] = []
    for path in paths:
        pattern = (complete.get(path.rpartition(".")[0], path) if "." in path or "" in complete
                   else path)
        if pattern not in out:
            out.append(pattern)
    return out


def relative_plans(model: nn.Module, styles: dict[str, TPStyle]) -> tuple[dict[str, TPStyle],
                                                                          dict[str, dict]]:
    """torchtitan's TP layout: one relative plan for the blocks of each module list that share it,
    absolute paths for everything else (the modules around the blocks, blocks' own entry/exit
    styles, blocks that differ)."""
    absolute = dict(styles)
    blocks: dict[str, dict[str, TPStyle]] = {}
    for container, children in _containers(model).items():
        rel = {
            child: {p[len(child) + 1:]: s
                    for p, s in styles.items() if p.startswith(child + ".")}
            for child in children
        }
        common, count = Counter(tuple(sorted(r.items())) for r in rel.values()).most_common(1)[0]
        if not common or count < 2:
            continue
        same = [c for c in children if tuple(sorted(rel[c].items())) == common]
        if len(same) < len(children):
            # an override made some blocks differ: keep them all absolute (explicit beats clever)
            continue
        plan = {k: s
                for k, s in sorted(common,
                                   key=lambda kv: _module_order(model, f"{children[0]}.{kv[0]}"))}
        blocks[f"{container}.*" if container else "*"] = plan
        for child in same:
            for k in rel[child]:
                absolute.pop(f"{child}.{k}")
    return absolute, blocks


def block_patterns(model: nn.Module, by_path: dict[str, Any]) -> dict[str, Any]:
    """``by_path`` with the entries that every block of a module list has alike (the same path
    inside the block, the same value) written once, as a pattern: ``{"h.0.attn": x, "h.1.attn": x}``
    -> ``{"h.*.attn": x}``."""
    out = dict(by_path)
    for container, children in sorted(_containers(model).items(), key=lambda kv: len(kv[0])):
        inside: dict[str, dict[str, Any]] = {}  # path inside a block -> block -> value
        for path, value in out.items():
            for child in children:
                if path.startswith(child + "."):
                    inside.setdefault(path[len(child) + 1:], {})[child] = value
        for rel, values in inside.items():
            first = next(iter(values.values()))
            if len(values) == len(children) and all(x == first for x in values.values()):
                pattern = f"{container}.*.{rel}" if container else f"*.{rel}"
                out = {(pattern if k == f"{children[0]}.{rel}" else k): x for k, x in out.items()
                       if k == f"{children[0]}.{rel}" or k not in {f"{c}.{rel}" for c in children}}
    return out


def _module_order(model: nn.Module, path: str) -> int:
    return list(dict(model.named_modules())).index(path)


def fsdp_units(model: nn.Module, plan: Plan, ties: list[list[str]]) -> list[Any]:
    """FSDP units from the plan's layers: each layer with ``fsdp`` and parameters of its own; the
    final norm and the head together (torchtitan's ``[norm, output]``); layers holding a tied
    parameter stay in the root unit."""
    modules = dict(model.named_modules())
    tied = {p.rpartition(".")[0] for group in ties for p in group}

    def holds_tie(path: str) -> bool:
        return any(within(t, path) for t in tied)

    layers = [lp.path for lp in plan.layers if lp.fsdp and lp.path in modules
              and not holds_tie(lp.path) and any(True for _ in modules[lp.path].parameters())]
    tail: list[Any] = []
    if (len(layers) >= 2 and layers[-1] == plan.layers[-1].path
        and "norm" in type(modules[layers[-2]]).__name__.lower()):
        tail, layers = [layers[-2:]], layers[:-2]
    return [*compress(model, layers), *tail]
