"""A memory timeline of one training step (like PyTorch's memory_viz active-memory view), from the
cost model: the bytes a pipeline rank holds at each moment its predicted peak is chosen from
(:func:`autopar_nb.cost.estimate. peak_moments`: each layer's forward, the loss, each layer's
recompute and backward, a pipelined FSDP stage's gradient reduction, the optimizer step), in the
order the step runs them, with the terms that make up each moment.

The bytes are the predicted tensors (parameters, gradients, optimizer states, activations, buffers),
without the allocator margin: the figure a launched run's measured peak compares with
(``autopar_nb.launch.compare``), and the timeline's largest moment is the plan's predicted peak for
the rank, margin aside."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import groupby
from typing import Any, NamedTuple

from ..cost.estimate import peak_moments
from ..cost.schedule import MULTI_STAGE
from ..hardware import Cluster
from ..plan import Plan
from ..units import fmt_bytes
from .explain import COMPONENT_LABELS

TOP_TERMS = 3
"""how many of a moment's largest terms it names"""
PHASE_LABELS = {"reduce": "gradient reduction", "step": "optimizer step"}
PASSES = {"I": "input pass, ", "W": "weight pass, "}
"""a zero-bubble backward's two passes, as a moment's label names them"""
_PHASE_ORDER = {"forward": 0, "loss": 1, "recompute": 2, "backward": 2, "reduce": 3, "step": 4}


class Moment(NamedTuple):
    """One moment of a rank's step on the timeline."""

    label: str
    """what runs then: "forward h.0", "backward h.3 (a later micro-batch)", "loss", "optimizer
    step"..."""
    bytes: float
    """the predicted tensors alive then (no allocator margin)"""
    terms: list[tuple[str, float]]
    """its largest components, largest first: (label, bytes), at most :data:`TOP_TERMS`"""


@dataclass
class MemoryTimeline:
    """The predicted memory of one pipeline rank over one step (:func:`memory_timeline`): iterate it
    for its :class:`Moment` rows; ``str()`` draws it for a terminal."""

    rank: int
    """the pipeline rank (every dp x tp rank of a pipeline stage holds the same)"""
    moments: list[Moment] = field(default_factory=list)
    peak: int = 0
    """the index of the largest moment"""
    margin: float = 0.0
    """the allocator margin the plan adds to the peak (not part of any moment's bytes)"""
    ranks: int = 1
    """pipeline ranks of the plan"""
    keys: list[tuple] = field(default_factory=list, repr=False)
    """each moment as the cost model lists it (``peak_moments``: phase, layer index, breakdown, op,
    later) and the action it is in on a multi-stage rank ((kind, micro-batch); (None, None)
    elsewhere): what a measured place is matched with (``verify.moments.moment_at``)"""
    measured: list[float | None] | None = None
    """after a measurement (``autopar_nb.verify.timeline.measured_timeline``): the largest total
    measured at each moment, None at a moment no measured place maps to"""
    measured_basis: str = ""
    """what :attr:`measured` is (which tracker, which process group)"""

    def __iter__(self):
        return iter(self.moments)

    def __len__(self) -> int:
        return len(self.moments)

    def __getitem__(self, i: int) -> Moment:
        return self.moments[i]

    @property
    def peak_bytes(self) -> float:
        """The largest moment's bytes: the plan's predicted peak for the rank without its margin."""
        return self.moments[self.peak].bytes if self.moments else 0.0

    def text(self, width: int = 40) -> str:
        """The timeline as text: one line per moment with a bar ``width`` characters long at the
        peak, the peak marked and its largest terms named."""
        if not self.moments:
            return f"pipeline rank {self.rank}: no moments"
        top = self.peak_bytes or 1.0
        pad = max(len(m.label) for m in self.moments)
        lines = [f"Predicted memory over one step, pipeline rank {self.rank} of {self.ranks} "
                 f"(tensors, no allocator margin; the plan adds {fmt_bytes(self.margin)} to the "
                 "peak)"]
        if self.measured is not None:
            lines.append(f"second column: {self.measured_basis} (— where no measured place maps to "
                         "the moment)")
        for i, m in enumerate(self.moments):
            bar = "█" * max(1, round(width * m.bytes / top)) if m.bytes > 0 else ""
            seen = "" if self.measured is None else f"  {_fmt_measured(self.measured[i]):>10}"
            lines.append(f"{m.label:<{pad}}  {fmt_bytes(m.bytes):>10}{seen}  {bar}"
                         f"{'  ◀ peak' if i == self.peak else ''}")
        p = self.moments[self.peak]
        lines.append(f"peak {fmt_bytes(p.bytes)} at {p.label}: "
                     + ", ".join(f"{name} {fmt_bytes(b)}" for name, b in p.terms))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(self.text())


