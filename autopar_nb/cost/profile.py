"""One walk over the captured graph that the whole cost model reads: per layer, the FLOPs and bytes by op class
(split into the part tensor parallelism divides and the part it replicates), what autograd saves for backward, the
tensor-parallel styles of its modules, and the collectives those styles imply.

Everything is measured at the captured batch and scales linearly with samples per micro-batch (attention-score
terms with the square of the sequence length). Computed once per (graph, device kind); the planner only does
arithmetic on the result.

Tensor-parallel styles come from :mod:`.tp_styles`.

What autograd saves follows ``tools/autograd/derivatives.yaml`` per op (``SAVES_*`` below), with storages
deduplicated: views share their base's storage, a non-contiguous view that a matmul or reshape needs contiguous
becomes a copy. On CUDA dropout saves a 1-byte mask and RMSNorm is fused (input + rstd); on CPU dropout saves a
noise tensor of the input's dtype and RMSNorm is decomposed (input, normalised input and rstd are saved).
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from dataclasses import dataclass, field

from .tp_styles import NORMS, packet, sp_check, splits_of, tp_walk

ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
            "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "complex64": 8}
FLOAT = {"float64", "float32", "float16", "bfloat16"}

# ops by what autograd saves (packet names without "aten.")
SAVES_MATMUL_INPUTS = {"linear", "mm", "bmm", "matmul", "addmm", "baddbmm", "einsum", "conv1d", "conv2d", "conv3d",
                       "convolution", "mse_loss"}
SAVES_INPUT = {"gelu", "silu", "silu_", "pow", "clamp", "hardtanh", "hardtanh_", "leaky_relu", "elu", "softplus",
               "sin", "cos", "adaptive_avg_pool2d", "adaptive_avg_pool1d", "avg_pool2d", "batch_norm",
               "_native_batch_norm_legit_functional", "group_norm", "layer_norm", "rms_norm", "max_pool2d",
               "max_pool2d_with_indices"}
SAVES_OUTPUT = {"relu", "relu_", "sigmoid", "tanh", "exp", "rsqrt", "sqrt", "softmax", "_softmax", "log_softmax",
                "_log_softmax"}
SAVES_ALL_IF_PAIR = {"mul", "mul_", "div"}
ATTENTION = {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu"}
NONCONTIG_VIEWS = {"split", "split_with_sizes", "chunk", "unbind", "slice", "narrow", "select", "transpose",
                   "permute", "t", "expand", "expand_as", "movedim", "as_strided"}
RESHAPES = {"reshape", "flatten", "_unsafe_view", "unflatten", "view"}


@dataclass
class Saved:
    """One storage autograd keeps for backward, at the captured batch."""

    nbytes: float
    """bytes at the captured dtype"""
    half_bytes: float
    """bytes when floating activations are 16-bit (AMP)"""
    region: bool
    """inside a tensor-parallel region: divided by the TP degree"""
    gathered: bool = False
    """a replicated input saved by a colwise Linear: with sequence parallel, PyTorch's DTensor saves it gathered
    (full), Megatron-LM saves the sequence shard and re-gathers in backward"""
    quadratic: bool = False
    """attention-score sized (seq x seq): dropped by selective recompute (Korthikanti et al. 2022, sec. 5)"""
    stat: bool = False
    """per-token statistics (norm mean/rstd, attention logsumexp): fp32 even under AMP, never TP-split"""


@dataclass
class Comm:
    """A TP collective at the captured batch: kind, bytes of the full (unsharded) tensor, fwd or bwd."""

    kind: str
    nbytes: float
    half_bytes: float
    phase: str


@dataclass
class LayerProfile:
    """Costs of one layer at the captured batch (see the module docstring)."""

    path: str
    params_split: int = 0
    """trainable parameters TP divides (split Linear / Embedding weights, colwise biases)"""
    params_rep: int = 0
    """trainable parameters every TP rank holds (norms, rowwise biases, replicated modules)"""
    param_itemsize: int = 4
    flops_split: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    """forward FLOPs by op class that TP divides"""
    flops_rep: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    bwd_split: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    bwd_rep: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    flops_other: float = 0.0
    """forward FLOPs of memory-bound ops (norms, elementwise, softmax): costed by bytes, counted as model FLOPs"""
    bwd_other: float = 0.0
    quad_flops: float = 0.0
    """forward FLOPs of the attention-score ops that selective recompute runs again"""
    mem_split: float = 0.0
    """bytes moved by memory-bound ops inside TP regions"""
    mem_rep: float = 0.0
    """bytes moved by memory-bound ops outside TP regions (divided by TP only with sequence parallel)"""
    n_ops: int = 0
    emb_bwd_split: float = 0.0
    """bytes of dense Embedding-gradient writes in backward (tables TP splits)"""
    emb_bwd_rep: float = 0.0
    saved: list[Saved] = field(default_factory=list)
    input_bytes: float = 0.0
    input_half: float = 0.0
    output_bytes: float = 0.0
    output_half: float = 0.0
    largest_out: float = 0.0
    """bytes of the largest (output + activation inputs) of one op: the gradients its backward holds at once"""
    comms: list[Comm] = field(default_factory=list)
    tp: dict[str, str] = field(default_factory=dict)
    """module path -> style when TP is on"""
    norms: list[str] = field(default_factory=list)
    """norm modules outside TP regions (sequence_parallel when SP is on)"""
    divisors: set[int] = field(default_factory=set)
    """sizes the TP degree must divide (heads, split Linear dims)"""
    heads: set[int] = field(default_factory=set)
    vocab: set[int] = field(default_factory=set)
    """embedding/head vocabulary sizes (uneven sharding allowed)"""
    regions: set[int] = field(default_factory=set)
    embedding_params: int = 0
    largest_param: int = 0
    """numel of the largest trainable parameter"""
    """parameters of vocab-parallel (rowwise) Embeddings in this layer"""


@dataclass
class GraphProfile:
    """Per-layer profiles in model order, plus model-level facts."""

    layers: list[LayerProfile]
    batch: int
    """samples in the captured batch"""
    seq_len: int | None
    loss_parallel: bool
    output_numel: int
    output_itemsize: int
    region_modules: dict[int, list[str]]
    """region id -> modules whose TP styles must change together"""
    device_kind: str
    rep: list[int] = field(default_factory=list)
    """layer index -> index of the first instance of its repeated block (identical costs: computed once)"""
    tp_refused: dict[str, str] = field(default_factory=dict)
    """module path -> why TP must not split it, even on a user's override (see ``tp_styles.tp_walk``)"""
    pp_blocker: str = ""
    """why pipeline stages cannot be cut between the layers ("" when they can): a layer reading a non-contiguous
    view made in another layer (gloo's send/recv of stage inputs needs contiguous tensors)"""
    sp_blocker: str = ""
    """why sequence parallelism cannot apply to the TP styles ("" when it can; see ``tp_styles.sp_check``)"""

    def layer(self, path: str) -> LayerProfile:
        for lp in self.layers:
            if lp.path == path:
                return lp
        raise KeyError(path)


