"""GEMM time by shape (cost/efficiency.py): tile and wave quantisation after NVIDIA's Matrix Multiplication
Background User's Guide, and the memory bound of skinny GEMMs."""

from __future__ import annotations

import pytest
import torch

import autopar_nb as ap
from autopar_nb.cost import factors_for, profile
from autopar_nb.cost.efficiency import Gemm, gemm_penalty, utilisation

H100 = dict(device="h100-80gb", rate=989.4e12 * 0.571, hbm=3.35e12 * 0.612, itemsize=2)


def test_large_square_gemms_keep_the_constant_efficiency():
    """As the tiles outnumber the SMs the utilisation tends to 1: a 16384-cube GEMM on 132 SMs loses under 1 %, so
    for the large GEMMs the efficiency factors were measured on the model is the constant efficiency's."""
    assert utilisation(1, 16384, 16384, 132) > 0.99
    g = Gemm(1, 16384, 16384, 16384, True, "")
    fwd, bwd = gemm_penalty((g,), scale=1.0, tp=1, **H100)
    ideal = 2 * 16384**3 / H100["rate"]
    assert 0 <= fwd < 0.01 * ideal and 0 <= bwd < 0.02 * ideal


def test_wave_quantisation_by_sm_count():
    """The guide's ch. 3.2: 133 tiles of 64 x 64 on 132 SMs run in two waves, the second nearly empty (no other tile
    of the list does better); 132 tiles in one."""
    assert utilisation(1, 128 * 12, 128 * 11, 132) == pytest.approx(1.0)
    assert utilisation(1, 64, 64 * 133, 132) < 0.55
    assert utilisation(1, 64, 64 * 133, 108) > utilisation(1, 64, 64 * 133, 132)  # 2 waves of 108 are fuller


def test_small_and_skinny_gemms_cost_more_than_their_flops():
    """A 32-token micro-batch through a 1024-wide Linear fills 16 of 132 SMs; a K of 16 makes a GEMM memory-bound:
    both take many times their FLOPs at the constant efficiency."""
    for g in (Gemm(1, 32, 1024, 1024, True, ""), Gemm(1, 8192, 8192, 16, True, "")):
        fwd, _ = gemm_penalty((g,), scale=1.0, tp=1, **H100)
        assert fwd > 3 * 2 * g.m * g.n * g.k / H100["rate"]


def test_tensor_parallel_shards_quantise_on_their_own_shape():
    """A colwise shard divides n, a rowwise one k: at tp=8 a 4096-wide projection of 512 tokens is 512 columns per
    rank, 16 tiles on 132 SMs, so the sharded GEMM runs below the constant efficiency where the whole one did not."""
    col = Gemm(1, 512, 4096, 4096, True, "n")
    whole = gemm_penalty((col,), scale=1.0, tp=1, **H100)[0] / (2 * 512 * 4096 * 4096 / H100["rate"])
    shard = gemm_penalty((col,), scale=1.0, tp=8, **H100)[0] / (2 * 512 * 512 * 4096 / H100["rate"])
    assert shard > whole + 0.5
    assert gemm_penalty((col,), scale=1.0, tp=1, **{**H100, "device": "cpu"}) == (0.0, 0.0)  # no SM count


def test_profile_records_each_matmul_shape():
    """The profile keeps each Linear's (m, n, k): the tokens, its outputs and inputs."""
    with torch.device("meta"):
        graph = ap.capture(torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 64)),
                           torch.randn(48, 256))
    prof = profile(graph)
    gemms = [g for lp in prof.layers for g in lp.gemms]
    assert [(g.batch, g.m, g.n, g.k, g.weight) for g in gemms] == [(1, 48, 1024, 256, True), (1, 48, 64, 1024, True)]
    c = ap.Cluster.preset("h100-80gb", gpus_per_node=1)
    assert factors_for(c).eff_matmul > 0
