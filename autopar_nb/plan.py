"""The Plan: the contract between planner, widget, runtime, export and launch.

A plan is plain data — printable, diffable, JSON round-trippable — and never imports torch.distributed.
Only the runtime maps its strings to PyTorch objects (``"colwise"`` -> ``ColwiseParallel()``).

JSON schema (``SCHEMA_VERSION`` = 1)::

    {
      "schema_version": 1,
      "model":     {"name": str, "num_params": int},
      "cluster":   {"preset": str, "nodes": int, "gpus_per_node": int},
      "mesh":      {"dp": int, "tp": int, "pp": int, "zero_stage": 0..3},
      "batch":     {"global_batch": int, "micro_batches": int, "seq_len": int | null},
      "pipeline":  {"schedule": str, "virtual_stages": int},
      "precision": {"amp": "none"|"bf16"|"fp16", "param_dtype": str, "reduce_dtype": str,
                    "init_loss_scale": float, "dynamic_loss_scale": bool, "growth_interval": int},
      "optimizer": {"name": "adam"|"adamw"|"sgd", "lr": float, "weight_decay": float, "betas": [float, float]},
      "layers":    [{"path": str, "stage": int, "tp": {module_path: style}, "sequence_parallel": bool,
                     "fsdp": bool, "recompute": "none"|"selective"|"full", "pinned": [field, ...]}, ...],
      "sync_batchnorm": bool,
      "loss_parallel": bool,
      "cost": {...} | null,          # see Cost; filled by the planner
      "explanation": [str, ...],
      "alternatives": [plan, ...]    # the next best plans (their own "alternatives" are empty)
    }
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

SCHEMA_VERSION = 1

ZERO_STAGES = (0, 1, 2, 3)
TP_STYLES = ("replicate", "colwise", "rowwise", "sequence_parallel")
RECOMPUTE = ("none", "selective", "full")
AMP = ("none", "bf16", "fp16")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble")
OPTIMIZERS = ("adam", "adamw", "sgd")


class PlanError(ValueError):
    """A plan that cannot be valid: the message says which field and why."""


def _check_choice(what: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise PlanError(f"{what}={value!r} is not supported; choose one of {', '.join(map(repr, allowed))}")


@dataclass
class MeshPlan:
    """How the world is factored. Mesh dims are ordered (pp, dp, tp): TP innermost, so it stays inside a node."""

    dp: int = 1
    """data-parallel degree: replicas (zero_stage 0) or shards (zero_stage >= 1)"""
    tp: int = 1
    """tensor-parallel degree (Megatron-style column/row splits, optionally with sequence parallel)"""
    pp: int = 1
    """pipeline-parallel degree: number of pipeline ranks"""
    zero_stage: int = 0
    """0: DDP (everything replicated); 1: optimizer states sharded (ZeroRedundancyOptimizer);
    2: + gradients sharded (FSDP2, reshard_after_forward=False); 3: + parameters sharded (FSDP2, reshard=True)"""

    def __post_init__(self):
        for name in ("dp", "tp", "pp"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise PlanError(f"mesh.{name} must be a positive integer, got {getattr(self, name)!r}")
        _check_choice("mesh.zero_stage", self.zero_stage, ZERO_STAGES)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp


@dataclass
class BatchPlan:
    """Batch sizes. One optimizer step consumes ``global_batch`` samples."""

    global_batch: int = 1
    """samples per optimizer step, over all data-parallel ranks"""
    micro_batches: int = 1
    """micro-batches per step on each data-parallel rank (pipeline micro-batches, or gradient accumulation)"""
    seq_len: int | None = None
    """tokens per sample for sequence models, else None"""

    def __post_init__(self):
        if self.global_batch < 1 or self.micro_batches < 1:
            raise PlanError(f"batch sizes must be >= 1, got global_batch={self.global_batch}, "
                            f"micro_batches={self.micro_batches}")


@dataclass
class PipelinePlan:
    """Pipeline schedule from ``torch.distributed.pipelining``."""

    schedule: str = "1f1b"
    """gpipe | 1f1b | interleaved_1f1b | looped_bfs | interleaved_zero_bubble | zbv_zero_bubble"""
    virtual_stages: int = 1
    """model chunks per pipeline rank (> 1 only for interleaved/looped schedules)"""

    def __post_init__(self):
        _check_choice("pipeline.schedule", self.schedule, SCHEDULES)
        if self.virtual_stages < 1:
            raise PlanError(f"pipeline.virtual_stages must be >= 1, got {self.virtual_stages}")


@dataclass
class PrecisionPlan:
    """Mixed precision (seed §4.3): autocast dtype, FSDP param/reduce dtypes, loss scaling for fp16."""

    amp: str = "none"
    """none | bf16 | fp16: the autocast dtype for the forward pass"""
    param_dtype: str = "float32"
    """dtype parameters are gathered/computed in (FSDP MixedPrecisionPolicy.param_dtype)"""
    reduce_dtype: str = "float32"
    """dtype gradients are reduced in"""
    init_loss_scale: float = 32768.0
    """fp16 only: GradScaler init_scale (seed §4.3 init_loss_scaling)"""
    dynamic_loss_scale: bool = True
    """fp16 only: grow/shrink the scale (seed §4.3 use_dynamic_loss_scaling)"""
    growth_interval: int = 2000
    """fp16 only: steps without overflow before the scale doubles"""

    def __post_init__(self):
        _check_choice("precision.amp", self.amp, AMP)


@dataclass
class OptimizerPlan:
    """The optimizer the exported script builds."""

    name: str = "adam"
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)

    def __post_init__(self):
        _check_choice("optimizer.name", self.name, OPTIMIZERS)
        self.betas = tuple(self.betas)


@dataclass
class LayerPlan:
    """Decisions for one layer (a node of ``ModelGraph.layers``, e.g. ``h.3`` or ``lm_head``)."""

    path: str
    """module path of the layer inside the model"""
    stage: int = 0
    """pipeline stage (0 .. pp * virtual_stages - 1)"""
    tp: dict[str, str] = field(default_factory=dict)
    """full module path -> TP style (replicate | colwise | rowwise | sequence_parallel); absent = replicate.
    An nn.Embedding that is "rowwise" is vocab-parallel (rows = vocabulary); "colwise" shards the embedding dim."""
    sequence_parallel: bool = False
    """norms/dropout of this layer run sequence-parallel (activations sharded on the sequence dim between TP regions)"""
    fsdp: bool = True
    """wrap this layer as its own FSDP unit (when mesh.zero_stage >= 2); False folds it into the root unit"""
    recompute: str = "none"
    """none | selective (recompute cheap ops, keep matmul outputs) | full (keep only the layer input)"""
    pinned: list[str] = field(default_factory=list)
    """the fields above that the user fixed with an override; the planner never changes them"""

    def __post_init__(self):
        _check_choice(f"layers[{self.path}].recompute", self.recompute, RECOMPUTE)
        for mod, style in self.tp.items():
            _check_choice(f"layers[{self.path}].tp[{mod}]", style, TP_STYLES)
        if self.stage < 0:
            raise PlanError(f"layers[{self.path}].stage must be >= 0, got {self.stage}")


@dataclass
class MemoryBreakdown:
    """Predicted bytes on one rank at its peak."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    buffers: float = 0.0
    """temporary buffers: FSDP all-gather/reduce-scatter buffers, TP comm buffers, pipeline send/recv"""
    margin: float = 0.0
    """allocator fragmentation and workspace margin"""

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers + self.margin


