"""Every tensor-parallel layout the planner offers has run once on stand-in tensors: the model's own
forward on one rank's local shards, on the meta device over a fake process group, before the search
may choose it.

The dataflow walk (``cost/tp_styles.py``) sees the ops, not the code around them: a width the code
read from the input (nanoGPT's ``split(self.n_embd, dim=2)``, ``view(B, T, self.n_head, C //
self.n_head)``) or a per-head table that stays whole (an ``nn.Parameter`` of shape (heads, T, T)
added to the scores) looks the same there as code that runs on shards. So for every TP degree the
search may take, the layout the profile gives (every splittable layer split, each one at the
degree's part layouts) is applied to the stand-in (``autopar_nb.capture.meta_stand_in``) with the
runtime's own styles and called once. A forward that fails names the module it failed in and the
user's line; that module is kept whole (``ModelGraph.tp_refused``, which the walk reads), in every
member of its repeated block, and the layout that results is run again. Only the first member of
each repeated block is split and run (the others are the same code on the same shapes: they hand its
output on), so a 32-layer model costs about one block.

The function that runs a layout (``forward_run.py``) builds the styles the exported script applies
(``styles.py``) and applies them with ``runtime/tp.py``. Each layout runs once per capture
(``StandIn.results``).
"""

from __future__ import annotations

from ..cost.profile import profile_of
from ..plan import within
from .degrees import divisors, tp_blockers
from .forward_run import Layout, run_layout

ROUNDS = 8
"""layouts run per degree at most: each failure keeps one more module whole"""


def tp_parts(lp, tp: dict[str, str], degree: int) -> dict[str, list[int]]:
    """``LayerPlan.tp_parts`` of one layer: the parts of its colwise modules whose split is not one
    even cut at this TP degree (fused projections split part by part or gathered, key/value
    projections repeated, head-indexed embeddings kept split by heads;
    :meth:`~autopar_nb.cost.profile.LayerProfile.layout`), and the features of its ``"shared"`` ones
    (:attr:`~autopar_nb.cost.profile.LayerProfile.shared`)."""
    return {m: list(lp.parts[m].counts) for m, st in tp.items() if st == "colwise" and m in lp.parts
            and (lp.parts[m].table or lp.layout(m, degree) != "split")} | \
        {m: list(lp.shared[m]) for m, st in tp.items() if st == "shared" and m in lp.shared}


def checked_profile(graph, device_kind: str, cluster, fix: dict | None):
    """The graph's profile once every TP layout the search may take at its degrees (``fix["tp"]``,
    else the divisors of a node's GPUs) has run on the stand-in: modules whose forward failed are
    kept whole."""
    prof = profile_of(graph, device_kind)
    stand = getattr(graph, "stand_in", None)
    if stand is None:
        return prof
    fixed = (fix or {}).get("tp")
    degrees = [fixed] if isinstance(fixed, int) else [t for t in divisors(cluster.gpus_per_node) if
                                                      cluster.world_size % t == 0]
    for t in (t for t in degrees if t > 1):
        for _ in range(ROUNDS):
            if tp_blockers(prof, t, [True] * len(prof.layers)):
                break  # the search refuses this degree anyway
            layout = sampled_layout(graph, prof, t)
            if not layout.styles:
                break
            if layout not in stand.results:
                stand.results[layout] = run_layout(stand, layout)
            failed = stand.results[layout]
            if failed is None:
                prof = _with_tables(graph, stand.tables.get(layout, {}), device_kind, prof)
                graph.__dict__.setdefault("tp_stage_refused",
                                          {})[t] = (stand.stage_refusals.get(layout, ""))
                break
            path, why = failed
            kept = {p: why for p in same_in_every_block(graph, path)}
            if all(graph.tp_refused.get(p) == w for p, w in kept.items()):
                kept = {"": why}  # keeping that module whole changed nothing: no split at all
            graph.tp_refused.update(kept)
            prof = profile_of(graph, device_kind)
    return prof


def _with_tables(graph, tables: dict[str, dict[str, int | tuple[int, int]]], device_kind: str,
                 prof):
    """The profile once ``graph.tp_tables`` holds the head-indexed tables a layout that ran split
    (found in the first member of each repeated block: every member's are named)."""
    named = {f"{m}.{name}": dim for path, names in tables.items()
             for m in same_in_every_block(graph, path) for name, dim in names.items()}
    # a graph pickled before the field existed lacks it
    known = graph.__dict__.setdefault("tp_tables", {})
    if all(known.get(k) == d for k, d in named.items()):
        return prof
    known.update(named)
    return profile_of(graph, device_kind)


def sampled_layout(graph, prof, tp: int) -> Layout:
    """The profile's layout at degree ``tp`` on the layers outside repeated blocks and the first
    member of each."""
    styles: dict[str, str] = {}
    parts: dict[str, list[int]] = {}
    for lay, lp in zip(graph.layers, prof.layers, strict=True):
        block = graph.block_of(lay.path)
        if block is not None and block.members[0] != lay.path:
            continue
        split = {m: st for m, st in lp.tp.items() if st != "replicate"}
        styles |= split
        parts |= tp_parts(lp, split, tp)
    head = any(lp.vocab and any(st == "colwise" for st in lp.tp.values()) for lp in prof.layers)
    repeats = tuple((m, b.members[0]) for b in graph.blocks for m in b.members[1:])
    return Layout(tp, tuple(sorted(styles.items())),
                  tuple(sorted((m, tuple(p)) for m, p in parts.items())),
                  tuple(lay.path for lay in graph.layers), bool(prof.loss_parallel and head),
                  repeats)


def same_in_every_block(graph, path: str) -> list[str]:
    """``path`` and the module at the same place in every other member of its repeated block."""
    for block in graph.blocks:
        for member in block.members:
            if within(path, member) and member:
                rest = path[len(member):]
                return [m + rest for m in block.members]
    return [path]
