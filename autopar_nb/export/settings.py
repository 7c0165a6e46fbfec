"""The exported script's settings block: ``NAME = value # where it came from in the plan``, one line
each."""

from __future__ import annotations

from ..plan import DTYPE_NAMES, Plan
from .literals import literal, one_line
from .values import ScriptValues


def _weights_setting(path: str) -> list[str]:
    """``WEIGHTS = "DIR"`` and where it came from (above it where a long path leaves no room beside
    it)."""
    line, why = f"WEIGHTS = {one_line(path)}", ("the checkpoint the model starts from (export's "
                                                "weights=)")
    return [f"{line}  # {why}"] if len(line) + len(why) + 4 <= 120 else [f"# {why}", line]


def settings(v: ScriptValues, plan: Plan, *, seed: int) -> tuple[list[str], set]:
    """The settings block (``NAME = value # where it came from``) and the names it needs
    imported."""
    s = [f"SEED = {seed!r}  # every process seeds the same before building the model",
         *(_weights_setting(v.weights) if v.weights else []), *_mesh_settings(v, plan)]
    return [*s, *_precision_settings(v, plan), *_optimizer_settings(plan), *_data_settings(v),
            *_technique_settings(v)], set()


def _mesh_settings(v: ScriptValues, plan: Plan) -> list[str]:
    """The mesh, ZeRO, expert parallelism, micro-batches and the pipeline's stages."""
    m = plan.mesh
    s = [*([f"PP, DP, TP = {m.pp!r}, {m.dp!r}, {m.tp!r}  # plan.mesh: world = PP * DP * TP = "
            f"{m.world_size}"]
           if v.cp == 1 else
           [f"PP, DP, CP, TP = {m.pp!r}, {m.dp!r}, {m.cp!r}, {m.tp!r}  # plan.mesh: world = PP * "
            f"DP * CP * TP = {m.world_size}",
            "# CP: context parallelism, each sequence split over CP ranks (torch's ring "
            "attention)"]),
         f"ZERO_STAGE = {m.zero_stage!r}  # 0 DDP; FSDP: 1 one reduce-scatter per step, 2 one per "
         "micro-batch, 3 + params resharded after forward",
         *([f"EP = {v.ep!r}  # plan.mesh.ep: each experts module split over EP consecutive "
            "data-parallel ranks",
            f"EXPERTS = {literal(v.experts, width=80)}  # plan.experts: the modules whose experts "
            "EP splits"]
           if v.ep > 1 else []),
         f"MICRO_BATCHES = {v.micro_batches!r}  # plan.batch.micro_batches: "
         + ("pipeline micro-batches" if v.pp > 1 else "gradient accumulation steps")]
    if v.pp > 1:
        s += [f"NUM_STAGES = {v.num_stages!r}  # mesh.pp * pipeline.virtual_stages",
              f"SCHEDULE = {one_line(v.schedule)}  # plan.pipeline.schedule",
              f"STAGE_BOUNDARIES = {literal(v.boundaries, width=64)}  # plan.layers[*].stage: each "
              "stage's first layer"]
    return s


def _precision_settings(v: ScriptValues, plan: Plan) -> list[str]:
    """Autocast and its op lists, FSDP's mixed precision, fp16's loss scaling."""
    pr, s = plan.precision, []
    if pr.amp != "none":
        s.append(f"AMP_DTYPE = torch.{DTYPE_NAMES[pr.amp]}  # plan.precision.amp: autocast dtype "
                 "of the forward pass")
        if v.fp32_ops:
            s.append(f"FP32_OPS = {literal(v.fp32_ops, width=80)}  # plan.precision.fp32_ops: kept "
                     "in float32")
        if v.low_precision_ops:
            s.append(f"LOW_PRECISION_OPS = {literal(v.low_precision_ops, width=70)}  # "
                     "plan.precision.low_precision_ops: run in AMP_DTYPE")
    if v.fsdp and (pr.param_dtype, pr.reduce_dtype) != ("float32", "float32"):
        param, reduce = DTYPE_NAMES[pr.param_dtype], DTYPE_NAMES[pr.reduce_dtype]
        s.append(f"PARAM_DTYPE, REDUCE_DTYPE = torch.{param}, torch.{reduce}  # plan.precision")
    if pr.amp == "fp16":
        s.append(f"INIT_LOSS_SCALE = {float(pr.init_loss_scale)!r}  # "
                 "plan.precision.init_loss_scale")
        s.append(f"DYNAMIC_LOSS_SCALE = {bool(pr.dynamic_loss_scale)!r}  # "
                 "plan.precision.dynamic_loss_scale")
        s.append(f"GROWTH_INTERVAL = {int(pr.growth_interval)!r}  # plan.precision.growth_interval")
    return s


