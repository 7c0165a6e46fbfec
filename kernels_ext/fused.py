"""Fused kernels: a chunked linear + cross-entropy that never holds the full logits, and RMSNorm.

Each is a ``torch.library`` custom op (``kernels_ext::linear_cross_entropy``, ``kernels_ext::rms_norm``) with a
pure-PyTorch forward and backward that run on any device, a fake implementation (so meta-device capture, FX and
``torch.compile`` see one op), and an :class:`OpRule` registered like any ATen op's (cost, what it saves, its
tensor-parallel role). On CUDA the public functions use Liger-kernel's Triton kernels when ``liger_kernel`` is
installed (it is optional: ``pip install liger-kernel``); everywhere else the custom ops run.

Memory (tokens N, hidden H, vocab V, chunk C tokens): the unfused head + loss keeps the logits (N x V, the compute
dtype) for backward and materialises an fp32 log-softmax and its gradient (2 x N x V x 4 bytes) at the loss's
backward; the fused op keeps only the hidden states and one fp32 log-sum-exp per token, and its largest temporary is
C x V fp32 logits (twice in backward: the probabilities and their gradient). C defaults to ceil(N / ceil(V / H)) so
that a chunk's logits are about the size of the hidden states (Liger-kernel's choice), but at least 256 tokens.
"""

from __future__ import annotations

import math

import torch

from .aten_rules import _SEQUENCE_SPLITS
from .registry import OpRule, TensorMeta, register_op

IGNORE_INDEX = -100
"""targets equal to this are left out of the loss (``F.cross_entropy``'s default)"""


MIN_CHUNK = 256
"""fewest tokens per chunk: the weight-gradient matmul contracts over the chunk, and below a few hundred it runs far
from peak (measured on CPU: 33-token chunks made the step 3x slower than unfused)"""


def default_chunk(tokens: int, hidden: int, vocab: int) -> int:
    """Tokens per chunk: a chunk's logits (C x V) about the size of the hidden states (N x H), and at least
    :data:`MIN_CHUNK` tokens (or all of them)."""
    return min(tokens, max(MIN_CHUNK, math.ceil(tokens / math.ceil(vocab / hidden))))


# --- linear + cross-entropy ----------------------------------------------------------------------------------------


@torch.library.custom_op("kernels_ext::linear_cross_entropy", mutates_args=())
def _lce_forward(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int,
                 chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the per-token losses in fp32, log-sum-exp per token (N,) fp32) of ``hidden (N, H) @ weight.T (V, H)``
    against ``target (N,)``, ``chunk`` tokens at a time."""
    n = hidden.shape[0]
    total = hidden.new_zeros((), dtype=torch.float32)
    lse = hidden.new_empty((n,), dtype=torch.float32)
    for start in range(0, n, chunk):
        h, t = hidden[start:start + chunk], target[start:start + chunk]
        logits = (h @ weight.t()).float()  # (C, V)
        lse[start:start + chunk] = torch.logsumexp(logits, dim=-1)
        keep = t != ignore_index
        picked = logits.gather(1, torch.where(keep, t, 0).unsqueeze(1)).squeeze(1)
        total += ((lse[start:start + chunk] - picked) * keep).sum()
    return total, lse


@_lce_forward.register_fake
def _(hidden, weight, target, ignore_index, chunk):
    return hidden.new_empty((), dtype=torch.float32), hidden.new_empty((hidden.shape[0],), dtype=torch.float32)


@torch.library.custom_op("kernels_ext::linear_cross_entropy_backward", mutates_args=())
def _lce_backward(grad: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                  lse: torch.Tensor, ignore_index: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``grad * loss sum`` w.r.t. hidden and weight, the logits recomputed chunk by chunk:
    d/dlogits = softmax - onehot(target) (0 on ignored tokens)."""
    grad_hidden = torch.empty_like(hidden)
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    for start in range(0, hidden.shape[0], chunk):
        h, t = hidden[start:start + chunk], target[start:start + chunk]
        probs = torch.exp((h @ weight.t()).float() - lse[start:start + chunk].unsqueeze(1))  # (C, V) softmax
        keep = t != ignore_index
        probs.scatter_add_(1, torch.where(keep, t, 0).unsqueeze(1), -keep.to(probs.dtype).unsqueeze(1))
        probs *= (keep.to(probs.dtype) * grad).unsqueeze(1)
        g = probs.to(hidden.dtype)
        grad_hidden[start:start + chunk] = g @ weight
        accumulate_mm(grad_weight, g.t(), h)  # summed in fp32 over the chunks
    return grad_hidden, grad_weight.to(weight.dtype)


def accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with ``acc`` in float32: on CUDA the matmul runs in ``a``'s and ``b``'s 16-bit dtype and
    writes its float32 sum into ``acc`` (``addmm``'s ``out_dtype``: no float32 matmul, no temporary); elsewhere
    (CPU has no such kernel) it runs on float32 copies. Measured on an H200 (LLaMA-3.2 1B's head, 8192 tokens in
    256-token chunks, bf16 autocast): with the float32 matmul the exported script's step took 294 ms against 179 ms
    unfused; with this, 217 ms (BENCHMARKS.md, "GPU")."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and b.dtype == a.dtype:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.addmm_(a.float(), b.float())


@_lce_backward.register_fake
def _(grad, hidden, weight, target, lse, ignore_index, chunk):
    return torch.empty_like(hidden), torch.empty_like(weight)


def _lce_setup(ctx, inputs, output):
    hidden, weight, target, ignore_index, chunk = inputs
    ctx.save_for_backward(hidden, weight, target, output[1])
    ctx.ignore_index, ctx.chunk = ignore_index, chunk


def _lce_grad(ctx, grad_total, grad_lse):
    hidden, weight, target, lse = ctx.saved_tensors
    gh, gw = _lce_backward(grad_total, hidden, weight, target, lse, ctx.ignore_index, ctx.chunk)
    return gh, gw, None, None, None


_lce_forward.register_autograd(_lce_grad, setup_context=_lce_setup)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
                         ignore_index: int = IGNORE_INDEX, reduction: str = "mean", chunk: int | None = None,
                         use_liger: bool | None = None) -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight.T, target)`` without the full logits: ``hidden (..., H)``, ``weight (V, H)``
    (an output head's, no bias), ``target (...)`` class ids. ``reduction``: "mean" over the tokens not ignored, or
    "sum". ``use_liger``: None = Liger-kernel's Triton kernel on CUDA when it is installed, else the chunked op."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction={reduction!r}: choose 'mean' or 'sum'")
    h, t = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)
    if _liger_wanted(use_liger, hidden):
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        return liger_fused_linear_cross_entropy(h, weight, t, ignore_index=ignore_index, reduction=reduction)
    total, _ = _lce_forward(h, weight, t, ignore_index, chunk or default_chunk(*h.shape, weight.shape[0]))
    if reduction == "sum":
        return total
    return total / (t != ignore_index).sum().clamp(min=1)


# --- vocab-parallel linear + cross-entropy (tensor parallelism) -----------------------------------------------------


