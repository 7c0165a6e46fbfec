"""The exported script's ``parallelize``: the runtime's technique functions called in torchtitan's
order (float8, the fused loss, TP, EP, activation checkpointing, compile, then data parallelism
last), each with a comment saying why it comes where it does; with tensor parallelism, the TP plans
as its local variables.
"""

from __future__ import annotations

from .literals import call, literal, style_dict
from .values import ScriptValues


def tp_plans(v: ScriptValues) -> tuple[list[str], set, list[str]]:
    """The TP plans as local variables of ``parallelize`` (torchtitan writes them inline in
    ``apply_tp``): lines, imports, and runtime names (styles defined by the runtime itself)."""
    lines = ["# tensor parallelism (plan: layers[*].tp, .sequence_parallel, loss_parallel): one "
             "plan for the blocks of",
             "# each module list (paths relative to a block), one for the modules around them"]
    if v.block_tp_plans:
        lines.append(f"layer_plans = {style_dict(v.block_tp_plans, width=116)}")
    lines.append(f"plan = {style_dict(v.tp_plan, width=116)}")  # inside parallelize: 4 more columns
    if v.local_sizes:
        lines += ["# per-rank head counts and widths that the model's code reads (global / TP; "
                  "plan: layers[*].tp_parts)", f"sizes = {literal(v.local_sizes, width=116)}"]
    if v.head_tables:
        lines += ["# head-indexed tables (bias per head, ALiBi slopes): name -> the dim of the "
                  "heads, split with them;",
                  "# (dim, heads): that dim holds the batch and the heads flattened (batch outer)",
                  f"tables = {literal(v.head_tables, width=116)}"]
    styles = [*v.tp_plan.values(), *(x for p in v.block_tp_plans.values() for x in p.values())]
    imports = {("torch.distributed.tensor", name, None) for st in styles
               for name in st.placements()}
    uses = sorted({st.class_name for st in styles if st.defined_by_runtime})
    imports |= {("torch.distributed.tensor.parallel", st.class_name, None) for st in styles
                if not st.defined_by_runtime}
    return lines, imports, uses


def tp_source(v: ScriptValues, step: int) -> tuple[list[str], list[str]]:
    """The lines of ``parallelize`` that apply TP (technique number ``step``) and the runtime names
    they call."""
    calls = [f"# {step}. TP first: it turns parameters into DTensors, which AC and FSDP must see",
             "apply_tp(part, mesh[\"tp\"], plan"
             + (", layer_plans=layer_plans)" if v.block_tp_plans else ")")]
    uses = ["apply_tp"] + ["apply_async_tp"] * v.async_tp
    # Inductor reads the flag when it compiles the blocks (below), on the TP mesh's symmetric memory
    if v.async_tp:
        calls.append("apply_async_tp(mesh[\"tp\"])  # TP's collectives micro-pipelined with the "
                     "matmuls (CUDA)")
    if v.local_sizes:
        calls.append("set_local_sizes(part, sizes)")
        uses.append("set_local_sizes")
    if v.head_tables:
        calls.append("shard_head_tables(part, mesh[\"tp\"], tables)")
        uses.append("shard_head_tables")
    if v.fused_head_tp:
        calls += ["# the fused head's weight split on the vocabulary (its loss then "
                  "vocab-parallel), before ties",
                  "shard_fused_head(part, FUSED_LOSS, mesh[\"tp\"], "
                  f"sequence_sharded={v.fused_head_sequence})"]
        uses.append("shard_fused_head")
    if v.ties:
        calls.append("tie_parameters(part, TIES)  # parallelize_module gave each side its own "
                     "DTensor")
        uses.append("tie_parameters")
    return calls, uses


