"""Trace one block per group of identical repeated modules and copy its ops for the others.

A 126-layer model runs 126 identical blocks, and tracing each costs about 0.1 s under torch.export.
During the one traced forward pass, a member of a group of repeated blocks is *stood in* when an
earlier member of the same group, its representative, has the same module tree, attributes,
parameter shapes and tying, and was called with the same arguments (the same structure, the same
plain values, tensors of the same shape, stride, dtype and aliasing): the stand-in records one op
that reads the member's tensor arguments and returns empty tensors shaped like the representative's
outputs. The representative's arguments and outputs pass through marker ops so its recorded ops say
which values came in and went out. :func:`splice` then removes the markers, puts a renamed copy of
the representative's ops where each stand-in ran (node names, module paths and parameter names moved
to the member, its inputs wired to what the stand-in read, later ops wired to the copy's outputs)
and renames every node as the tracer names the nodes of a full trace. Whatever cannot be copied
faithfully raises :class:`NotReplicable`; capture then traces every layer and says why.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import re
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

INDEX_ATTRS = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number", "block_idx"})
"""attributes that hold a block's own position: they may differ between identical members (Hugging
Face keeps ``layer_idx`` for its KV cache, which capture switches off); what a model derives from
them at construction shows in the other attributes, and per-layer lists in a config are looked up at
that position (:func:`_plain`)"""
PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.layout,
         torch.memory_format)


class NotReplicable(Exception):
    """The stood-in forward pass cannot be turned into the graph a full trace gives; the message
    says why."""


class HiddenNeeded(NotReplicable):
    """A member whose parameters were taken out must be traced after all: trace again with them
    in."""


# ---- marker ops: custom ops, so both tracers record them as single calls with their arguments ----
def _define(name: str, schema: str, impl: Callable) -> Any:
    # defined once per process, even if this module is reloaded
    if not hasattr(torch.ops.autopar_nb, name):
        torch.library.define(f"autopar_nb::{name}", schema)
        torch.library.impl(f"autopar_nb::{name}", "CompositeExplicitAutograd")(impl)
        torch.library.register_fake(f"autopar_nb::{name}")(impl)
    return getattr(torch.ops.autopar_nb, name).default


def _like(x, member, leaf):
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)


def _empty(inputs, member, leaf, shape, stride, dtype, device):
    return torch.empty_strided(shape, stride, dtype=dtype, device=device)


BLOCK_INPUT = _define("block_input", "(Tensor x, int member, int leaf) -> Tensor", _like)
BLOCK_OUTPUT = _define("block_output", "(Tensor x, int member, int leaf) -> Tensor", _like)
STAND_IN = _define("stand_in", "(Tensor[] inputs, int member, int leaf, SymInt[] shape, SymInt[] "
                               "stride, ScalarType dtype, Device device) -> Tensor", _empty)
MARKERS = {str(BLOCK_INPUT): "input", str(BLOCK_OUTPUT): "output", str(STAND_IN): "stand_in"}
"""the markers' op names as the tracers record them -> their role"""


# ---- which members are identical -----------------------------------------------------------------
def _plain(value: Any, index: tuple[int, ...]) -> Any:
    """An attribute as a hashable key: plain values as they are, tensors by shape and dtype, other
    objects by identity plus, for a config, the entries of its per-layer lists at the block's
    ``index``."""
    if isinstance(value, PLAIN):
        return value
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v, index) for v in value)
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    # activations built per module: gelu with approximate="tanh"
    if isinstance(value, functools.partial):
        return ("partial", _plain(value.func, index), _plain(value.args, index),
                _plain(value.keywords, index))
    if isinstance(value, dict):
        return ("dict", tuple((k, _plain(v, index)) for k, v in value.items()))
    per_layer = ()
    if hasattr(value, "__dict__") and index:
        n = getattr(value, "num_hidden_layers", None)
        per_layer = tuple((k, tuple(repr(v[i]) if i < len(v) else None for i in index))
                          for k, v in sorted(vars(value).items())
                          if isinstance(v, (list, tuple)) and len({repr(x) for x in v}) > 1
                          and (not isinstance(n, int) or len(v) == n))
    return ("object", id(value), per_layer)


