"""The Plan: the contract between planner, widget, runtime, export and launch.

A plan is plain data — printable, diffable, JSON round-trippable — and never imports
torch.distributed. Only the runtime maps its strings to PyTorch objects (``"colwise"`` ->
``ColwiseParallel()``).

JSON schema (``SCHEMA_VERSION`` = 1)::

    {
      "schema_version": 1,
      "model":     {"name": str, "num_params": int},
      "cluster":   {"preset": str, "nodes": int, "gpus_per_node": int,
                    # and, when set: a per-rank limit, the world size a plan_for plan was made for
                    "memory_limit_bytes": int, "scaled_from": int},
      "mesh":      {"dp": int, "tp": int, "pp": int, "zero_stage": 0..3, "ep": int, "cp": int,
                    "offload": "none"|"cpu"},
      "batch":     {"global_batch": int, "micro_batches": int, "seq_len": int | null},
      "pipeline":  {"schedule": str, "virtual_stages": int},
      "precision": {"amp": "none"|"bf16"|"fp16", "param_dtype": str, "reduce_dtype": str,
                    "init_loss_scale": float, "dynamic_loss_scale": bool, "growth_interval": int,
                    "float8": "none"|"tensorwise"|"rowwise"},
      "optimizer": {"name": "adam"|"adamw"|"sgd", "lr": float, "weight_decay": float,
                    "betas": [float, float]},
      "layers":    [{"path": str, "stage": int, "tp": {module_path: style},
                     "tp_parts": {module_path: [int, ...]}, "sequence_parallel": bool, "fsdp": bool,
                     "recompute": "none"|"selective"|"full", "compile": bool,
                     "pinned": [field, ...]}, ...],
      "sync_batchnorm": bool,
      "loss_parallel": bool,
      "fused_loss": str,             # the output head fused with the loss ("lm_head"), or ""
                                     # (unfused)
      "fused_norm": bool,            # the model's RMSNorm modules run kernels_ext's fused RMSNorm
      "async_tp": bool,              # Inductor's micro-pipelined TP (CUDA, compile, tp > 1)
      "experts":   [module_path_pattern, ...],   # expert modules ("model.layers.*.mlp.experts")
      "cost": {...} | null,          # see Cost; filled by the planner
      "explanation": [str, ...],
      "alternatives": [plan, ...],   # the next best plans (their own "alternatives" are empty)
      "levers": [{"name": str, "on": bool, "step_time_s": float, "peak_memory_bytes": float,
                  "fits": bool, "startup_s": float, "steps": int}, ...]   # see Lever
    }
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from ..units import fmt_bytes, fmt_time
from .checks import PlanError, check_bool, check_int, check_list, check_str
from .cost import LEVERS, MEMORY_TERMS, Cost, Lever, MemoryBreakdown
from .fix import FIX_ALIASES, FIX_CHOICES, FIX_KEYS, normalize_fix
from .refusals import check_compiled, check_cp, check_fused_loss, check_schedule
from .sections import BatchPlan, LayerPlan, MeshPlan, OptimizerPlan, PipelinePlan, PrecisionPlan
from .vocab import (
    AMP,
    AMP_OPS,
    DTYPE_NAMES,
    FLOAT8,
    ITEMSIZE,
    MAX_DEGREE,
    MAX_INT,
    MODULE_PATTERN,
    OPTIMIZERS,
    PINNABLE,
    RECOMPUTE,
    SCHEDULES,
    TP_STYLES,
    V_SCHEDULES,
    ZERO_STAGES,
    layer_of,
    stage_rank,
    within,
)

__all__ = [
    "AMP", "AMP_OPS", "DTYPE_NAMES", "FIX_ALIASES", "FIX_CHOICES", "FIX_KEYS", "FLOAT8", "ITEMSIZE",
    "LEVERS", "MEMORY_TERMS", "OPTIMIZERS", "PINNABLE", "RECOMPUTE", "SCHEDULES", "SCHEMA_VERSION",
    "TP_STYLES", "V_SCHEDULES", "ZERO_STAGES", "BatchPlan", "Change", "Cost", "LayerPlan", "Lever",
    "MemoryBreakdown", "MeshPlan", "OptimizerPlan", "PipelinePlan", "Plan", "PlanError",
    "PrecisionPlan", "layer_of", "normalize_fix", "stage_rank", "within",
]

SCHEMA_VERSION = 1
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
    """convert BatchNorm to SyncBatchNorm so statistics span all data-parallel ranks"""
    loss_parallel: bool = False
    """the output head is vocab-parallel and the loss is computed on sharded logits (torch
    loss_parallel)"""
    fused_loss: str = ""
    """module path of the output head (a bias-free ``nn.Linear``) whose matmul runs fused with the
    default next-token cross-entropy, chunk by chunk (``kernels_ext.linear_cross_entropy``): the
    full logits and their gradient are never held, and the logits are computed again in backward. ""
    = unfused. Only with the default loss (the cell defines no ``loss_fn``) and mesh.pp == 1; with
    mesh.tp > 1 the head's weight is split on the vocabulary and the loss is vocab-parallel
    (``kernels_ext.vocab_parallel_linear_cross_entropy``), so loss_parallel stays false"""
    fused_norm: bool = False
    """the model's RMSNorm modules (found by what they compute: ``runtime/fused_norm.py``) run
    kernels_ext's fused RMSNorm, which keeps the input and one fp32 rstd per row for backward
    instead of the eager chain's input, normalised input and rstd (on CUDA one kernel instead of
    five: Liger-kernel's when installed, else torch's)"""
    async_tp: bool = False
    """TP's all-gathers and reduce-scatters run micro-pipelined with the matmuls beside them
    (Inductor's ``_micro_pipeline_tp`` on symmetric memory: ``runtime/async_tp.py``); CUDA only,
    with compiled blocks and tp > 1"""
    experts: list[str] = field(default_factory=list)
    """the model's expert modules (stacked-weight experts of a Mixture-of-Experts layer), as module
    paths or patterns over repeated blocks (``"model.layers.*.mlp.experts"``); mesh.ep > 1 splits
    each one's experts"""
    model: dict[str, Any] = field(default_factory=dict)
    """{"name": class name, "num_params": int}"""
    cluster: dict[str, Any] = field(default_factory=dict)
    """{"preset": name, "nodes": int, "gpus_per_node": int}"""
    cost: Cost | None = None
    explanation: list[str] = field(default_factory=list)
    alternatives: list[Plan] = field(default_factory=list)
    levers: list[Lever] = field(default_factory=list)
    """each lever the planner can flip on this plan, flipped alone and costed (explain(), the
    widget's alternatives)"""

    def __post_init__(self):
        for name, kind in (("mesh", MeshPlan), ("batch", BatchPlan), ("pipeline", PipelinePlan),
                           ("precision", PrecisionPlan), ("optimizer", OptimizerPlan)):
            if not isinstance(getattr(self, name), kind):
                raise PlanError(f"{name} must be a {kind.__name__}, got {getattr(self, name)!r}")
        check_list("layers", self.layers, LayerPlan)
        seen: set[str] = set()
        for lp in self.layers:
            if lp.path in seen:
                raise PlanError(f"layer {lp.path!r} appears twice in layers")
            seen.add(lp.path)
        check_bool("sync_batchnorm", self.sync_batchnorm)
        check_bool("loss_parallel", self.loss_parallel)
        check_fused_loss(self)
        check_bool("fused_norm", self.fused_norm)
        check_bool("async_tp", self.async_tp)
        check_list("experts", self.experts, str)
        for i, pattern in enumerate(self.experts):
            if not MODULE_PATTERN.fullmatch(pattern):
                raise PlanError(f"experts[{i}]={pattern!r} is not a module path or pattern: dotted "
                                "names of letters, digits, '_', '-' and '*' "
                                "(\"model.layers.*.mlp.experts\")")
        if self.mesh.ep > 1 and not self.experts:
            raise PlanError(f"mesh.ep={self.mesh.ep} but experts is empty: name the expert modules "
                            "to split (\"model.layers.*.mlp.experts\"), or set mesh.ep to 1")
        self._check_info()
        if self.cost is not None and not isinstance(self.cost, Cost):
            raise PlanError(f"cost must be a Cost or None, got {self.cost!r}")
        check_list("explanation", self.explanation, str)
        check_list("alternatives", self.alternatives, Plan)
        check_list("levers", self.levers, Lever)
        gpus = self.cluster.get("nodes", 0) * self.cluster.get("gpus_per_node", 0)
        if gpus and self.mesh.world_size != gpus:
            raise PlanError(f"{self.mesh.factors()} = {self.mesh.world_size} != world_size({gpus})")
        check_cp(self)
        stages = self.mesh.pp * self.pipeline.virtual_stages
        for lp in self.layers:
            if lp.stage >= stages:
                raise PlanError(f"layer {lp.path!r} is on stage {lp.stage}, but the plan has "
                                f"{stages} stage(s) (pp={self.mesh.pp} x "
                                f"virtual_stages={self.pipeline.virtual_stages})")
        check_compiled(self)
        check_schedule(self)

    def _check_info(self) -> None:
        """``model`` and ``cluster``: dicts of known keys with their types."""
        # bounded as the mesh is; bytes and parameters by MAX_INT
        ranks = ("nodes", "gpus_per_node", "scaled_from")
        cluster = ranks + ("memory_limit_bytes",)
        for name, ints, strs in (("model", ("num_params",), ("name",)),
                                 ("cluster", cluster, ("preset",))):
            d = getattr(self, name)
            if not isinstance(d, dict):
                raise PlanError(f"{name} must be a dict, got {d!r}")
            if unknown := [k for k in d if k not in ints + strs]:
                raise PlanError(f"unknown field(s) in {name}: {', '.join(map(repr, unknown))}; "
                                f"{name} has {', '.join(strs + ints)}")
            for k in ints:
                if k in d:
                    check_int(f"{name}.{k}", d[k], minimum=0,
                              maximum=MAX_DEGREE if k in ranks else MAX_INT)
            for k in strs:
                if d.get(k) is not None:
                    check_str(f"{name}.{k}", d[k])

    # ---- lookup ----------------------------------------------------------------------------------
    def layer(self, path: str) -> LayerPlan:
        """The LayerPlan for ``path``; KeyError naming the known layers if absent."""
        for lp in self.layers:
            if lp.path == path:
                return lp
        raise KeyError(f"no layer {path!r} in the plan; layers are: "
                       f"{', '.join(lp.path for lp in self.layers)}")

    @property
    def tp_plan(self) -> dict[str, str]:
        """Every module's TP style, merged over layers: the dict the runtime turns into
        ``parallelize_module``."""
        return {m: style for lp in self.layers for m, style in lp.tp.items()}

    @property
    def tp_parts(self) -> dict[str, list[int]]:
        """Every colwise module's parts (``LayerPlan.tp_parts``), merged over layers."""
        return {m: parts for lp in self.layers for m, parts in lp.tp_parts.items()}

    def stage_layers(self) -> list[list[str]]:
        """Layer paths grouped by pipeline stage, in model order."""
        n = self.mesh.pp * self.pipeline.virtual_stages
        stages: list[list[str]] = [[] for _ in range(n)]
        for lp in self.layers:
            stages[lp.stage].append(lp.path)
        return stages

    # ---- JSON ------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["alternatives"] = [alt.to_dict() | {"alternatives": []} for alt in self.alternatives]
        if self.cost is not None:
            for m in d["cost"]["memory_by_rank"]:
                m["total"] = (m["params"] + m["grads"] + m["optimizer"] + m["activations"]
                              + m["buffers"] + m["margin"])
        return {"schema_version": SCHEMA_VERSION, **d}

    def to_json(self, indent: int | None = 2) -> str:
        """Serialise to JSON (see the module docstring for the schema)."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        """Build a plan from :meth:`to_dict`'s output (e.g. parsed JSON). Every field is checked
        (PlanError names the first bad one); ``d`` is not modified."""
        if not isinstance(d, dict):
            raise PlanError(f"a plan must be a JSON object, got {type(d).__name__}")
        version = d.get("schema_version")
        if version != SCHEMA_VERSION:
            raise PlanError(f"plan schema_version {version!r} is not supported (this autopar-nb "
                            f"reads {SCHEMA_VERSION}); re-plan with this version")
        d = {k: v for k, v in d.items() if k != "schema_version"}
        _check_keys(cls, d, "plan")
        sections = {"mesh": MeshPlan, "batch": BatchPlan, "pipeline": PipelinePlan,
                    "precision": PrecisionPlan, "optimizer": OptimizerPlan}
        for name, kind in sections.items():
            if name in d:
                d[name] = _build(kind, d[name], name)
        if "layers" in d:
            layers = _as_list(d["layers"], "layers")
            d["layers"] = [_build(LayerPlan, lp, f"layers[{i}]") for i, lp in enumerate(layers)]
        if d.get("cost") is not None:
            d["cost"] = _cost_from_dict(d["cost"])
        if "alternatives" in d:
            alts = []
            for i, a in enumerate(_as_list(d["alternatives"], "alternatives")):
                if not isinstance(a, dict):
                    raise PlanError(f"alternatives[{i}] must be a plan object, got "
                                    f"{type(a).__name__}")
                try:
                    alts.append(cls.from_dict({**a, "schema_version": SCHEMA_VERSION}))
                except PlanError as e:
                    raise PlanError(f"alternatives[{i}]: {e}") from None
            d["alternatives"] = alts
        if "levers" in d:
            d["levers"] = [_build(Lever, x, f"levers[{i}]")
                           for i, x in enumerate(_as_list(d["levers"], "levers"))]
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Parse a plan written by :meth:`to_json`; PlanError for text that is not JSON (or nested
        too deeply)."""
        if not isinstance(text, str | bytes | bytearray):
            raise PlanError(f"a plan's JSON text must be a string, got {type(text).__name__}")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"the plan is not valid JSON: {e}") from None
        except RecursionError:
            raise PlanError("the plan's JSON is nested too deeply to be a plan") from None
        return cls.from_dict(data)

    # ---- diff ------------------------------------------------------------------------------------
    def diff(self, other: Plan) -> list[Change]:
        """What changes going from ``self`` to ``other``: decisions only (cost, explanation,
        alternatives, levers ignored)."""
        # field by field, not to_dict(): that serialises the cost and every alternative (35-66 ms a
        # diff of a LLaMA-7B plan, against 2-16 ms), which a diff ignores, and a widget edit diffs
        # the plans it replaces
        skip = {"cost", "explanation", "alternatives", "levers", "layers"}
        plain = [(f.name, *(dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
                            for v in (getattr(self, f.name), getattr(other, f.name))))
                 for f in dataclasses.fields(self) if f.name not in skip]
        changes = [c for k, a, b in plain for c in _diff_values(k, a, b)]
        mine = {lp.path: dataclasses.asdict(lp) for lp in self.layers}
        theirs = {lp.path: dataclasses.asdict(lp) for lp in other.layers}
        for path in list(mine) + [p for p in theirs if p not in mine]:
            if path not in theirs:
                changes.append(Change(f"layers[{path}]", "present", None))
            elif path not in mine:
                changes.append(Change(f"layers[{path}]", None, "present"))
            else:
                changes += [c for k in mine[path] if k != "path"
                            for c in _diff_values(f"layers[{path}].{k}", mine[path][k],
                                                  theirs[path][k])]
        return changes

    def explain(self, run: Any = None) -> str:
        """Why this plan won and what limits it, in plain words (the planner's ``explanation``
        lines); with ``run`` (a launched Run of this plan), what it measured beside the predictions
        (``Run.explain()``) after them."""
        return "\n".join(self.explanation + ([run.explain()] if run is not None else []))

    def summary(self) -> str:
        """One line: mesh, ZeRO, schedule, precision, and predicted cost when known."""
        m = self.mesh
        s = (f"dp={m.dp} tp={m.tp} pp={m.pp}" + (f" cp={m.cp}" if m.cp > 1 else "")
             + f" zero={m.zero_stage}" + (f" ep={m.ep}" if m.ep > 1 else "")
             + (f" offload={m.offload}" if m.offload != "none" else ""))
        if m.pp > 1:
            v = self.pipeline.virtual_stages
            s += (f" {self.pipeline.schedule}" + (f" v{v}" if v > 1 else "")
                  + f" x{self.batch.micro_batches}")
        # a step of several forwards and backwards: compare it so with others
        elif self.batch.micro_batches > 1:
            s += f" accum x{self.batch.micro_batches}"
        if rec := sorted({lp.recompute for lp in self.layers} - {"none"}):
            s += f" recompute={'/'.join(rec)}"
        if self.precision.amp != "none":
            s += f" amp={self.precision.amp}"
        if self.precision.float8 != "none":
            s += f" float8={self.precision.float8}"
        if any(lp.compile for lp in self.layers):
            s += " compile"
        s += "".join(f" {n}"
                     for n, on in (("fused-loss", self.fused_loss), ("fused-norm", self.fused_norm),
                                   ("async-tp", self.async_tp)) if on)
        if self.cost is not None:
            s += (f" | {fmt_time(self.cost.step_time_s)}/step, peak "
                  f"{fmt_bytes(self.cost.peak_memory_bytes)}")
        return s

    def __repr__(self) -> str:
        return f"Plan({self.summary()})"

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(repr(self))


