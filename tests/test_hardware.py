import os
import sys
import types

import psutil
import pytest
import torch

from autopar_nb.hardware import GB, PCIE4, PRESETS, Cluster

H100_TORCH_BYTES = 85_017_755_648
"""what torch reports for an H100 80GB HBM3 (total_memory: without the driver's reserve)"""
H100_NVML_BYTES = 85_520_809_984
"""what NVML reports for the same card"""


def simulate_host(monkeypatch, gpus: int, name: str = "NVIDIA H100 80GB HBM3", memory: float = H100_TORCH_BYTES,
                  *, nvml_memory: float | None = None) -> None:
    """Make this process see ``gpus`` CUDA devices called ``name`` (0: a CPU-only host), whatever the machine has:
    torch.cuda's probes answer for them, and NVML too when ``nvml_memory`` is given (else ``import pynvml`` fails,
    as on a host without the NVIDIA driver's library)."""
    def properties(index=0):
        if not 0 <= int(index) < gpus:
            raise AssertionError(f"Invalid device id {index}")
        return types.SimpleNamespace(name=name, total_memory=int(memory))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    if nvml_memory is None or not gpus:
        monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
        return
    nvml = types.ModuleType("pynvml")
    nvml.nvmlInit = nvml.nvmlShutdown = lambda: None
    nvml.nvmlDeviceGetCount = lambda: gpus
    nvml.nvmlDeviceGetHandleByIndex = properties
    nvml.nvmlDeviceGetName = lambda handle: name.encode()  # older pynvml returns bytes
    nvml.nvmlDeviceGetMemoryInfo = lambda handle: types.SimpleNamespace(total=int(nvml_memory), free=0, used=0)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)


@pytest.mark.parametrize("name", [*PRESETS, "cpu"])
def test_presets_have_real_figures(name):
    c = Cluster.preset(name, nodes=2, gpus_per_node=4)
    assert c.world_size == 8 and c.name == name
    d = c.device
    assert d.memory_bytes > 1e9 and d.hbm_bandwidth > 1e9 and d.source
    assert d.flops("float32") > 0
    if name != "cpu":  # tensor cores: half precision is the fast path (on a CPU it is the slow one)
        assert d.flops("bfloat16") > d.flops("float32")
    assert c.intra_node.bandwidth > 0 and c.inter_node.latency > 0


def test_datasheet_values():
    h100 = Cluster.preset("h100-80gb").device
    assert h100.flops("bfloat16") == pytest.approx(989.4e12)
    assert h100.hbm_bandwidth == pytest.approx(3.35e12)
    assert Cluster.preset("a100-40gb").device.memory_bytes == 40e9
    assert Cluster.preset("h200").device.memory_bytes == 141e9
    assert Cluster.preset("l4").intra_node.bandwidth < Cluster.preset("h100-80gb").intra_node.bandwidth


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match="h100-80gb"):
        Cluster.preset("v100")


def test_detect_falls_back_to_cpu_with_real_cores_and_ram(monkeypatch):
    simulate_host(monkeypatch, gpus=0)
    c = Cluster.detect()
    assert (c.name, c.nodes, c.gpus_per_node) == ("cpu", 1, 1)
    assert str(os.cpu_count()) in c.device.source
    assert c.device.memory_bytes == psutil.virtual_memory().total


@pytest.mark.parametrize("name, memory, nvml_memory, preset", [
    ("NVIDIA H100 80GB HBM3", H100_TORCH_BYTES, H100_NVML_BYTES, "h100-80gb"),
    ("NVIDIA H100 80GB HBM3", H100_TORCH_BYTES, None, "h100-80gb"),  # no NVML: torch's figures
    ("NVIDIA H200", 150_110_011_392, 150_754_820_096, "h200"),
    ("NVIDIA A100-SXM4-40GB", 42_298_834_944, None, "a100-40gb"),
    ("NVIDIA A100-SXM4-80GB", 85_100_068_864, None, "a100-80gb"),
    ("NVIDIA L4", 23_580_639_232, 24_152_899_584, "l4"),
])
def test_detect_names_the_gpus_of_this_host(monkeypatch, name, memory, nvml_memory, preset):
    simulate_host(monkeypatch, gpus=4, name=name, memory=memory, nvml_memory=nvml_memory)
    c = Cluster.detect()
    assert (c.name, c.nodes, c.gpus_per_node) == (preset, 1, 4)
    datasheet = Cluster.preset(preset)
    assert c.device.memory_bytes == (nvml_memory or memory), "the card's own memory, not the datasheet's"
    assert c.device.peak_flops == datasheet.device.peak_flops and c.intra_node == datasheet.intra_node


def test_detect_unknown_gpu_is_a_conservative_custom_device(monkeypatch):
    simulate_host(monkeypatch, gpus=2, name="NVIDIA RTX 6000 Ada Generation", memory=51_010_060_288,
                  nvml_memory=51_527_024_640)
    c = Cluster.detect()
    assert (c.name, c.gpus_per_node, c.device.name) == ("", 2, "NVIDIA RTX 6000 Ada Generation")
    assert c.device.memory_bytes == 51_527_024_640 and c.intra_node == PCIE4
    slowest = min(Cluster.preset(p).device.flops("bfloat16") for p in PRESETS)
    assert "calibrate" in c.device.source and c.device.flops("bfloat16") <= slowest, "guesses err on the slow side"


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