def memory_timeline(plan: Plan, graph, *, cluster: Cluster | None = None,
                    rank: int | None = None) -> MemoryTimeline:
    """The predicted memory of pipeline rank ``rank`` of ``plan`` (for the model ``graph`` it was
    made for) over one training step: a :class:`MemoryTimeline` whose rows are (moment label, bytes,
    largest terms), in the order the step runs them; ``rank=None`` takes the rank with the largest
    peak. ``cluster``: the one the plan was made on (default: its preset, rebuilt from
    ``plan.cluster``).

    >>> tl = ap.memory_timeline(plan, graph)
    >>> print(tl)          # a bar per moment, the peak marked and its largest terms named
    >>> [(m.label, m.bytes) for m in tl]

    A run of identical layers is represented by the layers its peak can be at (its first and last
    two), as the cost model weighs them. The bytes leave out the allocator margin, as a launched
    run's measured peak does."""
    lines = memory_timelines(plan, graph, cluster=cluster)
    if rank is None:
        rank = max(range(len(lines)), key=lambda r: lines[r].peak_bytes)
    if not 0 <= rank < len(lines):
        raise ValueError(f"rank {rank} is not a pipeline rank of this plan: pp={len(lines)}, ranks "
                         f"0 to {len(lines) - 1}")
    return lines[rank]


def memory_timelines(plan: Plan, graph, *, cluster: Cluster | None = None) -> list[MemoryTimeline]:
    """:func:`memory_timeline` of every pipeline rank of ``plan``."""
    if plan.cost is None:
        raise ValueError("the plan has no cost: make it with ap.plan() (or estimate it) for this "
                         "model first")
    cluster = cluster or cluster_of(plan)
    paths = [lay.path for lay in graph.layers]
    staged = plan.mesh.pp > 1 and plan.pipeline.schedule in MULTI_STAGE
    # a multi-stage rank's moments come in torch's order, each at its micro-batch (a layer runs once
    # per micro-batch there); the others by run of layers, to be put in the step's order by
    # micro-batch (their ``later``, which only the per-op listing carries: ~3x the time, so not for
    # the multi-stage ones, whose moments are many)
    per_rank = peak_moments(graph, cluster, plan, per_op=not staged, action=staged)
    m = plan.batch.micro_batches
    out = []
    for r, rows in enumerate(per_rank):
        # an action's moments as it runs its layers: the loss first, the backwards from the last
        # layer
        if staged:
            rows = [
                row for _, run in groupby(((*mo[:3], None, None, mo[3:])
                                           for mo in rows), key=lambda x: x[5])
                for row in sorted(run, key=lambda x: _step_order(x[:5]))
            ]
        else:  # a layer's largest op (the others are for measured components)
            rows = [(*mo, (None, None))
                    for mo in sorted((mo for mo in rows if mo[3] is None), key=_step_order)]
        moments = [Moment(_label(phase, layer, later, paths, action, m), _tensors(mb), _largest(mb))
                   for phase, layer, mb, _op, later, action in rows]
        peak = max(range(len(moments)), key=lambda i: moments[i].bytes)
        margin = rows[peak][2].margin if rows else 0.0
        out.append(MemoryTimeline(r, moments, peak, float(margin), len(per_rank),
                                  keys=[row[:6] for row in rows]))
    return out


def cluster_of(plan: Plan) -> Cluster:
    """The cluster ``plan`` was made on, rebuilt from its preset (``plan.cluster``)."""
    info = plan.cluster or {}
    preset = info.get("preset")
    if not preset:
        raise ValueError("the plan was made on a custom cluster (no preset): pass cluster=")
    limit = info.get("memory_limit_bytes")
    return Cluster.preset(preset, int(info.get("nodes", 1)), int(info.get("gpus_per_node", 1)),
                          memory_gb=limit / 2**30 if limit else None)


def _step_order(mo: tuple) -> tuple:
    """When a moment happens in the step: the first micro-batch's (or every micro-batch's) moments
    before a later one's; within them the forwards from the first layer, the loss, the backwards
    (each after its recompute) from the last layer; the reduction and the optimizer step last."""
    phase, layer, _mb, _op, later = mo
    key = _PHASE_ORDER[phase]
    position = -1 if layer is None else (layer if phase == "forward" else -layer)
    return (key >= 3, bool(later), key, position, phase == "backward")


def _label(phase: str, layer: int | None, later: bool | None, paths: list[str], action: tuple,
           m: int) -> str:
    """What runs at a moment; on a multi-stage rank (``action``: its kind and micro-batch) at which
    micro-batch, and which pass of a backward split in two (zero bubble)."""
    text = PHASE_LABELS.get(phase, phase) + (f" {paths[layer]}" if layer is not None else "")
    kind, micro_batch = action
    if micro_batch is not None:
        return text + f" ({PASSES.get(kind, '')}micro-batch {micro_batch + 1} of {m})"
    return text + {True: " (a later micro-batch)", False: " (first micro-batch)", None: ""}[later]


def _fmt_measured(b: float | None) -> str:
    return fmt_bytes(b) if b is not None else "—"


def _tensors(mb) -> float:
    return float(mb.total - mb.margin)


def _largest(mb) -> list[tuple[str, float]]:
    parts: dict[str, Any] = {COMPONENT_LABELS[k]: getattr(mb, k)
                             for k in ("params", "grads", "optimizer")}
    parts.update({k.replace("_", " "): v for k, v in (mb.terms or {}).items()})
    return [(k, float(v)) for k, v in sorted(parts.items(), key=lambda kv: -kv[1])
            if v > 0][:TOP_TERMS]
