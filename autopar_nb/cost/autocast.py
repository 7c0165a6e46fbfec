"""The dtype of every tensor of a captured forward when it runs under ``torch.autocast`` (the plan's
``amp``), with the plan's own op lists (``precision.fp32_ops`` / ``low_precision_ops``, applied by
``runtime/amp.py``'s ``OpPrecision``): what the memory model needs to count saved activations at the
bytes they have.

The graph is captured in float32; this pass walks it in order and decides each op's dtype:

* an op the plan lists runs in float32 (``fp32_ops``: its floating inputs cast up, and
  ``WithoutAutocast`` keeps all of them and its output for backward) or in the autocast dtype
  (``low_precision_ops``);
* an op autocast lists follows its policy (``kernels_ext.autocast``: torch's own lists for this
  device kind): ``lower`` casts every floating input to the autocast dtype (activations copied on
  every call; a trainable parameter's copy is cached for the step, :attr:`AmpDtypes.cast_params`),
  ``fp32`` casts to float32, ``fp32_opt`` returns float32 without copying its inputs, ``promote``
  casts to the widest input dtype;
* any other op runs in its inputs' dtypes: a view or a norm (layer/group/batch/rms norm keep their
  input's dtype with float32 weights) follows its first input, an explicit ``.to(dtype)`` keeps the
  dtype the capture recorded, and elementwise ops follow PyTorch's type promotion (dimensioned
  tensors before 0-dim ones) when their captured output dtype was the promotion of their captured
  inputs (else they set their own dtype, e.g. ``softmax(dtype=)``).

So the residual stream of a Hugging Face decoder stays float32 (float32 embedding + 16-bit
projection promotes), its RMSNorm computes in float32 (explicit ``.to(torch.float32)``), and every
Linear saves its own 16-bit copy of its input (autocast caches only leaf parameters' casts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from kernels_ext.autocast import autocast_policy

from ..plan import DTYPE_NAMES
from .tp_refusals import packet

FLOAT_RANK = {"float16": 1, "bfloat16": 1, "float32": 2, "float64": 3}
"""floating dtypes by PyTorch's promotion order (float16 with bfloat16 promotes to float32)"""


@dataclass
class AmpDtypes:
    """The autocast dtypes of one graph (see the module docstring)."""

    dtype: dict[str, str]
    """tensor (node or graph input) -> dtype under autocast"""
    target: dict[str, str] = field(default_factory=dict)
    """node -> the dtype it casts its floating activation inputs to (ops autocast or the plan's
    lists cast)"""
    cast_params: set[str] = field(default_factory=set)
    """parameters a lower-precision op reads: autocast keeps a 16-bit copy of each for the autocast
    region (and the ops that read it save that copy for backward)"""
    keeps_all: set[str] = field(default_factory=set)
    """nodes the plan keeps in float32 (``OpPrecision``'s ``WithoutAutocast``: it holds every tensor
    input and its output until backward)"""
    reads: dict[str, list[str]] = field(default_factory=dict)
    """node -> the inputs it really reads, where they differ from the captured ones: a
    ``.to(float32)`` that was a no-op in the float32 capture returned its input itself, so the graph
    shows every later reader of that input reading the cast; under 16-bit parameters it is a copy,
    and readers outside its module (a residual add after an RMSNorm's ``x.to(float32)``) read the
    16-bit original"""
    all_low: set[str] = field(default_factory=set)
    """nodes whose floating inputs and parameters are all 16-bit when they run (a CPU norm's saved
    statistics are then 16-bit too; with a float32 weight they are float32)"""

    def cast(self, node: str, tensor: str) -> str | None:
        """The dtype of the copy ``node`` makes of its input ``tensor`` (None: it reads the tensor
        as it is)."""
        to = self.target.get(node)
        return (to if to is not None and self.dtype.get(tensor) in FLOAT_RANK
                and self.dtype[tensor] != to else None)