def _data_parallel_lines(v: ScriptValues, step: int, uses: list[str]) -> list[str]:
    """The lines of ``parallelize`` that apply data parallelism (technique number ``step``), last:
    FSDP over the TP-sharded, checkpoint-wrapped modules, FSDP2's replicate, or DDP (in ``main``
    under meta init)."""
    calls: list[str] = []
    if v.fsdp:
        mixed, indent = v.fsdp_policies, 8 if v.pp > 1 else 4
        calls += [f"# {step}. FSDP last (ZeRO-{v.zero_stage}), over the TP-sharded, "
                  "checkpoint-wrapped modules" + ("; the experts first," if v.ep > 1 else "")]
        if v.zero_stage == 3 and not v.reshard_after_forward:
            calls += [f"#    parameters kept gathered after forward: {v.schedule}'s input pass "
                      "hooks the weight pass",
                      "#    on the parameters the forward used (the sharded ones would hook "
                      "nothing)"]
        if v.ep > 1:
            calls += ["#    each its own unit over the ranks holding the same experts (the rest "
                      "leave them alone)",
                      call("shard_experts", "part", "experts_mesh[\"dp_mod_ep\"]", dp="DP",
                           reshard_after_forward=str(v.reshard_after_forward), **mixed,
                           indent=indent)]
            uses.append("shard_experts")
        calls.append(call("apply_fsdp", "part", v.dp_mesh, units="FSDP_UNITS",
                          reshard_after_forward=str(v.reshard_after_forward), **mixed,
                          indent=indent))
        uses.append("apply_fsdp")
    elif v.replicate:
        calls += [f"# {step}. data parallelism last: FSDP2's replicate (DDP takes no DTensors), "
                  "one all-reduce per unit",
                  f"apply_replicate(part, {v.dp_mesh}, units=FSDP_UNITS)"]
        uses.append("apply_replicate")
    elif v.ddp:
        calls.append(f"# {step}. data parallelism last: DDP"
                     + ("; the experts averaged among the ranks holding the "
                                                                         "same ones" if v.ep > 1
                        else ""))
        if v.ep > 1:
            calls.append("replicate_experts(part, experts_mesh[\"dp_mod_ep\"], dp=DP)  # DDP "
                         "leaves them alone")
            uses.append("replicate_experts")
        calls.append("# (DDP in main(): it broadcasts rank 0's weights, not made yet)"
                     if v.meta_init else
                     f"part = apply_ddp(part, {v.dp_mesh}.get_group(), device=device)")
        uses.append("apply_ddp")
    return calls


def parallelize_source(v: ScriptValues) -> tuple[str, list[str], set]:
    """``parallelize(model, mesh, device[, stage_ids, example])``: the runtime's technique functions
    called in torchtitan's order; the runtime names it calls and the imports it needs."""
    calls, uses, imports, plans = _technique_calls(v)
    head = ['def parallelize(model, mesh, device'
            + (', stage_ids, example):' if v.pp > 1 else '):'),
            '    """The plan applied to the pieces of the model this rank holds (one, or one per '
            'pipeline stage)."""',
            *("    " + line if line else "" for line in "\n".join(plans).splitlines()),
            *_whole_model_lines(v, uses)]
    if v.pp > 1:
        head += _stage_lines(v, uses)
        body = [f"        {c}" for c in calls] + ["        parts.append(part)",
                                                  "    return parts, shapes"]
    else:
        body = ["    part = model"] + [f"    {c}" for c in calls] + ["    return [part]"]
    return "\n".join(head + body), uses, imports


def _technique_calls(v: ScriptValues) -> tuple[list[str], list[str], set, list[str]]:
    """The techniques applied to each piece, numbered in their order: the lines, the runtime names
    they call, the imports they need and the TP plans (``parallelize``'s local variables)."""
    calls, uses, imports, plans = [], [], set(), []
    steps = iter(range(1, 20))  # the techniques' order, numbered in the comments
    if v.float8:  # before the fused loss replaces the head, which float8 keeps in bf16
        calls += [f"# {next(steps)}. float8 Linear layers (torchao), before the techniques that "
                  "wrap them", f"apply_float8(part, FLOAT8, device=device, fsdp={v.fsdp})"]
        uses.append("apply_float8")
    if v.fused_loss and v.pp == 1:  # pipelined: on the whole model, before the trace (below)
        calls += [f"# {next(steps)}. the output head fused with the loss (it never holds the full "
                  "logits), before the "
                  "techniques below",
                  "#    wrap the module that replaces it, which holds the same weight",
                  "apply_fused_loss(part, FUSED_LOSS)"]
        uses.append("apply_fused_loss")
    if v.tp > 1:
        plans, imports, tp_uses = tp_plans(v)
        tp_lines, tp_calls = tp_source(v, next(steps))
        calls += tp_lines
        uses += tp_uses + tp_calls
    if v.ep > 1:
        calls += _ep_lines(v, next(steps))
        uses += ["expert_mesh", "apply_ep"] + ["experts_in_stages"] * (v.pp > 1)
    if v.recompute:
        calls += [f"# {next(steps)}. activation checkpointing around whole layers, before FSDP so "
                  "that FSDP's "
                  "all-gathers stay", "#    outside the recomputed region",
                  "apply_ac(part, RECOMPUTE)"]
        uses.append("apply_ac")
    if v.compile:
        calls += [f"# {next(steps)}. torch.compile each block on its own (one graph reused by "
                  "every block of the same "
                  "shape), after",
                  "#    AC so that the checkpointed region is what is compiled, before FSDP so "
                  "that its hooks stay outside", "apply_compile(part, COMPILE)"]
        uses.append("apply_compile")
    calls += _data_parallel_lines(v, next(steps), uses)
    return calls, uses, imports, plans


