"""Tensor-parallel styles by dataflow, for the cost model and the planner.

Tensor parallelism is derived from dataflow, not from names (Megatron-LM's pairing, Shoeybi et al.
2019): walking the ops in order with a replicated/sharded state per tensor, a ``Linear`` that reads
a replicated tensor is ``colwise`` (its output is sharded on the last dim), one that reads a sharded
tensor is ``rowwise`` (its partial output is all-reduced back to replicated); an ``Embedding`` is
``rowwise`` (vocab-parallel); a colwise ``Linear`` whose sharded output is the model's output
(directly, or through elementwise ops of it alone: Gemma 2's logit soft-capping) is the
vocab-parallel head (``loss_parallel``), kept only when it has at least as many outputs as inputs
(an LM head, not a 10-way classifier). Which ops are Linear-like (a "colwise" and a "rowwise"
split), Embedding-like, norms, reductions or splits, which collective each style implies, and which
views reshape, come from the op's ``kernels_ext`` rule (``splits``, ``tp_role``, ``layout``), never
from its name, so a registered custom op takes part. A sharded tensor that reaches an op that cannot
take it (a norm, a residual add with a full-size replicated tensor, a reduction, a Linear kept
replicated, an attention op or a plain matmul whose operands are not all sharded, or a Linear-like
module PyTorch TP cannot split) turns the Linears that sharded it back to ``replicate`` (refused,
with the reason, where it is a replicated tensor added to a product of split operands that the
runtime cannot cut with the heads: made inside the attention; or one tensor of trainable values
broadcast into every head that is not one piece of one projection's output; :mod:`.tp_refusals`). A
bias made outside the attention and added in a batched product (Bloom's ALiBi (batch x heads, 1, T)
in ``baddbmm``) goes with the heads: the runtime cuts it on the way in. ``nn.Linear`` and Hugging
Face's ``Conv1D`` (weight stored (in, out)) get split styles; an Embedding is vocab-sharded
(rowwise) only when its ids come from the model's inputs (not ``torch.arange`` positions) and the
table has at least as many rows as columns (not a small table): :mod:`.tp_embeddings`.

Layouts beyond one contiguous shard per projection (``LayerPlan.tp_parts``; the runtime's
``runtime/layouts.py``):

* a colwise output cut by ``split``/``chunk``/``slice`` along its last dim (nanoGPT's fused
  ``c_attn(x).split(C, dim=2)``, Phi-3's ``qkv_proj`` and ``gate_up_proj``) is split part by part:
  the pieces stay sharded, each counted in heads (the ``view`` that follows it) or in features (no
  view follows). The projection is refused only when its pieces do not cover its output. Equal parts
  are a ``_StridedShard`` (rank r holds slice r of every part); parts of different widths (q, k, v
  under GQA) are split as one block and the output all-gathered, so the attention between the
  projection and its rowwise partner runs whole on every rank (:attr:`Walk.sharded` leaves those
  tensors out);
* a colwise projection whose output is split into ``h`` heads by a view gets parts ``[h]``; a
  key/value projection (fewer heads than the query projection of its region) with ``h < tp`` and
  ``tp % h == 0`` is repeated: its weight whole on every rank (:func:`part_split`);
* an ``nn.Embedding`` with one column per attention head, added to the scores (T5's
  ``relative_attention_bias``), is colwise with parts ``[H]``: its output stays split by heads, as
  the scores are.

* one piece of a replicated projection's output that every head of a split attention reads (MLA's
  rope key: the last ``qk_rope_head_dim`` outputs of ``kv_a_proj_with_mqa``, broadcast by ``expand``
  and copied into every head's key) leaves the split on: the projection stays whole, its piece's
  gradient is summed over the ranks (:attr:`Walk.shared`; the runtime's ``SharedSliceParallel``).
  Such a tensor made any other way is refused.
* a norm or a reduction over ``head_dim`` of tensors split by heads (Qwen3's ``q_norm``/``k_norm``)
  runs inside each head and leaves the split on; a norm module's weight there is whole on every rank
  with its gradient summed (:attr:`Walk.per_head`, :mod:`.tp_heads`).

:func:`.tp_sequence.sp_extent` says whether, and over which layers, sequence parallelism is valid
for the resulting styles. Head counts come from the ``view``/``reshape`` that splits a sharded last
dim into ``(heads, head_dim)``; TP degrees must divide them, every part and every split Linear dim
(a repeated key/value projection excepted).
"""

