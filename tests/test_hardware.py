import json
import os
import subprocess
import sys
import types

import psutil
import pytest
import torch

from autopar_nb import hardware
from autopar_nb.hardware import GB, PCIE4, PRESETS, Cluster, parse_memory, parse_visible_devices

H100_TORCH_BYTES = 85_017_755_648
"""what torch reports for an H100 80GB HBM3 (total_memory: without the driver's reserve)"""
H100_NVML_BYTES = 85_520_809_984
"""what NVML reports for the same card"""


def simulate_host(monkeypatch, gpus: int, name: str = "NVIDIA H100 80GB HBM3", memory: float = H100_TORCH_BYTES,
                  *, nvml_memory: float | None = None, cc: tuple[int, int] = (9, 0)) -> list[str]:
    """Make this process see ``gpus`` CUDA devices called ``name`` (0: a CPU-only host), whatever the machine has:
    torch.cuda's probes answer for them, and NVML too when ``nvml_memory`` is given (else ``import pynvml`` fails,
    as on a host without the NVIDIA driver's library, and the child process detection starts answers as torch
    would). Returns the log of CUDA-initialising calls made in this process (detection must make none)."""
    cuda_calls: list[str] = []
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # conftest hides real GPUs; this host shows its own

    def properties(index=0):
        cuda_calls.append(f"get_device_properties({index})")
        if not 0 <= int(index) < gpus:
            raise AssertionError(f"Invalid device id {index}")
        return types.SimpleNamespace(name=name, total_memory=int(memory), major=cc[0], minor=cc[1])

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    child = [hardware.GpuInfo(name, float(memory), cc) for _ in range(gpus)]
    monkeypatch.setattr(hardware, "_gpus_from_child", lambda env: list(child))
    if nvml_memory is None or not gpus:
        monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
        return cuda_calls
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([(name, nvml_memory, cc)] * gpus))
    return cuda_calls


def fake_nvml(devices: list[tuple[str, float, tuple[int, int]]], *,
              migs: dict[int, list[tuple[str, float]]] | None = None) -> types.ModuleType:
    """A stand-in for pynvml over ``devices`` ((name, memory, compute capability) by NVML index; UUIDs
    "GPU-0000000i-...") and ``migs`` (NVML index -> its MIG instances' (uuid, memory)). ``calls`` counts
    nvmlInit/nvmlShutdown."""
    migs = migs or {}
    nvml = types.ModuleType("pynvml")
    nvml.calls = {"init": 0, "shutdown": 0}
    nvml.nvmlInit = lambda: nvml.calls.__setitem__("init", nvml.calls["init"] + 1)
    nvml.nvmlShutdown = lambda: nvml.calls.__setitem__("shutdown", nvml.calls["shutdown"] + 1)
    nvml.nvmlDeviceGetCount = lambda: len(devices)

    def handle(i):
        if not 0 <= int(i) < len(devices):
            raise RuntimeError("NVML_ERROR_INVALID_ARGUMENT")
        return ("gpu", int(i))

    def mig_handle(h, k):
        if h[1] not in migs or k >= len(migs[h[1]]):
            raise RuntimeError("NVML_ERROR_NOT_FOUND")
        return ("mig", h[1], k)

    def max_migs(h):
        if h[1] not in migs:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return 7

    def memory(h):
        total = devices[h[1]][1] if h[0] == "gpu" else migs[h[1]][h[2]][1]
        return types.SimpleNamespace(total=int(total), free=0, used=0)

    nvml.nvmlDeviceGetHandleByIndex = handle
    nvml.nvmlDeviceGetName = lambda h: devices[h[1]][0].encode()  # older pynvml returns bytes
    nvml.nvmlDeviceGetMemoryInfo = memory
    nvml.nvmlDeviceGetCudaComputeCapability = lambda h: devices[h[1]][2]
    nvml.nvmlDeviceGetUUID = lambda h: f"GPU-{h[1]:08d}-aaaa-bbbb" if h[0] == "gpu" else migs[h[1]][h[2]][0]
    nvml.nvmlDeviceGetMaxMigDeviceCount = max_migs
    nvml.nvmlDeviceGetMigDeviceHandleByIndex = mig_handle
    nvml.nvmlDeviceGetAttributes = lambda h: types.SimpleNamespace(
        gpuInstanceSliceCount=round(7 * migs[h[1]][h[2]][1] / devices[h[1]][1]))  # slices in proportion to memory
    return nvml


