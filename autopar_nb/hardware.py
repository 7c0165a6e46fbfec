"""Hardware descriptions: a device spec, the links between devices, and a Cluster of nodes.

Figures are datasheet peaks (dense, no sparsity) in SI units: FLOP/s, bytes, bytes/s (per direction,
per GPU), seconds. The cost model derates them with efficiency factors; measured runs can replace
those factors.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field

from .units import fmt_bytes

GB = 1e9
GiB = 2**30
TB = 1e12


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or a CPU socket standing in for one)."""

    name: str
    memory_bytes: float
    peak_flops: dict[str, float]
    """dtype name ("bfloat16", "float16", "float32", and "float8_e4m3fn" where the device has FP8
    tensor cores: compute capability 8.9 or more) -> dense peak FLOP/s (tensor cores where they
    apply)"""
    hbm_bandwidth: float
    """device memory bandwidth, bytes/s"""
    source: str = ""
    """where the figures come from"""
    arch: str = ""
    """the GPU generation ("ampere", "hopper", ...): kernels reach different fractions of peak on
    each (``cost.factors.ARCH_FACTORS``)"""

    def flops(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype`` (a dtype the device lacks falls back to the slowest listed)."""
        return self.peak_flops.get(dtype, min(self.peak_flops.values()))

    def supports(self, dtype: str) -> bool:
        """Whether the device computes in ``dtype`` natively: bf16 needs compute capability >= 8.0
        (Ampere), so V100/T4 list float16 and float32 only."""
        return dtype in self.peak_flops


@dataclass(frozen=True)
class LinkSpec:
    """A communication level: per-GPU bandwidth in one direction and the per-message latency
    (alpha-beta model)."""

    bandwidth: float
    """bytes/s per GPU per direction"""
    latency: float
    """seconds per message"""
    name: str = ""
    shared: bool = False
    """one adapter per node that its GPUs share (False: one per GPU, as DGX nodes have one
    InfiniBand adapter per GPU, which NCCL drives all at once: ``cost.comm.link_for``)"""
    nccl: str = ""
    """NCCL's link kind ("nvlink", "pci", "net": ``cost.comm``); "" gloo's (``latency`` a step)"""


# --- Devices --------------------------------------------------------------------------------------
# A100 SXM: NVIDIA A100 Tensor Core GPU datasheet (2021): BF16/FP16 312 TFLOPS dense, TF32 156, FP32
# 19.5; 40GB HBM2 1,555 GB/s; 80GB HBM2e 2,039 GB/s; NVLink 3 600 GB/s total (300 GB/s per
# direction).
A100_40GB = DeviceSpec("a100-40gb", 40 * GB,
                       {"bfloat16": 312 * TB, "float16": 312 * TB, "float32": 19.5 * TB}, 1555 * GB,
                       "NVIDIA A100 datasheet (SXM4 40GB)", arch="ampere")
A100_80GB = DeviceSpec("a100-80gb", 80 * GB,
                       {"bfloat16": 312 * TB, "float16": 312 * TB, "float32": 19.5 * TB}, 2039 * GB,
                       "NVIDIA A100 datasheet (SXM4 80GB)", arch="ampere")
# H100 SXM5: NVIDIA H100 datasheet: BF16/FP16 989.4 TFLOPS dense (1,979 with sparsity), FP8 1,979
# dense (3,958 with sparsity), FP32 66.9, 80GB HBM3 3.35 TB/s; NVLink 4 900 GB/s total (450 per
# direction).
H100_80GB = DeviceSpec("h100-80gb", 80 * GB, {"bfloat16": 989.4 * TB, "float16": 989.4 * TB,
                                              "float32": 66.9 * TB, "float8_e4m3fn": 1979 * TB},
                       3350 * GB, "NVIDIA H100 datasheet (SXM5)", arch="hopper")
# H200 SXM: NVIDIA H200 datasheet: same Hopper compute as H100 SXM, 141GB HBM3e at 4.8 TB/s, NVLink
# 900 GB/s.
H200 = DeviceSpec("h200", 141 * GB, {"bfloat16": 989.4 * TB, "float16": 989.4 * TB,
                                     "float32": 66.9 * TB, "float8_e4m3fn": 1979 * TB},
                  4800 * GB, "NVIDIA H200 datasheet (SXM)", arch="hopper")
# L4: NVIDIA L4 datasheet: BF16/FP16 121 TFLOPS dense (242 with sparsity), FP8 242.5 dense (485 with
# sparsity), FP32 30.3, 24GB GDDR6 300 GB/s, PCIe Gen4 x16 (64 GB/s bidirectional), no NVLink.
L4 = DeviceSpec("l4", 24 * GB, {"bfloat16": 121 * TB, "float16": 121 * TB, "float32": 30.3 * TB,
                                "float8_e4m3fn": 242.5 * TB},
                300 * GB, "NVIDIA L4 datasheet", arch="ada")

# H100 PCIe: NVIDIA H100 datasheet: BF16/FP16 756 TFLOPS dense (1,513 with sparsity), FP8 1,513
# dense (3,026 with sparsity), FP32 51.2, 80GB HBM2e 2 TB/s, PCIe Gen5 x16 (128 GB/s bidirectional);
# NVLink bridge 600 GB/s for pairs.
H100_PCIE = DeviceSpec("h100-pcie", 80 * GB, {"bfloat16": 756 * TB, "float16": 756 * TB,
                                              "float32": 51.2 * TB, "float8_e4m3fn": 1513 * TB},
                       2000 * GB, "NVIDIA H100 datasheet (PCIe)", arch="hopper")
# H100 NVL: NVIDIA H100 datasheet: BF16/FP16 835 TFLOPS dense (1,671 with sparsity), FP8 1,671 dense
# (3,341 with sparsity), FP32 60, 94GB HBM3 3.9 TB/s; sold as NVLink-bridged pairs (600 GB/s), PCIe
# Gen5 between pairs.
H100_NVL = DeviceSpec("h100-nvl", 94 * GB, {"bfloat16": 835 * TB, "float16": 835 * TB,
                                            "float32": 60 * TB, "float8_e4m3fn": 1671 * TB},
                      3900 * GB, "NVIDIA H100 datasheet (NVL)", arch="hopper")
# GH200: NVIDIA GH200 Grace Hopper datasheet: the H100 SXM's compute (BF16 989 dense, FP32 67), 96GB
# HBM3 4 TB/s (the 144GB HBM3e version: 4.9 TB/s; detection replaces the memory with the card's
# own).
GH200 = DeviceSpec("gh200", 96 * GB,
                   {"bfloat16": 989.4 * TB, "float16": 989.4 * TB, "float32": 66.9 * TB,
                    # FP8 1,979 dense, as the H100 SXM
                    "float8_e4m3fn": 1979 * TB},
                   4000 * GB, "NVIDIA GH200 Grace Hopper Superchip datasheet (96GB HBM3)",
                   arch="hopper")
# H20: NVIDIA H20 product brief: BF16/FP16 148 TFLOPS dense (296 with sparsity), FP8 296 dense, FP32
# 44, 96GB HBM3 4.0 TB/s, NVLink 900 GB/s.
H20 = DeviceSpec("h20", 96 * GB, {"bfloat16": 148 * TB, "float16": 148 * TB, "float32": 44 * TB,
                                  "float8_e4m3fn": 296 * TB},
                 4000 * GB, "NVIDIA H20 product brief", arch="hopper")
# V100 SXM2: NVIDIA V100 datasheet: FP16 tensor 125 TFLOPS, FP32 15.7, no bf16 (compute capability
# 7.0), 32GB HBM2 900 GB/s, NVLink 2 300 GB/s total (150 per direction).
V100 = DeviceSpec("v100", 32 * GB, {"float16": 125 * TB, "float32": 15.7 * TB},
                  900 * GB, "NVIDIA V100 datasheet (SXM2 32GB)", arch="volta")
# T4: NVIDIA T4 datasheet: FP16 tensor 65 TFLOPS, FP32 8.1, no bf16 (compute capability 7.5), 16GB
# GDDR6 320 GB/s, PCIe Gen3 x16.
T4 = DeviceSpec("t4", 16 * GB, {"float16": 65 * TB, "float32": 8.1 * TB}, 320 * GB,
                "NVIDIA T4 datasheet", arch="turing")
# A10: NVIDIA A10 datasheet: BF16/FP16 125 TFLOPS dense (250 with sparsity), FP32 31.2, 24GB GDDR6
# 600 GB/s, PCIe 4.
A10 = DeviceSpec("a10", 24 * GB, {"bfloat16": 125 * TB, "float16": 125 * TB, "float32": 31.2 * TB},
                 600 * GB, "NVIDIA A10 datasheet", arch="ampere")
# A10G (AWS G5 only; NVIDIA publishes no datasheet): 24GB GDDR6 600 GB/s, FP32 31.2 TFLOPS; tensor
# BF16/FP16 about 70 TFLOPS dense as commonly quoted (its tensor rate is about half the A10's):
# calibrate with a run.
A10G = DeviceSpec("a10g", 24 * GB, {"bfloat16": 70 * TB, "float16": 70 * TB, "float32": 31.2 * TB},
                  600 * GB, "AWS G5 (A10G): no NVIDIA datasheet; tensor rate as commonly quoted, "
                            "calibrate", arch="ampere")
# L40S: NVIDIA L40S datasheet: BF16/FP16 362 TFLOPS dense (733 with sparsity), FP8 733 dense (1,466
# with sparsity), FP32 91.6, 48GB GDDR6 864 GB/s, PCIe 4.
L40S = DeviceSpec("l40s", 48 * GB, {"bfloat16": 362 * TB, "float16": 362 * TB, "float32": 91.6 * TB,
                                    "float8_e4m3fn": 733 * TB},
                  864 * GB, "NVIDIA L40S datasheet", arch="ada")

# --- Links ----------------------------------------------------------------------------------------
NVLINK3 = LinkSpec(300 * GB, 8e-6, "NVLink 3 (A100): 600 GB/s bidirectional", nccl="nvlink")
NVLINK4 = LinkSpec(450 * GB, 8e-6, "NVLink 4 (H100/H200): 900 GB/s bidirectional", nccl="nvlink")
NVLINK2 = LinkSpec(150 * GB, 8e-6, "NVLink 2 (V100): 300 GB/s bidirectional", nccl="nvlink")
PCIE3 = LinkSpec(16 * GB, 15e-6, "PCIe Gen3 x16: 16 GB/s per direction", nccl="pci")
PCIE4 = LinkSpec(32 * GB, 15e-6, "PCIe Gen4 x16: 32 GB/s per direction", nccl="pci")
PCIE5 = LinkSpec(64 * GB, 15e-6, "PCIe Gen5 x16: 64 GB/s per direction", nccl="pci")
# DGX A100: 8x ConnectX-6 HDR 200 Gb/s (one per GPU) = 25 GB/s per GPU; DGX H100: 8x ConnectX-7 NDR
# 400 Gb/s = 50 GB/s.
IB_HDR = LinkSpec(25 * GB, 15e-6, "InfiniBand HDR 200 Gb/s per GPU (DGX A100)", nccl="net")
IB_NDR = LinkSpec(50 * GB, 15e-6, "InfiniBand NDR 400 Gb/s per GPU (DGX H100)", nccl="net")
ETH_100G = LinkSpec(12.5 * GB, 30e-6, "100 GbE per node", shared=True, nccl="net")
# CPU 'links' are gloo over loopback/shared memory: a few GB/s, ~50 us per message (measured order
# of magnitude).
LOOPBACK = LinkSpec(3 * GB, 50e-6, "gloo over loopback TCP")

# preset name -> (device, intra-node link, inter-node link)
PRESETS: dict[str, tuple[DeviceSpec, LinkSpec, LinkSpec]] = {
    "a100-40gb": (A100_40GB, NVLINK3, IB_HDR),
    "a100-80gb": (A100_80GB, NVLINK3, IB_HDR),
    "h100-80gb": (H100_80GB, NVLINK4, IB_NDR),
    "h200": (H200, NVLINK4, IB_NDR),
    "l4": (L4, PCIE4, ETH_100G),
    "h100-pcie": (H100_PCIE, PCIE5, IB_NDR),
    "h100-nvl": (H100_NVL, PCIE5, IB_NDR),
    "gh200": (GH200, NVLINK4, IB_NDR),
    "h20": (H20, NVLINK4, IB_NDR),
    "v100": (V100, NVLINK2, ETH_100G),
    "t4": (T4, PCIE3, ETH_100G),
    "a10": (A10, PCIE4, ETH_100G),
    "a10g": (A10G, PCIE4, ETH_100G),
    "l40s": (L40S, PCIE4, ETH_100G),
}


def cpu_device(cores: int | None = None, memory_bytes: float | None = None) -> DeviceSpec:
    """A DeviceSpec for this host's CPU: FLOP/s estimated as cores x 2.5 GHz x 32 fp32 FLOP/cycle
    (AVX2: 2 FMA units x 8 lanes x 2), an estimate to be replaced by calibration; memory is the real
    RAM."""
    import psutil

    cores = cores or os.cpu_count() or 1
    memory_bytes = memory_bytes or float(psutil.virtual_memory().total)
    fp32 = cores * 2.5e9 * 32
    return DeviceSpec("cpu", memory_bytes,
                      {"float32": fp32, "bfloat16": fp32 / 2, "float16": fp32 / 4}, 20 * GB,
                      f"estimate for {cores} CPU cores (2.5 GHz, AVX2 FMA); DDR bandwidth ~20 GB/s")


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``gpus_per_node`` identical devices, an intra-node link and an inter-node
    link."""

    device: DeviceSpec
    nodes: int = 1
    gpus_per_node: int = 8
    intra_node: LinkSpec = NVLINK4
    inter_node: LinkSpec = IB_NDR
    name: str = ""
    """the preset this cluster was made from ("h100-80gb", "cpu", ...), "" for a custom one"""
    calibration: dict[str, float] = field(default_factory=dict)
    """measured factors that replace the cost model's defaults (see autopar_nb.cost)"""
    rank_memory: float | None = None
    """bytes each rank may use, set by the user (``memory_gb=``, the magic's ``--memory``); None:
    the device's memory (on the ``cpu`` preset the host's RAM, shared by the node's ranks). A CPU
    launch of a plan made with it enforces it on each rank's RSS above its baseline
    (``autopar_nb.launch.watch``)"""
    host_memory: float | None = None
    """bytes of RAM of each node's host where known (:meth:`detect`: this machine's), which CPU
    offload's host-side states must fit; None: the preset's reference system
    (``cost/offload.py``)"""

    def __post_init__(self):
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(f"a cluster needs nodes >= 1 and gpus_per_node >= 1, got {self.nodes} "
                             f"x {self.gpus_per_node}")
        if self.rank_memory is not None and not self.rank_memory > 0:
            raise ValueError(f"a rank's memory limit must be > 0 bytes, got {self.rank_memory}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def rank_memory_bytes(self) -> float:
        """Bytes one rank may use: the user's limit (``rank_memory``) when set, else the device's
        memory; on the ``cpu`` preset the ranks are processes sharing the host's RAM, so it is
        divided among the node's ranks."""
        if self.rank_memory is not None:
            return float(self.rank_memory)
        mem = self.device.memory_bytes
        return mem / self.gpus_per_node if self.name == "cpu" else mem

    @classmethod
    def preset(cls, name: str, nodes: int = 1, gpus_per_node: int = 8, *,
               memory_gb: float | None = None) -> Cluster:
        """A cluster of a named device: a key of :data:`PRESETS` (a100-40gb, a100-80gb, h100-80gb,
        h200, l4, ...) or cpu. ``memory_gb``: a memory limit per rank in GiB (2**30 bytes;
        ``rank_memory``), e.g. a CPU limit that a launch enforces, or a GPU memory budget below the
        card's.

        >>> Cluster.preset("h100-80gb", nodes=2).world_size
        16
        >>> Cluster.preset("cpu", gpus_per_node=2, memory_gb=3).rank_memory_bytes / 2**30
        3.0
        """
        key = name.lower().replace("_", "-")
        if memory_gb is not None and not (isinstance(memory_gb, (int, float)) and memory_gb > 0):
            raise ValueError(f"memory_gb must be a number of GiB > 0, got {memory_gb!r}")
        limit = None if memory_gb is None else float(memory_gb) * GiB
        if key == "cpu":
            return cls(cpu_device(), nodes, gpus_per_node, LOOPBACK, ETH_100G, "cpu",
                       rank_memory=limit)
        if key not in PRESETS:
            raise ValueError(f"unknown GPU preset {name!r}; choose one of "
                             f"{', '.join([*PRESETS, 'cpu'])}")
        dev, intra, inter = PRESETS[key]
        return cls(dev, nodes, gpus_per_node, intra, inter, key, rank_memory=limit)

    @classmethod
    def detect(cls, env: dict[str, str] | None = None) -> Cluster:
        """This machine as the workers will see it (``env``: their environment, default this
        process's): the GPUs that their ``CUDA_VISIBLE_DEVICES`` leaves visible (indices, UUIDs or
        MIG instances), named and sized by NVML and matched to a preset by name; or the ``cpu``
        preset with the real core count and RAM when there is none. CUDA is never initialised in
        this process (a kernel holding a CUDA context blocks workers on exclusive-process GPUs):
        without NVML a child process asks torch."""
        gpus = visible_gpus(env)
        if not gpus:
            return cls.preset("cpu", gpus_per_node=1)
        import psutil

        return dataclasses.replace(cls.from_gpu(gpus[0], len(gpus)),
                                   host_memory=float(psutil.virtual_memory().total))

    @classmethod
    def from_gpu(cls, gpu: GpuInfo, count: int) -> Cluster:
        """``count`` GPUs like ``gpu``: its preset with the card's own memory, or, for a GPU no
        preset names, a conservative custom device (bf16 only from compute capability 8.0)."""
        preset = _match_preset(gpu.name, gpu.card_memory_bytes or gpu.memory_bytes)
        if preset is None:
            return cls(_guessed_device(gpu), 1, count, PCIE4, ETH_100G, "")
        base = cls.preset(preset, 1, count)
        intra = (PCIE4 if preset.startswith("a100") and "PCIE" in _tokens(gpu.name)
                 else base.intra_node)
        flops = {k: v * gpu.compute_fraction for k, v in base.device.peak_flops.items()}
        device = dataclasses.replace(base.device, memory_bytes=gpu.memory_bytes, peak_flops=flops)
        return dataclasses.replace(base, device=device, intra_node=intra)

    def describe(self) -> str:
        d = self.device
        dtype, peak = max(((k, v) for k, v in d.peak_flops.items() if k != "float8_e4m3fn"),
                          key=lambda kv: kv[1])
        mem = (fmt_bytes(d.memory_bytes) if self.rank_memory is None
               else f"limit {fmt_bytes(self.rank_memory)} per rank")
        return (f"{self.nodes} x {self.gpus_per_node} {d.name} ({mem}, "
                f"{peak / TB:.3g} TFLOP/s {dtype})")


MEMORY_UNITS = {"": GiB, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20,
                "mib": 2**20, "g": GiB, "gb": GiB, "gib": GiB, "t": 2**40, "tb": 2**40,
                "tib": 2**40}
"""memory size suffixes (binary: "3GB" and "3GiB" are both 3 * 2**30 bytes, as torch and nvidia-smi
count); no suffix = GiB"""


def parse_memory(text: str) -> float:
    """``"3GiB"``, ``"512MiB"``, ``"1.5g"``, ``"3"`` (GiB) -> bytes; ValueError naming the accepted
    forms."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in MEMORY_UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"memory size {text!r} not understood: write a number > 0 with an "
                         "optional unit, e.g. 3GiB, 512MiB, 1.5GB (binary units; no unit = GiB)")
    return float(m.group(1)) * MEMORY_UNITS[unit]


def _tokens(name: str) -> list[str]:
    """A device name's words, upper case: "NVIDIA A100-SXM4-80GB" -> ["NVIDIA", "A100", "SXM4",
    "80GB"]."""
    return re.split(r"[\s\-_]+", name.upper())


def _match_preset(name: str, memory_bytes: float) -> str | None:
    """The preset whose datasheet describes the GPU NVML (or torch) calls ``name``; None for one no
    preset names. Variants of one chip differ in speed (H100 SXM 989 vs PCIe 756 TFLOP/s), so they
    are told apart by name."""
    words = set(_tokens(name))
    if "GH200" in words:
        return "gh200"
    if "H200" in words:
        return "h200"
    if "H100" in words:
        return "h100-nvl" if "NVL" in words else "h100-pcie" if "PCIE" in words else "h100-80gb"
    if "A100" in words:
        return "a100-80gb" if memory_bytes > 50 * GB else "a100-40gb"
    for word, preset in (("H20", "h20"), ("L40S", "l40s"), ("A10G", "a10g"), ("A10", "a10"),
                         ("L4", "l4"), ("V100", "v100"), ("T4", "t4")):
        if word in words:
            return preset
    return None


def _guessed_device(gpu: GpuInfo) -> DeviceSpec:
    """A GPU no preset names: slow guesses (below every preset's half-precision rate, so plans err
    on the safe side) that a run's calibration replaces; bf16 only where the compute capability (>=
    8.0) has it."""
    flops = {"float16": 60 * TB, "float32": 8 * TB}
    if gpu.compute_capability is None or gpu.compute_capability >= (8, 0):
        flops["bfloat16"] = 60 * TB
    return DeviceSpec(gpu.name, gpu.memory_bytes, flops, 300 * GB,
                      "unknown GPU: conservative guesses, calibrate with a run")


# --- Which GPUs a process sees --------------------------------------------------------------------


@dataclass(frozen=True)
class GpuInfo:
    """One GPU (or MIG instance) a CUDA process would see, as NVML describes it."""

    name: str
    memory_bytes: float
    compute_capability: tuple[int, int] | None = None
    """(major, minor); None where unknown"""
    nvml_index: int | None = None
    """NVML's index of the physical GPU (for a MIG instance: of its parent); None when found without
    NVML"""
    uuid: str = ""
    """"GPU-..." or, for a MIG instance, "MIG-..." """
    card_memory_bytes: float | None = None
    """for a MIG instance: its whole GPU's memory (which tells the card's variants apart); None
    otherwise"""
    compute_fraction: float = 1.0
    """for a MIG instance: its share of the GPU's compute (its GPU-instance slices of the 7 an
    A100/H100 has)"""


def parse_visible_devices(value: str | None) -> list[str] | None:
    """``CUDA_VISIBLE_DEVICES`` read as CUDA reads it: None when unset (every GPU), else its entries
    up to the first invalid one (CUDA ignores the rest: "0,-1,2" shows GPU 0 only; "" shows none).
    An entry is an index, a "GPU-<uuid>" prefix or a "MIG-<uuid>"."""
    if value is None:
        return None
    out = []
    for entry in value.split(","):
        entry = entry.strip()
        if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
            break
        out.append(entry)
    return out


def visible_gpus(env: dict[str, str] | None = None) -> list[GpuInfo]:
    """The GPUs a CUDA process with environment ``env`` (default: this process's) sees, in CUDA's
    order, without initialising CUDA here: NVML when it works, else a child process running torch
    (only when torch was built with CUDA). An index is taken as NVML's index, which is CUDA's when
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or every GPU is the same model (CUDA's default fastest-first
    order then falls back to PCI bus order)."""
    env = os.environ if env is None else env
    gpus = nvml_visible_gpus(env)
    if gpus is None:
        gpus = _gpus_from_child(env)
    return gpus


def nvml_visible_gpus(env: dict[str, str] | None = None) -> list[GpuInfo] | None:
    """:func:`visible_gpus` by NVML alone (quick: no child process); None when NVML is not usable
    here."""
    env = os.environ if env is None else env
    entries = parse_visible_devices(env.get("CUDA_VISIBLE_DEVICES"))
    if entries == []:
        return []
    return _nvml_gpus(entries)


def _nvml_gpus(entries: list[str] | None) -> list[GpuInfo] | None:
    """The GPUs ``entries`` (parsed ``CUDA_VISIBLE_DEVICES``; None: all) name, by NVML; None when
    NVML is not usable (no library, no driver). NVML is shut down again before returning."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no NVML library or driver
        return None
    try:
        every = [_nvml_gpu(pynvml, pynvml.nvmlDeviceGetHandleByIndex(i), i)
                 for i in range(pynvml.nvmlDeviceGetCount())]
        if entries is None:
            return every
        out = []
        for entry in entries:
            gpu = _nvml_entry(pynvml, entry, every)
            if gpu is None:  # CUDA stops at an entry that names no device
                break
            out.append(gpu)
        return out
    except Exception:  # a driver too old for one of the queries: let torch answer instead
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _nvml_gpu(nv, handle, index: int | None, uuid: str | None = None) -> GpuInfo:
    """A GpuInfo from an NVML device handle."""
    name = nv.nvmlDeviceGetName(handle)
    name = name.decode() if isinstance(name, bytes) else name
    try:
        cc = tuple(nv.nvmlDeviceGetCudaComputeCapability(handle))
    except Exception:
        cc = None
    if uuid is None:
        uuid = nv.nvmlDeviceGetUUID(handle)
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
    return GpuInfo(name, float(nv.nvmlDeviceGetMemoryInfo(handle).total), cc, index, uuid)


def _nvml_entry(nv, entry: str, every: list[GpuInfo]) -> GpuInfo | None:
    """The device one ``CUDA_VISIBLE_DEVICES`` entry names: an NVML index, a unique GPU UUID prefix,
    or a MIG instance (searched on every MIG-enabled GPU)."""
    if entry.isdigit():
        i = int(entry)
        return every[i] if i < len(every) else None
    if entry.startswith("GPU-"):
        found = [g for g in every if g.uuid.startswith(entry)]
        return found[0] if len(found) == 1 else None
    for parent in every:
        handle = nv.nvmlDeviceGetHandleByIndex(parent.nvml_index)
        try:
            slots = nv.nvmlDeviceGetMaxMigDeviceCount(handle)
        except Exception:  # not MIG-capable
            continue
        for k in range(slots):
            try:
                mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, k)
            except Exception:  # an empty slot
                continue
            uuid = nv.nvmlDeviceGetUUID(mig)
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            if uuid == entry:
                gpu = _nvml_gpu(nv, mig, parent.nvml_index, uuid)
                return dataclasses.replace(gpu, name=parent.name,
                                           compute_capability=parent.compute_capability,
                                           card_memory_bytes=parent.memory_bytes,
                                           compute_fraction=_mig_share(nv, mig))
    return None


