"""The sequence-parallel region of a TP plan: the consecutive layers whose activations are
sequence-sharded (:func:`sp_region`), the styles at its edges that cut the sequence and gather it
back (:func:`region_edges`), and the check that every parameter inside it is split or
sequence-parallel (:func:`check_region_params`). :mod:`.styles` chooses the styles inside it."""

from __future__ import annotations

import torch.nn as nn

from ..plan import within
from ..runtime.tp import REPLICATE, TPStyle

SEQ = 1
"""the sequence dim of (batch, seq, ...) activations: sequence parallelism shards it"""
GATHER = TPStyle("prepare_input", input_layout=SEQ, desired_layout=REPLICATE, use_local_output=True)
"""the whole sequence back from sequence shards, at a module's input"""


def sp_region(modules: dict[str, nn.Module], tp_plan: dict[str, str], sp_layers, layers
               ) -> tuple[list[str], str | None]:
    """The consecutive layers whose activations are sequence-sharded, and the first layer after
    them.

    Embedding layers and layers without parameters neither start nor end the region (embeddings
    output replicated activations; rotary tables, activations and dropout layers carry no sharding
    decision)."""
    flagged = set(sp_layers) | {layer for layer in layers for path, style in tp_plan.items()
                                if style == "sequence_parallel" and within(path, layer)}
    if not flagged:
        return [], None
    layers = list(layers) or sorted(flagged, key=list(modules).index)

    def counts(path: str) -> bool:
        m = modules.get(path)
        return m is not None and not isinstance(m, (nn.Embedding, nn.EmbeddingBag)) \
            and any(True for _ in m.parameters())

    def split(layer: str) -> bool:
        return any(within(path, layer) for path, style in tp_plan.items()
                   if style != "replicate")

    candidates = [layer for layer in layers if counts(layer)]
    # a flagged layer that TP leaves whole (e.g. a replicated head) gets the whole sequence instead:
    # its plain parameters would otherwise see one rank's tokens and never sum their gradients over
    # the TP ranks
    region = [layer for layer in candidates if layer in flagged and split(layer)]
    if not region:
        return [], None
    i, j = candidates.index(region[0]), candidates.index(region[-1])
    if candidates[i:j + 1] != region:
        gaps = [layer for layer in candidates[i:j + 1] if layer not in flagged]
        raise NotImplementedError("sequence parallelism must cover consecutive layers; "
                                  f"{', '.join(gaps)} between {region[0]} and {region[-1]} are not "
                                  "sequence-parallel")
    if tp_plan.get(region[0]) == "sequence_parallel":
        raise NotImplementedError(f"the first sequence-parallel layer {region[0]} is itself a "
                                  "norm: start sequence parallelism at a block (a module holding "
                                  "the norm and the Linears)")
    return region, candidates[j + 1] if j + 1 < len(candidates) else None


def region_edges(styles: dict[str, TPStyle], tp_plan: dict[str, str], region: list[str],
                  after: str | None) -> None:
    """The styles where the sequence-parallel region begins and ends (unless the plan chose those
    modules')."""
    if region and region[0] not in tp_plan:
        # enter: the replicated activations (embeddings' outputs) are cut along the sequence,
        # locally, no comm
        styles[region[0]] = TPStyle("prepare_input", input_layout=REPLICATE, desired_layout=SEQ,
                                    use_local_output=True)
    if region and after is None and region[-1] not in tp_plan:
        # the model's output leaves from inside the region: gather the sequence back
        if region[-1] in styles:
            raise NotImplementedError(f"sequence parallelism over the single layer {region[-1]} "
                                      "only is not supported; extend it over the blocks")
        styles[region[-1]] = TPStyle("prepare_output", output_layout=SEQ, desired_layout=REPLICATE,
                                     use_local_output=True)
    if after is not None and after not in tp_plan:
        # leave: the next layer gets the whole sequence back
        styles[after] = GATHER



def check_region_params(modules: dict[str, nn.Module], styles: dict[str, TPStyle],
                         region: list[str]) -> None:
    """Every parameter that sees sequence shards must belong to a split (TP) or sequence-parallel
    module; plain parameters there would get the gradient of one rank's tokens only."""
    gathered = [p for p, style in styles.items() if style == GATHER]
    for layer in region:
        for path, module in modules.items():
            if not within(path, layer) or not module._parameters:
                continue
            if path in styles and not styles[path].kind.startswith("prepare_"):
                continue
            if any(within(path, g) for g in gathered if g != layer):
                continue  # inside a block that gathered the whole sequence
            raise NotImplementedError(
                f"{path} ({type(module).__name__}) has parameters and no TP style, but sees "
                f"sequence shards in the sequence-parallel layer {layer}: split it "
                "(colwise/rowwise), mark it 'sequence_parallel' if it is a norm, or turn sequence "
                f"parallelism off for {layer}")

