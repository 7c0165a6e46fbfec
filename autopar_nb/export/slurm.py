"""The sbatch script of ``export(path, target="slurm")``: one ``torchrun`` per node under ``srun``,
meeting at the first node of the allocation, checkpointing to a directory every node sees, and back
in the queue when preempted or near its time limit (the next run resumes from the newest complete
checkpoint)."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

from ..plan import Plan
from .commands import RDZV_PORT, layout

SLURM_TIME = re.compile(r"(\d+-)?\d+(:\d{2}){0,2}")
"""Slurm's --time forms: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS"""
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
"""job, partition and account names, and the script's file name"""
PATH = re.compile(r"[A-Za-z0-9_./${}-]+")
"""what a checkpoint directory may hold (environment variables included: ``$SCRATCH/ckpt``); it is
written into double quotes unquoted"""
ARG = re.compile(r"[A-Za-z0-9_.=/:,-]+")
"""what a flag for the script may hold: it is written into the single-quoted command of ``srun bash
-c``"""


def _check_name(what: str, value: str | None) -> None:
    if value is not None and not NAME.fullmatch(value):
        raise ValueError(f"{what}={value!r}: letters, digits, '_', '.', '-' only")


def sbatch_script(script: str, plan: Plan, *, nodes: int | None = None, job_name: str | None = None,
                  partition: str | None = None, account: str | None = None, time: str | None = None,
                  gpus_per_node: int | None = None, exclusive: bool = True,
                  ckpt_dir: str | None = None, ckpt_every: int = 100, requeue_before_s: int = 120,
                  script_args: tuple[str, ...] = ()) -> str:
    """The batch script for running ``script`` (a file name, beside the batch script) with ``plan``.

    ``nodes``: how many nodes share the plan's processes (default: one when the plan fits a node,
    else the plan's cluster; it must divide the world size). ``gpus_per_node``: GPUs to request per
    node (default: the processes per node for GPU plans, none for CPU plans). ``ckpt_dir``: where
    DCP checkpoints go (default ``$SLURM_SUBMIT_DIR/<script stem>-ckpt``; ``$CKPT_DIR`` at
    submission overrides it); it must be on a filesystem every node sees. ``requeue_before_s``:
    seconds before the time limit at which the job puts itself back in the queue. ``script_args``:
    more flags for the script (``("--steps", "1000")``).
    """
    nodes, per_node, gpus = _nodes(plan, nodes, gpus_per_node)
    stem = Path(script).stem
    job_name = job_name or stem
    _check_inputs(script=script, job_name=job_name, partition=partition, account=account,
                  ckpt_dir=ckpt_dir, time=time, ckpt_every=ckpt_every,
                  requeue_before_s=requeue_before_s, script_args=script_args)
    options = _sbatch_options(job_name=job_name, nodes=nodes, gpus=gpus, exclusive=exclusive,
                              partition=partition, account=account, time=time,
                              requeue_before_s=requeue_before_s)
    torchrun = _torchrun_command(script, per_node, ckpt_every, script_args)
    intro = (f"Slurm batch job for {script} ({plan.summary()}; the plan is {stem}.plan.json), "
             f"written by autopar-nb. Submit it from the directory that holds {script}: sbatch "
             f"{stem}.sbatch. {nodes} node{'s' * (nodes != 1)} x {per_node} "
             f"process{'es' * (per_node != 1)}: srun starts one torchrun per node, and they meet "
             "at the first node (c10d rendezvous). A requeued run resumes from the newest complete "
             "checkpoint in CKPT_DIR.")
    return "\n".join([
        "#!/bin/bash",
        *textwrap.wrap(intro, width=118, initial_indent="# ", subsequent_indent="# ",
                       break_on_hyphens=False, break_long_words=False),
        *(o if o.startswith("#") else f"#SBATCH {o}" for o in options),
        "",
        *_job_body(ckpt_dir or f"$SLURM_SUBMIT_DIR/{stem}-ckpt", torchrun),
    ])


def _nodes(plan: Plan, nodes: int | None, gpus_per_node: int | None) -> tuple[int, int, int]:
    """(nodes, processes per node, GPUs to request per node) for ``plan``, checked."""
    lay = layout(plan)
    world = plan.mesh.world_size
    nodes = nodes or lay.nodes
    if nodes < 1 or world % nodes:
        raise ValueError(f"nodes={nodes} must divide the plan's {world} processes")
    per_node = world // nodes
    gpus = gpus_per_node if gpus_per_node is not None else (per_node if lay.gpus else 0)
    if gpus and gpus < per_node:
        raise ValueError(f"{per_node} processes per node need {per_node} GPUs per node, not {gpus}")
    return nodes, per_node, gpus


