"""The values a plan may hold, and the bounds of its counts: the planner, widget, runtime and export
read them from here (through :mod:`autopar_nb.plan`)."""

from __future__ import annotations

import re

# counts a plan may carry (more: a typo or hostile). Ranks, any degree: a million (largest ~1e5)
MAX_DEGREE = 2**20
# chunks per pipeline rank (> any model's layers); per step
MAX_VIRTUAL_STAGES, MAX_MICRO_BATCHES = 2**10, 2**16
# samples per step; tokens per sample (16.8M; the longest contexts are ~1e7)
MAX_BATCH = MAX_SEQ_LEN = 2**24
# any other count (steps, bytes, parameters): an int64, what torch and the runtime hold
MAX_INT = 2**63 - 1

ZERO_STAGES = (0, 1, 2, 3)
TP_STYLES = ("replicate", "colwise", "rowwise", "sequence_parallel", "shared", "per_head")
"""how TP runs a module; "per_head": a norm inside each head of a split attention (Qwen3's q_norm),
weight whole"""
RECOMPUTE = ("none", "selective", "full")
"""per-layer activation recompute: none | selective (element-wise ops and every other weight matmul)
| full (all)"""
AMP = ("none", "bf16", "fp16")
"""autocast dtype of the forward pass; "none" = fp32"""
FLOAT8 = ("none", "tensorwise", "rowwise")
"""torchao's float8 training recipes (``Float8LinearConfig.from_recipe_name``): none | tensorwise (a
scale per tensor; FSDP all-gathers the weights in float8 on GPUs) | rowwise (a scale per row: more
accurate, gathers in bf16)"""
MOE_CAPACITY = 1.25
"""the rows the busiest rank's experts are planned for, as a multiple of balanced routing's (each
rank's own (token, choice) pairs): a capacity factor of Switch Transformer (Fedus, Zoph and Shazeer,
JMLR 2022, sec. 2.2: expert capacity = tokens per batch / experts x capacity factor, the tokens
beyond it dropped; its Table 1 compares 1.0, 1.25 and 2.0), the bound Megatron-Core's
``moe_expert_capacity_factor`` sets. A dropless router (Hugging Face's Mixtral) has no capacity:
the same number is then an allowance, the busiest rank receiving up to this many times the
balanced rows (tiny Mixtral's untrained router sent a rank up to 1.72 times them in a layer)"""
OFFLOAD = ("none", "cpu")
"""where FSDP2 keeps the shards of parameters, gradients and optimizer states: device or host
(CPUOffloadPolicy)"""
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble",
             "zbv_zero_bubble")
V_SCHEDULES = ("zbv_zero_bubble",)
"""schedules that place a rank's two stages in a V: rank r holds stages r and 2 pp - 1 - r"""


OPTIMIZERS = ("adam", "adamw", "sgd")
LR_SCHEDULES = ("cosine", "constant")
AMP_OPS = ("linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "conv1d", "conv2d", "conv3d",
           "conv_transpose2d", "scaled_dot_product_attention", "softmax", "log_softmax",
           "layer_norm", "rms_norm", "group_norm", "batch_norm", "cross_entropy", "nll_loss",
           "mse_loss", "embedding", "gelu", "silu", "relu", "add", "sub", "mul", "div", "sum",
           "mean", "exp", "log", "pow", "rsqrt", "cumsum", "norm", "elementwise_add",
           "elementwise_sub", "elementwise_mul", "elementwise_div", "reduce_sum", "reduce_mean")
"""op names ``precision.fp32_ops`` / ``precision.low_precision_ops`` may hold: torch's function
names (``x + y`` is ``add``, ``x @ w`` is ``matmul``) and Paddle's names for the same ops
(``elementwise_add``, ``reduce_mean``)"""
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16",
               "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
"""plan dtype string (an ``amp`` value other than "none", or
``precision.param_dtype``/``reduce_dtype``) -> the torch attribute name: ``getattr(torch,
DTYPE_NAMES[s])``"""
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
            "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
            "complex64": 8, "complex128": 16}
"""bytes per element by torch dtype name (``str(dtype).removeprefix("torch.")``)"""

MODULE_PATH = re.compile(r"[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*")
"""a dotted module path as ``nn.Module.named_modules()`` yields it, restricted to names made of
letters, digits, ``_`` and ``-`` (attribute names, ``nn.Sequential`` indices, usual
``nn.ModuleDict`` keys); "" is the root"""
MODULE_PATTERN = re.compile(r"[A-Za-z0-9_*-]+(?:\.[A-Za-z0-9_*-]+)*")
"""a module path in which a name may be ``*`` or hold ``*`` (``fnmatch``: any characters):
``"layers.*.mlp.experts"`` names the experts module of every block"""
PINNABLE = ("stage", "recompute", "fsdp", "tp")
"""the LayerPlan fields an override can pin (the keys of ``Session.override`` /
``plan(overrides=...)``)"""


def stage_rank(stage: int, pp: int, num_stages: int, schedule: str) -> int:
    """The pipeline rank holding ``stage`` of ``num_stages``: stage s on rank s % pp (one stage per
    rank, or looped placement), or in a V (:data:`V_SCHEDULES`); the inverse of ``runtime/pp.py``'s
    ``stage_ids``."""
    if schedule in V_SCHEDULES and num_stages == 2 * pp and stage >= pp:
        return num_stages - 1 - stage
    return stage % pp


def within(path: str, module: str) -> bool:
    """Whether module ``path`` is ``module`` or lies below it ("" = the root holds every module)."""
    return module == "" or path == module or path.startswith(module + ".")


def layer_of(path: str, layer_paths) -> str | None:
    """The layer that contains module ``path``: the longest of ``layer_paths`` that it is
    :func:`within`; None when no layer does."""
    best = None
    for lp in layer_paths:
        if within(path, lp) and (best is None or len(lp) > len(best)):
            best = lp
    return best

