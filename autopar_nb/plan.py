"""The Plan: the contract between planner, widget, runtime, export and launch.

A plan is plain data — printable, diffable, JSON round-trippable — and never imports torch.distributed.
Only the runtime maps its strings to PyTorch objects (``"colwise"`` -> ``ColwiseParallel()``).

JSON schema (``SCHEMA_VERSION`` = 1)::

    {
      "schema_version": 1,
      "model":     {"name": str, "num_params": int},
      "cluster":   {"preset": str, "nodes": int, "gpus_per_node": int,  # and, when set: a per-rank limit, the
                    "memory_limit_bytes": int, "scaled_from": int},  # world size a plan_for plan was made for
      "mesh":      {"dp": int, "tp": int, "pp": int, "zero_stage": 0..3, "ep": int, "cp": int, "offload": "none"|"cpu"},
      "batch":     {"global_batch": int, "micro_batches": int, "seq_len": int | null},
      "pipeline":  {"schedule": str, "virtual_stages": int},
      "precision": {"amp": "none"|"bf16"|"fp16", "param_dtype": str, "reduce_dtype": str,
                    "init_loss_scale": float, "dynamic_loss_scale": bool, "growth_interval": int,
                    "float8": "none"|"tensorwise"|"rowwise"},
      "optimizer": {"name": "adam"|"adamw"|"sgd", "lr": float, "weight_decay": float, "betas": [float, float]},
      "layers":    [{"path": str, "stage": int, "tp": {module_path: style},
                     "tp_parts": {module_path: [int, ...]}, "sequence_parallel": bool, "fsdp": bool,
                     "recompute": "none"|"selective"|"full", "compile": bool, "pinned": [field, ...]}, ...],
      "sync_batchnorm": bool,
      "loss_parallel": bool,
      "fused_loss": str,             # the output head fused with the loss ("lm_head"), or "" (unfused)
      "fused_norm": bool,            # the model's RMSNorm modules run kernels_ext's fused RMSNorm
      "async_tp": bool,              # Inductor's micro-pipelined TP (CUDA, compile, tp > 1)
      "experts":   [module_path_pattern, ...],   # expert modules ("model.layers.*.mlp.experts")
      "cost": {...} | null,          # see Cost; filled by the planner
      "explanation": [str, ...],
      "alternatives": [plan, ...]    # the next best plans (their own "alternatives" are empty)
    }
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from .units import fmt_bytes, fmt_time

SCHEMA_VERSION = 1
MAX_DEGREE = 2**20  # counts a plan may carry (more: a typo or hostile). Ranks, any degree: a million (largest ~1e5)
MAX_VIRTUAL_STAGES, MAX_MICRO_BATCHES = 2**10, 2**16  # chunks per pipeline rank (> any model's layers); per step
MAX_BATCH = MAX_SEQ_LEN = 2**24  # samples per step; tokens per sample (16.8M; the longest contexts are ~1e7)
MAX_INT = 2**63 - 1  # any other count (steps, bytes, parameters): an int64, what torch and the runtime hold

# ---- vocabularies: the values a plan may hold (the planner, widget, runtime and export import them from here) ------
ZERO_STAGES = (0, 1, 2, 3)
TP_STYLES = ("replicate", "colwise", "rowwise", "sequence_parallel", "shared", "per_head")
"""how TP runs a module; "per_head": a norm inside each head of a split attention (Qwen3's q_norm), weight whole"""
RECOMPUTE = ("none", "selective", "full")
"""per-layer activation recompute: none | selective (element-wise ops and every other weight matmul) | full (all)"""
AMP = ("none", "bf16", "fp16")
"""autocast dtype of the forward pass; "none" = fp32"""
FLOAT8 = ("none", "tensorwise", "rowwise")
"""torchao's float8 training recipes (``Float8LinearConfig.from_recipe_name``): none | tensorwise (a scale per tensor;
FSDP all-gathers the weights in float8 on GPUs) | rowwise (a scale per row: more accurate, gathers in bf16)"""
OFFLOAD = ("none", "cpu")
"""where FSDP2 keeps the shards of parameters, gradients and optimizer states: device or host (CPUOffloadPolicy)"""
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble")
V_SCHEDULES = ("zbv_zero_bubble",)
"""schedules that place a rank's two stages in a V: rank r holds stages r and 2 pp - 1 - r"""


def stage_rank(stage: int, pp: int, num_stages: int, schedule: str) -> int:
    """The pipeline rank holding ``stage`` of ``num_stages``: stage s on rank s % pp (one stage per rank, or looped
    placement), or in a V (:data:`V_SCHEDULES`); the inverse of ``runtime/pp.py``'s ``stage_ids``."""
    if schedule in V_SCHEDULES and num_stages == 2 * pp and stage >= pp:
        return num_stages - 1 - stage
    return stage % pp
OPTIMIZERS = ("adam", "adamw", "sgd")
LR_SCHEDULES = ("cosine", "constant")
AMP_OPS = ("linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "conv1d", "conv2d", "conv3d", "conv_transpose2d",
           "scaled_dot_product_attention", "softmax", "log_softmax", "layer_norm", "rms_norm", "group_norm",
           "batch_norm", "cross_entropy", "nll_loss", "mse_loss", "embedding", "gelu", "silu", "relu", "add", "sub",
           "mul", "div", "sum", "mean", "exp", "log", "pow", "rsqrt", "cumsum", "norm",
           "elementwise_add", "elementwise_sub", "elementwise_mul", "elementwise_div", "reduce_sum", "reduce_mean")
"""op names ``precision.fp32_ops`` / ``precision.low_precision_ops`` may hold: torch's function names (``x + y`` is
``add``, ``x @ w`` is ``matmul``) and Paddle's names for the same ops (``elementwise_add``, ``reduce_mean``)"""
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16",
               "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
"""plan dtype string (an ``amp`` value other than "none", or ``precision.param_dtype``/``reduce_dtype``) -> the
torch attribute name: ``getattr(torch, DTYPE_NAMES[s])``"""
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
            "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "complex64": 8,
            "complex128": 16}
