"""Plain-words explanation of a chosen plan: what it is, why it beat the runner-up, what limits
it."""

from __future__ import annotations

import re

from .. import calibration
from ..cost.factors import factors_for
from ..cost.profile import profile_of
from ..cost.time import MFU_BASIS
from ..cost.tp_styles import LAYOUT_WORDS
from ..plan import RECOMPUTE
from ..units import fmt_bytes, fmt_delta, fmt_flops, fmt_time
from .constraints import sp_end, sp_refusal

GiB = 2**30


def _pct(a: float, b: float) -> str:
    return f"{100 * a / b:.0f}%" if b > 0 else "0%"


CPU_WAIT = "waiting for the CPU"
"""the step time the GPU waits for the host to issue work (``Cost.cpu_wait_s``)"""
TIME_DELTAS = (("compute", "compute_s"), ("exposed communication", "comm_exposed_s"),
               ("bubble", "bubble_s"), ("optimizer", "optimizer_s"), (CPU_WAIT, "cpu_wait_s"))
"""the step-time components a runner-up's difference is told in: (words, Cost field)"""

COMPONENT_SOURCES = {
    "params": "exact: the rank's parameter shards x their dtype's bytes",
    "grads": "exact: a gradient per local parameter alive at the peak",
    "optimizer": "exact: the optimizer's state per local parameter",
    "saved_activations": ("what autograd saves per layer (the captured graph), every micro-batch "
                          "in flight"),
    "loss_saved": "the loss's saved log-softmax",
    "autocast_weight_copies": "autocast's 16-bit copies of the weights",
    "ddp_buckets": "DDP's flat gradient buckets, the size of the parameters",
    "fsdp_unsharded_params": "FSDP's parameters kept unsharded from forward to backward",
    "fsdp_kept_params": "ZeRO-2's units kept gathered until the last accumulated micro-batch",
    "fsdp_root_params": "the parameters left in FSDP's root unit",
    "fsdp_gathered_units": "FSDP's unit being computed and the prefetched one",
    "fsdp_reduce_scatter": "the fp32 reduce-scatter input of the FSDP unit whose backward ran last",
    "fsdp_unsharded_grads": ("a pipelined FSDP stage's gradients, accumulated unsharded in fp32 "
                             "over its micro-batches and reduce-scattered after the last (torch's "
                             "PipelineStage)"),
    "pipeline_buffers": ("the buffers a pipeline stage receives inputs and gradients into, one "
                         "per micro-batch"),
    "pipeline_outputs": "a pipeline stage's outputs, kept until their micro-batch's backward",
    "pipeline_sent_gradients": ("the previous micro-batch's input gradients, held by the "
                                "schedule's send until this backward ends"),
    "weight_pass_gradients": ("the gradients a zero-bubble schedule's input pass keeps for each "
                              "micro-batch's weight pass (torch's stage_backward_input)"),
    "backward_working_set": "the largest layer's backward working set",
    "new_weight_gradients": ("the weight gradients a backward op makes where earlier "
                             "micro-batches' are accumulated, until autograd adds them in place "
                             "(torch's AccumulateGrad)"),
    "forward_working_set": ("the layer whose forward holds the most: its saved tensors so far and "
                            "the tensors alive then (output, operands still to be read, autocast's "
                            "copies)"),
    "fsdp_all_gather": "the all-gather output of the FSDP unit whose forward runs",
    "replicate_gathered_experts": ("the experts' parameters FSDP2's replicate (beside DDP) gathers "
                                   "in their forward and keeps to the end of their backward"),
    "replicate_reduce_buffers": ("the reduce-scatter input and all-reduce output of each experts "
                                 "module whose backward ran (FSDP2's replicate beside DDP), held "
                                 "to the end of the backward"),
    "ep_received_rows": "the rows expert parallelism's all-to-all delivered to a layer's experts",
    "cp_merge_copies": "context parallelism's merged attention outputs (output projections save)",
    "loss_temporaries": "the loss's logits and their copies",
    "optimizer_step_temporaries": "the optimizer step's temporaries"}