def _hooked(mod: nn.Module) -> bool:
    return any(getattr(mod, h, None)
               for h in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                         "_state_dict_hooks"))


def fingerprint(path: str, mod: nn.Module, canonical: dict[str, str]) -> tuple:
    """What must be equal for two members to run the same ops: every submodule's class and
    attributes (its position, :data:`INDEX_ATTRS`, aside), every parameter and buffer's shape,
    dtype, kind and what it is tied to. A member with hooks gets a key of its own (hooks may do
    anything)."""
    subs = list(mod.named_modules(remove_duplicate=False))
    if any(_hooked(m) for _, m in subs):
        return ("hooked", path)
    index = tuple(sorted({v for _, m in subs for k, v in vars(m).items() if k in INDEX_ATTRS
                          and isinstance(v, int)}))
    parts: list[Any] = [(name, type(m),
                         tuple(sorted((k, _plain(v, index)) for k, v in vars(m).items()
                                      if not k.startswith("_") and k not in INDEX_ATTRS)))
                        for name, m in subs]
    for name, t in [*mod.named_parameters(remove_duplicate=False),
                    *mod.named_buffers(remove_duplicate=False)]:
        full = f"{path}.{name}"
        tied = canonical.get(full, full)
        parts.append((name, tuple(t.shape), t.dtype, t.requires_grad, type(t),
                      None if tied == full else tied))
    return tuple(parts)


# ---- the stood-in forward pass -------------------------------------------------------------------
def _tensor_key(t: torch.Tensor) -> tuple:
    return tuple(t.shape), tuple(t.stride()), t.dtype, t.device, t.requires_grad


def _call_key(args: tuple, kwargs: dict) -> tuple | None:
    """What a member's ops may depend on in its call, or None when an argument is neither a tensor
    nor plain."""
    leaves, spec = tree_flatten((args, kwargs))
    first: dict[int, int] = {}
    key = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            key.append((_tensor_key(x), first.setdefault(id(x), len(first))))
        elif isinstance(x, PLAIN):
            key.append((type(x), x))
        else:
            return None
    return spec, tuple(key), torch.is_grad_enabled()


