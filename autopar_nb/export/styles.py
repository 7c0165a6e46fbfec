"""Which ParallelStyle each module gets: the plan's per-module TP choices turned into :class:`TPStyle` data.

Rules (Megatron-LM / torchtitan):

* ``nn.Linear`` colwise shards the output features, rowwise the input features; a colwise Linear with no rowwise
  Linear beside it in the same parent (an output head) gathers its output, or keeps it vocab-sharded for
  ``loss_parallel``.
* ``nn.Embedding`` rowwise = vocab-parallel (rows), colwise = embedding dim; both take replicated ids.
* sequence parallelism covers consecutive layers (typically the blocks, the final norm and the head): the first one
  cuts its replicated input along the sequence (``PrepareModuleInput``, no communication), norms run on sequence
  shards (``SequenceParallel``), rowwise Linears reduce-scatter to ``Shard(1)``, the module that holds a layer's
  colwise Linears all-gathers its input once (so code inside it sees the whole sequence), and the first layer after
  the region gathers the sequence back (or, for an output head, its colwise Linear does). Embeddings always output
  replicated activations: a position embedding is often added to the token embedding before the first block.
"""

from __future__ import annotations

import torch.nn as nn

from ..runtime.tp import REPLICATE, TPStyle

SEQ = 1
"""the sequence dim of (batch, seq, ...) activations: sequence parallelism shards it"""
GATHER = TPStyle("prepare_input", input_layout=SEQ, desired_layout=REPLICATE, use_local_output=True)
"""the whole sequence back from sequence shards, at a module's input"""


def tp_styles(model: nn.Module, tp_plan: dict[str, str], *, sp_layers: list[str] = (), layers: list[str] = (),
              loss_parallel: bool = False) -> dict[str, TPStyle]:
    """Module path -> :class:`TPStyle`, in model order (see the module docstring).

    ``tp_plan``: module path -> style from the plan; ``sp_layers``: layer paths whose activations are
    sequence-sharded (a layer holding a ``sequence_parallel`` module is one too); ``layers``: every layer path in
    model order (to find where the sequence-parallel region ends); ``loss_parallel``: the head's logits stay sharded
    on the vocabulary for ``loss_parallel()``.
    """
    modules = dict(model.named_modules())
    for path in tp_plan:
        if path not in modules:
            raise ValueError(f"the plan shards module {path!r}, which the model does not have; "
                             f"re-capture the model or fix the override")
    ordered = [p for p in modules if tp_plan.get(p, "replicate") != "replicate"]
    # parents of rowwise Linears: a colwise Linear beside one feeds it; one without is an output head
    row_parents = {p.rpartition(".")[0] for p in ordered
                   if tp_plan[p] == "rowwise" and isinstance(modules[p], nn.Linear)}
    region, after = _sp_region(modules, tp_plan, sp_layers, layers)

    def in_sp(path: str) -> str | None:
        """The sequence-parallel layer that contains ``path``, if any."""
        for layer in region:
            if path == layer or path.startswith(layer + "."):
                return layer
        return None

    def fed_sequence_shards(path: str) -> bool:
        return in_sp(path) is not None or (after is not None and (path == after or path.startswith(after + ".")))

    styles: dict[str, TPStyle] = {}
    if region and region[0] not in tp_plan:
        # enter: the replicated activations (embeddings' outputs) are cut along the sequence, locally, no comm
        styles[region[0]] = TPStyle("prepare_input", input_layout=REPLICATE, desired_layout=SEQ,
                                    use_local_output=True)
    if region and after is None and region[-1] not in tp_plan:
        # the model's output leaves from inside the region: gather the sequence back
        if region[-1] in styles:
            raise NotImplementedError(f"sequence parallelism over the single layer {region[-1]} only is not "
                                      "supported; extend it over the blocks")
        styles[region[-1]] = TPStyle("prepare_output", output_layout=SEQ, desired_layout=REPLICATE,
                                     use_local_output=True)
    if after is not None and after not in tp_plan:
        # leave: the next layer gets the whole sequence back
        styles[after] = GATHER
    for path in ordered:
        module, style, sp = modules[path], tp_plan[path], in_sp(path)
        if isinstance(module, nn.EmbeddingBag):
            raise NotImplementedError(f"{path}: PyTorch TP does not shard nn.EmbeddingBag; keep it 'replicate' "
                                      "and shard it with FSDP (zero_stage >= 2), or use nn.Embedding")
        if style == "sequence_parallel":
            if sp is None:
                raise NotImplementedError(f"{path} is 'sequence_parallel' outside the sequence-parallel layers")
            styles[path] = TPStyle("sequence_parallel", use_local_output=True)  # plain tensors between modules
        elif isinstance(module, nn.Embedding):
            # replicated output (other embeddings, e.g. positions, are often added to it); the first
            # sequence-parallel layer cuts the sequence
            kind = "rowwise" if style == "rowwise" else "colwise"
            styles[path] = TPStyle(kind, input_layout=REPLICATE, output_layout=REPLICATE)
        elif not isinstance(module, nn.Linear):
            raise NotImplementedError(f"{path} is a {type(module).__name__}: TP styles colwise/rowwise apply to "
                                      "nn.Linear and nn.Embedding; use 'sequence_parallel' for norms or 'replicate'")
        elif style == "rowwise":
            styles[path] = TPStyle("rowwise", output_layout=SEQ) if sp else TPStyle("rowwise")
        elif path.rpartition(".")[0] not in row_parents:  # an output head: no rowwise Linear consumes its shard
            seq = SEQ if fed_sequence_shards(path) and styles.get(after) is None else REPLICATE
            if loss_parallel:
                styles[path] = TPStyle("colwise", input_layout=seq, output_layout=-1, use_local_output=False)
            else:
                styles[path] = TPStyle("colwise", input_layout=seq, output_layout=REPLICATE)
        else:
            parent = path.rpartition(".")[0]
            if sp and parent != sp and parent.startswith(sp + "."):
                # gather the sequence once at the entry of the block that holds the colwise Linears
                styles.setdefault(parent, GATHER)
                styles[path] = TPStyle("colwise")
            else:
                styles[path] = TPStyle("colwise", input_layout=SEQ if sp else REPLICATE)
    _check_region_params(modules, styles, region)
    # parents first, so the order reads top-down like a hand-written plan
    return dict(sorted(styles.items(), key=lambda kv: list(modules).index(kv[0])))