def _optimizer_settings(plan: Plan) -> list[str]:
    """The optimizer and its learning-rate schedule."""
    o = plan.optimizer
    return [f"OPTIMIZER = {one_line(o.name)}  # plan.optimizer",
            f"LR = {float(o.lr)!r}",
            f"WEIGHT_DECAY = {float(o.weight_decay)!r}",
            f"BETAS = {tuple(float(b) for b in o.betas)!r}",
            f"WARMUP = {int(o.warmup_steps)!r}  # steps of linear learning-rate warm-up",
            f"LR_SCHEDULE = {one_line(o.lr_schedule)}  # cosine decay or constant after warm-up",
            f"MIN_LR_RATIO = {float(o.min_lr_ratio)!r}  # the cosine's end, relative to LR",
            f"GRAD_CLIP = {float(o.grad_clip)!r}  # max global gradient norm; 0: no clipping"]


def _data_settings(v: ScriptValues) -> list[str]:
    """The batch size per rank and, for the default loss and synthetic ids, their settings."""
    if v.defaults and v.dataset:
        return [f"BATCH_SIZE = {v.defaults['batch_size']!r}  # the dataset's samples per "
                "data-parallel rank and step",
                *([f"CAUSAL = {v.defaults['causal']!r}  # the default loss predicts the next "
                   "token (False: the same one)"] if v.default_loss else [])]
    if v.defaults:
        return [f"BATCH_SIZE = {v.defaults['batch_size']!r}  # samples per data-parallel rank and "
                "step (synthetic data)",
                f"INT_HIGH = {v.defaults['int_high']!r}  # synthetic ids are drawn below each "
                "integer input's entry: the largest embedding table it indexes",
                f"CAUSAL = {v.defaults['causal']!r}  # the default loss predicts the next token "
                "(False: the same one)"]
    return []


def _technique_settings(v: ScriptValues) -> list[str]:
    """What the techniques read: the fused loss and norms, float8, ties, recompute, compile, FSDP
    units."""
    s = []
    if v.fused_loss:
        s.append(f"FUSED_LOSS = {one_line(v.fused_loss)}  # plan.fused_loss: the output head fused "
                 "with the loss")
    if v.fused_norm:
        s.append(f"# plan.fused_norm: kernels_ext's fused RMSNorm in {len(v.fused_norm)} modules ("
                 f"{v.fused_norm[0]}{', ...' if len(v.fused_norm) > 1 else ''})")
    if v.float8:
        s.append(f"FLOAT8 = {one_line(v.float8)}  # plan.precision.float8 (torchao): "
                 f"{len(v.float8_linears)} Linears")
    if v.ties:
        s.append(f"TIES = {literal(v.ties, width=40)}  # parameters the model shares (kept one "
                 "parameter when sharded)")
    if v.recompute:
        s.append(f"RECOMPUTE = {literal(v.recompute, width=60)}  # plan.layers[*].recompute: \"*\" "
                 "is every block")
    if v.compile:
        s.append(f"COMPILE = {literal(v.compile, width=60)}  # plan.layers[*].compile: "
                 "torch.compile each, on its own")
    if v.fsdp or v.replicate:
        s.append(f"FSDP_UNITS = {literal(v.fsdp_units, width=60)}  # plan.layers[*].fsdp: a list "
                 "is one unit")
    return s