class StandIns:
    """Installs the stand-in forward on every member of a class of identical members while in a
    ``with`` block, and records what :func:`splice` needs: each member's path, the representative
    each stood-in member copies."""

    def __init__(self, classes: list[list[tuple[str, nn.Module]]], canonical: dict[str, str]):
        names_of = defaultdict(int)
        for first in canonical.values():
            names_of[first] += 1
        # parameters with one name
        self.untied = {n for n, first in canonical.items() if names_of[first] == 1}
        self.paths: list[str] = []
        self.modules: list[nn.Module] = []
        self.class_of: list[int] = []
        for c, members in enumerate(classes):
            for path, mod in members:
                self.paths.append(path)
                self.modules.append(mod)
                self.class_of.append(c)
        # take out the parameters of the members expected to stand in (parameters_hidden)
        self.hide = True
        self.hidden: set[int] = set()
        self.saved: list[Any] = []

    def __enter__(self) -> StandIns:
        self.rep: dict[int, int] = {}  # class -> its representative (the first member called)
        self.keys: dict[int, tuple | None] = {}  # representative -> its call key
        # representative -> (output spec, tensor keys or plain leaves)
        self.outputs: dict[int, tuple | None] = {}
        self.rep_of: dict[int, int] = {}  # stood-in member -> its representative
        self.called: set[int] = set()
        for mid, mod in enumerate(self.modules):
            # an instance-level forward (some wrappers set one)
            self.saved.append(vars(mod).get("forward"))
            mod.forward = self._forward_of(mid, mod.forward)
        return self

    def __exit__(self, *exc) -> None:
        for mod, saved in zip(self.modules, self.saved, strict=False):
            vars(mod).pop("forward", None)
            if saved is not None:
                mod.forward = saved
        self.saved = []

    @contextlib.contextmanager
    def parameters_hidden(self):
        """While torch.export traces: the parameters and buffers of every member but the first of
        each class are taken out of their modules, as no op reads them (torch.export makes a
        placeholder of each: 0.4 ms apiece, a third of a 126-layer capture). A tied one stays (its
        first name would change). A member whose parameters are out and that must be traced after
        all raises :class:`HiddenNeeded`: the trace runs again with them in."""
        firsts = {self.class_of.index(c) for c in set(self.class_of)}
        self.hidden = {mid for mid in range(len(self.modules)) if self.hide and mid not in firsts}
        taken = []
        for mid in sorted(self.hidden):
            mod = self.modules[mid]
            for sub, m in mod.named_modules():
                for store in (m._parameters, m._buffers):
                    for name, t in list(store.items()):
                        full = ".".join(filter(None, (self.paths[mid], sub, name)))
                        if t is not None and full in self.untied:
                            taken.append((store, name, store.pop(name)))
        try:
            yield
        finally:
            self.hidden = set()
            for store, name, t in taken:
                store[name] = t

    def _forward_of(self, mid: int, original: Callable) -> Callable:
        def forward(*args, **kwargs):
            # a second call of one member: its copy could not say which call it is
            if mid in self.called:
                raise NotReplicable(f"{self.paths[mid]} is called more than once in one forward "
                                    "pass")
            self.called.add(mid)
            key, c = _call_key(args, kwargs), self.class_of[mid]
            if c not in self.rep and key is not None and mid not in self.hidden:
                self.rep[c], self.keys[mid] = mid, key
                return self._traced_representative(mid, original, args, kwargs)
            rep = self.rep.get(c)
            if rep is not None and key == self.keys[rep] and self._grad_as(rep, args, kwargs):
                return self._stand_in(mid, rep, args, kwargs)
            if mid in self.hidden:
                raise HiddenNeeded(f"{self.paths[mid]} must be traced, but its parameters were "
                                   "taken out")
            return original(*args, **kwargs)  # traced as it is, not copied
        return forward

    def _traced_representative(self, mid: int, original: Callable, args: tuple,
                               kwargs: dict) -> Any:
        """The member's own forward, its tensor arguments and outputs passed through marker ops
        (once per distinct tensor), its output's structure kept for the stand-ins."""
        leaves, spec = tree_flatten((args, kwargs))
        marked: dict[int, torch.Tensor] = {}
        leaf = 0
        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor):
                if id(x) not in marked:
                    marked[id(x)] = BLOCK_INPUT(x, mid, leaf)
                leaves[i] = marked[id(x)]
                leaf += 1
        args, kwargs = tree_unflatten(leaves, spec)
        out = original(*args, **kwargs)
        oleaves, ospec = tree_flatten(out)
        tensors = [x for x in oleaves if isinstance(x, torch.Tensor)]
        plain = all(isinstance(x, (torch.Tensor, *PLAIN)) for x in oleaves)
        if not tensors or not plain or len({id(t) for t in tensors}) < len(tensors):
            self.outputs[mid] = None  # the members of its class are traced, not copied
            return out
        self.outputs[mid] = (ospec, [_tensor_key(x) if isinstance(x, torch.Tensor) else x
                                     for x in oleaves])
        leaf, marked_out = 0, []
        for x in oleaves:
            if isinstance(x, torch.Tensor):
                x, leaf = BLOCK_OUTPUT(x, mid, leaf), leaf + 1
            marked_out.append(x)
        return tree_unflatten(marked_out, ospec)

    def _grad_as(self, rep: int, args: tuple, kwargs: dict) -> bool:
        """The representative's outputs are known and the stand-in's can require grad as they do: a
        stand-in's output requires grad when it reads an input that does (an op without a derivative
        formula), so the outputs that must not are made without inputs, and one that reads them must
        be left."""
        if self.outputs.get(rep) is None:
            return False
        grad = torch.is_grad_enabled() and any(x.requires_grad
                                               for x in tree_flatten((args, kwargs))[0]
                                               if isinstance(x, torch.Tensor))
        wanted = [t[-1] for t in self.outputs[rep][1] if isinstance(t, tuple)]
        return all(grad or not w for w in wanted) and any(w or not grad for w in wanted)

    def _stand_in(self, mid: int, rep: int, args: tuple, kwargs: dict) -> Any:
        """Empty tensors shaped like the representative's outputs, in its output's structure, each
        from one stand-in op that reads the member's tensor arguments."""
        self.rep_of[mid] = rep
        tensors = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        ospec, template = self.outputs[rep]
        leaves = [(i, leaf, t) for leaf, (i, t) in enumerate((i, t) for i, t in enumerate(template)
                                                            if isinstance(t, tuple))]
        out = list(template)
        # the outputs that read the inputs first: splice takes the member's inputs from its first
        # stand-in op
        for i, leaf, (shape, stride, dtype, device,
                      requires_grad) in sorted(leaves, key=lambda x: grad != x[2][-1]):
            reads = tensors if requires_grad or not grad else []
            out[i] = STAND_IN(reads, mid, leaf, list(shape), list(stride), dtype, device)
            if out[i].requires_grad != requires_grad:
                raise NotReplicable(f"{self.paths[mid]}'s stand-in output would not require grad "
                                    f"as {self.paths[rep]}'s does")
        return tree_unflatten(out, ospec)


