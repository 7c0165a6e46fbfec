"""The CPU side of an eager training step: what PyTorch spends issuing work, with nothing to
compute.

At microsecond GPU steps the host decides the step time: eager PyTorch issues every kernel from
Python, one op after another, and FSDP2, DDP, tensor parallelism, pipelining and the optimizer add
Python and dispatcher work of their own. This measures that work on this machine, in one process
that is rank 0 of PyTorch's fake process group (``torch.testing._internal.distributed.fake_pg``:
every collective returns at once, moving nothing) with tiny tensors (4 x 8: the kernels themselves
take next to no time), so what is timed is the CPU side only:

  (a) eager CPU time per op of the captured graph (a chain of tiny Linear + ReLU layers; the op
      count is the cost model's own, ``LayerProfile.n_ops``), forward, and backward per forward op;
  (b) FSDP2's (``fully_shard``, each layer a unit, then the root) extra time per unit per forward +
      backward over the plain model, ZeRO-2 (``reshard_after_forward=False``) and ZeRO-3 (with and
      without bf16 parameters);
  (c) DDP's extra per forward + backward, and per parameter tensor (its comm hook issues the
      bucket's all-reduce on the fake group);
  (d) tensor parallelism's (``parallelize_module``, Colwise/Rowwise pairs on a 1-D mesh of the fake
      world) extra per styled module, forward and backward: DTensor's dispatch of the module's ops,
      the redistribution in its hooks;
  (e) the optimizer step per parameter tensor, as ``autopar_nb/runtime/train.py`` runs it: gradient
      clipping (``runtime/optim.clip_grad_norm``) and Adam with the multi-tensor (foreach) kernels
      CUDA defaults to, over plain tensors, over FSDP2's sharded DTensors (ZeRO-3's units), and over
      ZeRO-1's as the runtime builds them (``runtime/fsdp.apply_fsdp`` without resharding after
      forward: FSDP2 is ZeRO-1, Megatron's distributed optimizer); and a step of it at no tensor;
  (f) torch's pipeline schedule (1F1B, ``torch.distributed.pipelining``) per micro-batch on a stage,
      beyond the stage's ops;
  (g) one collective call (an all-reduce of a tiny tensor) on the fake group.

Each figure is a slope: times at two sizes (layers, units, modules, tensors, micro-batches)
differenced, and a wrapper's less the plain model's at the same sizes, so what a step does once (the
loss, the backward call, the root unit) does not enter a per-unit figure. Times are the process's
CPU time (not the wall clock: the machine may be shared), each the best of many short rounds that
alternate between the variants compared, so a busy spell of the machine touches them alike. Runs
still differ by up to 10 % on a shared machine.

What a GPU host adds, which this does not measure: each op's CUDA kernel launch
(``cudaLaunchKernel`` and the CUDA caching allocator, a few microseconds of CPU per kernel) and
NCCL's enqueue of each collective in place of the fake group's immediate return; what it may take
away: faster cores. The results are the defaults of ``autopar_nb/cost/factors.py``'s ``cpu_*``
factors, of which the cost model's CPU issue time per step is made (``autopar_nb/cost/cpu.py``).

    .venv/bin/python bench/overhead.py            # prints the table (about a minute)
"""

from __future__ import annotations

import math
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this tree's autopar_nb, not an editable install's

warnings.filterwarnings("ignore")
WIDTH, BATCH, WORLD = 8, 4, 2
ROUNDS, ROUND_S = 50, 0.01


def best_times(fns: dict, *, rounds: int = ROUNDS) -> dict:
    """CPU seconds per call of each of ``fns`` (name -> function): the best of ``rounds`` rounds,
    each ``ROUND_S`` of calls of every function in turn, after a warm-up (the first calls build
    caches and optimizer states)."""
    reps = {}
    for k, fn in fns.items():
        fn(), fn()
        t0 = time.process_time()
        fn()
        reps[k] = max(1, round(ROUND_S / max(time.process_time() - t0, 1e-6)))
    best = dict.fromkeys(fns, math.inf)
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.process_time()
            for _ in range(reps[k]):
                fn()
            best[k] = min(best[k], (time.process_time() - t0) / reps[k])
    return best


def extra_per_unit(make, small: int, large: int, *, plain=None) -> tuple[float, float]:
    """(seconds per unit of size, seconds at size 0) of ``make(n)``'s function at ``n`` =
    ``small`` and ``large``, less ``plain(n)``'s (the model without the wrapper) when given."""
    fns = {("w", small): make(small), ("w", large): make(large)}
    if plain is not None:
        fns |= {("p", small): plain(small), ("p", large): plain(large)}
    t = best_times(fns)
    d = {n: t["w", n] - (t["p", n] if plain is not None else 0.0) for n in (small, large)}
    per = (d[large] - d[small]) / (large - small)
    return per, d[small] - small * per


