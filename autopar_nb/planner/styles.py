"""Which ParallelStyle each module gets: the plan's per-module TP choices turned into
:class:`TPStyle` data.

Rules (Megatron-LM / torchtitan):

* ``nn.Linear`` colwise shards the output features, rowwise the input features; a colwise Linear
  with no rowwise Linear beside it in the same parent (an output head) gathers its output, or keeps
  it vocab-sharded for ``loss_parallel``.
* ``nn.Embedding`` rowwise = vocab-parallel (rows), colwise = embedding dim; both take replicated
  ids.
* sequence parallelism covers consecutive layers (typically the blocks, the final norm and the
  head): the first one cuts its replicated input along the sequence (``PrepareFirstInput``, no
  communication), norms run on sequence shards (``SequenceParallel``), rowwise Linears
  reduce-scatter to ``Shard(1)``, the module that holds a layer's colwise Linears all-gathers its
  input once (so code inside it sees the whole sequence), and the first layer after the region
  gathers the sequence back (or, for an output head, its colwise Linear does). Embeddings always
  output replicated activations: a position embedding is often added to the token embedding before
  the first block.
* a colwise module's parts (``LayerPlan.tp_parts``, in heads): equal parts of at least ``tp`` heads
  are split part by part (``PackedColwiseParallel``: rank r holds ``[q_r|k_r|v_r]``); a single part
  with fewer heads than ``tp`` (K/V under GQA) is repeated (``RepeatedColwiseParallel``); parts of
  different widths (q, k, v under GQA) have no DTensor placement, so the weight is split as one
  block and its output gathered, and the rowwise projection beside it takes the whole (replicated)
  attention output (transformers' own Phi-3 TP plan does the same). A colwise ``nn.Embedding`` with
  parts (T5's relative_attention_bias: one column per head) keeps its output split by heads.
* Hugging Face ``Conv1D`` (weight stored (in, out)) is split like ``nn.Linear`` with the dims
  swapped.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from ..plan import layer_of, within
from ..runtime.tp import REPLICATE, TPStyle
from .sp_region import GATHER, SEQ, check_region_params, region_edges, sp_region

HEAD_NORM = TPStyle("sequence_parallel", sequence_dim=-2, use_local_output=True)
"""a ``"per_head"`` norm (Qwen3's q_norm): its input (..., heads, head_dim) split by heads, its
weight replicated, so torch's sequence-parallel style on the heads dim sums the weight's gradient
over the ranks"""


def tp_styles(model: nn.Module, tp_plan: dict[str, str], *, sp_layers: list[str] = (),
              layers: list[str] = (), loss_parallel: bool = False,
              parts: dict[str, list[int]] | None = None, tp: int = 2) -> dict[str, TPStyle]:
    """Module path -> :class:`TPStyle`, in model order (see the module docstring).

    ``tp_plan``: module path -> style from the plan; ``sp_layers``: layer paths whose activations
    are sequence-sharded (a layer holding a ``sequence_parallel`` module is one too); ``layers``:
    every layer path in model order (to find where the sequence-parallel region ends);
    ``loss_parallel``: the head's logits stay sharded on the vocabulary for ``loss_parallel()``;
    ``parts``: colwise module path -> its output's parts in heads (``LayerPlan.tp_parts``); ``tp``:
    the TP degree.
    """
    modules = dict(model.named_modules())
    for path in tp_plan:
        if path not in modules:
            raise ValueError(f"the plan shards module {path!r}, which the model does not have; "
                             f"re-capture the model or fix the override")
    ordered = [p for p in modules
               if tp_plan.get(p, "replicate") not in ("replicate", "shared", "per_head")]
    # parents (and layers) of rowwise Linears: a colwise Linear beside one feeds it (BERT keeps them
    # in sibling modules of one layer: attention.self.query -> attention.output.dense); one without
    # is an output head
    rows = [p for p in ordered if tp_plan[p] == "rowwise" and is_projection(modules[p])]
    layouts = {p: part_layout(p, modules[p], (parts or {}).get(p), tp=tp) for p in ordered
               if tp_plan[p] == "colwise" and (is_projection(modules[p]) or p in (parts or {}))}
    region, after = sp_region(modules, tp_plan, sp_layers, layers)
    at = _Sharding(
        layers=layers, loss_parallel=loss_parallel, layouts=layouts, region=region, after=after,
        row_parents={p.rpartition(".")[0]
                     for p in rows} | {layer_of(p, layers)
                                       for p in rows} - {None}, gathered={
                                           p.rpartition(".")[0]
                                           for p, lay in layouts.items()
                                           if lay.get("output_layout") == REPLICATE
                                       })
    styles: dict[str, TPStyle] = shared_styles(modules, tp_plan, parts or {})
    region_edges(styles, tp_plan, region, after)
    for path in ordered:
        _module_style(styles, path, modules[path], tp_plan[path], at)
    check_region_params(modules, styles, region)
    # parents first, so the order reads top-down like a hand-written plan
    return dict(sorted(styles.items(), key=lambda kv: list(modules).index(kv[0])))


@dataclasses.dataclass(frozen=True)
class _Sharding:
    """What one module's style depends on beyond its own choice: the model's layers and
    sequence-parallel region, and the colwise modules' layouts."""

    layers: list[str]
    loss_parallel: bool
    layouts: dict[str, dict]
    """colwise module path -> its :func:`part_layout`"""
    region: list[str]
    """the sequence-parallel layers, in order"""
    after: str | None
    """the first layer after the region, if any"""
    row_parents: set[str]
    """parents and layers of rowwise projections"""
    gathered: set[str]
    """parents of colwise modules whose output is gathered (parts of different widths)"""

    def in_sp(self, path: str) -> str | None:
        """The sequence-parallel layer that contains ``path``, if any."""
        for layer in self.region:
            if within(path, layer):
                return layer
        return None

    def fed_sequence_shards(self, path: str) -> bool:
        return self.in_sp(path) is not None or (self.after is not None and within(path, self.after))


def _module_style(styles: dict[str, TPStyle], path: str, module: nn.Module, style: str,
                  at: _Sharding) -> None:
    """The style of one sharded module, into ``styles`` (with its parent's input gather where it
    needs one)."""
    sp = at.in_sp(path)
    if isinstance(module, nn.EmbeddingBag):
        raise NotImplementedError(f"{path}: PyTorch TP does not shard nn.EmbeddingBag; keep it "
                                  "'replicate' and shard it with FSDP (zero_stage >= 1), or use "
                                  "nn.Embedding")
    if style == "sequence_parallel":
        if sp is None:
            raise NotImplementedError(f"{path} is 'sequence_parallel' outside the "
                                      "sequence-parallel layers")
        # plain tensors between modules
        styles[path] = TPStyle("sequence_parallel", use_local_output=True)
    elif isinstance(module, nn.Embedding) and path in at.layouts:
        # head-indexed (T5's relative position bias): the output stays split by heads, as the scores
        # are
        styles[path] = TPStyle("colwise", input_layout=REPLICATE)
    elif isinstance(module, nn.Embedding):
        # replicated output (other embeddings, e.g. positions, are often added to it); the first
        # sequence-parallel layer cuts the sequence
        kind = "rowwise" if style == "rowwise" else "colwise"
        styles[path] = TPStyle(kind, input_layout=REPLICATE, output_layout=REPLICATE)
    elif not is_projection(module):
        raise NotImplementedError(f"{path} is a {type(module).__name__}: TP styles colwise/rowwise "
                                  "apply to nn.Linear, Hugging Face Conv1D and nn.Embedding; use "
                                  "'sequence_parallel' for norms or 'replicate'")
    elif style == "rowwise":
        kind = "rowwise" if isinstance(module, nn.Linear) else "transposed_rowwise"
        # the gathered attention output
        whole = REPLICATE if path.rpartition(".")[0] in at.gathered else None
        styles[path] = TPStyle(kind, input_layout=whole, output_layout=SEQ if sp else None)
    elif (path.rpartition(".")[0] not in at.row_parents
          and layer_of(path, at.layers) not in at.row_parents):
        styles[path] = _head_style(styles, path, module, at)
    else:
        parent = path.rpartition(".")[0]
        if sp and parent != sp and parent.startswith(sp + "."):
            # gather the sequence once at the entry of the block that holds the colwise Linears
            styles.setdefault(parent, GATHER)
            styles[path] = TPStyle(**at.layouts[path])
        else:
            styles[path] = TPStyle(**at.layouts[path], input_layout=SEQ if sp else REPLICATE)


def _head_style(styles: dict[str, TPStyle], path: str, module: nn.Module, at: _Sharding) -> TPStyle:
    """An output head's: a colwise projection no rowwise one consumes; its logits gathered, or left
    sharded on the vocabulary for ``loss_parallel``."""
    seq = SEQ if at.fed_sequence_shards(path) and styles.get(at.after) is None else REPLICATE
    # a Conv1D head: split, not packed
    lay = at.layouts[path] if not isinstance(module, nn.Linear) else {}
    if at.loss_parallel:
        return TPStyle(lay.get("kind", "colwise"), input_layout=seq, output_layout=-1,
                       use_local_output=False, transposed=lay.get("transposed"))
    return TPStyle(lay.get("kind", "colwise"), input_layout=seq, output_layout=REPLICATE,
                   transposed=lay.get("transposed"))


def is_projection(module: nn.Module) -> bool:
    """An ``nn.Linear``, or a Linear-like module that stores its weight (in, out) (Hugging Face's
    ``Conv1D``: a 2-D ``weight`` of shape (``nx``, ``nf``))."""
    if isinstance(module, nn.Linear):
        return True
    w = getattr(module, "weight", None)
    return isinstance(w, torch.Tensor) and w.dim() == 2 and isinstance(getattr(module, "nf", None),
                                                                       int) and \
        tuple(w.shape) == (getattr(module, "nx", None), module.nf)


def out_features(module: nn.Module) -> int:
    """The width of a projection's (or an embedding's) output."""
    if isinstance(module, nn.Linear):
        return module.out_features
    if isinstance(module, nn.Embedding):
        return module.embedding_dim
    return module.nf


def shared_styles(modules: dict[str, nn.Module], tp_plan: dict[str, str],
                  parts: dict[str, list[int]]) -> dict[str, TPStyle]:
    """The styles of the modules TP keeps whole but sums a gradient of: the ``"shared"`` projections
    from their ``tp_parts`` (features: [before, shared(, after)]), and the ``"per_head"`` norms
    (:data:`HEAD_NORM`). The shared piece's gradient is summed over the ranks only where projections
    beside it are split: a whole attention's is complete on every rank already."""
    out = {p: HEAD_NORM for p, st in tp_plan.items() if st == "per_head"}
    for path in (p for p, st in tp_plan.items() if st == "shared"):
        if not any(tp_plan.get(p) == "colwise" for p in modules
                   if p.rpartition(".")[0] == path.rpartition(".")[0]):
            continue
        if len(parts.get(path) or ()) not in (2, 3):
            raise ValueError(f"{path} is 'shared' but tp_parts does not name its shared features: "
                             f"[before, shared(, after)], got {parts.get(path)}")
        out[path] = TPStyle("shared_slice", start=parts[path][0],
                            stop=parts[path][0] + parts[path][1])
    return out


def part_layout(path: str, module: nn.Module, parts: list[int] | None, *, tp: int) -> dict:
    """How a colwise projection with ``parts`` (heads per part, ``LayerPlan.tp_parts``; None: one
    part) is split over ``tp`` ranks, as :class:`TPStyle` fields (see the module docstring)."""
    transposed = None if isinstance(module, (nn.Linear, nn.Embedding)) else True
    plain = {"kind": "packed_colwise", "transposed": True} if transposed else {"kind": "colwise"}
    if parts is None:
        return plain
    width = out_features(module)
    if width % sum(parts):
        raise ValueError(f"{path}: tp_parts {parts} do not divide its {width} output features "
                         "evenly")
    if (any(n % tp for n in parts) and all(n % tp == 0 or tp % n == 0 for n in parts)
            and not transposed and not isinstance(module, nn.Embedding)):
        # fewer heads than ranks: K/V repeated (with a fused multi-query projection's query heads,
        # split)
        return {"kind": "repeated_colwise", "heads": parts[0] if len(parts) == 1 else tuple(parts)}
    uneven = [n for n in parts if n % tp]
    if uneven:
        raise NotImplementedError(f"{path}: a part of {uneven[0]} head(s) (tp_parts {parts}) "
                                  f"cannot be split over tp={tp} ranks"
                                  + (" (a fused projection's parts are split together; keep it "
                                     "'replicate' or lower tp)" if len(parts) > 1
                                     else " (nor repeated: tp must divide by, or be a "
                                          "multiple of, its heads)"))
    if len(parts) == 1 or isinstance(module, nn.Embedding):
        return plain
    if len(set(parts)) == 1:
        return {"kind": "packed_colwise", "parts": len(parts), "transposed": transposed}
    # parts of different widths (q, k, v under GQA): one block split, the output gathered
    return {**plain, "output_layout": REPLICATE}


HEAD_COUNTS = ("n_head", "n_heads", "num_heads", "num_attention_heads")
"""attributes (of an attention module or its ``config``) that count query heads: tp ranks hold heads
/ tp each"""
KV_HEADS = ("n_kv_heads", "num_kv_heads", "num_key_value_heads")
"""attributes that count key/value heads: kv_heads / tp each, or 1 when they are repeated (tp >
kv_heads)"""
GROUPS = ("num_key_value_groups",)
"""query heads per key/value head (Hugging Face's attention functions read it from the module):
changes only when key/value heads are repeated"""
WIDTHS = ("split_size", "n_embd", "embed_dim", "all_head_size", "inner_dim", "hidden_size")
"""attributes that may hold the width of one part of a split projection's output (GPT-2's
``split_size``, nanoGPT's ``n_embd``): set per rank only when the value is such a width"""


def local_sizes(model: nn.Module, styles: dict[str, TPStyle], *,
                tp: int) -> dict[str, dict[str, int]]:
    """Module path -> attribute -> per-rank value, for the modules that hold split projections
    (attention, MLP): the attributes of :data:`HEAD_COUNTS`, :data:`KV_HEADS`, :data:`GROUPS` and
    :data:`WIDTHS` that the module's own code reads outside ``__init__`` (``self.n_head``,
    ``self.config.num_attention_heads``), with the value they have on one rank. A module whose split
    output is gathered back (parts of different widths) keeps its global sizes; so does every module
    of a model whose code reads none of these (views with ``-1``)."""
    modules = dict(model.named_modules())
    out: dict[str, dict[str, int]] = {}
    for parent, paths in _split_children(modules, styles).items():
        module = modules[parent]
        reads = _attributes_read(type(module))
        widths = {out_features(modules[p]) // (styles[p].parts or 1) for p in paths}
        repeated = [h for p in paths if styles[p].kind == "repeated_colwise" for h in
                    ((styles[p].heads,) if isinstance(styles[p].heads, int) else styles[p].heads)
                    if h % tp]
        sizes: dict[str, int] = {}
        for owner, name in reads:
            holder = module if owner is None else getattr(module, owner, None)
            value = getattr(holder, name, None) if holder is not None else None
            if isinstance(value, bool) or not isinstance(value, int):
                continue
            key = name if owner is None else f"{owner}.{name}"
            if name in HEAD_COUNTS:
                sizes[key] = _divide(parent, key, value, tp)
            elif name in KV_HEADS:
                sizes[key] = 1 if value in repeated else _divide(parent, key, value, tp)
            elif name in WIDTHS and value in widths:
                sizes[key] = _divide(parent, key, value, tp)
        for name in GROUPS:  # read by the attention functions, not by the module's code
            value = module.__dict__.get(name)
            if repeated and isinstance(value, int):
                # local query heads / one key/value head
                sizes[name] = _divide(parent, name, value * min(repeated), tp)
        if sizes:
            out[parent] = sizes
    return out


def _split_children(modules: dict[str, nn.Module],
                    styles: dict[str, TPStyle]) -> dict[str, list[str]]:
    """Module path -> its colwise projections whose output stays split (attention, MLP); modules
    whose split output is gathered back (parts of different widths) are left out: they run on whole
    tensors."""
    children: dict[str, list[str]] = {}
    for path, style in styles.items():
        if style.kind in ("colwise", "packed_colwise", "repeated_colwise") and path in modules and \
                not isinstance(modules[path], nn.Embedding) and style.output_layout is None:
            children.setdefault(path.rpartition(".")[0], []).append(path)
    gathered = {p.rpartition(".")[0] for p, s in styles.items()
                if s.kind in ("colwise", "packed_colwise") and s.output_layout == REPLICATE}
    return {parent: paths for parent, paths in children.items() if parent not in gathered
            and parent in modules}


HEAD_DIMS = ("head_dim", "head_size", "attention_head_size", "d_k")
"""attributes that hold the width of one head"""


def head_tables(model: nn.Module, styles: dict[str, TPStyle], *, tp: int,
                parts: dict[str, list[int]] | None = None,
                call=None) -> dict[str, dict[str, int | tuple[int, int]]]:
    """Module path -> parameter or buffer name -> the dim that indexes its heads, for the
    head-indexed tables of the modules that hold split projections (a relative-position bias of
    shape (heads, T, T) or (T, T, heads), ALiBi slopes (heads,)): the runtime's
    ``shard_head_tables`` splits them with the heads, so that each rank adds its own heads' bias to
    its own heads' scores. A table is the module's own parameter or buffer with exactly one dim of
    the module's query head count (its ``n_heads``-like attribute, else the heads of its
    projections' parts ``parts``, else a projection's width over the ``head_dim``-like attribute); a
    1-D one is left whole where the heads are as many as a head's width (it could be either).
    ``call`` (a function that runs the model once, on meta tensors) adds the floating-point tensors
    such a module is handed by keyword with exactly one dim of its head count (MPT's ALiBi
    ``position_bias`` (heads, 1, T), made once by the model for every block; masks are boolean), or
    with dim 0 the batch times the heads (Bloom's ALiBi (batch x heads, 1, T): named with (0,
    heads)), which the runtime splits on the way in. The planner runs the layout with these split
    (``forward_run.py``): a guess the forward cannot run with keeps the module whole."""
    modules = dict(model.named_modules())
    out: dict[str, dict[str, int | tuple[int, int]]] = {}
    hooks = []
    # what split modules return: a rank's own heads at run time (T5's bias)
    made: dict[int, torch.Tensor] = {}
    for parent, paths in _split_children(modules, styles).items():
        module = modules[parent]
        head_dim = next((v for a in HEAD_DIMS if isinstance(v := getattr(module, a, None), int)),
                        None)
        heads = _query_heads(module, [modules[p] for p in paths],
                             [(parts or {}).get(p) for p in paths], head_dim)
        if not heads or heads < 2 or heads % tp:
            continue
        found = out.setdefault(parent, {})
        for name, t in [*module.named_parameters(recurse=False),
                        *module.named_buffers(recurse=False)]:
            dims = [d for d, n in enumerate(t.shape) if n == heads]
            if len(dims) == 1 and not (t.dim() == 1 and heads == head_dim):
                found[name] = dims[0]
        if call is not None:
            # what any projection of the module reads, split or not (MLA's low-rank q_a_proj reads
            # the hidden states)
            widths = {m.in_features if isinstance(m, nn.Linear) else m.weight.shape[0]
                      for m in module.modules() if is_projection(m)}
            hooks.append(module.register_forward_pre_hook(
                lambda _m, args, kwargs, found=found, heads=heads, widths=widths:
                found.update(_head_inputs(args, kwargs, heads, widths, made=made)),
                with_kwargs=True))
            hooks.append(module.register_forward_hook(
                lambda _m, _args, result: made.update({id(t): t for t in tree_leaves(result)
                                                       if isinstance(t, torch.Tensor)})))
    try:
        if hooks:
            call(model)
    finally:
        for hook in hooks:
            hook.remove()
    return {parent: found for parent, found in out.items() if found}


def _head_inputs(args: tuple, kwargs: dict, heads: int, widths: set[int], *, made: dict
                 ) -> dict[str, int | tuple[int, int]]:
    """Keyword input -> its heads dim, for the floating-point tensors among ``kwargs`` with one dim
    of ``heads``, or -> (0, heads) for those whose dim 0 is the batch of the activations times
    ``heads`` and none is ``heads`` (Bloom's ALiBi (batch x heads, 1, T): the heads flattened with
    the batch, the batch outer); not the activations the module's projections read (last dim one of
    their input ``widths``), nor, where the batch of those activations is as large as the heads, a
    tensor whose dim 0 it would be (a float mask (batch, 1, T, T)), nor one that a split module
    returned (``made``: T5's position bias, computed from a table split with the heads, holds the
    rank's own heads already)."""
    hidden = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.dim()
              and t.shape[-1] in widths]
    batch = hidden[0].shape[0] if hidden else None
    out: dict[str, int | tuple[int, int]] = {}
    for name, t in kwargs.items():
        if (not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() < 2
                or t.shape[-1] in widths or id(t) in made):
            continue
        dims = [d for d, n in enumerate(t.shape) if n == heads]
        if len(dims) == 1 and dims[0] == 0 and batch == 1:
            # at batch 1, (heads, ...) may be (batch x heads, ...) and grow with the batch: cut as
            # that, which is the same cut of a tensor that does not grow (the runtime reads the
            # batch from its size)
            out[name] = (0, heads)
        elif len(dims) == 1 and not (dims[0] == 0 and heads == batch):
            out[name] = dims[0]
        elif not dims and batch and t.shape[0] == batch * heads:
            out[name] = (0, heads)
    return out


def _query_heads(module: nn.Module, projections: list[nn.Module], parts: list,
                 head_dim: int | None) -> int | None:
    """The query head count of an attention ``module`` (see :func:`head_tables`); None when nothing
    says it."""
    for holder in (module, getattr(module, "config", None)):
        value = next((v for a in HEAD_COUNTS if isinstance(v := getattr(holder, a, None), int)
                      and not isinstance(v, bool)), None)
        if value:
            return value
    counts = [n for p in parts if p for n in p]
    if counts:
        return max(counts)
    if head_dim:
        widths = [out_features(m) for m in projections if out_features(m) % head_dim == 0]
        return min(widths) // head_dim if widths else None
    return None


def _divide(path: str, name: str, value: int, tp: int) -> int:
    if value % tp:
        raise NotImplementedError(f"{path}.{name} = {value} does not divide by tp={tp}: the model "
                                  f"cannot run with {value / tp:g} per rank; choose a tp that "
                                  "divides it")
    return value // tp


def _attributes_read(cls: type) -> list[tuple[str | None, str]]:
    """(None, name) for ``self.name`` and (owner, name) for ``self.owner.name`` read in the methods
    of ``cls`` and its bases (``__init__`` excepted: it runs before sharding), from each method's
    source (a class defined in a notebook cell has no file, its methods have: the cell's lines); []
    for methods whose source cannot be read."""
    found: dict[tuple[str | None, str], None] = {}
    for klass in cls.__mro__:
        if klass in (nn.Module, object):
            continue
        for name, fn in vars(klass).items():
            fn = inspect.unwrap(fn.__func__ if isinstance(fn, (staticmethod, classmethod)) else fn)
            if name == "__init__" or not inspect.isfunction(fn):
                continue
            try:
                tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
            except (OSError, TypeError, SyntaxError):
                continue
            for n in ast.walk(tree):
                if not (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load)):
                    continue
                if isinstance(n.value, ast.Name) and n.value.id == "self":
                    found.setdefault((None, n.attr), None)
                elif isinstance(n.value, ast.Attribute) and isinstance(n.value.value,
                                                                       ast.Name) and \
                        n.value.value.id == "self":
                    found.setdefault((n.value.attr, n.attr), None)
    return list(found)
