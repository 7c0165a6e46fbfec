"""The one-file script's text (``export(single_file=True)``): settings as literals, the cell verbatim, the runtime's
functions verbatim (:mod:`.kit`), and two short functions written for the plan, ``parallelize`` and ``main``'s body,
that only call them. The two-file export (:mod:`.script`) reuses the settings, ``parallelize`` and ``main``'s body.

Every value from the plan reaches the text through ``repr`` of a checked Python value (or a ``TPStyle``'s
constructor), never pasted as code.
"""

from __future__ import annotations

import ast
import json
import textwrap
from pathlib import Path
from string import Template

from ..plan import DTYPE_NAMES, Plan
from ..source import ModelSource
from . import kit
from .cell import PRETRAINED, check_names, script_cell, weights_lines, whole_weights_lines, without_cell_imports
from .values import ScriptValues

TEMPLATE = Path(__file__).with_name("script.py.tmpl")
PRELUDE = ("process_rss",)
"""runtime functions the script calls before the cell"""
DATA_FLAGS = '''
    p.add_argument("--num-workers", type=int, default=default_num_workers(), help="DataLoader worker processes per "
                   "rank (default: the cores each rank has beyond its own, at most 4)")
    p.add_argument("--prefetch-factor", type=int, default=2, help="batches each DataLoader worker loads ahead")'''
"""``parse_args``'s flags for a script that reads the cell's dataset"""
HF_FLAGS = '''
    p.add_argument("--save-hf", default=None, metavar="DIR", help="at the end, write the trained weights to DIR in "
                   "Hugging Face's format (safetensors + config.json)")'''
"""``parse_args``'s flag for a Hugging Face model the cell loads ``from_pretrained``"""
TEMPLATE_IMPORTS = {("argparse", None, None), ("gc", None, None), ("traceback", None, None),
                    ("torch", None, None), ("torch.distributed", None, "dist"),
                    ("torch.distributed.elastic.multiprocessing.errors", "record", None)}


def literal(value, indent: int = 0, width: int = 120) -> str:
    """``value`` (plain data: numbers, strings, bools, None, lists, tuples, dicts) as Python source with double
    quotes, on one line when it fits ``width`` minus ``indent``, else one item per line."""
    text = _one_line(value)
    if indent + len(text) > width and isinstance(value, (list, tuple, dict)) and value:
        pad = " " * (indent + 4)
        items = ([f"{_one_line(k)}: {literal(v, indent + 4, width)}" for k, v in value.items()]
                 if isinstance(value, dict) else [literal(v, indent + 4, width) for v in value])
        opening, closing = {dict: "{}", list: "[]", tuple: "()"}[type(value)]
        text = opening + "\n" + "".join(f"{pad}{item},\n" for item in items) + " " * indent + closing
    if ast.literal_eval(text) != value:  # plain data only, never code
        raise ValueError(f"{value!r} is not plain data")
    return text


def _one_line(value) -> str:
    if isinstance(value, str):
        text = json.dumps(value)  # a JSON string is a Python string literal (double quotes, escapes)
        return text if ast.literal_eval(text) == value else repr(value)
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_one_line(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_one_line(k)}: {_one_line(v)}" for k, v in value.items()) + "}"
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    raise TypeError(f"{type(value).__name__} is not plain data")


def style_dict(styles: dict, indent: int = 0, width: int = 120) -> str:
    """A ``{path: ParallelStyle(...)}`` literal (nested for block plans), one entry per line, wrapped at 120."""
    pad = " " * (indent + 4)
    lines = []
    for path, style in styles.items():
        if isinstance(style, dict):
            lines.append(f"{pad}{_one_line(path)}: {style_dict(style, indent + 4, width)},")
            continue
        line = f"{pad}{_one_line(path)}: {style.source()},"
        if len(line) > width:
            head, _, args = style.source().partition("(")
            line = f"{pad}{_one_line(path)}: {head}(\n{pad}    {args},"
        lines.append(line)
    return "{\n" + "\n".join(lines) + "\n" + " " * indent + "}" if lines else "{}"


def _weights_setting(path: str) -> list[str]:
    """``WEIGHTS = "DIR"`` and where it came from (above it where a long path leaves no room beside it)."""
    line, why = f"WEIGHTS = {_one_line(path)}", "the checkpoint the model starts from (export's weights=)"
    return [f"{line}  # {why}"] if len(line) + len(why) + 4 <= 120 else [f"# {why}", line]