"""where each predicted memory component comes from (MemoryBreakdown fields and its MEMORY_TERMS),
for explain() and the planner widget's memory panel; the margin's is
``autopar_nb.calibration.margin_text``"""
COMPONENT_LABELS = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer states",
                    "margin": "allocator margin"}


def memory_components(mb, margin_source: str = "") -> list[dict]:
    """The named components of one rank's predicted peak (a MemoryBreakdown), largest first after
    the model state: ``[{"key", "label", "bytes", "source"}]`` — parameters, gradients, optimizer
    states, then each named term of its activations and buffers, then the allocator margin
    (``margin_source``: where its figure comes from)."""
    rows = [{
        "key": k, "label": COMPONENT_LABELS[k], "bytes": float(getattr(mb, k)),
        "source": COMPONENT_SOURCES[k]
    } for k in ("params", "grads", "optimizer")]
    rows += [{
        "key": k, "label": k.replace("_", " "), "bytes": float(v),
        "source": COMPONENT_SOURCES.get(k, "")
    } for k, v in sorted((mb.terms or {}).items(), key=lambda kv: -kv[1])]
    named = sum((mb.terms or {}).values())
    rest = mb.activations + mb.buffers - named
    if rest > 1e-6 * max(1.0, mb.total):  # a breakdown without named terms (an older plan)
        rows.append({"key": "other", "label": "activations and buffers", "bytes": float(rest),
                     "source": "not broken down by this plan"})
    rows.append({"key": "margin", "label": COMPONENT_LABELS["margin"], "bytes": float(mb.margin),
                 "source": margin_source
                 or "a fraction of the predicted bytes plus fixed workspaces"})
    return rows


def _margin_source(cluster) -> str:
    try:
        return calibration.margin_text(factors_for(cluster), getattr(cluster, "name", "") or "")
    except (AttributeError, TypeError, ValueError):
        return ""


def explain(plan, best, ranked, over, cons, cluster, prof) -> list[str]:
    """Lines for ``plan.explanation`` (see the module docstring). ``best`` is the chosen Candidate,
    ``ranked`` the feasible candidates in order, ``over`` a faster candidate that does not fit
    (None: none does), ``cons`` the user's constraints."""
    c, s = best.cost, best.setting
    lines = _step_lines(plan, c, cluster) + _memory_lines(c, best.limit, cluster)
    if s.tp > 1:
        lines += _tp_lines(plan, s, cons, prof)
    experts = {m: e for lp in prof.layers for m, e in lp.experts.items()}
    if experts:
        lines += _expert_lines(best, ranked, experts)
    if s.pp > 1:
        lines += _pipeline_lines(plan, best, prof)
    lines += _recompute_lines(plan, c, cons)
    if len(ranked) > 1:
        lines.append(_runner_up_line(best, ranked[1]))
    if over is not None:
        lines.append("Memory limits the plan: faster candidates do not fit, e.g. "
                     f"{_summary(over)}: {fmt_bytes(over.cost.peak_memory_bytes - best.limit)} "
                     "over.")
    lines += _limit_lines(c, best.limit)
    if cons.fix:
        lines.append("Fixed by you: " + ", ".join(f"{k}={v!r}" for k, v in cons.fix.items()) + ".")
    for t in cons.text:
        lines.append(f"Override honoured: {t}.")
    return lines + _calibrated_lines(cluster)


def _time_parts(c) -> list[tuple[str, float]]:
    """Where the step time goes: (words, seconds), compute first."""
    parts = [("compute", c.compute_s), ("exposed communication", c.comm_exposed_s),
             ("pipeline bubble", c.bubble_s), ("optimizer step", c.optimizer_s)]
    if c.cpu_wait_s > 0:
        parts.append((CPU_WAIT, c.cpu_wait_s))
    return parts


