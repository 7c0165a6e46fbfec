"""Tournament benchmark (issue 45): does the planner's order of its top plans match the measured order?

    .venv/bin/python bench/tournament.py [--models mlp llama gpt mixtral vit cnn] [--k 4] [--steps 20]
    .venv/bin/python bench/tournament.py --repeats 3     # the noise: each tournament 3 times, no calibration
    .venv/bin/python bench/tournament.py --models mlp --factor pp_handoff_s=0   # planned as before a factor

For each model (small configurations, planned with the ``cpu`` preset for 2 processes, global batch as in its cell)
it runs ``ap.tournament(session, k, steps)`` on 2 local gloo processes through the warm pool, against a calibration
file of its own (``$AUTOPAR_CALIBRATION`` pointed at a temporary file: nothing the developer calibrated changes the
predictions, and the benchmark changes nothing the developer keeps), and prints the tournament's table, then one
markdown row per model: the predicted order (plans numbered by the planner's rank, 0 = its choice), the measured
order, the order after the tournament's calibration (in-sample: fitted on the same measurements), Kendall's tau of
each against the measured order, the winner and its margin over the runner-up, and the tournament's wall time
(capture and planning not included).

With ``--factor NAME=VALUE`` the plans are made with that cost-model factor replaced (a value from before a change
of the ``cpu`` preset's defaults), and the measured plans are costed again with the defaults: Kendall's tau of both
predictions against the same measurements, the change's before and after.

With ``--repeats R`` each model's tournament runs R times over the same plans, uncalibrated (the predictions stay
the cost model's defaults), and its row says how far the measurements move from one run to the next: each plan's
coefficient of variation across the repeats (the median over the plans, and the largest), tau of each repeat, tau
of the plans' median step times, and tau over the pairs of plans the repeats tell apart
(``standings.tau_over_distinguishable``: every repeat of one faster than every repeat of the other), with the load
average at the start of each repeat.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ["AUTOPAR_CALIBRATION"] = os.path.join(tempfile.mkdtemp(prefix="autopar-bench-"), "calibration.json")

# imported after the calibration file is chosen
from autopar_nb.capture import capture
from autopar_nb.cost.estimate import estimate
from autopar_nb.demo import QUICKSTART_CELL
from autopar_nb.hardware import Cluster
from autopar_nb.launch.standings import kendall_tau, tau_over_distinguishable
from autopar_nb.launch.trials import tournament
from autopar_nb.notebook.session import Session
from autopar_nb.source import ModelSource

ZOO = """\
import torch
from autopar_nb import zoo

model = zoo.{model}
example_inputs = {inputs}
"""
TOKENS = "(torch.randint(0, 256, (8, 32)),)"
CELLS = {
    "mlp": QUICKSTART_CELL,
    "llama": ZOO.format(model="Llama(zoo.LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, "
                              "ffn_dim=128))", inputs=TOKENS),
    "gpt": ZOO.format(model="GPT(zoo.GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=256))",
                      inputs=TOKENS),
    # Mixtral's shape: routed experts only, top-2 renormalised
    "mixtral": ZOO.format(model="MoETransformer(zoo.MoEConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, "
                                "n_kv_heads=2, ffn_dim=128, n_dense_layers=0, n_routed_experts=4, "
                                "n_shared_experts=0, top_k=2, moe_ffn_dim=64, norm_topk_prob=True))",
                          inputs=TOKENS),
    "vit": """\
import torch
from transformers import ViTConfig, ViTForImageClassification

config = ViTConfig(image_size=16, patch_size=4, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   intermediate_size=128, num_labels=10)
model = ViTForImageClassification(config)
example_inputs = {"pixel_values": torch.randn(8, 3, 16, 16), "labels": torch.randint(0, 10, (8,))}
""",
    "cnn": ZOO.format(model="ResNet(widths=(16, 32, 64), blocks_per_stage=1, num_classes=10)",
                      inputs="(torch.randn(8, 3, 16, 16),)"),
}


def order(values: list[float | None]) -> str:
    """The entries' indices, fastest first ("0 3 1"); entries without a value left out."""
    return " ".join(str(i) for _, i in sorted((v, i) for i, v in enumerate(values) if v is not None))


def planned(name: str, factors: dict[str, float] | None = None) -> Session:
    """The model's session, planned with the ``cpu`` preset for 2 processes (``factors``: cost-model factors that
    replace its defaults, as a calibration would)."""
    source = ModelSource(CELLS[name])
    model, inputs, _ = source.build(device="meta")
    cluster = Cluster.preset("cpu", gpus_per_node=2)
    session = Session(capture(model, inputs), dataclasses.replace(cluster, calibration=dict(factors or {})), source)
    session.replan()
    return session


