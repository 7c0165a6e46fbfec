"""export(source, plan, path): the finalised plan as a standalone ``torchrun`` script, plus ``plan.json`` beside it.

The script reads like a hand-written one (nanoGPT's ``train.py``): a docstring with the launch commands, a block of
settings saying where each came from in the plan, the notebook cell verbatim, and one linear ``train()`` with the
plan applied through explicit torch calls (``parallelize_module``, ``checkpoint_wrapper``, ``fully_shard``,
``pipeline``...), in the same order and with the same values as :func:`autopar_nb.runtime.apply_plan`, so its losses
equal those of :func:`autopar_nb.verify`. Only the parts the plan uses are written. It never imports autopar_nb.
"""

from __future__ import annotations

import inspect
import textwrap
from dataclasses import dataclass
from pathlib import Path
from string import Template

from ..plan import Plan
from ..runtime.batchnorm import CPUSyncBatchNorm
from ..runtime.data import DEFAULT_DATA_LOSS, default_constants
from ..runtime.pp import SCHEDULES, V_SCHEDULES, stage_boundaries
from ..runtime.tp import tp_styles
from ..source import ModelSource
from .snippets import (
    _BOUNDARY,
    _CHECKPOINT,
    _CHECKPOINT_ZERO1,
    _CONTIGUOUS,
    _INIT_WEIGHTS,
    _MEMORY,
    _METRICS,
    _MODEL_INPUTS,
    _RESTORE_LEAVES,
    _SAVE_MATMULS,
    _SPLIT,
    _WRAP,
)

TEMPLATE = Path(__file__).with_name("script.py.tmpl")
DTYPE_NAMES = {"bf16": "torch.bfloat16", "fp16": "torch.float16", "bfloat16": "torch.bfloat16",
               "float16": "torch.float16", "float32": "torch.float32", "fp32": "torch.float32"}
OPTIMIZER_CLASSES = {"adam": "torch.optim.Adam", "adamw": "torch.optim.AdamW", "sgd": "torch.optim.SGD"}


@dataclass
class Exported:
    """What :func:`export` wrote."""

    script: Path
    plan_json: Path
    commands: list[str]
    """torchrun for one node, then for several"""

    def __str__(self) -> str:
        return f"wrote {self.script} and {self.plan_json}\n" + "\n".join(f"  {c}" for c in self.commands)


