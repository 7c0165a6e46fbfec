"""Mixed precision: bf16/fp16 autocast with the plan's own op lists (:class:`OpPrecision`) and, for
fp16, a (sharded) gradient scaler with the plan's initial loss scale and dynamic scaling."""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor.parallel import loss_parallel
from torch.overrides import TorchFunctionMode


def step_context(device: str, *, amp_dtype: torch.dtype | None = None, vocab_parallel: bool = False,
                 op_lists=None):
    """What a forward and backward run under: autocast to ``amp_dtype`` (None: off), ``op_lists()``
    (OpPrecision) and, for a vocab-sharded head (``vocab_parallel``), torch's ``loss_parallel()``
    (cross-entropy on its shards)."""
    stack = contextlib.ExitStack()
    if amp_dtype is not None:
        stack.enter_context(torch.autocast(device, dtype=amp_dtype))
    if op_lists is not None:
        stack.enter_context(op_lists())
    if vocab_parallel:
        stack.enter_context(loss_parallel())
    return stack


ALIASES = {"elementwise_add": "add", "elementwise_sub": "sub", "elementwise_mul": "mul",
           "elementwise_div": "div", "reduce_sum": "sum", "reduce_mean": "mean", "__add__": "add",
           "__radd__": "add", "__iadd__": "add_", "__sub__": "sub", "__rsub__": "sub",
           "__mul__": "mul", "__rmul__": "mul", "__truediv__": "div", "__rtruediv__": "div",
           "__matmul__": "matmul", "__rmatmul__": "matmul", "__pow__": "pow"}
"""Paddle's op names and Python's operators -> torch's function names"""


class OpPrecision(TorchFunctionMode):
    """Autocast's op lists changed by the plan (Paddle's custom white/black lists): a call of an op
    named in ``fp32_ops`` runs with autocast off and its floating inputs cast to float32; one named
    in ``low_precision_ops`` likewise in ``dtype`` (even one autocast keeps in float32, such as
    softmax). Ops are named as torch names the function (``linear``, ``softmax``, ``layer_norm``;
    ``x + y`` is ``add``). It applies to every call in the step, the recompute of checkpointed
    layers included; each op's backward runs in its forward's dtypes."""

    def __init__(self, device: str, dtype: torch.dtype, *, fp32_ops=(), low_precision_ops=()):
        super().__init__()
        self.device = device
        self.to = {ALIASES.get(n, n): torch.float32
                   for n in fp32_ops} | {ALIASES.get(n, n): dtype
                                         for n in low_precision_ops}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        to = self.to.get(ALIASES.get(name, name))
        if to is None:
            return func(*args, **kwargs)
        # floating inputs of these dtypes
        cast = {torch.float32, torch.float16, torch.bfloat16} - {to}
        args = [a.to(to) if isinstance(a, torch.Tensor) and a.dtype in cast else a for a in args]
        kwargs = {k: a.to(to) if isinstance(a, torch.Tensor) and a.dtype in cast else a
                  for k, a in kwargs.items()}
        if to == torch.float32 and torch.is_grad_enabled():  # its backward in float32 too
            keys = [*range(len(args)), *kwargs]  # where each argument goes: a position or a keyword
            values = [*args, *kwargs.values()]
            return WithoutAutocast.apply(self.device, func, keys, values,
                                         *[a for a in values if isinstance(a, torch.Tensor)])
        # the op runs in `to`, whatever autocast's own lists say
        with torch.autocast(self.device, enabled=False):
            return func(*args, **kwargs)


class WithoutAutocast(torch.autograd.Function):
    """``func`` with autocast off in its forward and its backward. The backward of a training step
    runs under the autocast state it was called in (autograd restores it for every node), which
    would cast the float32 matmuls of an op kept in float32 down: here that op's backward is a
    nested ``autograd.grad`` without autocast. ``keys``: each of ``values``' place in the call (an
    int: positional, a str: keyword); ``tensors``: the tensors among ``values``, in order
    (autograd's inputs)."""

    @staticmethod
    def forward(ctx, device, func, keys, values, *tensors):
        inner = iter([t.detach().requires_grad_(t.requires_grad) for t in tensors])
        values = [next(inner) if isinstance(v, torch.Tensor) else v for v in values]
        ctx.inputs, ctx.device = [v for v in values if isinstance(v, torch.Tensor)], device
        with torch.enable_grad(), torch.autocast(device, enabled=False):
            ctx.out = func(*[v for k, v in zip(keys, values, strict=True) if isinstance(k, int)],
                           **{k: v for k, v in zip(keys, values, strict=True)
                              if isinstance(k, str)})
        return ctx.out.detach()

    @staticmethod
    def backward(ctx, grad):
        wanted = [t for t in ctx.inputs if t.requires_grad]
        with torch.autocast(ctx.device, enabled=False):
            grads = iter(torch.autograd.grad(ctx.out, wanted, grad, allow_unused=True))
        return None, None, None, None, *[next(grads) if t.requires_grad else None
                                         for t in ctx.inputs]


def exact_fp32() -> None:
    """Compute fp32 matmuls and convolutions in full fp32 on CUDA: TF32 off for both (cuDNN
    convolutions use TF32 by default, ~1e-3 relative error, far above verify's fp32 tolerance).
    Verify's ranks and its reference call it; on a CPU it changes nothing."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def grad_scaler(device: str, *, init_scale: float, dynamic: bool, growth_interval: int,
                sharded: bool):
    """The fp16 loss scaler (``ShardedGradScaler`` when FSDP shards the gradients). A static loss
    scale (``dynamic=False``) is a scaler that never grows or backs off."""
    kwargs = {"init_scale": init_scale,
              "growth_interval": growth_interval if dynamic else 2**31 - 1}
    if not dynamic:
        kwargs.update(growth_factor=1.0, backoff_factor=1.0)
    if sharded:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device, **kwargs)
    return torch.amp.GradScaler(device, **kwargs)