class _VocabParallelLCE(torch.autograd.Function):
    """Megatron-LM's vocab-parallel cross-entropy (``tensor_parallel/cross_entropy.py``) fused with the head's matmul
    and chunked: each rank holds rows ``[start, start + V_local)`` of the head's weight and computes only those
    logits, chunk by chunk; the log-sum-exp over the whole vocabulary is combined with two all-reduces (max, then
    the sum of exponentials with the picked target logit, which one rank holds), and in backward each rank's partial
    gradient of the hidden states is summed by one all-reduce. torch.distributed's collectives on ``group``."""

    @staticmethod
    def forward(ctx, hidden, weight, target, start, group, ignore_index, chunk):
        import torch.distributed as dist

        n, v_local = hidden.shape[0], weight.shape[0]
        lse = hidden.new_empty((n,), dtype=torch.float32)
        total = hidden.new_zeros((), dtype=torch.float32)
        for lo in range(0, n, chunk):
            h, t = hidden[lo:lo + chunk], target[lo:lo + chunk]
            logits = (h @ weight.t()).float()  # (C, V_local)
            peak = logits.amax(dim=-1)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
            keep = t != ignore_index
            mine = keep & (t >= start) & (t < start + v_local)
            picked = logits.gather(1, torch.where(mine, t - start, 0).unsqueeze(1)).squeeze(1) * mine
            sums = torch.stack([torch.exp(logits - peak.unsqueeze(1)).sum(-1), picked])
            dist.all_reduce(sums, group=group)
            lse[lo:lo + chunk] = peak + torch.log(sums[0])
            total += ((lse[lo:lo + chunk] - sums[1]) * keep).sum()
        ctx.save_for_backward(hidden, weight, target, lse)
        ctx.start, ctx.group, ctx.ignore_index, ctx.chunk = start, group, ignore_index, chunk
        return total

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        hidden, weight, target, lse = ctx.saved_tensors
        start, v_local = ctx.start, weight.shape[0]
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for lo in range(0, hidden.shape[0], ctx.chunk):
            h, t = hidden[lo:lo + ctx.chunk], target[lo:lo + ctx.chunk]
            probs = torch.exp((h @ weight.t()).float() - lse[lo:lo + ctx.chunk].unsqueeze(1))  # this rank's softmax
            keep = t != ctx.ignore_index
            mine = keep & (t >= start) & (t < start + v_local)
            probs.scatter_add_(1, torch.where(mine, t - start, 0).unsqueeze(1), -mine.to(probs.dtype).unsqueeze(1))
            probs *= (keep.to(probs.dtype) * grad).unsqueeze(1)
            g = probs.to(hidden.dtype)
            grad_hidden[lo:lo + ctx.chunk] = g @ weight
            accumulate_mm(grad_weight, g.t(), h)
        dist.all_reduce(grad_hidden, group=ctx.group)  # each rank's vocabulary rows' share
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None, None


def vocab_parallel_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
                                        start: int, vocab: int, group=None, ignore_index: int = IGNORE_INDEX,
                                        reduction: str = "mean", chunk: int | None = None) -> torch.Tensor:
    """:func:`linear_cross_entropy` with the head's weight split on the vocabulary over the ranks of ``group``
    (tensor parallelism): ``weight`` is this rank's rows ``[start, start + len(weight))`` of the ``vocab``-row
    weight, ``hidden`` and ``target`` are whole on every rank, and the result (and the hidden states' gradient) is
    the same on every rank. The weight's gradient is this rank's rows'."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction={reduction!r}: choose 'mean' or 'sum'")
    h, t = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)
    total = _VocabParallelLCE.apply(h, weight, t, start, group, ignore_index,
                                    chunk or default_chunk(h.shape[0], h.shape[1], vocab))
    if reduction == "sum":
        return total
    return total / (t != ignore_index).sum().clamp(min=1)


# --- RMSNorm -------------------------------------------------------------------------------------------------------


@torch.library.custom_op("kernels_ext::rms_norm", mutates_args=())
def _rms_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / rms(x) * weight in x's dtype, rstd per row (..., 1) fp32); the statistics in fp32."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd).to(x.dtype) * weight, rstd


@_rms_forward.register_fake
def _(x, weight, eps):
    return torch.empty_like(x), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


@torch.library.custom_op("kernels_ext::rms_norm_backward", mutates_args=())
def _rms_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients w.r.t. x and weight from the saved input and rstd (the normalised input is recomputed, not kept):
    dx = rstd * (g*w - xhat * mean(g*w*xhat)), dw = sum over rows of g * xhat."""
    xhat = x.float() * rstd
    gw = grad.float() * weight.float()
    dx = rstd * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
    dw = (grad.float() * xhat).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)


@_rms_backward.register_fake
def _(grad, x, weight, rstd):
    return torch.empty_like(x), torch.empty_like(weight)