def torchrun_commands(script: str, plan: Plan, *, nodes: int | None = None) -> list[str]:
    """``torchrun`` command lines: one node with every rank, and ``nodes`` nodes (default: the plan's cluster, at
    least 2) sharing them."""
    world = plan.mesh.world_size
    nodes = nodes or max(2, plan.cluster.get("nodes", 1))
    per_node = max(1, world // nodes)
    one = f"torchrun --nproc-per-node {world} {script}"
    multi = (f"torchrun --nnodes {nodes} --nproc-per-node {per_node} --rdzv-backend c10d "
             f"--rdzv-endpoint HOST:29500 --rdzv-id {Path(script).stem} {script}")
    return [one, multi]


def export(source: ModelSource, plan: Plan, path: str | Path, *, steps: int = 100, seed: int = 0,
           meta_init: bool = False, quiet: bool = False) -> Exported:
    """Write the training script for ``plan`` to ``path`` and the plan to ``<path stem>.plan.json`` beside it.

    ``meta_init``: build the model on the meta device and initialise it shard by shard (models larger than host
    memory); otherwise every rank builds it for real and shards it. Prints the torchrun commands unless ``quiet``.
    """
    path = Path(path)
    if path.suffix != ".py":
        raise ValueError(f"export path {str(path)!r} should end in .py (it is a Python script)")
    plan_path = path.with_name(path.stem + ".plan.json")
    text = render_script(source, plan, script_name=path.name, plan_file=plan_path.name, steps=steps, seed=seed,
                         meta_init=meta_init)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    plan_path.write_text(plan.to_json() + "\n")
    result = Exported(script=path, plan_json=plan_path, commands=torchrun_commands(path.name, plan))
    if not quiet:
        print(result)
    return result


# ---- rendering ------------------------------------------------------------------------------------------------------
def _isort_key(name: str) -> tuple[int, str]:
    """isort's order-by-type: CONSTANTS, then Classes, then functions."""
    n = name.split()[0]
    return (0 if n.isupper() and len(n) > 1 else 1 if n[0].isupper() else 2, n)


def _style_entry(path: str, text: str, indent: int) -> list[str]:
    line = f'{" " * indent}"{path}": {text},'
    if len(line) + 4 <= 120:
        return [line]
    head, _, args = text.partition("(")
    return [f'{" " * indent}"{path}": {head}(', f'{" " * (indent + 4)}{args},']


def _block(text: str, indent: int = 0) -> list[str]:
    return textwrap.indent(textwrap.dedent(text).strip("\n"), " " * indent).splitlines()


def render_script(source: ModelSource, plan: Plan, *, script_name: str = "train.py", plan_file: str = "plan.json",
                  steps: int = 100, seed: int = 0, meta_init: bool = False) -> str:
    """The script's text (see :func:`export`)."""
    m, pr, o = plan.mesh, plan.precision, plan.optimizer
    model, inputs, _ = source.build(device="meta", seed=seed)
    modules = dict(model.named_modules())
    pp, fsdp, ddp = m.pp > 1, m.dp > 1 and m.zero_stage >= 2, m.dp > 1 and m.zero_stage < 2
    zero1 = m.dp > 1 and m.zero_stage == 1
    if m.tp > 1 and ddp:
        raise NotImplementedError(f"dp({m.dp}) x tp({m.tp}) needs FSDP over dp: set mesh.zero_stage to 2 or 3")
    if plan.sync_batchnorm and m.dp > 1 and pp:
        raise NotImplementedError("sync_batchnorm with pipelining is not supported")
    if pp and (pr.amp == "fp16" or plan.loss_parallel):
        raise NotImplementedError("pipelining with fp16 loss scaling or loss_parallel is not supported")
    styles = tp_styles(model, plan.tp_plan, sp_layers=[lp.path for lp in plan.layers if lp.sequence_parallel],
                       layers=[lp.path for lp in plan.layers], loss_parallel=plan.loss_parallel) if m.tp > 1 else {}
    # sequence-parallel activations crossing a pipeline boundary are cut: the stages infer their shapes instead
    static_sp = any("Shard(1)" in text for text in styles.values())
    full = [lp.path for lp in plan.layers if lp.recompute == "full"]
    selective = [lp.path for lp in plan.layers if lp.recompute == "selective"]
    units = [lp.path for lp in plan.layers if lp.fsdp and lp.path in modules
             and any(True for _ in modules[lp.path].parameters())]
    loss_name = source.loss_fn_var or "loss_fn"
    batch_name = source.make_batch_var or "make_batch"
    defaults = source.loss_fn_var is None or source.make_batch_var is None
    amp = pr.amp != "none"
    scaler = pr.amp == "fp16"
    lp_on = plan.loss_parallel and m.tp > 1
    # mirror of the runtime: foreach kernels cannot mix DTensor and plain tensor parameters (TP without FSDP)
    foreach_off = m.tp > 1 and not fsdp and not zero1
    first = inputs
    while isinstance(first, (tuple, list, dict)):
        first = next(iter(first.values())) if isinstance(first, dict) else first[0]
    tokens = first.dim() == 2 and not first.is_floating_point()

    # ---- imports ----
    std = {"argparse", "gc", "json", "os", "socket", "time", "traceback"}
    if meta_init:
        std.add("copy")
    if selective:
        std.add("functools")
    frm: dict[str, set[str]] = {
        "torch.distributed.checkpoint.state_dict": {"get_state_dict", "set_state_dict"}
        | (set() if zero1 else {"StateDictOptions"}),
        "torch.distributed.device_mesh": {"init_device_mesh"},
        "torch.distributed.elastic.multiprocessing.errors": {"record"},
    }
    if styles:
        used = {name for text in styles.values() for name in
                ("ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput", "PrepareModuleOutput")
                if name + "(" in text}
        frm["torch.distributed.tensor.parallel"] = used | {"parallelize_module"}
        layouts = {name for text in styles.values() for name in ("Shard", "Replicate") if name + "(" in text}
        if lp_on:
            frm["torch.distributed.tensor.parallel"].add("loss_parallel")
            layouts.add("DTensor")
        if meta_init:
            layouts |= {"DTensor", "distribute_tensor"}
        if layouts:
            frm["torch.distributed.tensor"] = layouts
    elif meta_init:
        frm["torch.distributed.tensor"] = {"DTensor", "distribute_tensor"}
    if full or selective:
        frm["torch.distributed.algorithms._checkpoint.checkpoint_wrapper"] = {"checkpoint_wrapper"}
    if selective:
        frm["torch.utils.checkpoint"] = {"CheckpointPolicy", "create_selective_checkpoint_contexts"}
    if fsdp:
        frm["torch.distributed.fsdp"] = {"fully_shard"}
        if (pr.param_dtype, pr.reduce_dtype) != ("float32", "float32"):
            frm["torch.distributed.fsdp"].add("MixedPrecisionPolicy")
    if ddp:
        frm["torch.nn.parallel"] = {"DistributedDataParallel as DDP"}
    if zero1:
        frm["torch.distributed.optim"] = {"ZeroRedundancyOptimizer"}
    if pp:
        frm["torch.distributed.pipelining"] = {"PipelineStage", "SplitPoint", "pipeline"}
        frm["torch.distributed.pipelining.schedules"] = {"Schedule" + SCHEDULES[plan.pipeline.schedule]}
    if scaler and fsdp:
        frm["torch.distributed.fsdp.sharded_grad_scaler"] = {"ShardedGradScaler"}
    imports = [f"import {s}" for s in sorted(std)] + [""]
    imports += ["import torch", "import torch.distributed as dist", "import torch.distributed.checkpoint as dcp"]
    if plan.sync_batchnorm and m.dp > 1:
        imports.append("import torch.distributed.nn.functional as dist_nn")
    for mod in sorted(frm):
        names = sorted(frm[mod], key=_isort_key)
        line = f"from {mod} import {', '.join(names)}"
        if len(line) > 120:
            line = f"from {mod} import (\n" + "".join(f"    {n},\n" for n in names) + ")"
        imports.append(line)

    # ---- settings ----
    num_stages = m.pp * plan.pipeline.virtual_stages
    s = [f"SEED = {seed}  # every process seeds the same before building the model",
         f"PP, DP, TP = {m.pp}, {m.dp}, {m.tp}  # mesh.pp, mesh.dp, mesh.tp: world = PP * DP * TP = {m.world_size}",
         f"ZERO_STAGE = {m.zero_stage}  # mesh.zero_stage: 0 DDP, 1 + sharded optimizer, 2 + sharded grads, "
         "3 + sharded params",
         f"MICRO_BATCHES = {plan.batch.micro_batches}  # batch.micro_batches: "
         + ("pipeline micro-batches" if pp else "gradient accumulation steps")]
    if pp:
        s.append(f"NUM_STAGES = {num_stages}  # mesh.pp * pipeline.virtual_stages")
    if amp:
        s.append(f"AMP_DTYPE = {DTYPE_NAMES[pr.amp]}  # precision.amp: autocast dtype of the forward pass")
    if fsdp and (pr.param_dtype, pr.reduce_dtype) != ("float32", "float32"):
        s.append(f"PARAM_DTYPE, REDUCE_DTYPE = {DTYPE_NAMES[pr.param_dtype]}, {DTYPE_NAMES[pr.reduce_dtype]}"
                 "  # precision.param_dtype, .reduce_dtype")
    if scaler:
        s.append(f"INIT_LOSS_SCALE = {pr.init_loss_scale!r}  # precision.init_loss_scale")
        s.append(f"GROWTH_INTERVAL = {pr.growth_interval if pr.dynamic_loss_scale else 2**31 - 1}"
                 f"  # precision.growth_interval (dynamic_loss_scale={pr.dynamic_loss_scale})")
    s.append(f"LR = {o.lr!r}  # optimizer.lr")
    s.append(f"WEIGHT_DECAY = {o.weight_decay!r}  # optimizer.weight_decay")
    if o.name != "sgd":
        s.append(f"BETAS = {tuple(o.betas)!r}  # optimizer.betas")
    if defaults:
        consts = default_constants(model, inputs, dp=m.dp, global_batch=plan.batch.global_batch)
        s.append(f"BATCH_SIZE = {consts['BATCH_SIZE']}  # samples per data-parallel rank and step (synthetic data)")
        s.append(f"INT_HIGH = {consts['INT_HIGH']}  # integer inputs are drawn from [0, INT_HIGH): the smallest "
                 "embedding table")
    settings = "\n".join(s)

    # ---- cell ----
    cell = source.code.rstrip("\n")
    if meta_init:
        cell = ("torch.set_default_device(\"meta\")  # the model is too large to build whole: shapes only, no "
                "storage\n" + cell + "\ntorch.set_default_device(None)")
    if defaults:
        cell += ("\n\n\n# the cell defines no data/loss: synthetic data shaped like its example inputs\n"
                 + DEFAULT_DATA_LOSS.format(inputs=source.inputs_var)
                 .replace("F.cross_entropy", "torch.nn.functional.cross_entropy").rstrip("\n"))
        if source.loss_fn_var is not None:  # keep the cell's own loss_fn
            cell = cell.replace("\n\ndef loss_fn(model, batch):", "\n\ndef _unused_loss_fn(model, batch):")
        if source.make_batch_var is not None:
            cell = cell.replace("\ndef make_batch(step, rank):", "\ndef _unused_make_batch(step, rank):")

    # ---- helpers ----
    h = [_METRICS, _MEMORY, _SPLIT]
    if pp:
        h.append(_MODEL_INPUTS.replace("loss_fn(", f"{loss_name}("))
        h.append(_RESTORE_LEAVES)
        h.append(_CONTIGUOUS)
        if not static_sp:
            h.append(_BOUNDARY)
    if full or selective:
        h.append(_WRAP)
    if selective:
        h.append(_SAVE_MATMULS)
    if meta_init:
        h.append(_INIT_WEIGHTS)
    h.append(_CHECKPOINT_ZERO1 if zero1 else _CHECKPOINT)
    if plan.sync_batchnorm and m.dp > 1:
        h.append(inspect.getsource(CPUSyncBatchNorm))
    helpers = "\n\n".join(x.strip("\n") for x in h) + "\n"

    # ---- train() ----
    t = _block('''
        def train(args, metrics):
            device = "cuda" if torch.cuda.is_available() else "cpu"
            if device == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            backend = "nccl" if device == "cuda" else "gloo"
            attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
            if attempt and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                # a restarted attempt (torchrun --max-restarts) meets in a fresh key space of the agent's store, so
                # stale keys of the failed attempt cannot break its rendezvous
                store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
                dist.init_process_group(backend, store=dist.PrefixStore(f"attempt{attempt}", store),
                                        rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
            else:
                dist.init_process_group(backend)
            rank = dist.get_rank()
            if dist.get_world_size() != PP * DP * TP:
                raise SystemExit(f"this plan runs on PP * DP * TP = {PP * DP * TP} processes, not "
                                 f"{dist.get_world_size()}: see the torchrun commands at the top of this file")
            # ranks form a (pp, dp, tp) grid; TP innermost so a TP group stays inside a node
            mesh = init_device_mesh(device, (PP, DP, TP), mesh_dim_names=("pp", "dp", "tp"))
            dp_rank, tp_rank = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
        ''')
    body: list[str] = []
    mv = source.model_var
    if meta_init:
        body += [f"skeleton = copy.deepcopy({mv})  # unsharded, on meta: module order and shapes for the init below"]
    if plan.sync_batchnorm and m.dp > 1:
        body += ["# BatchNorm statistics over the whole data-parallel batch (plan: sync_batchnorm); PyTorch has no CPU",
                 "# kernel for SyncBatchNorm, so on CPU CPUSyncBatchNorm (above) does the same with an all_reduce",
                 f"net = {mv}",
                 "if device == \"cuda\":",
                 "    net = torch.nn.SyncBatchNorm.convert_sync_batchnorm(net, process_group=mesh[\"dp\"].get_group())",
                 "else:",
                 "    net = CPUSyncBatchNorm.convert(net, process_group=mesh[\"dp\"].get_group())"]
        mv = "net"
    if pp:
        boundaries = stage_boundaries(plan.stage_layers())
        split = ", ".join(f"{b!r}: SplitPoint.BEGINNING" for b in boundaries).replace("'", '"')
        if plan.pipeline.schedule in V_SCHEDULES and num_stages > m.pp:
            ids = "[pp_rank, NUM_STAGES - 1 - pp_rank]  # V placement"
        elif num_stages > m.pp:
            ids = "list(range(pp_rank, NUM_STAGES, PP))  # looped placement"
        else:
            ids = "[pp_rank]"
        body += _block(f'''
            # pipeline stages (plan: layers[*].stage): trace the model on one micro-batch and cut it before the first
            # layer of each stage; stage modules keep the original parameter names
            example = split_batch(to_device({batch_name}(0, dp_rank), device), MICRO_BATCHES)[0]
            mb_args, mb_kwargs = model_inputs(example)
            pipe = pipeline({mv}, mb_args=mb_args, mb_kwargs=mb_kwargs or None, split_spec={{{split}}})
            all_stages = [restore_leaf_modules(pipe.get_stage_module(i), {mv}) for i in range(NUM_STAGES)]
            for stage in all_stages:
                stage.register_forward_hook(contiguous_outputs)
            pp_rank = mesh["pp"].get_local_rank()
            stage_ids = {ids}
            parts = [all_stages[i] for i in stage_ids]
            ''')
        if not static_sp:
            body += ["boundary = boundary_values(pipe, all_stages, mb_args, mb_kwargs)  # static stage shapes"]
    else:
        if not meta_init:
            body += [f"net = {mv}.to(device)" if mv != "net" else "net = net.to(device)"]
        else:
            body += [f"net = {mv}"]
        body += [] if (styles or full or selective or fsdp or ddp) else ["parts = [net]"]
    if styles:
        body += ["# tensor parallelism (plan: layers[*].tp, .sequence_parallel; loss_parallel): module -> style",
                 "tp_plan = {"] + [x for k, v in styles.items() for x in _style_entry(k, v, 4)] + ["}"]
    mixed = fsdp and (pr.param_dtype, pr.reduce_dtype) != ("float32", "float32")
    if mixed:
        body += ["mp_policy = MixedPrecisionPolicy(param_dtype=PARAM_DTYPE, reduce_dtype=REDUCE_DTYPE)"]
    # per model piece: "net" without pipelining (written straight), each stage module "part" with it (in a loop,
    # keeping the modules that stage holds)
    v = "part" if pp else "net"
    only = "    if path in modules:\n        " if pp else "    "
    per: list[str] = []
    if styles:
        per += ["# 1. TP first: it turns parameters into DTensors, which AC and FSDP must see",
                f"parallelize_module({v}, mesh[\"tp\"], "
                + ("{k: v for k, v in tp_plan.items() if k in modules})" if pp else "tp_plan)")]
    if full or selective:
        per += ["# 2. activation checkpointing (plan: layers[*].recompute) around whole layers, before FSDP so",
                "#    FSDP's all-gathers stay outside the recomputed region"]
        if full:
            per += [f"for path in {full!r}:  # full: keep only the layer input".replace("'", '"'),
                    *(only + f"wrap({v}, path, lambda m: checkpoint_wrapper(m, preserve_rng_state=False))"
                      ).splitlines()]
        if selective:
            per += [f"for path in {selective!r}:  # selective: keep matmul/attention outputs".replace("'", '"'),
                    *(only + f"wrap({v}, path, lambda m: checkpoint_wrapper(").splitlines(),
                    only.splitlines()[-1] + "    m, preserve_rng_state=False,",
                    only.splitlines()[-1] + "    context_fn=functools.partial(create_selective_checkpoint_contexts, "
                                            "save_matmuls)))"]
    if fsdp:
        mp_arg = "mp_policy=mp_policy, " if mixed else ""
        per += [f"# 3. FSDP last (ZeRO-{m.zero_stage}): one unit per layer (plan: layers[*].fsdp), then the root",
                f"for path in {units!r}:".replace("'", '"'),
                *(only + f"fully_shard({v}.get_submodule(path), mesh=mesh[\"dp\"], {mp_arg}"
                  f"reshard_after_forward={m.zero_stage == 3})").splitlines(),
                f"fully_shard({v}, mesh=mesh[\"dp\"], {mp_arg}reshard_after_forward=False)"]
    if ddp:
        per += [f"# 3. data parallelism last: DDP{' (ZeRO-1 shards the optimizer below)' if zero1 else ''}",
                f"{v} = DDP({v}, process_group=mesh[\"dp\"].get_group(),",
                f"{' ' * (len(v) + 7)}device_ids=[torch.cuda.current_device()] if device == \"cuda\" else None)"]
    if pp and per:
        body += ["for i, part in enumerate(parts):"]
        if any("modules" in line for line in per):
            body += ["    modules = dict(part.named_modules())"]
        body += ["    " + line if line else "" for line in per]
        if ddp:
            body += ["    parts[i] = part"]
    elif per:
        body += per + ["parts = [net]"]
    if meta_init:
        body += ["init_weights(parts, skeleton, device)  # allocate the local shards, initialise module by module"]
    body += _block('''
        if args.dry_run:
            counts = [None] * dist.get_world_size()
            dist.all_gather_object(counts, sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                                               for part in parts for p in part.parameters()))
            if rank == 0:
                for r, n in enumerate(counts):
                    print(f"rank {r}: {n:,} parameters")
            gc.collect()
            dist.destroy_process_group()
            return
        ''')
    rate = "tokens_per_s" if tokens else "samples_per_s"
    opt_cls = OPTIMIZER_CLASSES[o.name]
    opt_kwargs = "lr=args.lr, weight_decay=WEIGHT_DECAY" + (", betas=BETAS" if o.name != "sgd" else "")
    body += ["", "params = [p for part in parts for p in part.parameters()]"]
    if zero1:
        body += ["# ZeRO-1: each data-parallel rank keeps the optimizer state of its share of the parameters",
                 f"optimizer = ZeroRedundancyOptimizer(params, optimizer_class={opt_cls}, "
                 f"process_group=mesh[\"dp\"].get_group(),",
                 f"                                    {opt_kwargs})"]
    elif foreach_off:
        body += ["# foreach=False: the multi-tensor kernels cannot mix DTensor (TP) and plain parameters",
                 f"optimizer = {opt_cls}(params, {opt_kwargs}, foreach=False)"]
    else:
        body += [f"optimizer = {opt_cls}(params, {opt_kwargs})"]
    if scaler:
        cls = "ShardedGradScaler" if fsdp else "torch.amp.GradScaler"
        extra = "" if pr.dynamic_loss_scale else ", growth_factor=1.0, backoff_factor=1.0"
        body += [f"scaler = {cls}(device, init_scale=INIT_LOSS_SCALE, growth_interval=GROWTH_INTERVAL{extra})"]
    if pp:
        shapes = "" if static_sp else \
            ",\n" + " " * 36 + "input_args=boundary[i][0], output_args=boundary[i][1]"
        sched = "Schedule" + SCHEDULES[plan.pipeline.schedule]
        stages_arg = "stages[0]" if num_stages == m.pp and plan.pipeline.schedule in ("gpipe", "1f1b") else "stages"
        body += _block(f'''
            stages = [PipelineStage(part, i, NUM_STAGES, torch.device(device), group=mesh["pp"].get_group(){shapes})
                      for part, i in zip(parts, stage_ids, strict=True)]
            has_first, has_last = 0 in stage_ids, NUM_STAGES - 1 in stage_ids
            micro = []  # this step's micro-batches, read by the last stage's loss


            def stage_loss(output, index):
                """The cell's loss on the last stage: its model call is replaced by the stage output."""
                return {loss_name}(lambda *a, **k: output, micro[int(index)])


            schedule = {sched}({stages_arg}, n_microbatches=MICRO_BATCHES, loss_fn=stage_loss)
            ''')
    ckpt_model = "parts[0] if len(parts) == 1 else torch.nn.ModuleList(parts)"
    body += _block(f'''
        ckpt_model = {ckpt_model}
        start = 0
        if args.ckpt_dir and latest_checkpoint(args.ckpt_dir):
            start = load_checkpoint(latest_checkpoint(args.ckpt_dir), ckpt_model, optimizer)
            if rank == 0:
                print(f"resumed from {{latest_checkpoint(args.ckpt_dir)}} at step {{start}}")
        ''')
    body += ["", "for step in range(start, args.steps):",
             "    t0 = time.perf_counter()",
             f"    batch = to_device({batch_name}(step, dp_rank), device)  # this data-parallel rank's share",
             "    local_loss = torch.zeros((), device=device)"]
    ctx = []
    if amp:
        ctx.append("torch.autocast(device, dtype=AMP_DTYPE)")
    if lp_on:
        ctx.append("loss_parallel()")
    if pp:
        body += _block('''
            micro[:] = split_batch(batch, MICRO_BATCHES)
            losses = []
            inputs, kwargs = model_inputs(batch) if has_first else ((), {})
            target = torch.arange(MICRO_BATCHES) if has_last else None  # micro-batch index -> its batch
            ''', 4)
        if amp:
            body += ["    with torch.autocast(device, dtype=AMP_DTYPE):",
                     "        schedule.step(*inputs, target=target, losses=losses, **kwargs)"]
        else:
            body += ["    schedule.step(*inputs, target=target, losses=losses, **kwargs)"]
        body += ["    if has_last:", "        local_loss = torch.stack([x.detach().float() for x in losses]).mean()"]
    else:
        body += ["    for mb in split_batch(batch, MICRO_BATCHES):"]
        ind = "        "
        if ctx:
            body += [ind + f"with {', '.join(ctx)}:"]
            ind += "    "
        body += [ind + f"loss = {loss_name}(net, mb) / MICRO_BATCHES"]
        body += [ind + ("scaler.scale(loss).backward()" if scaler else "loss.backward()")]
        if lp_on:
            body += ["        if isinstance(loss, DTensor):  # loss_parallel returns a replicated DTensor",
                     "            loss = loss.full_tensor()"]
        body += ["        local_loss += loss.detach().float()"]
    body += ["    # the global batch's loss: mean over data-parallel ranks of the last stage's loss (one TP rank each)"]
    cond = "tp_rank != 0" if not pp else "not has_last or tp_rank != 0"
    body += [f"    if {cond}:", "        local_loss.zero_()", "    dist.all_reduce(local_loss)"]
    if scaler:
        body += ["    scaler.step(optimizer)", "    scaler.update()"]
    else:
        body += ["    optimizer.step()"]
    body += _block(f'''
        optimizer.zero_grad()
        loss = local_loss.item() / DP
        dt = time.perf_counter() - t0
        if rank == 0:
            print(f"step {{step}} | loss {{loss:.4f}} | {{dt * 1e3:.1f}} ms", flush=True)
        if metrics.sock is not None:
            n = first_tensor(batch).{"numel()" if tokens else "shape[0]"} * DP  # {rate[:-6]} in the global batch
            metrics.send({{"step": step, "loss": loss, "step_time_s": dt, "{rate}": n / dt,
                          **memory_stats(device)}})
        if args.ckpt_dir and (step + 1) % args.ckpt_every == 0:
            save_checkpoint(os.path.join(args.ckpt_dir, f"step_{{step + 1}}"), ckpt_model, optimizer, step + 1)
        ''', 4)
    body += ["", "gc.collect()  # before destroy: a gloo thread taking the GIL at exit can abort the process",
             "dist.destroy_process_group()"]
    train = "\n".join(t + ["    " + line if line else "" for line in body]) + "\n"

    world = m.world_size
    cmds = torchrun_commands(script_name, plan)
    nodes = int(cmds[1].split("--nnodes ")[1].split()[0])
    cmds[1] = cmds[1].replace(" --rdzv-id", " \\\n        --rdzv-id")  # a shell line continuation
    return Template(TEMPLATE.read_text()).substitute(
        model_name=type(model).__name__, summary=plan.summary(), nproc=world,
        intro=textwrap.fill(f"Exported by autopar-nb from a notebook cell. The cell is kept verbatim below; the plan "
                            f"({plan_file} beside this file) is applied with plain torch.distributed calls; nothing "
                            "but torch (and the cell's own imports) is needed.", width=116),
        cmd_one=cmds[0], cmd_multi=cmds[1], nnodes=nodes,
        per_node=f"{max(1, world // nodes)} process{'es' if world // nodes > 1 else ''}",
        imports="\n".join(imports), settings=settings, cell=cell, helpers=helpers, steps=steps, train=train)


# ---- helper functions written into the script (each only when the plan uses it) -----------------------------------


__all__ = ["Exported", "export", "render_script", "torchrun_commands"]