_PROFILES: dict[int, tuple[weakref.ref, str, GraphProfile]] = {}


def profile_of(graph, device_kind: str = "cuda") -> GraphProfile:
    """:func:`profile`, computed once per (graph, device kind) and kept while the graph lives."""
    hit = _PROFILES.get(id(graph))
    if hit is not None and hit[0]() is graph and hit[1] == device_kind:
        return hit[2]
    prof = profile(graph, device_kind=device_kind)
    key = id(graph)
    try:
        ref = weakref.ref(graph, lambda _r: _PROFILES.pop(key, None))
    except TypeError:
        return prof
    _PROFILES[key] = (ref, device_kind, prof)
    return prof


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def profile(graph, *, device_kind: str = "cuda") -> GraphProfile:
    """Walk ``graph`` once (see the module docstring). ``device_kind`` is "cuda" or "cpu" (what autograd saves for
    dropout and RMSNorm differs)."""
    nodes = graph.nodes
    by_name = {n.name: n for n in nodes}
    out_numel = {n.name: (_numel(n.out_shapes[0]) if n.out_shapes else 0) for n in nodes}
    out_item = {n.name: ITEMSIZE.get(n.dtype, 4) for n in nodes}
    inputs = list(graph.inputs)
    graph_in: dict[str, tuple[int, int, bool]] = {}  # placeholder name -> (numel, itemsize, is_float)

    def in_info(name: str) -> tuple[int, int, bool]:
        if name in by_name:
            n = by_name[name]
            return out_numel[name], out_item[name], n.dtype in FLOAT
        if name not in graph_in:
            ti = inputs[min(len(graph_in), len(inputs) - 1)] if inputs else None
            graph_in[name] = (ti.numel, ti.itemsize, ti.dtype in FLOAT) if ti else (0, 4, True)
        return graph_in[name]

    seq = graph.seq_len
    refused: dict[str, str] = {}
    styles, loss_parallel, regions, region_of, head_counts = tp_walk(graph, by_name, out_numel, refused)
    sharded = regions  # node name -> region id (sharded output) ; absent = replicated

    # storage roots and contiguity
    root: dict[str, str] = {}
    noncontig: dict[str, bool] = {}
    attn_out: dict[str, bool] = {}
    for n in nodes:
        p = packet(n.op)
        attn_out[n.name] = p in ATTENTION
        src = n.inputs[0] if n.inputs else None
        if n.op_class == "view" and src is not None:
            base_nc = noncontig.get(src, False)
            if p == "transpose" and attn_out.get(src):
                # fused attention kernels return (B, nh, T, hd) as a transposed view of a (B, T, nh, hd) buffer:
                # transposing back is contiguous, and the out-projection saves it without a copy
                root[n.name], noncontig[n.name] = root.get(src, src), False
            elif p in NONCONTIG_VIEWS:
                root[n.name], noncontig[n.name] = root.get(src, src), True
            elif p in RESHAPES and base_nc and p != "view":
                root[n.name], noncontig[n.name] = n.name, False  # reshape of a non-contiguous view copies
            else:
                root[n.name], noncontig[n.name] = root.get(src, src), base_nc
        else:
            root[n.name], noncontig[n.name] = n.name, False

    pp_blocker = ""
    for n in nodes:
        far = [i for i in n.inputs if i in by_name and by_name[i].layer != n.layer and noncontig.get(i, False)]
        if far and not pp_blocker:
            pp_blocker = (f"layer {n.layer} reads {far[0]} ({packet(by_name[far[0]].op)}), a non-contiguous view made "
                          f"in layer {by_name[far[0]].layer}, which a pipeline stage could not receive (send/recv "
                          "needs contiguous tensors)")
    consumers: dict[str, list[str]] = defaultdict(list)
    for n in nodes:
        for i in n.inputs:
            consumers[i].append(n.name)
    layer_of = {n.name: n.layer for n in nodes}
    layers = {lay.path: LayerProfile(lay.path) for lay in graph.layers}
    seen_roots: set[str] = set()
    boundary: set[tuple[str, str]] = set()
    comm_keys: set[tuple[str, str]] = set()

    def add_saved(lp: LayerProfile, key: str, numel: int, itemsize: int, is_float: bool, **kw) -> None:
        if key in seen_roots or numel == 0:
            return
        seen_roots.add(key)
        hb = numel * (2 if is_float and itemsize > 2 and not kw.get("stat") else itemsize)
        lp.saved.append(Saved(numel * itemsize, hb, **kw))

    # attention scores by dataflow: the output of an activation x activation matmul (q @ k^T), carried through the
    # ops that follow (scale, mask, softmax, dropout) until the next such matmul (scores @ v) consumes it
    quad_nodes: set[str] = set()
    for n in nodes:
        if n.op_class == "matmul" and not n.params and len(n.inputs) >= 2:
            if not any(i in quad_nodes for i in n.inputs) and n.out_shapes and len(n.out_shapes[0]) >= 3:
                quad_nodes.add(n.name)
        elif n.op_class != "attention" and any(i in quad_nodes for i in n.inputs):
            if not (n.op_class == "matmul"):
                quad_nodes.add(n.name)

    def is_quad(name: str) -> bool:
        return name in quad_nodes

    for n in nodes:
        lp = layers.get(n.layer)
        if lp is None:
            continue
        p = packet(n.op)
        in_region = n.name in sharded
        split_op = n.name in styles
        if n.op_class != "view":
            lp.n_ops += 1
        nbytes = n.bytes_read + n.bytes_written
        if n.op_class == "embedding" and n.params and n.params[0] in graph.params:
            # a lookup reads the rows it gathers, not the table; its backward writes a dense gradient of the whole
            # table (nn.Embedding without sparse=True: zero-fill + index_add)
            w = graph.params[n.params[0]]
            nbytes = 2 * n.bytes_written + sum(in_info(i)[0] * in_info(i)[1] for i in n.inputs)
            table = w.numel * w.itemsize
            if n.name in styles:
                lp.emb_bwd_split += table
            else:
                lp.emb_bwd_rep += table
        if n.op_class in ("matmul", "conv", "attention"):
            bucket_f, bucket_b = (lp.flops_split, lp.bwd_split) if (in_region or split_op) else (lp.flops_rep,
                                                                                                 lp.bwd_rep)
            bucket_f[n.op_class] += n.flops
            bucket_b[n.op_class] += n.bwd_flops
            if is_quad(n.name):
                lp.quad_flops += n.flops
        elif n.op_class != "view":
            lp.flops_other += n.flops
            lp.bwd_other += n.bwd_flops
            if in_region:
                lp.mem_split += nbytes
            else:
                lp.mem_rep += nbytes
            if is_quad(n.name):
                lp.quad_flops += n.flops
        if n.out_shapes and n.op_class != "view":
            # backward of this op holds the gradient of its output and of its activation inputs at once
            step = out_numel[n.name] * out_item[n.name] + sum(
                in_info(i)[0] * in_info(i)[1] for i in n.inputs if in_info(i)[2])
            lp.largest_out = max(lp.largest_out, step)

        # --- what autograd saves ---
        acts = [i for i in n.inputs]
        float_acts = [i for i in acts if in_info(i)[2]]

        def save_input(i: str, *, copy_if_noncontig: bool, gathered: bool = False, n=n, lp=lp) -> None:
            if copy_if_noncontig and noncontig.get(i, False):
                numel, item, is_f = in_info(i)  # the op makes a contiguous copy and saves that
                key = f"copy:{n.name}:{i}"
            else:
                key = root.get(i, i)
                numel, item, is_f = in_info(key)  # a view keeps its whole base storage alive
            add_saved(lp, key, numel, item, is_f, region=i in sharded or key in sharded, gathered=gathered,
                      quadratic=is_quad(i))

        if p in SAVES_MATMUL_INPUTS:
            for i in float_acts:
                # linear flattens (..., k) inputs and matmul flattens batch dims of >= 4-d inputs: a non-contiguous
                # input is copied first; mm/bmm/conv take strided inputs as they are
                nd = len(by_name[i].out_shapes[0]) if i in by_name and by_name[i].out_shapes else 2
                copies = (p == "linear" and nd >= 3) or (p in ("matmul", "einsum") and nd >= 4)
                save_input(i, copy_if_noncontig=copies, gathered=styles.get(n.name) == "colwise")
        elif p in ATTENTION:
            for i in acts[:3]:
                save_input(i, copy_if_noncontig=False)
            add_saved(lp, n.name, out_numel[n.name], out_item[n.name], True, region=in_region)
            shape = n.out_shapes[0] if n.out_shapes else ()
            add_saved(lp, f"lse:{n.name}", _numel(shape[:-1]), 4, True, region=in_region, stat=True)
        elif p in SAVES_INPUT:
            for i in float_acts[:1]:
                save_input(i, copy_if_noncontig=False)
            if p in NORMS or p == "rms_norm":
                shape = n.out_shapes[0] if n.out_shapes else ()
                rows = _numel(shape[:-1]) if p in ("layer_norm", "rms_norm") else (shape[1] if len(shape) > 1 else 1)
                nstats = 1 if p == "rms_norm" else 2
                add_saved(lp, f"stat:{n.name}", rows * nstats, 4, True, region=False, stat=True)
                if p == "rms_norm" and device_kind == "cpu":  # decomposed: the normalised input is saved too
                    add_saved(lp, f"norm:{n.name}", out_numel[n.name], out_item[n.name], True, region=in_region)
        elif p in SAVES_OUTPUT:
            add_saved(lp, n.name, out_numel[n.name], out_item[n.name], True, region=in_region,
                      quadratic=is_quad(n.name))
        elif p in SAVES_ALL_IF_PAIR:
            if len(float_acts) >= 2 or (float_acts and n.params):
                for i in float_acts:
                    save_input(i, copy_if_noncontig=False)
        elif p in ("dropout", "native_dropout", "feature_dropout"):
            mask_item = 1 if device_kind == "cuda" else out_item[n.name]
            quad = is_quad(n.name)
            add_saved(lp, f"mask:{n.name}", out_numel[n.name], mask_item, device_kind != "cuda", region=in_region,
                      quadratic=quad)
        elif p in ("embedding", "embedding_bag", "_embedding_bag"):
            for i in acts[:1]:
                numel, item, is_f = in_info(i)
                add_saved(lp, root.get(i, i), numel, item, False, region=False)
        elif p in ("masked_fill", "where") and len(acts) >= 2:
            numel, _, _ = in_info(acts[-1] if p == "masked_fill" else acts[0])
            add_saved(lp, f"mask:{n.name}", numel, 1, False, region=False)

        # --- TP collectives: what the op's kernels_ext Split says its style implies ---
        st = styles.get(n.name)
        split = splits_of(n.op).get(st) if st else None
        if split is not None:
            for phase, kind in (("fwd", split.forward), ("bwd", split.backward)):
                if not kind:
                    continue
                if split.comm_on == "output":
                    numel, item = out_numel[n.name], out_item[n.name]
                    key = n.name
                elif float_acts:
                    numel, item, _ = in_info(float_acts[0])
                    key = root.get(float_acts[0], float_acts[0])
                else:
                    continue
                if (phase, key) in comm_keys:  # one collective per distinct input (q/k/v, w1/w3 share it)
                    continue
                comm_keys.add((phase, key))
                lp.comms.append(Comm(kind, numel * item, numel * min(item, 2), phase))
        # layer boundaries
        for i in acts:
            if layer_of.get(i) != n.layer and (n.layer, root.get(i, i)) not in boundary:
                boundary.add((n.layer, root.get(i, i)))  # an input read by several ops is held once
                numel, item, is_f = in_info(root.get(i, i))
                lp.input_bytes += numel * item
                lp.input_half += numel * (2 if is_f and item > 2 else item)
        if n.op_class != "view" or not consumers.get(n.name):
            outs_elsewhere = [c for c in consumers.get(n.name, []) if layer_of.get(c) != n.layer]
            if outs_elsewhere or not consumers.get(n.name):
                if n.out_shapes and n.dtype in FLOAT and (outs_elsewhere or n is nodes[-1]):
                    lp.output_bytes += out_numel[n.name] * out_item[n.name]
                    lp.output_half += out_numel[n.name] * 2

    # parameters, TP styles, head constraints per layer
    params = graph.params
    for lay in graph.layers:
        lp = layers[lay.path]
        lp.param_itemsize = 4
    split_params: set[str] = set()
    for n in nodes:
        st = styles.get(n.name)
        lp = layers.get(n.layer)
        if lp is None:
            continue
        if st:
            mod = n.module_path
            lp.tp[mod] = st
            lp.regions.add(region_of.get(n.name, -1))
            for pname in n.params:
                pi = params.get(pname)
                if pi is None or pi.is_buffer:
                    continue
                if pname.endswith("bias") and st == "rowwise":
                    continue
                split_params.add(pname)
            w = params.get(n.params[0]) if n.params else None
            is_embedding = n.op_class == "embedding"
            if w is not None and is_embedding and st == "rowwise" and w.trainable:
                lp.embedding_params += w.numel
            if w is not None and len(w.shape) == 2:
                if is_embedding or n.name == loss_parallel:
                    lp.vocab.add(w.shape[0])
                else:
                    lp.divisors.add(w.shape[0] if st == "colwise" else w.shape[1])
        if n.op_class == "norm" and "sequence_parallel" in splits_of(n.op) and n.name not in sharded and \
                n.module_path and n.params:
            if n.module_path not in lp.norms:
                lp.norms.append(n.module_path)
    for n in nodes:
        hc = head_counts.get(n.name)
        if hc and n.layer in layers:
            layers[n.layer].heads.add(hc)
            layers[n.layer].divisors.add(hc)
    owner: dict[str, str] = {}
    for lay in graph.layers:
        for m in lay.modules:
            owner[m] = lay.path
    for pname, pi in params.items():
        if pi.is_buffer or not pi.trainable:
            continue
        lay_path = _owner_layer(pi.module_path, owner, graph)
        lp = layers.get(lay_path)
        if lp is None:
            continue
        lp.param_itemsize = pi.itemsize
        lp.largest_param = max(lp.largest_param, pi.numel)
        if pname in split_params:
            lp.params_split += pi.numel
        else:
            lp.params_rep += pi.numel
    out = graph.outputs[0] if graph.outputs else None
    region_modules: dict[int, list[str]] = defaultdict(list)
    for name, rid in region_of.items():
        region_modules[rid].append(by_name[name].module_path)
    index = {lay.path: i for i, lay in enumerate(graph.layers)}
    rep = [index[graph.block_of(lay.path).members[0]] if graph.block_of(lay.path) else i
           for i, lay in enumerate(graph.layers)]
    return GraphProfile([layers[lay.path] for lay in graph.layers], graph.batch_size, seq,
                        bool(loss_parallel), out.numel if out else 0, out.itemsize if out else 4,
                        dict(region_modules), device_kind, rep,
                        {by_name[k].module_path: why for k, why in refused.items()}, pp_blocker,
                        sp_check(graph, by_name, styles, regions))


def _owner_layer(module_path: str, owner: dict[str, str], graph) -> str | None:
    if module_path in owner:
        return owner[module_path]
    best = None
    for lay in graph.layers:
        lp = lay.path
        if lp == "" or module_path == lp or module_path.startswith(lp + "."):
            if best is None or len(lp) > len(best):
                best = lp
    return best