"""bytes per element by torch dtype name (``str(dtype).removeprefix("torch.")``)"""
FIX_KEYS = ("dp", "tp", "pp", "ep", "cp", "zero_stage", "micro_batches", "schedule", "virtual_stages", "recompute",
            "amp", "float8", "compile", "fused_loss", "fused_norm", "async_tp", "offload",
            "sequence_parallel", "optimizer", "fp32_ops", "low_precision_ops")
"""global choices a user can pin (``--fix``, ``plan(fix=...)``, ``Session.replan(fix=...)``)"""
FIX_ALIASES = {"zero": "zero_stage", "mb": "micro_batches", "micro": "micro_batches", "sp": "sequence_parallel"}
"""short names accepted for FIX_KEYS"""
FIX_CHOICES: dict[str, tuple] = {"zero_stage": ZERO_STAGES, "schedule": SCHEDULES, "recompute": RECOMPUTE,
                                 "amp": AMP, "float8": FLOAT8, "sequence_parallel": (False, True),
                                 "optimizer": OPTIMIZERS, "compile": (False, True), "fused_loss": (False, True),
                                 "fused_norm": (False, True), "async_tp": (False, True), "offload": OFFLOAD}
"""the allowed values of the FIX_KEYS that are choices; the others (dp, tp, pp, ep, cp, micro_batches, virtual_stages)
are positive integers, up to FIX_MAX or else MAX_DEGREE"""
FIX_MAX = {"micro_batches": MAX_MICRO_BATCHES, "virtual_stages": MAX_VIRTUAL_STAGES}

MODULE_PATH = re.compile(r"[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*")
"""a dotted module path as ``nn.Module.named_modules()`` yields it, restricted to names made of letters, digits,
``_`` and ``-`` (attribute names, ``nn.Sequential`` indices, usual ``nn.ModuleDict`` keys); "" is the root"""
MODULE_PATTERN = re.compile(r"[A-Za-z0-9_*-]+(?:\.[A-Za-z0-9_*-]+)*")
"""a module path in which a name may be ``*`` or hold ``*`` (``fnmatch``: any characters): ``"layers.*.mlp.experts"``
names the experts module of every block"""


class PlanError(ValueError):
    """A plan that cannot be valid: the message says which field and why."""


def within(path: str, module: str) -> bool:
    """Whether module ``path`` is ``module`` or lies below it ("" = the root holds every module)."""
    return module == "" or path == module or path.startswith(module + ".")


def layer_of(path: str, layer_paths) -> str | None:
    """The layer that contains module ``path``: the longest of ``layer_paths`` that it is :func:`within`; None when
    no layer does."""
    best = None
    for lp in layer_paths:
        if within(path, lp) and (best is None or len(lp) > len(best)):
            best = lp
    return best


def normalize_fix(fix: dict[str, Any] | None) -> dict[str, Any]:
    """A checked copy of ``fix`` with aliases resolved (``zero`` -> ``zero_stage``, ...). PlanError names an unknown
    key or a value of the wrong type."""
    out: dict[str, Any] = {}
    for key, value in (fix or {}).items():
        k = FIX_ALIASES.get(key, key)
        if k not in FIX_KEYS:
            raise PlanError(f"unknown fix key(s) {key}; supported: {', '.join(FIX_KEYS)} "
                            f"(aliases: {', '.join(f'{a}={t}' for a, t in FIX_ALIASES.items())})")
        if k in ("fp32_ops", "low_precision_ops"):  # op lists: ["softmax", "layer_norm"] or "softmax+layer_norm"
            value = value.split("+") if isinstance(value, str) else value
            if not isinstance(value, (list, tuple)):
                raise PlanError(f"fix[{k!r}] must be a list of op names (or names joined by '+'), got {value!r}")
            for op in value:
                _check_choice(f"fix[{k!r}][...]", op, AMP_OPS)
            value = list(value)
        elif k in FIX_CHOICES:
            _check_choice(f"fix[{k!r}]", value, FIX_CHOICES[k])
        else:
            _check_int(f"fix[{k!r}]", value, minimum=1, maximum=FIX_MAX.get(k, MAX_DEGREE))
        out[k] = value
    return out


# ---- field checks (each names the field) ---------------------------------------------------------------------------
def _check_choice(what: str, value: Any, allowed: tuple) -> None:
    # type first (a vocabulary holds one type): True == 1 == 1.0, so `in` alone would take them for zero_stage 1
    if type(value) is not type(allowed[0]) or value not in allowed:
        raise PlanError(f"{what}={value!r} is not supported; choose one of {', '.join(map(repr, allowed))}")


def _check_int(what: str, value: Any, *, minimum: int | None = None, maximum: int = MAX_INT) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"{what} must be an integer, got {value!r} ({type(value).__name__})")
    if minimum is not None and value < minimum:
        raise PlanError(f"{what} must be >= {minimum}, got {value}")
    if value > maximum:
        raise PlanError(f"{what} must be <= {maximum}, got {value}")


