"""CPU offload (``mesh.offload = "cpu"``: FSDP2's ``CPUOffloadPolicy``, ``runtime/fsdp.py``) as the
cost model sees it. FSDP2 keeps each rank's parameter shards, gradient shards and optimizer states
in host memory: before each all-gather it copies the shards to the device (host to device), after
each reduce-scatter it copies the gradient shards back (device to host), and the optimizer steps on
the CPU. The device then holds no model state between uses: only the gathered units, the unsharded
gradients before their reduce-scatter, activations and buffers.

Priced here: the host each GPU preset hangs off (:data:`HOSTS`: its RAM per node and each GPU's link
to it), the copies at that link's effective bandwidth, the CPU optimizer step at
:data:`CPU_ADAM_PARAMS_PER_S` shared by the node's ranks, and the host memory the ranks of a node
need together (:func:`host_need`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..hardware import GB
from ..units import fmt_bytes

HOST_LINK_EFFICIENCY = 55.6 / 64
"""share of a PCIe link's nominal per-direction rate a pinned copy reaches: NVIDIA's "NVbandwidth"
post (2025) shows ``host_to_device_memcpy_ce`` at 55.6 GB/s on a PCIe Gen5 x16 link (64 GB/s
nominal; 63 after 128b/130b encoding)"""
PCIE3, PCIE4, PCIE5 = (g * GB * HOST_LINK_EFFICIENCY for g in (16, 32, 64))
"""effective bytes/s per GPU per direction over PCIe Gen3/4/5 x16"""
NVLINK_C2C = 450 * GB * HOST_LINK_EFFICIENCY
"""GH200's NVLink-C2C: 900 GB/s total (450 per direction, NVIDIA GH200 datasheet), at the PCIe
copies' efficiency"""
CPU_ADAM_PARAMS_PER_S = 4.5e9
"""parameters a host's CPUs step with Adam per second, all cores: DeepSpeed's vectorised CPU-Adam
steps 1B parameters in ~0.22 s on a DGX-2 host (Ren et al., "ZeRO-Offload", USENIX ATC 2021, Table
2; PyTorch's for-loop CPU Adam was ~6x slower). The runtime steps offloaded shards with torch's
fused CPU AdamW, of the same kind (vectorised, one pass): measured here 447M parameters/s on one
loaded core, vs 32M for the for-loop Adam"""


@dataclass(frozen=True)
class HostSpec:
    """The host a node's GPUs offload to."""

    memory_bytes: float
    """RAM per node (pinned shards cannot be swapped out)"""
    link: float
    """bytes/s per GPU per direction between its memory and the host's (effective)"""
    source: str = ""


HOSTS = {"h100-80gb": HostSpec(2048 * GB, PCIE5, "NVIDIA DGX H100 datasheet: 2 TB system memory; "
                                                 "PCIe Gen5 x16 per GPU"),
    "h200": HostSpec(2048 * GB, PCIE5,
                     "NVIDIA DGX H200 datasheet: 2 TB system memory; PCIe Gen5 x16 per GPU"),
    "a100-80gb": HostSpec(2048 * GB, PCIE4,
                          "NVIDIA DGX A100 640GB datasheet: 2 TB system memory; PCIe Gen4 x16"),
    "a100-40gb": HostSpec(1024 * GB, PCIE4,
                          "NVIDIA DGX A100 320GB datasheet: 1 TB system memory; PCIe Gen4 x16"),
    "gh200": HostSpec(480 * GB, NVLINK_C2C,
                      "NVIDIA GH200 datasheet: 480 GB LPDDR5X per Grace CPU, NVLink-C2C"),
    "v100": HostSpec(512 * GB, PCIE3,
                     "NVIDIA DGX-1 (V100) datasheet: 512 GB system memory; PCIe Gen3 x16"),
}
"""GPU preset -> its reference system's host; the others: :func:`host_of`'s default"""
PCIE_OF = {"h100-pcie": PCIE5, "h100-nvl": PCIE5, "h20": PCIE5, "t4": PCIE3}
"""the host link of the PCIe cards and of the presets without a reference system listed (others:
PCIe Gen4)"""


def host_of(cluster) -> HostSpec:
    """The host of one node of ``cluster``: the RAM of the machine it was detected on where known
    (``Cluster.host_memory``: a lent or cloud node often has far less than its GPU's reference
    system), else its preset's reference system, else RAM twice the node's GPU memory (AWS
    g5.12xlarge: 192 GiB for 4 x 24 GB A10G); the link: the preset's, else the card's PCIe
    generation. The ``cpu`` preset's device is the host (no copies)."""
    if cluster.name == "cpu":
        return HostSpec(cluster.device.memory_bytes, float("inf"),
                        "the CPU processes' own RAM: nothing is copied")
    if cluster.name in HOSTS:
        host = HOSTS[cluster.name]
    else:
        host = HostSpec(2 * cluster.device.memory_bytes * cluster.gpus_per_node,
                        PCIE_OF.get(cluster.name, PCIE4),
                        "assumed: RAM twice the node's GPU memory, as cloud GPU instances have")
    ram = getattr(cluster, "host_memory", None)
    return host if ram is None else HostSpec(ram, host.link, "this machine's RAM, as detected")


def offload_copy_time(numel: float, *, gathers: int, reduce_scatters: int, p_item: int, g_item: int,
                      host: HostSpec) -> tuple[float, float]:
    """(host-to-device, device-to-host) seconds of one rank's step for ``numel`` parameters of its
    FSDP units: each all-gather first copies the rank's shard in, in the parameters' own dtype
    (``p_item`` bytes; FSDP2 casts to the compute dtype on the device), each reduce-scatter's output
    shard (``g_item``) is copied out."""
    return gathers * numel * p_item / host.link, reduce_scatters * numel * g_item / host.link


def cpu_optimizer_time(local_params: float, cluster) -> float:
    """Seconds of one rank's optimizer step on the host: its ``local_params`` sharded parameters at
    the host's CPU Adam rate shared by the node's ranks (each rank steps its shard at once)."""
    return local_params * cluster.gpus_per_node / CPU_ADAM_PARAMS_PER_S


def host_need(memory_by_rank, cluster) -> float:
    """Bytes of host memory a node's ranks hold together: the largest rank's offloaded states times
    the ranks per node."""
    return max((m.host for m in memory_by_rank), default=0.0) * cluster.gpus_per_node


def host_line(memory_by_rank, cluster) -> str:
    """One clause: the node's host need against its RAM."""
    host = host_of(cluster)
    return (f"{fmt_bytes(host_need(memory_by_rank, cluster))} of the host's "
            f"{fmt_bytes(host.memory_bytes)} per node ({host.source})")
