"""The walk: :func:`profile` runs each pass over the graph once, :func:`profile_of` keeps the result
while the graph lives."""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections import defaultdict

from ..tp_sequence import sp_extent
from .blockers import cp_blocker, pp_blocker
from .comms import count_comms
from .compute import count_amp_time, count_compute, count_keys_values
from .crossings import count_boundaries, count_crossings, stage_start_refusals
from .facts import Facts, amp_facts, graph_facts
from .float8 import count_float8
from .layers import PRECISIONS, Comm, Crossing, GraphProfile, LayerProfile
from .moments import count_later_gradients
from .params import count_experts, count_params
from .saved import count_saved, count_selective
from .tp import count_tp

_PROFILES: dict[int, tuple[weakref.ref, tuple, GraphProfile]] = {}


def profile_of(graph, device_kind: str = "cuda", *, fp32_ops=(),
               low_precision_ops=()) -> GraphProfile:
    """:func:`profile`, computed once per (graph, device kind, op lists) and kept while the graph
    lives (the latest one per graph)."""
    how = (device_kind, tuple(fp32_ops), tuple(low_precision_ops),
           tuple(sorted(getattr(graph, "tp_refused", {}).items())),
           tuple(sorted(getattr(graph, "tp_tables", {}).items())))
    return once_per_graph(_PROFILES, graph, how,
                          lambda: profile(graph, device_kind=device_kind, fp32_ops=fp32_ops,
                                          low_precision_ops=low_precision_ops))


def once_per_graph(cache: dict, graph, how: tuple, make):
    """``make()``, kept in ``cache`` for ``graph`` while it lives, and made again when ``how`` (what
    it depends on besides the graph) changes: the latest one per graph."""
    hit = cache.get(id(graph))
    if hit is not None and hit[0]() is graph and hit[1] == how:
        return hit[2]
    with no_cycle_collection():
        value = make()
    key = id(graph)
    try:
        ref = weakref.ref(graph, lambda _r: cache.pop(key, None))
    except TypeError:
        return value
    cache[key] = (ref, how, value)
    return value


@contextlib.contextmanager
def no_cycle_collection():
    """Python's cyclic garbage collector paused (as it was after): a profile makes hundreds of
    thousands of small tuples (a forward moment per op and precision), and each pass of the
    collector's oldest generation walks every object a large graph holds, a large share of a large
    model's first plan() call. A profile makes no reference cycles for it to free."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def profile(graph, *, device_kind: str = "cuda", fp32_ops=(),
            low_precision_ops=()) -> GraphProfile:
    """Walk ``graph`` once (see :mod:`autopar_nb.cost.profile`). ``device_kind`` is "cuda" or "cpu"
    (what autograd saves for dropout and RMSNorm differs, and autocast's op lists). ``fp32_ops`` /
    ``low_precision_ops``: the plan's op lists (``precision.fp32_ops`` / ``low_precision_ops``),
    which change the dtypes saved under autocast."""
    refused: dict[str, str] = {}
    f = graph_facts(graph, refused, device_kind)
    amp = {p: amp_facts(f, device_kind, low_params=p == "autocast_lowp", fp32_ops=fp32_ops,
                        low_precision_ops=low_precision_ops) for p in PRECISIONS[1:]}
    layers = {lay.path: LayerProfile(lay.path) for lay in graph.layers}
    count_compute(layers, f)
    count_float8(layers, f)
    count_amp_time(layers, f, amp)
    first_saver = count_saved(layers, f, amp, device_kind)
    count_selective(layers, f, amp, device_kind)
    count_comms(layers, f)
    count_boundaries(layers, f, amp)
    split_params = count_tp(layers, f)
    count_params(layers, f, split_params=split_params, cast=amp["autocast"].autocast.cast_params)
    # after count_saved (the moments it fills in) and count_params (the parameters a layer borrows)
    count_later_gradients(layers, f, split_params)
    count_experts(layers, f)
    count_keys_values(layers, f)
    out = graph.outputs[0] if graph.outputs else None
    sp = sp_extent(graph, f.by_name, f.tp.styles, f.tp.sharded)
    crossings, last = count_crossings(f, amp, first_saver), _index(graph, sp.last)
    return GraphProfile(
        layers=[layers[lay.path] for lay in graph.layers], batch=graph.batch_size,
        seq_len=graph.seq_len, loss_parallel=bool(f.tp.head), output_numel=out.numel if out else 0,
        output_itemsize=out.itemsize if out else 4, region_modules=_region_modules(f),
        device_kind=device_kind, rep=_repeats(graph),
        tp_refused={f.by_name[k].module_path: why for k, why in refused.items()},
        tp_whole={f.by_name[k].module_path: why for k, why in f.tp.whole.items()},
        pp_blocker=pp_blocker(f), sp_blocker=sp.refused, sp_end=sp.why_last,
        sp_before=[_index(graph, p) for p in sp.before], sp_last=last,
        sp_gather=_index(graph, sp.gather),
        sp_gather_comms=_gather_comms(crossings, last, sp.gather),
        cp_blocker=cp_blocker(graph, device_kind), crossings=crossings,
        pp_glued=stage_start_refusals(graph))


def _gather_comms(crossings: list[list[Crossing]], last: int | None, gather: str) -> list[Comm]:
    """The collectives of the gather that ends sequence parallelism after layer ``last``: the shards
    made up to ``last`` that enter the next layer with parameters, all-gathered in forward, their
    gradient reduce-scattered in backward (``planner.styles``' ``GATHER``: a ``PrepareModuleInput``
    from ``Shard(1)`` to ``Replicate()``)."""
    if last is None:
        return []
    into = [c for c in crossings[last + 1] if 0 <= c.made <= last]
    full, half = sum(c.nbytes["fp32"] for c in into), sum(c.nbytes["autocast"] for c in into)
    return [Comm("all_gather", full, half, "fwd"), Comm("reduce_scatter", full, half, "bwd")]


def _index(graph, path: str) -> int | None:
    """The index of layer ``path`` (None for "")."""
    return [lay.path for lay in graph.layers].index(path) if path else None


def _region_modules(f: Facts) -> dict[int, list[str]]:
    """TP region id -> the modules whose styles must change together."""
    region_modules: dict[int, list[str]] = defaultdict(list)
    for name, rid in f.tp.region_of.items():
        region_modules[rid].append(f.by_name[name].module_path)
    return dict(region_modules)


def _repeats(graph) -> list[int]:
    """Layer index -> index of the first instance of its repeated block (itself when none)."""
    index = {lay.path: i for i, lay in enumerate(graph.layers)}
    return [index[graph.block_of(lay.path).members[0]] if graph.block_of(lay.path) else i
            for i, lay in enumerate(graph.layers)]
