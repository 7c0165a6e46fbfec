"""The search: mesh factorisations x ZeRO stage x micro-batching x schedule, then per layer
(pipeline stage, recompute, TP on/off) under the memory limit.

What is exact and what is heuristic:

* **Exact (exhaustive)**: every mesh ``dp * tp * pp = world`` with TP inside a node dividing every
  head count and split Linear dim, PP <= layers, DP dividing the global batch; every ZeRO stage;
  1F1B and, where it applies, interleaved 1F1B with each of :data:`VIRTUAL_STAGES` chunks per rank
  that the layers allow; for a model with experts modules, every expert-parallel degree inside a
  node that divides dp and each module's number of experts (tp = 1: what the runtime runs).
  Configurations are costed in order of a lower bound on their step time and skipped once the bound
  exceeds the ``top_k``-th best feasible time, which never drops one of the ``top_k`` best.
* **Heuristic (sampled)**: micro-batch sizes: every divisor of the per-replica batch when there are
  at most 8, else the 4 largest and the 4 smallest.
* **Exact (optimal)**: pipeline stage boundaries minimise the slowest stage's time for the chosen
  per-layer costs: bisection on the bottleneck with a greedy maximal-prefix check (optimal for
  contiguous min-max partitions), or, when the user pins layers to stages, a dynamic programme over
  the layer chain.
* **Heuristic**: stages are balanced by time before recompute is chosen; recompute is then chosen
  per pipeline rank greedily (most activation bytes saved per second of recompute first: selective,
  then full) until the rank fits, and the plan is costed again. When a rank still does not fit
  (1F1B, no pins), the stages are balanced again by time subject to each rank's memory (the same
  bisection, the greedy check also capping each stage's bytes with every free layer at full
  recompute), then recompute is chosen again. Stage balancing ignores the optimizer step and
  point-to-point time. Repeated blocks are costed once (identical layers share their terms). The
  cost model itself is an analytic estimate (see ``autopar_nb.cost``).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import dataclass

from ..cost.estimate import Evaluator
from ..cost.floor import loss_fusable, memory_floor
from ..cost.norm import one_kernel
from ..cost.schedule import MULTI_STAGE, ZERO_BUBBLE
from ..cost.setting import LayerChoice, Setting
from ..cost.time import bubble_fraction
from ..plan import V_SCHEDULES, Cost, PlanError, stage_rank
from ..plan.vocab import MOE_CAPACITY
from .constraints import async_tp_modes, float8_fix, offload_fix, sequence_parallel
from .degrees import divisors, tp_blockers
from .recompute import choose_recompute
from .stages import memory_partition, partition, partition_runs
from .time_bound import applies, recompute_time_floor


@dataclass
class Candidate:
    """A costed candidate plan."""

    setting: Setting
    choices: list[LayerChoice]
    cost: Cost
    limit: float
    other: Candidate | None = None
    """the same setting with the loss fused where this one is not, or not fused where it is, when
    both were costed (``Search.fused_variant``): what the choice saved or would have saved"""
    norm_other: Candidate | None = None
    """the same setting with the other choice of fused RMSNorms, when both were costed
    (``Search.norm_variant``)"""
    origin: tuple | None = None
    """the (setting, choices) its variants were made from (``Search._variants``)"""
    roomier_than: Candidate | None = None  # a faster one, tight in memory (levers.roomier)

    @property
    def fits(self) -> bool:
        return self.cost.peak_memory_bytes <= self.limit

    @property
    def key(self) -> tuple:
        s = self.setting
        return (s.dp, s.tp, s.pp, s.zero_stage, s.micro_batches, s.schedule, s.virtual_stages, s.ep,
                s.cp)


VIRTUAL_STAGES = (2, 3, 4, 6, 8)
"""chunks per rank the looped schedules are tried with: a bubble of (pp - 1) / v stage-times shrinks
with v while each micro-batch crosses v times as many stage boundaries and each rank holds more
micro-batches in flight (the cost model prices both); Megatron-LM's SC21 runs and Llama 3's use up
to a few layers per chunk"""
LOOPED = tuple(s for s in MULTI_STAGE if s not in V_SCHEDULES)
"""schedules that run any number of chunks per rank (a V schedule runs two)"""

def _order(cand: Candidate, floor: float) -> tuple:
    """How :attr:`Search.over` is chosen among candidates: least bound on the step time, then time,
    then key."""
    return floor, cand.cost.step_time_s, cand.key


def memory_limit(cluster) -> float:
    """Bytes one rank may use (``Cluster.rank_memory_bytes``)."""
    return cluster.rank_memory_bytes


def default_amp(device) -> str:
    """The precision the planner picks unless one is fixed: bf16 where the device has it and it is
    faster than fp32, else fp16 where that is faster (V100, T4: loss scaling), else none (CPUs)."""
    fp32 = device.flops("float32")
    if device.supports("bfloat16") and device.flops("bfloat16") > fp32:
        return "bf16"
    return "fp16" if device.supports("float16") and device.flops("float16") > fp32 else "none"


def measured_compile_gain(cluster) -> bool:
    """Whether a compiled run on this cluster's preset measured compiled blocks faster than eager
    ones: its calibration holds ``compile_memory_bound`` (only compiled runs set it) below 1."""
    return cluster.calibration.get("compile_memory_bound", 1.0) < 1.0


FLOORS = True
"""Search.floors' default (internal: a test turns it off to compare)"""


