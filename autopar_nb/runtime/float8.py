"""Float8 training with torchao (``convert_to_float8_training``): the Linear layers it can take
compute their three matmuls (output, input gradient, weight gradient) in float8 with dynamic scales,
as torchtitan's ``Float8Converter`` applies it. Without FP8 matmuls (CPUs, GPUs below compute
capability 8.9) torchao emulates them: the same casts and scales, the products in float32, which is
how CPU runs check the numerics.

torchao is imported inside the functions that need it: a plan without float8 runs without it
installed.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

FLOAT8_MULTIPLE = 16
"""both dimensions of a float8 matmul's operands must be multiples of 16 (``torch._scaled_mm``)"""
TORCHAO_INSTALL = "pip install --no-deps torchao==0.18.0"
"""the torchao the project is tested with; --no-deps keeps the installed torch"""


def output_head(model: nn.Module) -> str:
    """The module path of the model's output head: the last ``nn.Linear`` it registers (Hugging
    Face's and nanoGPT's ``lm_head``, torchtitan's ``output``); "" when it has none. Kept in bf16 by
    default, as torchtitan does: the logits feed a softmax whose gradient float8 rounds most."""
    return next((path for path, m in reversed(list(model.named_modules())) if type(m) is nn.Linear),
                "")


def float8_eligible(in_features: int, out_features: int) -> bool:
    """Whether a Linear of these dimensions can run float8 matmuls (:data:`FLOAT8_MULTIPLE`)."""
    return in_features % FLOAT8_MULTIPLE == 0 and out_features % FLOAT8_MULTIPLE == 0


def float8_linears(model: nn.Module, *, keep: tuple[str, ...] | None = None) -> list[str]:
    """The module paths :func:`apply_float8` converts: every ``nn.Linear`` (not a subclass:
    MultiheadAttention's ``out_proj`` is read as a weight, never called) whose dimensions are
    multiples of 16, except ``keep`` (default: the :func:`output_head`)."""
    keep = (output_head(model),) if keep is None else keep
    return [path for path, m in model.named_modules() if type(m) is nn.Linear and path not in keep
            and float8_eligible(m.in_features, m.out_features)]


def emulated(device: torch.device | str) -> bool:
    """Whether float8 matmuls are emulated on ``device``: everywhere but CUDA devices of compute
    capability 8.9 or more (Ada, Hopper, Blackwell), which have FP8 tensor cores."""
    device = torch.device(device)
    return device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9)


def float8_config(recipe: str, *, emulate: bool, fsdp: bool):
    """torchao's ``Float8LinearConfig`` for ``recipe`` ("tensorwise" or "rowwise"): with ``fsdp``,
    the tensorwise recipe all-gathers the weights in float8 (half the bytes of bf16), as torchtitan
    enables it; the rowwise one gathers them in bf16 (its scales are per row of each use, known only
    after the gather)."""
    try:
        from torchao.float8 import Float8LinearConfig
    except ImportError as e:
        raise ImportError(f"float8 training needs torchao: {TORCHAO_INSTALL}") from e
    config = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=emulate,
                               enable_fsdp_float8_all_gather=fsdp and recipe == "tensorwise")


def apply_float8(model: nn.Module, recipe: str, *, device, fsdp: bool,
                 keep: tuple[str, ...] | None = None) -> list[str]:
    """Swap :func:`float8_linears` for torchao's ``Float8Linear`` (the same weights), before TP,
    compile and FSDP wrap them; returns their paths. ``device``: where the model runs
    (:func:`emulated`); ``fsdp``: FSDP will shard them (:func:`float8_config`)."""
    from torchao.float8 import convert_to_float8_training

    targets = set(float8_linears(model, keep=keep))
    # gloo has no float8 dtype (its all-gather fails: "Invalid scalar type"): on CPUs FSDP gathers
    # in bf16
    config = float8_config(recipe, emulate=emulated(device),
                           fsdp=fsdp and torch.device(device).type != "cpu")
    convert_to_float8_training(model, config=config, module_filter_fn=lambda _, fqn: fqn in targets)
    return sorted(targets)
