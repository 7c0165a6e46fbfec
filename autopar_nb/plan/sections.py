"""The sections of a plan: the mesh, batch, pipeline, precision and optimizer settings, and each
layer's decisions. Each checks its own fields when built."""

from __future__ import annotations

from dataclasses import dataclass, field

from .checks import (
    PlanError,
    check_bool,
    check_choice,
    check_int,
    check_list,
    check_module_path,
    check_number,
)
from .vocab import (
    AMP,
    AMP_OPS,
    DTYPE_NAMES,
    FLOAT8,
    LR_SCHEDULES,
    MAX_BATCH,
    MAX_DEGREE,
    MAX_MICRO_BATCHES,
    MAX_SEQ_LEN,
    MAX_VIRTUAL_STAGES,
    MODULE_PATH,
    MOE_CAPACITY,
    OFFLOAD,
    OPTIMIZERS,
    PINNABLE,
    RECOMPUTE,
    SCHEDULES,
    TP_STYLES,
    ZERO_STAGES,
)


@dataclass
class MeshPlan:
    """How the world is factored. Mesh dims are ordered (pp, dp, tp): TP innermost, so it stays
    inside a node."""

    dp: int = 1
    """data-parallel degree: replicas (zero_stage 0) or shards (zero_stage >= 1)"""
    tp: int = 1
    """tensor-parallel degree (Megatron-style column/row splits, optionally with sequence
    parallel)"""
    pp: int = 1
    """pipeline-parallel degree: number of pipeline ranks"""
    zero_stage: int = 0
    """0: DDP (everything replicated); 1: Megatron's distributed optimizer on FSDP2
    (reshard_after_forward=False, unsharded gradients accumulated over the micro-batches and
    reduce-scattered once per step: the float32 parameters, gradients and optimizer states sharded
    between steps); 2: gradients reduce-scattered every micro-batch (FSDP2,
    reshard_after_forward=False); 3: + parameters sharded (FSDP2, reshard=True), but in pipeline
    stages under a zero-bubble schedule, whose input pass needs the parameters the forward used,
    they stay gathered after forward, as under 2"""
    ep: int = 1
    """expert-parallel degree: the experts of every ``Plan.experts`` module split over ``ep``
    consecutive data-parallel ranks, tokens routed to them by all-to-all. Borrowed from dp as
    torchtitan does (no ranks of its own: ep divides dp); each expert is then held by dp / ep ranks,
    which average its gradients"""
    cp: int = 1
    """context-parallel degree: every sample's sequence split over ``cp`` ranks of a replica,
    attention computed by torch's ring attention (``context_parallel``; K/V passed round the cp
    ranks in every attention layer). Ranks of its own (world = pp * dp * cp * tp), between dp and
    tp; parameters are replicated over them and gradients averaged over dp * cp, as over
    data-parallel ranks"""
    offload: str = "none"
    """:data:`OFFLOAD`: "cpu" keeps FSDP's shards in host memory (``runtime/fsdp.py``); needs
    zero_stage 2 or 3"""
    moe_capacity: float = MOE_CAPACITY
    """with ep > 1: the rows the busiest rank's experts are costed for, as a multiple of balanced
    routing's (:data:`MOE_CAPACITY`: a capacity factor, or a dropless router's allowance); >= 1"""

    def __post_init__(self):
        for name in ("dp", "tp", "pp", "ep", "cp"):
            check_int(f"mesh.{name}", getattr(self, name), minimum=1, maximum=MAX_DEGREE)
        check_int(f"mesh world size {self.factors()}", self.world_size, maximum=MAX_DEGREE)
        check_choice("mesh.zero_stage", self.zero_stage, ZERO_STAGES)
        check_choice("mesh.offload", self.offload, OFFLOAD)
        self.moe_capacity = check_number("mesh.moe_capacity", self.moe_capacity, minimum=1)
        if self.offload != "none" and self.zero_stage < 2:
            raise PlanError(f"mesh.offload={self.offload!r} needs FSDP (zero_stage 2 or 3), got "
                            f"{self.zero_stage}")
        if self.dp % self.ep:
            raise PlanError(f"mesh.ep({self.ep}) must divide mesh.dp({self.dp}): expert "
                            "parallelism splits the experts over data-parallel ranks "
                            f"(dp({self.dp}) % ep({self.ep}) = {self.dp % self.ep})")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def factors(self) -> str:
        """The world's factors as text: ``dp(2) * tp(2) * pp(1)``, with ``cp(2)`` when there is
        context parallelism."""
        return (f"dp({self.dp}) * tp({self.tp}) * "
                f"pp({self.pp})") + (f" * cp({self.cp})" if self.cp > 1 else "")