def _check_inputs(*, script: str, job_name: str, partition: str | None, account: str | None,
                  ckpt_dir: str | None, time: str | None, ckpt_every: int, requeue_before_s: int,
                  script_args: tuple[str, ...]) -> None:
    """Every value written into the batch script holds only what its place there reads literally."""
    for what, value in (("script", script), ("job_name", job_name), ("partition", partition),
                        ("account", account)):
        _check_name(what, value)
    if ckpt_dir is not None and not PATH.fullmatch(ckpt_dir):
        raise ValueError(f"ckpt_dir={ckpt_dir!r}: letters, digits, '_', '.', '/', '-' and "
                         "$VARIABLES only")
    if time is not None and not SLURM_TIME.fullmatch(time):
        raise ValueError(f"time={time!r} is not a Slurm time limit (minutes, HH:MM:SS or "
                         "D-HH:MM:SS)")
    if ckpt_every < 1 or requeue_before_s < 0:
        raise ValueError("ckpt_every must be >= 1 and requeue_before_s >= 0")
    for arg in script_args:
        if not ARG.fullmatch(arg):
            raise ValueError(f"script_args: {arg!r} holds characters a shell would read (letters, "
                             "digits and _.=/:,- only)")


def _sbatch_options(*, job_name: str, nodes: int, gpus: int, exclusive: bool, partition: str | None,
                    account: str | None, time: str | None, requeue_before_s: int) -> list[str]:
    """The ``#SBATCH`` options, with comment lines (starting with ``#``) between them."""
    return [f"--job-name={job_name}",
            f"--nodes={nodes}",
            "# one torchrun per node; it starts the node's processes",
            "--ntasks-per-node=1",
            *([f"--gpus-per-node={gpus}"] if gpus else []),
            *(["# whole nodes: the job uses every core and GPU of them", "--exclusive"] if exclusive
              else []),
            *([f"--partition={partition}"] if partition else []),
            *([f"--account={account}"] if account else []),
            *([f"--time={time}"] if time else []),
            "# preempted, or a node failed: back in the queue (it resumes from CKPT_DIR)",
            "--requeue",
            f"# {requeue_before_s} s before the time limit, USR1 to this script: it requeues "
            "itself (trap below)", f"--signal=B:USR1@{requeue_before_s}",
            "# a requeued run adds to the same log",
            "--open-mode=append",
            f"--output={job_name}-%j.out"]


def _torchrun_command(script: str, per_node: int, ckpt_every: int,
                      script_args: tuple[str, ...]) -> str:
    """The node's torchrun, as ``srun bash -c`` runs it on every node."""
    flags = " ".join(script_args)
    script_path = f"$SLURM_SUBMIT_DIR/{script}"
    return (f"exec torchrun --nnodes \"$SLURM_NNODES\" --nproc-per-node {per_node} \\\n"
            "    --rdzv-backend c10d --rdzv-endpoint \"$RDZV_HOST:$RDZV_PORT\" --rdzv-id "
            "\"$SLURM_JOB_ID\" \\\n    --rdzv-conf is_host=$((SLURM_NODEID == 0)) --local-addr "
            f"\"$(node_addr \"$SLURMD_NODENAME\")\" \\\n    \"{script_path}\" --ckpt-dir "
            f"\"$CKPT_DIR\" --ckpt-every {int(ckpt_every)}" + (f" {flags}" if flags else ""))


def _job_body(ckpt: str, torchrun: str) -> list[str]:
    """The job's shell lines: the checkpoint directory, the rendezvous address, the requeue trap and
    the srun."""
    return [
        "set -euo pipefail",
        f"export CKPT_DIR=\"${{CKPT_DIR:-{ckpt}}}\"  # DCP checkpoints: on a filesystem every node "
        "sees",
        "node_addr() {  # the address Slurm reaches a node at (its NodeAddr)",
        "    scontrol show node \"$1\" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p'",
        "}",
        "export -f node_addr",
        "export RDZV_HOST=\"$(node_addr \"$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head "
        "-n 1)\")\"",
        f"export RDZV_PORT=\"$(({RDZV_PORT} + SLURM_JOB_ID % 1000))\"  # one port per job, should "
        "jobs share a node",
        "echo \"job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST\"",
        "echo \"rendezvous at $RDZV_HOST:$RDZV_PORT, checkpoints in $CKPT_DIR\"",
        "",
        "# near the time limit (--signal above) Slurm sends USR1: back in the queue; the next run "
        "resumes from CKPT_DIR",
        "trap 'echo \"requeueing job $SLURM_JOB_ID\"; scontrol requeue \"$SLURM_JOB_ID\"' USR1",
        "",
        "# the node's rank decides who hosts the rendezvous, and the address Slurm knows the node "
        "by is the one",
        "# torchrun gives its peers: neither depends on how host names resolve",
        "srun --kill-on-bad-exit=1 bash -c '" + torchrun + "' &",
        "wait $!  # in the background, so that the USR1 trap runs at once",
        "",
    ]