def _step_lines(plan, c, cluster) -> list[str]:
    """What the plan is and how fast, where its step time goes, and its communication by kind."""
    lines = [f"Chosen: {plan.summary()}; {fmt_flops(c.model_tflops_per_gpu * 1e12)} of the model "
             f"per GPU (MFU {100 * c.mfu:.0f}%, model FLOPs {MFU_BASIS}) on {cluster.world_size} x "
             f"{cluster.device.name}."]
    lines.append("Step time goes to "
                 + ", ".join(f"{n} {_pct(v, c.step_time_s)}" for n, v in _time_parts(c)) + ".")
    if c.comm_by_kind:
        kinds = ", ".join(f"{k} {fmt_time(v)}"
                          for k, v in sorted(c.comm_by_kind.items(), key=lambda kv: -kv[1]))
        lines.append(f"Communication per step (before overlap): {kinds}.")
    return lines


def _memory_lines(c, limit: float, cluster) -> list[str]:
    """The fullest pipeline rank's peak, by component, and where each figure comes from."""
    peak_rank = max(range(len(c.memory_by_rank)), key=lambda r: c.memory_by_rank[r].total)
    mb = c.memory_by_rank[peak_rank]
    lines = [f"Peak memory {fmt_bytes(c.peak_memory_bytes)} of {fmt_bytes(limit)} "
             f"({_pct(c.peak_memory_bytes, limit)}) on pipeline rank {peak_rank}: params "
             f"{fmt_bytes(mb.params)}, grads {fmt_bytes(mb.grads)}, optimizer "
             f"{fmt_bytes(mb.optimizer)}, activations {fmt_bytes(mb.activations)}, buffers "
             f"{fmt_bytes(mb.buffers)}, margin {fmt_bytes(mb.margin)}."]
    if mb.terms:
        terms = sorted(mb.terms.items(), key=lambda kv: -kv[1])
        lines.append("Activations and buffers there: "
                     + ", ".join(f"{k.replace('_', ' ')} {fmt_bytes(v)}" for k, v in terms)
                     + ".")
    lines.append("Where those figures come from: " + "; ".join(
        f"{r['label']}: {r['source']}" for r in memory_components(mb, _margin_source(cluster)))
                 + ".")
    return lines


def _tp_lines(plan, s, cons, prof) -> list[str]:
    """TP's degree and heads per rank, sequence parallel and loss_parallel (and why sequence
    parallel is off or ends early), its layouts, and the modules it keeps replicated or whole."""
    heads = sorted({h for lp in prof.layers for h in lp.heads})
    hs = f" ({', '.join(f'{h} heads -> {h // s.tp} per rank' for h in heads)})" if heads else ""
    lines = [f"TP={s.tp} inside a node{hs}; sequence parallel {'on' if s.sp else 'off'}; "
             f"loss_parallel {'on' if plan.loss_parallel else 'off'}."]
    if (not s.sp and (why := sp_refusal(prof, s.tp, plan.batch.seq_len))
        and "sequence_parallel" not in cons.fix):
        lines.append(f"Sequence parallel off because {why}.")
    elif s.sp and (why := sp_end(prof)):
        lines.append(f"{why[0].upper()}{why[1:]}.")
    lines += _layout_lines(plan, prof, s.tp)
    if prof.tp_refused:
        mods = sorted(prof.tp_refused)
        lines.append("Kept replicated under TP: "
                     f"{', '.join(mods[:3])}{', ...' if len(mods) > 3 else ''} "
                     f"({prof.tp_refused[mods[0]]}), with the Linears that read them.")
    return lines + _whole_lines(plan, prof)


def _runner_up_line(best, ru) -> str:
    """How much slower (or faster, then roomier) the runner-up ``ru`` is, by time component, and
    which global choices it makes differently."""
    c, rc = best.cost, ru.cost
    diff = _setting_diff(ru.setting, best.setting)
    deltas = [(n, getattr(rc, a) - getattr(c, a)) for n, a in TIME_DELTAS]
    why = ", ".join(f"{fmt_delta(d)} {n}" for n, d in sorted(deltas, key=lambda kv: -abs(kv[1]))
                    if abs(d) > 0.005 * c.step_time_s)
    return (f"Runner-up: {_summary(ru)} is "
            f"{_pct(abs(rc.step_time_s - c.step_time_s), c.step_time_s)} "
            + ("slower" if rc.step_time_s >= c.step_time_s else "faster (see Headroom)")
            + (f" ({why})" if why else "")
            + (f"; it uses {', '.join(diff)}" if diff else "") + ".")