@dataclass
class BatchPlan:
    """Batch sizes. One optimizer step consumes ``global_batch`` samples."""

    global_batch: int = 1
    """samples per optimizer step, over all data-parallel ranks"""
    micro_batches: int = 1
    """micro-batches per step on each data-parallel rank (pipeline micro-batches, or gradient
    accumulation)"""
    seq_len: int | None = None
    """tokens per sample for sequence models, else None"""

    def __post_init__(self):
        check_int("batch.global_batch", self.global_batch, minimum=1, maximum=MAX_BATCH)
        check_int("batch.micro_batches", self.micro_batches, minimum=1, maximum=MAX_MICRO_BATCHES)
        if self.seq_len is not None:
            check_int("batch.seq_len", self.seq_len, minimum=1, maximum=MAX_SEQ_LEN)


@dataclass
class PipelinePlan:
    """Pipeline schedule from ``torch.distributed.pipelining``."""

    schedule: str = "1f1b"
    """gpipe | 1f1b | interleaved_1f1b | looped_bfs | interleaved_zero_bubble | zbv_zero_bubble"""
    virtual_stages: int = 1
    """model chunks per pipeline rank (> 1 only for interleaved/looped schedules)"""

    def __post_init__(self):
        check_choice("pipeline.schedule", self.schedule, SCHEDULES)
        check_int("pipeline.virtual_stages", self.virtual_stages, minimum=1,
                  maximum=MAX_VIRTUAL_STAGES)


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
    """ops kept in float32 under autocast (PaddlePaddle's custom_black_list), names from
    :data:`AMP_OPS`"""
    low_precision_ops: list[str] = field(default_factory=list)
    """ops run in the autocast dtype beyond autocast's own list (PaddlePaddle's custom_white_list:
    ``["matmul", "elementwise_add"]``)"""
    float8: str = "none"
    """:data:`FLOAT8`: the Linear layers whose dimensions are multiples of 16, the output head
    excepted, train with float8 matmuls (torchao's ``convert_to_float8_training``;
    ``runtime/float8.py``); needs amp "bf16"""

    def __post_init__(self):
        check_choice("precision.amp", self.amp, AMP)
        check_choice("precision.float8", self.float8, FLOAT8)
        if self.float8 != "none" and self.amp != "bf16":
            raise PlanError(f"precision.float8={self.float8!r} needs precision.amp='bf16' "
                            f"(torchao's float8 matmuls take bf16 inputs), got amp={self.amp!r}; "
                            "set amp to 'bf16' or float8 to 'none'")
        for name in ("fp32_ops", "low_precision_ops"):
            ops = getattr(self, name)
            if not isinstance(ops, (list, tuple)):
                raise PlanError(f"precision.{name} must be a list of op names, got {ops!r}")
            for op in ops:
                check_choice(f"precision.{name}[...]", op, AMP_OPS)
            setattr(self, name, list(ops))
            if ops and self.amp == "none":
                raise PlanError(f"precision.{name}={list(ops)} needs mixed precision: set "
                                "precision.amp (or fix amp=) to 'bf16' or 'fp16' (without autocast "
                                "every op runs in float32)")
        if both := sorted(set(self.fp32_ops) & set(self.low_precision_ops)):
            raise PlanError("precision.fp32_ops and precision.low_precision_ops both name "
                            f"{', '.join(both)}")
        check_choice("precision.param_dtype", self.param_dtype, tuple(DTYPE_NAMES))
        check_choice("precision.reduce_dtype", self.reduce_dtype, tuple(DTYPE_NAMES))
        self.init_loss_scale = check_number("precision.init_loss_scale", self.init_loss_scale,
                                            minimum=0.0)
        check_bool("precision.dynamic_loss_scale", self.dynamic_loss_scale)
        check_int("precision.growth_interval", self.growth_interval, minimum=1)


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
    """the largest global gradient 2-norm (torchtitan's and Megatron-LM's default 1.0); 0 turns
    clipping off"""

    def __post_init__(self):
        check_choice("optimizer.name", self.name, OPTIMIZERS)
        check_choice("optimizer.lr_schedule", self.lr_schedule, LR_SCHEDULES)
        check_int("optimizer.warmup_steps", self.warmup_steps, minimum=0)
        self.min_lr_ratio = check_number("optimizer.min_lr_ratio", self.min_lr_ratio, minimum=0.0)
        self.grad_clip = check_number("optimizer.grad_clip", self.grad_clip, minimum=0.0)
        self.lr = check_number("optimizer.lr", self.lr, minimum=0.0)
        self.weight_decay = check_number("optimizer.weight_decay", self.weight_decay, minimum=0.0)
        if not isinstance(self.betas, (list, tuple)) or len(self.betas) != 2:
            raise PlanError("optimizer.betas must be two numbers [beta1, beta2], got "
                            f"{self.betas!r}")
        self.betas = tuple(check_number(f"optimizer.betas[{i}]", b, minimum=0.0, below=1.0)
                           for i, b in enumerate(self.betas))