def settings(v: ScriptValues, plan: Plan, *, seed: int) -> tuple[list[str], set]:
    """The settings block (``NAME = value  # where it came from``) and the names it needs imported."""
    m, o, pr = plan.mesh, plan.optimizer, plan.precision
    imports: set = set()
    s = [f"SEED = {seed!r}  # every process seeds the same before building the model",
         *(_weights_setting(v.weights) if v.weights else []),
         *([f"PP, DP, TP = {m.pp!r}, {m.dp!r}, {m.tp!r}  # plan.mesh: world = PP * DP * TP = {m.world_size}"]
           if v.cp == 1 else
           [f"PP, DP, CP, TP = {m.pp!r}, {m.dp!r}, {m.cp!r}, {m.tp!r}  # plan.mesh: world = PP * DP * CP * TP = "
            f"{m.world_size}",
            "# CP: context parallelism, each sequence split over CP ranks (torch's ring attention)"]),
         f"ZERO_STAGE = {m.zero_stage!r}  # 0 DDP, 1 + sharded optimizer, 2 + sharded gradients, 3 + sharded "
         "params",
         *([f"EP = {v.ep!r}  # plan.mesh.ep: each experts module split over EP consecutive data-parallel ranks",
            f"EXPERTS = {literal(v.experts, width=80)}  # plan.experts: the modules whose experts EP splits"]
           if v.ep > 1 else []),
         f"MICRO_BATCHES = {v.micro_batches!r}  # plan.batch.micro_batches: "
         + ("pipeline micro-batches" if v.pp > 1 else "gradient accumulation steps")]
    if v.pp > 1:
        s += [f"NUM_STAGES = {v.num_stages!r}  # mesh.pp * pipeline.virtual_stages",
              f"SCHEDULE = {_one_line(v.schedule)}  # plan.pipeline.schedule",
              f"STAGE_BOUNDARIES = {literal(v.boundaries, width=64)}  # plan.layers[*].stage: each stage's first layer"]
    if pr.amp != "none":
        s.append(f"AMP_DTYPE = torch.{DTYPE_NAMES[pr.amp]}  # plan.precision.amp: autocast dtype of the forward pass")
        if v.fp32_ops:
            s.append(f"FP32_OPS = {literal(v.fp32_ops, width=80)}  # plan.precision.fp32_ops: kept in float32")
        if v.low_precision_ops:
            s.append(f"LOW_PRECISION_OPS = {literal(v.low_precision_ops, width=70)}  # plan.precision."
                     "low_precision_ops: run in AMP_DTYPE")
    if v.fsdp and (pr.param_dtype, pr.reduce_dtype) != ("float32", "float32"):
        param, reduce = DTYPE_NAMES[pr.param_dtype], DTYPE_NAMES[pr.reduce_dtype]
        s.append(f"PARAM_DTYPE, REDUCE_DTYPE = torch.{param}, torch.{reduce}  # plan.precision")
    if pr.amp == "fp16":
        s.append(f"INIT_LOSS_SCALE = {float(pr.init_loss_scale)!r}  # plan.precision.init_loss_scale")
        s.append(f"DYNAMIC_LOSS_SCALE = {bool(pr.dynamic_loss_scale)!r}  # plan.precision.dynamic_loss_scale")
        s.append(f"GROWTH_INTERVAL = {int(pr.growth_interval)!r}  # plan.precision.growth_interval")
    s += [f"OPTIMIZER = {_one_line(o.name)}  # plan.optimizer",
          f"LR = {float(o.lr)!r}",
          f"WEIGHT_DECAY = {float(o.weight_decay)!r}",
          f"BETAS = {tuple(float(b) for b in o.betas)!r}",
          f"WARMUP = {int(o.warmup_steps)!r}  # steps of linear learning-rate warm-up",
          f"LR_SCHEDULE = {_one_line(o.lr_schedule)}  # cosine decay or constant after warm-up",
          f"MIN_LR_RATIO = {float(o.min_lr_ratio)!r}  # the cosine's end, relative to LR",
          f"GRAD_CLIP = {float(o.grad_clip)!r}  # max global gradient norm; 0: no clipping"]
    if v.defaults and v.dataset:
        s.append(f"BATCH_SIZE = {v.defaults['batch_size']!r}  # the dataset's samples per data-parallel rank and step")
        if v.default_loss:
            s.append(f"CAUSAL = {v.defaults['causal']!r}  # the default loss predicts the next token (False: the "
                     "same one)")
    elif v.defaults:
        s += [f"BATCH_SIZE = {v.defaults['batch_size']!r}  # samples per data-parallel rank and step (synthetic data)",
              f"INT_HIGH = {v.defaults['int_high']!r}  # synthetic ids are drawn below each integer input's entry: the "
              "largest embedding table it indexes",
              f"CAUSAL = {v.defaults['causal']!r}  # the default loss predicts the next token (False: the same one)"]
    if v.fused_loss:
        s.append(f"FUSED_LOSS = {_one_line(v.fused_loss)}  # plan.fused_loss: the output head fused with the loss")
    if v.fused_norm:
        s.append(f"# plan.fused_norm: kernels_ext's fused RMSNorm in {len(v.fused_norm)} modules ("
                 f"{v.fused_norm[0]}{', ...' if len(v.fused_norm) > 1 else ''})")
    if v.float8:
        s.append(f"FLOAT8 = {_one_line(v.float8)}  # plan.precision.float8 (torchao): {len(v.float8_linears)} Linears")
    if v.ties:
        s.append(f"TIES = {literal(v.ties, width=40)}  # parameters the model shares (kept one parameter when sharded)")
    if v.recompute:
        s.append(f"RECOMPUTE = {literal(v.recompute, width=60)}  # plan.layers[*].recompute: \"*\" is every block")
    if v.compile:
        s.append(f"COMPILE = {literal(v.compile, width=60)}  # plan.layers[*].compile: torch.compile each, on its own")
    if v.fsdp or v.replicate:
        s.append(f"FSDP_UNITS = {literal(v.fsdp_units, width=60)}  # plan.layers[*].fsdp: a list is one unit")
    return s, imports