def _limit_lines(c, limit: float) -> list[str]:
    """What limits the plan: memory when nearly full, then the largest part of the step besides
    compute (the host's issue time, told by part), or compute itself."""
    dominant = max(_time_parts(c)[1:], key=lambda kv: kv[1])
    lines = []
    if c.peak_memory_bytes > 0.9 * limit:
        lines.append(f"Memory is the binding constraint: {_pct(c.peak_memory_bytes, limit)} of the "
                     "device is used.")
    if dominant[0] == CPU_WAIT and dominant[1] > 0.15 * c.step_time_s:
        lines.append(_cpu_bound_line(c))
    elif dominant[1] > 0.15 * c.step_time_s:
        lines.append(f"What limits it most besides compute: {dominant[0]} "
                     f"({_pct(dominant[1], c.step_time_s)}).")
    else:
        lines.append(f"Compute-bound ({_pct(c.compute_s, c.step_time_s)} of the step): going "
                     "faster needs more GPUs or better kernel efficiency, not a different split.")
    return lines


def _pipeline_lines(plan, best, prof) -> list[str]:
    """The pipeline's ranks, chunks, micro-batches, layers per stage and bubble, and the layers no
    stage starts at."""
    c, s = best.cost, best.setting
    per_stage = [len(x) for x in plan.stage_layers()]
    shown = str(per_stage) if len(per_stage) <= 12 else (
        f"{min(per_stage)}-{max(per_stage)} (first {per_stage[0]}, last {per_stage[-1]})")
    return [f"Pipeline: {s.pp} ranks x {s.virtual_stages} chunk(s), {s.micro_batches} "
            f"micro-batches of {s.mb_samples:g} ({s.schedule}); layers per stage {shown}, balanced "
            f"by time; bubble {_pct(c.bubble_s, c.step_time_s)} of the step."] + [
        f"No stage starts at {prof.layers[i].path}, which stays with {prof.layers[i - 1].path}: "
        f"{why}." for i, why in list(prof.pp_glued.items())[:3]]


def _calibrated_lines(cluster) -> list[str]:
    """Where the step times' factors come from, when the cluster carries measured ones
    (``calibration.apply``)."""
    held = getattr(cluster, "calibration", None) or {}
    if not any(k in held for k in calibration.SPEED_KEYS):
        return []
    text = calibration.speed_text(getattr(cluster, "name", "") or "")
    return [text] if text else []


def _cpu_bound_line(c) -> str:
    """Why a CPU-bound step takes what it does: the host's time issuing it, by part
    (``cost/cpu.py``)."""
    by_part = sorted(c.cpu_by_part.items(), key=lambda kv: -kv[1])
    parts = ", ".join(f"{k} {fmt_time(v)}" for k, v in by_part if v)
    gpu = c.step_time_s - c.cpu_wait_s
    return (f"CPU-bound: the host takes {fmt_time(c.cpu_s)} to issue a step ({parts}), the GPU "
            f"runs it in {fmt_time(gpu)}, so it waits {_pct(c.cpu_wait_s, c.step_time_s)} of the "
            "step. Fewer wrappers (DDP rather than FSDP or TP), more work per op (larger "
            "micro-batches) or fewer ops (torch.compile, CUDA graphs) go faster; more GPUs do not.")


