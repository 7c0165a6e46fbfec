"""Mixed precision (seed §4.3): bf16/fp16 autocast and, for fp16, a (sharded) gradient scaler with the plan's
initial loss scale and dynamic scaling."""

from __future__ import annotations

import contextlib

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "fp32": torch.float32}


def autocast(amp: str, device: str):
    """The forward-pass context for ``amp`` ("none" | "bf16" | "fp16")."""
    if amp == "none":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device, dtype=DTYPES[amp])


def grad_scaler(amp: str, device: str, *, init_scale: float, dynamic: bool, growth_interval: int, sharded: bool):
    """A GradScaler for fp16 (``ShardedGradScaler`` when gradients are FSDP-sharded); ``None`` otherwise.

    A static loss scale (``dynamic=False``) is a scaler that never grows or backs off.
    """
    if amp != "fp16":
        return None
    kwargs = dict(init_scale=init_scale, growth_interval=growth_interval if dynamic else 2**31 - 1)
    if not dynamic:
        kwargs.update(growth_factor=1.0, backoff_factor=1.0)
    if sharded:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device, **kwargs)
    return torch.amp.GradScaler(device, **kwargs)