def tp_plans(v: ScriptValues) -> tuple[list[str], set, list[str]]:
    """The TP plans as local variables of ``parallelize`` (torchtitan writes them inline in ``apply_tp``): lines,
    imports, and runtime names (styles defined by the runtime itself)."""
    lines = ["# tensor parallelism (plan: layers[*].tp, .sequence_parallel, loss_parallel): one plan for the blocks of",
             "# each module list (paths relative to a block), one for the modules around them"]
    if v.block_tp_plans:
        lines.append(f"layer_plans = {style_dict(v.block_tp_plans, width=116)}")
    lines.append(f"plan = {style_dict(v.tp_plan, width=116)}")  # inside parallelize: 4 more columns
    if v.local_sizes:
        lines += ["# per-rank head counts and widths that the model's code reads (global / TP; plan: "
                  "layers[*].tp_parts)", f"sizes = {literal(v.local_sizes, width=116)}"]
    if v.head_tables:
        lines += ["# head-indexed tables (bias per head, ALiBi slopes): name -> the dim of the heads, split with them",
                  f"tables = {literal(v.head_tables, width=116)}"]
    styles = [*v.tp_plan.values(), *(x for p in v.block_tp_plans.values() for x in p.values())]
    imports = {("torch.distributed.tensor", name, None) for st in styles for name in st.placements()}
    uses = sorted({st.class_name for st in styles if st.defined_by_runtime})
    imports |= {("torch.distributed.tensor.parallel", st.class_name, None) for st in styles
                if not st.defined_by_runtime}
    return lines, imports, uses


def tp_source(v: ScriptValues, step: int) -> tuple[list[str], list[str]]:
    """The lines of ``parallelize`` that apply TP (technique number ``step``) and the runtime names they call."""
    calls = [f"# {step}. TP first: it turns parameters into DTensors, which AC and FSDP must see",
             "apply_tp(part, mesh[\"tp\"], plan" + (", layer_plans=layer_plans)" if v.block_tp_plans else ")")]
    uses = ["apply_tp"] + ["apply_async_tp"] * v.async_tp
    if v.async_tp:  # Inductor reads the flag when it compiles the blocks (below), on the TP mesh's symmetric memory
        calls.append("apply_async_tp(mesh[\"tp\"])  # TP's collectives micro-pipelined with the matmuls (CUDA)")
    if v.local_sizes:
        calls.append("set_local_sizes(part, sizes)")
        uses.append("set_local_sizes")
    if v.head_tables:
        calls.append("shard_head_tables(part, mesh[\"tp\"], tables)")
        uses.append("shard_head_tables")
    if v.fused_head_tp:
        calls += ["# the fused head's weight split on the vocabulary (its loss then vocab-parallel), before ties",
                  f"shard_fused_head(part, FUSED_LOSS, mesh[\"tp\"], sequence_sharded={v.fused_head_sequence})"]
        uses.append("shard_fused_head")
    if v.ties:
        calls.append("tie_parameters(part, TIES)  # parallelize_module gave each side its own DTensor")
        uses.append("tie_parameters")
    return calls, uses