def _layout_lines(plan, prof, tp: int) -> list[str]:
    """One line per TP layout beyond an even cut (``LayerPlan.tp_parts``): fused projections split
    part by part or gathered, key/value projections repeated, head-indexed embeddings split by
    heads, projections a split attention shares; modules of repeated blocks named once
    (``h.*.attn.c_attn``)."""
    found: dict[str, dict[str, list]] = {}
    whole_query = 0.0
    for lp, prof_lp in zip(plan.layers, prof.layers, strict=True):
        block = re.sub(r"\d+$", "*", lp.path)  # h.3 -> h.*
        for m, parts in lp.tp_parts.items():
            name = block + m[len(lp.path):] if m.startswith(lp.path) else m
            kind = "shared" if lp.tp.get(m) == "shared" else prof_lp.layout(m, tp)
            kind = "multi_query" if kind == "repeated" and len(parts) > 1 else kind
            found.setdefault(kind, {}).setdefault(name, []).append((m, parts))
            # the query rows' bytes a split would divide
            if kind == "multi_query" and m in prof_lp.repeatable:
                whole_query += prof_lp.repeatable[m].grad_bytes * max(parts) / sum(parts) * (
                    tp - 1) / tp

    def names(kind: str) -> str:
        mods = [f"{m if len(seen) > 1 else seen[0][0]} {seen[0][1]}"
                for m, seen in found[kind].items()]
        return ", ".join(mods[:3]) + (f", ... ({len(mods)} in all)" if len(mods) > 3 else "")

    out = []
    if "packed" in found:
        out.append(f"Fused projections {LAYOUT_WORDS['packed']} (parts in heads or features): "
                   f"{names('packed')}; rank r holds slice r of every part (a _StridedShard), so "
                   "the model's own split/chunk cuts each rank's pieces right, and they cost what "
                   "separate projections would.")
    if "gathered" in found:
        out.append(f"Fused projections {LAYOUT_WORDS['gathered']} (parts of different widths, "
                   f"which no DTensor placement holds): {names('gathered')}; the weight is split "
                   "as one block and its output all-gathered, so the attention runs whole on every "
                   "rank (its FLOPs and activations not divided) and the projection after it reads "
                   "the whole result.")
    if "repeated" in found:
        out.append(f"Key/value projections {LAYOUT_WORDS['repeated']} (fewer heads than tp={tp}): "
                   f"{names('repeated')}; each rank holds the whole weight and keeps the head its "
                   "query heads read, their gradients all-reduced once per step.")
    if "multi_query" in found:
        parts = next(iter(found["multi_query"].values()))[0][1]
        out.append("Fused multi-query projections (query heads, then key/value heads fewer than "
                   f"tp={tp}): {names('multi_query')}; a key/value head cannot be split over {tp} "
                   "ranks, so it is repeated and the query heads are split: each rank holds the "
                   "whole weight, computes the whole projection and keeps its share of the query "
                   "heads with the key/value head they read (the attention and the projection "
                   "after it run split by heads), the weight's gradient all-reduced once per "
                   f"step. Its query rows ({max(parts)} of {sum(parts)} heads) stay whole too: one "
                   "DTensor is split or whole, not both, and two parameters would rename the "
                   f"weight in checkpoints and Hugging Face files: {fmt_bytes(whole_query)} more "
                   "parameters on each rank than split query rows (their gradients and optimizer "
                   "states alike, unless ZeRO shards them).")
    if "split" in found:
        out.append(f"Head-indexed tables {LAYOUT_WORDS['split']} like the attention scores they "
                   f"are added to: {names('split')}.")
    if "shared" in found:
        out.append("Projections kept whole whose output a split attention's heads share (features "
                   f"[before, shared, after]): {names('shared')}; every head reads the shared "
                   "piece (MLA's rope key), so its gradient is all-reduced over the TP ranks in "
                   "backward.")
    per_head = sorted({re.sub(r"\.\d+\.", ".*.", m) for lp in plan.layers for m, st in lp.tp.items()
                       if st == "per_head"})
    if per_head:
        out.append(f"Norms inside each head of a split attention: {', '.join(per_head[:3])}; each "
                   "rank normalises its own heads with the whole weight (SequenceParallel on the "
                   "heads dim), whose gradient is all-reduced over the TP ranks.")
    return out


def whole_under_tp(plan, prof) -> dict[str, str]:
    """Module -> why, for every Linear or Embedding of the graph that ``plan``'s TP leaves whole
    (replicated) in a layer it splits something else in, or in a model it splits nowhere else; the
    modules of repeated blocks named once (``h.*.attn.c_attn``)."""
    out: dict[str, str] = {}
    split_anywhere = any(st not in ("replicate", "shared", "per_head") for lp in plan.layers
                         for st in lp.tp.values())
    for lp in plan.layers:
        for m, why in prof.tp_whole.items():
            if ((m == lp.path or m.startswith(lp.path + "."))
                    and lp.tp.get(m, "replicate") == "replicate" and (lp.tp or not split_anywhere)):
                out.setdefault(re.sub(r"\.\d+(?=\.|$)", ".*", m) if m != lp.path else m,
                               why or "no cause recorded")
    return out