class _Param(NamedTuple):
    dtype: str
    shape: tuple[int, ...]


def promote(dtypes: list[str]) -> str:
    """PyTorch's promotion of floating dtypes (bfloat16 with float16 gives float32)."""
    best = max(dtypes, key=lambda d: FLOAT_RANK[d])
    if FLOAT_RANK[best] == 1 and len(set(dtypes)) > 1:
        return "float32"
    return best


def _op_name(op: str) -> str:
    """ATen overload -> the torch function name the plan's op lists use (``aten.cross_entropy_loss``
    -> ``cross_entropy``)."""
    name = packet(op)
    return {"cross_entropy_loss": "cross_entropy"}.get(name, name)


def amp_dtypes(graph, captured: dict[str, str], *, device_kind: str, amp: str = "bf16",
               param_dtype: str | None = None, fp32_ops=(), low_precision_ops=()) -> AmpDtypes:
    """Walk ``graph`` (module docstring). ``captured``: tensor name -> its captured dtype (graph
    inputs included); ``amp``: "bf16" or "fp16"; ``param_dtype``: the floating parameters' dtype
    when it is not the captured one (FSDP's MixedPrecisionPolicy gathers them in 16 bits)."""
    from ..runtime.amp import ALIASES  # the op lists' names, as OpPrecision reads them

    low = DTYPE_NAMES[amp]
    plan_to = {ALIASES.get(n, n): "float32" for n in fp32_ops} | {ALIASES.get(n, n): low
                                                                  for n in low_precision_ops}
    out = AmpDtypes(dict(captured))
    dt = out.dtype
    params = {k: p if param_dtype is None or p.dtype not in FLOAT_RANK
              else _Param(param_dtype, p.shape) for k, p in graph.params.items()}
    shapes = {n.name: n.out_shapes[0] if n.out_shapes else () for n in graph.nodes}
    module = {n.name: n.module_path for n in graph.nodes}
    casts = _NoOpCasts(graph, captured, params)
    # node -> the dtype an up-cast before it in its module started from
    restore: dict[str, str] = {}
    upcast: dict[str, str] = {}  # an up-cast the capture saw as a no-op -> the tensor it copies
    t5_norms = _t5_norms(graph)
    for n in graph.nodes:
        if not n.out_shapes:
            continue
        # T5LayerNorm's x * rsqrt(variance)
        original = n.module_path in t5_norms and packet(n.op) == "mul"
        outside = [upcast[i] if i in upcast and (module[i] != n.module_path or original) else i
                   for i in n.inputs]
        if outside != n.inputs:
            out.reads[n.name] = outside
        inputs = outside
        src = next((i for i in inputs if module.get(i) == n.module_path and i in restore), None)
        if packet(n.op) in ("to", "_to_copy") and inputs and captured.get(inputs[0]) == n.dtype:
            to = restore[src] if src is not None and inputs[0] == src else casts.target(n, dt)
            if to is not None:
                dt[n.name] = to
                continue
            if FLOAT_RANK.get(dt.get(inputs[0]), 0) < FLOAT_RANK.get(n.dtype, 0):
                restore[n.name], upcast[n.name] = dt[inputs[0]], inputs[0]
        elif src is not None and n.dtype in FLOAT_RANK:
            restore[n.name] = restore[src]
        floats = [i for i in inputs if dt.get(i) in FLOAT_RANK]
        fparams = [p for p in n.params if p in params and params[p].dtype in FLOAT_RANK]
        name = _op_name(n.op)
        policy = "plan" if name in plan_to else autocast_policy(n.op, device_kind)
        to = {"plan": plan_to.get(name), "lower": low, "fp32": "float32"}.get(policy)
        if to is None and n.module_path in t5_norms:
            to = _norm_weight_cast(n, floats, fparams, dt, params)
        if policy == "promote" and floats:
            to = promote([dt[i] for i in floats] + [params[p].dtype for p in fparams])
        if to is not None:
            out.target[n.name] = to
            if to == low:
                out.cast_params.update(p for p in fparams if params[p].dtype != low)
            if policy == "plan" and to == "float32":
                out.keeps_all.add(n.name)
        if floats and all(FLOAT_RANK[to or dt[i]] == 1 for i in floats) and \
                all(FLOAT_RANK[to or params[p].dtype] == 1 for p in fparams):
            out.all_low.add(n.name)
        if n.dtype not in FLOAT_RANK:
            dt[n.name] = n.dtype
        elif to is not None:
            dt[n.name] = to
        elif policy == "fp32_opt":
            dt[n.name] = "float32"
        else:
            dt[n.name] = _follows(n, floats, fparams, dt, captured, shapes, params, graph.params)
    return out