def copied_or_full(trace: Callable[[StandIns | None], Any], groups: list,
                   canonical: dict[str, str]) -> Any:
    """``trace(stand_ins)`` with identical members of ``groups`` stood in, else ``trace(None)`` of
    every layer, the reason kept on the graph: a failure of the stood-in trace is no failure of the
    model's."""
    session = stand_ins(groups, canonical) if groups else None
    while isinstance(session, StandIns):
        try:
            with session:
                return trace(session)
        except HiddenNeeded:
            session.hide = False  # once more, every parameter in place
        except NotReplicable as e:
            session = str(e)
        except Exception as e:
            text = str(e).strip().splitlines()
            session = (f"tracing with repeated blocks stood in failed ({type(e).__name__}: "
                       f"{text[0] if text else ''})")
    graph = trace(None)
    graph.full_trace_reason = session
    return graph


def stand_ins(groups: list[list[tuple[str, nn.Module]]],
              canonical: dict[str, str]) -> StandIns | str:
    """The stand-ins for ``groups`` (each: the (path, module) members of one repeated block), or why
    there are none (no two members of any group are identical)."""
    classes = []
    for members in groups:
        by_key: dict[tuple, list] = defaultdict(list)
        for path, mod in members:
            by_key[fingerprint(path, mod, canonical)].append((path, mod))
        classes += [c for c in by_key.values() if len(c) > 1]
    if classes:
        return StandIns(classes, canonical)
    names = ", ".join(_parent(m[0][0]) or m[0][0] for m in groups)
    return f"no two members of {names} have the same attributes, hooks and tied parameters"


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


# ---- the graph a full trace gives ----------------------------------------------------------------
_SUFFIX = re.compile(r"^(.*?)(?:_(\d+))?$")


def _namer(naming: str) -> Callable[[Any], str]:
    """op -> its node name, in order, as the tracer names nodes: torch.export ("export") through
    torch.fx's namespace (a base name, then base_1, base_2...; "max_1" first where "max" is a
    builtin), the eager recorder ("fx") by a count per op."""
    if naming == "export":
        namespace = getattr(torch.fx.graph, "_Namespace", None)
        if namespace is None:
            raise NotReplicable("this torch has no torch.fx.graph._Namespace to name copied nodes "
                                "with")
        ns = namespace()
        return lambda op: ns.create_name(_SUFFIX.match(op.name.split("#")[0]).group(1), None)
    counts: dict[str, int] = defaultdict(int)

    def count(op) -> str:
        base = op.op.split(".")[-2]
        counts[base] += 1
        return f"{base}_{counts[base] - 1}" if counts[base] > 1 else base
    return count


def _check_names(raw: list, naming: str) -> None:
    """The tracer named the stood-in trace's nodes as :func:`_namer` would: then it names a full
    trace so too."""
    name = _namer(naming)
    for r in raw:
        expected = name(r)
        if expected != r.name:
            raise NotReplicable(f"the tracer named node {r.name!r} where {expected!r} was expected")


def _moved(name: str, rep: str, member: str) -> str:
    """A module path or parameter name of the representative ``rep``, moved to ``member``."""
    if name == rep or name.startswith(rep + "."):
        return member + name[len(rep):]
    return name