def whole_notes(graph, plan) -> dict[str, str]:
    """Layer path -> " · dense whole: why" for the Linears TP leaves whole in it
    (:func:`whole_under_tp`), and " · whole sequence: why" for the layer that gathers the sequence
    where sequence parallelism ends before the model's output, for the widget's layer table; {}
    without TP."""
    if plan.mesh.tp < 2:
        return {}
    prof = profile_of(graph)
    whole = whole_under_tp(plan, prof)
    out: dict[str, str] = {}
    for layer in graph.layers:
        block = re.sub(r"\.\d+(?=\.|$)", ".*", layer.path)
        for m, why in whole.items():
            if m == block or m.startswith(block + "."):
                out[layer.path] = out.get(layer.path, "") + (f" · {m.rsplit('.', 1)[-1]} whole: "
                                                             f"{why}")
    if prof.sp_gather is not None and any(lp.sequence_parallel for lp in plan.layers):
        path = prof.layers[prof.sp_gather].path
        out[path] = out.get(path, "") + f" · whole sequence: {sp_end(prof)}"
    return out


def _whole_lines(plan, prof) -> list[str]:
    """One line naming the modules TP leaves whole inside the layers it splits, each with why."""
    whole = whole_under_tp(plan, prof)
    if not whole:
        return []
    items = [f"{m} ({why})" for m, why in whole.items()]
    return [f"Kept whole under TP: {'; '.join(items[:4])}"
            + (f"; ... ({len(items)} in all)" if len(items) > 4 else "") + "."]


def _recompute_lines(plan, c, cons) -> list[str]:
    """Where recompute is on and whose choice it was: the planner's (to fit memory) or the user's
    (``fix`` for every layer, or an override pinning a layer); with the extra FLOPs it costs."""
    fixed = cons.fix.get("recompute")
    auto = [lp.recompute for lp in plan.layers if "recompute" not in lp.pinned and fixed is None]
    mine = [lp for lp in plan.layers if ("recompute" in lp.pinned or fixed is not None)
            and lp.recompute != "none"]
    lines = []
    if any(r != "none" for r in auto):
        kinds = ", ".join(f"{k} on {auto.count(k)}" for k in RECOMPUTE if k != "none"
                          and auto.count(k))
        lines.append(f"Recompute chosen to fit memory: {kinds} of the {len(auto)} layers you left "
                     "to the planner.")
    if mine:
        paths = [lp.path for lp in mine]
        shown = ", ".join(paths[:4]) + (f", ... ({len(paths)} layers)" if len(paths) > 4 else "")
        how = " and ".join(([f"fix recompute={fixed!r}"] if fixed is not None else [])
                           + (["override"] if any("recompute" in lp.pinned for lp in mine) else []))
        kinds = sorted({lp.recompute for lp in mine}, key=RECOMPUTE.index)
        lines.append(f"Recompute {'/'.join(kinds)} is your choice ({how}): {shown}.")
    if lines:
        extra = _pct(c.hardware_tflops_per_gpu - c.model_tflops_per_gpu, c.model_tflops_per_gpu)
        lines[-1] = lines[-1][:-1] + f"; recompute costs {extra} extra FLOPs."
    return lines


