"""kernels_ext's fused kernels against the unfused ops, fp32 and bf16: values, gradients, the rules they register,
and that they are seen as one op by meta-device capture and FX."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels_ext
from kernels_ext.fused import accumulate_mm, default_chunk

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def lce_case(dtype, n=37, h=16, v=101, ignore=5):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(dtype).requires_grad_()
    target = torch.randint(0, v, (n,), generator=g)
    target[:ignore] = -100
    return hidden, weight, target


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction, chunk", [("mean", 8), ("sum", 5), ("mean", None), ("mean", 1000)])
def test_linear_cross_entropy_matches_unfused(dtype, reduction, chunk):
    hidden, weight, target = lce_case(dtype)
    fused = kernels_ext.linear_cross_entropy(hidden, weight, target, reduction=reduction, chunk=chunk)
    gh, gw = torch.autograd.grad(fused * 3.0, (hidden, weight))
    # the unfused reference in fp32 from the same (rounded) inputs: bf16 is checked against exact arithmetic
    h32, w32 = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    ref = F.cross_entropy(h32 @ w32.t(), target, reduction=reduction)
    rh, rw = torch.autograd.grad(ref * 3.0, (h32, w32))
    assert fused.dtype == torch.float32 and gh.dtype == gw.dtype == dtype
    torch.testing.assert_close(fused, ref, **TOL[dtype])
    torch.testing.assert_close(gh.float(), rh, **TOL[dtype])
    torch.testing.assert_close(gw.float(), rw, **TOL[dtype])


def test_linear_cross_entropy_takes_batch_dims_and_refuses_other_reductions():
    hidden, weight, target = lce_case(torch.float32, n=24)
    a = kernels_ext.linear_cross_entropy(hidden.reshape(2, 12, -1), weight, target.reshape(2, 12))
    torch.testing.assert_close(a, kernels_ext.linear_cross_entropy(hidden, weight, target))
    with pytest.raises(ValueError, match="'mean' or 'sum'"):
        kernels_ext.linear_cross_entropy(hidden, weight, target, reduction="none")
    with pytest.raises(ImportError, match="pip install liger-kernel"):
        kernels_ext.linear_cross_entropy(hidden, weight, target, use_liger=True)


def test_default_chunk_keeps_a_chunks_logits_near_the_hidden_size():
    n, h, v = 2048, 4096, 128_256
    assert default_chunk(n, h, v) == 256  # 33 by hidden size alone: too few for the weight-gradient matmul
    assert default_chunk(16_384, 4096, 32_000) == 2048  # a chunk's logits the size of the hidden states
    assert default_chunk(8, 64, 32) == 8  # fewer tokens than a chunk: one chunk


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_unfused(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, 32, generator=g).to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(32, generator=g)).to(dtype).requires_grad_()
    y = kernels_ext.rms_norm(x, w, 1e-6)
    up = torch.randn(y.shape, generator=g).to(dtype)
    gx, gw = torch.autograd.grad((y * up).sum(), (x, w))
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = F.rms_norm(x32, (32,), w32, 1e-6)
    rx, rw = torch.autograd.grad((ref * up.float()).sum(), (x32, w32))
    assert y.dtype == gx.dtype == gw.dtype == dtype
    torch.testing.assert_close(y.float(), ref, **TOL[dtype])
    torch.testing.assert_close(gx.float(), rx, **TOL[dtype])
    torch.testing.assert_close(gw.float(), rw, **TOL[dtype] if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2))
    m = kernels_ext.RMSNorm(32)
    assert set(m.state_dict()) == set(torch.nn.RMSNorm(32).state_dict())


def test_rules_are_registered_like_any_op():
    lce = kernels_ext.lookup("kernels_ext.linear_cross_entropy.default")
    H = kernels_ext.TensorMeta
    args = (H((2048, 4096), "bfloat16", 2), H((128_256, 4096), "bfloat16", 2), H((2048,), "int64", 8), -100, 64)
    assert lce.op_class == "matmul" and lce.forward_flops(args, {}, []) == 2 * 2048 * 4096 * 128_256
    assert lce.backward_factor == 3.0 and lce.tp_role == "reduction"
    assert lce.saves == ("input", "stats") and lce.stats([(2048, 4096)], []) == 2048
    norm = kernels_ext.lookup("kernels_ext.rms_norm.default")
    assert norm.tp_role == "norm" and "sequence_parallel" in norm.splits and norm.saves == ("input", "stats")


def test_capture_sees_one_op_each():
    """On the meta device (the fake implementations) the planner's capture records the custom ops by name."""
    import autopar_nb as ap

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = kernels_ext.RMSNorm(64)
            self.out = torch.nn.Linear(64, 1000, bias=False)

        def forward(self, x):
            return kernels_ext.linear_cross_entropy(self.norm(x), self.out.weight, x[..., 0].long().abs())

    with torch.device("meta"):
        model = Head()
    graph = ap.capture(model, torch.randn(4, 16, 64, device="meta"))
    ops = {n.op: n.op_class for n in graph.nodes}
    assert ops["kernels_ext.rms_norm.default"] == "norm"
    assert ops["kernels_ext.linear_cross_entropy.default"] == "matmul" and not graph.unknown_ops


def _vocab_parallel_rank(rank: int, world: int, init: str, dtype, errors) -> None:
    """One rank of :func:`test_vocab_parallel_linear_cross_entropy_matches_unfused`: its rows of the weight."""
    import math

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        hidden, weight, target = lce_case(dtype)
        rows = math.ceil(weight.shape[0] / world)  # DTensor's Shard(0) cut: 51 + 50 rows of 101
        start = rank * rows
        local = weight.detach()[start:start + rows].clone().requires_grad_()
        loss = kernels_ext.vocab_parallel_linear_cross_entropy(hidden, local, target, start=start,
                                                               vocab=weight.shape[0], chunk=8)
        gh, gw = torch.autograd.grad(loss, (hidden, local))
        ref = F.cross_entropy((hidden.float() @ weight.float().t()), target)
        rh, rw = torch.autograd.grad(ref, (hidden, weight))
        tol = TOL[dtype]
        torch.testing.assert_close(loss.float(), ref, **tol)
        torch.testing.assert_close(gh.float(), rh.float(), **tol)
        torch.testing.assert_close(gw.float(), rw[start:start + rows].float(), **tol)
    except Exception as e:  # reported to the parent, which fails the test
        errors.put(f"rank {rank}: {e!r}")
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocab_parallel_linear_cross_entropy_matches_unfused(dtype, tmp_path):
    """Two gloo processes, each with half the vocabulary's rows (uneven: 101 words), 5 ignored targets: the loss and
    the hidden states' gradient equal the unfused loss's on every rank, the weight gradient is the rank's rows'."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")  # a fork after torch started its thread pools can hang
    errors = ctx.Queue()
    init = f"file://{tmp_path / 'store'}"
    procs = [ctx.Process(target=_vocab_parallel_rank, args=(r, 2, init, dtype, errors)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    found = [errors.get() for _ in range(errors.qsize())] if not errors.empty() else []
    assert not found and all(p.exitcode == 0 for p in procs), found


def test_accumulate_mm_sums_16_bit_products_in_float32():
    """The fused loss's weight gradient over chunks (on CPU on float32 copies; on CUDA addmm with a float32 output,
    measured in bench/fused_kernels.py --cuda)."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(6, 5, generator=g).bfloat16() for _ in range(2))
    acc = torch.ones(5, 5)
    accumulate_mm(acc, a.t(), b)
    assert acc.dtype == torch.float32
    torch.testing.assert_close(acc, 1 + a.float().t() @ b.float())
