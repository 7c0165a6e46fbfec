"""How an exported script is started: where its processes sit (:func:`layout`) and the ``torchrun``
lines of its docstring, one node, several and elastic; :mod:`.slurm` and :mod:`.k8s` wrap the same
line for a scheduler."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path

from ..plan import Plan

RDZV_PORT = 29500
"""the c10d rendezvous port on the first node (torchrun's default master port)"""


@dataclass(frozen=True)
class Layout:
    """How a plan's processes sit on machines: ``nodes`` x ``per_node`` = the plan's world size."""

    nodes: int
    per_node: int
    gpus: bool
    """the plan's cluster is GPUs (one process per GPU); False for CPU plans and plans without a
    cluster"""

    @property
    def world(self) -> int:
        return self.nodes * self.per_node


def layout(plan: Plan) -> Layout:
    """One node when the plan's world fits its ``gpus_per_node`` (or the plan names no cluster);
    otherwise nodes of ``gpus_per_node`` processes (a divisor of the world when it does not divide
    it)."""
    world, per_node = plan.mesh.world_size, int(plan.cluster.get("gpus_per_node") or 0)
    gpus = plan.cluster.get("preset") not in (None, "", "cpu")
    if not per_node or world <= per_node:
        return Layout(1, world, gpus)
    per_node = max(d for d in range(1, per_node + 1) if world % d == 0)
    return Layout(world // per_node, per_node, gpus)


def torchrun_command(script: str, nodes: int | str, per_node: int, *, run_id: str,
                     elastic: bool = False, endpoint: str = f"HOST:{RDZV_PORT}") -> str:
    """``torchrun`` for ``nodes`` (a count, or ``"MIN:MAX"`` when ``elastic``) of ``per_node``
    processes meeting at ``endpoint`` (c10d rendezvous); a single node needs no rendezvous
    endpoint."""
    if nodes == 1:
        return f"torchrun --nproc-per-node {per_node} {script}"
    # see README "Past one machine"
    head = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 " if elastic else ""
    restarts = " --max-restarts 3" if elastic else ""
    return (f"{head}torchrun --nnodes {nodes} --nproc-per-node {per_node}{restarts} --rdzv-backend "
            f"c10d --rdzv-endpoint {endpoint} --rdzv-id {run_id} {script}")


def elastic_min_nodes(plan: Plan, per_node: int) -> int:
    """The fewest nodes of ``per_node`` processes that still hold whole model replicas (``pp * tp``
    divides the processes; the data-parallel degree shrinks)."""
    layout_size = plan.mesh.pp * plan.mesh.tp
    return next(k for k in range(1, layout_size + 1) if (k * per_node) % layout_size == 0)


def can_be_elastic(plan: Plan) -> bool:
    """Whether the script may run at another data-parallel degree from a checkpoint (DCP reshards
    every ZeRO stage's states): not with expert parallelism (its experts are split over
    data-parallel ranks)."""
    return plan.mesh.ep == 1


@dataclass(frozen=True)
class LaunchCommand:
    """One way to start the script: what it is for, and the command."""

    title: str
    command: str


def launch_commands(script: str, plan: Plan, *, nodes: int | None = None) -> list[LaunchCommand]:
    """The commands of the script's docstring: one node when the plan fits one (``world <=
    gpus_per_node``) and the same plan over ``nodes`` (default: the plan's cluster, at least 2)
    nodes; a plan larger than a node gets only the multi-node command. Multi-node commands use c10d
    rendezvous on the first node (``HOST``); the elastic one (``--nnodes MIN:MAX``) lets the job
    lose and regain nodes."""
    world, run_id, lay = plan.mesh.world_size, Path(script).stem, layout(plan)
    out = []
    if lay.nodes == 1:
        out.append(LaunchCommand(f"One node, {world} process{'es' * (world != 1)}:",
                                 torchrun_command(script, 1, world, run_id=run_id)))
        nodes = nodes or max(2, plan.cluster.get("nodes", 1))
        if world % nodes or world < nodes:
            return out
        per_node = world // nodes
    else:
        nodes, per_node = lay.nodes, lay.per_node
    why = (f"{world} processes do not fit one node of {plan.cluster['gpus_per_node']} GPUs; "
           if lay.nodes > 1 else "tensor parallelism then crosses nodes; "
           if per_node % plan.mesh.tp else "")
    out.append(LaunchCommand(f"{nodes} nodes, {per_node} process{'es' * (per_node != 1)} each "
                             f"({why}the same command on every node; HOST is the first node's "
                             "address):", torchrun_command(script, nodes, per_node, run_id=run_id)))
    if can_be_elastic(plan):
        low = elastic_min_nodes(plan, per_node)
        if low < nodes:
            out.append(LaunchCommand(f"Elastic, {low} to {nodes} nodes (when a node is lost the "
                                     "others go on from the last --ckpt-dir checkpoint with fewer "
                                     "data-parallel ranks; it may rejoin):",
                                     torchrun_command(script, f"{low}:{nodes}", per_node,
                                                      run_id=run_id, elastic=True)
                                     + " --ckpt-dir ckpt"))
    return out


def torchrun_commands(script: str, plan: Plan, *, nodes: int | None = None) -> list[str]:
    """``torchrun`` command lines (see :func:`launch_commands`): one node with every rank when the
    plan fits one node, then several nodes sharing them, then the elastic form."""
    return [c.command for c in launch_commands(script, plan, nodes=nodes)]


def wrap_command(command: str, *, indent: int = 4, width: int = 116) -> str:
    """``command`` indented, broken with ``\\`` continuations before an option (kept with the words
    up to the next option) where a line would pass ``width``."""
    groups: list[str] = []
    for word in command.split(" "):
        if groups and not word.startswith("--") and groups[-1].startswith("--"):
            # an option's value (and, after the last option, the script and its flags)
            groups[-1] += " " + word
        else:
            groups.append(word)
    lines, line = [], " " * indent + groups[0]
    for group in groups[1:]:
        if group.startswith("--") and len(line) + len(group) + 3 > width:
            lines.append(line + " \\")
            line = " " * (indent + 4) + group
        else:
            line += " " + group
    return "\n".join([*lines, line])


def _fill(text: str) -> str:
    return textwrap.fill(text, width=116, break_on_hyphens=False, break_long_words=False)


def launch_text(script: str, plan: Plan) -> str:
    """The docstring's launch section: each command under its title."""
    blocks = [_fill(c.title) + "\n" + wrap_command(c.command)
              for c in launch_commands(script, plan)]
    if len(blocks) > 1 or layout(plan).nodes > 1:
        blocks.append(_fill("Hosts whose name does not resolve to HOST (containers, network "
                            "namespaces): add "
                                    "--rdzv-conf is_host=1 on the first node (0 elsewhere) and "
                                    "--local-addr <this node's address>; without GPUs, "
                                    "GLOO_SOCKET_IFNAME=<interface>."))
    return "\n".join(blocks)