def _ep_lines(v: ScriptValues, step: int) -> list[str]:
    """The lines of ``parallelize`` that apply expert parallelism (technique number ``step``)."""
    return [f"# {step}. expert parallelism: each experts module's experts split over "
            "EP consecutive "
            "data-parallel",
            "#    ranks, tokens sent to them by all-to-all; before AC wraps the modules and "
            "before data",
            "#    parallelism, which must leave the experts to the ranks that hold the same "
            "ones",
            "experts_mesh = expert_mesh(mesh, ep=EP)  # (pp, dp_mod_ep, ep, tp): dp split",
            "apply_ep(part, experts_mesh[\"ep\"], experts=EXPERTS"
            + (", stage=True)" if v.pp > 1 else ")")]


def _whole_model_lines(v: ScriptValues, uses: list[str]) -> list[str]:
    """What ``parallelize`` does to the whole model before any piece of it: the fused norms and,
    pipelined, the fused loss (the stages' graphs then call the fused ops)."""
    lines = []
    # on the whole model, before the pipeline's trace: the stages' graphs call the fused op
    if v.fused_norm:
        lines += ["    # the RMSNorms fused first (the same modules and weights, a new forward), "
                  "on the whole model: what the", "    # techniques below wrap"
                  + (" and the pipeline's trace records" if v.pp > 1 else ""),
                  "    apply_fused_norm(model)"]
        uses.append("apply_fused_norm")
    if v.pp > 1 and v.fused_loss:
        lines += ["    # the output head fused with the loss (it never holds the full logits), "
                  "before the trace: the "
                  "last stage", "    # holds it, ends at its input, and its loss runs it on that "
                                "input (StageLoss)",
                  "    apply_fused_loss(model, FUSED_LOSS)"]
        uses.append("apply_fused_loss")
    return lines


def _stage_lines(v: ScriptValues, uses: list[str]) -> list[str]:
    """The pipeline's stages cut from the traced model, and the loop over this rank's ones that
    the techniques run in."""
    # the traced whole model: read for the stages' boundary shapes
    whole = "whole" if v.static_shapes else "_"
    split = call("split_model", "model", boundaries="STAGE_BOUNDARIES", microbatch="example",
                 **({"loss_head": "FUSED_LOSS"} if v.fused_loss else {}),
                 **({"one_sequence_per_row": "True"} if v.cp > 1 else {}),
                 indent=len(f"    stages, {whole} = "))
    uses += ["split_model", "release_stages"] + (["boundary_values"] if v.static_shapes else [])
    return ["    # pipeline stages: trace the model on one micro-batch, cut it before each "
            "stage's first layer", f"    stages, {whole} = {split}",
            "    shapes = boundary_values(whole, stages, example)" if v.static_shapes else
            "    shapes = None  # not as traced: the stages infer what crosses their cuts",
            *["    experts_in_stages(model, stages, experts=EXPERTS)  # the model's, not "
              "traced"] * (v.ep > 1),
            "    release_stages(model, stages, keep=stage_ids)  # the other ranks' stages' "
            "weights: freed",
            "    parts = []", "    for part in [stages[i] for i in stage_ids]:"]
