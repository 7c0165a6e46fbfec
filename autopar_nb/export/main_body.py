"""The body of the exported script's ``main``: data, loss, the model built (or left on meta),
``parallelize``, the optimizer, what each forward and backward runs under, the pipeline schedule or
gradient accumulation, and ``train``.
"""

from __future__ import annotations

from ..source import ModelSource
from .cell import weights_lines, whole_weights_lines
from .literals import call
from .values import ScriptValues


def main_source(v: ScriptValues, source: ModelSource, *,
                telemetry: bool = True) -> tuple[str, list[str]]:
    """The body of ``main``'s ``try`` (or ``with distributed()``): data, parallelize, optimizer,
    forward/backward, train; and the runtime names it calls. ``telemetry``: ``train`` is handed
    ``main``'s metrics and observer."""
    uses = [
        "init_distributed", "build_mesh", "Metrics", "parameters_of", "build_optimizer", "train",
        "print_parameter_counts"
    ] + ["buffers_to"] * v.offload
    mv, ind = source.model_var, 8
    batches, loss = _batches_and_loss(v, source, ind, uses)
    lines = ["dp_rank = mesh[\"dp\"].get_local_rank()", f"loss = {loss}"]
    if not (v.dataset and v.pp > 1):  # else after the stage ids
        lines.append(f"make_batch_fn = {batches}")
    if v.kv_cache:
        lines.append(f"switch_off_kv_cache({mv})  # Hugging Face's key/value cache: training never "
                     "reads it")
        uses.append("switch_off_kv_cache")
    if v.meta_init:
        lines += [f"skeleton = copy.deepcopy({mv})  # unsharded, on meta: the initialisation below "
                  "reads it", f"net = {mv}"]
        uses.append("materialize")
    else:
        lines += [*whole_weights_lines(v, mv),
                  f"net = {mv}" + ("  # on the host: FSDP offloads its parameters there"
                                                                 if v.offload else ".to(device)")]
    if v.pretrained:
        uses.append("load_pretrained")
    if v.sync_batchnorm:
        lines.append("net = apply_sync_batchnorm(net, mesh[\"dp\"].get_group(), device=device)  # "
                     "plan.sync_batchnorm")
        uses.append("apply_sync_batchnorm")
    if v.fp32_ops or v.low_precision_ops:
        lines.append("# plan.precision's op lists, beyond autocast's own")
        lines.append("op_lists = " + call("functools.partial", "OpPrecision", "device", "AMP_DTYPE",
                                          **({"fp32_ops": "FP32_OPS"} if v.fp32_ops else {}),
                                          **({"low_precision_ops": "LOW_PRECISION_OPS"}
                                             if v.low_precision_ops else {}),
                                          indent=11, width=120 - ind))
        uses.append("OpPrecision")
    lines.append("# what each forward and backward runs under (autocast, loss_parallel)")
    lines.append("context = " + call("functools.partial", "step_context", "device",
                                     **({"amp_dtype": "AMP_DTYPE"} if v.amp != "none" else {}),
                                     **({"op_lists": "op_lists"} if v.fp32_ops
                                        or v.low_precision_ops else {}),
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
        lines += ["# data parallelism last: DDP, once the weights are real (it broadcasts rank 0's "
                  "when it wraps; meta has none)",
                  f"parts = [apply_ddp(part, {v.dp_mesh}.get_group(), device=device) for part in "
                  "parts]"]
    lines.append("optimizer = "
                 + call("build_optimizer", "parameters_of(parts)", "OPTIMIZER", lr="args.lr",
                        weight_decay="WEIGHT_DECAY", betas="BETAS", indent=12, width=120 - ind,
                        # offload: a fused CPU step
                        **({"fused": "True"} if v.offload else {})))
    scaler = "None"
    if v.amp == "fp16":
        uses.append("grad_scaler")
        lines.append("scaler = " + call("grad_scaler", "device", init_scale="INIT_LOSS_SCALE",
                                        dynamic="DYNAMIC_LOSS_SCALE",
                                        growth_interval="GROWTH_INTERVAL", sharded=str(v.fsdp),
                                        indent=9, width=120 - ind))
        scaler = "scaler"
    lines += _schedule_lines(v, context, scaler, ind, uses)
    lines += ["if args.dry_run:", "    print_parameter_counts(parts)", "else:",
              "    " + _train_call(v, scaler, telemetry, width=120 - ind), *_save_hf(v, mv, uses)]
    return "\n".join(" " * ind + line for line in "\n".join(lines).splitlines()), uses


def _batches_and_loss(v: ScriptValues, source: ModelSource, ind: int,
                      uses: list[str]) -> tuple[str, str]:
    """Where ``main``'s batches come from (the cell's ``make_batch``, a DataStream over its dataset,
    or synthetic ids) and the loss it trains, as source for ``main``'s body at indent ``ind``."""
    if source.make_batch_var:
        batches = source.make_batch_var
    elif v.dataset:  # a DataLoader over the data-parallel ranks: see runtime/data.py DataStream
        batches = call("DataStream", source.dataset_var, batch_size="BATCH_SIZE",
                       dp="mesh[\"dp\"].size()", dp_rank="dp_rank",
                       **({"collate_fn": source.collate_fn_var} if v.collate_fn else {}),
                       seed="SEED", num_workers="args.num_workers", pin_memory="device == \"cuda\"",
                       prefetch_factor="args.prefetch_factor", indent=len("make_batch_fn = "),
                       width=120 - ind - 4 * (v.pp > 1))  # under an ``if`` with pipelining
        uses += ["DataStream", "default_num_workers"]
    else:
        batches = call("functools.partial", "synthetic_batch", source.inputs_var,
                       batch_size="BATCH_SIZE", int_high="INT_HIGH", indent=len("make_batch_fn = "),
                       width=120 - ind)
        uses.append("synthetic_batch")
    if source.loss_fn_var:
        loss = source.loss_fn_var
    elif v.cp > 1:  # the default loss on this rank's part of each sequence (runtime/cp.py)
        loss = ("functools.partial(sequence_loss, "
                "cp=CP") + f", positions=takes_positions({source.model_var})" * (v.pp > 1) + ")"
        uses += ["sequence_loss", "sequence_shards"] + ["takes_positions", "shard_of"] * (v.pp > 1)
    else:
        loss = (f"functools.partial({'fused_default_loss' if v.fused_loss else 'default_loss'}, "
                "causal=CAUSAL)")
        uses.append("fused_default_loss" if v.fused_loss else "default_loss")
    return batches, loss


def _schedule_lines(v: ScriptValues, context: str, scaler: str, ind: int,
                    uses: list[str]) -> list[str]:
    """``main``'s ``forward_backward``: the pipeline schedule over this rank's stages, or gradient
    accumulation (under cp, on each micro-batch's part of the sequences); and ``counts_loss``, the
    ranks whose loss is logged."""
    lines: list[str] = []
    if v.pp > 1:
        lines += ["stages = ["
                  + call("build_stage", "part", "i", "NUM_STAGES", device="torch.device(device)",
                         pp_group="mesh[\"pp\"].get_group()", values="shapes", indent=10,
                         width=120 - ind),
                  "          for part, i in zip(parts, ids, strict=True)]",
                  "stage_loss = StageLoss(loss)  # the cell's loss on the last stage",
                  "schedule = " + call("build_schedule", "stages", schedule="SCHEDULE",
                                       n_microbatches="MICRO_BATCHES",
                                       loss_fn="stage_loss", indent=11, width=120 - ind),
                  "forward_backward = "
                  + call("functools.partial", "pipeline_step", "schedule", "stage_loss",
                         micro_batches="MICRO_BATCHES", has_first="0 in ids",
                         has_last="NUM_STAGES - 1 in ids", device="device", context=context,
                         **({"shard": "shard"} if v.cp > 1 else {}), indent=19, width=120 - ind),
                  "counts_loss = NUM_STAGES - 1 in ids and mesh[\"tp\"].get_local_rank() == 0",
                  *(["tied = TiedGradients(parts, TIES, mesh)  # an embedding and its head on "
                     "different stages"]
                    if v.ties else [])]
        if v.ties:
            uses.append("TiedGradients")
    else:
        uses.append("accumulate")
        if v.cp > 1:
            lines += ["# context parallelism: each micro-batch's sequences split over the cp "
                      "ranks, a ring attention",
                      "shard = functools.partial(sequence_shards, mesh[\"cp\"], causal=CAUSAL)"]
        lines += ["forward_backward = " + call("functools.partial", "accumulate", "parts[0]",
                                               micro_batches="MICRO_BATCHES", loss_fn="loss",
                                               context=context, scaler=scaler,
                                               zero_stage="ZERO_STAGE",
                                               **({"shard": "shard"} if v.cp > 1 else {}),
                                               indent=19, width=120 - ind),
                  "counts_loss = mesh[\"tp\"].get_local_rank() == 0  # one loss per model replica"]
    return lines


def _pipeline_lines(v: ScriptValues, source: ModelSource, batches: str,
                    uses: list[str]) -> list[str]:
    """``main``'s lines before a pipelined ``parallelize``: the stages held here, the batches (on
    the end stages only, from a dataset), the micro-batch the stages are traced on (under cp, this
    rank's part of it)."""
    trace = "example = model_call(loss, " + ("shard_of(shard, {}))" if v.cp > 1 else "{})")
    uses += ["stage_ids", "split_batch", "to_device", "model_call", "build_stage", "StageLoss",
             "build_schedule", "pipeline_step"]
    lines = ["ids = stage_ids(mesh[\"pp\"].get_local_rank(), PP, NUM_STAGES, SCHEDULE)  # the "
             "stages held here"]
    if v.cp > 1:
        lines += ["# context parallelism: sequences split over the cp ranks before the schedule "
                  "splits the batch",
                  "shard = functools.partial(sequence_shards, mesh[\"cp\"], causal=CAUSAL, "
                  "per_sample=True)"]
    if v.dataset:  # only the first stage (inputs) and the last (targets) read samples
        first = call("first_batch", source.dataset_var, batch_size="BATCH_SIZE",
                     **({"collate_fn": source.collate_fn_var} if v.collate_fn else {}))
        lines += ["make_batch_fn = None  # a stage between the first and the last reads no data",
                  "if 0 in ids or NUM_STAGES - 1 in ids:  # the first stage takes the inputs, the "
                  "last the targets", "    make_batch_fn = " + batches.replace("\n", "\n    "),
                  "# every stage traces its part of the model on the dataset's first samples",
                  f"first = {first}",
                  trace.format("split_batch(to_device(first, device), MICRO_BATCHES)[0]")]
        uses.append("first_batch")
    else:
        lines.append(trace.format("split_batch(to_device(make_batch_fn(0, dp_rank), device), "
                                  "MICRO_BATCHES)[0]"))
    lines += ["parts, shapes = parallelize(net, mesh, device, ids, example)",
              ("del example, first" if v.dataset else "del example")
              + "  # (a whole batch): not held for the run"]
    return lines


def _train_call(v: ScriptValues, scaler: str, telemetry: bool, *, width: int) -> str:
    """``train(...)`` as ``main`` calls it: the one-file script hands it its metrics stream and
    verify's observer, which the two-file script's runtime module holds itself
    (``runtime/metrics.py``'s ``Run``)."""
    notebook = {"metrics": "metrics", "observer": "observer"} if telemetry else {}
    return call("train", "args", "parts", "optimizer", forward_backward="forward_backward",
                make_batch="make_batch_fn", dp_rank="dp_rank", device="device",
                dp="mesh[\"dp\"].size()", counts_loss="counts_loss", **notebook, scaler=scaler,
                pp_group="mesh[\"pp\"].get_group()" if v.pp > 1 else "None",
                **({"tied": "tied"} if v.pp > 1 and v.ties else {}), tokens=str(v.tokens),
                **({"cp": "CP"} if v.cp > 1 else {}), indent=4, width=width)


def _save_hf(v: ScriptValues, model_var: str, uses: list[str]) -> list[str]:
    """``main``'s lines for ``--save-hf`` (a pretrained Hugging Face model): the trained weights in
    its format."""
    if not v.save_hf:
        return []
    uses.append("save_hf")
    ties = ", ties=TIES" if v.ties else ""
    return ["    if args.save_hf:  # the trained weights as from_pretrained reads them",
            f"        save_hf(args.save_hf, parts, {model_var}{ties})"]
