"""Per-rank memory: the cost model's prediction against PyTorch's memory tracker on the Hugging Face families people
bring (issue 21), component by component.

Each case: the family's cell at hidden 256, 4 layers, seq 256, batch 8 (tests/memcells.py), planned with the case's
fixed choices, exported, and its script's own ``main`` run for 2 steps as one rank of a fake process group inside
the tracker (``autopar_nb.verify.measure``; real small tensors on CPU; pipelined and expert-parallel plans on real gloo
processes, whose ranks need each other's data). The prediction is the cost model's per-rank
peak total before its allocator margin, and its named terms (``MemoryBreakdown.terms``) grouped as the tracker
labels what it counts (``verify.moments.GROUPS``), at the moment the tracker peaked at: the model weighs every
layer's backward (at each of its ops) and recompute, the loss and the step (``cost.estimate.peak_moments``), and
where two of them hold nearly the same total its peak and the tracker's can be different moments, between which
bytes move from one component to another; compared at the same moment, a wrong term cannot hide behind a moment
choice (``verify.moments.moment_at``: the tracker's moment is placed by the autograd node running at its peak;
at the model's own peak where it has no moment there, e.g. a forward).

    .venv/bin/python bench/memory.py [FAMILY,...] [--plans single,ddp,...] [--amp none,bf16]
                                     [--recompute none,selective,full] [--jobs N] [--write]
    .venv/bin/python bench/memory.py --matrix --write      # the table in BENCHMARKS.md (:data:`MATRIX`)
    .venv/bin/python bench/memory.py --quick               # one case of each class (:data:`QUICK`)
    .venv/bin/python bench/memory.py T5 --plans pp --recompute full --largest 20   # what each peak is made of

``--write`` replaces the "## Per-rank memory against the tracker" section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import platform
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this tree's autopar_nb, not an editable install's
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

SIZE = {"hidden": 256, "layers": 4, "seq": 256, "batch": 8}
PLANS = {
    "single": {"dp": 1, "tp": 1, "pp": 1},
    "ddp": {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 0},
    "zero1": {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 1},
    "zero2": {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 2},
    "zero3": {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 3},
    # gradient accumulation: ZeRO-1 keeps the micro-batches' gradients unsharded until its one reduce-scatter
    "zero1-accum": {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 1, "micro_batches": 4},
    "zero2-accum": {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 2, "micro_batches": 4},
    "tp": {"dp": 1, "tp": 2, "pp": 1},
    "pp": {"dp": 1, "tp": 1, "pp": 2, "micro_batches": 2, "schedule": "1f1b"},
    "pp-interleaved": {"dp": 1, "tp": 1, "pp": 2, "micro_batches": 4, "schedule": "interleaved_1f1b",
                       "virtual_stages": 2},
    "pp-zbv": {"dp": 1, "tp": 1, "pp": 2, "micro_batches": 4, "schedule": "zbv_zero_bubble", "virtual_stages": 2},
    # compositions, on 4 and 8 real gloo processes where ranks exchange data (pipelines, experts, context)
    "ddp-tp": {"dp": 2, "tp": 2, "pp": 1, "zero_stage": 0},
    "zero2-tp": {"dp": 2, "tp": 2, "pp": 1, "zero_stage": 2},
    "zero3-tp": {"dp": 2, "tp": 2, "pp": 1, "zero_stage": 3},
    "ddp-pp": {"dp": 2, "tp": 1, "pp": 2, "zero_stage": 0, "micro_batches": 4, "schedule": "1f1b"},
    "zero1-pp": {"dp": 2, "tp": 1, "pp": 2, "zero_stage": 1, "micro_batches": 4, "schedule": "1f1b"},
    "zero2-pp": {"dp": 2, "tp": 1, "pp": 2, "zero_stage": 2, "micro_batches": 4, "schedule": "1f1b"},
    "zero3-pp": {"dp": 2, "tp": 1, "pp": 2, "zero_stage": 3, "micro_batches": 4, "schedule": "1f1b"},
    "zero3-pp-interleaved": {"dp": 2, "tp": 1, "pp": 2, "zero_stage": 3, "micro_batches": 4,
                             "schedule": "interleaved_1f1b", "virtual_stages": 2},
    "zero3-pp-zbv": {"dp": 2, "tp": 1, "pp": 2, "zero_stage": 3, "micro_batches": 4, "schedule": "zbv_zero_bubble",
                     "virtual_stages": 2},
    "zero3-tp-pp": {"dp": 2, "tp": 2, "pp": 2, "zero_stage": 3, "micro_batches": 4, "schedule": "1f1b"},
    "ep-dp": {"dp": 4, "tp": 1, "pp": 1, "zero_stage": 0, "ep": 4},
    "ep-pp": {"dp": 2, "tp": 1, "pp": 2, "zero_stage": 0, "ep": 2, "micro_batches": 4, "schedule": "1f1b"},
    "cp-zero3": {"dp": 2, "tp": 1, "pp": 1, "cp": 2, "zero_stage": 3},
    # FSDP over the dp x cp ranks beside TP (torchtitan's dp_shard_cp x tp)
    "cp-tp": {"dp": 1, "tp": 2, "pp": 1, "cp": 2, "zero_stage": 3},
    # each pipeline stage's sequences split over its cp ranks, FSDP over dp x cp (torchtitan's 4-D layouts)
    "cp-pp": {"dp": 1, "tp": 1, "pp": 2, "cp": 2, "zero_stage": 3, "micro_batches": 4, "schedule": "1f1b"},
    # on 8 processes (zero3-tp-pp above is 8 too): ZeRO-2 over 4 data-parallel ranks beside TP, and experts split
    # over 2 of each stage's 4 data-parallel ranks (each expert group replicated twice)
    "zero2-tp-dp4": {"dp": 4, "tp": 2, "pp": 1, "zero_stage": 2},
    "ep-dp-pp": {"dp": 4, "tp": 1, "pp": 2, "zero_stage": 0, "ep": 2, "micro_batches": 4, "schedule": "1f1b"},
}
"""plan name -> the planner's fixed choices (fp32, no recompute unless --amp / --recompute)"""
ALL = "LLaMA,Qwen2,GPT-NeoX,GPT-2,BERT,T5,ViT,Mixtral"
MATRIX = [
    (ALL, "single,ddp,zero1,zero2,zero3,tp", "none", "none"),
    (ALL, "single,ddp,zero1,zero2,zero3,tp", "bf16", "none"),
    (ALL, "single", "none,bf16", "selective,full"),
    (ALL, "tp", "none,bf16", "selective,full"),
    (ALL, "ddp,zero1,zero2,zero3", "none,bf16", "selective,full"),
    (ALL, "pp", "none", "none"),
]
"""the table's groups, in the order they run (breadth first): (families, plans, amp values, recompute values),
each group their product: every family under every data/tensor-parallel plan (single, DDP, ZeRO 1-3, TP +
sequence parallelism) x fp32 / bf16 autocast (ZeRO 2/3 run autocast over FSDP's 16-bit parameters) x recompute
none / selective / full, the issue's whole product but the pipeline, which is here in fp32 without recompute and
in its own section under every precision and recompute (``--plans pp``)"""
COMPOSITIONS = [
    ("LLaMA,GPT-2,Mixtral", "ddp-tp,zero2-tp,zero3-tp", "none,bf16", "none,full"),
    ("LLaMA,GPT-2,Mixtral", "ddp-pp,zero1-pp,zero2-pp,zero3-pp", "none,bf16", "none,full"),
    ("LLaMA,GPT-2,Mixtral", "zero3-pp-interleaved,zero3-pp-zbv", "none,bf16", "none,full"),
    ("LLaMA,GPT-2,Mixtral", "zero3-tp-pp", "none,bf16", "none,full"),
    ("Mixtral", "ep-dp,ep-pp", "none,bf16", "none,full"),
    ("LLaMA,GPT-2,Mixtral", "cp-zero3", "none,bf16", "none,full"),
    ("LLaMA,GPT-2,Mixtral", "cp-tp", "none,bf16", "none,full"),
    ("LLaMA,GPT-2,Mixtral", "cp-pp", "none,bf16", "none,full"),
    ("LLaMA,GPT-2,Mixtral", "zero2-tp-dp4", "none,bf16", "none,full"),
    ("Mixtral", "ep-dp-pp", "none,bf16", "none,full"),
]
"""the composition table's groups: techniques together, as the planner offers them at scale (``--compositions``)"""
QUICK = [
    ("LLaMA,ViT", "single,ddp,zero2,zero3,tp", "none,bf16", "none"),
    ("LLaMA,BERT,GPT-2", "single,tp", "bf16", "selective,full"),
]
"""one case of each class the matrix checks, in a few minutes (``--quick``)"""
KNOWN = [
    "Components are compared at the tracker's moment: its peak is placed by the autograd node running then (the "
    "module whose forward made it, and which of that module's calls of the step: a pipeline rank's micro-batch, "
    "autopar_nb.verify.measure._NodeSpans), and a layer's backward is compared at that module's ops, matched by their "
    "path within the layer, in the first micro-batch's moments or a later one's (peak_moments(per_op=True), "
    "PeakMoment.later), and among that module's ops at those of the running autograd node's kind "
    "(moments.op_kind_of_node: Mixtral's experts peak at their last index op's backward, where all they saved is "
    "still alive; compared at their largest op, whose moment has freed it, 5 pipelined recompute ranks missed by "
    "6-10 MiB); the counts at the model's own peak are given too",
    "A layer's forward and its recompute are costed op by op (cost.profile.LayerProfile.forward, "
    "cost.memory.forward_peak: its saved tensors so far, the storages still read, autocast's copies, in an eager "
    "forward what a module's caller holds; a recompute up to its last saver, the checkpoint's input not counted "
    "twice). The model has a forward moment only for the last layer of each run of layers without recompute: a "
    "tracker's peak in another layer's forward, or outside every layer but not at the loss the model costs (T5 "
    "bf16: \"train/forward in T5ForConditionalGeneration\", \"train/backward in CrossEntropyLoss\"), is compared "
    "at the model's own peak (\"none there\")",
    "Mended this session (2026-12-05): BERT pp bf16 rank 0 (CPU SDPA's math kernel holds the attention weights' "
    "float32 gradient in its backward: cost.profile.moments.math_attention_gradients), ZeRO-2's unsharded parameters "
    "freed unit by unit in backward (Mixtral ZeRO-2 full recompute was +6.1 %), an index op's backward holding "
    "zeros and index_put's result of its input's size (Mixtral ZeRO 2/3 bf16 full recompute were -5.4 / -5.5 %), "
    "and expert-parallel plans measured on real processes (the fake group's all-to-all left the exchanged token "
    "counts uninitialised: Mixtral DDP bf16 selective was -6.2 %)",
    "Routing: an expert-parallel plan's rows are every data-parallel rank of each stage, each predicted with the "
    "rows its experts really received in each layer (verify.measure records them, averaged over the step's "
    "micro-batches, or under full recompute the busiest micro-batch's, the one a recompute peaks in: "
    "routed_rows(busiest=True); estimate(routed=...)); tiny Mixtral's random router sent a rank 0.61 to 1.72 "
    "times the balanced rows. The planner itself cannot know them: it costs every rank for the busiest, "
    "mesh.moe_capacity (1.25, Switch Transformer's capacity factor) times the balanced rows. Plans without expert "
    "parallelism run every "
    "expert on the rank's own tokens: routing does not change their memory",
    "Eight processes: zero3-tp-pp (dp 2 x tp 2 x pp 2, real gloo), ep-dp-pp (dp 4 x ep 2 x pp 2, Mixtral, every "
    "rank measured and predicted from its own routing) and zero2-tp-dp4 (dp 4 x tp 2, one rank of a fake group of 8). "
    "Context parallelism's merged attention output (one (batch, seq / cp, hidden / tp) tensor a layer, which the "
    "output projection saves) is the term cp_merge_copies, apart from saved_activations: 2.0 of LLaMA cp-tp's 58.4 "
    "MiB at the loss, too small for its case to fail without it (tests/test_compositions.py TOO_SMALL)",
    "Compositions (--compositions): ZeRO-3 x PP under ZBV with full recompute measured 44-76 % above the "
    "prediction and above the same plan without recompute (torch's input pass keeps what the recompute re-made "
    "for the weight pass): the planner now refuses recompute with zero-bubble schedules. LLaMA ZeRO-3 x TP x PP's "
    "last stage -7 to -17 % (its peak in the stage's forward outside a layer, or the loss's backward: the "
    "vocab-parallel head's logits inside a pipeline stage), not identified. GPT-2 under CP crashed on CPU at its "
    "default attention dropout (SDPA's math form, which the ring cannot split): refused on CPU now",
    "Mixtral EP x PP (dp 2 x ep 2 x pp 2, 1F1B x 4, ZeRO 0, measured apart: bench/memory.py Mixtral --plans ep-pp --amp"
    " none,bf16 --recompute none,full): ranks 0 and 2 within 5 %, every component too (-3.3 to +3.2 %; were -4 to "
    "-16 %) "
    "since the experts' FSDP2 replicas beside DDP are costed (cost/peak.py _experts_replicas: "
    "replicate_gathered_experts, each experts module's parameters gathered from its forward to the end of its backward,"
    " 6 MiB at the first stage's forward peak; replicate_reduce_buffers, the reduce-scatter input and all-reduce output"
    " of each module whose backward ran, held to the end of the stage's backward, 6 MiB at a recompute) and the "
    "tracker's peaks are placed where they are (a stage's experts, which the tracker names through torch.export's "
    "wrapper, in their layer; the last stage's loss, made between micro-batches, in no module: it was placed in the "
    "next forward's first one). Mixtral EP x DP holds the same replicas (its buffers match, 11.0 / 11.0 MiB at the "
    "loss). With full recompute (EP x DP and EP x PP) the tracker peaks in the experts' recompute of the layer its "
    "router loaded most, where the model's recompute moment holds 9-14 MiB fewer activations and 4 MiB fewer "
    "temporaries than measured (EP x DP fp32 rank 3: 99.4 / 113.5 and 2.0 / 6.0 MiB); the totals are within 5 % "
    "because the model's own peak (the layer's backward) holds as much. A census there (ep-dp fp32 full rank 3, "
    "--largest 25): the local experts' forward in the middle of the recompute, on 6991 rows (1.71x), holding the "
    "gate/up output 27.3, the SiLU 13.7 and the product 13.7 MiB and five (rows, 256) float32 tensors of 6.8 MiB: "
    "the all-to-all's output (the local forward's input, which runtime/ep.py's dispatch holds until the local "
    "forward returns), its gather, the second grouped matmul's output, its product with the ones and one "
    "not identified. Two parts of that gap are costed now: the all-to-all's output (ep_received_rows, at a layer's "
    "forward and recompute: cost/peak.py received_rows) and, under full recompute, the rows of the busiest "
    "micro-batch, the one whose recompute the tracker peaks in (verify.measure.routed_rows(busiest=True); rank 3 of "
    "EP x PP received 1515 rows in layer 2's busiest micro-batch, 1.48x, where its 4 averaged 1.23x). EP x PP bf16 "
    "full rank 3 was -6.5 % (activations 18.5 / 24.1 MiB at the recompute), -2.7 % with both (22.6 / 24.1), every "
    "component within 5 %: bench/memory.py Mixtral --plans ep-pp --amp none,bf16 --recompute full, 8 of 8 rows "
    "within 5 % (-0.1 to -2.7 %). The one (rows, 256) tensor not identified (no op recorded: made outside the "
    "dispatcher, gloo's all-to-all?) is not costed",
    "ViT fp32 full recompute (+2.4 %, total only): the components match at the tracker's moment (layer 0's "
    "backward at the GELU, 62.2 MiB), the model's peak is layer 0's backward at another op (63.7 MiB); not "
    "identified",
    "Expert parallelism only where a plan's name says ep (bench/memory.py fixed(): ep 1 otherwise). Left free, the "
    "planner gave Mixtral's zero3-pp-interleaved ep 2 without recompute (fp32 and bf16) and its ddp ep 2 under bf16 "
    "(no recompute, selective), so those rows measured how the run's router spread its tokens over two expert groups "
    "(zero3-pp-interleaved rank 0 +6.5 / +7.3 %: its experts' grouped_mm outputs had 661-1031 rows per micro-batch "
    "where balanced routing gives 1024, census at helper140's bead8a8); with ep 1 they are -0.6 / -2.0 % (rank 0) and "
    "-1.1 / -1.6 % (rank 2). Their rank 2 peaks at layer 3's first backward op in a later micro-batch, where the "
    "tracker files 7.4 (fp32) and 4.0 MiB (bf16) more under buffers than the model at that op: its census holds a "
    "6.76 MiB float32 all-gather buffer made in backward under model.norm, one layer's unit (1,771,008 elements), "
    "which the model does not hold there; the totals stay within 2 % as the model's peak (that micro-batch's forward) "
    "holds as much. Not identified further",
    "cp-pp under bf16 with full recompute (first measured 2026-12-07): LLaMA ranks 0-1 -6.0 % (20.3 / 21.6 MiB; every "
    "component within 5 % at the tracker's moment, the ring attention's backward: temporaries 2.1 / 2.9, activations "
    "1.5 / 2.0), Mixtral ranks 2-3 -5.4 % (50.3 / 53.1: the tracker peaks in the last stage's forward outside every "
    "module, where the model has no moment; at its loss moment activations 4.0 / 10.7 and buffers 14.8 / 20.4 MiB); "
    "not identified",
    "ZeRO-2 under gradient accumulation (zero2-accum: FSDP2 reduce-scatters every micro-batch) held more buffers "
    "in a middle micro-batch's backward than the model: GPT-NeoX fp32 full -3.6 % (buffers 9.0 / 12.1 MiB at layer "
    "2's GELU), ViT bf16 full -7.1 % (5.2 / 6.3), Mixtral bf16 full -4.6 % (17.4 / 21.3). The runtime reshards no "
    "unit before the last micro-batch (runtime/train.py set_grad_sync: set_reshard_after_backward(False)), so the "
    "units after the layer keep their parameters gathered: costed since 2026-12-07 (cost/moment.py fsdp_buffers, "
    "fsdp_kept_params; the buffers at the tracker's moment 12.06 / 12.06, 6.19 / 6.31, 21.27 / 21.27 MiB). The census "
    "there had been read as a second sharded gradient of the unit above: its four 1.01 MiB [263552] storages are the "
    "four blocks' accumulated gradients (the gradients match, 5.02 / 5.02 MiB), labelled by the module running when "
    "each was made",
]
"""cases known to miss 5 %, and why (written under the table)"""
MiB = 2**20


