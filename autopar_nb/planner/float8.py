"""Float8 training as the planner chooses it (``plan.precision.float8``): fixed by the user, or
tried on the best plan where the device has FP8 tensor cores and taken when the cost model finds it
faster (:mod:`..cost.float8`); never on a device without them, where torchao emulates the matmuls in
float32."""

from __future__ import annotations

import dataclasses

from ..cost.float8 import FP8
from ..hardware import PRESETS
from ..units import fmt_time
from .candidate import Candidate
from .levers import take_if_faster

PRESET_DEVICES = {dev.name for dev, _, _ in PRESETS.values()} | {"cpu"}
"""the devices whose datasheets the presets copy: one of them without an FP8 rate has no FP8
matmuls"""
AUTO_RECIPE = "tensorwise"
"""the recipe the planner offers: torchtitan's default, the fastest (one scale per tensor, float8
FSDP gathers)"""


def float8_refusal(device, amp: str, pp: int) -> str:
    """Why float8 is not offered on ``device`` with autocast ``amp`` and ``pp`` pipeline stages (""
    when it is)."""
    if not device.supports(FP8) and device.name not in PRESET_DEVICES:
        # a GPU no preset names (or a custom DeviceSpec) may well have FP8 tensor cores: its rate is
        # what is missing
        return (f"no FP8 rate is known for the {device.name} (no preset names it), so float8 "
                "cannot be costed; fix float8=tensorwise runs torchao on it (FP8 matmuls from "
                f"compute capability 8.9, else emulated), or give its DeviceSpec a {FP8!r} peak")
    if not device.supports(FP8):
        return (f"the {device.name} has no FP8 matmuls (they need compute capability 8.9: H100, "
                "H200, GH200, L4, L40S), so torchao would emulate them in float32, slower than "
                "bf16; fix float8=tensorwise runs that emulation to check the numerics")
    if amp != "bf16":
        return f"float8 takes bf16 inputs, and this plan runs amp={amp!r}"
    return "" if pp == 1 else f"float8 runs with pp=1 only, and this plan has pp={pp}"


def with_float8(cand: Candidate, ev, recipe: str) -> Candidate:
    """``cand``'s setting and choices costed with ``recipe``."""
    s = dataclasses.replace(cand.setting, float8=recipe)
    choices = [dataclasses.replace(c) for c in cand.choices]
    return Candidate(s, choices, ev.evaluate(s, choices), cand.limit)


def float8_flipped(cand: Candidate, ev) -> Candidate:
    """``cand`` with the other float8 choice (bf16 where it runs float8, else :data:`AUTO_RECIPE`),
    its setting otherwise as it is: the one costing that explain()'s Float8 line and its lever line
    (``lever_costs.py``) both state, so that they compare against the same plan."""
    return with_float8(cand, ev, "none" if cand.setting.float8 != "none" else AUTO_RECIPE)


def float8_choice(best: Candidate, ev, cons, cluster) -> Candidate:
    """The chosen candidate: float8 taken when it fits and is faster; a fixed recipe stays, and so
    does bf16 where float8 is not offered."""
    s = best.setting
    if "float8" in cons.fix or float8_refusal(cluster.device, s.amp, s.pp):
        return best
    return take_if_faster(best, with_float8(best, ev, AUTO_RECIPE))[0]


def float8_lines(best: Candidate, ev, cons, cluster) -> list[str]:
    """One line: the float8 choice, why, and the other choice's step time on the final plan
    (:func:`float8_flipped`: the levers chosen after float8, async TP, are kept on both sides, as
    the lever line keeps them)."""
    s, device = best.setting, cluster.device
    why = "" if "float8" in cons.fix else float8_refusal(device, s.amp, s.pp)
    if why:
        return [f"Float8 not offered: {why}."]
    if s.float8 == "none" and "float8" in cons.fix:
        return []
    other = float8_flipped(best, ev)
    on, off = (best, other) if s.float8 != "none" else (other, best)
    ratio = off.cost.step_time_s / on.cost.step_time_s
    rate = (f"at the {device.name}'s FP8 rate ({device.flops(FP8) / 1e12:.0f} TFLOP/s, "
            f"{device.flops(FP8) / device.flops('bfloat16'):.1f}x bf16)" if device.supports(FP8)
            else f"emulated in float32 on the {device.name} (no FP8 matmuls)")
    step = (f"{fmt_time(on.cost.step_time_s)}/step vs {fmt_time(off.cost.step_time_s)} in bf16 "
            f"({ratio:.2f}x)")
    if "float8" in cons.fix:
        return [f"Float8 ({s.float8}, fix float8): torchao's float8 Linears (the output head kept "
                f"in bf16), matmuls {rate}, casts included: {step}."]
    if s.float8 != "none":
        return [f"Float8 ({s.float8}) chosen: the Linears' matmuls {rate}, casts included: {step}; "
                "torchao, the output head kept in bf16."]
    eager = "" if any(c.compile for c in best.choices) else ("; its casts run eager here (compile "
                                                             "fuses them)")
    return [f"Float8 not chosen: its casts cost more than the matmuls {rate} save ({step}){eager}."]
