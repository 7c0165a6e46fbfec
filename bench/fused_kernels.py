"""CPU figures of kernels_ext's fused kernels (issue 16): peak memory and time of one loss step (forward + backward
of head and loss) at vocab 128256 x 2048 tokens x hidden 2048 (LLaMA-3.2 1B's head), fused vs
``F.cross_entropy(h @ W.T)``; and the fused RMSNorm (``plan.fused_norm``) against Hugging Face's eager LlamaRMSNorm:
the bytes autograd keeps for backward and the forward + backward time of a stack of norms (``--norm``).

Each variant runs in a fresh interpreter; its peak is the process's peak RSS (``ru_maxrss``) minus its RSS once
the inputs exist, so it counts everything the step allocates (logits, softmax, gradients of hidden and weight).

    .venv/bin/python bench/fused_kernels.py            # print
    .venv/bin/python bench/fused_kernels.py --write    # and replace the section of BENCHMARKS.md
    .venv/bin/python bench/fused_kernels.py --norm     # only the RMSNorm figures (about a minute)
    python bench/fused_kernels.py --cuda               # on a CUDA host: the loss step in bf16, fused vs unfused
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SECTION = "Fused linear + cross-entropy and compile, CPU (issue 16)"

CHILD = """
import json, resource, sys, time, psutil, torch, torch.nn.functional as F
import kernels_ext
variant, n, h, v = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
hidden = torch.randn(n, h).requires_grad_()
weight = (torch.randn(v, h) / h**0.5).requires_grad_()
target = torch.randint(0, v, (n,))
base = psutil.Process().memory_info().rss
t0 = time.perf_counter()
if variant == "fused":
    loss = kernels_ext.linear_cross_entropy(hidden, weight, target)
else:
    loss = F.cross_entropy(hidden @ weight.t(), target)
loss.backward()
dt = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"variant": variant, "loss": loss.item(), "peak_bytes": peak - base, "seconds": dt,
                  "grad_norm": hidden.grad.norm().item()}))
"""


CHILD_TP = """
import json, math, os, resource, sys, time, psutil, torch, torch.distributed as dist
import kernels_ext
n, h, v = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
hidden = torch.randn(n, h).requires_grad_()
rows = math.ceil(v / world)
start = rank * rows
g = torch.Generator().manual_seed(1)
weight = torch.cat([torch.randn(min(rows, v - lo), h, generator=g) / h**0.5 for lo in range(0, v, rows)][rank:rank + 1])
weight.requires_grad_()
target = torch.randint(0, v, (n,))
dist.barrier()
base = psutil.Process().memory_info().rss
t0 = time.perf_counter()
loss = kernels_ext.vocab_parallel_linear_cross_entropy(hidden, weight, target, start=start, vocab=v)
loss.backward()
dt = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"rank": rank, "loss": loss.item(), "peak_bytes": peak - base, "seconds": dt}))
dist.destroy_process_group()
"""


def measure_vocab_parallel(n: int, h: int, v: int, world: int = 2) -> list[dict]:
    """The vocab-parallel loss step on ``world`` gloo processes (each its ``v / world`` rows of the weight; seeded
    as :data:`CHILD` seeds the hidden states and targets, so the loss is the same one): per rank {"rank", "loss",
    "peak_bytes", "seconds"}. The weight's rows differ from :data:`CHILD`'s draw, so its loss differs too."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world)}
    procs = [subprocess.Popen([sys.executable, "-c", CHILD_TP, str(n), str(h), str(v)], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, env=env | {"RANK": str(r)}) for r in range(world)]
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a rank failed: {[p.returncode for p in procs]}")
    return [json.loads(o.strip().splitlines()[-1]) for o in outs]