class _NoOpCasts:
    """What a ``.to(dtype)`` that was a no-op in the float32 capture casts to under autocast. The
    capture records the dtype it saw (float32), not where it came from; three idioms of model code
    name a tensor's dtype instead:

    * ``x.to(float32) ... .to(input_dtype)`` (Hugging Face RMSNorm): back to the dtype the up-cast
      started from (handled in :func:`amp_dtypes`, which follows the up-cast through its module);
    * ``x.to(weight.dtype)`` before an op that reads that weight (Hugging Face's grouped-matmul
      experts): the weight's dtype;
    * ``out.to(hidden_states.dtype)`` as a module's result (Mixtral's experts): the dtype of the
      floating tensor that entered the module.

    Each resolves to float32 in a float32 forward, so the capture cannot tell them from
    ``.to(torch.float32)``; they differ once the parameters are 16-bit (FSDP's MixedPrecisionPolicy)
    or the module's input is."""

    def __init__(self, graph, captured: dict[str, str], params: dict):
        self.params, self.captured = params, captured
        self.graph_params = graph.params
        self.by_name = {n.name: n for n in graph.nodes}
        self.consumers: dict[str, list] = {}
        # module -> the first floating tensor one of its ops reads from outside
        self.entry: dict[str, str] = {}
        for n in graph.nodes:
            for i in n.inputs:
                self.consumers.setdefault(i, []).append(n)
                src = self.by_name.get(i)
                outside = src is None or not _inside(src.module_path, n.module_path)
                if outside and captured.get(i) in FLOAT_RANK and n.module_path:
                    self.entry.setdefault(n.module_path, i)

    def weight_of(self, name: str) -> str | None:
        """The parameter a node is (a view of), or None."""
        n = self.by_name.get(name)
        while n is not None and n.op_class == "view" and n.inputs and n.inputs[0] in self.by_name:
            n = self.by_name[n.inputs[0]]
        if n is None or n.op_class != "view" or n.inputs or not n.params:
            return None
        return n.params[0] if n.params[0] in self.params else None

    def target(self, n, dt: dict[str, str]) -> str | None:
        """The dtype the no-op ``.to`` node ``n`` casts to under autocast, when an idiom (class
        docstring) says."""
        readers = self.consumers.get(n.name, [])
        for c in readers:
            weights = [p for p in c.params if p in self.params] + \
                      [w for w in map(self.weight_of, c.inputs) if w is not None]
            same = [w for w in weights if self.graph_params[w].dtype == n.dtype]
            if same:
                return self.params[same[0]].dtype
        if n.module_path and readers and all(not _inside(c.module_path, n.module_path)
                                             for c in readers):
            entry = self.entry.get(n.module_path)
            if entry is not None and FLOAT_RANK.get(dt.get(entry), 0) < FLOAT_RANK.get(n.dtype, 0):
                return dt[entry]
        return None


NORM_MODULES = ("LayerNorm", "RMSNorm", "GroupNorm")
"""module class names (suffixes) of norms written in Python (e.g. Hugging Face's LlamaRMSNorm: pow,
mean, rsqrt and a weight multiply): sequence parallelism runs them on sequence shards like torch's
own norm ops"""