def chain(n: int) -> nn.Sequential:
    """``n`` layers of Linear(8, 8) + ReLU, each its own Sequential (an FSDP unit, a layer)."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(n)])


def step_fn(model: nn.Module, x: torch.Tensor, *, backward: bool = True):
    """One forward (and backward) of ``model``, the gradients set to None first as
    ``optimizer.zero_grad()`` leaves them."""
    def run():
        for p in model.parameters():
            p.grad = None
        out = model(x)
        if backward:
            out.sum().backward()
    return run


def plain_chain(x, *, backward: bool = True):
    return lambda n: step_fn(chain(n), x, backward=backward)


# ---- (a) eager ops -------------------------------------------------------------------------------
def ops_per_layer() -> float:
    """Non-view ops of one chain layer (Linear + ReLU) in the captured graph: the cost model's
    ``LayerProfile.n_ops`` summed over its layers (the capture makes each leaf module a layer)."""
    import autopar_nb as ap
    from autopar_nb.cost.profile import profile_of

    with torch.device("meta"):
        model = chain(4)
    prof = profile_of(ap.capture(model, torch.randn(BATCH, WIDTH)), "cuda")
    return sum(lp.n_ops for lp in prof.layers) / 4


def eager_ops(x) -> dict[str, float]:
    per_layer = ops_per_layer()
    t = best_times({(b, n): step_fn(chain(n), x, backward=b)
                    for b in (False, True) for n in (8, 40)})
    fwd, both = ((t[b, 40] - t[b, 8]) / 32 for b in (False, True))
    return {"ops per layer (captured graph)": per_layer, "cpu_op_s": fwd / per_layer,
            "cpu_op_bwd_s": (both - fwd) / per_layer}


# ---- (b) FSDP2, (c) DDP, (d) TP ------------------------------------------------------------------
def fsdp(x, mesh, *, reshard: bool, bf16: bool = False) -> float:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                              reduce_dtype=torch.float32 if bf16 else None)

    def make(n):
        model = chain(n)
        for layer in model:
            fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
        return step_fn(model, x)

    return extra_per_unit(make, 4, 16, plain=plain_chain(x))[0]


def _all_reduce_hook(state, bucket):
    """DDP comm hook: the bucket's all-reduce issued on the fake group, the bucket handed back as
    it is (the fake group's future returns None, which DDP's reducer refuses)."""
    dist.all_reduce(bucket.buffer(), async_op=True)
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def ddp(x) -> tuple[float, float]:
    """(extra seconds per parameter tensor, extra seconds per forward + backward at none)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    def make(n):
        model = DDP(chain(n))
        model.register_comm_hook(None, _all_reduce_hook)
        return step_fn(model, x)

    per_layer, fixed = extra_per_unit(make, 4, 32, plain=plain_chain(x))
    return per_layer / 2, fixed  # 2 parameter tensors per layer


def tp(x, mesh) -> tuple[float, float]:
    """Extra seconds per styled module (a Colwise Linear(8, 16), a Rowwise Linear(16, 8)):
    (forward, backward)."""
    import torch.distributed.tensor.parallel as tensor_parallel

    def model_of(n):
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.ReLU(),
                                             nn.Linear(2 * WIDTH, WIDTH)) for _ in range(n)])

    def make(backward):
        def at(n):
            model = model_of(n)
            col, row = tensor_parallel.ColwiseParallel(), tensor_parallel.RowwiseParallel()
            tensor_parallel.parallelize_module(model, mesh, {f"{i}.{j}": style for i in range(n)
                                                             for j, style in ((0, col), (2, row))})
            return step_fn(model, x, backward=backward)
        return at

    def extra(backward):
        def plain(n):
            return step_fn(model_of(n), x, backward=backward)
        return extra_per_unit(make(backward), 2, 8, plain=plain)[0] / 2  # 2 modules per pair

    fwd = extra(False)
    return fwd, extra(True) - fwd


