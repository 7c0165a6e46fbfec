"""What the search tries: the meshes ``dp * tp * pp * cp = world`` the hard constraints allow, and
per mesh its expert-parallel degrees, ZeRO stages, micro-batch sizes and pipeline schedules (what is
exhaustive and what is sampled: :mod:`.search`). Fixed choices that cannot apply raise
:class:`PlanError`; unfixed ones that cannot are skipped, each with why in ``rejected``."""

from __future__ import annotations

from ..cost.schedule import MULTI_STAGE
from ..plan import V_SCHEDULES, PlanError
from .degrees import divisors, tp_blockers

VIRTUAL_STAGES = (2, 3, 4, 6, 8)
"""chunks per rank the looped schedules are tried with: a bubble of (pp - 1) / v stage-times shrinks
with v while each micro-batch crosses v times as many stage boundaries and each rank holds more
micro-batches in flight (the cost model prices both); Megatron-LM's SC21 runs and Llama 3's use up
to a few layers per chunk"""
LOOPED = tuple(s for s in MULTI_STAGE if s not in V_SCHEDULES)
"""schedules that run any number of chunks per rank (a V schedule runs two)"""


class Enumeration:
    """The enumeration half of :class:`.search.Search`, which sets the attributes read here: the
    graph, profile, cluster and constraints (``graph``, ``prof``, ``cluster``, ``cons``), the layers
    (``n``, ``tp_on``, ``pins``, ``glued``, ``starts``), the model's ``experts`` and
    ``has_batchnorm``, the fixed ``amp``, ``offload`` and ``selective_experts``, the
    ``global_batch``, the context-parallel degrees ``cps`` and the list of refusals ``rejected``."""

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

    def zero_stages(self, dp: int, cp: int, ep: int) -> list[int]:
        """ZeRO stages to try on a mesh: FSDP (ZeRO 1-3) shards over dp x cp, whose ranks hold the
        same parameters (dp_shard_cp); offload needs ZeRO 2 or 3, even alone; none beside EP when
        selective recompute is pinned on layers holding experts ([] then, the refusal noted)."""
        fix = self.cons.fix
        zeros = [fix["zero_stage"]] if "zero_stage" in fix else [2, 3] if self.offload != "none" \
            else [0] if dp * cp == 1 else [0, 1, 2, 3]
        if ep > 1:
            zeros = [z for z in zeros if not (z >= 1 and self.selective_experts)]
            if not zeros:
                self.rejected.append(f"ep={ep} with fix zero_stage={fix['zero_stage']}: "
                                     "selective recompute is pinned on layers holding experts, "
                                     "which FSDP shards inside the checkpointed region (use "
                                     "full recompute, or ZeRO 0)")
        return zeros

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