def _rms_setup(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _rms_grad(ctx, grad_out, grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = _rms_backward(grad_out, x, weight, rstd)
    return dx, dw, None


_rms_forward.register_autograd(_rms_grad, setup_context=_rms_setup)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, use_liger: bool | None = None
             ) -> torch.Tensor:
    """RMSNorm over the last dim (LLaMA's: statistics in fp32, then scaled by ``weight``). ``use_liger``: None =
    Liger-kernel's Triton kernel on CUDA when it is installed; else on CUDA, for a plain tensor of the weight's
    dtype, torch's own fused kernel (``F.rms_norm``: ``aten._fused_rms_norm`` and its backward, one kernel each);
    else the custom op. Each saves x and one fp32 rstd per row (the decomposed eager norm also keeps the
    normalised input)."""
    if _liger_wanted(use_liger, x):
        from liger_kernel.transformers.functional import liger_rms_norm

        return liger_rms_norm(x, weight, eps)
    if use_liger is None and x.is_cuda and x.dtype == weight.dtype and not _is_dtensor(x):
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
    return _rms_forward(x, weight, eps)[0]


class RMSNorm(torch.nn.Module):
    """``nn.RMSNorm`` on :func:`rms_norm` (same ``weight`` parameter, so state dicts are interchangeable)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def _liger_wanted(use_liger: bool | None, tensor: torch.Tensor) -> bool:
    """Whether to call Liger-kernel: asked for, or (None) on CUDA with liger_kernel importable, for a plain tensor
    (a DTensor runs the custom op, whose sharding rules DTensor knows: :func:`_register_dtensor_rules`)."""
    if use_liger is False or (use_liger is None and (not tensor.is_cuda or _is_dtensor(tensor))):
        return False
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        if use_liger:
            raise ImportError("use_liger=True needs Liger-kernel: pip install liger-kernel") from None
        return False
    return True


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return type(tensor).__name__ == "DTensor" and hasattr(tensor, "placements")


# --- how DTensor runs them (tensor / sequence parallelism) ---------------------------------------------------------


def _register_dtensor_rules() -> None:
    """Sharding rules for DTensor (``torch.distributed.tensor.experimental.register_sharding``), so that a norm that
    sequence parallelism runs on sequence shards (``SequenceParallel``: input ``Shard(1)``, weight ``Replicate``)
    calls the custom op on each rank's rows: RMSNorm is row-wise, so any dim but the last may be sharded, the rstd
    sharded alike; in backward the input's gradient is sharded like the input and the weight's is a ``Partial`` sum
    over the ranks' rows (DTensor reduces it where a replicated weight's gradient must be whole)."""
    try:
        from torch.distributed.tensor import Partial, Replicate, Shard
        from torch.distributed.tensor.experimental import register_sharding
    except ImportError:  # a torch built without distributed
        return

    @register_sharding(torch.ops.kernels_ext.rms_norm.default)
    def _(x, weight, eps):
        rows = [([Shard(d), Shard(d)], [Shard(d), Replicate(), None]) for d in range(len(x.shape) - 1)]
        return [([Replicate(), Replicate()], [Replicate(), Replicate(), None]), *rows]

    @register_sharding(torch.ops.kernels_ext.rms_norm_backward.default)
    def _(grad, x, weight, rstd):
        rows = [([Shard(d), Partial()], [Shard(d), Shard(d), Replicate(), Shard(d)]) for d in range(len(x.shape) - 1)]
        return [([Replicate(), Replicate()], [Replicate(), Replicate(), Replicate(), Replicate()]), *rows]


_register_dtensor_rules()


# --- what the planner knows about them -----------------------------------------------------------------------------


def _lce_flops(args, kwargs, outs) -> float:
    hidden, weight = args[0], args[1]
    return 2.0 * hidden.numel * weight.shape[0] if isinstance(hidden, TensorMeta) else 0.0


register_op(OpRule(
    "kernels_ext.linear_cross_entropy", "matmul", _lce_flops,
    # backward: the logits recomputed (1x), then the hidden's and the weight's gradients (2x)
    backward_factor=3.0,
    saves=("input", "stats"), stats=lambda ins, outs: math.prod(ins[0][:-1]),  # hidden + one fp32 lse per token
    # a feature-sharded hidden must not reach it; vocab-parallel TP of the head uses torch's loss_parallel instead
    tp_role="reduction",
))
register_op(OpRule(
    "kernels_ext.rms_norm", "norm", lambda args, kwargs, outs: 4.0 * outs[0].numel, backward_factor=2.0,
    splits=_SEQUENCE_SPLITS, saves=("input", "stats"), stats=lambda ins, outs: math.prod(outs[0][:-1]),
    tp_role="norm",
))
