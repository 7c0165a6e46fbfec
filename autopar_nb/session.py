"""Session: what ``%%autoparallel`` binds in the user's namespace (``ap`` by default).

It holds the captured graph, the cluster, the cell's source and the user's constraints, and offers the same
operations as the widget as plain Python calls.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any

from .graph import ModelGraph, human
from .hardware import Cluster
from .plan import Plan
from .source import ModelSource

MODES = ("auto", "semi", "manual")


@dataclass
class Session:
    """One model cell: ``graph`` (the captured ModelGraph), ``cluster``, ``source`` (the cell code and names) and
    the planning constraints. ``plan`` is the current Plan once a planner has run."""

    graph: ModelGraph
    cluster: Cluster
    source: ModelSource
    global_batch: int | None = None
    """samples per optimizer step (--batch); None = the example inputs' batch size"""
    mode: str = "auto"
    """auto: the planner chooses everything; semi: it honours pinned choices (--fix, override()); manual: --fix
    must give the whole mesh and the planner only costs it"""
    fix: dict[str, Any] = field(default_factory=dict)
    """pinned global choices, e.g. {"tp": 2, "zero_stage": 3}"""
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    """layer-path glob -> pinned per-layer choices, e.g. {"h.*.mlp": {"tp": "colwise-rowwise"}}"""
    plan: Plan | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} unknown; choose one of {', '.join(MODES)}")

    @property
    def batch(self) -> int:
        """The global batch the plan is made for."""
        return self.global_batch or self.graph.batch_size

    def summary(self) -> str:
        """Plain-text summary: model, cluster, layers (repeated blocks folded)."""
        lines = [self.graph.summary(), f"cluster: {self.cluster.describe()}; global batch {self.batch}"]
        if self.plan is not None:
            lines.append(f"plan: {self.plan.summary()}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<autopar_nb.Session {self.graph.model_type}: {self.summary().splitlines()[0]}>"

    def _repr_html_(self) -> str:
        g = self.graph
        rows = []
        for layer, count in g.folded_layers():
            name = layer.path if count == 1 else f"{g.block_of(layer.path).name}.[0–{count - 1}]"
            rows.append(f"<tr><td><code>{html.escape(name)}</code></td><td>{html.escape(layer.type)}</td>"
                        f"<td style='text-align:right'>{f'× {count}' if count > 1 else ''}</td>"
                        f"<td style='text-align:right'>{human(layer.num_params)}</td>"
                        f"<td style='text-align:right'>{human(layer.flops)}FLOP</td></tr>")
        inputs = ", ".join(str(tuple(i.shape)) for i in g.inputs)
        plan = f"<p><b>Plan:</b> {html.escape(self.plan.summary())}</p>" if self.plan is not None else ""
        return (f"<div class='autopar-summary'><p><b>{html.escape(g.model_type)}</b>: {human(g.num_params)}params, "
                f"{human(g.step_flops)}FLOP per step (fwd+bwd) on inputs {inputs}; {len(g.nodes)} ops "
                f"({g.tracer}). Cluster: {html.escape(self.cluster.describe())}; global batch {self.batch}.</p>"
                f"{plan}<table><thead><tr><th>layer</th><th>type</th><th></th><th>params</th><th>fwd</th></tr>"
                f"</thead><tbody>{''.join(rows)}</tbody></table></div>")
