"""Verify's two runs made deterministic by construction: every random op a model's forward runs is
switched off, whatever attribute its probability came from.

Why not give both runs the same random stream: the ranks draw on other shapes than the reference (a
TP rank's dropout sees its shard of the hidden width, a data-parallel rank its share of the batch, a
pipeline stage its micro-batch), so no seed gives one mask to both; DTensor's RNG tracker keeps
sharded draws consistent across ranks, not with a single process. So the draws are taken out, at the
call:

* a dropout probability argument is set to 0 — ``p`` of the dropout family (``F.dropout``,
  ``alpha_dropout``, ``dropout1d/2d/3d``, aten ``dropout``/``native_dropout``) and ``dropout_p`` of
  ``scaled_dot_product_attention``, ``multi_head_attention_forward`` and the fused attention
  kernels: the op then returns its input, exactly;
* a draw from a distribution (:data:`MEANS`: ``bernoulli``, ``rand``, ``randn``, ``uniform_``,
  ``normal``) is replaced by the distribution's mean. Stochastic depth's mask
  ``x.new_empty(...).bernoulli_(keep)`` becomes ``keep``, which drop-path then divides by ``keep``:
  exactly 1, the branch passes whole (filling with ones instead would scale it by ``1 / keep``); CPU
  dropout's own ``bernoulli_(1 - p)`` / ``(1 - p)`` likewise; additive noise (``randn``) becomes 0,
  a router's jitter ``uniform_(1 - e, 1 + e)`` 1. A constant is the same for every shape, hence on
  every rank and in the reference;
* any other op PyTorch tags ``nondeterministic_seeded`` (``randint``, ``randperm``, ``multinomial``,
  ...) has no such stand-in: it runs, and is reported (:attr:`RandomOff.left`), so that a mismatch
  it causes is not blamed on the plan.

The switch is a ``TorchFunctionMode``: it sees each call above autograd, so the backward is that of
what ran (a dispatch-level change of ``native_dropout``'s ``p`` would leave its backward scaling by
``1 / (1 - p)``), and it sees the aten ops of a traced pipeline stage as well as the Python calls of
an eager model. Random ops are recognised by PyTorch's own tag on the aten op of the function's name
(``torch.Tag.nondeterministic_seeded``). It acts only inside module forwards (global module hooks
keep a per-thread stack of the modules running, recompute in the backward included): weight
initialisation and the batches, drawn outside any forward, keep their randomness. A Python function
that draws inside its own body behind a torch-function check (``F.gumbel_softmax``) is one call to
the mode, whose name is no aten op: it is neither switched off nor reported.
"""

from __future__ import annotations

import inspect
import threading
from collections import Counter

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

SEEDED = torch.Tag.nondeterministic_seeded
PROBABILITY_ARGS = ("dropout_p",)
"""argument names that are a drop probability in any function (attention's); ``p`` is one in the
dropout family"""
TRAIN_ARGS = ("train", "training")


def _bernoulli_mean(call: _Call):
    p = call.get("p")
    # torch.bernoulli(probs) draws with its input as the probabilities; Tensor.bernoulli_() with 0.5
    if p is None:
        return 0.5 if call.name.endswith("_") else call.args[0].detach()
    return p


MEANS = {
    "bernoulli": _bernoulli_mean,
    "bernoulli_": _bernoulli_mean,
    "rand": lambda call: 0.5,
    "rand_like": lambda call: 0.5,
    "randn": lambda call: 0.0,
    "randn_like": lambda call: 0.0,
    "uniform_": lambda call: (call.get("from", 0.0) + call.get("to", 1.0)) / 2,
    "normal_": lambda call: call.get("mean", 0.0),
    "normal": lambda call: call.get("mean", 0.0),
}
"""name -> the mean of the distribution the call draws from (a number or a tensor)"""


def _name(func) -> str:
    """The aten name of ``func``: an OpOverload's packet (``dropout`` for ``aten.dropout.default``),
    else its own."""
    if isinstance(func, torch._ops.OpOverload):
        return func.overloadpacket.__name__
    return getattr(func, "__name__", "")


def _aten(name: str) -> torch._ops.OpOverloadPacket | None:
    """The aten op of this name, None when there is none (``__eq__`` is the namespace's own
    method)."""
    try:
        packet = getattr(torch.ops.aten, name, None)
    except Exception:  # a name torch.ops refuses
        return None
    return packet if isinstance(packet, torch._ops.OpOverloadPacket) else None


def _seeded(name: str) -> bool:
    """Whether calls of this name draw random numbers: the dropout family (``dropout2d`` is no aten
    op of its own), or an aten op PyTorch tags as seeded."""
    if "dropout" in name:
        return "backward" not in name
    packet = _aten(name)
    return packet is not None and any(SEEDED in getattr(packet, o).tags for o in packet.overloads())