def parallelize_source(v: ScriptValues) -> tuple[str, list[str], set]:
    """``parallelize(model, mesh, device[, stage_ids, example])``: the runtime's technique functions called in
    torchtitan's order; the runtime names it calls and the imports it needs."""
    calls, uses, imports, plans = [], [], set(), []
    steps = iter(range(1, 20))  # the techniques' order, numbered in the comments
    if v.float8:  # before the fused loss replaces the head, which float8 keeps in bf16
        calls += [f"# {next(steps)}. float8 Linear layers (torchao), before the techniques that wrap them",
                  f"apply_float8(part, FLOAT8, device=device, fsdp={v.fsdp})"]
        uses.append("apply_float8")
    if v.fused_loss and v.pp == 1:  # pipelined: on the whole model, before the trace (below)
        calls += [f"# {next(steps)}. the output head fused with the loss (it never holds the full logits), before the "
                  "techniques below", "#    wrap the module that replaces it, which holds the same weight",
                  "apply_fused_loss(part, FUSED_LOSS)"]
        uses.append("apply_fused_loss")
    if v.tp > 1:
        plans, imports, tp_uses = tp_plans(v)
        tp_lines, tp_calls = tp_source(v, next(steps))
        calls += tp_lines
        uses += tp_uses + tp_calls
    if v.ep > 1:
        calls += [f"# {next(steps)}. expert parallelism: each experts module's experts split over EP consecutive "
                  "data-parallel", "#    ranks, tokens sent to them by all-to-all; before AC wraps the modules and "
                  "before data", "#    parallelism, which must leave the experts to the ranks that hold the same "
                  "ones", "experts_mesh = expert_mesh(mesh, ep=EP)  # (pp, dp_mod_ep, ep, tp): dp split",
                  "apply_ep(part, experts_mesh[\"ep\"], experts=EXPERTS" + (", stage=True)" if v.pp > 1 else ")")]
        uses += ["expert_mesh", "apply_ep"] + ["experts_in_stages"] * (v.pp > 1)
    if v.recompute:
        calls += [f"# {next(steps)}. activation checkpointing around whole layers, before FSDP so that FSDP's "
                  "all-gathers stay", "#    outside the recomputed region", "apply_ac(part, RECOMPUTE)"]
        uses.append("apply_ac")
    if v.compile:
        calls += [f"# {next(steps)}. torch.compile each block on its own (one graph reused by every block of the same "
                  "shape), after", "#    AC so that the checkpointed region is what is compiled, before FSDP so "
                  "that its hooks stay outside", "apply_compile(part, COMPILE)"]
        uses.append("apply_compile")
    if v.fsdp:
        mixed, indent = v.fsdp_policies, 8 if v.pp > 1 else 4
        calls += [f"# {next(steps)}. FSDP last (ZeRO-{v.zero_stage}), over the TP-sharded, checkpoint-wrapped modules"
                  + ("; the experts first," if v.ep > 1 else "")]
        if v.zero_stage == 3 and not v.reshard_after_forward:
            calls += [f"#    parameters kept gathered after forward: {v.schedule}'s input pass hooks the weight pass",
                      "#    on the parameters the forward used (the sharded ones would hook nothing)"]
        if v.ep > 1:
            calls += ["#    each its own unit over the ranks holding the same experts (the rest leave them alone)",
                      call("shard_experts", "part", "experts_mesh[\"dp_mod_ep\"]", dp="DP",
                           reshard_after_forward=str(v.reshard_after_forward), **mixed, indent=indent)]
            uses.append("shard_experts")
        calls.append(call("apply_fsdp", "part", v.dp_mesh, units="FSDP_UNITS",
                          reshard_after_forward=str(v.reshard_after_forward), **mixed, indent=indent))
        uses.append("apply_fsdp")
    elif v.replicate:
        calls += [f"# {next(steps)}. data parallelism last: FSDP2's replicate (DDP takes no DTensors), one all-reduce "
                  "per unit", f"apply_replicate(part, {v.dp_mesh}, units=FSDP_UNITS)"]
        uses.append("apply_replicate")
    elif v.ddp:
        calls.append(f"# {next(steps)}. data parallelism last: DDP" + (" (ZeRO-1 shards the optimizer)" if v.zero1 else
                                                                         "; the experts averaged among the ranks "
                                                                         "holding the same ones" if v.ep > 1 else ""))
        if v.ep > 1:
            calls.append("replicate_experts(part, experts_mesh[\"dp_mod_ep\"], dp=DP)  # DDP leaves them alone")
            uses.append("replicate_experts")
        calls.append("# (DDP in main(): it broadcasts rank 0's weights, not made yet)" if v.meta_init else
                     f"part = apply_ddp(part, {v.dp_mesh}.get_group(), device=device)")
        uses.append("apply_ddp")
    head = ['def parallelize(model, mesh, device' + (', stage_ids, example):' if v.pp > 1 else '):'),
            '    """The plan applied to the pieces of the model this rank holds (one, or one per pipeline stage)."""',
            *("    " + line if line else "" for line in "\n".join(plans).splitlines())]
    if v.fused_norm:  # on the whole model, before the pipeline's trace: the stages' graphs call the fused op
        head += ["    # the RMSNorms fused first (the same modules and weights, a new forward), on the whole model: "
                 "what the", "    # techniques below wrap" + (" and the pipeline's trace records" if v.pp > 1 else ""),
                 "    apply_fused_norm(model)"]
        uses.append("apply_fused_norm")
    if v.pp > 1 and v.fused_loss:
        head += ["    # the output head fused with the loss (it never holds the full logits), before the trace: the "
                 "last stage", "    # holds it, ends at its input, and its loss runs it on that input (StageLoss)",
                 "    apply_fused_loss(model, FUSED_LOSS)"]
        uses.append("apply_fused_loss")
    if v.pp > 1:
        whole = "whole" if v.static_shapes else "_"  # the traced whole model: read for the stages' boundary shapes
        split = call("split_model", "model", boundaries="STAGE_BOUNDARIES", microbatch="example",
                     **({"loss_head": "FUSED_LOSS"} if v.fused_loss else {}),
                     **({"one_sequence_per_row": "True"} if v.cp > 1 else {}), indent=len(f"    stages, {whole} = "))
        head += ["    # pipeline stages: trace the model on one micro-batch, cut it before each stage's first layer",
                 f"    stages, {whole} = {split}",
                 "    shapes = boundary_values(whole, stages, example)" if v.static_shapes else
                 "    shapes = None  # not as traced: the stages infer what crosses their cuts",
                 *["    experts_in_stages(model, stages, experts=EXPERTS)  # the model's, not traced"] * (v.ep > 1),
                 "    release_stages(model, stages, keep=stage_ids)  # the other ranks' stages' weights: freed",
                 "    parts = []", "    for part in [stages[i] for i in stage_ids]:"]
        uses += ["split_model", "release_stages"] + (["boundary_values"] if v.static_shapes else [])
        body = [f"        {c}" for c in calls] + ["        parts.append(part)", "    return parts, shapes"]
    else:
        body = ["    part = model"] + [f"    {c}" for c in calls] + ["    return [part]"]
    return "\n".join(head + body), uses, imports


