"""Mixed precision (seed §4.3): bf16/fp16 autocast and, for fp16, a (sharded) gradient scaler with the plan's
initial loss scale and dynamic scaling."""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor.parallel import loss_parallel


def step_context(device: str, *, amp_dtype: torch.dtype | None = None, vocab_parallel: bool = False):
    """What a forward and backward run under: autocast to ``amp_dtype`` (None: off) and, for a vocab-sharded head
    (``vocab_parallel``), torch's ``loss_parallel()`` (cross-entropy on the logits' shards)."""
    stack = contextlib.ExitStack()
    if amp_dtype is not None:
        stack.enter_context(torch.autocast(device, dtype=amp_dtype))
    if vocab_parallel:
        stack.enter_context(loss_parallel())
    return stack


def exact_fp32() -> None:
    """Compute fp32 matmuls and convolutions in full fp32 on CUDA: TF32 off for both (cuDNN convolutions use TF32 by
    default, ~1e-3 relative error, far above verify's fp32 tolerance). Verify's ranks and its reference call it; on a
    CPU it changes nothing."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def grad_scaler(device: str, *, init_scale: float, dynamic: bool, growth_interval: int, sharded: bool):
    """The fp16 loss scaler (``ShardedGradScaler`` when FSDP shards the gradients). A static loss scale
    (``dynamic=False``) is a scaler that never grows or backs off."""
    kwargs = {"init_scale": init_scale, "growth_interval": growth_interval if dynamic else 2**31 - 1}
    if not dynamic:
        kwargs.update(growth_factor=1.0, backoff_factor=1.0)
    if sharded:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device, **kwargs)
    return torch.amp.GradScaler(device, **kwargs)
