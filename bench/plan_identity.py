"""Plans as JSON, to show a change to the planner's speed leaves every chosen plan as it was: every row of
``bench/published.py`` (its layout pinned, the planner choosing the rest, as that bench plans it) and some
unpinned plans (zoo models on 2, 4 and 8 GPUs, LLaMA-3 8B on 64 x H100, Megatron's 1T GPT shape on
3072 x A100-80GB). Each plan is written with ``Plan.to_dict`` (cost, explanation and alternatives included); a
refusal as its message.

    PYTHONPATH=. .venv/bin/python bench/plan_identity.py --out /tmp/before.json      # on the old code
    PYTHONPATH=. .venv/bin/python bench/plan_identity.py --compare /tmp/before.json  # on the new: exit 1 on a diff

``--choices`` compares only what each plan chooses (mesh, batch, pipeline, precision, levers' flags, every
layer's split), not its costs and words, and leaves out fields the older file does not have (a field a change
added): for a change to the cost model, which moves every figure; each difference is named by its fields.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this tree's autopar_nb, not an editable install's
sys.path.insert(0, str(ROOT / "bench"))

import published  # noqa: E402

import autopar_nb as ap  # noqa: E402
from autopar_nb import zoo  # noqa: E402

warnings.filterwarnings("ignore")


def _meta(make, inputs):
    with torch.device("meta"):
        return make(), inputs


def free_cases():
    """(name, model and inputs maker, cluster, plan keywords) of the unpinned plans."""
    gpt2 = zoo.GPTConfig(n_layer=4)
    llama = zoo.LlamaConfig(vocab_size=32000, dim=1024, n_layers=4, n_heads=16, n_kv_heads=4, ffn_dim=2816)
    moe = zoo.MoEConfig(vocab_size=32000, dim=512, n_layers=4, n_heads=8, n_kv_heads=8, ffn_dim=1408,
                        n_routed_experts=8, n_shared_experts=1, top_k=2, moe_ffn_dim=256)
    models = {
        "seed MLP": lambda: _meta(zoo.SeedMLP, torch.randn(32, 1024)),
        "GPT-2 4 layers": lambda: _meta(lambda: zoo.GPT(gpt2), torch.randint(0, 50257, (8, 1024))),
        "LLaMA 4 layers": lambda: _meta(lambda: zoo.Llama(llama), torch.randint(0, 32000, (8, 2048))),
        "MoE 4 layers": lambda: _meta(lambda: zoo.MoETransformer(moe), torch.randint(0, 32000, (8, 1024))),
        "ResNet": lambda: _meta(zoo.ResNet, torch.randn(64, 3, 32, 32)),
    }
    for name, make in models.items():
        for gpus in (2, 4, 8):
            yield f"{name}, {gpus} x H100", make, ap.Cluster.preset("h100-80gb", 1, gpus), {}
    yield ("LLaMA-3 8B seq 8192, 64 x H100", lambda: _meta(lambda: zoo.Llama(zoo.LLAMA3_8B),
                                                            torch.randint(0, 128256, (1, 8192))),
           ap.Cluster.preset("h100-80gb", 8, 8), {"global_batch": 256})
    cfg = zoo.GPTConfig(vocab_size=51200, block_size=2048, n_layer=128, n_head=160, n_embd=25600)
    yield ("GPT 1T shape, 3072 x A100-80GB", lambda: _meta(lambda: zoo.GPT(cfg), torch.randint(0, 51200, (1, 2048))),
           ap.Cluster.preset("a100-80gb", 384, 8), {"global_batch": 1536})


def plans(only: str | None = None) -> dict[str, object]:
    """Every case's plan as ``Plan.to_dict()``, or ``{"refused": message}``, by case name."""
    out: dict[str, object] = {}
    for row in published.ROWS:
        if only and only not in row.name:
            continue
        t0 = time.perf_counter()
        res = published.predict(row, published.graph_of(row.model))
        out["published: " + row.name] = res.plan.to_dict() if res.plan is not None else {"refused": res.refused}
        print(f"{row.name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    for name, make, cluster, kw in free_cases():
        if only and only not in name:
            continue
        t0 = time.perf_counter()
        graph = ap.capture(*make())
        try:
            out[name] = ap.plan(graph, cluster, **kw).to_dict()
        except ap.PlanError as e:
            out[name] = {"refused": str(e)}
        print(f"{name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return out


CHOICES = ("mesh", "batch", "pipeline", "precision", "fused_loss", "fused_norm", "async_tp", "loss_parallel",
           "experts", "layers")
"""what a plan chooses (``Plan.to_dict`` keys): what ``--choices`` compares"""


def choices(plan: dict, like: dict) -> dict:
    """``plan``'s choices, each dict field limited to those ``like`` (the same plan from the older file) has."""
    if "refused" in plan:
        return plan
    out = {}
    for key in CHOICES:
        value, old = plan.get(key), like.get(key)
        if isinstance(value, dict) and isinstance(old, dict):
            value = {k: v for k, v in value.items() if k in old}
        out[key] = value
    return out


def differences(got: dict, want: dict, by_choice: bool) -> dict[str, list[str]]:
    """case -> the top-level fields that differ (every case in both files)."""
    out = {}
    for k in got:
        if k not in want:
            continue
        a, b = (choices(got[k], want[k]), choices(want[k], want[k])) if by_choice else (got[k], want[k])
        if a != b:
            out[k] = sorted(f for f in set(a) | set(b) if a.get(f) != b.get(f))
    return out


def main() -> None:
    ap_ = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap_.add_argument("--out", help="write the plans to this JSON file")
    ap_.add_argument("--compare", help="compare the plans with this JSON file (exit status 1 on a difference)")
    ap_.add_argument("--only", help="the cases whose name contains this")
    ap_.add_argument("--choices", action="store_true",
                     help="with --compare: compare what each plan chooses, not its costs and words")
    args = ap_.parse_args()
    got = plans(args.only)
    if args.out:
        Path(args.out).write_text(json.dumps(got, indent=1, sort_keys=True))
    if args.compare:
        want = json.loads(Path(args.compare).read_text())
        got = json.loads(json.dumps(got))  # tuples as lists, as read back
        differ = differences(got, want, args.choices)
        missing = [k for k in got if k not in want]
        for k, fields in differ.items():
            print(f"DIFFERS: {k} ({', '.join(fields)})")
        print(f"{len(got) - len(differ) - len(missing)} of {len(got)} plans identical"
              + (f", {len(missing)} not in {args.compare}" if missing else ""))
        sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