@pytest.mark.parametrize("name", [*PRESETS, "cpu"])
def test_presets_have_real_figures(name):
    c = Cluster.preset(name, nodes=2, gpus_per_node=4)
    assert c.world_size == 8 and c.name == name
    d = c.device
    assert d.memory_bytes > 1e9 and d.hbm_bandwidth > 1e9 and d.source
    assert d.flops("float32") > 0
    if name != "cpu":  # tensor cores: half precision is the fast path (on a CPU it is the slow one)
        assert d.flops("float16") > d.flops("float32")
        assert d.supports("bfloat16") == (name not in ("v100", "t4")), "bf16 from compute capability 8.0 only"
        if d.supports("bfloat16"):
            assert d.flops("bfloat16") > d.flops("float32")
    assert c.intra_node.bandwidth > 0 and c.inter_node.latency > 0


def test_datasheet_values():
    h100 = Cluster.preset("h100-80gb").device
    assert h100.flops("bfloat16") == pytest.approx(989.4e12)
    assert h100.hbm_bandwidth == pytest.approx(3.35e12)
    assert Cluster.preset("a100-40gb").device.memory_bytes == 40e9
    assert Cluster.preset("h200").device.memory_bytes == 141e9
    assert Cluster.preset("l4").intra_node.bandwidth < Cluster.preset("h100-80gb").intra_node.bandwidth


def test_a_memory_limit_per_rank_replaces_the_shared_ram():
    """``memory_gb`` (issue 14, point 5): a per-rank limit, not the host's RAM divided among the ranks."""
    shared = Cluster.preset("cpu", gpus_per_node=2)
    assert shared.rank_memory_bytes == shared.device.memory_bytes / 2
    limited = Cluster.preset("cpu", gpus_per_node=2, memory_gb=3)
    assert limited.rank_memory_bytes == 3 * 2**30 and limited.rank_memory == 3 * 2**30
    assert Cluster.preset("h100-80gb", memory_gb=40).rank_memory_bytes == 40 * 2**30
    with pytest.raises(ValueError, match="memory_gb must be a number of GiB > 0"):
        Cluster.preset("cpu", memory_gb=0)
    assert [parse_memory(t) for t in ("3GiB", "3gb", "512MiB", "1.5", "64k")] == \
        [3 * 2**30, 3 * 2**30, 2**29, 1.5 * 2**30, 2**16]
    with pytest.raises(ValueError, match="3GiB, 512MiB"):
        parse_memory("3 apples")


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match="h100-80gb"):
        Cluster.preset("p100")


def test_detect_falls_back_to_cpu_with_real_cores_and_ram(monkeypatch):
    simulate_host(monkeypatch, gpus=0)
    c = Cluster.detect()
    assert (c.name, c.nodes, c.gpus_per_node) == ("cpu", 1, 1)
    assert str(os.cpu_count()) in c.device.source
    assert c.device.memory_bytes == psutil.virtual_memory().total


