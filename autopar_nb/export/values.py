"""A Plan as the plain values an exported script is written with: mesh sizes, styles per module,
recompute and FSDP units as patterns over repeated blocks, stage boundaries, tied parameters.

Everything here is decided once, at export time, from the plan and the model (built on the meta
device); the script holds the values as literals, and the runtime functions it carries read them.
The patterns over repeated blocks are written by :mod:`.patterns`; what the script could not run is
refused first, by :mod:`.checks`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from ..capture import split_inputs
from ..capture.meta_stand_in import StandIn
from ..plan import Plan
from ..planner.degrees import stage_refusal
from ..planner.forward_run import call
from ..planner.styles import head_tables, local_sizes, tp_styles
from ..runtime.data import (
    default_batch_size,
    default_loss,
    first_tensor,
    is_causal_lm,
    smallest_table,
)
from ..runtime.pp import SPLIT_BACKWARD, stage_boundaries
from ..runtime.pretrained import check_pretrained, tied_parameters
from ..runtime.tp import REPLICATE, TPStyle
from ..runtime.train import switch_off_kv_cache
from ..source import PRETRAINED_KEY, ModelSource
from .checks import (
    check_cp,
    check_experts,
    check_fused_loss,
    check_runnable,
    float8_modules,
    fused_norms,
    samples_divide,
    weights_folder,
)
from .patterns import block_patterns, compress, fsdp_units, relative_plans
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

def script_values(source: ModelSource, plan: Plan, *, seed: int = 0,
                  meta_init: bool | None = None) -> ScriptValues:
    """The values of ``plan``'s script for the model ``source`` builds; raises PlanError (or
    NotImplementedError for what PyTorch cannot run) before anything is written."""
    m = plan.mesh
    model, inputs, ns = source.build(device="meta", seed=seed)
    check_runnable(plan)
    check_stage_starts(model, inputs, plan)
    v = _plan_values(plan, model)
    _checkpoint_values(v, source, model, ns[PRETRAINED_KEY], meta_init)
    _cell_values(v, source, model, inputs)
    _kernel_values(v, source, model, plan)
    _defaults(v, source, plan, model, inputs, ns)
    v.ties = tied_parameters(model)
    if v.pretrained:
        check_pretrained(v.pretrained, model, ties=v.ties,
                         what="weights" if v.weights else "from_pretrained")
    if m.cp > 1:
        check_cp(source, inputs, tokens=v.tokens)
    if m.ep > 1:
        v.ep, v.experts = m.ep, list(plan.experts)
        check_experts(model, plan)
    if m.tp > 1:
        _tp_values(v, model, inputs, plan)
    if m.pp > 1:
        _pipeline(v, plan)
    _layer_values(v, model, plan)
    return v


def _plan_values(plan: Plan, model: nn.Module) -> ScriptValues:
    """The values the plan states outright: its mesh, micro-batches and precision."""
    m, pr = plan.mesh, plan.precision
    return ScriptValues(pp=m.pp, dp=m.dp, tp=m.tp, cp=m.cp, zero_stage=m.zero_stage,
                        micro_batches=plan.batch.micro_batches, offload=m.offload != "none",
                        sync_batchnorm=plan.sync_batchnorm and m.dp > 1, amp=pr.amp,
                        param_dtype=pr.param_dtype, reduce_dtype=pr.reduce_dtype,
                        model_class=type(model).__name__, fp32_ops=list(pr.fp32_ops),
                        low_precision_ops=list(pr.low_precision_ops))


def _checkpoint_values(v: ScriptValues, source: ModelSource, model: nn.Module, found: list[str],
                       meta_init: bool | None) -> None:
    """Where the weights come from: built on the meta device or whole, the checkpoint ``main``
    reads (``found``: the checkpoints the cell's ``from_pretrained`` names), and whether the script
    can save them back in Hugging Face's format."""
    num_params = sum(p.numel() for p in model.parameters())
    v.meta_init = num_params > META_INIT_PARAMS if meta_init is None else meta_init
    v.weights = weights_folder(source, found)
    v.pretrained = v.weights or (found[-1] if found and v.meta_init else "")
    v.save_hf = bool(found or v.weights) and callable(
        getattr(getattr(model, "config", None), "save_pretrained", 0))


def _cell_values(v: ScriptValues, source: ModelSource, model: nn.Module, inputs) -> None:
    """What the cell gives: token ids or not, a key/value cache, a dataset, its collate_fn, a
    loss."""
    first = first_tensor(inputs)
    v.tokens = first.dim() == 2 and not first.is_floating_point()
    v.kv_cache = bool(switch_off_kv_cache(model))  # a meta copy of the cell's model: only read here
    v.dataset = source.dataset_var is not None and source.make_batch_var is None
    v.collate_fn = v.dataset and source.collate_fn_var is not None
    v.default_loss = source.loss_fn_var is None


def _kernel_values(v: ScriptValues, source: ModelSource, model: nn.Module, plan: Plan) -> None:
    """The fused loss, the fused norms and the float8 Linear layers, each checked runnable."""
    if plan.fused_loss:
        check_fused_loss(model, plan.fused_loss, source)
        v.fused_loss = plan.fused_loss
    v.fused_norm = fused_norms(model) if plan.fused_norm else []
    v.float8, v.float8_linears = float8_modules(model, plan.precision.float8)


def _defaults(v: ScriptValues, source: ModelSource, plan: Plan, model: nn.Module, inputs,
              ns: dict) -> None:
    """Synthetic data and the default loss, where the cell lacks a loss_fn or make_batch: the rows
    per rank, the ids' range, whether the loss predicts the next token."""
    per_sample = samples_divide(plan, source.rows_per_sample) if v.dataset else 1
    if source.loss_fn_var is not None and source.make_batch_var is not None:
        return
    causal = is_causal_lm(model)
    loss_fn = (ns[source.loss_fn_var] if source.loss_fn_var
               else functools.partial(default_loss, causal=causal))
    # (one meta forward: only where ids are drawn)
    synthetic = source.make_batch_var is None and not v.dataset
    rows = default_batch_size(inputs, dp=plan.mesh.dp, global_batch=plan.batch.global_batch)
    v.defaults = {
        # the plan's rows, as samples the dataset gives
        "batch_size": max(1, rows // per_sample),
        "int_high": id_ranges(model, inputs, loss_fn=loss_fn)
        if synthetic else smallest_table(model), "causal": causal
    }


def _tp_values(v: ScriptValues, model: nn.Module, inputs, plan: Plan) -> None:
    """Tensor parallelism's values: the styles as one relative plan per module list, the per-rank
    sizes and head-indexed tables the model's code reads, the fused head's split."""
    tp = plan.mesh.tp
    styles = tp_styles(model, plan.tp_plan,
                       sp_layers=[lp.path for lp in plan.layers if lp.sequence_parallel],
                       layers=[lp.path for lp in plan.layers], loss_parallel=plan.loss_parallel,
                       parts=plan.tp_parts, tp=tp)
    head_style = styles.pop(plan.fused_loss, None) if plan.fused_loss else None
    # the fused head splits its own weight (runtime/fused_loss.py shard_fused_head)
    if head_style is not None:
        v.fused_head_tp, v.fused_head_sequence = True, head_style.input_layout != REPLICATE
    v.tp_plan, v.block_tp_plans = relative_plans(model, styles)
    v.local_sizes = block_patterns(model, local_sizes(model, styles, tp=tp))
    stand = StandIn(model, *split_inputs(inputs))
    v.head_tables = block_patterns(model,
                                   head_tables(model, styles, tp=tp, parts=plan.tp_parts,
                                               call=lambda model: call(model, stand)))
    if plan.mesh.pp > 1 and (why := stage_refusal(v.local_sizes, v.head_tables)):
        raise NotImplementedError(why)
    v.vocab_parallel = plan.loss_parallel


def _pipeline(v: ScriptValues, plan: Plan) -> None:
    """The pipeline's values: its stages, their first layers (where the model is cut), its schedule,
    and whether the values between stages keep one shape (``static_shapes``)."""
    v.num_stages = plan.mesh.pp * plan.pipeline.virtual_stages
    v.schedule = plan.pipeline.schedule
    v.boundaries = stage_boundaries(plan.stage_layers())
    mixed = v.fsdp and plan.precision.param_dtype != "float32"
    v.static_shapes = not _sequence_shards_cross(v) and not mixed


def _layer_values(v: ScriptValues, model: nn.Module, plan: Plan) -> None:
    """The per-layer choices as patterns: recompute by mode, compiled layers, FSDP units."""
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
