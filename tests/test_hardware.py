import os

import psutil
import pytest

from autopar_nb.hardware import PRESETS, Cluster


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


def test_detect_falls_back_to_cpu_with_real_cores_and_ram():
    c = Cluster.detect()  # this machine has no GPU
    assert c.name == "cpu"
    assert str(os.cpu_count()) in c.device.source
    assert c.device.memory_bytes == psutil.virtual_memory().total