def _check_region_params(modules: dict[str, nn.Module], styles: dict[str, TPStyle], region: list[str]) -> None:
    """Every parameter that sees sequence shards must belong to a split (TP) or sequence-parallel module; plain
    parameters there would get the gradient of one rank's tokens only."""
    gathered = [p for p, style in styles.items() if style == GATHER]
    for layer in region:
        for path, module in modules.items():
            if not (path == layer or path.startswith(layer + ".")) or not module._parameters:
                continue
            if path in styles and not styles[path].kind.startswith("prepare_"):
                continue
            if any(path == g or path.startswith(g + ".") for g in gathered if g != layer):
                continue  # inside a block that gathered the whole sequence
            raise NotImplementedError(
                f"{path} ({type(module).__name__}) has parameters and no TP style, but sees sequence shards in the "
                f"sequence-parallel layer {layer}: split it (colwise/rowwise), mark it 'sequence_parallel' if it is "
                f"a norm, or turn sequence parallelism off for {layer}")


def _sp_region(modules: dict[str, nn.Module], tp_plan: dict[str, str], sp_layers, layers
               ) -> tuple[list[str], str | None]:
    """The consecutive layers whose activations are sequence-sharded, and the first layer after them.

    Embedding layers and layers without parameters neither start nor end the region (embeddings output replicated
    activations; rotary tables, activations and dropout layers carry no sharding decision)."""
    flagged = set(sp_layers) | {layer for layer in layers for path, style in tp_plan.items()
                                if style == "sequence_parallel" and (path == layer or path.startswith(layer + "."))}
    if not flagged:
        return [], None
    layers = list(layers) or sorted(flagged, key=list(modules).index)

    def counts(path: str) -> bool:
        m = modules.get(path)
        return m is not None and not isinstance(m, (nn.Embedding, nn.EmbeddingBag)) \
            and any(True for _ in m.parameters())

    def split(layer: str) -> bool:
        return any(path == layer or path.startswith(layer + ".") for path, style in tp_plan.items()
                   if style != "replicate")

    candidates = [layer for layer in layers if counts(layer)]
    # a flagged layer that TP leaves whole (e.g. a replicated head) gets the whole sequence instead: its plain
    # parameters would otherwise see one rank's tokens and never sum their gradients over the TP ranks
    region = [layer for layer in candidates if layer in flagged and split(layer)]
    if not region:
        return [], None
    i, j = candidates.index(region[0]), candidates.index(region[-1])
    if candidates[i:j + 1] != region:
        gaps = [layer for layer in candidates[i:j + 1] if layer not in flagged]
        raise NotImplementedError(f"sequence parallelism must cover consecutive layers; {', '.join(gaps)} "
                                  f"between {region[0]} and {region[-1]} are not sequence-parallel")
    if tp_plan.get(region[0]) == "sequence_parallel":
        raise NotImplementedError(f"the first sequence-parallel layer {region[0]} is itself a norm: start sequence "
                                  "parallelism at a block (a module holding the norm and the Linears)")
    return region, candidates[j + 1] if j + 1 < len(candidates) else None