def _summary_lines(model_name: str, summary: str) -> str:
    """The plan's summary as the docstring's first sentence (``Train <model> with <summary>.``), wrapped at 120
    columns where a long plan (many techniques) makes it longer."""
    lead = f'"""Train {model_name} with '
    text = textwrap.fill(lead + summary + ".", width=120, break_long_words=False, break_on_hyphens=False)
    return text[len(lead):-1]


def call(target: str, *args: str, indent: int = 0, width: int = 120, **kwargs: str) -> str:
    """``target(args..., key=value...)`` as source (arguments are source text) for a line where ``target`` starts at
    column ``indent``, wrapped at ``width`` with continuation lines aligned to the opening parenthesis."""
    items = [*args, *(f"{k}={val}" for k, val in kwargs.items())]
    line = " " * indent + f"{target}("
    lines, pad = [], " " * len(line)
    for i, item in enumerate(items):
        text = item + (")" if i == len(items) - 1 else ",")
        sep = "" if line.endswith("(") else " "
        if len(line) + len(sep) + len(text) > width and sep:
            lines.append(line)
            line, sep = pad, ""
        line += sep + text
    lines.append(line if items else line + ")")
    return "\n".join(lines)[indent:]


def main_source(v: ScriptValues, source: ModelSource, *, telemetry: bool = True) -> tuple[str, list[str]]:
    """The body of ``main``'s ``try`` (or ``with distributed()``): data, parallelize, optimizer, forward/backward,
    train; and the runtime names it calls. ``telemetry``: ``train`` is handed ``main``'s metrics and observer."""
    uses = ["init_distributed", "build_mesh", "Metrics", "parameters_of", "build_optimizer", "train",
            "print_parameter_counts"] + ["buffers_to"] * v.offload
    mv, ind = source.model_var, 8
    if source.make_batch_var:
        batches = source.make_batch_var
    elif v.dataset:  # a DataLoader over the data-parallel ranks: see runtime/data.py DataStream
        batches = call("DataStream", source.dataset_var, batch_size="BATCH_SIZE", dp="mesh[\"dp\"].size()",
                       dp_rank="dp_rank", **({"collate_fn": source.collate_fn_var} if v.collate_fn else {}),
                       seed="SEED", num_workers="args.num_workers", pin_memory="device == \"cuda\"",
                       prefetch_factor="args.prefetch_factor", indent=len("make_batch_fn = "),
                       width=120 - ind - 4 * (v.pp > 1))  # under an ``if`` with pipelining
        uses += ["DataStream", "default_num_workers"]
    else:
        batches = call("functools.partial", "synthetic_batch", source.inputs_var, batch_size="BATCH_SIZE",
                       int_high="INT_HIGH", indent=len("make_batch_fn = "), width=120 - ind)
        uses.append("synthetic_batch")
    if source.loss_fn_var:
        loss = source.loss_fn_var
    elif v.cp > 1:  # the default loss on this rank's part of each sequence (runtime/cp.py)
        loss = "functools.partial(sequence_loss, cp=CP" + f", positions=takes_positions({source.model_var})" * (
            v.pp > 1) + ")"
        uses += ["sequence_loss", "sequence_shards"] + ["takes_positions", "shard_of"] * (v.pp > 1)
    else:
        loss = f"functools.partial({'fused_default_loss' if v.fused_loss else 'default_loss'}, causal=CAUSAL)"
        uses.append("fused_default_loss" if v.fused_loss else "default_loss")
    lines = ["dp_rank = mesh[\"dp\"].get_local_rank()", f"loss = {loss}"]
    if not (v.dataset and v.pp > 1):  # else after the stage ids
        lines.append(f"make_batch_fn = {batches}")
    if v.kv_cache:
        lines.append(f"switch_off_kv_cache({mv})  # Hugging Face's key/value cache: training never reads it")
        uses.append("switch_off_kv_cache")
    if v.meta_init:
        lines += [f"skeleton = copy.deepcopy({mv})  # unsharded, on meta: the initialisation below reads it",
                  f"net = {mv}"]
        uses.append("materialize")
    else:
        lines += [*whole_weights_lines(v, mv), f"net = {mv}" + ("  # on the host: FSDP offloads its parameters there"
                                                                 if v.offload else ".to(device)")]
    if v.pretrained:
        uses.append("load_pretrained")
    if v.sync_batchnorm:
        lines.append("net = apply_sync_batchnorm(net, mesh[\"dp\"].get_group(), device=device)  # plan.sync_batchnorm")
        uses.append("apply_sync_batchnorm")
    if v.fp32_ops or v.low_precision_ops:
        lines.append("# plan.precision's op lists, beyond autocast's own")
        lines.append("op_lists = " + call("functools.partial", "OpPrecision", "device", "AMP_DTYPE",
                                          **({"fp32_ops": "FP32_OPS"} if v.fp32_ops else {}),
                                          **({"low_precision_ops": "LOW_PRECISION_OPS"} if v.low_precision_ops else {}),
                                          indent=11, width=120 - ind))
        uses.append("OpPrecision")
    lines.append("# what each forward and backward runs under (autocast, loss_parallel)")
    lines.append("context = " + call("functools.partial", "step_context", "device",
                                     **({"amp_dtype": "AMP_DTYPE"} if v.amp != "none" else {}),
                                     **({"op_lists": "op_lists"} if v.fp32_ops or v.low_precision_ops else {}),
                                     **({"vocab_parallel": "True"} if v.vocab_parallel else {}),
                                     indent=10, width=120 - ind))
    context = "context"
    uses.append("step_context")
    if v.pp > 1:
        lines += _pipeline_lines(v, source, batches, uses)
    else:
        lines.append("parts = parallelize(net, mesh, device)")
    lines += weights_lines(v)
    if v.ddp and v.meta_init:
        lines += ["# data parallelism last: DDP, once the weights are real (it broadcasts rank 0's when it wraps; "
                  "meta has none)",
                  f"parts = [apply_ddp(part, {v.dp_mesh}.get_group(), device=device) for part in parts]"]
    lines.append("optimizer = " + call("build_optimizer", "parameters_of(parts)", "OPTIMIZER", lr="args.lr",
                                       weight_decay="WEIGHT_DECAY", betas="BETAS", indent=12, width=120 - ind,
                                       **({"zero1_group": f"{v.dp_mesh}.get_group()"} if v.zero1 else
                                          {"fused": "True"} if v.offload else {})))  # offload: a fused CPU step
    scaler = "None"
    if v.amp == "fp16":
        uses.append("grad_scaler")
        lines.append("scaler = " + call("grad_scaler", "device", init_scale="INIT_LOSS_SCALE",
                                        dynamic="DYNAMIC_LOSS_SCALE", growth_interval="GROWTH_INTERVAL",
                                        sharded=str(v.fsdp), indent=9, width=120 - ind))
        scaler = "scaler"
    if v.pp > 1:
        lines += ["stages = [" + call("build_stage", "part", "i", "NUM_STAGES", device="torch.device(device)",
                                      pp_group="mesh[\"pp\"].get_group()", values="shapes", indent=10, width=120 - ind),
                  "          for part, i in zip(parts, ids, strict=True)]",
                  "stage_loss = StageLoss(loss)  # the cell's loss on the last stage",
                  "schedule = " + call("build_schedule", "stages", schedule="SCHEDULE", n_microbatches="MICRO_BATCHES",
                                       loss_fn="stage_loss", indent=11, width=120 - ind),
                  "forward_backward = " + call("functools.partial", "pipeline_step", "schedule", "stage_loss",
                                               micro_batches="MICRO_BATCHES", has_first="0 in ids",
                                               has_last="NUM_STAGES - 1 in ids", device="device", context=context,
                                               **({"shard": "shard"} if v.cp > 1 else {}), indent=19, width=120 - ind),
                  "counts_loss = NUM_STAGES - 1 in ids and mesh[\"tp\"].get_local_rank() == 0",
                  *(["tied = TiedGradients(parts, TIES, mesh)  # an embedding and its head on different stages"]
                    if v.ties else [])]
        if v.ties:
            uses.append("TiedGradients")
    else:
        uses.append("accumulate")
        if v.cp > 1:
            lines += ["# context parallelism: each micro-batch's sequences split over the cp ranks, a ring attention",
                      "shard = functools.partial(sequence_shards, mesh[\"cp\"], causal=CAUSAL)"]
        lines += ["forward_backward = " + call("functools.partial", "accumulate", "parts[0]",
                                               micro_batches="MICRO_BATCHES", loss_fn="loss", context=context,
                                               scaler=scaler, zero_stage="ZERO_STAGE",
                                               **({"shard": "shard"} if v.cp > 1 else {}), indent=19,
                                               width=120 - ind),
                  "counts_loss = mesh[\"tp\"].get_local_rank() == 0  # one loss per model replica"]
    lines += ["if args.dry_run:", "    print_parameter_counts(parts)", "else:",
              "    " + _train_call(v, scaler, telemetry, width=120 - ind), *_save_hf(v, mv, uses)]
    return "\n".join(" " * ind + line for line in "\n".join(lines).splitlines()), uses