@dataclass
class Cost:
    """Predicted cost of one training step, filled by the planner."""

    step_time_s: float = 0.0
    compute_s: float = 0.0
    comm_exposed_s: float = 0.0
    """communication time not hidden behind compute"""
    comm_total_s: float = 0.0
    comm_by_kind: dict[str, float] = field(default_factory=dict)
    """seconds per collective kind: all_reduce, all_gather, reduce_scatter, send_recv, ..."""
    comm_exposed_by_kind: dict[str, float] = field(default_factory=dict)
    """the part of comm_by_kind not hidden behind compute, per kind (sums to comm_exposed_s)"""
    bubble_s: float = 0.0
    optimizer_s: float = 0.0
    memory_by_rank: list[MemoryBreakdown] = field(default_factory=list)
    peak_memory_bytes: float = 0.0
    model_tflops_per_gpu: float = 0.0
    """model FLOPs (no recompute) per GPU per second, in TFLOP/s"""
    hardware_tflops_per_gpu: float = 0.0
    """FLOPs actually executed (with recompute) per GPU per second, in TFLOP/s"""
    mfu: float = 0.0
    tokens_per_s: float | None = None
    samples_per_s: float = 0.0


@dataclass(repr=False)
class Plan:
    """A complete parallelisation plan for one model on one cluster."""

    mesh: MeshPlan = field(default_factory=MeshPlan)
    batch: BatchPlan = field(default_factory=BatchPlan)
    pipeline: PipelinePlan = field(default_factory=PipelinePlan)
    precision: PrecisionPlan = field(default_factory=PrecisionPlan)
    optimizer: OptimizerPlan = field(default_factory=OptimizerPlan)
    layers: list[LayerPlan] = field(default_factory=list)
    sync_batchnorm: bool = False
    """convert BatchNorm to SyncBatchNorm so statistics span all data-parallel ranks (seed §6.2)"""
    loss_parallel: bool = False
    """the output head is vocab-parallel and the loss is computed on sharded logits (torch loss_parallel)"""
    model: dict[str, Any] = field(default_factory=dict)
    """{"name": class name, "num_params": int}"""
    cluster: dict[str, Any] = field(default_factory=dict)
    """{"preset": name, "nodes": int, "gpus_per_node": int}"""
    cost: Cost | None = None
    explanation: list[str] = field(default_factory=list)
    alternatives: list[Plan] = field(default_factory=list)

    def __post_init__(self):
        gpus = self.cluster.get("nodes", 0) * self.cluster.get("gpus_per_node", 0)
        if gpus and self.mesh.world_size != gpus:
            m = self.mesh
            raise PlanError(f"dp({m.dp}) * tp({m.tp}) * pp({m.pp}) = {m.world_size} != world_size({gpus})")
        stages = self.mesh.pp * self.pipeline.virtual_stages
        for lp in self.layers:
            if lp.stage >= stages:
                raise PlanError(f"layer {lp.path!r} is on stage {lp.stage}, but the plan has {stages} stage(s) "
                                f"(pp={self.mesh.pp} x virtual_stages={self.pipeline.virtual_stages})")

    # ---- lookup -------------------------------------------------------------------------------------------------
    def layer(self, path: str) -> LayerPlan:
        """The LayerPlan for ``path``; KeyError naming the known layers if absent."""
        for lp in self.layers:
            if lp.path == path:
                return lp
        raise KeyError(f"no layer {path!r} in the plan; layers are: {', '.join(lp.path for lp in self.layers)}")

    @property
    def tp_plan(self) -> dict[str, str]:
        """Every module's TP style, merged over layers: the dict the runtime turns into ``parallelize_module``."""
        out: dict[str, str] = {}
        for lp in self.layers:
            out.update(lp.tp)
        return out

    def stage_layers(self) -> list[list[str]]:
        """Layer paths grouped by pipeline stage, in model order."""
        n = self.mesh.pp * self.pipeline.virtual_stages
        stages: list[list[str]] = [[] for _ in range(n)]
        for lp in self.layers:
            stages[lp.stage].append(lp.path)
        return stages

    # ---- JSON ---------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["alternatives"] = [alt.to_dict() | {"alternatives": []} for alt in self.alternatives]
        if self.cost is not None:
            for m in d["cost"]["memory_by_rank"]:
                m["total"] = m["params"] + m["grads"] + m["optimizer"] + m["activations"] + m["buffers"] + m["margin"]
        return {"schema_version": SCHEMA_VERSION, **d}

    def to_json(self, indent: int | None = 2) -> str:
        """Serialise to JSON (see the module docstring for the schema)."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        d = dict(d)
        version = d.pop("schema_version", None)
        if version != SCHEMA_VERSION:
            raise PlanError(f"plan schema_version {version!r} is not supported (this autopar-nb reads "
                            f"{SCHEMA_VERSION}); re-plan with this version")
        cost = d.pop("cost", None)
        if cost is not None:
            mem = [MemoryBreakdown(**{k: v for k, v in m.items() if k != "total"})
                   for m in cost.pop("memory_by_rank", [])]
            cost = Cost(**cost, memory_by_rank=mem)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise PlanError(f"unknown plan field(s): {', '.join(sorted(unknown))}")
        return cls(
            mesh=MeshPlan(**d.pop("mesh", {})),
            batch=BatchPlan(**d.pop("batch", {})),
            pipeline=PipelinePlan(**d.pop("pipeline", {})),
            precision=PrecisionPlan(**d.pop("precision", {})),
            optimizer=OptimizerPlan(**d.pop("optimizer", {})),
            layers=[LayerPlan(**lp) for lp in d.pop("layers", [])],
            alternatives=[cls.from_dict({"schema_version": SCHEMA_VERSION, **a}) for a in d.pop("alternatives", [])],
            cost=cost,
            **d,
        )

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Parse a plan written by :meth:`to_json`."""
        return cls.from_dict(json.loads(text))

    # ---- diff ---------------------------------------------------------------------------------------------------
    def diff(self, other: Plan) -> list[Change]:
        """What changes going from ``self`` to ``other``: decisions only (cost, explanation, alternatives ignored)."""
        skip = {"cost", "explanation", "alternatives", "layers", "schema_version"}
        a, b = self.to_dict(), other.to_dict()
        changes = [c for k in a if k not in skip for c in _diff_values(k, a[k], b[k])]
        mine = {lp.path: dataclasses.asdict(lp) for lp in self.layers}
        theirs = {lp.path: dataclasses.asdict(lp) for lp in other.layers}
        for path in list(mine) + [p for p in theirs if p not in mine]:
            if path not in theirs:
                changes.append(Change(f"layers[{path}]", "present", None))
            elif path not in mine:
                changes.append(Change(f"layers[{path}]", None, "present"))
            else:
                changes += [c for k in mine[path] if k != "path"
                            for c in _diff_values(f"layers[{path}].{k}", mine[path][k], theirs[path][k])]
        return changes

    def explain(self) -> str:
        """Why this plan won and what limits it, in plain words (the planner's ``explanation`` lines)."""
        return "\n".join(self.explanation)

    def summary(self) -> str:
        """One line: mesh, ZeRO, schedule, precision, and predicted cost when known."""
        m = self.mesh
        s = f"dp={m.dp} tp={m.tp} pp={m.pp} zero={m.zero_stage}"
        if m.pp > 1:
            s += f" {self.pipeline.schedule}x{self.batch.micro_batches}"
        rec = sorted({lp.recompute for lp in self.layers} - {"none"})
        if rec:
            s += f" recompute={'/'.join(rec)}"
        if self.precision.amp != "none":
            s += f" amp={self.precision.amp}"
        if self.cost is not None:
            s += f" | {self.cost.step_time_s * 1e3:.1f} ms/step, peak {self.cost.peak_memory_bytes / 2**30:.2f} GiB"
        return s

    def __repr__(self) -> str:
        return f"Plan({self.summary()})"

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(repr(self))


@dataclass(frozen=True)
class Change:
    """One difference between two plans: a dotted field path with its old and new value."""

    path: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.path}: {self.old!r} -> {self.new!r}"


def _diff_values(path: str, a: Any, b: Any) -> list[Change]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [c for k in list(a) + [k for k in b if k not in a]
                for c in _diff_values(f"{path}.{k}", a.get(k), b.get(k))]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        a, b = list(a), list(b)
    return [] if a == b else [Change(path, a, b)]
