import ast
import math
import pathlib

import pytest
import torch

import kernels_ext
from kernels_ext import OpRule, TensorMeta


def T(*shape):
    return TensorMeta(tuple(shape), "float32", 4)


def test_linear_flops_and_splits():
    rule = kernels_ext.lookup("aten.linear.default")
    assert rule.forward_flops((T(4, 16, 32), T(64, 32), T(64)), {}, [T(4, 16, 64)]) == 2 * 4 * 16 * 32 * 64
    assert rule.backward_factor == 2.0
    assert rule.splits["rowwise"].forward == "all_reduce"
    assert rule.splits["colwise"].forward is None and rule.splits["colwise"].backward == "all_reduce"
    # addmm(bias, x, w) with w stored (in, out), as Hugging Face's Conv1D runs: the same splits, weight dims swapped
    addmm = kernels_ext.lookup("aten.addmm.default")
    assert addmm.splits["colwise"].param_dims == {0: 0, 2: 1} and addmm.splits["rowwise"].param_dims == {2: 0}
    assert addmm.splits["colwise"].backward == addmm.splits["rowwise"].forward == "all_reduce"


def test_conv_and_attention_formulas():
    conv = kernels_ext.lookup("aten.conv2d.default")
    out = T(2, 8, 10, 10)
    assert conv.forward_flops((T(2, 3, 10, 10), T(8, 3, 3, 3)), {}, [out]) == 2 * out.numel * 3 * 9
    sdpa = kernels_ext.lookup("aten.scaled_dot_product_attention.default")
    q = T(2, 4, 16, 8)
    assert sdpa.forward_flops((q, q, q), {}, [q]) == 2 * 2 * 4 * 16 * 16 * (8 + 8)


@pytest.mark.parametrize("equation, shapes", [
    ("btd,de->bte", [(2, 8, 16), (16, 32)]),
    ("bhqd,bhkd->bhqk", [(2, 4, 8, 16), (2, 4, 8, 16)]),
    ("...ij,...jk", [(2, 3, 4, 5), (3, 5, 6)]),  # broadcast dims, implicit output
    ("ij,jk,kl->il", [(3, 4), (4, 5), (5, 6)]),  # contracted pairwise, left to right
    ("bn,anm,bm->ba", [(2, 3), (4, 3, 5), (2, 5)]),
    ("ij,ij->", [(3, 4), (3, 4)]),
    ("i,j->ij", [(3,), (4,)]),  # an outer product: torch multiplies, no matmul FLOPs
    ("ii->i", [(3, 3)]),
])
def test_einsum_flops_match_torch_flop_counter(equation, shapes):
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    tensors = [torch.randn(s) for s in shapes]
    with FlopCounterMode(display=False) as counter:
        out = torch.einsum(equation, *tensors)
    rule = kernels_ext.lookup("aten.einsum.default")
    assert rule.forward_flops((equation, [T(*s) for s in shapes]), {}, [T(*out.shape)]) == counter.get_total_flops()


def test_flops_are_torch_flop_counter_formulas():
    import torch
    from torch.utils.flop_counter import flop_registry

    from kernels_ext import torch_flops

    aten = torch.ops.aten
    # ops torch counts: its own formula, called as FlopCounterMode calls it (shapes in, out_val the output shape)
    a, b = T(8, 16), T(16, 4)
    assert kernels_ext.lookup("aten.mm.default").forward_flops((a, b), {}, [T(8, 4)]) == \
        flop_registry[aten.mm]((8, 16), (16, 4), out_val=(8, 4))
    q, kv = T(2, 8, 16, 32), T(2, 2, 16, 32)  # grouped-query attention: 8 query heads, 2 key/value heads
    flash = kernels_ext.lookup("aten._scaled_dot_product_flash_attention.default")
    want = flop_registry[aten._scaled_dot_product_flash_attention](q.shape, kv.shape, kv.shape, out_val=q.shape)
    assert flash.forward_flops((q, kv, kv, 0.0, True), {}, [q]) == want == 2 * 2 * 8 * 16 * 16 * (32 + 32)
    # composite ops torch counts after decomposing them: the formula of the op they run as
    sdpa = kernels_ext.lookup("aten.scaled_dot_product_attention.default")
    assert sdpa.forward_flops((q, kv, kv), {"enable_gqa": True}, [q]) == want
    assert sdpa.forward_flops((T(16, 16, 32),) * 3, {}, [T(16, 16, 32)]) == 2 * 16 * 16 * 16 * (32 + 32)  # 3-d
    matmul = kernels_ext.lookup("aten.matmul.default")
    assert matmul.forward_flops((T(4, 1, 8, 16), T(3, 16, 5)), {}, [T(4, 3, 8, 5)]) == 2 * 4 * 3 * 8 * 16 * 5
    assert matmul.forward_flops((T(16), T(16, 5)), {}, [T(5)]) == 2 * 16 * 5
    with pytest.raises(ValueError, match="no FLOP formula for aten.relu"):
        torch_flops("aten.relu")((T(4),), {}, [T(4)])


