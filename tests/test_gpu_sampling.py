"""The GPU side of launching, against a stand-in for nvidia-ml-py (no GPU here): which GPU each rank's figures come
from (the workers' CUDA_VISIBLE_DEVICES — indices, UUIDs, MIG instances — not the kernel's), what a rank's own process
holds, and the kernel-holds-the-GPU guard when NVML lists other PIDs than ours (containers)."""

import types

import psutil
import pytest
import torch
from test_hardware import fake_nvml

from autopar_nb.launch import launcher as launcher_mod
from autopar_nb.launch.launcher import LaunchError
from autopar_nb.launch.monitor import DeviceSampler

GIB = 2.0**30
H200 = ("NVIDIA H200", 141 * GIB, (9, 0))


def sampling_nvml(devices, *, migs=None, procs=None):
    """fake_nvml plus what sampling reads: utilisation (87 + NVML index; MIG instances have none), power,
    temperature, handles by UUID, and per-device process lists ``procs`` (NVML index -> [(pid, bytes)])."""
    nv = fake_nvml(devices, migs=migs)
    procs = procs or {}
    every = {nv.nvmlDeviceGetUUID(("gpu", i)): ("gpu", i) for i in range(len(devices))}
    for i, instances in (migs or {}).items():
        every.update({uuid: ("mig", i, k) for k, (uuid, _) in enumerate(instances)})

    def utilisation(h):
        if h[0] == "mig":
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return types.SimpleNamespace(gpu=87 + h[1])

    nv.NVML_TEMPERATURE_GPU = 0
    nv.NVML_COMPUTEMODE_DEFAULT, nv.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS, nv.NVML_COMPUTEMODE_PROHIBITED = 0, 1, 2
    nv.nvmlDeviceGetUtilizationRates = utilisation
    nv.nvmlDeviceGetPowerUsage = lambda h: 500_000 + 1000 * h[1]
    nv.nvmlDeviceGetTemperature = lambda h, kind: 60
    nv.nvmlDeviceGetHandleByUUID = lambda uuid: every[uuid]
    nv.nvmlDeviceGetComputeMode = lambda h: 0
    nv.nvmlDeviceGetComputeRunningProcesses = lambda h: [
        types.SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in procs.get(h[1], [])]
    return nv


def test_ranks_are_sampled_on_the_gpus_the_workers_see(monkeypatch):
    """The kernel sees GPU 0; the workers were given GPUs 2 and 3 by UUID: rank k's figures are the k-th of those."""
    monkeypatch.setitem(__import__("sys").modules, "pynvml", sampling_nvml([H200] * 4))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    sampler = DeviceSampler(use_gpu=True, env={"CUDA_VISIBLE_DEVICES": "GPU-00000002,GPU-00000003"})
    me = psutil.Process()
    out = sampler.sample({0: me, 1: me})
    assert (out[0]["gpu_util"], out[1]["gpu_util"]) == (87 + 2, 87 + 3)
    assert out[1]["power_w"] == 503.0 and out[0]["gpu_mem_total"] == 141 * GIB and sampler.gpu_name == "NVIDIA H200"
    assert "gpu_proc_mem" not in out[0], "NVML does not list this PID: no per-process figure is made up"
    assert out[0]["rss"] > 0 and "cpu_percent" in out[0]
    by_index = DeviceSampler(use_gpu=True, env={"CUDA_VISIBLE_DEVICES": "3,2"}).sample({0: me, 1: me})
    assert (by_index[0]["gpu_util"], by_index[1]["gpu_util"]) == (87 + 3, 87 + 2)


def test_a_mig_instance_gives_what_it_has_and_a_ranks_own_process_memory_is_found_by_pid(monkeypatch):
    mig = "MIG-11111111-2222-3333-4444-555555555555"
    me = psutil.Process()
    nv = sampling_nvml([H200] * 2, migs={1: [(mig, 18 * GIB)]}, procs={1: [(me.pid, 3 * GIB), (1, 9 * GIB)]})
    monkeypatch.setitem(__import__("sys").modules, "pynvml", nv)
    sampler = DeviceSampler(use_gpu=True, env={"CUDA_VISIBLE_DEVICES": f"0,{mig}"})
    out = sampler.sample({0: me, 1: me})
    assert out[0]["gpu_util"] == 87 and "gpu_proc_mem" not in out[0]
    assert "gpu_util" not in out[1], "a MIG instance has no utilisation of its own"
    assert out[1]["gpu_mem_total"] == 18 * GIB and out[1]["temperature_c"] == 60  # the rest is still read
    nv.nvmlDeviceGetComputeRunningProcesses = lambda h: [types.SimpleNamespace(pid=me.pid, usedGpuMemory=3 * GIB)]
    assert sampler.sample({1: me})[1]["gpu_proc_mem"] == 3 * GIB


def simulate_kernel_cuda(monkeypatch, reserved_by_device: dict[int, float]):
    """CUDA initialised in this process, with the caching allocator holding ``reserved_by_device`` (torch's device
    index in this process -> bytes)."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(reserved_by_device))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved_by_device[int(device)])


def test_the_guard_finds_what_the_kernel_holds_when_nvml_lists_host_pids(monkeypatch):
    """In a container NVML lists the kernel under its host PID, never os.getpid(): the kernel's own allocator
    figures, matched to the workers' GPUs by UUID, still show that it holds most of the workers' second GPU."""
    monkeypatch.setitem(__import__("sys").modules, "pynvml", sampling_nvml(
        [H200] * 2, procs={1: [(424242, 101 * GIB)]}))  # the kernel, under a PID we cannot know
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # the kernel's device 0 is NVML's GPU 1
    simulate_kernel_cuda(monkeypatch, {0: 100 * GIB})
    workers = {"CUDA_VISIBLE_DEVICES": "0,1"}
    launcher_mod.check_cuda(1, "nccl", workers)  # rank 0 uses GPU 0: the kernel holds nothing there
    with pytest.raises(LaunchError, match=r"holds most of the memory of GPU 1 \(100 GiB of 141 GiB\)"):
        launcher_mod.check_cuda(2, "nccl", workers)
    monkeypatch.setitem(__import__("sys").modules, "pynvml", sampling_nvml([H200] * 2))
    assert launcher_mod._gpu_count({"CUDA_VISIBLE_DEVICES": "GPU-00000001"}) == 1
    assert launcher_mod._gpu_count({"CUDA_VISIBLE_DEVICES": ""}) == 0
    assert launcher_mod._gpu_count({}) == 2