def _check_number(what: str, value: Any, *, minimum: float | None = None, below: float | None = None,
                  finite: bool = True) -> float:
    """The value as a float; PlanError unless it is an int or float (not a bool or a string) in range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PlanError(f"{what} must be a number, got {value!r} ({type(value).__name__})")
    if finite and not math.isfinite(value):
        raise PlanError(f"{what} must be finite, got {value!r}")
    if (minimum is not None and value < minimum) or (below is not None and value >= below):
        rng = f">= {minimum}" if below is None else f"in [{minimum}, {below})"
        raise PlanError(f"{what} must be {rng}, got {value!r}")
    return float(value)


def _check_bool(what: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise PlanError(f"{what} must be true or false, got {value!r} ({type(value).__name__})")


def _check_str(what: str, value: Any) -> None:
    if not isinstance(value, str):
        raise PlanError(f"{what} must be a string, got {value!r} ({type(value).__name__})")


def _check_module_path(what: str, value: Any, *, root: bool) -> None:
    _check_str(what, value)
    if not (value == "" and root) and not MODULE_PATH.fullmatch(value):
        raise PlanError(f"{what}={value!r} is not a module path: dotted names of letters, digits, '_' and '-' "
                        f"(as nn.Module.named_modules() yields them){', or the root' if root else ''}")


def _check_list(what: str, value: Any, kind: type) -> None:
    if not isinstance(value, list):
        raise PlanError(f"{what} must be a list, got {value!r} ({type(value).__name__})")
    for i, v in enumerate(value):
        if not isinstance(v, kind):
            raise PlanError(f"{what}[{i}] must be a {kind.__name__}, got {v!r} ({type(v).__name__})")


def _check_numbers(obj: Any, prefix: str, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        if type(value) is not float:  # a float passes (not finite allowed): checked without naming it (hot path)
            _check_number(f"{prefix}.{name}", value, finite=False)


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
    2: + gradients sharded (FSDP2, reshard_after_forward=False); 3: + parameters sharded
    (FSDP2, reshard=True), but in pipeline stages under a zero-bubble schedule, whose input
    pass needs the parameters the forward used, they stay gathered after forward, as under 2"""
    ep: int = 1
    """expert-parallel degree: the experts of every ``Plan.experts`` module split over ``ep`` consecutive
    data-parallel ranks, tokens routed to them by all-to-all. Borrowed from dp as torchtitan does (no ranks of its
    own: ep divides dp); each expert is then held by dp / ep ranks, which average its gradients"""
    cp: int = 1
    """context-parallel degree: every sample's sequence split over ``cp`` ranks of a replica, attention computed by
    torch's ring attention (``context_parallel``; K/V passed round the cp ranks in every attention layer). Ranks of
    its own (world = pp * dp * cp * tp), between dp and tp; parameters are replicated over them and gradients
    averaged over dp * cp, as over data-parallel ranks"""
    offload: str = "none"
    """:data:`OFFLOAD`: "cpu" keeps FSDP's shards in host memory (``runtime/fsdp.py``); needs zero_stage 2 or 3"""

    def __post_init__(self):
        for name in ("dp", "tp", "pp", "ep", "cp"):
            _check_int(f"mesh.{name}", getattr(self, name), minimum=1, maximum=MAX_DEGREE)
        _check_int(f"mesh world size {self.factors()}", self.world_size, maximum=MAX_DEGREE)
        _check_choice("mesh.zero_stage", self.zero_stage, ZERO_STAGES)
        _check_choice("mesh.offload", self.offload, OFFLOAD)
        if self.offload != "none" and self.zero_stage < 2:
            raise PlanError(f"mesh.offload={self.offload!r} needs FSDP (zero_stage 2 or 3), got {self.zero_stage}")
        if self.dp % self.ep:
            raise PlanError(f"mesh.ep({self.ep}) must divide mesh.dp({self.dp}): expert parallelism splits the "
                            f"experts over data-parallel ranks (dp({self.dp}) % ep({self.ep}) = {self.dp % self.ep})")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def factors(self) -> str:
        """The world's factors as text: ``dp(2) * tp(2) * pp(1)``, with ``cp(2)`` when there is context parallelism."""
        return f"dp({self.dp}) * tp({self.tp}) * pp({self.pp})" + (f" * cp({self.cp})" if self.cp > 1 else "")


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
        _check_int("batch.global_batch", self.global_batch, minimum=1, maximum=MAX_BATCH)
        _check_int("batch.micro_batches", self.micro_batches, minimum=1, maximum=MAX_MICRO_BATCHES)
        if self.seq_len is not None:
            _check_int("batch.seq_len", self.seq_len, minimum=1, maximum=MAX_SEQ_LEN)


@dataclass
class PipelinePlan:
    """Pipeline schedule from ``torch.distributed.pipelining``."""

    schedule: str = "1f1b"
    """gpipe | 1f1b | interleaved_1f1b | looped_bfs | interleaved_zero_bubble | zbv_zero_bubble"""
    virtual_stages: int = 1
    """model chunks per pipeline rank (> 1 only for interleaved/looped schedules)"""

    def __post_init__(self):
        _check_choice("pipeline.schedule", self.schedule, SCHEDULES)
        _check_int("pipeline.virtual_stages", self.virtual_stages, minimum=1, maximum=MAX_VIRTUAL_STAGES)