def test_custom_op_takes_torch_flop_formula():
    import torch
    import torch.nn as nn
    from torch.utils.flop_counter import register_flop_formula

    import autopar_nb as ap
    from kernels_ext import torch_flops

    @torch.library.custom_op("autopar_test::fused_mm", mutates_args=())
    def fused_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x @ w

    @fused_mm.register_fake
    def _(x, w):
        return x.new_empty(x.shape[0], w.shape[1])

    @register_flop_formula(torch.ops.autopar_test.fused_mm)
    def _(x_shape, w_shape, *, out_shape=None, **kwargs):
        return 3 * x_shape[0] * x_shape[1] * out_shape[1]  # a made-up count: it must reach the graph as is

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 4))

        def forward(self, x):
            return fused_mm(x, self.w)

    kernels_ext.register_op(OpRule("autopar_test.fused_mm", "matmul", torch_flops("autopar_test.fused_mm"), 2.0))
    with torch.device("meta"):
        net = Net()
    g = ap.capture(net, torch.randn(2, 8))
    node = next(n for n in g.nodes if n.op.startswith("autopar_test.fused_mm"))
    assert node.flops == 3 * 2 * 8 * 4 and node.bwd_flops == 2 * node.flops


def test_views_move_no_data():
    rule = kernels_ext.lookup("aten.view.default")
    assert rule.bytes_moved((T(4, 4), [16]), {}, [T(16)]) == (0, 0)
    add = kernels_ext.lookup("aten.add.Tensor")
    assert add.bytes_moved((T(4, 4), T(4, 4)), {}, [T(4, 4)]) == (128, 64)


def test_register_glob_and_duplicates():
    kernels_ext.register_op(OpRule("mylib_test.fused_*", "matmul", lambda a, k, o: 7, 2.0))
    assert kernels_ext.lookup("mylib_test.fused_mlp.default").forward_flops((), {}, []) == 7
    with pytest.raises(ValueError, match="already has a rule"):
        kernels_ext.register_op(OpRule("aten.linear", "matmul"))
    with pytest.raises(ValueError, match="op_class"):
        OpRule("x", "magic")
    with pytest.raises(ValueError, match="saves token 'weights' unknown"):
        OpRule("x", "norm", saves=("weights",))
    with pytest.raises(ValueError, match="must be a tuple"):
        OpRule("x", "norm", saves="input")
    with pytest.raises(ValueError, match="needs stats="):
        OpRule("x", "norm", saves=("input", "stats"))
    with pytest.raises(ValueError, match="tp_role 'layernorm' unknown"):
        OpRule("x", "norm", tp_role="layernorm")
    assert OpRule("x", "elementwise", saves=["mask@cuda", "temp@cpu"]).saves_on("cpu") == ("temp",)
    assert kernels_ext.lookup("aten.never_heard_of.default") is None


def test_kernels_ext_never_imports_autopar_nb():
    for path in pathlib.Path(kernels_ext.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.startswith("autopar_nb") for n in names), path