from __future__ import annotations

from typing import NamedTuple

import kernels_ext

from .tp_embeddings import from_inputs, head_biases, shardable_embedding, untied
from .tp_heads import track_heads, within_heads
from .tp_parts import Parts, fused_cut, name_heads, parts_of, role_of, split_heads
from .tp_refusals import (
    Blame,
    bias_with_heads,
    first_causes,
    packet,
    refuse_shared,
    where,
    whole_bias,
)

PROJECTIONS = ("Linear", "Conv1D")
"""module classes whose Linear-like ops TP splits: ``nn.Linear`` and Hugging Face's ``Conv1D``
(weight (in, out))"""


def rule_of(op: str) -> kernels_ext.OpRule | None:
    """The kernels_ext rule for ``op`` (None for an op no rule covers)."""
    return kernels_ext.lookup(op)


class Walk(NamedTuple):
    """What :func:`tp_walk` derives from dataflow."""

    styles: dict[str, str]
    """node -> "colwise" | "rowwise" (split Linears and Embeddings)"""
    head: str
    """the vocab-parallel head node ("" when none: no loss parallelism)"""
    sharded: dict[str, int]
    """node whose output is sharded on some rank-local dim -> its TP region (tensors a gathered
    projection makes whole on every rank are left out)"""
    region_of: dict[str, int]
    """styled node -> its TP region"""
    heads: dict[str, int]
    """view node splitting a sharded dim into heads -> the head count (views of a projection's own
    output or pieces are counted in its :attr:`parts` instead)"""
    parts: dict[str, Parts]
    """colwise node -> its output's parts (a projection split into heads, a fused projection cut
    into pieces, a head-indexed embedding)"""
    holders: dict[str, str]
    """module that holds a weight other modules share without running itself (T5's ``shared``) ->
    the style of the modules that run with it (split alike, so the runtime keeps the tie)"""
    shared: dict[str, tuple[int, int, int]] = {}
    """replicated projection node -> (first, last + 1 feature, TP region) of the piece of its output
    that every head of a split attention reads (MLA's rope key): the runtime sums that piece's
    gradient over the TP ranks"""
    per_head: dict[str, int] = {}
    """node of a norm module that reads its weight inside each head of a split attention (Qwen3's
    ``q_norm`` and ``k_norm``: an RMSNorm over ``head_dim`` after the view into heads) -> its TP
    region: the weight is one value per feature of a head, the same for every head, so each rank's
    gradient is that of its own heads only and the runtime sums it over the TP ranks
    (``"per_head"``)"""
    whole: dict[str, str] = {}
    """Linear-like node the walk keeps whole (replicated) -> why, in words (a refusal's reason, or
    the first cause the walk met: a norm over the split features, a residual add, a model output, a
    tie, no rowwise partner ...)"""


def tp_walk(graph, by_name, out_numel, refused: dict[str, str] | None = None, keep=()) -> Walk:
    """Assign colwise/rowwise styles by dataflow (module docstring). ``refused`` (when given) gets
    node -> why for Linears that must never be split (whatever a user override says): their sharded
    output is cut along the sharded dim into pieces that do not make up the whole output. ``keep``:
    nodes left whole from the start."""
    disabled: set[str] = set(keep)
    refused = {} if refused is None else refused
    why: dict[str, str] = {}
    for attempt in range(20):
        result = _walk_once(graph, by_name, out_numel, disabled, refused)
        if isinstance(result, Walk):
            return result._replace(whole={k: refused.get(k) or why.get(k, "") for k in disabled})
        new = first_causes(set(result), graph, by_name) if attempt < 10 else set(result)
        why.update({k: result[k] for k in new if k not in why})
        disabled |= new
    return Walk({}, "", {}, {}, {}, {}, {})


