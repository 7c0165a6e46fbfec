import ast
import pathlib

import pytest

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
    assert kernels_ext.lookup("aten.never_heard_of.default") is None


def test_kernels_ext_never_imports_autopar_nb():
    for path in pathlib.Path(kernels_ext.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.startswith("autopar_nb") for n in names), path