@pytest.mark.parametrize("name, memory, nvml_memory, preset", [
    ("NVIDIA H100 80GB HBM3", H100_TORCH_BYTES, H100_NVML_BYTES, "h100-80gb"),
    ("NVIDIA H100 80GB HBM3", H100_TORCH_BYTES, None, "h100-80gb"),  # no NVML: a child process's torch figures
    ("NVIDIA H200", 150_110_011_392, 150_754_820_096, "h200"),
    ("NVIDIA A100-SXM4-40GB", 42_298_834_944, None, "a100-40gb"),
    ("NVIDIA A100-SXM4-80GB", 85_100_068_864, None, "a100-80gb"),
    ("NVIDIA L4", 23_580_639_232, 24_152_899_584, "l4"),
    ("NVIDIA H100 PCIe", 85_029_158_912, 85_520_809_984, "h100-pcie"),
    ("NVIDIA H100 NVL", 99_921_690_624, 100_485_038_080, "h100-nvl"),
    ("NVIDIA GH200 480GB", 101_468_602_368, 102_005_473_280, "gh200"),
    ("NVIDIA H20", 102_005_473_280, 102_005_473_280, "h20"),
    ("Tesla V100-SXM2-32GB", 34_089_730_048, 34_359_738_368, "v100"),
    ("Tesla T4", 15_835_660_288, 16_106_127_360, "t4"),
    ("NVIDIA A10", 23_835_181_056, 24_146_608_128, "a10"),
    ("NVIDIA A10G", 23_835_181_056, 24_146_608_128, "a10g"),
    ("NVIDIA L40S", 47_697_362_944, 48_305_799_168, "l40s"),
])
def test_detect_names_the_gpus_of_this_host(monkeypatch, name, memory, nvml_memory, preset):
    cuda_calls = simulate_host(monkeypatch, gpus=4, name=name, memory=memory, nvml_memory=nvml_memory)
    c = Cluster.detect()
    assert (c.name, c.nodes, c.gpus_per_node) == (preset, 1, 4)
    datasheet = Cluster.preset(preset)
    assert c.device.memory_bytes == (nvml_memory or memory), "the card's own memory, not the datasheet's"
    assert c.device.peak_flops == datasheet.device.peak_flops and c.intra_node == datasheet.intra_node
    assert cuda_calls == [], "detection must not initialise CUDA in the kernel"
    assert c.host_memory == psutil.virtual_memory().total, "CPU offload is checked against this machine's RAM"
    assert datasheet.host_memory is None


def test_pcie_a100_gets_a_pcie_link(monkeypatch):
    simulate_host(monkeypatch, gpus=2, name="NVIDIA A100 80GB PCIe", memory=85_100_068_864,
                  nvml_memory=85_899_345_920)
    c = Cluster.detect()
    assert c.name == "a100-80gb" and c.intra_node == PCIE4


def test_detect_unknown_gpu_is_a_conservative_custom_device(monkeypatch):
    simulate_host(monkeypatch, gpus=2, name="NVIDIA RTX 6000 Ada Generation", memory=51_010_060_288,
                  nvml_memory=51_527_024_640, cc=(8, 9))
    c = Cluster.detect()
    assert (c.name, c.gpus_per_node, c.device.name) == ("", 2, "NVIDIA RTX 6000 Ada Generation")
    assert c.device.memory_bytes == 51_527_024_640 and c.intra_node == PCIE4
    assert "calibrate" in c.device.source and c.device.supports("bfloat16")
    for dtype in ("bfloat16", "float16"):
        devices = [dev for dev, _, _ in PRESETS.values() if dev.supports(dtype)]
        slowest = min(dev.flops(dtype) for dev in devices)
        assert c.device.flops(dtype) <= slowest, "guesses err on the slow side"


def test_unknown_pre_ampere_gpu_has_no_bf16(monkeypatch):
    simulate_host(monkeypatch, gpus=1, name="Quadro RTX 8000", memory=50e9, nvml_memory=51e9, cc=(7, 5))
    d = Cluster.detect().device
    assert not d.supports("bfloat16") and d.supports("float16")


@pytest.mark.parametrize("value, entries", [
    (None, None), ("", []), ("1,0", ["1", "0"]), (" 2 , 3", ["2", "3"]), ("0,-1,2", ["0"]), ("-1", []),
    ("GPU-8a1b,MIG-5c6d", ["GPU-8a1b", "MIG-5c6d"]), ("0,bogus,1", ["0"]),
])
def test_cuda_visible_devices_is_read_as_cuda_reads_it(value, entries):
    assert parse_visible_devices(value) == entries


