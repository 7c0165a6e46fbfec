import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

import autopar_nb as ap
from autopar_nb.zoo import GPT, GPTConfig, RecSys, ResNet, SeedMLP


def _meta(build):
    with torch.device("meta"):
        return build()


def _linear_weights(model: nn.Module) -> int:
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def test_seed_mlp_flops_are_2mnk_and_backward_twice():
    model = _meta(SeedMLP)
    g = ap.capture(model, torch.randn(32, 1024))
    matmul = sum(n.flops for n in g.nodes if n.op_class == "matmul")
    assert matmul == 2 * 32 * 1024 * 1024 + 2 * 32 * 1024 * 512
    assert sum(n.bwd_flops for n in g.nodes if n.op_class == "matmul") == 2 * matmul
    assert g.num_params == 1024 * 1024 + 1024 + 1024 * 512 + 512
    assert [lay.path for lay in g.layers] == ["linear1", "linear2"]
    assert g.layer("linear1").num_params == 1024 * 1024 + 1024
    assert not g.blocks
    assert g.tracer == "torch.export"


def test_capture_allocates_nothing_on_meta():
    model = _meta(SeedMLP)
    g = ap.capture(model, torch.randn(32, 1024))  # real input is moved to meta
    assert all(p.is_meta for p in model.parameters())
    assert g.inputs[0].shape == (32, 1024)


def test_gpt_flops_match_closed_form_and_blocks_fold():
    cfg = GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024)
    B, T, L, d = 2, 256, cfg.n_layer, cfg.n_embd
    model = _meta(lambda: GPT(cfg))
    g = ap.capture(model, torch.randint(0, cfg.vocab_size, (B, T)))
    tokens = B * T
    n_lin = _linear_weights(model)
    # forward: 2 FLOPs per Linear weight per token, attention QK^T + PV = 4*T*d per token per layer
    matmul = sum(n.flops for n in g.nodes if n.op_class == "matmul")
    attn = sum(n.flops for n in g.nodes if n.op_class == "attention")
    assert matmul == 2 * n_lin * tokens
    assert attn == 4 * L * T * d * tokens
    # fwd+bwd against the standard 6N + 12 L T d per token (Kaplan et al.); ours counts attention backward as 2.5x
    # (5 matmuls vs 2, as torch.utils.flop_counter does) and elementwise ops, so it sits slightly above
    standard = (6 * n_lin + 12 * L * T * d) * tokens
    assert standard <= g.step_flops <= 1.02 * standard
    assert len(g.blocks) == 1 and g.blocks[0].name == "h" and g.blocks[0].count == 12
    assert [lay.path for lay in g.layers][:3] == ["wte", "wpe", "h.0"]
    assert g.layer("h.3").block == "h" and g.layer("h.3").index == 3
    folded = g.folded_layers()
    assert ("h.0", 12) in [(lay.path, n) for lay, n in folded]
    assert len(folded) == len(g.layers) - 11
    assert g.seq_len == T
    # every op knows its module path and layer; TP can see the block's Linear modules
    assert all(n.layer for n in g.nodes)
    assert g.layer("h.0").modules["h.0.attn.c_attn"] == "Linear"
    assert any(n.params == ["h.0.mlp.c_fc.weight", "h.0.mlp.c_fc.bias"] for n in g.nodes)


def test_forward_flops_equal_torch_flop_counter():
    for build, inputs in ((SeedMLP, (torch.randn(8, 1024),)), (ResNet, (torch.randn(4, 3, 32, 32),))):
        torch.manual_seed(0)
        model = build()
        with FlopCounterMode(display=False) as counter:
            model(*inputs)
        g = ap.capture(_meta(build), inputs)
        ours = sum(n.flops for n in g.nodes if n.op_class in ("matmul", "conv"))
        assert ours == counter.get_total_flops(), build.__name__


def test_transposed_convolution_flops_equal_torch_flop_counter():
    class UNetish(nn.Module):
        def __init__(self):
            super().__init__()
            self.down = nn.Conv2d(3, 8, 3, stride=2, padding=1)
            self.up = nn.ConvTranspose2d(8, 4, 3, stride=2, padding=1, output_padding=1, groups=2)
            self.tag = None

        def forward(self, x):
            h = self.up(torch.relu(self.down(x)))
            if self.tag is not None:  # eager recording (dispatch-level ops: aten.convolution, transposed=True)
                h = h if h.data_ptr() % 16 == 0 else h.contiguous()
            return h

    x = torch.randn(2, 3, 16, 16)
    torch.manual_seed(0)
    with FlopCounterMode(display=False) as counter:
        UNetish()(x)
    assert counter.get_total_flops() > 0
    exported, recorded = {"aten.conv2d.default", "aten.conv_transpose2d.input"}, {"aten.convolution.default"}
    for tag, ops in ((None, exported), ("eager", recorded)):
        model = UNetish()
        model.tag = tag
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            g = ap.capture(model, x)
        convs = [n for n in g.nodes if n.op_class == "conv"]
        assert {n.op for n in convs} == ops
        assert sum(n.flops for n in convs) == counter.get_total_flops(), tag


