"""The search: mesh factorisations x ZeRO stage x micro-batching x schedule, then per layer
(pipeline stage, recompute, TP on/off) under the memory limit.

What is exact and what is heuristic:

* **Exact (exhaustive)**: every mesh ``dp * tp * pp = world`` with TP inside a node dividing every
  head count and split Linear dim, PP <= layers, DP dividing the global batch; every ZeRO stage;
  1F1B and, where it applies, interleaved 1F1B with each of :data:`.meshes.VIRTUAL_STAGES` chunks
  per rank that the layers allow; for a model with experts modules, every expert-parallel degree
  inside a node that divides dp and each module's number of experts (tp = 1: what the runtime
  runs).
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

from ..cost.estimate import Evaluator
from ..cost.floor import loss_fusable, memory_floor
from ..cost.norm import one_kernel
from ..cost.schedule import ZERO_BUBBLE
from ..cost.setting import LayerChoice, Setting
from ..cost.time import bubble_fraction
from ..plan import PlanError, stage_rank
from ..plan.vocab import MOE_CAPACITY
from .candidate import Candidate, memory_limit
from .constraints import async_tp_modes, float8_fix, offload_fix, sequence_parallel
from .meshes import Enumeration
from .recompute import choose_recompute
from .stages import memory_partition, partition, partition_runs
from .time_bound import applies, recompute_time_floor


def _order(cand: Candidate, floor: float) -> tuple:
    """How :attr:`Search.over` is chosen among candidates: least bound on the step time, then time,
    then key."""
    return floor, cand.cost.step_time_s, cand.key


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


class Search(Enumeration):
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

    # ---- costing ---------------------------------------------------------------------------------
    def run(self, top_k: int = 5) -> list[Candidate]:
        """Costed candidates, best first by a lower bound: a configuration whose bound (compute + TP
        comm + bubble of its slowest pipeline rank, before recompute) exceeds the ``top_k``-th best
        feasible step time is skipped, which never drops one of the ``top_k`` best."""
        configs = sorted(self._configs(), key=lambda c: (c[0], c[1]))
        out: list[Candidate | tuple[Setting, list[LayerChoice]]] = []
        best: list[float] = []
        for bound, _, base, assign, zeros in configs:
            if len(best) >= top_k and bound > best[top_k - 1]:
                self.pruned += 1
                continue
            for z in zeros:
                cand = self._zero_candidate(base, assign, z)
                if cand is None:
                    continue
                out.append(cand)
                if isinstance(cand, Candidate) and cand.fits:
                    bisect.insort(best, cand.cost.step_time_s)
        return self._settle(out)

    def _configs(self) -> list[tuple]:
        """(bound, index, base setting, each layer's stage, ZeRO stages to try) for every mesh,
        expert-parallel degree, micro-batch size and schedule whose layers make its stages; the
        bound is :meth:`_bound`'s."""
        configs = []
        for dp, t, pp, cp, ep in [(*mesh, e) for mesh in self.meshes()
                                  for e in self.ep_degrees(*mesh[:3])]:
            zeros = self.zero_stages(dp, cp, ep)
            if not zeros:
                continue
            sp, why = sequence_parallel(self.cons.fix, self.prof, t, seq_ratio=self.ev.seq_ratio)
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
                    runs = self.ev.runs(self._choices([0] * self.n, pp))
                    times = self._run_times(base, runs)
                    if (assign := self._stages(runs, times, stages)) is None:
                        continue
                    configs.append((self._bound(base, runs, times, assign), len(configs), base,
                                    assign, zeros))
        return configs

    def _choices(self, assign: list[int], pp: int) -> list[LayerChoice]:
        """Each layer's choice on stage ``assign[i]``, before recompute is added: TP, pinned
        recompute, FSDP and compile as the search set them (compile with pp = 1 only)."""
        return [LayerChoice(assign[i], self.tp_on[i], self.rec_pinned.get(i, "none"), self.fsdp[i],
                            self.compile[i] and pp == 1) for i in range(self.n)]

    def _bound(self, base: Setting, runs, times: list[float], assign: list[int]) -> float:
        """A lower bound on ``base``'s step time: its slowest pipeline rank's per-micro-batch time
        (compute, recompute, TP comm not overlapped, over the stages it holds) times the
        micro-batches plus the bubble."""
        pp, stages = base.pp, base.pp * base.virtual_stages
        rank_t = [0.0] * pp
        k = 0
        for (_, cnt, _), t_ in zip(runs, times, strict=True):
            for j in range(k, k + cnt):
                rank_t[stage_rank(assign[j], pp, stages, base.schedule)] += t_
            k += cnt
        m = base.micro_batches
        return max(rank_t) * (m + bubble_fraction(base.schedule, pp=pp, micro_batches=m,
                                                  virtual_stages=base.virtual_stages,
                                                  factors=self.ev.f))

    def _zero_candidate(self, base: Setting, assign: list[int], z: int):
        """``base`` at ZeRO stage ``z`` with the fixed levers, costed (a :class:`Candidate`), or
        ``(setting, choices)`` when its memory floor is over the limit (it cannot fit: costed only
        if the explanation may tell it, :meth:`_settle`), or None when the runtime does not run
        it."""
        fix = self.cons.fix
        if z == 1 and "zero_stage" not in fix and (base.pp > 1 or base.micro_batches == 1):
            # ZeRO-1 runs ZeRO-2's FSDP2 calls then (one micro-batch, or PipelineStage's own)
            return None
        s = dataclasses.replace(base, zero_stage=z, fused_loss=bool(fix.get("fused_loss")),
                                fused_norm=bool(fix.get("fused_norm")), float8=self.float8,
                                offload=self.offload, moe_capacity=self.moe_capacity)
        if ((self.float8 != "none" or self.async_tp or s.offload != "none") and base.pp > 1
                or self.async_tp and base.tp == 1):
            # float8, async TP and offload run with pp=1 only, async TP with tp > 1
            return None
        choices = self._choices(assign, base.pp)
        if self.floors and memory_floor(self.ev, s, choices, limit=self.limit) > self.limit:
            return (s, choices)
        return self._variants(s, choices)

    def _stages(self, runs, times: list[float], stages: int) -> list[int] | None:
        """Each layer's stage, balanced by the per-layer ``times`` of ``runs`` (the pins kept, no
        stage starting at a glued layer); None when the layers cannot make ``stages`` stages."""
        if self.pins:
            per_layer = [t for (_, cnt, _), t in zip(runs, times, strict=True) for _ in range(cnt)]
            return partition(per_layer, stages, self.pins, self.glued)
        return partition_runs([(t, cnt) for (_, cnt, _), t in zip(runs, times, strict=True)],
                              stages, self.glued)

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