@dataclass
class PrecisionPlan:
    """Mixed precision: autocast dtype, FSDP param/reduce dtypes, loss scaling for fp16."""

    amp: str = "none"
    """none | bf16 | fp16: the autocast dtype for the forward pass"""
    param_dtype: str = "float32"
    """dtype parameters are gathered/computed in (FSDP MixedPrecisionPolicy.param_dtype)"""
    reduce_dtype: str = "float32"
    """dtype gradients are reduced in"""
    init_loss_scale: float = 32768.0
    """fp16 only: GradScaler init_scale (PaddlePaddle's init_loss_scaling)"""
    dynamic_loss_scale: bool = True
    """fp16 only: grow/shrink the scale (PaddlePaddle's use_dynamic_loss_scaling)"""
    growth_interval: int = 2000
    """fp16 only: steps without overflow before the scale doubles"""
    fp32_ops: list[str] = field(default_factory=list)
    """ops kept in float32 under autocast (PaddlePaddle's custom_black_list), names from :data:`AMP_OPS`"""
    low_precision_ops: list[str] = field(default_factory=list)
    """ops run in the autocast dtype beyond autocast's own list (PaddlePaddle's custom_white_list: ``["matmul",
    "elementwise_add"]``)"""
    float8: str = "none"
    """:data:`FLOAT8`: the Linear layers whose dimensions are multiples of 16, the output head excepted, train with
    float8 matmuls (torchao's ``convert_to_float8_training``; ``runtime/float8.py``); needs amp "bf16"""

    def __post_init__(self):
        _check_choice("precision.amp", self.amp, AMP)
        _check_choice("precision.float8", self.float8, FLOAT8)
        if self.float8 != "none" and self.amp != "bf16":
            raise PlanError(f"precision.float8={self.float8!r} needs precision.amp='bf16' (torchao's float8 matmuls "
                            f"take bf16 inputs), got amp={self.amp!r}; set amp to 'bf16' or float8 to 'none'")
        for name in ("fp32_ops", "low_precision_ops"):
            ops = getattr(self, name)
            if not isinstance(ops, (list, tuple)):
                raise PlanError(f"precision.{name} must be a list of op names, got {ops!r}")
            for op in ops:
                _check_choice(f"precision.{name}[...]", op, AMP_OPS)
            setattr(self, name, list(ops))
            if ops and self.amp == "none":
                raise PlanError(f"precision.{name}={list(ops)} needs mixed precision: set precision.amp (or fix "
                                "amp=) to 'bf16' or 'fp16' (without autocast every op runs in float32)")
        if both := sorted(set(self.fp32_ops) & set(self.low_precision_ops)):
            raise PlanError(f"precision.fp32_ops and precision.low_precision_ops both name {', '.join(both)}")
        _check_choice("precision.param_dtype", self.param_dtype, tuple(DTYPE_NAMES))
        _check_choice("precision.reduce_dtype", self.reduce_dtype, tuple(DTYPE_NAMES))
        self.init_loss_scale = _check_number("precision.init_loss_scale", self.init_loss_scale, minimum=0.0)
        _check_bool("precision.dynamic_loss_scale", self.dynamic_loss_scale)
        _check_int("precision.growth_interval", self.growth_interval, minimum=1)


@dataclass
class OptimizerPlan:
    """The optimizer the exported script builds."""

    name: str = "adam"
    """adam | adamw | sgd"""
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam's (beta1, beta2), each in [0, 1)"""
    warmup_steps: int = 0
    """steps of linear learning-rate warm-up from lr / warmup_steps to lr"""
    lr_schedule: str = "cosine"
    """after warm-up: cosine decay to ``min_lr_ratio * lr`` at the run's last step, or constant"""
    min_lr_ratio: float = 0.1
    """the cosine's end, relative to lr"""
    grad_clip: float = 1.0
    """the largest global gradient 2-norm (torchtitan's and Megatron-LM's default 1.0); 0 turns clipping off"""

    def __post_init__(self):
        _check_choice("optimizer.name", self.name, OPTIMIZERS)
        _check_choice("optimizer.lr_schedule", self.lr_schedule, LR_SCHEDULES)
        _check_int("optimizer.warmup_steps", self.warmup_steps, minimum=0)
        self.min_lr_ratio = _check_number("optimizer.min_lr_ratio", self.min_lr_ratio, minimum=0.0)
        self.grad_clip = _check_number("optimizer.grad_clip", self.grad_clip, minimum=0.0)
        self.lr = _check_number("optimizer.lr", self.lr, minimum=0.0)
        self.weight_decay = _check_number("optimizer.weight_decay", self.weight_decay, minimum=0.0)
        if not isinstance(self.betas, (list, tuple)) or len(self.betas) != 2:
            raise PlanError(f"optimizer.betas must be two numbers [beta1, beta2], got {self.betas!r}")
        self.betas = tuple(_check_number(f"optimizer.betas[{i}]", b, minimum=0.0, below=1.0)
                           for i, b in enumerate(self.betas))


PINNABLE = ("stage", "recompute", "fsdp", "tp")
"""the LayerPlan fields an override can pin (the keys of ``Session.override`` / ``plan(overrides=...)``)"""


