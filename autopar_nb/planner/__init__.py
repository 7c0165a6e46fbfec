"""The automatic planner: ``plan(graph, cluster, ...) -> Plan``.

Pipeline: :mod:`.constraints` parses ``fix``/``overrides``; :mod:`.search` enumerates and costs
candidates with :class:`autopar_nb.cost.Evaluator`, placing layers on pipeline stages with
:mod:`.stages` and choosing recompute with :mod:`.recompute`; :mod:`.explain` writes the
explanation. What is exact and what is heuristic is stated in :mod:`.search`.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import weakref
from collections import OrderedDict

from ..cost.estimate import Evaluator
from ..cost.loss import fused_head
from ..cost.norm import fused_norm_profile
from ..cost.profile import no_cycle_collection, profile_of
from ..plan import (
    DTYPE_NAMES,
    BatchPlan,
    LayerPlan,
    MeshPlan,
    OptimizerPlan,
    PipelinePlan,
    Plan,
    PlanError,
    PrecisionPlan,
    within,
)
from .async_tp import async_tp_choice, async_tp_lines
from .candidate import Candidate, memory_limit
from .compile import HORIZON_STEPS, compile_choice, compile_lines, horizon, startup_s
from .constraints import Constraints, parse
from .degrees import cp_degrees
from .experts import moe_capacity_lines
from .explain import explain, fmt_bytes, op_list_lines
from .float8 import float8_choice, float8_lines
from .forward import checked_profile, tp_parts
from .fused import fused_loss_lines, fused_norm_lines
from .lever_costs import set_levers
from .levers import headroom_lines, levered_variant, roomier
from .offload import checked_fixed, offload_lines, offload_search
from .per_rank import plan_per_rank
from .search import Search

__all__ = ["plan"]

GiB = 2**30


def plan(graph, cluster, *, global_batch: int | None = None, per_rank_batch: int | None = None,
         seq_len: int | None = None, fix: dict | None = None, overrides: dict | None = None,
         top_k: int = 5, default_loss: bool = True, steps: int | None = None) -> Plan:
    """Choose how to train ``graph`` on ``cluster``: mesh (DP x TP x PP), ZeRO stage, per-layer TP
    styles, sequence parallel, recompute, pipeline stages and schedule, micro-batches and mixed
    precision.

    ``global_batch``: samples per optimizer step (default: the captured batch). ``per_rank_batch``:
    instead, the samples each data-parallel rank trains on whatever dp (a cell's ``make_batch``):
    each dp is planned at its own global batch and the most samples per second wins
    (:mod:`.per_rank`). ``seq_len``: tokens per sample if different from the captured inputs (costs
    scale linearly, attention scores quadratically). ``fix``: global choices to keep, e.g. ``{"tp":
    1, "zero_stage": 3, "recompute": "full"}``. ``overrides``: layer/module globs to per-layer
    choices, e.g. ``{"blocks.*.mlp": {"tp": "colwise-rowwise"}, "blocks.10": {"stage": 2}}``.
    ``default_loss``: the training loss is the default one (the cell defines no ``loss_fn``), so the
    output head may be fused with it (``plan.fused_loss``); False never fuses. ``steps``: the run's
    length, over which compile's start-up must pay back (default: :data:`.compile.HORIZON_STEPS`).

    Returns the fastest plan that fits in device memory, with ``cost`` filled, up to ``top_k - 1``
    next-best ``alternatives`` and an ``explanation`` (``plan.explain()``). Raises
    :class:`PlanError` naming the failing constraint (and by how much memory) when nothing satisfies
    the request.
    """
    kwargs = dict(seq_len=seq_len, fix=fix, overrides=overrides, top_k=top_k,
                  default_loss=default_loss, steps=horizon(steps))
    # the search makes millions of short-lived objects, and each pass of the collector's oldest
    # generation walks every object the graph holds (a fifth of the CPU time of planning the 1T GPT
    # shape on 3072 GPUs)
    with no_cycle_collection():
        if per_rank_batch:
            return plan_per_rank(_plan, graph, cluster, per_rank_batch, **kwargs)
        return _plan(graph, cluster, global_batch=global_batch, **kwargs)


_PLANS: OrderedDict[tuple[int, str], tuple[weakref.ref, Plan]] = OrderedDict()
"""(graph, request) -> the plan :func:`remembered_plan` made for it; the latest :data:`REMEMBERED`
are kept"""
REMEMBERED = 8


def remembered_plan(graph, cluster, **kwargs) -> Plan:
    """:func:`plan`, made once per graph and request: the planner is deterministic, so a session
    re-planning what it planned before (the magic re-run on an unchanged cell, whose capture is
    reused: ``capture/cache.py``) gets a copy. Calls of :func:`plan` itself always plan (tests
    change the planner's switches between them)."""
    key = (id(graph), json.dumps([repr(cluster), kwargs], sort_keys=True, default=repr))
    hit = _PLANS.get(key)
    if hit is not None and hit[0]() is graph:
        _PLANS.move_to_end(key)
        return copy.deepcopy(hit[1])
    made = plan(graph, cluster, **kwargs)
    _PLANS[key] = (weakref.ref(graph), copy.deepcopy(made))
    while len(_PLANS) > REMEMBERED:
        _PLANS.popitem(last=False)
    return made


def _plan(graph, cluster, *, global_batch: int | None = None, seq_len: int | None = None,
          fix: dict | None = None, overrides: dict | None = None, top_k: int = 5,
          default_loss: bool = True, steps: int = HORIZON_STEPS) -> Plan:
    """:func:`plan` for one global batch."""
    if top_k < 1:
        raise PlanError(f"top_k must be >= 1, got {top_k}")
    device_kind = "cpu" if cluster.name == "cpu" else "cuda"
    # every TP layout run once on stand-in tensors
    prof = checked_profile(graph, device_kind, cluster, fix)
    global_batch = int(global_batch or graph.batch_size)
    if global_batch < 1:
        raise PlanError(f"global_batch must be >= 1, got {global_batch}")
    seq_ratio = _seq_ratio(graph, seq_len)
    cons = parse(graph, prof, fix, overrides)
    default_prof = prof
    # they change the dtypes saved under AMP
    if cons.fix.get("fp32_ops") or cons.fix.get("low_precision_ops"):
        prof = profile_of(graph, device_kind, fp32_ops=cons.fix.get("fp32_ops", ()),
                          low_precision_ops=cons.fix.get("low_precision_ops", ()))
    head, fused_why = (fused_head(graph) if default_loss
                       else (None, "the cell defines its own loss_fn (the fused op computes the "
                                   "default next-token cross-entropy)"))
    norm_prof = None if cons.fix.get("fused_norm") is False else fused_norm_profile(
        graph, device_kind, fp32_ops=cons.fix.get("fp32_ops", ()),
        low_precision_ops=cons.fix.get("low_precision_ops", ()))
    ev = Evaluator(prof, cluster, seq_ratio=seq_ratio, head=head, norm_prof=norm_prof)
    search, found, cands = _searched(graph, prof, cluster, cons, ev, global_batch=global_batch,
                                     fused_why=fused_why, seq_len=seq_len or graph.seq_len,
                                     default_loss=default_loss, top_k=top_k)
    ranked, found = _ranked(cands, found, cluster, cons, top_k)
    ranked, (best, async_other) = _levered(
        ranked, lambda c: _with_levers(c, ev, cons, graph, search.compilable, steps, cluster),
        top_k)
    plans = [
        _to_plan(c, graph, prof, cluster, cons, global_batch, seq_len,
                 head=head.module if head else "") for c in ranked[:top_k]
    ]
    chosen = plans[0]
    chosen.alternatives = plans[1:]
    chosen.explanation = explain(chosen, best, ranked, found.over, cons, cluster, prof)
    chosen.explanation += _lever_lines(best, async_other, ev, cons, cluster, graph,
                                       search.compilable, steps, fused_why=fused_why)
    chosen.explanation += set_levers(chosen, best, ev, cluster, graph, search.compilable, steps)
    if prof is not default_prof:  # the op lists' price: the same setting with autocast's own lists
        chosen.explanation += op_list_lines(best, cons,
                                            Evaluator(default_prof, cluster, seq_ratio=seq_ratio,
                                                      head=head), graph)
    if best.setting.cp > 1:
        chosen.explanation.append(
            f"Context parallelism cp={best.setting.cp}: every sequence is split over "
            f"{best.setting.cp} ranks (torch's ring attention) because "
            + ("fix cp asks for it." if "cp" in cons.fix
               else "no plan without it fits in memory, recompute included."))
    return chosen


def _seq_ratio(graph, seq_len: int | None) -> float:
    """``seq_len`` over the captured inputs' tokens per sample (1 when not given)."""
    if seq_len is None:
        return 1.0
    if graph.seq_len is None:
        raise PlanError(f"seq_len={seq_len} given, but the captured inputs are not token "
                        "sequences (first input "
                        f"{graph.inputs[0].shape if graph.inputs else None})")
    return seq_len / graph.seq_len


def _searched(graph, prof, cluster, cons, ev, *, global_batch: int, fused_why: str,
              seq_len: int | None, default_loss: bool, top_k: int) -> tuple[Search, Search, list]:
    """(the search at the fixed context-parallel degree (1 unless fixed), the search whose
    candidates are kept: that one, or one that also tries every cp degree where nothing fits
    without, those candidates), each search run."""
    cps, cp_why = cp_degrees(prof, cluster, seq_len=seq_len,
                             why="" if default_loss
                             else "the cell defines its own loss_fn (each cp rank computes the "
                                  "default loss on its part)")
    fixed_cp = cons.fix.get("cp", 1)
    if fixed_cp > 1 and fixed_cp not in cps:
        raise PlanError(f"fix cp={fixed_cp}: "
                        + (cp_why or f"context parallelism needs a degree that divides the "
                                     f"world size {cluster.world_size} inside a node and "
                                     f"seq_len / 2 (possible: {cps})"))
    search = Search(graph, prof, cluster, cons, ev, global_batch=global_batch, fused_why=fused_why,
                    cps=(fixed_cp,))
    cands, found = search.run(top_k), search
    if cands and not any(c.fits for c in cands) and "cp" not in cons.fix and cps:
        # the activations of long sequences fit nowhere, recompute included: split the sequences
        # (ring attention); no candidate at all means the constraints refused every mesh, which a cp
        # share of the world cannot mend
        retry = Search(graph, prof, cluster, cons, ev, global_batch=global_batch,
                       fused_why=fused_why, cps=tuple(cps))
        try:
            if more := retry.run(top_k):
                cands, found = more, retry
        # the fixed choices leave no mesh with a cp share (fix dp=world): say why nothing fits
        except PlanError:
            pass
    if not cands:
        raise PlanError("no candidate plan: "
                        f"{'; '.join(dict.fromkeys(search.rejected)) or 'check fix/overrides'}")
    return search, found, cands


def _ranked(cands: list[Candidate], found: Search, cluster, cons: Constraints,
            top_k: int) -> tuple[list[Candidate], Search]:
    """(the candidates that fit and that the fixed choices allow, fastest first, the first of each
    key, the search they came from): ``found``'s, or where none fits a search with CPU offload
    (slow, only where nothing else fits); raises PlanError, by how much the smallest is over, when
    none of those fits either."""
    feasible = checked_fixed([c for c in cands if c.fits], cluster)
    if not feasible:
        feasible, found, why = offload_search(found, cons, top_k)
        if not feasible:
            raise PlanError(_no_fit_message(cands, cluster, cons) + why)
    feasible.sort(key=lambda c: (c.cost.step_time_s, c.setting.pp, c.setting.tp,
                                 c.setting.zero_stage))
    seen: set = set()
    # the first of each key
    return [c for c in feasible if not (c.key in seen or seen.add(c.key))], found


def _lever_lines(best, async_other, ev, cons, cluster, graph, compilable: list[bool], steps: int,
                 *, fused_why: str) -> list[str]:
    """The levers' lines of the explanation, each lever's choice and why: compile, headroom, the
    fused loss and RMSNorms, float8, async TP, CPU offload and the experts' capacity."""
    return (compile_lines(best, ev, cons, graph, compilable, steps) + headroom_lines(best)
            + fused_loss_lines(best, ev, cons, fused_why) + fused_norm_lines(best, ev, cons)
            + float8_lines(best, ev, cons, cluster)
            + async_tp_lines(best, async_other, cons, cluster) + offload_lines(best, cons, cluster)
            + moe_capacity_lines(best, ev, cons))


def _with_levers(cand, ev, cons, graph, compilable: list[bool], steps: int, cluster) -> tuple:
    """(``cand`` compiled, with float8 and async TP, each taken where it pays; async TP's other
    choice or None), or the same of its fused-loss / fused-RMSNorm variant where that takes less
    time over the ``steps`` (:func:`.levers.levered_variant`)."""
    def levered(c):
        c = float8_choice(compile_choice(c, ev, cons, graph, compilable, steps), ev, cons, cluster)
        return async_tp_choice(c, ev, cons, cluster)

    return levered_variant(cand, levered,
                           lambda c: c.cost.step_time_s * steps + startup_s(c, ev, graph))


def _levered(ranked: list, with_levers, k: int) -> tuple[list, tuple]:
    """(``ranked`` with its first ``k`` levered and ordered again, the fastest first;
    ``with_levers`` of that one). The search ranks without compile, float8 and async TP, which are
    chosen per plan afterwards, so every plan shown is levered before it is compared (a DDP plan
    ranked 23% slower than ZeRO-2 unlevered is 0.5% slower levered). They run with pp=1 only: where
    the first ``k`` are all pipelined, the fastest pp=1 candidate the search kept is levered too and
    leads when then faster (02_llm's 7B on 8 H100s: pp=2 at 3.37 s/step against dp=8 compiled with
    float8 at 2.57). The first is :func:`.levers.roomier` than the fastest where that is tight."""
    head = list(ranked[:k])
    flat = next((c for c in ranked if c.setting.pp == 1), None)
    if flat is not None and all(c is not flat for c in head):
        head.append(flat)
    done = [with_levers(c) for c in head]
    order = sorted(range(len(done)),
                   key=lambda i: (not done[i][0].fits, done[i][0].cost.step_time_s))
    first = roomier(done[order[0]][0], [d[0] for d in done])
    order.sort(key=lambda i: done[i][0] is not first)
    rest = [c for c in ranked[k:] if c is not flat]
    return [done[i][0] for i in order] + rest, done[order[0]]


def expert_patterns(graph, paths: list[str]) -> list[str]:
    """The experts modules ``paths`` as the script names them: one pattern per position inside a
    repeated block (``"model.layers.*.mlp.experts"``) when it names exactly those modules, else the
    paths themselves."""
    modules = [m for lay in graph.layers for m in lay.modules]
    out: list[str] = []
    for path in paths:
        block = next((b for lay in graph.layers if within(path, lay.path)
                      and (b := graph.block_of(lay.path))), None)
        layer = next((m for m in block.members if within(path, m)), None) if block else None
        pattern = f"{block.name}.*.{path[len(layer) + 1:]}" if layer and path != layer else path
        if pattern != path and {m for m in modules if fnmatch.fnmatchcase(m, pattern)} - set(paths):
            pattern = path  # the pattern would name more than the experts modules
        if pattern not in out:
            out.append(pattern)
    return out


def cluster_info(cluster) -> dict:
    """``Plan.cluster``: the preset, its size, and the per-rank memory limit when the user set one
    (a CPU launch enforces it)."""
    out = {"preset": cluster.name, "nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node}
    if getattr(cluster, "rank_memory", None) is not None:
        out["memory_limit_bytes"] = int(cluster.rank_memory)
    return out


def _no_fit_message(cands: list[Candidate], cluster, cons: Constraints) -> str:
    c = min(cands, key=lambda c: c.cost.peak_memory_bytes)
    limit = memory_limit(cluster)
    r = max(range(len(c.cost.memory_by_rank)), key=lambda j: c.cost.memory_by_rank[j].total)
    mb = c.cost.memory_by_rank[r]
    s = c.setting
    fixed = f" with fix {cons.fix}" if cons.fix else ""
    return (f"nothing fits in {fmt_bytes(limit)} per GPU{fixed}: the smallest candidate (dp={s.dp} "
            f"tp={s.tp} pp={s.pp}{f' cp={s.cp}' if s.cp > 1 else ''} zero={s.zero_stage}, "
            f"{s.micro_batches} micro-batch(es) of {s.mb_samples:g}) needs {fmt_bytes(mb.total)} "
            f"on pipeline rank {r}, {fmt_bytes(mb.total - limit)} over the memory limit (params "
            f"{fmt_bytes(mb.params)}, grads {fmt_bytes(mb.grads)}, optimizer "
            f"{fmt_bytes(mb.optimizer)}, activations {fmt_bytes(mb.activations)}, buffers "
            f"{fmt_bytes(mb.buffers)}, margin {fmt_bytes(mb.margin)}); use more GPUs, a smaller "
            "batch, or relax the fixed choices")


def _to_plan(c: Candidate, graph, prof, cluster, cons: Constraints, global_batch: int, seq_len, *,
             head: str = "") -> Plan:
    s = c.setting
    layers = []
    for i, (lay, ch) in enumerate(zip(graph.layers, c.choices, strict=True)):
        ov = cons.layers.get(i)
        tp: dict[str, str] = {}
        sp = False
        if s.tp > 1:
            if ch.tp:
                tp.update(prof.layers[i].tp)
                # beyond sp_last the runtime gathers: whole, replicated norms
                if s.sp and prof.sp_covers(i):
                    sp = True
                    for norm in prof.layers[i].norms:
                        tp[norm] = "sequence_parallel"
            if ov is not None:
                tp.update(ov.tp_styles)
            tp = {m: st for m, st in tp.items() if st != "replicate" or (ov and m in ov.tp_styles)}
        layers.append(LayerPlan(lay.path, stage=ch.stage, tp=tp,
                                tp_parts=tp_parts(prof.layers[i], tp, s.tp), sequence_parallel=sp,
                                fsdp=ch.fsdp, recompute=ch.recompute, compile=ch.compile,
                                pinned=ov.pinned if ov else []))
    half = s.amp != "none"
    dtype = DTYPE_NAMES.get(s.amp, "float32")
    precision = PrecisionPlan(amp=s.amp,
                              param_dtype=dtype if (half and s.zero_stage >= 1) else "float32",
                              reduce_dtype="float32", dynamic_loss_scale=s.amp == "fp16",
                              float8=s.float8,
                              **{k: cons.fix[k] for k in ("fp32_ops", "low_precision_ops")
                                 if k in cons.fix})
    head_tp = any(lp.vocab and any(st == "colwise" for st in lp.tp.values()) and ch.tp
                  for lp, ch in zip(prof.layers, c.choices, strict=True))
    return Plan(
        mesh=MeshPlan(s.dp, s.tp, s.pp, s.zero_stage, ep=s.ep, cp=s.cp, offload=s.offload,
                      moe_capacity=s.moe_capacity),
        batch=BatchPlan(global_batch, s.micro_batches, seq_len or graph.seq_len),
        pipeline=PipelinePlan(s.schedule, s.virtual_stages),
        precision=precision,
        optimizer=OptimizerPlan(name=s.optimizer),
        layers=layers,
        sync_batchnorm=s.dp > 1 and any(lay.type.startswith("BatchNorm") or "BatchNorm" in
                                        " ".join(lay.modules.values()) for lay in graph.layers),
        loss_parallel=s.vocab_parallel_loss(capable=prof.loss_parallel, head_tp=head_tp),
        fused_loss=head if s.fused_loss else "",
        fused_norm=s.fused_norm,
        async_tp=s.async_tp,
        experts=expert_patterns(graph, [m for lp in prof.layers for m in lp.experts]),
        model={"name": graph.model_type, "num_params": graph.num_params},
        cluster=cluster_info(cluster),
        cost=c.cost,
    )