def _params(func, name: str) -> list[str]:
    """The names of ``func``'s arguments in order: its signature, else its aten schema (builtins and
    Tensor methods, whose first argument is ``self``)."""
    if isinstance(func, torch._ops.OpOverload):
        return [a.name for a in func._schema.arguments]
    try:
        return list(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        packet = _aten(name)
        overloads = packet.overloads() if packet is not None else []
        return ([a.name for a in getattr(packet, overloads[0])._schema.arguments] if overloads
                else [])


class _Call:
    """One call's arguments, read and replaced by name."""

    def __init__(self, func, name: str, params: list[str], args: tuple, kwargs: dict):
        self.func, self.name, self.params, self.args, self.kwargs = func, name, params, args, kwargs

    def get(self, key: str, default=None):
        if key in self.kwargs:
            return self.kwargs[key]
        i = self.params.index(key) if key in self.params else len(self.args)
        return self.args[i] if i < len(self.args) else default

    def run(self, **replace):
        args, kwargs = list(self.args), dict(self.kwargs)
        for key, value in replace.items():
            i = self.params.index(key)
            if i < len(args):
                args[i] = value
            else:
                kwargs[key] = value
        return self.func(*args, **kwargs)


class RandomOff(TorchFunctionMode):
    """``with RandomOff(model):`` — every random op of every module forward run in it is switched
    off (see the module docstring). :attr:`off` and :attr:`left` count, per kind and module, the
    random ops met in the first forward (one forward's worth: the report's figures), "kind (module)"
    -> calls."""

    def __init__(self, model: nn.Module | None = None):
        super().__init__()
        self.names = {id(m): n for n, m in model.named_modules()} if model is not None else {}
        self.off: Counter = Counter()
        self.left: Counter = Counter()
        self.forwards = 0
        """outermost forwards finished (in any thread): only the first one's ops are counted"""
        self._local = threading.local()
        self._hooks: list = []
        self._plan: dict = {}

    def counts(self) -> tuple[list[str], list[str]]:
        """The ops switched off and those left, as ``"2 x dropout p=0.1 (h.0.attn)"`` (one forward's
        worth)."""
        return ([f"{n} x {what}" for what, n in self.off.items()],
                [f"{n} x {what}" for what, n in self.left.items()])

    # ---- where: the modules running in this thread -----------------------------------------------
    def _stack(self) -> list:
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    def _enter(self, module, *_):
        self._stack().append(module)

    def _exit(self, module, *_):
        stack = self._stack()
        if stack and stack[-1] is module:
            stack.pop()
            self.forwards += not stack

    def _where(self) -> str:
        module = self._stack()[-1]
        return self.names.get(id(module)) or type(module).__name__

    def __enter__(self):
        self._hooks = [nn.modules.module.register_module_forward_pre_hook(self._enter),
                       nn.modules.module.register_module_forward_hook(self._exit, always_call=True)]
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        return super().__exit__(*exc)

    # ---- what: each call -------------------------------------------------------------------------
    def _kind(self, func) -> tuple[str, list[str]] | None:
        """(name, parameter names) of a random function, None for any other (cached per
        function)."""
        try:
            return self._plan[func]
        except KeyError:
            pass
        except TypeError:  # unhashable: look it up each time
            return self._classify(func)
        self._plan[func] = kind = self._classify(func)
        return kind

    @staticmethod
    def _classify(func):
        """Random: seeded by name, or taking a drop probability (``multi_head_attention_forward``'s
        ``dropout_p``)."""
        name = _name(func)
        if not name:
            return None
        params = _params(func, name)
        return (name, params) if _seeded(name) or any(a in params
                                                      for a in PROBABILITY_ARGS) else None

    def _count(self, counter: Counter, what: str) -> None:
        if not self.forwards:
            counter[f"{what} ({self._where()})"] += 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = self._kind(func) if self._stack() else None
        if kind is None:
            return func(*args, **kwargs)
        call = _Call(func, *kind, args, kwargs)
        # dropout when not training draws nothing
        if any(call.get(t, True) is False for t in TRAIN_ARGS):
            return func(*args, **kwargs)
        prob = next((a for a in PROBABILITY_ARGS if a in call.params),
                    "p" if "dropout" in call.name else None)
        if prob is not None and prob in call.params:
            p = call.get(prob, 0.0)
            if isinstance(p, (int, float)) and p > 0:
                self._count(self.off, f"{call.name} {prob}={p:g}")
                return call.run(**{prob: 0.0})
            return func(*args, **kwargs)
        if call.name in MEANS:
            mean = MEANS[call.name](call)
            self._count(self.off, f"{call.name} -> its mean"
                        + (f" {mean:g}" if isinstance(mean, (int, float)) else ""))
            out = func(*args, **kwargs)
            # normal(mean, std): the gradient reaches mean
            if isinstance(mean, torch.Tensor) and mean.requires_grad:
                return mean.expand_as(out).clone()
            with torch.no_grad():
                return out.copy_(mean) if isinstance(mean, torch.Tensor) else out.fill_(mean)
        self._count(self.left, call.name)
        return func(*args, **kwargs)