@dataclass
class LayerPlan:
    """Decisions for one layer (a node of ``ModelGraph.layers``, e.g. ``h.3`` or ``lm_head``)."""

    path: str
    """module path of the layer inside the model"""
    stage: int = 0
    """pipeline stage (0 .. pp * virtual_stages - 1)"""
    tp: dict[str, str] = field(default_factory=dict)
    """module path -> TP style (TP_STYLES; absent: replicate); an Embedding "rowwise" splits the vocabulary"""
    tp_parts: dict[str, list[int]] = field(default_factory=dict)
    """"colwise" module path -> the parts its output features hold, in order, counted in heads (or features for
    parts that have none): [12] for a projection of 12 heads, [32, 8, 8] for a fused q|k|v with 32 query and 8
    key/value heads, [11008, 11008] for a fused gate|up, [12] for T5's relative_attention_bias (kept split by heads).
    Rank r holds slice r of every part; a part of fewer heads than mesh.tp is repeated (weight whole on every rank).
    Absent: one part, split evenly. "shared" (kept whole): features [before, shared(, after)] (MLA: rope key)."""
    sequence_parallel: bool = False
    """norms/dropout of this layer run sequence-parallel (activations sharded on the sequence dim between TP regions)"""
    fsdp: bool = True
    """wrap this layer as its own FSDP unit (when mesh.zero_stage >= 2); False folds it into the root unit"""
    recompute: str = "none"
    """none | selective (recompute element-wise ops, every other weight matmul) | full (keep only the layer input)"""
    compile: bool = False
    """compile this layer with ``torch.compile`` (Inductor), on its own as torchtitan's ``apply_compile`` does each
    repeated block: its pointwise ops, norms and softmax fused into fewer kernels. Only with mesh.pp == 1 (pipeline
    stages are traced graphs whose blocks are no longer modules that run)"""
    pinned: list[str] = field(default_factory=list)
    """the fields above that the user fixed with an override; the planner never changes them"""

    def __post_init__(self):
        _check_module_path("layer path", self.path, root=True)
        where = f"layers[{self.path!r}]"
        _check_int(f"{where}.stage", self.stage, minimum=0)
        if not isinstance(self.tp, dict):
            raise PlanError(f"{where}.tp must be a dict of module path -> style, got {self.tp!r}")
        root = self.path == ""  # "" (the root module) only in the root layer: a model that is a single Linear
        for mod, style in self.tp.items():  # the messages are built only for a bad entry (plans have many)
            if type(mod) is not str or not (MODULE_PATH.fullmatch(mod) or (root and mod == "")):
                _check_module_path(f"{where}.tp key", mod, root=root)
            if type(style) is not str or style not in TP_STYLES:
                _check_choice(f"{where}.tp[{mod!r}]", style, TP_STYLES)
        if not isinstance(self.tp_parts, dict):
            raise PlanError(f"{where}.tp_parts must be a dict of module path -> [int, ...], got {self.tp_parts!r}")
        for mod, parts in self.tp_parts.items():
            if self.tp.get(mod) not in ("colwise", "shared"):
                raise PlanError(f"{where}.tp_parts names {mod!r}, whose tp style is {self.tp.get(mod, 'replicate')!r}"
                                ": parts say how a 'colwise' split cuts a module's output (or a 'shared' one's)")
            _check_list(f"{where}.tp_parts[{mod!r}]", parts, int)
            if not parts:
                raise PlanError(f"{where}.tp_parts[{mod!r}] is empty: give at least one part")
            for i, n in enumerate(parts):
                _check_int(f"{where}.tp_parts[{mod!r}][{i}]", n, minimum=1)
        _check_bool(f"{where}.sequence_parallel", self.sequence_parallel)
        _check_bool(f"{where}.fsdp", self.fsdp)
        _check_bool(f"{where}.compile", self.compile)
        _check_choice(f"{where}.recompute", self.recompute, RECOMPUTE)
        _check_list(f"{where}.pinned", self.pinned, str)
        for name in self.pinned:
            _check_choice(f"{where}.pinned entry", name, PINNABLE)


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
    host: float = 0.0
    """bytes this rank keeps in host memory (``mesh.offload``: its FSDP shards and optimizer states), not in total"""
    terms: dict[str, float] = field(default_factory=dict)
    """the named terms ``activations`` and ``buffers`` are made of, by :data:`MEMORY_TERMS` name (bytes)"""

    def __post_init__(self):
        _check_numbers(self, "memory", _MEMORY_FIELDS)
        if not isinstance(self.terms, dict):
            raise PlanError(f"memory.terms must be a JSON object, got {self.terms!r} ({type(self.terms).__name__})")
        for name, value in self.terms.items():  # (the planner makes one per rank and candidate: fast when valid)
            if type(name) is not str or name not in MEMORY_TERMS:
                _check_choice("memory.terms", name, tuple(MEMORY_TERMS))
            if type(value) is not float:
                _check_number(f"memory.terms[{name!r}]", value, finite=False)

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers + self.margin


