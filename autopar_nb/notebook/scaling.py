"""A plan run on another number of processes than it was made for: the same TP/PP layout with
fewer (or more) data-parallel replicas, so a plan made for 64 GPUs can be checked on 2 local
processes, its cost re-estimated for the processes it runs on.
"""

from __future__ import annotations

import dataclasses

from ..graph import ModelGraph
from ..hardware import Cluster
from ..plan import Plan, PlanError


def scaled_plan(plan: Plan, nproc: int | None, *, graph: ModelGraph, cluster: Cluster) -> Plan:
    """``plan`` at ``nproc`` processes (itself at its own world size, or with ``nproc`` None): its
    cost the cost model's for ``nproc`` devices of ``cluster``'s kind, its
    ``cluster["scaled_from"]`` the world size planned, and its explanation one line saying all
    this. PlanError when ``nproc`` cannot hold one copy of the model-parallel layout."""
    from ..cost import estimate

    m = plan.mesh
    if nproc is None or nproc == m.world_size:
        return plan
    model_parallel = m.tp * m.pp
    if nproc % model_parallel:
        raise PlanError(f"the plan needs multiples of tp({m.tp}) * pp({m.pp}) = "
                        f"{model_parallel} processes; nproc={nproc} is not one. Pass "
                        f"nproc={model_parallel} (or re-plan with --gpus {nproc})")
    dp = nproc // model_parallel
    per_replica = plan.batch.global_batch // m.dp
    scaled = Plan.from_dict(plan.to_dict())
    scaled.mesh.dp = dp
    scaled.batch.global_batch = per_replica * dp
    scaled.cluster = {**scaled.cluster, "nodes": 1, "gpus_per_node": nproc,
                      "scaled_from": m.world_size}
    scaled.alternatives = []
    how = f"re-estimated for {nproc} x {cluster.device.name}"
    try:
        scaled.cost = estimate(graph, dataclasses.replace(cluster, nodes=1, gpus_per_node=nproc),
                               scaled)
    except ValueError as e:  # the run keeps the plan's figures to compare with, and says so
        per_rank_as_planned(scaled.cost, m, nproc)
        how = f"as planned for {m.world_size} (not re-estimated: {e})"
    scaled.explanation = [
        f"The plan is for {m.world_size} processes; running it on {nproc}: the same tp({m.tp}) "
        f"x pp({m.pp}) layout with dp {m.dp} -> {dp} (global batch {plan.batch.global_batch} "
        f"-> {scaled.batch.global_batch}), its cost {how}. To run it as planned: "
        f"nproc={m.world_size}; to plan for {nproc} instead: "
        f"ap.replan(cluster=Cluster.preset({cluster.name!r}, gpus_per_node={nproc}))"]
    return scaled


def per_rank_as_planned(cost, mesh, nproc: int) -> None:
    """Give ``cost`` (a copy of a plan's, mesh ``mesh``) one memory figure per rank of ``nproc``
    processes, the same tp x pp layout with more or fewer data-parallel replicas: each rank takes
    replica 0's figure of its pipeline stage and TP position (ranks in mesh order (pp, dp, tp), TP
    innermost). Per-stage lists stay as they are."""
    mem = list(getattr(cost, "memory_by_rank", None) or [])
    if cost is None or len(mem) != mesh.world_size:
        return
    dp = nproc // (mesh.tp * mesh.pp)
    cost.memory_by_rank = [mem[(r // (dp * mesh.tp)) * mesh.dp * mesh.tp + r % mesh.tp]
                           for r in range(nproc)]
