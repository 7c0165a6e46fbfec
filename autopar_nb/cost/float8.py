"""Float8 training (``plan.precision.float8``, ``runtime/float8.py``) as the cost model sees it: the
Linears it takes (:mod:`.profile.float8`) run their three matmuls at the device's FP8 rate, and each
step casts their inputs, weights and output gradients to float8 with dynamic scales (an amax read,
then a scaled cast), which are memory-bound.

torchao saves each Linear's bf16 input and weight for backward and casts them again there
(``matmul_with_hp_or_ float8_args``), so the saved activations are what bf16 saves: float8 changes
time, not the activation memory. Without FP8 matmuls (CPUs, GPUs before compute capability 8.9)
torchao emulates them in float32.
"""

from __future__ import annotations

FP8 = "float8_e4m3fn"
"""the ``DeviceSpec.peak_flops`` key of a device's dense FP8 tensor-core rate"""
FP8_ITEM = 1
"""bytes per float8 element"""
CAST_BYTES = {False: 25, True: 5}
"""bytes moved per element cast to float8, eager (torchao's abs, amax, float32 scale, clamp and
convert: 25) or compiled (Inductor fuses the amax read and the cast: read 2 twice, write 1)"""


def fp8_rate(device) -> tuple[str, float]:
    """(the dtype float8 matmuls run at, its peak FLOP/s): FP8 where the device has it, else float32
    (emulated)."""
    return (FP8, device.flops(FP8)) if device.supports(FP8) else ("float32",
                                                                  device.flops("float32"))


def local_share(lp, tp: int) -> float:
    """The share of the float8 Linears' activations and weights one of ``tp`` ranks holds: those TP
    splits by 1/tp, the others whole (weighted by their FLOPs)."""
    split = lp.f8_flops_split / (lp.f8_flops_split + lp.f8_flops_rep)
    return split / tp + (1 - split)


def float8_weights_local(lp, tp: int) -> float:
    """numel of the float8 Linears' weights one of ``tp`` ranks holds (0 in a layer without
    them)."""
    return lp.f8_weights * local_share(lp, tp) if lp.f8_flops_split + lp.f8_flops_rep else 0.0


def gathered_item(numel: float, f8_numel: float, *, p_item: int, recipe: str, cluster) -> float:
    """Bytes per parameter FSDP all-gathers for ``numel`` parameters of which ``f8_numel`` are
    float8 Linears' weights: under the tensorwise recipe torchao casts each weight shard to float8
    before the all-gather (``Float8LinearConfig.enable_fsdp_float8_all_gather``,
    ``fsdp_pre_all_gather`` in torchao/float8/fsdp_utils.py; torchtitan's ``[float8]
    enable_fsdp_float8_all_gather``): 1 byte each (:data:`FP8_ITEM`) where ``p_item`` would gather
    otherwise. The rowwise recipe gathers in bf16; gloo has no float8 dtype, so on the ``cpu``
    preset the runtime gathers in bf16 (``runtime/float8.py``)."""
    if recipe != "tensorwise" or cluster.name == "cpu" or not numel:
        return p_item
    return p_item - min(f8_numel, numel) / numel * (p_item - FP8_ITEM)


def gathered_in_float8(s, cluster) -> bool:
    """Whether FSDP all-gathers setting ``s``'s float8 weights in float8 (:func:`gathered_item`; the
    runtime's ``float8_config`` with FSDP over several ranks). Then torchao casts each weight's
    shard in ``fsdp_pre_all_gather`` and the Linear finds its weight cast already
    (``tensor_already_casted_to_fp8`` in ``matmul_with_hp_or_float8_args``, forward and backward):
    the cast moves from the whole local weight per pass to a 1/dp shard per all-gather."""
    return (s.float8 == "tensorwise" and s.zero_stage >= 1 and s.replicas > 1
            and cluster.name != "cpu")


def shard_cast_time(numel: float, device, factors) -> float:
    """Seconds of one cast of ``numel`` weight elements to float8 before FSDP's all-gather: eager
    (FSDP's hook runs outside any compiled region), :data:`CAST_BYTES` per element."""
    return numel * CAST_BYTES[False] / (device.hbm_bandwidth * factors.eff_hbm)


def float8_time(lp, *, tp: int, scale: float, device, factors, compiled: bool,
                low_dtype: str = "bfloat16", weight_cast: bool = True) -> tuple[float, float]:
    """(forward, backward) seconds float8 adds to one micro-batch of the layer ``lp`` on one rank
    (negative: it saves them): its Linears' matmuls at :func:`fp8_rate` instead of ``low_dtype``'s
    (backward: twice the forward's FLOPs), plus the casts (:data:`CAST_BYTES`): forward the input
    and the weight, backward the input and weight again and the output's gradient twice (for the
    input's and the weight's gradient). ``weight_cast`` False: the weights arrive cast by FSDP's
    all-gather (:func:`gathered_in_float8`), costed there."""
    flops = (lp.f8_flops_split / tp + lp.f8_flops_rep) * scale
    if not flops:
        return 0.0, 0.0
    dtype, rate = fp8_rate(device)
    eff_lo, eff_f8 = factors.efficiency("matmul", True), factors.efficiency("matmul",
                                                                            dtype != "float32")
    matmul = flops / (rate * eff_f8) - flops / (device.flops(low_dtype) * eff_lo)
    shard = local_share(lp, tp)  # the share of the activations and weights a rank casts
    act_in, act_out, w = (lp.f8_in * scale * shard, lp.f8_out * scale * shard,
                          lp.f8_weights * shard * weight_cast)
    per = CAST_BYTES[compiled] / (device.hbm_bandwidth * factors.eff_hbm)
    return matmul + (act_in + w) * per, 2 * matmul + (act_in + w + 2 * act_out) * per