def vocab_parallel_table(n: int = 2048, h: int = 2048, v: int = 128_256) -> str:
    """Per-rank peak of the vocab-parallel fused loss step on 2 gloo processes, as markdown."""
    gib = 2**30
    rows = measure_vocab_parallel(n, h, v)
    lines = [f"Vocab-parallel fused loss step, 2 gloo processes on this machine, each with {-(-v // 2)} of the {v} "
             f"rows, {n} tokens x hidden {h}, fp32:", "", "| rank | peak above inputs | time | loss |",
             "|---|---|---|---|"]
    lines += [f"| {r['rank']} | {r['peak_bytes'] / gib:.2f} GiB | {r['seconds']:.1f} s | {r['loss']:.5f} |"
              for r in rows]
    return "\n".join(lines)


def measure_loss_step(variant: str, n: int, h: int, v: int) -> dict:
    """One loss step in a fresh interpreter: {"variant", "loss", "peak_bytes", "seconds", "grad_norm"}."""
    out = subprocess.run([sys.executable, "-c", CHILD, variant, str(n), str(h), str(v)], capture_output=True,
                         text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def machine() -> str:
    import torch

    return (f"{platform.machine()} CPU, {os.cpu_count()} cores (shared with other jobs), torch {torch.__version__}, "
            f"{datetime.date.today().isoformat()}")


def fused_ce_table(n: int = 2048, h: int = 2048, v: int = 128_256) -> tuple[str, dict]:
    """The markdown table of the fused vs unfused loss step, and the raw figures."""
    rows = {name: measure_loss_step(name, n, h, v) for name in ("unfused", "fused")}
    gib = 2**30
    lines = [f"Loss step (forward + backward of head and loss), {n} tokens x hidden {h} x vocab {v}, fp32 "
             f"(weight {v * h * 4 / gib:.2f} GiB, full logits {n * v * 4 / gib:.2f} GiB):", "",
             "| variant | peak above inputs | time | loss |", "|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['peak_bytes'] / gib:.2f} GiB | {r['seconds']:.1f} s | {r['loss']:.5f} |")
    saved = rows["unfused"]["peak_bytes"] - rows["fused"]["peak_bytes"]
    lines += ["", f"Saved: {saved / gib:.2f} GiB ({saved / rows['unfused']['peak_bytes']:.0%} of the unfused peak); "
              "both peaks include the weight's gradient "
              f"({v * h * 4 / gib:.2f} GiB) and the hidden's ({n * h * 4 / gib:.3f} GiB)."]
    return "\n".join(lines), rows


def _norm_stack(fused: bool, hidden: int, depth: int):
    """``depth`` Hugging Face LlamaRMSNorms in a row with residual adds, as a model's blocks hold them; ``fused``:
    their forward replaced by ``runtime/fused_norm.py``'s ``apply_fused_norm`` (kernels_ext's op)."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from autopar_nb.runtime.fused_norm import apply_fused_norm

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norms = torch.nn.ModuleList(LlamaRMSNorm(hidden, eps=1e-5) for _ in range(depth))

        def forward(self, x):
            for norm in self.norms:
                x = x + norm(x)
            return x

    stack = Stack()
    if fused:
        apply_fused_norm(stack)
    return stack


def measure_norms(fused: bool, n: int, h: int, depth: int, *, reps: int, amp: bool = False) -> dict:
    """Saved bytes (``saved_tensors_hooks``: every tensor autograd packs, each storage once) and the median forward +
    backward time over ``reps`` of a stack of ``depth`` norms on ``n`` x ``h`` float32 inputs."""
    import statistics
    import time

    import torch

    stack = _norm_stack(fused, h, depth)
    x = torch.randn(1, n, h, generator=torch.Generator().manual_seed(0)).requires_grad_()
    own = {p.untyped_storage().data_ptr() for p in stack.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in own:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        out = stack(x)
    out.sum().backward()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            out = stack(x)
        out.sum().backward()
        times.append(time.perf_counter() - t0)
    return {"saved_bytes": sum(seen.values()), "seconds": statistics.median(times), "out": out.detach()}


def norm_table(n: int = 2048, h: int = 2048, depth: int = 16, reps: int = 10) -> str:
    """The markdown table of eager vs fused RMSNorms on the CPU, and the closed form of their saved bytes."""
    import torch

    torch.manual_seed(0)
    rows = {}
    for fused in (False, True):
        rows[fused] = measure_norms(fused, n, h, depth, reps=reps)
    same = torch.allclose(rows[True]["out"], rows[False]["out"], rtol=1e-5, atol=1e-5)
    mib = 2**20
    per = {True: n * h * 4 + n * 4, False: 2 * n * h * 4 + n * 4}  # x + rstd (+ the normalised input)
    lines = [f"{depth} LlamaRMSNorms (hidden {h}) with residual adds, {n} tokens, fp32, forward + backward, median of "
             f"{reps} (torch threads: {torch.get_num_threads()}):", "",
             "| norms | saved for backward | closed form | forward + backward |", "|---|---|---|---|"]
    for fused in (False, True):
        r = rows[fused]
        lines.append(f"| {'fused (kernels_ext.rms_norm)' if fused else 'eager (HF LlamaRMSNorm)'} | "
                     f"{r['saved_bytes'] / mib:.1f} MiB | {depth * per[fused] / mib:.1f} MiB | "
                     f"{r['seconds'] * 1e3:.0f} ms |")
    lines += ["", f"Outputs equal to 1e-5: {same}. Saved per norm: {(per[False] - per[True]) / mib:.1f} MiB "
              f"({n} x {h} x 4 bytes, the normalised input)."]
    return "\n".join(lines)


def planner_table(seq: int = 8192, gpus: int = 8) -> str:
    """The planner's predicted peak per GPU with and without plan.fused_loss for LLaMA-3 8B (vocab 128256) at
    ``seq`` tokens per sample on one node of H100-80GB: ZeRO-3 over ``gpus`` ranks, 1 sample per rank, no
    recompute (fixed, so the two differ only by the loss), then the planner's own choice."""
    import torch

    import autopar_nb as ap
    from autopar_nb import zoo

    with torch.device("meta"):
        model = zoo.Llama(zoo.LLAMA3_8B)
    graph = ap.capture(model, torch.randint(0, 128256, (1, seq), device="meta"))
    cluster = ap.Cluster.preset("h100-80gb", 1, gpus)
    fix = {"dp": gpus, "zero_stage": 3, "micro_batches": 1, "recompute": "none"}
    lines = [f"Planner, LLaMA-3 8B (vocab 128256), {seq} tokens x 1 sample per GPU, {gpus} x h100-80gb, bf16, "
             f"fix {fix} (predicted, not measured):", "", "| loss | predicted peak per GPU | step |", "|---|---|---|"]
    for fused in (False, True):
        lines.append(_planner_row("fused" if fused else "unfused", ap, graph, cluster, gpus,
                                  fix | {"fused_loss": fused}))
    tp_fix = {"dp": 1, "tp": gpus, "micro_batches": 1, "recompute": "none"}
    lines += ["", f"The same model with tensor parallelism, fix {tp_fix}, 1 sample per step (the unfused head "
              "vocab-parallel with torch's loss_parallel; the fused one kernels_ext's vocab-parallel op):", "",
              "| loss | predicted peak per GPU | step |", "|---|---|---|"]
    for fused in (False, True):
        lines.append(_planner_row("fused, vocab-parallel" if fused else "unfused, loss_parallel", ap, graph, cluster,
                                  1, tp_fix | {"fused_loss": fused}))
    return "\n".join(lines)


def _planner_row(name: str, ap, graph, cluster, batch: int, fix: dict) -> str:
    """One row of :func:`planner_table`: the plan's predicted peak and step, or why nothing fits."""
    try:
        plan = ap.plan(graph, cluster, global_batch=batch, fix=fix)
    except ap.PlanError as e:
        return f"| {name} | does not fit: {str(e).split(':')[0]} | - |"
    return f"| {name} | {plan.cost.peak_memory_bytes / 2**30:.2f} GiB | {plan.cost.step_time_s * 1e3:.1f} ms |"


def cuda_loss_step(n: int = 8192, h: int = 2048, v: int = 128_256, reps: int = 5) -> str:
    """The loss step on one CUDA GPU under bf16 autocast (float32 master weights, as the runtime trains), LLaMA-3.2
    1B's head at 4 x 2048 tokens: unfused ``F.cross_entropy(h @ W.T)`` vs kernels_ext's fused op (its inputs cast
    to bf16 as the runtime's fused head casts them): milliseconds (median of ``reps`` after a warm-up, CUDA
    events), peak memory above the inputs, and the fused loss's and gradients' relative differences from the
    unfused ones. Markdown."""
    import statistics

    import torch
    import torch.nn.functional as F

    import kernels_ext

    torch.manual_seed(0)
    hidden, target = torch.randn(n, h, device="cuda"), torch.randint(0, v, (n,), device="cuda")
    weight = torch.randn(v, h, device="cuda") / h**0.5

    def step(fused: bool):
        x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cuda", torch.bfloat16):
            if fused:
                loss = kernels_ext.linear_cross_entropy(x.to(torch.bfloat16), w.to(torch.bfloat16), target)
            else:
                loss = F.cross_entropy(x @ w.t(), target)
        loss.backward()
        return loss.detach().float(), x.grad, w.grad

    rows, ref = [], None
    for fused in (False, True):
        out = step(fused)  # warm-up (and the figures compared)
        times = []
        for _ in range(reps):
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(fused)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        peak = torch.cuda.max_memory_allocated() - base
        ref = ref or out
        diff = [float((a - b).norm() / b.norm()) for a, b in zip(out, ref, strict=True)]
        rows.append(f"| {'fused' if fused else 'unfused'} | {statistics.median(times):.1f} ms | "
                    f"{peak / 2**30:.2f} GiB | {diff[0]:.1e} / {diff[1]:.1e} / {diff[2]:.1e} |")
    name = torch.cuda.get_device_name()
    return "\n".join([f"Loss step on one {name}, bf16 autocast, {n} tokens x hidden {h} x vocab {v}, torch "
                      f"{torch.__version__}:", "", "| variant | time | peak above inputs | relative difference from "
                      "unfused: loss / hidden grad / weight grad |", "|---|---|---|---|", *rows])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help="replace the section of BENCHMARKS.md")
    p.add_argument("--planner", action="store_true", help="print only the planner's figures (seconds)")
    p.add_argument("--norm", action="store_true", help="print only the fused RMSNorm's figures (a minute)")
    p.add_argument("--tp", action="store_true", help="print only the vocab-parallel loss step on 2 processes")
    p.add_argument("--cuda", action="store_true", help="print only the loss step on one CUDA GPU, bf16 (seconds)")
    args = p.parse_args()
    if args.cuda:
        print(f"`python bench/fused_kernels.py --cuda` — {datetime.date.today().isoformat()}.\n\n{cuda_loss_step()}")
        return
    if args.planner:
        print(planner_table())
        return
    if args.tp:
        print(f"`.venv/bin/python bench/fused_kernels.py --tp` — {machine()}.\n\n{vocab_parallel_table()}")
        return
    if args.norm:
        print(f"`.venv/bin/python bench/fused_kernels.py --norm` — {machine()}.\n\n{norm_table()}")
        return
    table, _ = fused_ce_table()
    table += "\n\n" + vocab_parallel_table() + "\n\n" + planner_table() + "\n\n" + norm_table()
    body = f"## {SECTION}\n\n`.venv/bin/python bench/fused_kernels.py --write` — {machine()}.\n\n{table}\n"
    print(body)
    if args.write:
        sys.path.insert(0, str(ROOT / "bench"))
        from capture import write_section

        write_section(SECTION, body)


if __name__ == "__main__":
    main()