def _pipeline_lines(v: ScriptValues, source: ModelSource, batches: str, uses: list[str]) -> list[str]:
    """``main``'s lines before a pipelined ``parallelize``: the stages held here, the batches (on the end stages
    only, from a dataset), the micro-batch the stages are traced on (under cp, this rank's part of it)."""
    trace = "example = model_call(loss, " + ("shard_of(shard, {}))" if v.cp > 1 else "{})")
    uses += ["stage_ids", "split_batch", "to_device", "model_call", "build_stage", "StageLoss", "build_schedule",
             "pipeline_step"]
    lines = ["ids = stage_ids(mesh[\"pp\"].get_local_rank(), PP, NUM_STAGES, SCHEDULE)  # the stages held here"]
    if v.cp > 1:
        lines += ["# context parallelism: sequences split over the cp ranks before the schedule splits the batch",
                  "shard = functools.partial(sequence_shards, mesh[\"cp\"], causal=CAUSAL, per_sample=True)"]
    if v.dataset:  # only the first stage (inputs) and the last (targets) read samples
        first = call("first_batch", source.dataset_var, batch_size="BATCH_SIZE",
                     **({"collate_fn": source.collate_fn_var} if v.collate_fn else {}))
        lines += ["make_batch_fn = None  # a stage between the first and the last reads no data",
                  "if 0 in ids or NUM_STAGES - 1 in ids:  # the first stage takes the inputs, the last the targets",
                  "    make_batch_fn = " + batches.replace("\n", "\n    "),
                  "# every stage traces its part of the model on the dataset's first samples",
                  f"first = {first}",
                  trace.format("split_batch(to_device(first, device), MICRO_BATCHES)[0]")]
        uses.append("first_batch")
    else:
        lines.append(trace.format("split_batch(to_device(make_batch_fn(0, dp_rank), device), MICRO_BATCHES)[0]"))
    lines += ["parts, shapes = parallelize(net, mesh, device, ids, example)",
              ("del example, first" if v.dataset else "del example") + "  # (a whole batch): not held for the run"]
    return lines