class Search:
    """Enumerates and costs candidates (module docstring)."""

    def __init__(self, graph, prof, cluster, cons, ev: Evaluator, *, global_batch: int,
                 fused_why: str = "", cps: tuple[int, ...] = (1,)):
        self.graph, self.prof, self.cluster, self.cons, self.ev = graph, prof, cluster, cons, ev
        self.cps = cps
        """context-parallel degrees to try (:func:`cp_degrees`)"""
        self.fused_why = fused_why
        """why the output head and the loss cannot be fused ("" when ``ev.head`` can be)"""
        if cons.fix.get("fused_norm") and ev.norm_prof is None:
            raise PlanError("fix fused_norm=True, but the model has no RMSNorm module (a module "
                            "whose ops compute x * rsqrt(mean(x**2) + eps) * weight); drop "
                            "fused_norm from fix")
        if cons.fix.get("fused_loss") and ev.head is None:
            raise PlanError("fix fused_loss=True, but the output head and the loss cannot be "
                            f"fused: {fused_why}; drop fused_loss from fix")
        self.global_batch, self.limit, self.n, fix = (global_batch, memory_limit(cluster),
                                                      len(prof.layers), cons.fix)
        self.tp_on = [bool(lp.tp or lp.norms) for lp in prof.layers]  # norms: sequence parallel
        for i, ov in cons.layers.items():
            if ov.tp_styles and all(v == "replicate" for v in ov.tp_styles.values()) and \
                    set(ov.tp_styles) >= set(prof.layers[i].tp):
                self.tp_on[i] = False
        self.pins = {i: ov.stage for i, ov in cons.layers.items() if ov.stage is not None}
        self.glued = frozenset(prof.pp_glued) if cons.glued is None else cons.glued
        """layers no pipeline stage may start at (each stays in the stage of the layer before)"""
        self.starts = self.n - len(self.glued)
        """the most pipeline stages the model can hold: the layers a stage may start at"""
        self.rec_pinned = {i: ov.recompute for i, ov in cons.layers.items()
                           if ov.recompute is not None}
        # a fixed recompute mode applies to the repeated blocks (as Megatron-LM and torchtitan apply
        # it), or to every layer of a model without any: recomputing an embedding or a head saves
        # nothing worth a wrapper
        if "recompute" in fix:
            blocks = [i for i, lay in enumerate(graph.layers)
                      if graph.block_of(lay.path) is not None]
            for i in blocks or range(self.n):
                self.rec_pinned.setdefault(i, fix["recompute"])
        self.fsdp = [cons.layers[i].fsdp if i in cons.layers and cons.layers[i].fsdp is not None
                     else True for i in range(self.n)]
        # compile: per repeated block as torchtitan compiles them (or every layer of a model without
        # any), with pp=1 only (a pipeline stage is a traced graph); as fixed, else chosen once a
        # compiled run has measured the factor on this preset and found compiled blocks faster — the
        # default factor is a guess, and compiling costs minutes at start-up, which a step time does
        # not show
        blocks = [i for i, lay in enumerate(graph.layers) if graph.block_of(lay.path) is not None]
        self.compilable = [i in blocks or not blocks for i in range(self.n)]
        """the layers compile applies to"""
        # fixed; auto
        self.async_tp, self.auto_async = async_tp_modes(cons, cluster,
                                                        measured_compile_gain(cluster))
        self.compile = [bool(fix.get("compile", self.async_tp or measured_compile_gain(cluster)))
                        and on for on in self.compilable]
        self.amp = fix.get("amp", default_amp(cluster.device))
        if self.amp == "bf16" and not cluster.device.supports("bfloat16"):
            raise PlanError(f"fix amp='bf16', but the {cluster.device.name} has no bf16 (it needs "
                            "compute capability >= 8.0); use amp='fp16' (with loss scaling) or "
                            "amp='none'")
        self.optimizer, self.offload = fix.get("optimizer", "adam"), offload_fix(cons)
        self.moe_capacity = fix.get("moe_capacity", MOE_CAPACITY)  # the busiest rank's routed rows
        self.float8 = float8_fix(cons, self.amp)
        self.has_batchnorm = any("BatchNorm" in lay.type
                                 or "BatchNorm" in " ".join(lay.modules.values())
                                 for lay in graph.layers)
        self.experts = {m: e for lp in prof.layers for m, e in lp.experts.items()}
        """the model's experts modules -> number of experts (expert parallelism may split them)"""
        self.selective_experts = any(self.rec_pinned.get(i) == "selective" and lp.experts
                                     for i, lp in enumerate(prof.layers))
        """selective recompute pinned on a layer holding experts (the runtime refuses it beside EP
        with FSDP)"""
        self.rejected: list[str] = []
        self.floors = FLOORS
        """weigh each candidate's memory floor before costing it in full (False: cost every one, as
        the guard test of the unchanged answer does)"""
        self.evaluated = self.pruned = 0
        self.over: Candidate | None = None
        """a candidate faster than the fastest that fits which does not fit: of those, the one with
        the least bound on its step time (the explanation names it; finding the fastest would cost
        every one of them)"""

    # ---- enumeration -----------------------------------------------------------------------------
    def meshes(self) -> list[tuple[int, int, int, int]]:
        """(dp, tp, pp, cp) candidates after the hard constraints, for every context-parallel degree
        to try (the cp ranks take their share of the world first); raises PlanError when a fixed one
        fails."""
        out = [(*mesh, cp) for cp in self.cps
               for mesh in self._meshes(self.cluster.world_size // cp, cp)]
        if not out:
            f = {k: self.cons.fix[k] for k in ("dp", "tp", "pp", "cp") if k in self.cons.fix}
            why = "; ".join(dict.fromkeys(self.rejected)) or "no factorisation fits"
            raise PlanError(f"no mesh dp * tp * pp = {self.cluster.world_size} satisfies "
                            f"{f or 'the model'}: {why}")
        return out

    def _meshes(self, world: int, cp: int) -> list[tuple[int, int, int]]:
        """(dp, tp, pp) with dp * tp * pp = ``world`` (the ranks per context-parallel group)."""
        gpn, fix = self.cluster.gpus_per_node, self.cons.fix
        if all(k in fix for k in ("dp", "tp", "pp")) and fix["dp"] * fix["tp"] * fix["pp"] != world:
            raise PlanError(f"dp({fix['dp']}) * tp({fix['tp']}) * pp({fix['pp']}) = "
                            f"{fix['dp'] * fix['tp'] * fix['pp']} != world_size({world})")
        for k in ("dp", "tp", "pp"):
            if k in fix and world % fix[k]:
                raise PlanError(f"fix {k}={fix[k]} does not divide the world size {world}")
        if self.pins and "pp" in fix:
            stages = fix["pp"] * fix.get("virtual_stages", 1)
            bad = {self.prof.layers[i].path: st for i, st in self.pins.items() if st >= stages}
            if bad:
                raise PlanError(f"override pins {bad} but fix pp={fix['pp']} gives {stages} "
                                f"stage(s) (0..{stages - 1})")
        has_tp = any(self.tp_on[i] and lp.tp for i, lp in enumerate(self.prof.layers))
        tps = [fix["tp"]] if "tp" in fix else [t for t in divisors(gpn) if world % t == 0
                                               and (has_tp or t == 1)]
        out = []
        for t in tps:
            if world % t:
                raise PlanError(f"fix tp={t} does not divide the world size {world}")
            if t > 1:
                if not has_tp:
                    if "tp" in fix:
                        raise PlanError(f"fix tp={t}, but the model has no Linear/Embedding that "
                                        "TP can split")
                    continue
                blockers = tp_blockers(self.prof, t, self.tp_on)
                if blockers:
                    if "tp" in fix:
                        raise PlanError("; ".join(blockers[:3]))
                    self.rejected.append(blockers[0])
                    continue
                if t > gpn and "tp" not in fix:
                    continue
            elif self.cons.needs_tp:
                if "tp" in fix:
                    raise PlanError("an override asks for a tensor-parallel style, but fix tp=1")
                continue
            pps = [fix["pp"]] if "pp" in fix else divisors(world // t)
            for pp in pps:
                if (world // t) % pp:
                    if "pp" in fix and "tp" in fix:
                        raise PlanError(f"tp({t}) * pp({pp}) does not divide the world size "
                                        f"{world}")
                    continue  # an unfixed tp that leaves no room for the fixed pp: try the next tp
                if pp > self.starts:
                    if "pp" in fix:
                        raise PlanError(f"pp={pp} exceeds the {self.starts} pipeline stages the "
                                        "model can hold" + self.glued_note())
                    continue
                if (self.pins and max(self.pins.values()) >= pp * fix.get("virtual_stages", 1)
                    and "pp" not in fix):
                    continue
                dp = world // (t * pp)
                if "dp" in fix and fix["dp"] != dp:
                    continue
                why = self.unsupported(dp, t, pp, cp)
                if why:
                    if sum(k in fix for k in ("dp", "tp", "pp")) >= 2:  # the user fixed this mesh
                        raise PlanError(why)
                    self.rejected.append(why)
                    continue
                if self.global_batch % dp:
                    self.rejected.append(f"dp={dp} does not divide the global batch "
                                         f"{self.global_batch}")
                    continue
                out.append((dp, t, pp))
        return out

    def unsupported(self, dp: int, tp: int, pp: int, cp: int = 1) -> str:
        """Why the runtime (``autopar_nb.runtime``, the exported script) cannot run this mesh with
        the fixed choices, "" when it can. The runtime's restrictions: SyncBatchNorm is not applied
        under pipelining; pipelining does not take fp16 loss scaling, nor a model torch.export
        cannot trace, nor the fused head beside TP (it runs on the last stage unsplit); context
        parallelism does not take the fused head."""
        fix = self.cons.fix
        if cp > 1 and fix.get("fused_loss"):
            return f"cp={cp} with fused_loss: use fused_loss=False"
        if dp > 1 and pp > 1 and self.has_batchnorm:
            return (f"dp({dp}) x pp({pp}) with BatchNorm: SyncBatchNorm is not supported with "
                    "pipelining; fix pp=1 (or dp=1)")
        if pp > 1 and self.prof.pp_blocker:
            return f"pp={pp}: {self.prof.pp_blocker}; or use pp=1"
        if pp > 1 and tp > 1 and (why := getattr(self.graph, "tp_stage_refused", {}).get(tp)):
            return f"pp={pp} x tp={tp}: {why}"
        if pp > 1 and tp > 1 and fix.get("fused_loss"):
            return (f"pp={pp} x tp={tp} with fix fused_loss=True: the fused head + loss runs on "
                    "the last pipeline stage unsplit, or vocab-parallel without pipelining, not "
                    "both; use tp=1 or pp=1, or fused_loss=False")
        if pp > 1 and fix.get("compile"):
            return (f"pp={pp} with fix compile=True: compile applies to whole blocks, which a "
                    "pipeline stage (a traced graph) no longer runs as modules; use pp=1 or "
                    "compile=False")
        if pp > 1 and self.amp == "fp16":
            how = ("fix amp='fp16'" if fix.get("amp") == "fp16" else
                   f"amp='fp16' (the {self.cluster.device.name} has no bf16)")
            return (f"pp={pp} with {how}: pipelining does not support fp16 loss scaling; use "
                    "amp='bf16' or pp=1")
        return ""

    def ep_degrees(self, dp: int, tp: int, pp: int) -> list[int]:
        """Expert-parallel degrees for a mesh: 1, and for a model with experts modules every divisor
        of dp that divides every module's number of experts, inside a node (the all-to-alls stay on
        the fast links). EP runs beside data parallelism, per pipeline stage, with tp = 1; a fixed
        ep that cannot apply is a PlanError."""
        fix = self.cons.fix
        if "ep" in fix:
            e = fix["ep"]
            if e == 1:
                return [1]
            why = ("the model has no experts modules (stacked per-expert weights run by a grouped "
                   "matmul)" if not self.experts else f"ep={e} does not divide dp={dp}" if dp % e
                   else f"ep={e} does not divide the {min(self.experts.values())} experts of "
                        f"{min(self.experts, key=self.experts.get)}"
                   if any(n % e for n in self.experts.values())
                   else f"expert parallelism runs with tp=1 only, not tp={tp}" if tp > 1 else "")
            if why:
                if all(k in fix for k in ("dp", "tp", "pp")) or not self.experts:
                    raise PlanError(f"fix ep={e}: {why}")
                self.rejected.append(f"fix ep={e}: {why}")
                return []
            return [e]
        if not self.experts or tp > 1 or self.cps != (1,):
            return [1]
        gpn = self.cluster.gpus_per_node
        return [1] + [e for e in divisors(dp) if 1 < e <= gpn
                      and all(n % e == 0 for n in self.experts.values())]

    def micro_batch_sizes(self, local: int, pp: int) -> list[int]:
        fix = self.cons.fix
        if "micro_batches" in fix:
            m = fix["micro_batches"]
            if local % m:
                raise PlanError(f"micro_batches={m} does not divide the per-replica batch {local} "
                                f"(global {self.global_batch})")
            # torch's 1F1B would refuse it
            if 1 < pp and m < pp and fix.get("schedule", "1f1b") != "gpipe":
                self.rejected.append(f"pp={pp} with fix micro_batches={m}: 1F1B needs a "
                                     "micro-batch per stage")
                return []
            return [local // m]
        ds = sorted(divisors(local), reverse=True)
        # at least pp micro-batches keep the pipeline busy; allow fewer only if nothing else
        if pp > 1:
            ds = [d for d in ds if local // d >= pp] or ds[-1:]
            # torch's 1F1B would refuse it
            if local // ds[0] < pp and "gpipe" != fix.get("schedule", "1f1b"):
                self.rejected.append(f"pp={pp} with 1F1B needs at least {pp} micro-batches, and "
                                     f"the per-replica batch is {local}")
                return []
        # the largest sizes (GEMM efficiency, fewest steps) and the smallest (least activation
        # memory)
        return ds if len(ds) <= 8 else ds[:4] + ds[-4:]

    def schedules(self, pp: int, m: int) -> list[tuple[str, int]]:
        fix = self.cons.fix
        if pp == 1:
            return [(fix.get("schedule", "1f1b"), 1)]
        if "schedule" in fix:
            sch = fix["schedule"]
            if "virtual_stages" in fix or sch not in LOOPED:
                return [(sch, fix.get("virtual_stages", 2 if sch in MULTI_STAGE else 1))]
            return [(sch, v) for v in VIRTUAL_STAGES if pp * v <= self.starts] or [(sch, 2)]
        out = [("1f1b", 1)]
        if m % pp == 0 and not self.pins:
            out += [("interleaved_1f1b", v) for v in VIRTUAL_STAGES if pp * v <= self.starts]
        return out

    # ---- costing ---------------------------------------------------------------------------------
    def run(self, top_k: int = 5) -> list[Candidate]:
        """Costed candidates, best first by a lower bound: a configuration whose bound (compute + TP
        comm + bubble of its slowest pipeline rank, before recompute) exceeds the ``top_k``-th best
        feasible step time is skipped, which never drops one of the ``top_k`` best."""
        fix = self.cons.fix
        configs = []
        for dp, t, pp, cp, ep in [(*mesh, e) for mesh in self.meshes()
                                  for e in self.ep_degrees(*mesh[:3])]:
            # FSDP (ZeRO 1-3) shards over dp x cp, whose ranks hold the same parameters
            # (dp_shard_cp); offload needs ZeRO 2 or 3, even alone
            zeros = [fix["zero_stage"]
                     ] if "zero_stage" in fix else [2, 3] if self.offload != "none" else (
                         [0] if dp * cp == 1 else [0, 1, 2, 3])
            if ep > 1:
                zeros = [z for z in zeros if not (z >= 1 and self.selective_experts)]
                if not zeros:
                    self.rejected.append(f"ep={ep} with fix zero_stage={fix['zero_stage']}: "
                                         "selective recompute is pinned on layers holding experts, "
                                         "which FSDP shards inside the checkpointed region (use "
                                         "full recompute, or ZeRO 0)")
                    continue
            sp, why = sequence_parallel(fix, self.prof, t, seq_ratio=self.ev.seq_ratio)
            if why:
                self.rejected.append(why)
                continue
            local = self.global_batch // dp
            for mb in self.micro_batch_sizes(local, pp):
                m = local // mb
                for sched, v in self.schedules(pp, m):
                    stages = pp * v
                    if stages > self.starts:
                        self.rejected.append(f"{pp} x {v} pipeline stages: the model can hold "
                                             f"{self.starts}" + self.glued_note())
                        continue
                    base = Setting(dp, t, pp, 0, self.amp, m, float(mb), sched, v, sp,
                                   self.optimizer, ep, cp=cp,
                                   async_tp=self.async_tp or self.auto_async and t > 1 and pp == 1)
                    choices = [LayerChoice(0, self.tp_on[i], self.rec_pinned.get(i, "none"),
                                           self.fsdp[i], self.compile[i] and pp == 1)
                               for i in range(self.n)]
                    runs = self.ev.runs(choices)
                    times = self._run_times(base, runs)
                    if (assign := self._stages(runs, times, stages)) is None:
                        continue
                    rank_t = [0.0] * pp
                    k = 0
                    for (_, cnt, _), t_ in zip(runs, times, strict=True):
                        for j in range(k, k + cnt):
                            rank_t[stage_rank(assign[j], pp, stages, sched)] += t_
                        k += cnt
                    bound = max(rank_t) * (m + bubble_fraction(sched, pp=pp, micro_batches=m,
                                                               virtual_stages=v, factors=self.ev.f))
                    configs.append((bound, len(configs), base, assign, zeros))
        configs.sort(key=lambda c: (c[0], c[1]))
        out: list[Candidate | tuple[Setting, list[LayerChoice]]] = []
        best: list[float] = []
        for bound, _, base, assign, zeros in configs:
            if len(best) >= top_k and bound > best[top_k - 1]:
                self.pruned += 1
                continue
            for z in zeros:
                if z == 1 and "zero_stage" not in fix and (base.pp > 1 or base.micro_batches == 1):
                    # ZeRO-1 runs ZeRO-2's FSDP2 calls then (one micro-batch, or PipelineStage's
                    # own)
                    continue
                s = dataclasses.replace(base, zero_stage=z, fused_loss=bool(fix.get("fused_loss")),
                                        fused_norm=bool(fix.get("fused_norm")), float8=self.float8,
                                        offload=self.offload, moe_capacity=self.moe_capacity)
                if ((self.float8 != "none" or self.async_tp or s.offload != "none") and base.pp > 1
                        or self.async_tp and base.tp == 1):
                    # float8, async TP and offload run with pp=1 only, async TP with tp > 1
                    continue
                choices = [LayerChoice(assign[i], self.tp_on[i], self.rec_pinned.get(i, "none"),
                                       self.fsdp[i], self.compile[i] and base.pp == 1)
                           for i in range(self.n)]
                if self.floors and memory_floor(self.ev, s, choices, limit=self.limit) > self.limit:
                    # it cannot fit: costed only if the explanation may tell it (_settle)
                    out.append((s, choices))
                    continue
                cand = self._variants(s, choices)
                out.append(cand)
                if cand.fits:
                    bisect.insort(best, cand.cost.step_time_s)
        return self._settle(out)

    def _stages(self, runs, times: list[float], stages: int) -> list[int] | None:
        """Each layer's stage, balanced by the per-layer ``times`` of ``runs`` (the pins kept, no
        stage starting at a glued layer); None when the layers cannot make ``stages`` stages."""
        if self.pins:
            per_layer = [t for (_, cnt, _), t in zip(runs, times, strict=True) for _ in range(cnt)]
            return partition(per_layer, stages, self.pins, self.glued)
        return partition_runs([(t, cnt) for (_, cnt, _), t in zip(runs, times, strict=True)],
                              stages, self.glued)

    def glued_note(self) -> str:
        """Which layers no stage may start at, and why (the first), for a refusal; "" when none."""
        if not self.glued:
            return ""
        paths = [self.prof.layers[i].path for i in sorted(self.glued)]
        first = min(self.glued)
        return (
            f" of {self.n} layers: no stage starts at "
            f"{', '.join(paths[:3])}{', ...' if len(paths) > 3 else ''} ({paths[0]}: "
            f"{self.prof.pp_glued.get(first, 'it stays with the pinned stage start before it')})")

    def _variants(self, s: Setting, choices: list[LayerChoice]) -> Candidate:
        """The candidate of ``s`` with ``choices``, recompute added where needed, and variants."""
        # costing adds recompute to ``choices``
        origin = (s, [dataclasses.replace(c) for c in choices])
        cand = self.norm_variant(self.fused_variant(self._cost(s, choices,
                                                               "recompute" not in self.cons.fix)))
        cand.origin = origin
        return cand

    def _settle(self, out: list) -> list[Candidate]:
        """``out`` with the candidates a memory floor set aside (``(setting, choices)``: they cannot
        fit, :func:`~autopar_nb.cost.floor.memory_floor`) costed in full where ``plan()`` may tell
        them: every one when nothing fits (it tells the one over by the least), else, in the order
        of a bound on their step time, until :attr:`over` is found. The rest can change neither the
        plan, nor its alternatives, nor its explanation."""
        done = [c for c in out if isinstance(c, Candidate)]
        aside = [c for c in out if not isinstance(c, Candidate)]
        bar = min((c.cost.step_time_s for c in done if c.fits), default=math.inf)
        if bar == math.inf:
            return done + [self._variants(*c) for c in aside]
        over = [(_order(c, self._time_floor(*c.origin)), c) for c in done if not c.fits
                and c.cost.step_time_s < bar]
        for floor, _, c in sorted((self._time_floor(*c), i, c) for i, c in enumerate(aside)):
            # past the fastest that fits none can be faster (with none found, every one was costed)
            if floor >= bar or over and floor > min(r for r, _ in over)[0]:
                break
            if applies(self, c[0]) and recompute_time_floor(self, *c, bar) >= bar:
                # the recompute it must add puts it past the fastest that fits: it cannot be faster
                continue
            cand = self._variants(*c)
            done.append(cand)
            if not cand.fits and cand.cost.step_time_s < bar:
                over.append((_order(cand, floor), cand))
        self.over = min(over, key=lambda rc: rc[0])[1] if over else None
        return done

    def _time_floor(self, s: Setting, choices: list[LayerChoice]) -> float:
        """A lower bound on the step time of ``s`` with ``choices`` and of each variant
        :meth:`_variants` costs (recompute added, fused loss or norms, stages moved by memory): the
        slowest rank's compute and exposed TP comm per micro-batch times (micro-batches + bubble),
        on the best stages for those times where memory may move them (one stage per rank), less a
        hair for the stage bisection's tolerance."""
        idle = bubble_fraction(s.schedule, pp=s.pp, micro_batches=s.micro_batches,
                               virtual_stages=s.virtual_stages, factors=self.ev.f)
        runs = self.ev.runs(choices)
        out = math.inf
        for v in [s] + ([dataclasses.replace(s, fused_norm=True)] if self.ev.norm_prof is not None
                        else []):
            times = self._run_times(v, runs)
            per_layer = [(t, ch.stage) for (_, cnt, ch), t in zip(runs, times, strict=True)
                         for _ in range(cnt)]
            if s.pp > 1 and s.virtual_stages == 1 and not self.pins:
                assign = partition_runs([(t, cnt)
                                         for (_, cnt, _), t in zip(runs, times, strict=True)], s.pp,
                                        self.glued)
                per_layer = [(t, st) for (t, _), st in zip(per_layer, assign, strict=True)]
            rank_t = [0.0] * s.pp
            for t, st in per_layer:
                rank_t[s.rank_of(st)] += t
            out = min(out, max(rank_t) * (s.micro_batches + idle))
        return out * (1 - 1e-4)

    def fused_variant(self, cand: Candidate) -> Candidate:
        """The candidate, or the same setting with the output head and the loss fused
        (``Setting.fused_loss``) when the unfused one needs recompute the user did not ask for, or
        does not fit, and the fused one fits and is faster (it adds one head matmul, and saves the
        logits' memory; ``cost/loss.py``). Tried with cp = 1, and not with both pp > 1 and tp > 1
        (what the runtime runs: under TP vocab-parallel, under pipelining on the last stage), unless
        fused_loss is fixed either way. The other variant is kept on ``other``."""
        s, fix = cand.setting, self.cons.fix
        if s.fused_loss or "fused_loss" in fix or not loss_fusable(self.ev, s):
            return cand
        added = any(ch.recompute != self.rec_pinned.get(i, "none")
                    for i, ch in enumerate(cand.choices))
        if cand.fits and not added:
            return cand
        choices = [LayerChoice(ch.stage, ch.tp, self.rec_pinned.get(i, "none"), ch.fsdp, ch.compile)
                   for i, ch in enumerate(cand.choices)]
        fused = self._cost(dataclasses.replace(s, fused_loss=True), choices, "recompute" not in fix)
        better = (fused.cost.step_time_s < cand.cost.step_time_s if fused.fits == cand.fits
                  else fused.fits)
        if not cand.fits and not fused.fits:
            better = fused.cost.peak_memory_bytes < cand.cost.peak_memory_bytes
        chosen, other = (fused, cand) if better else (cand, fused)
        chosen.other = other
        return chosen

    def norm_variant(self, cand: Candidate) -> Candidate:
        """The candidate, or the same setting with the RMSNorms fused (``Setting.fused_norm``,
        :mod:`..cost.norm`) when that pays: on CUDA (one kernel for the eager chain's five to eight)
        when it fits and is faster, or fits where the eager norms do not, or needs no recompute they
        need; on the CPU (the op's body runs the chain's kernels) only for memory: when the eager
        norms need recompute the user did not ask for or do not fit, and the fused ones fit or need
        less. Unless fused_norm is fixed either way."""
        s, fix = cand.setting, self.cons.fix
        if s.fused_norm or self.ev.norm_prof is None or "fused_norm" in fix:
            return cand
        added = any(ch.recompute != self.rec_pinned.get(i, "none")
                    for i, ch in enumerate(cand.choices))
        speed = one_kernel(self.prof.device_kind)
        if cand.fits and not added and not speed:
            return cand
        choices = [LayerChoice(ch.stage, ch.tp, self.rec_pinned.get(i, "none"), ch.fsdp, ch.compile)
                   for i, ch in enumerate(cand.choices)]
        fused = self._cost(dataclasses.replace(s, fused_norm=True), choices, "recompute" not in fix)
        fused_added = any(ch.recompute != self.rec_pinned.get(i, "none")
                          for i, ch in enumerate(fused.choices))
        if fused.fits != cand.fits:
            better = fused.fits
        elif not fused.fits:
            better = fused.cost.peak_memory_bytes < cand.cost.peak_memory_bytes
        elif fused_added != added:
            better = added
        else:
            better = speed and fused.cost.step_time_s < cand.cost.step_time_s
        if not better:
            cand.norm_other = fused
            return cand
        fused.other, fused.norm_other = cand.other, cand
        return fused

    def _run_times(self, s: Setting, runs) -> list[float]:
        """Per-micro-batch time of one layer of each run (compute, recompute, TP collectives not
        overlapped)."""
        return [self.ev.choice_terms(i, s, ch).time_s(ch.recompute) for i, _, ch in runs]

    def _cost(self, s: Setting, choices: list[LayerChoice], auto_recompute: bool) -> Candidate:
        self.evaluated += 1
        cost = self.ev.evaluate(s, choices)
        # it holds more
        if cost.peak_memory_bytes > self.limit and auto_recompute and s.schedule not in ZERO_BUBBLE:
            free = [i not in self.rec_pinned for i in range(self.n)]
            original = [LayerChoice(c.stage, c.tp, c.recompute, c.fsdp, c.compile) for c in choices]
            # greedy: its estimate of the bytes each step sheds is checked by evaluating again
            for _ in range(3):
                if cost.peak_memory_bytes <= self.limit or not choose_recompute(
                        self.ev, s, choices, cost, self.limit, free):
                    break
                cost = self.ev.evaluate(s, choices)
            if (cost.peak_memory_bytes > self.limit and s.pp > 1 and s.virtual_stages == 1
                and not self.pins):
                # time-balanced stages do not fit: move layers off the fullest ranks (embedding on
                # the first, head and loss on the last, more micro-batches in flight early in 1F1B),
                # then recompute again
                assign = memory_partition(self.ev, s, original, limit=self.limit,
                                          rec_pinned=self.rec_pinned, glued=self.glued)
                if assign is not None:
                    retry = [LayerChoice(st, c.tp, c.recompute, c.fsdp, c.compile)
                             for st, c in zip(assign, original, strict=True)]
                    cost2 = self.ev.evaluate(s, retry)
                    for _ in range(3):
                        if cost2.peak_memory_bytes <= self.limit or not choose_recompute(
                                self.ev, s, retry, cost2, self.limit, free):
                            break
                        cost2 = self.ev.evaluate(s, retry)
                    if cost2.peak_memory_bytes < cost.peak_memory_bytes:
                        choices, cost = retry, cost2
        return Candidate(s, choices, cost, self.limit)