_MEMORY_FIELDS = ("params", "grads", "optimizer", "activations", "buffers", "margin", "host")
MEMORY_TERMS = {
    "saved_activations": "activations", "loss_saved": "activations", "autocast_weight_copies": "buffers",
    "ddp_buckets": "buffers", "fsdp_unsharded_params": "buffers", "fsdp_root_params": "buffers",
    "fsdp_gathered_units": "buffers", "fsdp_reduce_scatter": "buffers", "fsdp_unsharded_grads": "buffers",
    "fsdp_weight_pass_grads": "buffers", "pipeline_buffers": "buffers", "pipeline_outputs": "activations",
    "pipeline_sent_gradients": "buffers", "weight_pass_gradients": "buffers", "backward_working_set": "buffers",
    "forward_working_set": "activations",
    "fsdp_all_gather": "buffers", "replicate_gathered_experts": "buffers", "replicate_reduce_buffers": "buffers",
    "loss_temporaries": "buffers", "optimizer_step_temporaries": "buffers",
}
"""term of a rank's peak -> the MemoryBreakdown field it is part of: what autograd saves for backward (every micro-batch
in flight); the loss's saved log-softmax; autocast's 16-bit copies of the weights its lower-precision ops read; DDP's
gradient buckets; FSDP's parameters kept unsharded from forward to backward (ZeRO 2, and replicate), the parameters left
in the root unit (ZeRO 3), and the unit being computed plus the prefetched one (ZeRO 3: parameters and their unsharded
gradients); a pipelined FSDP stage's gradients, accumulated unsharded over its micro-batches and reduce-scattered once
after the last, and under a zero-bubble schedule and mixed precision the 16-bit gradients a weight pass leaves until
FSDP takes them in; the buffers pipeline stages receive inputs and gradients into (per micro-batch in flight) and their
outputs, kept until each micro-batch's backward, and the input gradients of the micro-batch before, whose send the
schedule still holds; the gradients a zero-bubble schedule's input pass keeps for each micro-batch's weight pass; the
largest layer's backward working set; at a layer's forward, what it holds then (its saved tensors so far and the
storages alive: output, operands still to be read, autocast's copies) and its FSDP unit's all-gather output; the loss's
temporaries (logits and their copies, loss_parallel's shards); the optimizer step's temporaries; beside DDP, the
experts' replicas' gathered parameters and reduction buffers"""


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
    cpu_wait_s: float = 0.0
    """time the GPU waits for the host to issue work: the step is CPU-bound where issuing it (eager
    ops, FSDP's and DDP's hooks, TP's DTensor dispatch, the optimizer step) takes longer than
    running it. With compute_s, comm_exposed_s, bubble_s and optimizer_s it sums to step_time_s"""
    cpu_s: float = 0.0
    """the host's time issuing one step (``cost/cpu.py``)"""
    cpu_by_part: dict[str, float] = field(default_factory=dict)
    """cpu_s by part: eager ops, tensor parallel, FSDP, DDP, pipeline, collectives, optimizer"""
    memory_by_rank: list[MemoryBreakdown] = field(default_factory=list)
    peak_memory_bytes: float = 0.0
    model_tflops_per_gpu: float = 0.0
    """model FLOPs (``cost.time.MFU_BASIS``: recompute not counted) per GPU per second, in TFLOP/s"""
    hardware_tflops_per_gpu: float = 0.0
    """FLOPs actually executed (with recompute) per GPU per second, in TFLOP/s"""
    mfu: float = 0.0
    """model FLOPs per GPU per second over the device's datasheet peak for the plan's precision"""
    tokens_per_s: float | None = None
    samples_per_s: float = 0.0

    def __post_init__(self):
        _check_numbers(self, "cost", _COST_FIELDS)
        if self.tokens_per_s is not None:
            _check_number("cost.tokens_per_s", self.tokens_per_s, finite=False)
        for name in ("comm_by_kind", "comm_exposed_by_kind", "cpu_by_part"):
            d = getattr(self, name)
            if not isinstance(d, dict):
                raise PlanError(f"cost.{name} must be a dict of name -> seconds, got {d!r}")
            for k, v in d.items():
                _check_str(f"cost.{name} key", k)
                _check_number(f"cost.{name}[{k!r}]", v, finite=False)
        _check_list("cost.memory_by_rank", self.memory_by_rank, MemoryBreakdown)