class _Splice:
    """The state of one pass over the stood-in trace (see :func:`splice`)."""

    def __init__(self, session: StandIns):
        self.session = session
        # a marker's name -> the node it stands for ("" when none is listed)
        self.sub: dict[str, str] = {}
        # representative -> its ops as traced, markers not yet substituted
        self.span: dict[int, list] = {}
        # representative -> its input marker -> leaf
        self.inputs: dict[int, dict[str, int]] = defaultdict(dict)
        # representative -> output leaf -> producer
        self.outputs: dict[int, dict[int, str]] = defaultdict(dict)
        # stood-in member -> its copy's name for a traced name
        self.copies: dict[int, Callable[[str], str]] = {}
        self.open: int | None = None  # the representative whose ops are being traced
        self.out: list = []

    def op(self, r) -> None:
        role = MARKERS.get(r.op)
        if role is None:
            if self.open is not None:
                self.span[self.open].append(r)
            self.out.append(self._substituted(r))
            return
        mid, leaf = int(r.args[1]), int(r.args[2])
        if r.params or (role != "stand_in" and len(r.inputs) > 1):
            raise NotReplicable(f"{self.session.paths[mid]} takes or returns a parameter or buffer "
                                "itself")
        if role == "input":
            self.inputs[mid][r.name], self.span[mid], self.open = leaf, [], mid
            self.sub[r.name] = self.sub.get(r.inputs[0], r.inputs[0]) if r.inputs else ""
        elif role == "output":
            self.open = None
            self.outputs[mid][leaf] = r.inputs[0]
            self.sub[r.name] = self.sub.get(r.inputs[0], r.inputs[0])
        else:
            if mid not in self.copies:
                self.copies[mid] = self._copy(mid, r.inputs)
            rep = self.session.rep_of[mid]
            self.sub[r.name] = self.copies[mid](self.outputs[rep][leaf])

    def _substituted(self, r):
        inputs = [self.sub.get(i, i) for i in r.inputs]
        if inputs == r.inputs:
            return r
        r = copy.copy(r)
        r.inputs = [i for i in inputs if i]
        return r

    def _copy(self, mid: int, read: list[str]) -> Callable[[str], str]:
        """Appends the representative's ops renamed for member ``mid``, whose stand-in read ``read``
        (one node per tensor argument, "" for one no node produced); returns the copy's name for a
        traced name."""
        rep = self.session.rep_of[mid]
        if rep not in self.span or rep in self.inputs and self.open == rep:
            raise NotReplicable(f"{self.session.paths[mid]} ran before {self.session.paths[rep]} "
                                "returned")
        ops, src, dst = self.span[rep], self.session.paths[rep], self.session.paths[mid]
        own = {r.name for r in ops}
        leaf_of = self.inputs[rep]

        def name(n: str) -> str:
            if n in own:
                return f"{n}#{mid}"
            if n in leaf_of:
                n = read[leaf_of[n]]
            return self.sub.get(n, n)

        for r in ops:
            c = copy.copy(r)
            c.name, c.inputs = name(r.name), [i for i in map(name, r.inputs) if i]
            c.params = [_moved(p, src, dst) for p in r.params]
            c.module_path = _moved(r.module_path, src, dst)
            self.out.append(c)
        return name


def splice(raw: list, session: StandIns, naming: str) -> tuple[list, int]:
    """The ops of a trace with members stood in -> (the ops a full trace records, how many members
    were copied). ``raw`` holds capture's recorded ops (name, op, inputs, params, module_path...);
    ``naming`` is "export" for torch.export's node names, "fx" for the eager recorder's."""
    _check_names(raw, naming)
    state = _Splice(session)
    for r in raw:
        state.op(r)
    if set(state.copies) != set(session.rep_of):
        missing = sorted(session.paths[m] for m in set(session.rep_of) - set(state.copies))
        raise NotReplicable(f"the stand-ins of {', '.join(missing)} were not recorded")
    name = _namer(naming)
    names = {r.name: name(r) for r in state.out}
    for r in state.out:
        r.name, r.inputs = names[r.name], [names.get(i, i) for i in r.inputs]
    return state.out, len(state.copies)