def _as_list(value: Any, what: str) -> list:
    if not isinstance(value, list):
        raise PlanError(f"{what} must be a list, got {type(value).__name__}")
    return value


def _check_keys(kind: type, data: dict, what: str, ignore: tuple[str, ...] = ()) -> None:
    """PlanError for keys of ``data`` that are not fields of the dataclass ``kind``, or required
    fields missing."""
    fields = [f for f in dataclasses.fields(kind) if f.init]
    names = {f.name for f in fields}
    if unknown := [k for k in data if k not in names and k not in ignore]:
        raise PlanError(f"unknown field(s) in {what}: {', '.join(map(repr, unknown))}; "
                        f"{what} has {', '.join(f.name for f in fields)}")
    missing = [f.name for f in fields if f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING and f.name not in data]
    if missing:
        raise PlanError(f"{what} lacks the required field(s) {', '.join(missing)}")


def _build(kind: type, data: Any, what: str, ignore: tuple[str, ...] = ()):
    """``kind(**data)`` for a JSON object ``data`` (not modified), with PlanErrors naming
    ``what``."""
    if not isinstance(data, dict):
        raise PlanError(f"{what} must be a JSON object, got {data!r} ({type(data).__name__})")
    _check_keys(kind, data, what, ignore)
    return kind(**{k: v for k, v in data.items() if k not in ignore})


def _cost_from_dict(data: Any) -> Cost:
    if not isinstance(data, dict):
        raise PlanError(f"cost must be a JSON object or null, got {data!r} ({type(data).__name__})")
    mem = [_build(MemoryBreakdown, m, f"cost.memory_by_rank[{i}]", ignore=("total",))
           for i, m in enumerate(_as_list(data.get("memory_by_rank", []), "cost.memory_by_rank"))]
    return _build(Cost, {**data, "memory_by_rank": mem}, "cost")


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