def test_registered_custom_op_rule_decides_what_is_saved_and_how_tp_treats_it():
    import torch
    import torch.nn as nn

    import autopar_nb as ap
    from autopar_nb.cost.profile import profile

    @torch.library.custom_op("autopar_test::row_norm", mutates_args=())
    def row_norm(x: torch.Tensor) -> torch.Tensor:
        return x / x.norm(dim=-1, keepdim=True)

    @row_norm.register_fake
    def _(x):
        return torch.empty_like(x)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

        def forward(self, x):
            return self.down(row_norm(self.up(x)))

    with torch.device("meta"):
        model = Block()
    B, T = 4, 8

    def profiled():
        prof = profile(ap.capture(model, torch.randn(B, T, 16)), device_kind="cuda")
        styles = {m: st for lp in prof.layers for m, st in lp.tp.items()}
        return styles, sum(s.nbytes for lp in prof.layers for s in lp.saved)

    flops = lambda args, kwargs, outs: 3 * outs[0].numel
    kernels_ext.register_op(OpRule("autopar_test.row_norm", "norm", flops, 2.0), replace=True)
    styles, saved = profiled()
    # a rule that says nothing else: the op keeps nothing, and a TP shard passes through it (Megatron's MLP pair)
    assert styles == {"up": "colwise", "down": "rowwise"}

    kernels_ext.register_op(OpRule("autopar_test.row_norm", "norm", flops, 2.0, saves=("input", "stats"),
                                   stats=lambda ins, outs: math.prod(outs[0][:-1]), tp_role="norm"), replace=True)
    styles_known, saved_known = profiled()
    # it normalises over the feature dim: a shard must not reach it, so neither Linear is split
    assert styles_known == {}
    # it keeps its input (the up-projection's output, fp32) and one fp32 statistic per row
    assert saved_known - saved == B * T * 64 * 4 + B * T * 4


@pytest.mark.parametrize("kind,key", [("cpu", "AutocastCPU"), ("cuda", "AutocastCUDA")])
def test_autocast_lists_are_the_dispatchers(kind, key):
    """Every ATen op with an autocast kernel for this device has exactly one policy in kernels_ext.autocast, and
    nothing else has one (a torch upgrade that changes autocast's lists fails here)."""
    from kernels_ext import autocast as ac

    registered = {n.removeprefix("aten::") for n in torch._C._dispatch_get_all_op_names()
                  if n.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(n, key)}
    tables = [t[kind] for t in (ac.LOWER, ac.FP32, ac.FP32_OPT_DTYPE, ac.PROMOTE, ac.BANNED)]
    assert sum(len(t) for t in tables) == len(set().union(*tables)), "an op in two lists"
    assert set().union(*tables) == registered


def test_autocast_policies_as_cpu_autocast_runs_them():
    """One op of each CPU policy, run under CPU autocast: the output dtype the policy says; unlisted ops (norms,
    softmax) follow their input."""
    from kernels_ext.autocast import autocast_policy

    f32, b16 = torch.randn(4, 4), torch.randn(4, 4, dtype=torch.bfloat16)
    cases = [("aten.mm.default", lambda: torch.mm(f32, f32), torch.bfloat16),
             ("aten.linear.default", lambda: torch.nn.functional.linear(f32, f32), torch.bfloat16),
             ("aten.mse_loss.default", lambda: torch.nn.functional.mse_loss(b16, b16), torch.float32),
             ("aten.cat.default", lambda: torch.cat([f32, b16]), torch.float32),
             ("aten.layer_norm.default", lambda: torch.nn.functional.layer_norm(b16, (4,), f32[0], f32[0]),
              torch.bfloat16),
             ("aten.softmax.int", lambda: torch.softmax(b16, -1), torch.bfloat16)]
    want_policy = {torch.bfloat16: ("lower", ""), torch.float32: ("fp32", "promote")}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for op, run, dtype in cases:
            assert run().dtype == dtype, op
            assert autocast_policy(op, "cpu") in want_policy[dtype], op
    assert autocast_policy("aten.softmax.int", "cuda") == "fp32_opt"
    assert autocast_policy("aten.layer_norm.default", "cuda") == "fp32"
    assert autocast_policy("aten.add.Tensor", "cuda") == ""