def test_einsum_is_traced_and_costed_like_torch_flop_counter():
    class Mixer(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(16, 32))
            self.ln = nn.LayerNorm(32)

        def forward(self, x):
            h = torch.einsum("btd,de->bte", x, self.w)
            scores = torch.einsum("bte,bse->bts", h, h).softmax(-1)
            return self.ln(torch.einsum("bts,bse->bte", scores, h))

    x = torch.randn(2, 8, 16)
    torch.manual_seed(0)
    with FlopCounterMode(display=False) as counter:
        Mixer()(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to the eager recorder: the einsum rule is reached and works
        g = ap.capture(_meta(Mixer), x)
    einsums = [n for n in g.nodes if n.op.startswith("aten.einsum")]
    assert g.tracer == "torch.export" and len(einsums) == 3
    assert [n.flops for n in einsums] == [2 * 2 * 8 * 16 * 32, 2 * 2 * 8 * 8 * 32, 2 * 2 * 8 * 8 * 32]
    assert sum(n.flops for n in einsums) == counter.get_total_flops()
    assert all(n.op_class == "matmul" and n.bwd_flops == 2 * n.flops for n in einsums)


def test_cnn_with_batchnorm():
    model = _meta(ResNet)
    x = torch.randn(8, 3, 32, 32)
    g = ap.capture(model, x)
    first = next(n for n in g.nodes if n.op_class == "conv")
    assert first.flops == 2 * (8 * 16 * 32 * 32) * 3 * 3 * 3  # 2 * out_numel * Cin * kh * kw
    assert first.module_path == "conv1"
    assert first.in_shapes == [(8, 3, 32, 32), (16, 3, 3, 3)]  # input and weight
    assert any("batch_norm" in n.op for n in g.nodes)
    assert [b.members for b in g.blocks] == [["layer1.0", "layer1.1"]]  # layer2.0/3.0 downsample: not repeats
    assert any(p.is_buffer and p.name.endswith("running_mean") for p in g.params.values())


def test_recommender_large_embeddings():
    model = _meta(lambda: RecSys(table_sizes=(10_000_000, 100_000)))
    g = ap.capture(model, (torch.randn(16, 13), torch.randint(0, 100_000, (16, 2))))
    assert g.layer("tables.0").num_params == 10_000_000 * 64
    assert g.layer("tables.0").param_bytes == 10_000_000 * 64 * 4
    emb = [n for n in g.nodes if n.op_class == "embedding"]
    assert len(emb) == 2 and all(n.flops == 0 for n in emb)
    assert emb[0].bytes_written == 16 * 64 * 4
    # layers in execution order: the dense bottom MLP runs before the tables
    assert [lay.path for lay in g.layers][:4] == ["bottom.0", "bottom.1", "bottom.2", "tables.0"]


def test_tied_weights_count_once():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(100, 16)
            self.head = nn.Linear(16, 100, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, idx):
            return self.head(self.emb(idx))

    g = ap.capture(_meta(Tied), torch.randint(0, 100, (2, 8)))
    assert g.num_params == 1600
    assert {p for n in g.nodes for p in n.params} == {"emb.weight"}  # one name for the tied weight


def test_model_returning_non_tensor_objects():
    class Box:  # not a pytree (like a Hugging Face cache object): only the tensors matter for the graph
        def __init__(self, t):
            self.t = t

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            y = self.lin(x)
            return {"logits": y, "cache": Box(y)}

    g = ap.capture(_meta(Net), torch.randn(2, 8))
    assert g.tracer == "torch.export"
    assert [o.shape for o in g.outputs] == [(2, 8)]
    assert g.nodes[0].module_path == "lin" and g.nodes[0].params == ["lin.weight", "lin.bias"]


def test_data_dependent_control_flow_names_module_and_line():
    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            if y.sum() > 0:  # data-dependent
                return y * 2
            return y

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Gate(), Gate()])

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    with pytest.raises(ap.CaptureError) as err:
        ap.capture(_meta(Net), torch.randn(2, 4))
    msg = str(err.value)
    assert "blocks.0 (Gate)" in msg
    assert "if y.sum() > 0:" in msg
    assert "torch.where" in msg


def test_fallback_trace_with_warning_when_export_cannot():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 2)

        def forward(self, x):
            h = torch.relu(self.a(x))
            aligned = h.data_ptr() % 16 == 0  # a custom kernel's alignment check: export has no data pointers
            return self.b(h if aligned else h.contiguous())

    with pytest.warns(UserWarning, match="torch.export could not trace"):
        g = ap.capture(_meta(Net), torch.randn(4, 8))
    assert g.tracer == "fx"
    assert [lay.path for lay in g.layers] == ["a", "b"]
    assert sum(n.flops for n in g.nodes if n.op_class == "matmul") == 2 * 4 * 8 * 8 + 2 * 4 * 8 * 2
    assert {n.layer for n in g.nodes} == {"a", "b"}
    assert any(sorted(n.params) == ["a.bias", "a.weight"] for n in g.nodes)


