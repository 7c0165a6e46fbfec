"""What ``torch.compile`` costs at start-up, which a step time does not show: the seconds Inductor
takes to compile the plan's compiled layers once, before the first step runs them.

The runtime compiles each repeated block on its own (``runtime/compile.py``, torchtitan's regional
compile): Dynamo caches the graph by the block's code, so the members of one repeated block share
one compile and a 32-layer model compiles as fast as a 2-layer one; a compiled layer outside any
block is a graph of its own. Each distinct graph is priced by its forward ops
(:attr:`LayerProfile.n_ops`; its backward is compiled with it) at
:attr:`~.factors.Factors.compile_s_per_op`, measured on an H200 and on this project's CPU host.
"""

from __future__ import annotations


def compiled_graphs(graph, compiled: list[bool]) -> list[int]:
    """The layers whose graph Inductor compiles: of the layers ``compiled`` marks, the first member
    of each repeated block (the others reuse its graph) and every layer outside a block."""
    seen: set[str] = set()
    out = []
    for i, (lay, on) in enumerate(zip(graph.layers, compiled, strict=True)):
        block = graph.block_of(lay.path)
        key = block.name if block is not None else lay.path
        if on and key not in seen:
            seen.add(key)
            out.append(i)
    return out


def compile_startup_s(graph, prof, compiled: list[bool], factors) -> float:
    """Seconds of Inductor compile at start-up for the layers ``compiled`` marks (module
    docstring)."""
    return (sum(prof.layers[i].n_ops
                for i in compiled_graphs(graph, compiled)) * factors.compile_s_per_op)
