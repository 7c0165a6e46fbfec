"""Predicted per-rank peak memory against PyTorch's own trackers (FSDPMemTracker / MemTracker) with the fake process
group and FakeTensorMode: one process measures one rank of a world of 2-8 without devices.

The model is GPT-2 sized in width (d=768, vocab 50257/50304, seq 512, micro-batch 2) with 4 layers instead of 12 to
keep the test short; TP uses a LLaMA-style block (separate q/k/v, 16 heads so that TP=8 divides them). The plan is
applied by its exported script (``parallelize``: TP styles, FSDP units, in the script's order), so what is measured is
what a user runs, not a mapping of this test's own. The checks run in a subprocess (the fake process group is global
state) and compare predicted peak (the cost model's total minus its allocator margin, which a tracker does not see)
with the tracked peak of the second training step.
"""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

B, T, LAYERS = 2, 512, 4
CASES = [("fsdp", 2), ("fsdp", 4), ("fsdp", 8), ("tp_sp", 2), ("tp_sp", 4), ("tp_sp", 8),
         ("tp", 2), ("tp", 4), ("tp", 8)]
GPT_CELL = f"""\
import torch
from autopar_nb.zoo import GPT, GPTConfig

model = GPT(GPTConfig(n_layer={LAYERS}))
example_inputs = (torch.randint(0, 50257, ({B}, {T})),)
"""
LLAMA_CELL = f"""\
import torch
from autopar_nb.zoo import Llama, LlamaConfig

model = Llama(LlamaConfig(vocab_size=50304, dim=768, n_layers={LAYERS}, n_heads=16, n_kv_heads=16, ffn_dim=3072))
example_inputs = (torch.randint(0, 50304, ({B}, {T})),)
"""
_SCRIPTS: dict = {}


def _parallelize(src, plan, key):
    """The ``parallelize(model, mesh, device)`` of ``plan``'s exported script (exported once per case)."""
    from autopar_nb.export import export

    if key not in _SCRIPTS:
        with tempfile.TemporaryDirectory(prefix="memtracker-") as tmp:
            script = export(src, plan, Path(tmp) / "train.py", quiet=True, single_file=True).script
            _SCRIPTS[key] = runpy.run_path(str(script), run_name="under_test")  # its cell runs; main does not
    return _SCRIPTS[key]["parallelize"]


def _run_case(kind: str, world: int) -> dict:
    import torch
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    import autopar_nb as ap
    from autopar_nb.cost import estimate
    from autopar_nb.source import ModelSource

    if kind == "fsdp":
        src, fix = ModelSource(GPT_CELL), {"dp": world, "tp": 1, "zero_stage": 3}
    else:
        src, fix = ModelSource(LLAMA_CELL), {"dp": 1, "tp": world, "zero_stage": 0,
                                             "sequence_parallel": kind == "tp_sp"}
    meta_model, example, _ = src.build(device="meta")
    vocab = next(m for m in meta_model.modules() if isinstance(m, torch.nn.Embedding)).num_embeddings  # token table
    graph = ap.capture(meta_model, example)
    cluster = ap.Cluster.preset("cpu", 1, world)
    plan = ap.plan(graph, cluster, global_batch=B * fix["dp"], fix={**fix, "pp": 1, "amp": "none",
                                                                     "micro_batches": 1, "recompute": "none"})
    parallelize = _parallelize(src, plan, (kind, world))
    # the script's (pp, dp, tp) mesh, on `world` of the fake process group's ranks
    mesh = init_device_mesh("cpu", (1, fix["dp"], fix["tp"]), mesh_dim_names=("pp", "dp", "tp"))
    with FakeTensorMode():
        model, _, _ = src.build()
        (model,) = parallelize(model, mesh, "cpu")
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


FAKE_LOSS_PARALLEL = ("FakeTensorMode shows loss_parallel's backward holding ~1.25 x the full logits more than real "
                      "tensors do (measured on this head, tp 4: 433 vs 187 MiB of temporaries); the cost model follows "
                      "real tensors: the exported script's own step on this model at tp 4 (verify.measure) is "
                      "predicted within 0.1 %; tests/test_memory_accuracy.py checks a TP whole step")
"""why the TP cases whose loss dominates differ here (issue 21)"""


@pytest.mark.multiprocess  # the trackers run in a child process (the fake group is global state)
@pytest.mark.parametrize("kind, world", [
    pytest.param(k, w, marks=pytest.mark.xfail(strict=True, reason=FAKE_LOSS_PARALLEL)) if k != "fsdp" and w >= 4
    else (k, w) for k, w in CASES])
def test_predicted_peak_matches_tracker(results, kind, world):
    r = results[(kind, world)]
    assert r["predicted"] == pytest.approx(r["tracked"], rel=0.10), r


if __name__ == "__main__":
    _worker()