def part_split(parts: list[int] | tuple[int, ...], tp: int, *, repeatable: bool = True,
               packable: bool = True) -> str:
    """How ``tp`` ranks split a colwise module whose output holds ``parts`` (heads or features per
    part), following the runtime (``planner.styles.part_layout``): "split" (one part, each rank 1/tp
    of it), "packed" (equal parts, split part by part), "gathered" (parts of different widths: one
    block, output all-gathered), "repeated" (one part of fewer heads than ranks, ``tp % heads ==
    0``: a key/value projection whole on every rank; or a fused multi-query projection, whose query
    heads each rank keeps its share of and whose key/value heads it keeps whole, the weight whole on
    every rank), or "" when ``tp`` cannot split it. ``repeatable``: a key/value projection;
    ``packable``: not an embedding (whose parts are heads kept split as they are)."""
    if repeatable and any(n % tp for n in parts) and all(n % tp == 0 or tp % n == 0 for n in parts):
        return "repeated"
    if any(n % tp for n in parts):
        return ""
    if len(parts) == 1 or not packable:
        return "split"
    return "packed" if len(set(parts)) == 1 else "gathered"


WHOLE_WORDS = {"norm": "normalises", "reduction": "reduces"}
"""what a norm or a reduction op does over the features it reads (why TP keeps a Linear whole)"""

LAYOUT_WORDS = {"packed": "split part by part", "gathered": "gathered", "repeated": "repeated",
                "split": "split by heads", "shared": "whole, its shared piece's gradient summed"}
"""how :func:`part_split`'s answers read in ``explain()`` and the widget's layer table ("split": a
module listed in ``LayerPlan.tp_parts`` that is cut evenly, a head-indexed embedding; "shared": a
``"shared"`` projection)"""


def _walk_once(graph, by_name, out_numel, disabled, refused) -> Walk | Blame:
    """One walk; the nodes to disable (keep replicated) when it found conflicts, each with why."""
    walker = _Walker(graph, by_name, out_numel, disabled, refused)
    for n in graph.nodes:
        # none: no tensor out (aten._assert_tensor_metadata before a .to()), nothing sharded
        if n.out_shapes:
            walker.step(n)
    return walker.finish()