def _train_call(v: ScriptValues, scaler: str, telemetry: bool, *, width: int) -> str:
    """``train(...)`` as ``main`` calls it: the one-file script hands it its metrics stream and verify's observer,
    which the two-file script's runtime module holds itself (``runtime/metrics.py``'s ``Run``)."""
    notebook = {"metrics": "metrics", "observer": "observer"} if telemetry else {}
    return call("train", "args", "parts", "optimizer", forward_backward="forward_backward",
                make_batch="make_batch_fn", dp_rank="dp_rank", device="device", dp="mesh[\"dp\"].size()",
                counts_loss="counts_loss", **notebook, scaler=scaler,
                pp_group="mesh[\"pp\"].get_group()" if v.pp > 1 else "None",
                **({"tied": "tied"} if v.pp > 1 and v.ties else {}), tokens=str(v.tokens),
                **({"cp": "CP"} if v.cp > 1 else {}), indent=4, width=width)


def _save_hf(v: ScriptValues, model_var: str, uses: list[str]) -> list[str]:
    """``main``'s lines for ``--save-hf`` (a pretrained Hugging Face model): the trained weights in its format."""
    if not v.save_hf:
        return []
    uses.append("save_hf")
    ties = ", ties=TIES" if v.ties else ""
    return ["    if args.save_hf:  # the trained weights as from_pretrained reads them",
            f"        save_hf(args.save_hf, parts, {model_var}{ties})"]


