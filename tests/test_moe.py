"""Mixture of Experts: the zoo's DeepSeekMoE-style model and the kernels_ext rules that cost experts by active
parameters."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import kernels_ext
from autopar_nb.capture import capture
from autopar_nb.zoo import DEEPSEEK_MOE_16B, MIXTRAL_8X7B, MoEConfig, MoETransformer, grouped_linear
from kernels_ext import TensorMeta

TINY = MoEConfig(vocab_size=128, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64, n_dense_layers=1,
                 n_routed_experts=4, n_shared_experts=1, top_k=2, moe_ffn_dim=16)


def has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


needs_transformers = pytest.mark.skipif(not has_transformers(), reason="transformers is not installed")


def T(*shape):
    return TensorMeta(tuple(shape), "float32", 4)


def _capture(model, inputs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph = capture(model, inputs)
    return graph, [str(w.message) for w in caught]


def _fwd_bwd(nodes) -> float:
    return sum(n.flops + n.bwd_flops for n in nodes)


# ---- the zoo model --------------------------------------------------------------------------------------------------
def test_grouped_experts_equal_a_per_token_loop():
    torch.manual_seed(0)
    moe = MoETransformer(TINY).layers[1].feed_forward
    h = torch.randn(10, TINY.dim)
    weights, index = moe.gate(h)
    ref = torch.zeros_like(h)
    for t in range(10):
        for k in range(TINY.top_k):
            e = index[t, k]
            gate, up = (moe.experts.gate_up_proj[e] @ h[t]).chunk(2)
            ref[t] += weights[t, k] * (moe.experts.down_proj[e] @ (F.silu(gate) * up))
    torch.testing.assert_close(moe.experts(h, index, weights), ref, rtol=1e-5, atol=1e-6)
    # the custom op's backward (a second custom op) against finite differences, with an empty group in the middle
    x = torch.randn(6, 8, dtype=torch.double, requires_grad=True)
    w = torch.randn(3, 4, 8, dtype=torch.double, requires_grad=True)
    offs = torch.tensor([2, 2, 6], dtype=torch.int32)
    assert torch.autograd.gradcheck(lambda a, b: grouped_linear(a, b, offs), (x, w))


def test_moe_configs_are_the_published_sizes():
    with torch.device("meta"):
        ds = MoETransformer(DEEPSEEK_MOE_16B)
        mx = MoETransformer(MIXTRAL_8X7B)
    # deepseek-moe-16b: 16.4B parameters; Mixtral-8x7B: 46.7B, exactly transformers' MixtralForCausalLM count
    assert sum(p.numel() for p in ds.parameters()) == pytest.approx(16.38e9, rel=0.005)
    assert sum(p.numel() for p in mx.parameters()) == 46_702_792_704
    assert type(ds.layers[0].feed_forward).__name__ == "LlamaFeedForward"  # first_k_dense_replace = 1
    assert ds.layers[1].feed_forward.experts.gate_up_proj.shape == (64, 2 * 1408, 2048)
    assert ds.layers[1].feed_forward.shared_experts.w1.weight.shape == (2 * 1408, 2048)


# ---- cost: experts by active parameters ---------------------------------------------------------------------------
def test_grouped_mm_rules():
    gmm = kernels_ext.lookup("aten._grouped_mm.default")
    assert gmm.op_class == "matmul" and gmm.backward_factor == 2.0
    # 2D x 3D: 40 token-expert pairs (S) of width 16 times one (16, 24) expert each, whatever the number of experts
    assert gmm.forward_flops((T(40, 16), T(8, 16, 24), T(8)), {}, [T(40, 24)]) == 2 * 40 * 16 * 24
    assert gmm.forward_flops((T(8, 5, 16), T(8, 16, 24)), {}, [T(8, 5, 24)]) == 2 * 8 * 5 * 16 * 24  # 3D x 3D
    # 2D x 2D (weight gradient): K = 40 jagged over 8 groups, each group contracts only its own rows
    assert gmm.forward_flops((T(16, 40), T(40, 24), T(8)), {}, [T(8, 16, 24)]) == 2 * 16 * 24 * 40
    fallback = kernels_ext.lookup("transformers.grouped_mm_fallback.default")
    assert fallback.forward_flops((T(40, 16), T(8, 16, 24), T(8)), {}, [T(40, 24)]) == 2 * 40 * 16 * 24
    zoo = kernels_ext.lookup("autopar_zoo.grouped_linear.default")
    assert zoo.forward_flops((T(40, 16), T(8, 24, 16), T(8)), {}, [T(40, 24)]) == 2 * 40 * 16 * 24
    for op in ("aten.topk.default", "aten.sort.default", "aten.histc.default", "aten.argsort.stable"):
        assert kernels_ext.lookup(op) is not None, op


def test_zoo_moe_capture_counts_active_experts():
    with torch.device("meta"):
        model = MoETransformer(TINY)
    graph, caught = _capture(model, (torch.randint(0, TINY.vocab_size, (2, 16)),))
    assert graph.unknown_ops == [] and not [w for w in caught if "kernels_ext" in w], caught
    experts = [n for n in graph.nodes if n.module_path.endswith(".experts") and n.op_class == "matmul"]
    assert {n.op for n in experts} == {"autopar_zoo.grouped_linear.default"}
    pairs = 2 * 16 * TINY.top_k  # tokens x k
    active = 3 * TINY.dim * TINY.moe_ffn_dim  # one expert's SwiGLU
    moe_layers = TINY.n_layers - TINY.n_dense_layers
    assert sum(n.flops for n in experts) == moe_layers * 2 * pairs * active


@needs_transformers
@pytest.mark.parametrize("impl, dtype, op", [
    ("grouped_mm", torch.float32, "transformers.grouped_mm_fallback.default"),  # the default config, fp32
    ("grouped_mm", torch.bfloat16, "aten._grouped_mm.default"),
    ("batched_mm", torch.float32, "aten.bmm.default"),
])
def test_mixtral_experts_costed_by_active_parameters(impl, dtype, op):
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    cfg._experts_implementation = impl
    with torch.device("meta"):
        model = MixtralForCausalLM(cfg).to(dtype)
    graph, caught = _capture(model, (torch.randint(0, 256, (1, 32)),))
    assert not [w for w in caught if "kernels_ext" in w], caught
    experts = [n for n in graph.nodes if n.module_path.endswith(".experts") and n.op_class == "matmul"]
    assert {n.op for n in experts} == {op}
    active = 3 * cfg.hidden_size * cfg.intermediate_size
    assert sum(n.flops for n in experts) == cfg.num_hidden_layers * 2 * (32 * 2) * active


@needs_transformers
def test_mixtral_8x7b_flops_match_6_active_params_tokens():
    """Mixtral-8x7B (transformers' MixtralConfig defaults), seq 4096, batch 1: forward + backward FLOPs of the
    captured graph against 6 x active parameters x tokens + attention's 12 x layers x seq^2 x dim. 4 of the 32
    layers are captured (identical layers: the per-layer figure is exact) and the rest extrapolated."""
    from transformers import MixtralConfig, MixtralForCausalLM

    full = MixtralConfig()
    n_layers, seq = full.num_hidden_layers, 4096
    with torch.device("meta"):
        model = MixtralForCausalLM(MixtralConfig(num_hidden_layers=4))
    graph, caught = _capture(model, (torch.randint(0, full.vocab_size, (1, seq)),))
    assert not [w for w in caught if "kernels_ext" in w], caught
    in_layers = [n for n in graph.nodes if ".layers." in n.module_path]
    per_layer = _fwd_bwd(in_layers) / 4
    predicted = _fwd_bwd(graph.nodes) - _fwd_bwd(in_layers) + n_layers * per_layer

    d, ffn = full.hidden_size, full.intermediate_size
    kv = full.num_key_value_heads * (full.head_dim or d // full.num_attention_heads)
    attention = d * d + 2 * d * kv + d * d  # q, k, v, o
    experts = full.num_experts_per_tok * 3 * d * ffn  # top_k SwiGLU experts per token, not all 8
    router = full.num_local_experts * d
    active = n_layers * (attention + experts + router) + full.vocab_size * d  # + the head; embeddings do no matmul
    assert active == pytest.approx(12.75e9, rel=0.01)  # Mixtral's 12.9B active includes the 0.13B embedding
    six_nt = 6 * active * seq
    attention_quadratic = 12 * n_layers * seq * seq * d  # QK^T and PV, forward 4*T^2*d per layer, x3 with backward
    ratio = predicted / (six_nt + attention_quadratic)
    print(f"\nMixtral-8x7B seq {seq}: predicted {predicted:.4e} FLOPs, 6NT {six_nt:.4e} + attention "
          f"{attention_quadratic:.4e} = {six_nt + attention_quadratic:.4e}: ratio {ratio:.4f}")
    assert ratio == pytest.approx(1.0, abs=0.15)
    # and the experts are the bulk of it (costed at 0 before the grouped-matmul rules: the ratio was ~0.2)
    experts_flops = _fwd_bwd(n for n in in_layers if n.module_path.endswith(".experts")) / 4 * n_layers
    assert experts_flops == pytest.approx(6 * n_layers * experts * seq, rel=0.01)