def _t5_norms(graph) -> set[str]:
    """Norm modules written as Hugging Face's T5LayerNorm (and its copies: LongT5, MT5, UMT5,
    Pix2Struct...)::

        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        if self.weight.dtype in [torch.float16, torch.bfloat16]:
            hidden_states = hidden_states.to(self.weight.dtype)
        return self.weight * hidden_states

    A float32 capture shows one ``.to`` (the variance's up-cast, a no-op then, which every later op
    seems to read) and no cast back, where LlamaRMSNorm casts its input up once and back with
    ``.to(input_dtype)``: the modules with a single cast. There the normalisation multiplies the
    original input, and the weight multiply runs in a 16-bit weight's dtype
    (:func:`_norm_weight_cast`)."""
    casts: dict[str, int] = {}
    for n in graph.nodes:
        if n.module_type and n.module_type.endswith(NORM_MODULES) and n.op_class == "elementwise":
            casts[n.module_path] = (casts.get(n.module_path, 0)
                                    + (packet(n.op) in ("to", "_to_copy")))
    return {m for m, k in casts.items() if k == 1}


def _norm_weight_cast(n, floats: list[str], fparams: list[str], dt: dict[str, str],
                      params: dict) -> str | None:
    """The dtype a T5LayerNorm's weight multiply (:func:`_t5_norms`) runs in: a 16-bit weight's
    (FSDP's MixedPrecisionPolicy), on a copy of the float32 normalised tensor, which it saves (the
    branch a float32 capture never takes); None with a float32 weight or input already 16-bit."""
    if packet(n.op) != "mul" or len(fparams) != 1:
        return None
    weight = params[fparams[0]].dtype
    if FLOAT_RANK.get(weight) != 1 or not floats or any(dt[i] != "float32" for i in floats):
        return None
    return weight


def _inside(path: str, module: str) -> bool:
    """``path`` is ``module`` or one of its submodules."""
    return path == module or path.startswith(module + ".")

def _follows(n, floats, fparams, dt, captured, shapes, params, captured_params) -> str:
    """The dtype of an op autocast leaves alone (module docstring). Whether the op set its own dtype
    is judged at the captured dtypes (``captured``, ``captured_params``); what it gives follows
    ``dt`` and ``params``."""
    name = packet(n.op)
    if not floats and not fparams:
        return n.dtype
    if name in ("to", "_to_copy"):
        # torch.export records ``x.to(device)`` as ``to.dtype_layout`` with x's dtype: a captured
        # no-op of that overload moves x and keeps its dtype (GPT-2's
        # ``position_embeds.to(inputs_embeds.device)``)
        if n.op.endswith(".dtype") or not floats or captured.get(floats[0]) != n.dtype:
            return n.dtype  # an explicit dtype: the one the capture recorded
        return dt[floats[0]]
    if name == "type_as" and len(floats) >= 2:
        return dt[floats[1]]
    if n.op_class in ("view", "norm") and floats:
        return dt[floats[0]]
    cap = [captured[i] for i in floats] + [captured_params[p].dtype for p in fparams]
    if n.dtype != promote(cap):
        return n.dtype  # the op sets its own dtype
    dims = [dt[i] for i in floats if len(shapes.get(i, (1,))) > 0] + \
           [params[p].dtype for p in fparams if len(params[p].shape) > 0]
    return promote(dims or [dt[i] for i in floats] + [params[p].dtype for p in fparams])


def ops_named(graph, name: str) -> int:
    """How many ops of ``graph`` an op-list name (``precision.fp32_ops`` / ``low_precision_ops``:
    torch's or Paddle's, e.g. ``elementwise_add``) reaches, as ``OpPrecision`` and
    :func:`amp_dtypes` match them."""
    from ..runtime.amp import ALIASES

    want = ALIASES.get(name, name)
    return sum(1 for n in graph.nodes if n.out_shapes and _op_name(n.op) == want)
