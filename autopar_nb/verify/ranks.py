"""A verify's ranks: each imports the plan's exported script and runs its ``main`` with a
:class:`Recorder` (the observer the script's ``train`` calls), which keeps the loss, the full
gradients and the full parameters of every step, and what the rank held. :func:`worker` is the entry
point the elastic launch starts on every rank.
"""

from __future__ import annotations

import contextlib
import io
import os

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from ..export.files import run_script
from ..plan import Plan
from ..randomness import RandomOff

# at the top: a warm standby's forkserver preloads this module, and so what every rank calls
from ..runtime.amp import exact_fp32
from ..runtime.fsdp import on_mesh_device
from ..runtime.init import canonical_name
from ..runtime.mesh import init_distributed


class Recorder:
    """The observer verify hands to the script's ``main``: after each backward the loss and the full
    gradients, after each optimizer step the full parameters (DTensors gathered: every rank takes
    part). Only the ranks at data-parallel and tensor-parallel index 0 keep them (one per pipeline
    stage). Expert parallelism splits the dp dim into (dp_mod_ep, ep) without reordering ranks, so
    the dp index stays ``(rank // tp) % dp``; the experts, DTensors over their ep ranks, are
    gathered like any other."""

    def __init__(self, plan: Plan, rank: int):
        m, self.plan = plan.mesh, plan
        self.keeps = (rank // m.tp) % m.dp == 0 and rank % m.tp == 0
        self.result: dict = {"losses": [], "grads": [], "params": [], "info": {}}

    def after_backward(self, step: int, parts: list, loss: float) -> None:
        self.result["losses"].append(loss)
        grads = named_tensors(parts, "grad")
        if self.keeps:
            self.result["grads"].append(grads)

    def after_step(self, step: int, parts: list) -> None:
        params = named_tensors(parts, "param")
        if self.keeps:
            self.result["params"].append(params)
        self.result["info"] = rank_info(parts, self.plan)


def named_tensors(parts: list, what: str) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters or gradients of this rank's parts, by the names of the
    single-process model. Collective: every rank of the mesh calls it (CPU offload's host shards are
    reduced on the mesh's device)."""
    from torch.distributed.tensor import DTensor

    named = [(n, p.grad if what == "grad" else p.detach()) for part in parts
             for n, p in part.named_parameters()]
    return {
        canonical_name(n): (on_mesh_device(t).full_tensor()
                            if isinstance(t, DTensor) else t).detach().float().cpu().clone()
        for n, t in named if t is not None
    }


def rank_info(parts: list, plan: Plan) -> dict:
    """What this rank holds: ``local_numel`` (parameter elements stored here), ``dtensor_params``
    (parameters sharded/replicated as DTensors), ``checkpointed`` (checkpoint-wrapped modules),
    ``stages`` (the pipeline stages whose first layer one of its parts holds), ``offloaded`` (FSDP
    units under ``CPUOffloadPolicy``)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
    from torch.distributed.tensor import DTensor

    params = [p for part in parts for p in part.parameters()]
    names = [canonical_name(n) for part in parts for n, _ in part.named_parameters()]
    firsts = [layers[0] for layers in plan.stage_layers()] if plan.mesh.pp > 1 else []
    return {
        "local_numel": sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params),
        "dtensor_params": sum(isinstance(p, DTensor) for p in params),
        "checkpointed": sum(isinstance(m, CheckpointWrapper) for part in parts
                            for m in part.modules()),
        "stages": [i for i, first in enumerate(firsts)
                   if any(n.startswith(first + ".") for n in names)],
        "offloaded": sum(isinstance(getattr(m._get_fsdp_state()._fsdp_param_group, "offload_policy",
                                            None),
                                    CPUOffloadPolicy) for part in parts for m in part.modules()
                         if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_group)}


def script_argv(ns: dict, steps: int) -> list[str]:
    """The flags verify runs an exported script with (``ns``: its namespace): ``steps`` steps, and
    for a script that reads the cell's dataset no DataLoader worker processes (``--num-workers 0``):
    the reference reads the samples in-process, and workers forked from every rank would only add
    start-up time and processes to a short check."""
    return ["--steps", str(steps)] + (["--num-workers", "0"] if "DataStream" in ns else [])


@record
def worker(jobs: list[tuple[str, str, str]], steps: int) -> list[dict]:
    """One rank: import each exported script and run its ``main`` with a :class:`Recorder`, its
    model's random ops switched off as in the reference; every script shares one process group."""
    import gc

    import torch.distributed as dist

    torch.set_num_threads(1)  # 2+ ranks on a few cores: more threads only oversubscribe
    exact_fp32()  # as the reference: no TF32 on a GPU
    results = []
    # one group for every script (each main() finds it and leaves it open)
    init_distributed(timeout_s=300)
    try:
        for script, _, plan_json in jobs:
            ns, runtime = run_script(script, run_name="__autopar_verify__")
            recorder = Recorder(Plan.from_json(plan_json), int(os.environ["RANK"]))
            runtime.Run.observer = recorder  # train() calls it on every rank
            # active in module forwards only: meta_init's initialisation and the batches keep their
            # randomness the script's per-step lines
            with RandomOff(), contextlib.redirect_stdout(io.StringIO()):
                ns["main"](script_argv(ns, steps))
            results.append(recorder.result)
            del ns, runtime
            gc.collect()
    finally:
        gc.collect()  # a gloo thread taking the GIL during shutdown aborts ~20% of exits otherwise
        if dist.is_initialized():
            dist.destroy_process_group()
    return results
