"""The memory timeline of one step (:mod:`autopar_nb.planner.timeline`) with what the plan's
exported script holds at each of its moments, measured: :func:`autopar_nb.verify.measure.measure`
runs the script's own step under torch's memory tracker, which keeps the largest total at each place
the step runs ("train/backward in GPT.h.3"), and each place is matched with the predicted moment it
is at (:func:`autopar_nb.verify.moments.moment_at`, as a measured peak is)."""

from __future__ import annotations

from ..cost.schedule import MULTI_STAGE
from ..planner.timeline import MemoryTimeline, memory_timeline, memory_timelines
from .measure import measure, needs_real_group
from .moments import moment_at

MAPPED_STAGED = ("interleaved_1f1b", "looped_bfs")
"""the schedules with several stages per rank whose moments a measured place maps to: each of a
rank's moments is one micro-batch's forward, loss or backward of a layer, and the tracker's place
names the layer and which of the step's calls of its module it is (the micro-batch). Not the
zero-bubble ones: their backward's input and weight passes are one place to the tracker"""
MAX_LOCAL_RANKS = 8
"""the most processes a measurement on a real gloo group starts on this machine (a pipeline's,
expert parallelism's: every rank of the plan)"""


def measured_basis(plan) -> str:
    """What a measured timeline's curve is, for ``plan``."""
    group = "a real gloo group" if needs_real_group(plan) else "one rank of a fake process group"
    return f"measured tensors (torch's memory tracker on CPU, {group})"


def measured_timeline(source, plan, graph, *, cluster=None, rank: int | None = None, steps: int = 2,
                      timeout: float = 600) -> MemoryTimeline:
    """:func:`autopar_nb.memory_timeline` of ``plan`` with its :attr:`~MemoryTimeline.measured`
    curve: the exported script of ``source`` (a :class:`~autopar_nb.source.ModelSource`) run for
    ``steps`` steps on CPU under torch's memory tracker as the first rank of pipeline rank
    ``rank``'s stage, its last step's largest total at each moment (None at a moment no measured
    place maps to: a run of identical layers' middle ones, which the timeline leaves out). A
    schedule with several stages per rank other than :data:`MAPPED_STAGED` is refused, as is a plan
    measured on a real group (pipelines, expert parallelism) of more than :data:`MAX_LOCAL_RANKS`
    processes. Several pipeline ranks from one run: :func:`measured_timelines`.

    >>> tl = measured_timeline(src, plan, graph)
    >>> print(tl)   # a second column: what was measured at each moment"""
    (tl,) = measured_timelines(source, plan, graph, cluster=cluster, ranks=(rank,), steps=steps,
                               timeout=timeout)
    return tl


def measured_timelines(source, plan, graph, *, cluster=None,
                       ranks: tuple[int | None, ...] | None = None, steps: int = 2,
                       timeout: float = 600) -> list[MemoryTimeline]:
    """:func:`measured_timeline` of each pipeline rank of ``ranks`` (None: every pipeline rank), all
    measured by one :func:`~autopar_nb.verify.measure.measure` call: a plan on a real gloo group
    runs every rank in that one run anyway, so its pipeline ranks cost no more together than one of
    them."""
    if (plan.mesh.pp > 1 and plan.pipeline.schedule in MULTI_STAGE
        and plan.pipeline.schedule not in MAPPED_STAGED):
        raise ValueError(f"a measured timeline of a {plan.pipeline.schedule} schedule is not "
                         "supported (its backward's input and weight passes run the same layer's "
                         "autograd nodes, which the tracker cannot tell apart): use "
                         "interleaved_1f1b or looped_bfs, or a schedule with one stage per rank "
                         "(1f1b, gpipe)")
    if needs_real_group(plan) and plan.mesh.world_size > MAX_LOCAL_RANKS:
        raise ValueError(f"measuring this plan runs all its {plan.mesh.world_size} ranks as "
                         f"processes here (more than {MAX_LOCAL_RANKS}): measure the same layout "
                         "at fewer processes, Session.plan_for(nproc)")
    if ranks is None:
        tls = memory_timelines(plan, graph, cluster=cluster)
    else:
        tls = [memory_timeline(plan, graph, cluster=cluster, rank=r) for r in ranks]
    width = max(1, plan.mesh.world_size // tls[0].ranks)
    got = measure(source, plan, ranks=tuple(tl.rank * width for tl in tls), steps=steps,
                  timeout=timeout, moments=True)
    paths = [lay.path for lay in graph.layers]
    for tl, one in zip(tls, got, strict=True):
        tl.measured = measured_curve(one["moments"], tl, paths)
        tl.measured_basis = measured_basis(plan)
    return tls


def measured_curve(places: list, tl: MemoryTimeline, layer_paths: list[str]) -> list[float | None]:
    """The largest of ``places`` ([where, micro-batch or None, its largest total]:
    ``measure(moments=True)``) at each of ``tl``'s moments (a pipeline rank's backward at its first
    micro-batch's moment or a later one's); None where none maps to it."""
    values: list[float | None] = [None] * len(tl)
    for where, micro_batch, total in places:
        hit = moment_at(where, layer_paths, tl.keys, micro_batch=micro_batch)
        i = (next((k for k, key in enumerate(tl.keys) if key is hit), None) if hit is not None
             else None)
        if i is not None:
            values[i] = max(values[i] or 0.0, float(total))
    return values