# ---- (e) optimizer -------------------------------------------------------------------------------
def optimizer_model(kind: str, n: int, mesh) -> nn.Sequential:
    """A chain of ``n`` layers whose parameters the optimizer steps over: plain tensors ("param"), FSDP2's
    DTensor shards under ZeRO-3 ("dtensor"), or ZeRO-1's as the exported script shards them ("zero1":
    ``runtime/fsdp.apply_fsdp``, each layer a unit and then the root, not resharded after forward)."""
    from torch.distributed.fsdp import fully_shard

    from autopar_nb.runtime.fsdp import apply_fsdp

    model = chain(n)
    if kind == "dtensor":
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif kind == "zero1":
        apply_fsdp(model, mesh, units=[str(k) for k in range(n)], reshard_after_forward=False)
    return model


def optimizer_per_tensor(x, mesh) -> dict[str, float]:
    from autopar_nb.runtime.optim import clip_grad_norm

    def make(kind):
        def at(n):
            model = optimizer_model(kind, n, mesh)
            params = list(model.parameters())
            opt = torch.optim.Adam(params, lr=1e-3, foreach=True)  # CUDA's default: the foreach kernels
            model(x).sum().backward()

            def run():
                clip_grad_norm(params, 1.0)
                opt.step()
            return run
        return at

    out = {}
    for kind in ("param", "dtensor", "zero1"):
        per_layer, fixed = extra_per_unit(make(kind), 8, 40)
        out[f"cpu_optimizer_{kind}_s"] = per_layer / 2  # 2 parameter tensors per layer
        if kind == "param":
            out["cpu_optimizer_step_s"] = fixed
    return out


# ---- (f) pipeline --------------------------------------------------------------------------------
def pipeline(x) -> float:
    """Seconds torch's pipeline schedule (1F1B, as ``runtime/pp.py`` builds it) adds per
    micro-batch on the first of 2 stages, beyond its layers' ops: a step's slope in micro-batches,
    at 4 and 16 layers, extrapolated to no layer (the schedule's actions, the sends and receives,
    the stage's backward call)."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import Schedule1F1B

    # the fake group's receives leave their buffers as they are: the stages vote for the static
    # shapes given below instead of asking each other for theirs
    PipelineStage._warmup_backward_result = (
        lambda self, received_result=None: torch.ones(1, dtype=torch.int32))

    def at(layers: int, m: int):
        stage = PipelineStage(chain(layers), 0, 2, torch.device("cpu"), input_args=(x,),
                              output_args=(torch.randn(BATCH, WIDTH, requires_grad=True),))
        schedule = Schedule1F1B(stage, m, loss_fn=lambda out, target: out.sum())
        batch = torch.randn(BATCH * m, WIDTH)
        return lambda: schedule.step(batch)

    t = best_times({(n, m): at(n, m) for n in (4, 16) for m in (2, 8)})
    per_mb = {n: (t[n, 8] - t[n, 2]) / 6 for n in (4, 16)}
    return per_mb[4] - 4 * (per_mb[16] - per_mb[4]) / 12


# ---- (g) one collective --------------------------------------------------------------------------
def collective() -> float:
    t = torch.zeros(WIDTH)

    def hundred():
        for _ in range(100):
            dist.all_reduce(t)
    return best_times({0: hundred})[0] / 100


def main() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    dist.init_process_group("fake", rank=0, world_size=WORLD, store=FakeStore())
    mesh = init_device_mesh("cpu", (WORLD,))
    x = torch.randn(BATCH, WIDTH)
    t0 = time.perf_counter()
    rows = dict(eager_ops(x))
    rows["cpu_tp_module_s"], rows["cpu_tp_module_bwd_s"] = tp(x, mesh)
    rows["cpu_fsdp_unit_s (ZeRO-2)"] = fsdp(x, mesh, reshard=False)
    rows["cpu_fsdp_unit_s (ZeRO-3)"] = fsdp(x, mesh, reshard=True)
    rows["cpu_fsdp_unit_s (ZeRO-3, bf16 parameters)"] = fsdp(x, mesh, reshard=True, bf16=True)
    rows["cpu_ddp_param_s"], rows["cpu_ddp_s"] = ddp(x)
    rows.update(optimizer_per_tensor(x, mesh))
    rows["cpu_pp_microbatch_s"] = pipeline(x)
    rows["cpu_collective_s"] = collective()
    took = time.perf_counter() - t0
    print(f"`.venv/bin/python bench/overhead.py` on {platform.machine()} ({os.cpu_count()} CPUs), "
          f"Python {platform.python_version()}, torch {torch.__version__}, fake group of {WORLD}, "
          f"tensors {BATCH} x {WIDTH}, process CPU time; {took:.0f} s\n")
    print("| figure | value |\n|---|---|")
    for k, v in rows.items():
        print(f"| {k} | {v * 1e6:.1f} us |" if k.startswith("cpu_") else f"| {k} | {v:g} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
