"""RMSNorm modules run kernels_ext's fused RMSNorm (``plan.fused_norm``): on CUDA one kernel
(Liger-kernel's Triton kernel when it is installed, else torch's own fused one), elsewhere the
``kernels_ext::rms_norm`` custom op; each keeps the input and one fp32 rstd per row for backward
where the eager chain (``x.pow(2).mean()``, ``rsqrt``, two multiplies) also keeps the normalised
input.

The norms of the models people bring are found by what they compute, not by their class: a leaf
module whose only state is a 1-D ``weight`` and which holds its epsilon (``variance_epsilon``:
Hugging Face's LlamaRMSNorm, Qwen2RMSNorm, MixtralRMSNorm, T5LayerNorm, ...; ``eps``:
``nn.RMSNorm``, Mistral's and torchtitan's) is an RMSNorm when a copy of it on the CPU, given random
weights, returns ``x * rsqrt(mean(x**2) + eps) * weight`` for a random ``x``. A norm that computes
anything else (Gemma's ``x * (1 + weight)``, a LayerNorm without bias) keeps its forward.

Only the module's ``forward`` is replaced (an instance attribute): parameters, names, state dicts
and the module's class stay as they are, so TP styles, checkpoint wrappers, compile and FSDP see the
same modules. Under sequence parallelism DTensor runs the op on sequence shards by kernels_ext's
sharding rules.

This file is copied verbatim into exported scripts: it imports only the standard library and torch
at the top; kernels_ext is imported when a plan fuses its norms, and a script that needs it says how
to install it.
"""

from __future__ import annotations

import copy
import types

import torch
import torch.nn as nn

EPS_NAMES = ("variance_epsilon", "eps", "epsilon")
"""attributes an RMSNorm module keeps its epsilon in"""


def fused_rms_norm_op():
    """``kernels_ext.rms_norm``; an ImportError that says what to install when it is missing."""
    try:
        from kernels_ext import rms_norm
    except ImportError as e:
        raise ImportError("this plan fuses the model's RMSNorms (plan.fused_norm) with "
                          "kernels_ext, which is not installed here: pip install autopar-nb (it "
                          "ships kernels_ext), or re-plan with fix fused_norm=False") from e
    return rms_norm


def rms_norm_eps(module: nn.Module) -> float | None:
    """The epsilon of ``module`` when it computes RMSNorm over its last dim with its 1-D ``weight``
    (see the module docstring), else None."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or next(module.children(),
                                                                         None) is not None:
        return None
    if len(list(module.parameters(recurse=False))) != 1 or next(module.buffers(recurse=False),
                                                                None) is not None:
        return None
    eps = next((getattr(module, n) for n in EPS_NAMES
                if isinstance(getattr(module, n, None), float | int)
                and not isinstance(getattr(module, n), bool)), None)
    if eps is None:
        return None
    return float(eps) if _computes_rms_norm(module, float(eps)) else None


def _computes_rms_norm(module: nn.Module, eps: float) -> bool:
    """Whether a CPU copy of ``module`` with random weights returns RMSNorm of random (off-centre)
    rows."""
    probe = copy.deepcopy(module).to_empty(device="cpu").float()
    g = torch.Generator().manual_seed(0)
    dim = probe.weight.shape[0]
    x = torch.randn(2, 3, dim, generator=g) + 0.5
    with torch.no_grad():
        probe.weight.copy_(torch.rand(dim, generator=g) + 0.5)
        want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * probe.weight
        try:
            got = probe(x)
        except (TypeError, ValueError, RuntimeError, AttributeError, IndexError,
                NotImplementedError):
            # a module this probe cannot call is not one to fuse
            return False
    return (isinstance(got, torch.Tensor) and got.shape == want.shape
            and torch.allclose(got, want, rtol=1e-5, atol=1e-6))


def _fused_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self._fused_rms_norm(x, self.weight, self._fused_rms_eps)


def apply_fused_norm(model: nn.Module) -> list[str]:
    """Replace the forward of every RMSNorm module of ``model`` (:func:`rms_norm_eps`) with
    kernels_ext's fused RMSNorm, before TP, checkpointing, compile and data parallelism wrap them;
    returns their paths (a module already fused is left as it is and listed). ValueError when the
    model has none: re-plan with fix fused_norm=False."""
    op = fused_rms_norm_op()
    paths = []
    for path, module in model.named_modules():
        if getattr(module, "_fused_rms_eps", None) is None:
            eps = rms_norm_eps(module)
            if eps is None:
                continue
            module._fused_rms_eps, module._fused_rms_norm = eps, op
            module.forward = types.MethodType(_fused_forward, module)
        paths.append(path)
    if not paths:
        raise ValueError(f"plan.fused_norm is set, but {type(model).__name__} has no RMSNorm "
                         "module (a leaf with a 1-D weight and an eps that computes x * "
                         "rsqrt(mean(x**2) + eps) * weight): re-plan with fix fused_norm=False")
    return paths
