"""Predicted per-rank peak memory against PyTorch's own trackers (FSDPMemTracker / MemTracker) with the fake process
group and FakeTensorMode: one process measures one rank of a world of 2-8 without devices.

The model is GPT-2 sized in width (d=768, vocab 50257/50304, seq 512, micro-batch 2) with 4 layers instead of 12 to
keep the test short; TP uses a LLaMA-style block (separate q/k/v, 16 heads so that TP=8 divides them), because
nanoGPT's fused c_attn split by ``split(n_embd)`` is not TP-compatible as written. The checks run in a subprocess
(the fake process group is global state) and compare predicted peak (the cost model's total minus its allocator
margin, which a tracker does not see) with the tracked peak of the second training step.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

B, T, LAYERS = 2, 512, 4
CASES = [("fsdp", 2), ("fsdp", 4), ("fsdp", 8), ("tp_sp", 2), ("tp_sp", 4), ("tp_sp", 8),
         ("tp", 2), ("tp", 4), ("tp", 8)]


def _tp_styles(plan, sp):
    """The plan's TP styles as PyTorch ParallelStyles, torchtitan-style: the parent of colwise Linears gathers the
    sequence-sharded input once (PrepareModuleInput)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    seq = Shard(1) if sp else Replicate()
    layers = {lp.path for lp in plan.layers}
    styles = {}
    for mod, st in plan.tp_plan.items():
        parent = mod.rsplit(".", 1)[0]
        if st == "colwise" and mod in layers:  # the vocab-parallel head: loss on sharded logits
            styles[mod] = ColwiseParallel(input_layouts=seq, use_local_output=False)
        elif st == "colwise":
            styles[mod] = ColwiseParallel()
            if sp:
                styles[parent] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
        elif st == "rowwise" and mod in layers:  # vocab-parallel embedding
            styles[mod] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
        elif st == "rowwise":
            styles[mod] = RowwiseParallel(output_layouts=seq)
        elif st == "sequence_parallel":
            styles[mod] = SequenceParallel()
    return styles


def _run_case(kind: str, world: int) -> dict:
    import torch
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    import autopar_nb as ap
    from autopar_nb import zoo
    from autopar_nb.cost import estimate

    if kind == "fsdp":
        cfg = zoo.GPTConfig(n_layer=LAYERS)
        build, vocab = (lambda: zoo.GPT(cfg)), cfg.vocab_size
        fix = {"dp": world, "tp": 1, "zero_stage": 3}
    else:
        cfg = zoo.LlamaConfig(vocab_size=50304, dim=768, n_layers=LAYERS, n_heads=16, n_kv_heads=16, ffn_dim=3072)
        build, vocab = (lambda: zoo.Llama(cfg)), cfg.vocab_size
        fix = {"dp": 1, "tp": world, "zero_stage": 0, "sequence_parallel": kind == "tp_sp"}
    with torch.device("meta"):
        meta_model = build()
    graph = ap.capture(meta_model, torch.randint(0, vocab, (B, T)))
    cluster = ap.Cluster.preset("cpu", 1, world)
    plan = ap.plan(graph, cluster, global_batch=B * fix["dp"], fix={**fix, "pp": 1, "amp": "none",
                                                                     "micro_batches": 1, "recompute": "none"})
    mesh = init_device_mesh("cpu", (world,))
    with FakeTensorMode():
        torch.manual_seed(0)
        model = build()
        if kind == "fsdp":
            # the order matters: each layer its own unit first, then the root
            for lp in plan.layers:
                if lp.fsdp:
                    fully_shard(model.get_submodule(lp.path), mesh=mesh)
            fully_shard(model, mesh=mesh)
        else:
            parallelize_module(model, mesh, _tp_styles(plan, kind == "tp_sp"))
        optim = torch.optim.Adam(model.parameters(), lr=1e-3)
        x, y = torch.randint(0, vocab, (B, T)), torch.randint(0, vocab, (B, T))
        tracker = FSDPMemTracker(model, optim) if kind == "fsdp" else MemTracker()
        if kind == "fsdp":
            tracker.track_inputs((x,))
        else:
            tracker.track_external(model, optim)
        with tracker:
            for step in range(2):
                if kind == "fsdp":
                    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                    loss.backward()
                else:
                    with loss_parallel():
                        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                        loss.backward()
                optim.step()
                optim.zero_grad()
                if step == 0:
                    tracker.reset_mod_stats()
        tracked = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    mb = estimate(graph, cluster, plan).memory_by_rank[0]
    return {"kind": kind, "world": world, "predicted": mb.total - mb.margin, "tracked": tracked,
            "plan": plan.summary()}


def _worker() -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=max(w for _, w in CASES), store=FakeStore())
    for kind, world in CASES:
        if kind != "fsdp":
            # the first DTensor run on a mesh of a given size shows 0.15-0.6 GB of extra optimizer temporaries in
            # MemTracker that an identical second run does not (one-time caches): measure the steady state
            _run_case(kind, world)
        print(json.dumps(_run_case(kind, world)), flush=True)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results() -> dict:
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=600)
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            out[(r["kind"], r["world"])] = r
    if len(out) != len(CASES):
        raise AssertionError(f"tracker worker failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    return out


@pytest.mark.parametrize("kind, world", CASES)
def test_predicted_peak_matches_tracker(results, kind, world):
    r = results[(kind, world)]
    assert r["predicted"] == pytest.approx(r["tracked"], rel=0.10), r


if __name__ == "__main__":
    _worker()
