"""ModelGraph: the operator graph of one forward pass, grouped into layers, as plain data.

Produced by :func:`autopar_nb.capture`; read by the cost model, the planner and the widget. Holds no
tensors and no reference to the model, so it can be pickled, shown and kept while the model is gone;
the one exception, a meta copy of the model the planner runs its tensor-parallel layouts on
(``stand_in``), is left out when it is pickled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TensorInfo:
    """Shape and dtype of one tensor (an input, an output, a parameter)."""

    shape: tuple[int, ...]
    dtype: str
    itemsize: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass
class OpNode:
    """One ATen call in the forward graph."""

    name: str
    """node name in the traced graph (unique)"""
    op: str
    """ATen overload, e.g. "aten.linear.default"""
    op_class: str
    """matmul | conv | attention | norm | elementwise | reduction | embedding | view | other (from
    kernels_ext)"""
    inputs: list[str]
    """names of the nodes (or graph inputs) this op reads"""
    in_shapes: list[tuple[int, ...]]
    out_shapes: list[tuple[int, ...]]
    dtype: str
    flops: float
    """forward FLOPs"""
    bwd_flops: float
    """backward FLOPs this op implies"""
    bytes_read: int
    bytes_written: int
    params: list[str]
    """fully qualified names of the parameters (and buffers) it uses"""
    module_path: str
    """innermost module that called it ("" for the model's own forward)"""
    module_type: str
    layer: str
    """path of the layer it is assigned to"""
    known: bool = True
    """False when kernels_ext has no rule for the op (its FLOPs count as 0)"""
    dropout_p: float | None = None
    """dropout ops: the probability they drop with (0 when not training: then the op returns its
    input and saves nothing); attention: SDPA's dropout_p; None for other ops"""
    causal: bool = False
    """attention: SDPA's ``is_causal`` (the kernel skips the masked half: ``cost/flash.py``)"""


def sdpa_causal(op: str, args, kwargs) -> bool:
    """:attr:`OpNode.causal` of a call of ``op``: SDPA's ``is_causal`` (its sixth argument:
    ``query, key, value, attn_mask, dropout_p, is_causal, ...``); False for any other op."""
    if "scaled_dot_product_attention" not in op:
        return False
    return bool(kwargs.get("is_causal", args[5] if len(args) > 5 else False))


@dataclass
class ParamInfo:
    """One parameter or buffer of the model."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    module_path: str
    module_type: str
    trainable: bool = True
    is_buffer: bool = False

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass
class Layer:
    """A unit of planning: a module the planner gives one decision (pipeline stage, recompute, FSDP
    unit)."""

    path: str
    type: str
    num_params: int
    param_bytes: int
    flops: float
    """forward FLOPs of every op assigned to the layer"""
    bwd_flops: float
    nodes: list[str]
    modules: dict[str, str] = field(default_factory=dict)
    """every submodule with parameters (full path -> class name), including the layer itself: what
    TP may split"""
    block: str | None = None
    """name of the repeated block this layer is an instance of (e.g. "h"), else None"""
    index: int | None = None
    """position inside that repeated block"""


@dataclass
class RepeatedBlock:
    """Consecutive sibling layers with identical type and parameter shapes (e.g. ``h.0 ...
    h.11``)."""

    name: str
    """container path, e.g. "transformer.h\""""
    type: str
    members: list[str]

    @property
    def count(self) -> int:
        return len(self.members)


