"""Hardware descriptions: a device spec, the links between devices, and a Cluster of nodes.

Figures are datasheet peaks (dense, no sparsity) in SI units: FLOP/s, bytes, bytes/s (per direction, per GPU),
seconds. The cost model derates them with efficiency factors; measured runs can replace those factors.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

GB = 1e9
GiB = 2**30
TB = 1e12


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or a CPU socket standing in for one)."""

    name: str
    memory_bytes: float
    peak_flops: dict[str, float]
    """dtype name ("bfloat16", "float16", "float32") -> dense peak FLOP/s (tensor cores where they apply)"""
    hbm_bandwidth: float
    """device memory bandwidth, bytes/s"""
    source: str = ""
    """where the figures come from"""

    def flops(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype`` (float32 falls back to the slowest listed)."""
        return self.peak_flops.get(dtype, min(self.peak_flops.values()))


@dataclass(frozen=True)
class LinkSpec:
    """A communication level: per-GPU bandwidth in one direction and the per-message latency (alpha-beta model)."""

    bandwidth: float
    """bytes/s per GPU per direction"""
    latency: float
    """seconds per message"""
    name: str = ""


# --- Devices ---------------------------------------------------------------------------------------------------------
# A100 SXM: NVIDIA A100 Tensor Core GPU datasheet (2021): BF16/FP16 312 TFLOPS dense, TF32 156, FP32 19.5;
# 40GB HBM2 1,555 GB/s; 80GB HBM2e 2,039 GB/s; NVLink 3 600 GB/s total (300 GB/s per direction).
A100_40GB = DeviceSpec("a100-40gb", 40 * GB, {"bfloat16": 312 * TB, "float16": 312 * TB, "float32": 19.5 * TB},
                       1555 * GB, "NVIDIA A100 datasheet (SXM4 40GB)")
A100_80GB = DeviceSpec("a100-80gb", 80 * GB, {"bfloat16": 312 * TB, "float16": 312 * TB, "float32": 19.5 * TB},
                       2039 * GB, "NVIDIA A100 datasheet (SXM4 80GB)")
# H100 SXM5: NVIDIA H100 datasheet: BF16/FP16 989.4 TFLOPS dense (1,979 with sparsity), FP32 66.9, 80GB HBM3
# 3.35 TB/s; NVLink 4 900 GB/s total (450 per direction).
H100_80GB = DeviceSpec("h100-80gb", 80 * GB, {"bfloat16": 989.4 * TB, "float16": 989.4 * TB, "float32": 66.9 * TB},
                       3350 * GB, "NVIDIA H100 datasheet (SXM5)")
# H200 SXM: NVIDIA H200 datasheet: same Hopper compute as H100 SXM, 141GB HBM3e at 4.8 TB/s, NVLink 900 GB/s.
H200 = DeviceSpec("h200", 141 * GB, {"bfloat16": 989.4 * TB, "float16": 989.4 * TB, "float32": 66.9 * TB},
                  4800 * GB, "NVIDIA H200 datasheet (SXM)")
# L4: NVIDIA L4 datasheet: BF16/FP16 121 TFLOPS dense (242 with sparsity), FP32 30.3, 24GB GDDR6 300 GB/s,
# PCIe Gen4 x16 (64 GB/s bidirectional), no NVLink.
L4 = DeviceSpec("l4", 24 * GB, {"bfloat16": 121 * TB, "float16": 121 * TB, "float32": 30.3 * TB},
                300 * GB, "NVIDIA L4 datasheet")

# --- Links -----------------------------------------------------------------------------------------------------------
# Latencies: NCCL ring/tree base latency per step, order of magnitude from the NCCL tuning model (~5-10 us intra-node
# NVLink, ~10-20 us over InfiniBand).
NVLINK3 = LinkSpec(300 * GB, 8e-6, "NVLink 3 (A100): 600 GB/s bidirectional")
NVLINK4 = LinkSpec(450 * GB, 8e-6, "NVLink 4 (H100/H200): 900 GB/s bidirectional")
PCIE4 = LinkSpec(32 * GB, 15e-6, "PCIe Gen4 x16: 32 GB/s per direction")
# DGX A100: 8x ConnectX-6 HDR 200 Gb/s (one per GPU) = 25 GB/s per GPU; DGX H100: 8x ConnectX-7 NDR 400 Gb/s = 50 GB/s.
IB_HDR = LinkSpec(25 * GB, 15e-6, "InfiniBand HDR 200 Gb/s per GPU (DGX A100)")
IB_NDR = LinkSpec(50 * GB, 15e-6, "InfiniBand NDR 400 Gb/s per GPU (DGX H100)")
ETH_100G = LinkSpec(12.5 * GB, 30e-6, "100 GbE per node")
# CPU 'links' are gloo over loopback/shared memory: a few GB/s, ~50 us per message (measured order of magnitude).
LOOPBACK = LinkSpec(3 * GB, 50e-6, "gloo over loopback TCP")

# preset name -> (device, intra-node link, inter-node link)
PRESETS: dict[str, tuple[DeviceSpec, LinkSpec, LinkSpec]] = {
    "a100-40gb": (A100_40GB, NVLINK3, IB_HDR),
    "a100-80gb": (A100_80GB, NVLINK3, IB_HDR),
    "h100-80gb": (H100_80GB, NVLINK4, IB_NDR),
    "h200": (H200, NVLINK4, IB_NDR),
    "l4": (L4, PCIE4, ETH_100G),
}


def cpu_device(cores: int | None = None, memory_bytes: float | None = None) -> DeviceSpec:
    """A DeviceSpec for this host's CPU: FLOP/s estimated as cores x 2.5 GHz x 32 fp32 FLOP/cycle (AVX2: 2 FMA
    units x 8 lanes x 2), an estimate to be replaced by calibration; memory is the real RAM."""
    import psutil

    cores = cores or os.cpu_count() or 1
    memory_bytes = memory_bytes or float(psutil.virtual_memory().total)
    fp32 = cores * 2.5e9 * 32
    return DeviceSpec("cpu", memory_bytes, {"float32": fp32, "bfloat16": fp32 / 2, "float16": fp32 / 4},
                      20 * GB, f"estimate for {cores} CPU cores (2.5 GHz, AVX2 FMA); DDR bandwidth ~20 GB/s")


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``gpus_per_node`` identical devices, an intra-node link and an inter-node link."""

    device: DeviceSpec
    nodes: int = 1
    gpus_per_node: int = 8
    intra_node: LinkSpec = NVLINK4
    inter_node: LinkSpec = IB_NDR
    name: str = ""
    """the preset this cluster was made from ("h100-80gb", "cpu", ...), "" for a custom one"""
    calibration: dict[str, float] = field(default_factory=dict)
    """measured factors that replace the cost model's defaults (see autopar_nb.cost)"""

    def __post_init__(self):
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(f"a cluster needs nodes >= 1 and gpus_per_node >= 1, got {self.nodes} x "
                             f"{self.gpus_per_node}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @classmethod
    def preset(cls, name: str, nodes: int = 1, gpus_per_node: int = 8) -> Cluster:
        """A cluster of a named device: one of a100-40gb, a100-80gb, h100-80gb, h200, l4, cpu.

        >>> Cluster.preset("h100-80gb", nodes=2).world_size
        16
        """
        key = name.lower().replace("_", "-")
        if key == "cpu":
            return cls(cpu_device(), nodes, gpus_per_node, LOOPBACK, ETH_100G, "cpu")
        if key not in PRESETS:
            raise ValueError(f"unknown GPU preset {name!r}; choose one of {', '.join([*PRESETS, 'cpu'])}")
        dev, intra, inter = PRESETS[key]
        return cls(dev, nodes, gpus_per_node, intra, inter, key)

    @classmethod
    def detect(cls) -> Cluster:
        """This machine: its CUDA GPUs (named via NVML when available, matched to a preset by name and memory),
        or the ``cpu`` preset with the real core count and RAM when there is no GPU."""
        import torch

        if not torch.cuda.is_available():
            return cls.preset("cpu", gpus_per_node=1)
        n = torch.cuda.device_count()
        props = torch.cuda.get_device_properties(0)
        name, mem = props.name, float(props.total_memory)
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            mem = float(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
        except Exception:  # NVML missing or not permitted: torch's figures are enough
            pass
        preset = _match_preset(name, mem)
        if preset is None:
            dev = DeviceSpec(name, mem, {"bfloat16": 100 * TB, "float16": 100 * TB, "float32": 20 * TB},
                             1000 * GB, "unknown GPU: conservative guesses, calibrate with a run")
            return cls(dev, 1, n, PCIE4, ETH_100G, "")
        base = cls.preset(preset, 1, n)
        return dataclasses.replace(base, device=dataclasses.replace(base.device, memory_bytes=mem))

    def describe(self) -> str:
        d = self.device
        dtype, peak = max(d.peak_flops.items(), key=lambda kv: kv[1])
        return (f"{self.nodes} x {self.gpus_per_node} {d.name} ({d.memory_bytes / GiB:.0f} GiB, "
                f"{peak / TB:.3g} TFLOP/s {dtype})")


def _match_preset(name: str, memory_bytes: float) -> str | None:
    n = name.upper()
    if "H200" in n:
        return "h200"
    if "H100" in n:
        return "h100-80gb"
    if "A100" in n:
        return "a100-80gb" if memory_bytes > 50 * GB else "a100-40gb"
    if "L4" in n.split():
        return "l4"
    return None