def test_twenty_billion_parameter_gpt_captures_in_small_memory():
    # run in a fresh interpreter so the peak RSS is this capture's alone
    code = textwrap.dedent("""
        import resource, torch
        import autopar_nb as ap
        from autopar_nb.zoo import GPT, GPTConfig
        with torch.device("meta"):
            m = GPT(GPTConfig(n_layer=44, n_head=48, n_embd=6144, block_size=2048))
        g = ap.capture(m, torch.randint(0, 50257, (1, 2048)))
        print(g.num_params, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    params, rss = map(int, out.stdout.split()[-2:])
    assert params > 20e9
    assert rss < 2 * 2**30, f"peak RSS {rss / 2**30:.2f} GiB"


def test_unknown_op_warns_and_registered_rule_costs_it():
    import kernels_ext

    @torch.library.custom_op("autopar_test::scale2", mutates_args=())
    def scale2(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @scale2.register_fake
    def _(x):
        return torch.empty_like(x)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return scale2(self.lin(x))

    with pytest.warns(UserWarning, match="autopar_test.scale2"):
        g = ap.capture(_meta(Net), torch.randn(4, 8))
    node = next(n for n in g.nodes if "scale2" in n.op)
    assert not node.known and node.flops == 0 and g.unknown_ops
    kernels_ext.register_op(kernels_ext.OpRule("autopar_test.scale2", "elementwise",
                                               flops=lambda args, kwargs, outs: outs[0].numel))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g = ap.capture(_meta(Net), torch.randn(4, 8))
    node = next(n for n in g.nodes if "scale2" in n.op)
    assert node.known and node.flops == 32 and node.op_class == "elementwise"


def test_hugging_face_gpt2_from_config():
    import transformers  # a test dependency (pyproject's test extra)

    cfg = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4)
    model = _meta(lambda: transformers.GPT2LMHeadModel(cfg))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # export must work directly (no fallback), every op known
        g = ap.capture(model, {"input_ids": torch.randint(0, cfg.vocab_size, (2, 128))})
    assert g.tracer == "torch.export"
    assert [b.members for b in g.blocks] == [[f"transformer.h.{i}" for i in range(4)]]
    assert g.num_params == sum(p.numel() for p in model.parameters())  # lm_head tied to wte: counted once
    matmul = sum(n.flops for n in g.nodes if n.op_class == "matmul")
    linear_like = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "wpe" not in n)
    assert matmul == 2 * 2 * 128 * linear_like  # GPT-2's Conv1D (addmm) layers + the tied head


def test_transposes_written_as_attributes_are_known_views():
    """``weight.T`` (Falcon's FalconLinear computes ``input @ self.weight.T``) and ``.mT`` trace as aten.numpy_T and
    aten.mT: views that move no data, not ops without a rule (which warned and were counted as 0 FLOPs unknown)."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(16, 8))

        def forward(self, x):
            return (x @ self.w.T) @ self.w.mT.mT

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g = ap.capture(_meta(Net), torch.randn(4, 8))
    assert not g.unknown_ops
    # the views stay ops holding the parameter (the copied blocks' trace matches node names against a full trace's);
    # only an nn.Linear subclass's weight.T stands for its weight (the next test)
    assert {p for n in g.nodes for p in n.params} == {"w"} and all(n.params == [] for n in g.nodes
                                                                    if n.op_class == "matmul")


def test_a_linear_subclass_with_its_own_forward_is_a_linear():
    """Falcon's ``FalconLinear`` (an ``nn.Linear`` whose forward is ``input @ self.weight.T + self.bias``) is captured
    as the Linear it is: ``aten.linear`` reading its weight, in a module the TP rules read as "Linear" (before, a
    ``numpy_T`` node held the weight and the ``matmul`` none, and TP left Falcon's blocks whole)."""

    class FalconLike(nn.Linear):
        def forward(self, x):
            return x @ self.weight.T + self.bias

    model = _meta(lambda: nn.Sequential(FalconLike(8, 16), nn.ReLU(), FalconLike(16, 4)))
    g = ap.capture(model, torch.randn(4, 8))
    linear = [n for n in g.nodes if n.op_class == "matmul"]
    assert [(n.op, n.params, n.module_type) for n in linear] == [
        ("aten.linear.default", ["0.weight"], "Linear"), ("aten.linear.default", ["2.weight"], "Linear")]
    assert [n.flops for n in linear] == [2 * 4 * 8 * 16, 2 * 4 * 16 * 4]
