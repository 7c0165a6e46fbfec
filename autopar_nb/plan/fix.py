"""The global choices a user can pin (``--fix``, ``plan(fix=...)``, ``Session.replan(fix=...)``) and
their check."""

from __future__ import annotations

from typing import Any

from .checks import PlanError, check_choice, check_int, check_number
from .vocab import (
    AMP,
    AMP_OPS,
    FLOAT8,
    MAX_DEGREE,
    MAX_MICRO_BATCHES,
    MAX_VIRTUAL_STAGES,
    OFFLOAD,
    OPTIMIZERS,
    RECOMPUTE,
    SCHEDULES,
    ZERO_STAGES,
)

FIX_KEYS = ("dp", "tp", "pp", "ep", "cp", "zero_stage", "micro_batches", "schedule",
            "virtual_stages", "recompute", "amp", "float8", "compile", "fused_loss", "fused_norm",
            "async_tp", "offload", "sequence_parallel", "optimizer", "fp32_ops",
            "low_precision_ops", "moe_capacity")
"""global choices a user can pin (``--fix``, ``plan(fix=...)``, ``Session.replan(fix=...)``)"""
FIX_ALIASES = {"zero": "zero_stage", "mb": "micro_batches", "micro": "micro_batches",
               "sp": "sequence_parallel"}
"""short names accepted for FIX_KEYS"""
FIX_CHOICES: dict[str, tuple] = {"zero_stage": ZERO_STAGES, "schedule": SCHEDULES,
                                 "recompute": RECOMPUTE, "amp": AMP, "float8": FLOAT8,
                                 "sequence_parallel": (False, True), "optimizer": OPTIMIZERS,
                                 "compile": (False, True), "fused_loss": (False, True),
                                 "fused_norm": (False, True), "async_tp": (False, True),
                                 "offload": OFFLOAD}
"""the allowed values of the FIX_KEYS that are choices; the others (dp, tp, pp, ep, cp,
micro_batches, virtual_stages) are positive integers, up to FIX_MAX or else MAX_DEGREE"""
FIX_MAX = {"micro_batches": MAX_MICRO_BATCHES, "virtual_stages": MAX_VIRTUAL_STAGES}
FIX_NUMBERS = {"moe_capacity": 1.0}
"""the FIX_KEYS that are real numbers, and their least value (``mesh.moe_capacity``)"""


def normalize_fix(fix: dict[str, Any] | None) -> dict[str, Any]:
    """A checked copy of ``fix`` with aliases resolved (``zero`` -> ``zero_stage``, ...). PlanError
    names an unknown key or a value of the wrong type."""
    out: dict[str, Any] = {}
    for key, value in (fix or {}).items():
        k = FIX_ALIASES.get(key, key)
        if k not in FIX_KEYS:
            raise PlanError(f"unknown fix key(s) {key}; supported: {', '.join(FIX_KEYS)} "
                            f"(aliases: {', '.join(f'{a}={t}' for a, t in FIX_ALIASES.items())})")
        # op lists: ["softmax", "layer_norm"] or "softmax+layer_norm"
        if k in ("fp32_ops", "low_precision_ops"):
            value = value.split("+") if isinstance(value, str) else value
            if not isinstance(value, (list, tuple)):
                raise PlanError(f"fix[{k!r}] must be a list of op names (or names joined by '+'), "
                                f"got {value!r}")
            for op in value:
                check_choice(f"fix[{k!r}][...]", op, AMP_OPS)
            value = list(value)
        elif k in FIX_CHOICES:
            check_choice(f"fix[{k!r}]", value, FIX_CHOICES[k])
        elif k in FIX_NUMBERS:
            value = check_number(f"fix[{k!r}]", value, minimum=FIX_NUMBERS[k])
        else:
            check_int(f"fix[{k!r}]", value, minimum=1, maximum=FIX_MAX.get(k, MAX_DEGREE))
        out[k] = value
    return out