class _Walker:
    """One walk over the ops in order: the replicated/sharded state of every tensor so far, the
    styles given, and the conflicts met."""

    def __init__(self, graph, by_name, out_numel, disabled: set[str], refused: dict[str, str]):
        self.graph, self.by_name, self.out_numel, self.disabled, self.refused = \
            graph, by_name, out_numel, disabled, refused
        self.styles: dict[str, str] = {}
        self.sharded: dict[str, int] = {}  # node -> region id
        self.seeds: dict[str, frozenset] = {}
        self.region_of: dict[str, int] = {}
        # region -> the region it was merged into (an op reading two joins them)
        self.merged: dict[int, int] = {}
        self.heads: dict[str, int] = {}  # view node -> head count
        self.shared: dict[str, tuple[int, int, int]] = {}  # Walk.shared, regions not yet merged
        self.per_head: dict[str, int] = {}  # tp_heads.track_heads
        self.headed: set[str] = set()
        self.next_region = 0
        self.conflicts = Blame()
        self.from_input = from_inputs(graph, by_name)
        self.biases = head_biases(graph, by_name, self.from_input)
        # sharded nodes whose sharded dim is still the last dim (colwise, elementwise)
        self.last: set[str] = set()
        self.origin: dict[str, tuple[str, tuple[int, ...] | None]] = {}  # see _cut
        self.pieces: dict[str, list[list]] = {}
        self.width: dict[str, int] = {}  # colwise node -> output features
        # colwise node -> heads of its whole output (a view right after it)
        self.whole_heads: dict[str, int] = {}
        # elementwise node of one tensor input -> the colwise node it came from
        self.through: dict[str, str] = {}

    def find(self, r: int) -> int:
        while r in self.merged:
            r = self.merged[r]
        return r

    def step(self, n) -> None:
        """Op ``n``: a style where it starts or ends a split, the split carried through it, or a
        conflict."""
        s_in = [i for i in n.inputs if i in self.sharded]
        splits = splits_of(n.op)
        if (bool(n.params) and n.op_class == "matmul" and "colwise" in splits
            and "rowwise" in splits):
            self._linear(n, s_in)
        elif not self._split_embedding(n, splits) and s_in:
            self._reads_split(n, s_in)

    def _linear(self, n, s_in: list[str]) -> None:
        """A Linear-like op: colwise on a replicated input, rowwise on a sharded one (or a
        conflict)."""
        if n.module_type not in PROJECTIONS:
            if s_in:  # a Linear-like op PyTorch TP cannot shard reads a sharded tensor
                self.conflicts.add(frozenset().union(*(self.seeds[i] for i in s_in)),
                                   f"its split output reaches {where(n)}, a {n.module_type} "
                                   "PyTorch TP cannot split")
        elif n.name in self.disabled:
            if s_in:  # a Linear kept replicated cannot read a sharded tensor
                self.conflicts.add((k for i in s_in for k in self.seeds[i]),
                                   f"{where(n)}, kept whole, reads its split output")
        elif s_in:
            self.styles[n.name] = "rowwise"
            self.region_of[n.name] = self.sharded[s_in[0]]
        else:
            self._colwise(n)

    def _colwise(self, n) -> None:
        self.styles[n.name] = "colwise"
        rid = self.next_region
        # linears reading the same replicated input (q/k/v, w1/w3) belong to the same region
        for other, st in self.styles.items():
            if (st == "colwise" and other != n.name
                and self.by_name[other].inputs[:1] == n.inputs[:1]):
                rid = self.region_of[other]
                break
        else:
            self.next_region += 1
        self.region_of[n.name] = rid
        self.sharded[n.name] = rid
        self.seeds[n.name] = frozenset([n.name])
        self.last.add(n.name)
        self.origin[n.name] = (n.name, None)
        self.width[n.name] = int(n.out_shapes[0][-1]) if n.out_shapes else 0

    def _split_embedding(self, n, splits) -> bool:
        """Whether ``n`` is an embedding split here: by heads (a head-indexed bias) or on the
        vocabulary."""
        # split by heads, like the scores it is added to
        if n.name in self.biases and n.name not in self.disabled:
            self.styles[n.name] = "colwise"
            self.region_of[n.name] = self.sharded[n.name] = self.next_region
            self.next_region += 1
            self.seeds[n.name] = frozenset([n.name])
            return True
        if (n.op_class == "embedding" and "rowwise" in splits and n.params
                and n.name not in self.disabled
                and shardable_embedding(n, self.graph, self.from_input)):
            self.styles[n.name] = "rowwise"
            self.region_of[n.name] = self.next_region
            self.next_region += 1
            return True
        return False

    def _reads_split(self, n, s_in: list[str]) -> None:
        """An op (not Linear-like) that reads a split tensor: the split carried through it, or a
        conflict."""
        seed = frozenset().union(*(self.seeds[i] for i in s_in))
        if self._cannot_take(n, s_in, seed):
            return
        # part by part
        why = fused_cut(n, s_in, self.last, self.origin, self.pieces, self.width, self.by_name)
        if why is not None:
            if why:
                self.conflicts.add(seed, why)
                for k in seed:
                    self.refused.setdefault(k, why)
                return
            self.sharded[n.name] = self.sharded[s_in[0]]
            self.seeds[n.name] = seed
            return
        rep_in = [i for i in n.inputs if i not in self.sharded and i in self.by_name and
                  self.by_name[i].op_class != "view"]
        if n.op_class == "elementwise" and (
                any(self.out_numel.get(i, 0) >= self.out_numel.get(s_in[0], 0) for i in rep_in) or
                refuse_shared(n, s_in, seed, self.refused, self.sharded, self.graph, self.by_name,
                              self.out_numel, self.shared)):
            self.conflicts.add(seed, f"{where(n)} meets its split output with a whole tensor as "
                                     "large (a residual?)")
            return
        self._carry(n, s_in, seed)

    def _cannot_take(self, n, s_in: list[str], seed: frozenset) -> bool:
        """Whether ``n`` cannot read a split tensor (a norm or reduction over the split features, an
        attention or a plain matmul whose operands are not all split): a conflict, and True."""
        if role_of(n.op) in ("norm", "reduction") and not within_heads(n, s_in, self.headed):
            self.conflicts.add(seed, f"{where(n)} {WHOLE_WORDS[role_of(n.op)]} over its split "
                                     "output's features")
            return True
        if n.op_class == "attention" and any(i not in self.sharded for i in n.inputs[:3]):
            self.conflicts.add(seed, f"the attention ({where(n)}) reads a query, key or value that "
                                     "is not split by heads")
            return True
        if n.op_class == "matmul" and not n.params and \
                any(i not in self.sharded and i in self.by_name for i in n.inputs):
            # eager q @ k^T, scores @ v: both operands split by heads or neither; a bias added to
            # the product goes with the heads where it can (Bloom's ALiBi in baddbmm)
            if bias_with_heads(n, self.sharded, self.by_name):
                return False
            why = whole_bias(n, self.sharded, self.by_name)
            self.conflicts.add(seed, why or f"{where(n)} multiplies its split output by a tensor "
                                            "that is not split")
            self.refused.update({k: why for k in seed if why and k not in self.refused})
            return True
        return False

    def _carry(self, n, s_in: list[str], seed: frozenset) -> None:
        """The split carried through ``n``: its region (regions it joins merged), heads where it is
        a view into heads, and whether its split dim is still the projection's last."""
        rule, hc = rule_of(n.op), None
        if (n.op_class == "view" and rule is not None and rule.layout in ("view", "reshape")
            and n.out_shapes):
            src = self.by_name.get(s_in[0])
            if src is not None and src.out_shapes:
                hc = split_heads(src.out_shapes[0], n.out_shapes[0])
                if hc and not name_heads(n, hc, s_in[0], self.origin, self.pieces,
                                         self.whole_heads):
                    self.heads[n.name] = hc
        regions = {self.find(self.sharded[i]) for i in s_in}
        rid = min(regions)
        for r in regions - {rid}:
            self.merged[r] = rid  # q and k/v of different inputs (cross-attention) meet: one region
        self.sharded[n.name], self.seeds[n.name] = rid, seed
        track_heads(n, s_in, hc, self.headed, self.per_head, rid, self.graph, self.by_name)
        if n.op_class == "elementwise" and len(n.inputs) == 1 and (s_in[0] in self.through or
                                                                   self.styles.get(s_in[0])):
            # the logits soft-capped (/ c, tanh, * c)
            self.through[n.name] = self.through.get(s_in[0], s_in[0])
        src = self.by_name.get(s_in[0])
        if (all(i in self.last for i in s_in) and src is not None and src.out_shapes
                and n.out_shapes and not hc
                and tuple(n.out_shapes[0])[-1:] == tuple(src.out_shapes[0])[-1:]):
            self.last.add(n.name)
            if len({self.origin.get(i) for i in s_in}) == 1 and s_in[0] in self.origin:
                # still the projection's output (a bias add, a reshape)
                self.origin[n.name] = self.origin[s_in[0]]

    def finish(self) -> Walk | Blame:
        """The walk's styles, or the conflicts found at its end as well."""
        self._check_pieces()
        head_node = self._head()
        holders: dict[str, str] = {}
        self.conflicts.add(untied(self.graph, self.styles, holders),
                           "its weight is tied to a module not split on the vocabulary")
        region_of = {k: self.find(r) for k, r in self.region_of.items()}
        sharded = {k: self.find(r) for k, r in self.sharded.items()}
        # a colwise Linear with no rowwise partner and not the head (sharded tensor dies elsewhere)
        # is fine only as head
        rowwise_regions = {region_of[k] for k, v in self.styles.items() if v == "rowwise" and
                           self.by_name[k].op_class != "embedding"}
        for k, v in self.styles.items():
            if (v == "colwise" and k != head_node and k not in self.biases
                and region_of[k] not in rowwise_regions):
                self.conflicts.add([k], "no rowwise Linear reads its split output, and it is not "
                                        "the output head")
        if self.conflicts:
            return self.conflicts
        parts = {
            k: pp
            for k in self.styles if self.styles[k] == "colwise" and k not in self.biases and
            (pp := parts_of(self.width[k], self.pieces.get(k), self.whole_heads.get(k))) is not None
        }
        parts |= {k: Parts((h,), True, h, table=True) for k, h in self.biases.items()
                  if k in self.styles}
        # a projection with parts of different widths is all-gathered: what it feeds runs whole up
        # to its rowwise partner
        gathered = {k for k, pp in parts.items() if pp.gathered}
        whole = {k for k in sharded
                 if k in gathered
                 or (k not in self.styles and self.seeds.get(k, frozenset()) & gathered)}
        return Walk(self.styles, head_node, {k: r for k, r in sharded.items() if k not in whole},
                    region_of, self.heads, parts, holders,
                    {k: (a, b, self.find(r)) for k, (a, b, r) in self.shared.items()},
                    {k: self.find(r) for k, r in self.per_head.items()})

    def _check_pieces(self) -> None:
        """A fused projection's pieces must make up its whole output: else it is refused."""
        for proj, cut in self.pieces.items():
            covered = sum(w for w, _ in cut)
            if covered != self.width[proj]:
                self.conflicts.add([proj], "its output's pieces do not make up the whole")
                self.refused.setdefault(proj, "the pieces cut from its output "
                                              f"({', '.join(str(w) for w, _ in cut)} features) do "
                                              f"not make up its {self.width[proj]} outputs")

    def _head(self) -> str:
        """The vocab-parallel head node ("" when none); any other sharded model output is a
        conflict."""
        head_node = ""
        used = {i for n in self.graph.nodes for i in n.inputs}
        # a sharded model output (an in-place op's is not: its target, e.g. MLA's key, is read)
        outputs = [n.name for n in self.graph.nodes
                   if n.name in self.sharded and not packet(n.op).endswith("_")
                   and n.name not in used]
        for name in outputs:
            # elementwise ops on the logits run on vocabulary shards as well
            head = self.through.get(name, name)
            w = (self.graph.params.get(self.by_name[head].params[0]) if self.by_name[head].params
                 else None)
            # a vocab-parallel head only where it pays: many outputs per input (an LM head, not a
            # 10-way classifier)
            if (self.styles.get(head) == "colwise" and w is not None and len(w.shape) == 2
                and w.shape[0] >= w.shape[1]):
                head_node = head
            else:
                self.conflicts.add(self.seeds[name],
                                   "its split output is a model output, not a vocabulary head's "
                                   "logits")
        return head_node


def splits_of(op: str) -> dict:
    """The TP splits kernels_ext registers for ``op`` (style -> Split), {} when none."""
    rule = kernels_ext.lookup(op)
    return rule.splits if rule is not None else {}