MIG_COMPUTE_SLICES = 7
"""GPU-instance slices of a whole A100/H100 (NVIDIA MIG user guide: 1g ... 7g profiles)"""


def _mig_share(nv, mig) -> float:
    """A MIG instance's share of its GPU's compute, from NVML's attributes (1.0 when NVML cannot
    say)."""
    try:
        return min(1.0, nv.nvmlDeviceGetAttributes(mig).gpuInstanceSliceCount / MIG_COMPUTE_SLICES)
    except Exception:
        return 1.0


CHILD_PROBE = """\
import json, torch
out = []
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append({"name": p.name, "memory_bytes": p.total_memory, "cc": [p.major, p.minor]})
print(json.dumps(out))
"""
"""what the child process runs: torch's view of the visible GPUs as JSON"""


def _gpus_from_child(env) -> list[GpuInfo]:
    """The visible GPUs as torch sees them in a child process (CUDA initialised there, not here); []
    when torch has no CUDA build or the child fails."""
    try:
        import torch
    except ImportError:
        return []
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return []  # a CPU-only build sees no GPU
    try:
        done = subprocess.run([sys.executable, "-c", CHILD_PROBE], env=dict(env),
                              capture_output=True, text=True, timeout=120)
        found = json.loads(done.stdout.strip().splitlines()[-1])
    except Exception:  # the child crashed, hung or printed nothing useful
        return []
    return [GpuInfo(d["name"], float(d["memory_bytes"]), tuple(d["cc"])) for d in found]