_COST_FIELDS = ("step_time_s", "compute_s", "comm_exposed_s", "comm_total_s", "bubble_s", "optimizer_s",
                "cpu_wait_s", "cpu_s",
                "peak_memory_bytes", "model_tflops_per_gpu", "hardware_tflops_per_gpu", "mfu", "samples_per_s")


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
    """the output head is vocab-parallel and the loss is computed on sharded logits (torch loss_parallel)"""
    fused_loss: str = ""
    """module path of the output head (a bias-free ``nn.Linear``) whose matmul runs fused with the default next-token
    cross-entropy, chunk by chunk (``kernels_ext.linear_cross_entropy``): the full logits and their gradient are never
    held, and the logits are computed again in backward. "" = unfused. Only with the default loss (the cell defines no
    ``loss_fn``) and mesh.pp == 1; with mesh.tp > 1 the head's weight is split on the vocabulary and the loss is
    vocab-parallel (``kernels_ext.vocab_parallel_linear_cross_entropy``), so loss_parallel stays false"""
    fused_norm: bool = False
    """the model's RMSNorm modules (found by what they compute: ``runtime/fused_norm.py``) run kernels_ext's fused
    RMSNorm, which keeps the input and one fp32 rstd per row for backward instead of the eager chain's input,
    normalised input and rstd (on CUDA one kernel instead of five: Liger-kernel's when installed, else torch's)"""
    async_tp: bool = False
    """TP's all-gathers and reduce-scatters run micro-pipelined with the matmuls beside them (Inductor's
    ``_micro_pipeline_tp`` on symmetric memory: ``runtime/async_tp.py``); CUDA only, with compiled blocks and tp > 1"""
    experts: list[str] = field(default_factory=list)
    """the model's expert modules (stacked-weight experts of a Mixture-of-Experts layer), as module paths or patterns
    over repeated blocks (``"model.layers.*.mlp.experts"``); mesh.ep > 1 splits each one's experts"""
    model: dict[str, Any] = field(default_factory=dict)
    """{"name": class name, "num_params": int}"""
    cluster: dict[str, Any] = field(default_factory=dict)
    """{"preset": name, "nodes": int, "gpus_per_node": int}"""
    cost: Cost | None = None
    explanation: list[str] = field(default_factory=list)
    alternatives: list[Plan] = field(default_factory=list)

    def __post_init__(self):
        for name, kind in (("mesh", MeshPlan), ("batch", BatchPlan), ("pipeline", PipelinePlan),
                           ("precision", PrecisionPlan), ("optimizer", OptimizerPlan)):
            if not isinstance(getattr(self, name), kind):
                raise PlanError(f"{name} must be a {kind.__name__}, got {getattr(self, name)!r}")
        _check_list("layers", self.layers, LayerPlan)
        seen: set[str] = set()
        for lp in self.layers:
            if lp.path in seen:
                raise PlanError(f"layer {lp.path!r} appears twice in layers")
            seen.add(lp.path)
        _check_bool("sync_batchnorm", self.sync_batchnorm)
        _check_bool("loss_parallel", self.loss_parallel)
        self._check_fused_loss()
        _check_bool("fused_norm", self.fused_norm)
        _check_bool("async_tp", self.async_tp)
        _check_list("experts", self.experts, str)
        for i, pattern in enumerate(self.experts):
            if not MODULE_PATTERN.fullmatch(pattern):
                raise PlanError(f"experts[{i}]={pattern!r} is not a module path or pattern: dotted names of letters, "
                                "digits, '_', '-' and '*' (\"model.layers.*.mlp.experts\")")
        if self.mesh.ep > 1 and not self.experts:
            raise PlanError(f"mesh.ep={self.mesh.ep} but experts is empty: name the expert modules to split "
                            "(\"model.layers.*.mlp.experts\"), or set mesh.ep to 1")
        self._check_info()
        if self.cost is not None and not isinstance(self.cost, Cost):
            raise PlanError(f"cost must be a Cost or None, got {self.cost!r}")
        _check_list("explanation", self.explanation, str)
        _check_list("alternatives", self.alternatives, Plan)
        gpus = self.cluster.get("nodes", 0) * self.cluster.get("gpus_per_node", 0)
        if gpus and self.mesh.world_size != gpus:
            raise PlanError(f"{self.mesh.factors()} = {self.mesh.world_size} != world_size({gpus})")
        self._check_cp()
        stages = self.mesh.pp * self.pipeline.virtual_stages
        for lp in self.layers:
            if lp.stage >= stages:
                raise PlanError(f"layer {lp.path!r} is on stage {lp.stage}, but the plan has {stages} stage(s) "
                                f"(pp={self.mesh.pp} x virtual_stages={self.pipeline.virtual_stages})")
        compiled = [lp.path for lp in self.layers if lp.compile]
        if compiled and self.mesh.pp > 1:
            raise PlanError(f"layers {', '.join(compiled[:3])}{', ...' if len(compiled) > 3 else ''} are compiled, but "
                            f"mesh.pp={self.mesh.pp}: compile applies to whole blocks with pp=1 only (a pipeline stage "
                            "is a traced graph); set their compile to false or pp to 1")
        if self.async_tp and (self.mesh.tp == 1 or not compiled or self.cluster.get("preset") == "cpu"):
            raise PlanError(f"async_tp=true needs CUDA (symmetric memory), compiled blocks and mesh.tp > 1; got cluster"
                            f" {self.cluster.get('preset')!r}, {len(compiled)} compiled layers, tp={self.mesh.tp}")
        if self.precision.float8 != "none" and self.mesh.pp > 1:
            raise PlanError(f"precision.float8={self.precision.float8!r} with mesh.pp={self.mesh.pp}: float8 runs "
                            "with pp=1 only (not verified under pipelining, whose stages are traced graphs); set "
                            "float8 to 'none' or pp to 1")
        self._check_schedule()

    def _check_schedule(self) -> None:
        """What torch.distributed.pipelining's schedules refuse when they are built (in every rank, after start-up):
        1F1B needs a micro-batch per stage at least; the interleaved schedules a number of micro-batches that splits
        into rounds of pp; zero-bubble V exactly 2 stages per rank."""
        m, pl, mb = self.mesh, self.pipeline, self.batch.micro_batches
        if m.pp == 1:
            return
        if pl.schedule == "1f1b" and mb < m.pp:
            raise PlanError(f"pipeline.schedule='1f1b' with mesh.pp={m.pp} needs batch.micro_batches >= {m.pp} "
                            f"(torch's Schedule1F1B runs at least one micro-batch per stage), got {mb}; raise "
                            "micro_batches or use 'gpipe'")
        rounds = max(1, mb // m.pp)
        if pl.schedule in ("interleaved_1f1b", "interleaved_zero_bubble") and mb % rounds:
            raise PlanError(f"pipeline.schedule={pl.schedule!r} with mesh.pp={m.pp} needs batch.micro_batches to be a "
                            f"multiple of its rounds (micro_batches // pp = {rounds}), got {mb}; use a multiple of "
                            f"{m.pp} or fewer than {2 * m.pp}")
        if pl.schedule == "zbv_zero_bubble" and pl.virtual_stages != 2:
            raise PlanError(f"pipeline.schedule='zbv_zero_bubble' runs exactly 2 stages per rank: "
                            f"pipeline.virtual_stages must be 2, got {pl.virtual_stages}")

    def _check_cp(self) -> None:
        """``mesh.cp`` > 1: a sequence model whose sequence splits into 2 * cp equal chunks (torch's head-tail load
        balancing of causal attention), without pipelining, experts or a fused loss head."""
        m, seq = self.mesh, self.batch.seq_len
        if m.cp == 1:
            return
        if seq is None:
            raise PlanError(f"mesh.cp={m.cp} needs a sequence model: batch.seq_len is null (context parallelism "
                            "splits every sample's sequence); set mesh.cp to 1")
        if seq % (2 * m.cp):
            raise PlanError(f"mesh.cp={m.cp} needs batch.seq_len divisible by 2 * cp = {2 * m.cp} (torch's "
                            f"load balancing cuts each sequence into 2 * cp chunks), got seq_len {seq}")
        why = ("mesh.pp > 1 (pipeline stages are traced graphs, where torch's context_parallel cannot replace the "
               "attention)" if m.pp > 1 else "mesh.ep > 1" if m.ep > 1 else
               "fused_loss (the fused head computes the unsplit sequence's loss)" if self.fused_loss else "")
        if why:
            raise PlanError(f"mesh.cp={m.cp} with {why} is not supported; set mesh.cp to 1")

    def _check_fused_loss(self) -> None:
        """``fused_loss``: a module path or ""; the fused head runs where the head is (under pipelining on the last
        stage, which ends at its input), vocab-parallel under TP (its own loss, not torch's loss_parallel), not
        both pipelined and vocab-parallel (not verified)."""
        _check_module_path("fused_loss", self.fused_loss, root=True)
        if not self.fused_loss:
            return
        m = self.mesh
        if self.loss_parallel:
            raise PlanError(f"fused_loss={self.fused_loss!r} with loss_parallel=true (the fused head computes a "
                            "vocab-parallel loss itself under TP; torch's loss_parallel takes logits, which it never "
                            "makes): set loss_parallel to false, or fused_loss to \"\" (or fix fused_loss=false)")
        if m.pp > 1 and m.tp > 1:
            raise PlanError(f"fused_loss={self.fused_loss!r} with mesh.pp={m.pp} and mesh.tp={m.tp}: the fused head "
                            "runs on the last pipeline stage unsplit, or vocab-parallel without pipelining, not both "
                            "(not verified yet); use tp=1 or pp=1, or set fused_loss to \"\" (fix fused_loss=false)")

    def _check_info(self) -> None:
        """``model`` and ``cluster``: dicts of known keys with their types."""
        ranks = ("nodes", "gpus_per_node", "scaled_from")  # bounded as the mesh is; bytes and parameters by MAX_INT
        cluster = ranks + ("memory_limit_bytes",)
        for name, ints, strs in (("model", ("num_params",), ("name",)), ("cluster", cluster, ("preset",))):
            d = getattr(self, name)
            if not isinstance(d, dict):
                raise PlanError(f"{name} must be a dict, got {d!r}")
            if unknown := [k for k in d if k not in ints + strs]:
                raise PlanError(f"unknown field(s) in {name}: {', '.join(map(repr, unknown))}; {name} has "
                                f"{', '.join(strs + ints)}")
            for k in ints:
                if k in d:
                    _check_int(f"{name}.{k}", d[k], minimum=0, maximum=MAX_DEGREE if k in ranks else MAX_INT)
            for k in strs:
                if d.get(k) is not None:
                    _check_str(f"{name}.{k}", d[k])

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
        """Build a plan from :meth:`to_dict`'s output (e.g. parsed JSON). Every field is checked (PlanError names the
        first bad one); ``d`` is not modified."""
        if not isinstance(d, dict):
            raise PlanError(f"a plan must be a JSON object, got {type(d).__name__}")
        version = d.get("schema_version")
        if version != SCHEMA_VERSION:
            raise PlanError(f"plan schema_version {version!r} is not supported (this autopar-nb reads "
                            f"{SCHEMA_VERSION}); re-plan with this version")
        d = {k: v for k, v in d.items() if k != "schema_version"}
        _check_keys(cls, d, "plan")
        sections = {"mesh": MeshPlan, "batch": BatchPlan, "pipeline": PipelinePlan, "precision": PrecisionPlan,
                    "optimizer": OptimizerPlan}
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
                    raise PlanError(f"alternatives[{i}] must be a plan object, got {type(a).__name__}")
                try:
                    alts.append(cls.from_dict({**a, "schema_version": SCHEMA_VERSION}))
                except PlanError as e:
                    raise PlanError(f"alternatives[{i}]: {e}") from None
            d["alternatives"] = alts
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Parse a plan written by :meth:`to_json`; PlanError for text that is not JSON (or nested too deeply)."""
        if not isinstance(text, str | bytes | bytearray):
            raise PlanError(f"a plan's JSON text must be a string, got {type(text).__name__}")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"the plan is not valid JSON: {e}") from None
        except RecursionError:
            raise PlanError("the plan's JSON is nested too deeply to be a plan") from None
        return cls.from_dict(data)

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

    def explain(self, run: Any = None) -> str:
        """Why this plan won and what limits it, in plain words (the planner's ``explanation`` lines); with ``run``
        (a launched Run of this plan), what it measured beside the predictions (``Run.explain()``) after them."""
        return "\n".join(self.explanation + ([run.explain()] if run is not None else []))

    def summary(self) -> str:
        """One line: mesh, ZeRO, schedule, precision, and predicted cost when known."""
        m = self.mesh
        s = (f"dp={m.dp} tp={m.tp} pp={m.pp}" + (f" cp={m.cp}" if m.cp > 1 else "") + f" zero={m.zero_stage}"
             + (f" ep={m.ep}" if m.ep > 1 else "") + (f" offload={m.offload}" if m.offload != "none" else ""))
        if m.pp > 1:
            v = self.pipeline.virtual_stages
            s += f" {self.pipeline.schedule}" + (f" v{v}" if v > 1 else "") + f" x{self.batch.micro_batches}"
        if rec := sorted({lp.recompute for lp in self.layers} - {"none"}):
            s += f" recompute={'/'.join(rec)}"
        if self.precision.amp != "none":
            s += f" amp={self.precision.amp}"
        if self.precision.float8 != "none":
            s += f" float8={self.precision.float8}"
        if any(lp.compile for lp in self.layers):
            s += " compile"
        s += "".join(f" {n}" for n, on in (("fused-loss", self.fused_loss), ("fused-norm", self.fused_norm),
                                           ("async-tp", self.async_tp)) if on)
        if self.cost is not None:
            s += f" | {fmt_time(self.cost.step_time_s)}/step, peak {fmt_bytes(self.cost.peak_memory_bytes)}"
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
    """PlanError for keys of ``data`` that are not fields of the dataclass ``kind``, or required fields missing."""
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
    """``kind(**data)`` for a JSON object ``data`` (not modified), with PlanErrors naming ``what``."""
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