MIXED = [("NVIDIA A100-SXM4-80GB", 85e9, (8, 0)), ("NVIDIA L4", 24e9, (8, 9)), ("Tesla T4", 16e9, (7, 5)),
         ("NVIDIA A100-SXM4-80GB", 85e9, (8, 0))]


@pytest.mark.parametrize("visible, names", [
    (None, ["NVIDIA A100-SXM4-80GB", "NVIDIA L4", "Tesla T4", "NVIDIA A100-SXM4-80GB"]),
    ("2,1", ["Tesla T4", "NVIDIA L4"]),
    ("GPU-00000001", ["NVIDIA L4"]),  # a UUID prefix, as CUDA accepts
    ("3,7,0", ["NVIDIA A100-SXM4-80GB"]),  # CUDA stops at the first device that does not exist
    ("GPU-0000", []),  # an ambiguous prefix names no device
])
def test_visible_gpus_follow_the_workers_environment(monkeypatch, visible, names):
    nvml = fake_nvml(MIXED)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # the kernel's own setting: not the workers'
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert [g.name for g in hardware.visible_gpus(env)] == names
    assert nvml.calls["init"] == nvml.calls["shutdown"] == 1, "every nvmlInit has its nvmlShutdown"
    c = Cluster.detect(env)
    assert c.gpus_per_node == max(len(names), 1) and c.name == {"Tesla T4": "t4", "NVIDIA L4": "l4"}.get(
        names[0] if names else "", "a100-80gb" if names else "cpu")


def test_mig_instance_is_sized_as_the_instance(monkeypatch):
    nvml = fake_nvml(MIXED[:1], migs={0: [("MIG-1111", 10.7e9), ("MIG-2222", 21.5e9)]})
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    (gpu,) = hardware.visible_gpus({"CUDA_VISIBLE_DEVICES": "MIG-2222"})
    assert (gpu.uuid, gpu.memory_bytes, gpu.nvml_index, gpu.compute_capability) == ("MIG-2222", 21.5e9, 0, (8, 0))
    c = Cluster.detect({"CUDA_VISIBLE_DEVICES": "MIG-2222"})
    assert (c.name, c.gpus_per_node, c.device.memory_bytes) == ("a100-80gb", 1, 21.5e9), "the card's variant"
    assert c.device.flops("bfloat16") == pytest.approx(2 / 7 * 312e12), "a 2g instance: 2 of 7 compute slices"


def test_detection_without_nvml_asks_a_child_process(monkeypatch):
    """No NVML: the child process's probe, really run. On a CPU-only torch build no child is needed ([])."""
    monkeypatch.setitem(sys.modules, "pynvml", None)
    gpus = hardware.visible_gpus({})
    if torch.version.cuda is None:
        assert gpus == []
    out = subprocess.run([sys.executable, "-c", hardware.CHILD_PROBE], capture_output=True, text=True, timeout=120)
    found = json.loads(out.stdout)
    assert len(found) == (torch.cuda.device_count() if torch.version.cuda else 0)
    assert not torch.cuda.is_initialized(), "the probe ran in the child, not here"


def test_detect_matches_what_this_host_reports():
    """No simulation: the cluster detected here is the machine torch sees (CPU-only in CI, GPUs elsewhere)."""
    c = Cluster.detect()
    if not torch.cuda.is_available():
        assert (c.name, c.world_size) == ("cpu", 1)
        return
    props = torch.cuda.get_device_properties(0)
    assert c.name != "cpu" and (c.nodes, c.gpus_per_node) == (1, torch.cuda.device_count())
    # NVML's total includes the memory the driver reserves, torch's does not: a few percent apart at most
    assert props.total_memory <= c.device.memory_bytes <= 1.05 * props.total_memory + GB
