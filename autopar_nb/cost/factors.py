"""Every efficiency, overlap and margin factor of the cost model, in one place.

The defaults are round figures from published measurements (sources beside each). A measured run
replaces any of them through ``Cluster.calibration`` (same names): ``factors_for(cluster)`` applies
the overrides.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Factors:
    """Dimensionless factors (0..1 unless stated) and small constants the cost model multiplies
    peaks by."""

    eff_matmul: float = 0.70
    """achieved / peak FLOP/s of large GEMMs (Megatron-LM reports 0.6-0.75 of A100/H100 bf16
    peak)"""
    eff_conv: float = 0.55
    """achieved / peak for convolutions (cuDNN, typical CNN shapes). No source: a round figure"""
    eff_attention: float = 0.55
    """achieved / peak for fused attention on a device without published kernel figures (16-bit
    attention on the A100 and Hopper presets is costed by head dim, sequence and mask from
    FlashAttention-2's published speeds: ``cost/flash.py``); FlashAttention-2 paper: 50-73% of A100
    peak forward, less backward"""
    flash_speed: float = 1.0
    """achieved / published FlashAttention-2 speed where ``cost/flash.py`` has figures for the
    device (1: the published one; a calibration's speed correction scales it)"""
    eff_fp32_matmul: float = 0.85
    """fp32 GEMMs run on CUDA cores (or the CPU) close to their (much lower) peak. No source: a
    round figure"""
    eff_hbm: float = 0.75
    """achieved / datasheet HBM bandwidth for memory-bound kernels (elementwise, norms, softmax,
    optimizer). No source: a round figure"""
    eff_link: float = 0.80
    """achieved NCCL bus bandwidth / link datasheet bandwidth at large messages (the latency and
    protocols of smaller ones: ``cost/comm.py``). NCCL's maintainer: the ring reaches ~370 GB/s of
    NVLink 4's 450 "with the protocol overhead (~20%)" (NVIDIA/nccl-tests#212, 0.82); 46-48 GB/s per
    400 Gb/s NDR adapter (NVIDIA/nccl-tests#290, 0.92-0.96); 0.80 kept, the lower"""
    op_overhead_s: float = 2e-6
    """seconds per non-view op of launch/framework overhead not hidden by asynchronous kernel
    execution (eager PyTorch issues a kernel in ~5-10 us of CPU time, mostly overlapped with the
    previous kernels). No source on a GPU: a round figure"""
    overlap_dp: float = 0.80
    """fraction of DDP/ZeRO-1/2 gradient all-reduce or reduce-scatter hidden behind backward
    compute. No source: a round figure (not derived from the buckets' schedule)"""
    overlap_fsdp: float = 0.80
    """fraction of FSDP (ZeRO-3) all-gather/reduce-scatter hidden behind compute (prefetch of the
    next unit). No source: a round figure (not derived from FSDP2's one-unit prefetch)"""
    overlap_tp: float = 0.0
    """fraction of TP collectives hidden (0: PyTorch's eager TP runs them on the critical path)"""
    overlap_pp: float = 0.90
    """fraction of pipeline send/recv hidden behind the other micro-batches' compute (steady
    state). No source: a round figure"""
    overlap_contention: float = 0.189
    """seconds of compute lost per second of communication hidden behind it: an NCCL kernel holds
    SMs and HBM bandwidth while it runs beside the compute kernels. Measured by Characterizing
    Compute-Communication Overlap in GPU-Accelerated Distributed Deep Learning: Performance and
    Power Implications (arXiv:2507.03114, 2025, the abstract): GPT and LLaMA training on 4 A100s,
    H100s, MI250s and MI210s, computation overlapped with communication is 18.9 % slower on average
    (40.0 % at most) than the same computation alone. Not measured on CPUs: 0 for the ``cpu``
    preset"""
    bubble_zero_bubble: float = 0.10
    """zero-bubble schedules: remaining bubble as a fraction of the 1F1B bubble. No source for the
    figure: the schedules' authors publish a bubble rate of (p-1)/m for 1F1B, (p-1)/3m for ZB1P and
    0 for ZB2P and ZBV "assuming T_F = T_B = T_W" (sail-sg/zero-bubble-pipeline-parallelism's README
    at 3a91d0c, "Comparision of Schedules"), which a transformer's backward does not meet (its
    attention has no weight gradient: T_B > T_W), so 0 would be low; the round 0.10 is kept"""
    margin_fraction: float = 0.05
    """allocator fragmentation: fraction of the predicted bytes the caching allocator reserves on
    top, without full recompute. Measured on an H200 (BENCHMARKS.md "GPU"): 1.4 % without recompute,
    2.2 % selective; a CUDA run's ``run.calibrate()`` replaces this default with its own peak
    reserve's (``autopar_nb.calibration``)"""
    margin_full_recompute: float = 0.305
    """the same under full recompute (every layer of a rank; a share of them moves the fraction by
    its share, :func:`~autopar_nb.cost.memory.with_margin`): measured on the H200, LLaMA-3.2 1B's
    shape, bf16, the caching allocator's peak reserve 41.7 GiB over 31.9 GiB allocated, +30.5 %
    twice (BENCHMARKS.md "GPU"); a CUDA run's ``run.calibrate()`` of a full-recompute plan replaces
    it"""
    margin_fixed_bytes: float = 1.0 * 2**30
    """CUDA context, cuBLAS/NCCL workspaces, bytes (about 0.5-1.5 GiB per GPU process)"""
    compile_memory_bound: float = 0.43
    """a ``torch.compile``d block's memory-bound time (the bytes its pointwise ops, norms and
    softmax move, and its per-op launch overhead) as a fraction of the eager block's: Inductor fuses
    chains of such ops into one kernel that reads its inputs and writes its outputs once; matmuls
    and attention are unchanged (cuBLAS / SDPA either way). Measured on an H200 (BENCHMARKS.md
    "GPU"): LLaMA-3.2 1B's shape, bf16, one GPU, blocks compiled 162.2 ms against 179.1 eager per
    step, which this factor reproduces with the Hopper factors below; a compiled run's calibration
    replaces it (``autopar_nb.calibration``)"""
    compile_s_per_op: float = 1.25
    """seconds Inductor takes at start-up per op of each distinct compiled graph (forward ops
    counted, its backward compiled with it; a repeated block's members share one graph,
    ``cost/compile.py``). Measured on the same H200 run: the compiled launches took about 20 s more
    than the eager ones (45 s against 25), one LLaMA block of 16 ops compiled once for its 16
    members. ``make gpu-check``'s scaling check measures it on a GPU host: the compiled 1B's first
    step over its median, less the eager 1B's, beside this factor's figure and the s/op it
    implies"""
    optimizer_bytes_per_param: float = 36.0
    """bytes moved per local parameter by a fused Adam step: read param, grad, m, v (fp32, 16) +
    write param, m, v (12) + bf16 param copy / grad scaling reads (~8)"""

    # The host's CPU time issuing a step (cost/cpu.py), which the step cannot go below. Measured
    # by `.venv/bin/python bench/overhead.py` (BENCHMARKS.md "CPU overhead"): rank 0 of PyTorch's
    # fake process group, tiny tensors, process CPU time, on the 2-core shared x86_64 container
    # (Intel Xeon, Python 3.11, torch 2.13.0+cpu); the mean of two runs, rounded (they differ by up
    # to 10 %, ZeRO-3's extra by more). The CPU side only: a GPU host adds a CUDA kernel launch per
    # op and NCCL's enqueue per collective (so these are low there), and its cores may be faster.
    cpu_op_s: float = 10e-6
    """seconds of host time per eager op of a forward (``LayerProfile.n_ops``: Python, the
    dispatcher, autograd's recording)"""
    cpu_op_bwd_s: float = 13e-6
    """seconds of host time per forward op in backward (the autograd engine running its backward)"""
    cpu_tp_module_s: float = 290e-6
    """seconds a module TP splits adds to a forward (DTensor's dispatch of its ops, the
    redistribution in its hooks)"""
    cpu_tp_module_bwd_s: float = 400e-6
    """the same in backward"""
    cpu_fsdp_unit_s: float = 560e-6
    """seconds FSDP2 adds per unit per forward + backward under ZeRO-2 (pre/post forward and
    backward hooks, the all-gather's and reduce-scatter's copy-in/out and calls)"""
    cpu_fsdp_reshard_s: float = 130e-6
    """what ZeRO-3 adds per unit to that (the all-gather again in backward)"""
    cpu_ddp_s: float = 85e-6
    """seconds DDP adds per forward + backward (its forward's checks, the reducer, the bucket's
    all-reduce)"""
    cpu_ddp_param_s: float = 3.5e-6
    """what DDP adds per parameter tensor (its gradient hook, the copy into the bucket)"""
    cpu_optimizer_step_s: float = 135e-6
    """seconds of a step of gradient clipping and foreach Adam at no tensor
    (``runtime/train.py``)"""
    cpu_optimizer_param_s: float = 19e-6
    """what clipping and the optimizer step add per plain parameter tensor (on the CPU the foreach
    ops loop over the tensors, which CUDA's multi-tensor kernels batch: high for a GPU host)"""
    cpu_optimizer_dtensor_s: float = 46e-6
    """the same per DTensor parameter (FSDP2's shards, TP's splits: DTensor's dispatch handles each
    tensor of a multi-tensor op)"""
    cpu_pp_microbatch_s: float = 110e-6
    """seconds torch's pipeline schedule adds per micro-batch on a stage (its actions, the sends
    and receives, the stage's backward call)"""
    cpu_collective_s: float = 4.4e-6
    """seconds of host time per collective call outside the wrappers above (the loss's
    all-reduce)"""
    pp_handoff_s: float = 0.0
    """seconds a step waits per micro-batch and stage of a rank (virtual stage) for the stage's
    blocking handoffs (the activation's send/recv forward, its gradient's back) beyond the link's
    alpha-beta time and the schedule's host time (``cpu_pp_microbatch_s``), never hidden; not per
    stage boundary: 1F1B's ranks wait at once, each on its neighbour, so 3 and 4 stages cost no more
    per micro-batch than 2 (BENCHMARKS.md "Pipeline handoffs on gloo"). 0 on the GPU presets, whose
    point-to-point cost is the link's published NCCL latency and bandwidth; the ``cpu`` preset's is
    :data:`CPU_PP_HANDOFF_S`"""

    def efficiency(self, op_class: str, dtype_is_half: bool) -> float:
        """Fraction of peak FLOP/s for a compute-bound op class."""
        if not dtype_is_half:
            return self.eff_fp32_matmul
        return {"matmul": self.eff_matmul, "conv": self.eff_conv,
                "attention": self.eff_attention}.get(op_class, self.eff_matmul)


DEFAULT = Factors()

ARCH_FACTORS: dict[str, dict[str, float]] = {
    # Hopper (H100, H200: the same SMs and tensor cores) reaches a smaller fraction of its peak than
    # Ampere with the kernels eager PyTorch runs: FlashAttention-2 (torch's SDPA) "achieves only 35%
    # utilization on the H100" (Shah et al. 2024, FlashAttention-3, abstract), where it reached
    # 50-73 % of the A100's forward (Dao 2023). Measured: LLaMA-3.2 1B's shape on one H200, bf16
    # eager, seq 2048, recompute none, 179.1 ms a step (BENCHMARKS.md "GPU"): one step time, so one
    # ratio applied to each default alike, as run.calibrate() does: the defaults predict 150.3 ms,
    # 0.839 of it (the model with GEMM shapes and FlashAttention-2's published speeds), giving
    # matmul 0.588, attention 0.462 (where cost/flash.py has no figures), the published attention
    # speeds x 0.839, HBM-bound ops 0.630, float32 matmul 0.713: not independent measurements
    "hopper": {"eff_matmul": 0.588, "eff_attention": 0.462, "flash_speed": 0.839,
               "eff_hbm": 0.630, "eff_fp32_matmul": 0.713},}
"""GPU generation (:attr:`~autopar_nb.hardware.DeviceSpec.arch`) -> the defaults measured there,
replacing :data:`DEFAULT`'s; a generation without a measurement keeps them (Ampere's: Megatron-LM's
large runs)"""


CPU_COMPILE_S_PER_OP = 4.3
"""``compile_s_per_op`` on the ``cpu`` preset (Inductor's C++ backend, the compiler run per kernel):
69 s more in the first steps compiled than eager for zoo.Llama's 16-op block on this project's 2
shared cores (BENCHMARKS.md "Compile vs eager, CPU")"""


CPU_PP_HANDOFF_S = 5.3e-3
"""``pp_handoff_s`` on the ``cpu`` preset: between real gloo processes a ``recv`` sleeps until the
sending process has been scheduled, which on cores shared with other processes costs far more than
the fake process group's ``cpu_pp_microbatch_s`` saw. Measured by ``.venv/bin/python
bench/gloo_latency.py`` (BENCHMARKS.md "Pipeline handoffs on gloo", 2026-12-06): the slope of
torch's 2-stage ``Schedule1F1B`` step in its micro-batches, less that of each stage run alone, less
``cpu_pp_microbatch_s``, on this project's 2 shared x86_64 cores (torch 2.13.0+cpu): 3.1, 6.5, 4.1
and 7.6 ms in four runs at load average 11-17, the median 5.3 ms. It moves with the load (a
tournament's pipelines cost about 10 ms per micro-batch at load 2-8, 74 ms at 21-25): a calibration
scales it. With 3 and 4 stages (``--stages``, 2026-12-07, load 18-26) the per micro-batch cost was
no larger than with 2, so it is not multiplied by the stage boundaries"""


def factors_for(cluster) -> Factors:
    """The default factors of the cluster's GPU generation (:data:`ARCH_FACTORS`) with
    ``cluster.calibration`` applied (unknown names raise, so typos do not pass silently).

    The ``cpu`` preset has no allocator workspace to speak of, so its fixed margin is 0; its overlap
    contention is 0 too (the measurement is of GPUs); its pipeline handoffs wait for the other
    process (:data:`CPU_PP_HANDOFF_S`).
    """
    arch = ARCH_FACTORS.get(getattr(cluster.device, "arch", ""), {})
    base = dataclasses.replace(DEFAULT, **arch) if arch else DEFAULT
    if cluster.name == "cpu":  # no caching allocator: what a CPU run holds is what it allocates
        base = dataclasses.replace(base, margin_fixed_bytes=0.0,
                                   margin_full_recompute=base.margin_fraction,
                                   overlap_contention=0.0, compile_s_per_op=CPU_COMPILE_S_PER_OP,
                                   pp_handoff_s=CPU_PP_HANDOFF_S)
    calib = dict(getattr(cluster, "calibration", None) or {})
    if not calib:
        return base
    known = {f.name for f in dataclasses.fields(Factors)}
    unknown = set(calib) - known
    if unknown:
        raise ValueError(f"unknown calibration factor(s) {', '.join(sorted(unknown))}; "
                         f"known: {', '.join(sorted(known))}")
    return dataclasses.replace(base, **{k: float(v) for k, v in calib.items()})
