"""CPU offload as the planner chooses it (``plan.mesh.offload``): fixed by the user, or searched
again with it when nothing fits in device memory, since every copy over the host link and the CPU
optimizer step make it slow (:mod:`..cost.offload`). A plan with it must fit the host too: the
node's ranks hold their offloaded states in its RAM together (on the ``cpu`` preset the device is
the host, so a rank holds both in its share)."""

from __future__ import annotations

import dataclasses

from ..cost.offload import host_line, host_need, host_of
from ..plan import PlanError
from ..units import fmt_bytes, fmt_time
from .candidate import Candidate
from .search import Search


def host_refusal(cand: Candidate, cluster) -> str:
    """Why ``cand``'s offloaded states do not fit the host ("" when they do)."""
    if cand.setting.offload == "none":
        return ""
    mem = cand.cost.memory_by_rank
    if cluster.name == "cpu":
        worst = max(mem, key=lambda m: m.total + m.host)
        need = worst.total + worst.host
        return "" if need <= cand.limit else (f"a rank needs {fmt_bytes(need)} of RAM with its "
                                              f"offloaded states, over its {fmt_bytes(cand.limit)}")
    host = host_of(cluster)
    need = host_need(mem, cluster)
    return "" if need <= host.memory_bytes else ("its offloaded states need "
                                                 f"{host_line(mem, cluster)}")


def offload_search(search: Search, cons, top_k: int) -> tuple[list[Candidate], Search | None, str]:
    """(the candidates of ``search``'s request with CPU offload that fit device and host, that
    search, why none does: "" or a clause for the no-fit message) when the planner may offload (not
    fixed, not on the ``cpu`` preset, whose device is the host); ([], None, "") otherwise."""
    if "offload" in cons.fix or search.cluster.name == "cpu":
        return [], None, ""
    try:
        again = Search(search.graph, search.prof, search.cluster,
                       dataclasses.replace(cons, fix={**cons.fix, "offload": "cpu"}), search.ev,
                       global_batch=search.global_batch,
                       fused_why=search.fused_why, cps=search.cps)
        cands = again.run(top_k)
    # the fixed choices take no offload (zero_stage 0 or 1, pp > 1): nothing to offload
    except PlanError:
        return [], None, ""
    fit = [c for c in cands if c.fits]
    kept = [c for c in fit if not host_refusal(c, search.cluster)]
    least = min(fit, key=lambda c: host_need(c.cost.memory_by_rank, search.cluster), default=None)
    return kept, again, "" if kept or least is None else ("; with CPU offload "
                                                          f"{host_refusal(least, search.cluster)}")


def checked_fixed(feasible: list[Candidate], cluster) -> list[Candidate]:
    """``feasible`` less the candidates whose offloaded states do not fit the host (none without
    offload); PlanError with the reason when none is left."""
    kept = [c for c in feasible if not host_refusal(c, cluster)]
    if feasible and not kept:
        raise PlanError(f"fix offload={feasible[0].setting.offload!r}: "
                        f"{host_refusal(feasible[0], cluster)}; use more GPUs or nodes, or a "
                        "smaller model")
    return kept


def offload_lines(best: Candidate, cons, cluster) -> list[str]:
    """One line: CPU offload taken (why, its price in step time, device and host memory), or
    nothing."""
    s, c = best.setting, best.cost
    if s.offload == "none":
        return []
    why = "fix offload" if "offload" in cons.fix else "nothing fits in device memory without it"
    mem = max(c.memory_by_rank, key=lambda m: m.host)
    copies = sum(c.comm_by_kind.get(k, 0.0) for k in ("host_to_device", "device_to_host"))
    exposed = sum(c.comm_exposed_by_kind.get(k, 0.0) for k in ("host_to_device", "device_to_host"))
    where = ("the device is the host here: nothing is copied, the accounting only moves"
             if cluster.name == "cpu" else f"{host_line(c.memory_by_rank, cluster)}; "
                                           f"{fmt_time(copies)} of host copies per step "
                                           f"({fmt_time(exposed)} exposed)")
    return [f"CPU offload ({why}): FSDP2's CPUOffloadPolicy keeps the parameter and gradient "
            f"shards and the optimizer states in host memory ({fmt_bytes(mem.host)} per rank) and "
            f"steps on the CPU ({fmt_time(c.optimizer_s)}); {where}."]