def fixed(plan_name: str) -> dict:
    """``PLANS[plan_name]``, with ep 1 where the name does not say expert parallelism: left free, the planner splits
    Mixtral's experts where that costs less (zero3-pp-interleaved, ddp under bf16), and the row then measures how
    that run's router spread its tokens over the expert groups, not the composition the name says."""
    return {"ep": 1, **PLANS[plan_name]}


def case(family: str, plan_name: str, *, amp: str = "none", recompute: str = "none", largest: int = 0) -> list[dict]:
    """Predicted and measured components of every rank that differs (each pipeline stage; rank 0 otherwise), and
    the ``largest`` storages alive at each one's measured peak, with what made them (``measure``'s census). The
    predicted components are the model's at the moment the tracker peaked (``autopar_nb.verify.moments.moment_at``), or
    at the model's own peak where the model has no such moment; the predicted total is the model's peak."""
    from memcells import CELLS

    import autopar_nb as ap
    from autopar_nb.cost import estimate
    from autopar_nb.cost.estimate import peak_moments
    from autopar_nb.source import ModelSource
    from autopar_nb.verify.measure import measure, routed_rows
    from autopar_nb.verify.moments import measured_groups, moment_at, predicted_groups

    src = ModelSource(CELLS[family](**SIZE))
    meta, example, _ = src.build(device="meta")
    graph = ap.capture(meta, example)
    fix = fixed(plan_name)
    world = fix["dp"] * fix["tp"] * fix["pp"] * fix.get("cp", 1)
    cluster = ap.Cluster.preset("cpu", 1, world)
    plan = ap.plan(graph, cluster, global_batch=SIZE["batch"] * fix["dp"],
                   fix={"micro_batches": 1, **fix, "amp": amp, "recompute": recompute})
    op_modules = {k: n.module_path for k, n in enumerate(graph.nodes)}
    op_names = {k: n.op for k, n in enumerate(graph.nodes)}
    paths = [lay.path for lay in graph.layers]
    # rank r of a (pp, dp, cp, tp) mesh is pipeline stage r // (dp * cp * tp); each stage's cp ranks hold
    # different parts of the ring's work (the first of dp 0: stage's first rank, at stride tp)
    cp, tp = fix.get("cp", 1), fix["tp"]
    ranks = [(stage, stage * world // fix["pp"] + c * tp) for stage in range(fix["pp"]) for c in range(cp)]
    if fix.get("ep", 1) > 1:  # every data-parallel rank of a stage: each its own experts and routing
        ranks = [(stage, stage * world // fix["pp"] + d * tp) for stage in range(fix["pp"]) for d in range(fix["dp"])]
    measured = measure(src, plan, ranks=tuple(g for _, g in ranks), census=largest)
    rows = []
    for (stage, rank), m in zip(ranks, measured, strict=True):
        # predicted with the routing this rank really had (none without expert parallelism), and with balanced
        routed = (routed_rows(m.get("routed", []), paths, busiest=recompute == "full") if fix.get("ep", 1) > 1
                  else None)
        cost = estimate(graph, cluster, plan, routed=routed)
        moments = peak_moments(graph, cluster, plan, per_op=True, routed=routed)
        balanced = estimate(graph, cluster, plan, routed=dict.fromkeys(paths, 1.0)).memory_by_rank[stage]
        mb = cost.memory_by_rank[stage]
        peak = max((mo for mo in moments[stage] if mo[3] is None), key=lambda mo: mo[2].total)
        at = moment_at(m["where"], paths, moments[stage], op_modules, micro_batch=m.get("micro_batch"),
                       node=m.get("node"), op_names=op_names)
        rows.append({"family": family, "plan": plan_name, "amp": amp, "recompute": recompute, "stage": stage,
                     "rank": rank,
                     "predicted": predicted_groups((at or peak)[2]), "predicted_total": mb.total - mb.margin,
                     "predicted_peak": predicted_groups(mb), "moment": _moment_name(at or peak, paths, op_modules),
                     "model_peak": _moment_name(peak, paths, op_modules), "matched": at is not None,
                     "moment_total": (at or peak)[2].total - mb.margin,
                     "balanced_total": balanced.total - balanced.margin, "routed": routed,
                     # the planner's own figure: every rank at mesh.moe_capacity times the balanced rows
                     "default_total": plan.cost.memory_by_rank[stage].total - plan.cost.memory_by_rank[stage].margin,
                     "moe_capacity": plan.mesh.moe_capacity,
                     "measured": measured_groups(m["peak"]), "measured_total": m["peak"]["total"],
                     "where": m["where"] + (f" ({m['node']})" if m.get("node") else ""),
                     "largest": m.get("largest", [])})
    return rows


def _moment_name(moment, paths: list[str], op_modules: dict[int, str]) -> str:
    from autopar_nb.verify.moments import path_in_layer

    phase, layer, _, op, later = moment
    at = path_in_layer(op_modules[op], paths).removeprefix(".") if op is not None else ""
    return (phase + (f" {paths[layer]}" if layer is not None else "") + (f" at {at}" if at else "")
            + {True: " (a later micro-batch)", False: " (first micro-batch)", None: ""}[later])


def error(row: dict) -> float:
    return row["predicted_total"] / row["measured_total"] - 1


def components_within(row: dict, key: str = "predicted") -> bool:
    """Every component of ``row[key]`` within 5 % of the measured total of the measured one."""
    from autopar_nb.verify.moments import GROUPS

    return all(abs(row[key][g] - row["measured"][g]) <= 0.05 * row["measured_total"] for g in GROUPS)


def markdown(rows: list[dict]) -> str:
    """One line per case: each component predicted (at the tracker's moment) / measured, the total (the model's
    peak) and its error, where the tracker peaked and which of the model's moments the components are from."""
    from autopar_nb.verify.moments import GROUPS

    head = ("| family | plan | amp | recompute | rank | " + " | ".join(f"{g} p/m" for g in GROUPS)
            + " | total p/m (MiB) | error | tracker's peak at | model's moment compared (its total, MiB) |")
    out = [head, "|---" * (len(GROUPS) + 9) + "|"]
    for r in rows:
        p, m = r["predicted"], r["measured"]
        cells = [f"{p[g] / MiB:.1f} / {m[g] / MiB:.1f}" for g in GROUPS]
        cells.append(f"{r['predicted_total'] / MiB:.1f} / {r['measured_total'] / MiB:.1f}")
        same = r["moment"] == r["model_peak"]
        moment = (f"{r['moment']} ({r['moment_total'] / MiB:.1f})" + ("" if same else f"; its peak: {r['model_peak']}")
                  if r["matched"] else f"none there; its peak: {r['model_peak']}")
        out.append(f"| {r['family']} | {r['plan']} | {r['amp']} | {r['recompute']} | {r.get('rank', r['stage'])} | "
                   + " | ".join(cells) + f" | {error(r):+.1%} | {r['where']} | {moment} |")
    return "\n".join(out)


def cases_of(groups) -> list[tuple[str, str, str, str]]:
    """The cases of ``groups`` ((families, plans, amps, recomputes) comma lists, each group their product), breadth
    first: one case of each group in turn, each group's cases in a fixed shuffled order (families and plans mixed),
    so a run cut short has measured every class on several families."""
    import random

    per_group = []
    for group in groups:
        cases = list(itertools.product(*(g.split(",") for g in group)))
        random.Random(21).shuffle(cases)
        per_group.append(cases)
    out = []
    for k in range(max(map(len, per_group), default=0)):
        out += [g[k] for g in per_group if k < len(g)]
    return out


def _one(c: tuple[str, str, str, str], largest: int = 0) -> tuple[str, list[dict] | None, str]:
    family, plan_name, amp, rec = c
    name = f"{family} / {plan_name} / {amp} / {rec}"
    try:
        return name, case(family, plan_name, amp=amp, recompute=rec, largest=largest), ""
    except Exception as e:  # a plan the planner refuses, or a run that fails: reported, not hidden
        return name, None, f"{name}: {type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}"


def run(groups, *, each=None, jobs: int = 1, largest: int = 0) -> tuple[list[dict], list[str]]:
    """Every case of ``groups`` (:func:`cases_of`), ``jobs`` at a time: rows, and the cases that did not run (the
    planner refused the plan, or the run failed) with why. ``each(rows, failed, cases)`` after every case;
    ``largest``: print that many of the largest storages at each measured peak."""
    from concurrent.futures import ProcessPoolExecutor
    from functools import partial

    rows, failed = [], []
    todo = cases_of(groups)
    with ProcessPoolExecutor(jobs) as pool:
        for name, got, why in pool.map(partial(_one, largest=largest), todo):
            if got is None:
                failed.append(why)
                print("FAILED", why, flush=True)
            else:
                rows += got
                for r in got:
                    print(f"{name} rank {r.get('rank', r['stage'])}: predicted {r['predicted_total'] / MiB:7.1f} "
                          f"measured {r['measured_total'] / MiB:7.1f} MiB  {error(r):+.1%}  ({r['where']}; model at "
                          f"{r['moment'] if r['matched'] else 'no such moment'}, its peak {r['model_peak']}; "
                          f"components {'within' if components_within(r) else 'OUTSIDE'} 5 %)", flush=True)
                    if r.get("routed"):
                        print(f"    routed rows / balanced: {', '.join(f'{v:.2f}' for v in r['routed'].values())}; "
                              f"balanced routing predicted {r['balanced_total'] / MiB:.1f} MiB "
                              f"({r['balanced_total'] / r['measured_total'] - 1:+.1%}); the plan's own (moe_capacity "
                              f"{r['moe_capacity']:g}) {r['default_total'] / MiB:.1f} MiB "
                              f"({r['default_total'] / r['measured_total'] - 1:+.1%})", flush=True)
                    for t in r["largest"]:
                        print(f"    {t['MiB']:6.2f} MiB {t['label']:<14} {t.get('side', ''):<8} {t.get('op', '?')} "
                              f"{t.get('shape', '')} {t.get('dtype', '')} {t.get('module', '')}", flush=True)
            if each is not None:
                each(rows, failed, len(todo))
    return rows, failed


def main() -> None:
    from memcells import CELLS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("families", nargs="?", default=",".join(CELLS))
    ap.add_argument("--plans", default=",".join(PLANS))
    ap.add_argument("--amp", default="none")
    ap.add_argument("--recompute", default="none")
    ap.add_argument("--matrix", action="store_true", help="the table's cases (MATRIX); other selections ignored")
    ap.add_argument("--quick", action="store_true", help="a few cases of each class (QUICK) instead")
    ap.add_argument("--compositions", action="store_true",
                    help="the composition table's cases (COMPOSITIONS); other selections ignored")
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--jobs", type=int, default=1, help="cases measured at once")
    ap.add_argument("--largest", type=int, default=0, metavar="N",
                    help="print the N largest storages alive at each measured peak, with the op and module that "
                         "made each (what a component's miss is made of)")
    ap.add_argument("--section", default="Per-rank memory against the tracker", help="BENCHMARKS.md section title")
    args = ap.parse_args()
    if args.compositions and args.section == ap.get_default("section"):
        args.section = "Compositions: per-rank memory on 4 and 8 real processes"
    t0, load0 = time.time(), os.getloadavg()[0]
    groups = (MATRIX if args.matrix else COMPOSITIONS if args.compositions else QUICK if args.quick
              else [(args.families, args.plans, args.amp, args.recompute)])

    def report(rows, failed, cases, *, final=False):
        table = markdown(rows)
        within = sum(abs(error(r)) <= 0.05 for r in rows)
        comp = sum(map(components_within, rows))
        comp_peak = sum(components_within(r, "predicted_peak") for r in rows)
        matched = sum(r["matched"] for r in rows)
        done = len({(r["family"], r["plan"], r["amp"], r["recompute"]) for r in rows}) + len(failed)
        minutes = (time.time() - t0) / 60
        summary = (f"{within} of {len(rows)} totals within 5 %; {comp} of {len(rows)} with every component within "
                   f"5 % of the total at the tracker's moment ({matched} of {len(rows)} at a moment the model has; "
                   f"{comp_peak} of {len(rows)} compared at the model's own peak)"
                   + (f"; {len(failed)} not measured" if failed else "")
                   + ("" if done == cases else f"; {done} of the {cases} cases run so far"))
        if final:
            print(table, "\n", summary, f"({minutes:.0f} min)", sep="\n")
        if args.write:
            import torch
            from capture import write_section
            cmd = shlex.join(["bench/memory.py", *(a for a in sys.argv[1:] if a != "--write")])
            body = (f"## {args.section}\n\n`.venv/bin/python {cmd}` — {datetime.date.today()}, "
                    f"{platform.machine()} CPU container (2 cores, shared with other jobs; load average "
                    f"{load0:.1f} at the start, {os.getloadavg()[0]:.1f} now), torch {torch.__version__}, "
                    f"{minutes:.0f} min, {args.jobs} case(s) at a time. Sizes {SIZE}, Adam; predicted (p) = the "
                    "cost model's per-rank peak total before its allocator margin, and its named terms at the "
                    "moment of the step the tracker peaked at (a layer's backward at the op of the module the "
                    "running autograd node was made in, a layer's recompute, the loss, the step: "
                    "autopar_nb.verify.moments.moment_at; at the model's own peak where it has no such moment), "
                    "measured (m) = "
                    "MemTracker/FSDPMemTracker peak of the 2nd step of the exported script's own main under a fake "
                    "process group, pipelined and expert-parallel plans on real gloo processes "
                    "(autopar_nb/verify/measure.py), "
                    f"both grouped as autopar_nb.verify.moments.GROUPS says (MiB). {summary}.\n\n{table}\n"
                    + ("".join(f"\n- not measured: {f}" for f in failed))
                    + ("\n\nKnown gaps:\n" + "".join(f"\n- {k}" for k in KNOWN)) + "\n")
            write_section(args.section, body, ROOT / "BENCHMARKS.md")

    rows, failed = run(groups, each=report, jobs=args.jobs, largest=args.largest)
    report(rows, failed, len(cases_of(groups)), final=True)


if __name__ == "__main__":
    main()