def _expert_lines(best, ranked, experts: dict[str, int]) -> list[str]:
    """Whether the experts are split (expert parallelism) and what the other choice would cost: the
    fastest feasible candidate with the other answer."""
    s, c = best.setting, best.cost
    counts = sorted(set(experts.values()))
    each = "/".join(map(str, counts))
    if s.ep > 1:
        edp = s.dp // s.ep
        line = (f"Expert parallelism ep={s.ep}: the {each} experts of each of the {len(experts)} "
                f"experts modules are split over {s.ep} consecutive data-parallel ranks "
                f"({'/'.join(str(n // s.ep) for n in counts)} per rank; {edp} rank(s) hold each "
                "expert and average its gradients), so expert parameters, gradients and optimizer "
                f"states are 1/{s.ep} per rank before ZeRO and their data-parallel traffic crosses "
                f"{edp} rank(s) instead of {s.dp}; the token all-to-alls cost "
                f"{fmt_time(c.comm_by_kind.get('all_to_all', 0.0))} per step, not overlapped")
        other = next((r for r in ranked if r.setting.ep == 1), None)
    else:
        line = (f"Experts kept whole on every rank (ep=1; {len(experts)} experts modules of {each} "
                "experts)")
        other = next((r for r in ranked if r.setting.ep > 1), None)
    if other is None:
        why = ("no plan without expert parallelism fits in memory" if s.ep > 1 else
               "no expert-parallel plan was costed: none fits or applies (expert parallelism runs "
               "beside data parallelism only, tp = 1, over a degree that divides the experts and "
               "dp), or the search skipped them, bound to be slower than the plans it kept")
        return [f"{line}; {why}."]
    oc = other.cost
    deltas = [(n, getattr(oc, a) - getattr(c, a)) for n, a in TIME_DELTAS]
    why = ", ".join(f"{fmt_delta(d)} {n}" for n, d in sorted(deltas, key=lambda kv: -abs(kv[1]))
                    if abs(d) > 0.005 * c.step_time_s)
    return [f"{line}; the best plan "
            f"{'without expert parallelism' if s.ep > 1 else 'with expert parallelism'}, "
            f"{_summary(other)}, is {_pct(oc.step_time_s - c.step_time_s, c.step_time_s)} slower"
            + (f" ({why})" if why else "") + "."]


def _summary(cand) -> str:
    s, c = cand.setting, cand.cost
    out = (f"dp={s.dp} tp={s.tp} pp={s.pp}" + (f" cp={s.cp}" if s.cp > 1 else "")
           + f" zero={s.zero_stage}" + (f" ep={s.ep}" if s.ep > 1 else ""))
    if s.pp > 1:
        out += f" {s.schedule}x{s.micro_batches}"
    elif s.micro_batches > 1:
        out += f" accum x{s.micro_batches}"
    if s.fused_loss:
        out += " fused-loss"
    return out + f" ({fmt_time(c.step_time_s)}, {fmt_bytes(c.peak_memory_bytes)})"


def _setting_diff(a, b) -> list[str]:
    """Global choices that differ between two candidates (cheap: no layer-by-layer diff)."""
    names = ("dp", "tp", "pp", "ep", "zero_stage", "micro_batches", "schedule", "virtual_stages",
             "sp", "amp", "fused_loss")
    return [f"{n}={getattr(a, n)} instead of {getattr(b, n)}" for n in names
            if getattr(a, n) != getattr(b, n)]


def op_list_lines(best, cons, default_ev, graph) -> list[str]:
    """What the plan's op lists (``fix["fp32_ops"]`` / ``fix["low_precision_ops"]``) cost: the
    chosen setting's step time and peak with them, and with autocast's own lists (``default_ev``: an
    Evaluator of the profile without them), and how many of the model's ops each name reaches."""
    from ..cost.autocast import ops_named

    lists = {k: cons.fix.get(k) or [] for k in ("fp32_ops", "low_precision_ops")}
    if not any(lists.values()) or best.setting.amp == "none":
        return []
    named = "; ".join(
        f"{label} {', '.join(f'{op} ({ops_named(graph, op)} ops)' for op in lists[k])}"
        for k, label in (("fp32_ops", "kept in float32:"), ("low_precision_ops",
                                                            "in low precision:")) if lists[k])
    c, d = best.cost, default_ev.evaluate(best.setting, best.choices)
    return [f"Op lists ({named}): {fmt_time(c.step_time_s)}/step and "
            f"{fmt_bytes(c.peak_memory_bytes)} peak, against {fmt_time(d.step_time_s)} and "
            f"{fmt_bytes(d.peak_memory_bytes)} with autocast's own lists "
            f"({(c.step_time_s / d.step_time_s - 1) * 100:+.0f} % time; each op costed at the "
            "dtype it runs in)."]