def against_defaults(t, graph) -> str:
    """Each measured plan of tournament ``t`` (planned with replaced factors) costed again with the ``cpu`` preset's
    defaults: a line per plan, and Kendall's tau of those predictions against the measured order."""
    cluster = Cluster.preset("cpu", gpus_per_node=2)
    rows, now = [], []
    for i, e in enumerate(t.entries):
        if e.status == "measured":
            now.append((estimate(graph, cluster, e.plan).step_time_s, e.measured_s))
            rows.append(f"  {i} {e.label}: predicted {e.predicted_s * 1e3:.2f} ms, with the defaults "
                        f"{now[-1][0] * 1e3:.2f} ms, measured {e.measured_s * 1e3:.2f} ms")
    tau = kendall_tau([p for p, _ in now], [m for _, m in now]) if len(now) > 1 else None
    return "\n".join([*rows, f"  tau with the defaults: {fmt(tau)} (planned with the replaced factors: {fmt(t.tau)})"])


def repeated(name: str, k: int, steps: int, repeats: int, factors: dict[str, float] | None = None) -> str:
    """Run one model's tournament ``repeats`` times without calibration (planned with ``factors``); return its
    markdown row of the noise."""
    session = planned(name, factors)
    runs, loads = [], []
    for r in range(repeats):
        loads.append(os.getloadavg()[0])
        runs.append(tournament(session, k=k, steps=steps, calibrate=False, save=False))
        print(f"[{name}] repeat {r + 1} at load {loads[-1]:.1f}\n{runs[-1]!r}", flush=True)
    predicted = [e.predicted_s for e in runs[0].entries]
    times = [[t.entries[i].measured_s for t in runs if t.entries[i].measured_s] for i in range(len(predicted))]
    cvs = sorted(statistics.stdev(m) / statistics.fmean(m) for m in times if len(m) > 1)
    medians = [statistics.median(m) if m else None for m in times]
    both = [i for i, m in enumerate(medians) if m is not None]
    tau_median = kendall_tau([predicted[i] for i in both], [medians[i] for i in both]) if len(both) > 1 else None
    tau_apart, pairs = tau_over_distinguishable(predicted, times)
    cv = f"{statistics.median(cvs):.0%} (max {cvs[-1]:.0%})" if cvs else "-"
    return (f"| {name} | {order(medians)} | {' '.join(fmt(t.tau) for t in runs)} | {fmt(tau_median)} | {cv} | "
            f"{pairs}/{len(both) * (len(both) - 1) // 2} | {fmt(tau_apart)} | "
            f"{' '.join(f'{x:.0f}' for x in loads)} |")


def one(name: str, k: int, steps: int, factors: dict[str, float] | None = None) -> str:
    """Capture, plan and run one model's tournament; print its table (with ``factors``, the measured plans costed
    again with the defaults too); return its markdown row."""
    session = planned(name, factors)
    t = tournament(session, k=k, steps=steps)
    print(f"\n[{name}]\n{t!r}\nfitted scales: {t.scales}", flush=True)
    if factors:
        print(against_defaults(t, session.graph), flush=True)
    m = [e if e.status == "measured" else None for e in t.entries]
    w = t.winner
    won = "-" if w is None else f"{t.entries.index(w)} ({'chosen' if w is t.entries[0] else 'alternative'})"
    margin = "-" if t.margin is None else f"{t.margin:.0%}"
    return (f"| {name} | {order([e and e.predicted_s for e in m])} | {order([e and e.measured_s for e in m])} | "
            f"{order([e and e.calibrated_s for e in m])} | {fmt(t.tau)} | {fmt(t.tau_calibrated)} | {won} | "
            f"{margin} | {len(t.measured)}/{len(t.entries)} | {t.wall_s:.0f} s |")


def fmt(tau: float | None) -> str:
    return "-" if tau is None else f"{tau:+.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(CELLS), choices=list(CELLS))
    parser.add_argument("--k", type=int, default=4, help="alternatives run besides the chosen plan")
    parser.add_argument("--steps", type=int, default=20, help="the most steps a trial runs")
    parser.add_argument("--repeats", type=int, default=1, help="run each tournament this many times (the noise)")
    parser.add_argument("--factor", action="append", default=[], metavar="NAME=VALUE",
                        help="plan with this cost-model factor replaced (``autopar_nb.cost.Factors``; repeatable), "
                             "e.g. the value before a change; without --repeats the measured plans are costed "
                             "with the defaults too")
    args = parser.parse_args()
    factors = {k: float(v) for k, v in (f.split("=", 1) for f in args.factor)}
    print(f"{platform.node()}: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    rows = []
    for name in args.models:
        try:
            rows.append(one(name, args.k, args.steps, factors) if args.repeats <= 1 else
                        repeated(name, args.k, args.steps, args.repeats, factors))
        except Exception as e:  # one model's failure (an optional package missing) must not end the others
            rows.append(f"| {name} | failed: {type(e).__name__}: {str(e)[:120]} |")
            print(rows[-1], flush=True)
    if args.repeats > 1:
        print("\n| model | median measured order | tau per repeat | tau of medians | CV across repeats | pairs told "
              "apart | tau over them | load |")
        print("|---|---|---|---|---|---|---|---|")
        print("\n".join(rows))
        return
    print("\n| model | predicted order | measured order | calibrated order | tau before | tau after | winner | "
          "by | measured | wall |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