@dataclass
class LayerPlan:
    """Decisions for one layer (a node of ``ModelGraph.layers``, e.g. ``h.3`` or ``lm_head``)."""

    path: str
    """module path of the layer inside the model"""
    stage: int = 0
    """pipeline stage (0 .. pp * virtual_stages - 1)"""
    tp: dict[str, str] = field(default_factory=dict)
    """module path -> TP style (TP_STYLES; absent: replicate); an Embedding "rowwise" splits the
    vocabulary"""
    tp_parts: dict[str, list[int]] = field(default_factory=dict)
    """"colwise" module path -> the parts its output features hold, in order, counted in heads (or
    features for parts that have none): [12] for a projection of 12 heads, [32, 8, 8] for a fused
    q|k|v with 32 query and 8 key/value heads, [11008, 11008] for a fused gate|up, [12] for T5's
    relative_attention_bias (kept split by heads). Rank r holds slice r of every part; a part of
    fewer heads than mesh.tp is repeated (weight whole on every rank). Absent: one part, split
    evenly. "shared" (kept whole): features [before, shared(, after)] (MLA: rope key)."""
    sequence_parallel: bool = False
    """norms/dropout of this layer run sequence-parallel (activations sharded on the sequence dim
    between TP regions)"""
    fsdp: bool = True
    """wrap this layer as its own FSDP unit (when mesh.zero_stage >= 1); False folds it into the
    root unit"""
    recompute: str = "none"
    """none | selective (recompute element-wise ops, every other weight matmul) | full (keep only
    the layer input)"""
    compile: bool = False
    """compile this layer with ``torch.compile`` (Inductor), on its own as torchtitan's
    ``apply_compile`` does each repeated block: its pointwise ops, norms and softmax fused into
    fewer kernels. Only with mesh.pp == 1 (pipeline stages are traced graphs whose blocks are no
    longer modules that run)"""
    pinned: list[str] = field(default_factory=list)
    """the fields above that the user fixed with an override; the planner never changes them"""

    def __post_init__(self):
        check_module_path("layer path", self.path, root=True)
        where = f"layers[{self.path!r}]"
        check_int(f"{where}.stage", self.stage, minimum=0)
        if not isinstance(self.tp, dict):
            raise PlanError(f"{where}.tp must be a dict of module path -> style, got {self.tp!r}")
        # "" (the root module) only in the root layer: a model that is a single Linear
        root = self.path == ""
        # the messages are built only for a bad entry (plans have many)
        for mod, style in self.tp.items():
            if type(mod) is not str or not (MODULE_PATH.fullmatch(mod) or (root and mod == "")):
                check_module_path(f"{where}.tp key", mod, root=root)
            if type(style) is not str or style not in TP_STYLES:
                check_choice(f"{where}.tp[{mod!r}]", style, TP_STYLES)
        if not isinstance(self.tp_parts, dict):
            raise PlanError(f"{where}.tp_parts must be a dict of module path -> [int, ...], got "
                            f"{self.tp_parts!r}")
        for mod, parts in self.tp_parts.items():
            if self.tp.get(mod) not in ("colwise", "shared"):
                raise PlanError(f"{where}.tp_parts names {mod!r}, whose tp style is "
                                f"{self.tp.get(mod, 'replicate')!r}: parts say how a 'colwise' "
                                "split cuts a module's output (or a 'shared' one's)")
            check_list(f"{where}.tp_parts[{mod!r}]", parts, int)
            if not parts:
                raise PlanError(f"{where}.tp_parts[{mod!r}] is empty: give at least one part")
            for i, n in enumerate(parts):
                check_int(f"{where}.tp_parts[{mod!r}][{i}]", n, minimum=1)
        check_bool(f"{where}.sequence_parallel", self.sequence_parallel)
        check_bool(f"{where}.fsdp", self.fsdp)
        check_bool(f"{where}.compile", self.compile)
        check_choice(f"{where}.recompute", self.recompute, RECOMPUTE)
        check_list(f"{where}.pinned", self.pinned, str)
        for name in self.pinned:
            check_choice(f"{where}.pinned entry", name, PINNABLE)