def render_script(source: ModelSource, plan: Plan, v: ScriptValues, *, script_name: str, plan_file: str,
                  steps: int, seed: int, launch: str) -> str:
    """The whole script (see the module docstring)."""
    setting_lines, setting_imports = settings(v, plan, seed=seed)
    par, par_uses, par_imports = parallelize_source(v)
    body, main_uses = main_source(v, source)
    prelude = kit.assemble([*PRELUDE, *(PRETRAINED if v.from_config else ())])  # what the cell's lines call
    assembly = kit.assemble([*par_uses, *main_uses])
    assembly.blocks = [b for b in assembly.blocks if b[1] not in prelude.names]  # defined once, before the cell
    std = {("functools", None, None)} | ({("copy", None, None)} if v.meta_init else set())
    check_names(source, assembly.names + prelude.names)
    imports = without_cell_imports(assembly.imports | prelude.imports | TEMPLATE_IMPORTS | std | par_imports,
                                    source, keep=setting_imports | prelude.imports)
    flags = (DATA_FLAGS if v.dataset else "") + (HF_FLAGS if v.save_hf else "")
    return Template(TEMPLATE.read_text()).substitute(
        model_name=v.model_class, summary=_summary_lines(v.model_class, plan.summary()), plan_file=plan_file,
        intro=textwrap.fill(f"Exported by autopar-nb from a notebook cell. The cell is kept verbatim below; the plan "
                            f"({plan_file} beside this file) is applied by the functions of autopar_nb.runtime, "
                            "copied below; nothing but torch (and the cell's own imports) is needed.", width=116),
        launch=launch,
        imports="\n\n".join(kit.import_lines(imports, setting_imports)),
        settings="\n".join(setting_lines), prelude=prelude.source(), cell=script_cell(source, v), kit=assembly.source(),
        parallelize=par, steps=int(steps), main=body, data_flags=flags,
        build_mesh="build_mesh(device, PP, DP, TP" + (", cp=CP)" if v.cp > 1 else ")"))