@dataclass
class ModelGraph:
    """The captured model (see module docstring)."""

    model_type: str
    nodes: list[OpNode]
    layers: list[Layer]
    blocks: list[RepeatedBlock]
    params: dict[str, ParamInfo]
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    tracer: str
    """"torch.export" or "fx" (make_fx fallback)"""
    source: str | None = None
    """the exact cell source the model came from, when captured by the magic"""
    unknown_ops: list[str] = field(default_factory=list)
    """ATen ops with no kernels_ext rule (counted with zero FLOPs); register rules for them to cost
    them"""
    takes_positions: bool = False
    """the model's forward takes ``position_ids`` (context parallelism then passes each token's
    global position: ``runtime/cp.py``)"""
    copied_layers: int = 0
    """layers whose ops were copied from an identical member of their repeated block instead of
    traced"""
    full_trace_reason: str | None = None
    """why capture traced every member of the repeated blocks instead of copying identical ones
    (None when it did not have to)"""
    tp_refused: dict[str, str] = field(default_factory=dict)
    """module path -> why tensor parallelism leaves it whole: the planner ran a layout splitting it
    on stand-in tensors and the model's forward failed on the local shards (``planner/forward.py``);
    filled at plan time"""
    tp_tables: dict[str, int | tuple[int, int]] = field(default_factory=dict)
    """parameter, buffer or keyword input name -> its heads dim (or (dim, heads): flattened with the
    batch), for the head-indexed tables (bias tables, ALiBi slopes) that a layout run at plan time
    split with the heads (``planner/forward.py``): the cost model counts them split"""
    tp_stage_refused: dict[int, str] = field(default_factory=dict)
    """TP degree -> why the layout that ran at plan time cannot run inside pipeline stages ("" where
    it can: ``planner.degrees.stage_refusal``); the search does not offer that degree beside
    pipelining"""
    stand_in: Any = field(default=None, repr=False, compare=False)
    """the meta copy of the model and its example inputs
    (``autopar_nb.capture.meta_stand_in.StandIn``; None: not checked)"""

    def __getstate__(self) -> dict:
        # a model copy is no plain data: pickled graphs go unchecked
        return {**self.__dict__, "stand_in": None}

    # ---- totals ----------------------------------------------------------------------------------
    @property
    def num_params(self) -> int:
        """Trainable parameters (shared parameters counted once)."""
        return sum(p.numel for p in self.params.values() if p.trainable and not p.is_buffer)

    @property
    def param_bytes(self) -> int:
        return sum(p.numel * p.itemsize for p in self.params.values() if not p.is_buffer)

    @property
    def forward_flops(self) -> float:
        return sum(n.flops for n in self.nodes)

    @property
    def backward_flops(self) -> float:
        return sum(n.bwd_flops for n in self.nodes)

    @property
    def step_flops(self) -> float:
        """Forward + backward FLOPs of one step on the example inputs (no recompute)."""
        return self.forward_flops + self.backward_flops

    @property
    def batch_size(self) -> int:
        """Leading dim of the first example input."""
        return self.inputs[0].shape[0] if self.inputs and self.inputs[0].shape else 1

    @property
    def seq_len(self) -> int | None:
        """Second dim of the first input when it is an integer (token) tensor of rank 2, else
        None."""
        first = self.inputs[0] if self.inputs else None
        if first and len(first.shape) == 2 and first.dtype.startswith(("int", "uint")):
            return first.shape[1]
        return None

    # ---- lookup ----------------------------------------------------------------------------------
    def layer(self, path: str) -> Layer:
        for layer in self.layers:
            if layer.path == path:
                return layer
        raise KeyError(f"no layer {path!r}; layers are: "
                       f"{', '.join(lay.path for lay in self.layers)}")

    def node(self, name: str) -> OpNode:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no op node {name!r}")

    def layer_nodes(self, path: str) -> list[OpNode]:
        wanted = set(self.layer(path).nodes)
        return [n for n in self.nodes if n.name in wanted]

    def block_of(self, path: str) -> RepeatedBlock | None:
        for b in self.blocks:
            if path in b.members:
                return b
        return None

    def folded_layers(self) -> list[tuple[Layer, int]]:
        """Layers in order with repeated blocks folded: (first instance, repeat count)."""
        out: list[tuple[Layer, int]] = []
        seen: set[str] = set()
        for layer in self.layers:
            b = self.block_of(layer.path)
            if b is None:
                out.append((layer, 1))
            elif b.name not in seen:
                seen.add(b.name)
                out.append((layer, b.count))
        return out

    def summary(self) -> str:
        """A few lines: parameters, FLOPs per step, layers with repeated blocks folded."""
        lines = [f"{self.model_type}: {human(self.num_params)} params, "
                 f"{human(self.step_flops)}FLOP per step (fwd+bwd) on inputs "
                 f"{', '.join(str(tuple(i.shape)) for i in self.inputs)}; {len(self.nodes)} ops "
                 f"via {self.tracer}"
                 + (f", {self.copied_layers} of {len(self.layers)} layers copied from an "
                    "identical traced one" if self.copied_layers else "")
                 + (f"; every layer traced: {self.full_trace_reason}" if self.full_trace_reason
                    else "")]
        for layer, count in self.folded_layers():
            name = layer.path if count == 1 else f"{self.block_of(layer.path).name}.[0-{count - 1}]"
            mult = f" x {count}" if count > 1 else ""
            lines.append(f"  {name:<28} {layer.type:<20}{mult:>6} {human(layer.num_params):>9} "
                         f"params {human(layer.flops):>9}FLOP fwd")
        return "\n".join(lines)


def human(x: float) -> str:
    """1234567 -> '1.23 M', 3.2e12 -> '3.20 T' (SI prefixes, for tables)."""
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} "
