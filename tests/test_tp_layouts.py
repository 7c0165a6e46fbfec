"""TP layouts beyond one Linear per projection, verified for real: fused ``[q|k|v]`` and ``[gate|up]`` projections,
Hugging Face ``Conv1D``, head counts the model's code reads, T5's relative position bias split by heads, and
key/value heads repeated when there are fewer than TP ranks.

Each family runs on 2 gloo processes against the single-process run (one launch for all of them), and each case also
checks that the weights were really sharded: every rank holds exactly the elements the plan says (a split weight
1/tp of it, a repeated one all of it), not merely fewer. The fast tests check the layout arithmetic without processes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from runtime_cases import (
    GPT_CELL,
    HF_BERT_CELL,
    HF_FALCON_CELL,
    HF_GEMMA_CELL,
    HF_GPT2_CELL,
    HF_LLAMA_CELL,
    HF_PHI3_CELL,
    HF_T5_CELL,
    has_transformers,
    hf_bert_tp,
    hf_falcon_tp,
    hf_gpt2_tp,
    hf_gqa_tp,
    hf_phi3_tp,
    hf_t5_tp,
    make_plan,
    source,
    with_parts,
    zoo_gpt_tp,
)
from torch.distributed.tensor.placement_types import _StridedShard

from autopar_nb.plan import PlanError
from autopar_nb.planner.styles import local_sizes, part_layout, tp_styles
from autopar_nb.runtime.heads import set_local_sizes
from autopar_nb.runtime.layouts import packed_placement
from autopar_nb.verify import FP32_RTOL, verify_many

STEPS = 3
TP = 2
# GPT-2 and BERT pass their attention dropout module's ``p`` to SDPA, which verify's dropout switch (eval mode) does
# not reach: those two settings are 0 here, the other dropouts keep their defaults
GPT2_CELL = HF_GPT2_CELL.replace("eos_token_id=0))", "eos_token_id=0, attn_pdrop=0.0))")
BERT_CELL = HF_BERT_CELL.replace("max_position_embeddings=32))",
                                 "max_position_embeddings=32, attention_probs_dropout_prob=0.0))")
assert GPT2_CELL != HF_GPT2_CELL and BERT_CELL != HF_BERT_CELL


def _cases() -> dict:
    """name -> (source, styles, parts): tiny models (2 layers, hidden 32, 4 heads, seq 16, batch 4)."""
    cases = {"zoo_gpt_fused_qkv": (source(GPT_CELL), *zoo_gpt_tp())}
    if has_transformers():
        cases |= {
            "gpt2_conv1d": (source(GPT2_CELL), *hf_gpt2_tp()),
            "phi3_gqa": (source(HF_PHI3_CELL.format(kv=2)), *hf_phi3_tp(kv_heads=2)),  # q, k, v of other widths
            "phi3": (source(HF_PHI3_CELL.format(kv=4)), *hf_phi3_tp(kv_heads=4)),  # Phi-3's default: kv = heads
            "bert": (source(BERT_CELL), hf_bert_tp(), {}),
            "t5_relative_bias": (source(HF_T5_CELL), *hf_t5_tp()),
            "gemma_one_kv_head": (source(HF_GEMMA_CELL), *hf_gqa_tp(kv_heads=1)),
            # one fused [q|k|v] of 4 + 1 + 1 heads: query heads split, the key/value head repeated
            "falcon_multi_query": (source(HF_FALCON_CELL), *hf_falcon_tp()),
        }
        cases["gpt2_conv1d_meta_init"] = cases["gpt2_conv1d"]  # built on meta, initialised shard by shard
    return cases


CASES = _cases()
FOUR = {}  # 4 TP ranks, 2 key/value heads: ranks 0, 1 read head 0 and ranks 2, 3 head 1
if has_transformers():
    FOUR["llama_kv_repeated_tp4"] = (source(HF_LLAMA_CELL), *hf_gqa_tp(heads=4, kv_heads=2))


def _plan(src, styles, parts, tp=TP):
    plan = with_parts(make_plan(src, tp=tp, tp_styles=styles), parts)
    plan.optimizer.name, plan.optimizer.lr = "sgd", 0.05  # SGD: parameter updates checked at 1e-5 too
    return plan


@pytest.fixture(scope="module")
def reports():
    out = {}
    for cases, tp in ((CASES, TP), (FOUR, 4)):  # one launch per world size
        plans = {name: (src, _plan(src, styles, parts, tp)) for name, (src, styles, parts) in cases.items()}
        meta = [name.endswith("_meta_init") for name in plans]
        out |= dict(zip(plans, verify_many(list(plans.values()), steps=STEPS, meta_init=meta), strict=True))
    return out


def expected_local_numel(src, plan) -> tuple[int, int]:
    """(elements one rank holds, elements of the whole model) for ``plan``: a split weight holds 1/tp, a rowwise
    bias, the bias of a projection split part by part and a repeated key/value projection (fewer
    heads than ranks) all of it."""
    model, _, _ = src.build(device="meta")
    tp, styles, parts = plan.mesh.tp, plan.tp_plan, plan.tp_parts
    local = full = 0
    seen = set()
    for path, module in model.named_modules():
        for p in module.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            full += p.numel()
            style, heads = styles.get(path, "replicate"), parts.get(path, [tp])
            repeated = any(h % tp for h in heads)  # fewer heads than ranks in a part: the weight whole
            packed_bias = len(heads) > 1 and len(set(heads)) == 1 and p.dim() == 1
            split = (style == "colwise" and not repeated and not packed_bias) or (
                style == "rowwise" and p.dim() == 2)
            local += p.numel() // tp if split else p.numel()
    return local, full


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [*CASES, *FOUR])
def test_layout_matches_single_process(reports, name):
    report = reports[name]
    print(name, report)
    assert report.rtol == FP32_RTOL
    assert report.ok, str(report)
    assert report.steps[-1].ref_loss != report.steps[0].ref_loss  # it trained
    src, styles, parts = CASES[name] if name in CASES else FOUR[name]
    local, full = expected_local_numel(src, _plan(src, styles, parts, TP if name in CASES else 4))
    print(f"{name}: max grad rel {report.max_grad_rel:.2e}, max param rel {report.max_param_rel:.2e}, "
          f"local_numel {report.per_rank[0]['local_numel']} of {full}")
    for info in report.per_rank:
        assert info["local_numel"] == local < full, (name, info, local, full)
        assert info["dtensor_params"] > 0


# ---- the layout arithmetic, no processes --------------------------------------------------------------------------
def test_strided_shard_holds_slice_r_of_every_part():
    """``packed_placement(0, 3)`` on tp ranks: rank r holds ``[q_r|k_r|v_r]`` (what the model's split expects), and
    the ranks together hold every row once."""
    rows = torch.arange(24)  # q = 0..7, k = 8..15, v = 16..23
    for tp in (2, 4):
        shards, _ = packed_placement(0, 3)._split_tensor(rows, tp, with_padding=False)
        for r, shard in enumerate(shards):
            want = torch.cat([part.chunk(tp)[r] for part in rows.chunk(3)])
            assert torch.equal(shard, want), (tp, r, shard, want)
        assert sorted(torch.cat(shards).tolist()) == rows.tolist()
    assert isinstance(packed_placement(1, 2), _StridedShard) and packed_placement(0, 1).__class__.__name__ == "Shard"


class _Conv1D(nn.Module):
    """Hugging Face's Conv1D contract: weight (nx, nf)."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight, self.bias = nn.Parameter(torch.empty(nx, nf)), nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(x.size()[:-1] + (self.nf,))


def test_part_layouts():
    lin = nn.Linear(32, 64, bias=False)
    assert part_layout("a", lin, None, tp=2) == {"kind": "colwise"}
    assert part_layout("a", _Conv1D(96, 32), [4, 4, 4], tp=2) == {"kind": "packed_colwise", "parts": 3,
                                                                   "transposed": True}
    assert part_layout("a", _Conv1D(96, 32), None, tp=2) == {"kind": "packed_colwise", "transposed": True}
    assert part_layout("a", lin, [32, 32], tp=2)["parts"] == 2  # [gate|up] in features
    assert part_layout("a", lin, [4, 2, 2], tp=2) == {"kind": "colwise", "output_layout": "replicate"}  # GQA qkv
    assert part_layout("a", nn.Linear(32, 8), [1], tp=2) == {"kind": "repeated_colwise", "heads": 1}
    assert part_layout("a", nn.Linear(32, 16), [2], tp=4) == {"kind": "repeated_colwise", "heads": 2}
    assert part_layout("a", nn.Embedding(32, 4), [4], tp=2) == {"kind": "colwise"}
    with pytest.raises(ValueError, match="do not divide"):
        part_layout("a", lin, [3, 3, 3], tp=2)
    # one kv head in a fused projection at tp=2 (Falcon's multi-query): query heads split, the key/value head kept
    assert part_layout("a", nn.Linear(32, 32), [2, 1, 1], tp=2) == {"kind": "repeated_colwise", "heads": (2, 1, 1)}
    with pytest.raises(NotImplementedError, match="cannot be split"):
        part_layout("a", nn.Linear(32, 40), [3, 1, 1], tp=2)  # 3 query heads: neither split nor repeated
    with pytest.raises(NotImplementedError, match="cannot be split"):
        part_layout("a", nn.Linear(32, 24), [3], tp=2)


def test_plan_parts_are_checked():
    from autopar_nb.plan import LayerPlan

    lp = LayerPlan("h.0", tp={"h.0.c_attn": "colwise"}, tp_parts={"h.0.c_attn": [4, 4, 4]})
    assert lp.tp_parts == {"h.0.c_attn": [4, 4, 4]}
    for bad, match in (({"h.0.other": [4]}, "'replicate'"), ({"h.0.c_attn": []}, "empty"),
                       ({"h.0.c_attn": [0]}, ">= 1"), ({"h.0.c_attn": [True]}, "integer"), ({"h.0.c_attn": 3}, "list")):
        with pytest.raises(PlanError, match=match):
            LayerPlan("h.0", tp={"h.0.c_attn": "colwise"}, tp_parts=bad)


@pytest.mark.skipif(not has_transformers(), reason="transformers not installed")
def test_local_sizes_and_styles_per_family():
    """Which sizes each family's code needs per rank, decided at export time from its source and the plan."""
    expected = {
        "zoo_gpt_fused_qkv": ("h.0.attn", {"n_embd": 16}),  # its heads counted from the width: no n_head
        "gpt2_conv1d": ("transformer.h.0.attn", {"split_size": 16}),
        "gpt2_conv1d_meta_init": ("transformer.h.0.attn", {"split_size": 16}),
        "phi3": ("model.layers.0.self_attn", {"config.num_attention_heads": 2, "num_key_value_heads": 2}),
        "phi3_gqa": ("model.layers.0.self_attn", None),  # gathered: the attention runs whole
        "bert": ("bert.encoder.layer.0.attention.self", None),  # views with -1: nothing to set
        "t5_relative_bias": ("decoder.block.0.layer.1.EncDecAttention", {"n_heads": 2}),
        "gemma_one_kv_head": ("model.layers.0.self_attn", {"num_key_value_groups": 2}),
        "falcon_multi_query": ("transformer.h.0.self_attention",
                               {"num_heads": 2, "num_kv_heads": 1, "num_key_value_groups": 2}),
    }
    for name, (src, styles, parts) in CASES.items():
        model, _, _ = src.build(device="meta")
        plan = _plan(src, styles, parts)
        st = tp_styles(model, plan.tp_plan, layers=[lp.path for lp in plan.layers], parts=plan.tp_parts, tp=TP)
        sizes = local_sizes(model, st, tp=TP)
        path, want = expected[name]
        assert sizes.get(path) == want, (name, sizes)
        kinds = {p.rsplit(".", 1)[-1]: s.kind for p, s in st.items()}
        if name == "gpt2_conv1d":
            assert kinds == {"c_attn": "packed_colwise", "c_proj": "transposed_rowwise", "c_fc": "packed_colwise"}
        if name == "bert":  # q/k/v feed attention.output.dense (a sibling module): split, not gathered as a head
            assert st["bert.encoder.layer.0.attention.self.query"].output_layout is None
        if name == "phi3_gqa":
            assert st["model.layers.0.self_attn.o_proj"].input_layout == "replicate"
        if name == "falcon_multi_query":  # FalconLinear is an nn.Linear: torch's styles, the qkv kept part by part
            assert kinds == {"query_key_value": "repeated_colwise", "dense": "rowwise", "dense_h_to_4h": "colwise",
                             "dense_4h_to_h": "rowwise"}, kinds
            assert st["transformer.h.0.self_attention.query_key_value"].source() == \
                "RepeatedColwiseParallel(input_layouts=Replicate(), heads=(4, 1, 1))"
    # setting them: idempotent, and a dotted name sets the module's own copy of the config
    src, styles, parts = CASES["phi3"]
    model = src.run()[src.model_var]
    sizes = {"model.layers.*.self_attn": {"config.num_attention_heads": 2, "num_key_value_heads": 2}}
    set_local_sizes(model, sizes)
    set_local_sizes(model, sizes)
    attn = model.model.layers[1].self_attn
    assert (attn.config.num_attention_heads, attn.num_key_value_heads, model.config.num_attention_heads) == (2, 2, 4)
    with pytest.raises(AttributeError, match="no attribute"):
        set_local_sizes(model, {"model.layers.*.self_attn": {"n_head": 2}})


@pytest.mark.skipif(not has_transformers(), reason="transformers not installed")
def test_fused_script_is_standalone(tmp_path):
    """The exported script of a fused case carries the runtime's style classes, imports no autopar_nb, and passes
    ruff with the project's configuration."""
    import subprocess
    import sys
    from pathlib import Path

    from autopar_nb.export import export

    src, styles, parts = CASES["gpt2_conv1d"]
    script = export(src, _plan(src, styles, parts), tmp_path / "train_gpt2_tp.py", quiet=True).script
    runtime = script.with_name("train_gpt2_tp_runtime.py")  # the runtime module the script imports
    text = script.read_text() + runtime.read_text()
    assert "autopar_nb" not in text.replace("autopar_nb/runtime", "").replace("autopar_nb.runtime", "")
    assert "class PackedColwiseParallel(ColwiseParallel):" in text
    assert "PackedColwiseParallel(input_layouts=Replicate(), parts=3, transposed=True)" in text
    assert 'sizes = {"transformer.h.*.attn": {"split_size": 16}}' in text
    root = Path(__file__).resolve().parents[1]
    ruff = Path(sys.executable).with_name("ruff")
    out = subprocess.run([str(ruff), "check", "--config", str(root / "pyproject.toml"), str(script), str(runtime)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def _checkpoint_worker(ckpt: str) -> dict:
    """One rank: a fused [q|k|v] Linear and a Conv1D split part by part at tp=2, one AdamW step, a DCP checkpoint
    written and read back by the runtime's own save/load."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from autopar_nb.runtime.checkpoint import load_checkpoint, save_checkpoint
    from autopar_nb.runtime.layouts import PackedColwiseParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)
        model = nn.ModuleDict({"qkv": nn.Linear(4, 12), "conv": _Conv1D(12, 4)})
        nn.init.normal_(model["conv"].weight)
        parallelize_module(model, init_device_mesh("cpu", (2,)),
                           {"qkv": PackedColwiseParallel(parts=3), "conv": PackedColwiseParallel(parts=3,
                                                                                                 transposed=True)})
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        x = torch.randn(2, 4)
        (model["qkv"](x).sum() + model["conv"](x).sum()).backward()
        opt.step()
        after = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
        moments = [s["exp_avg"].full_tensor().clone() for s in opt.state.values()]
        save_checkpoint(ckpt, model, opt, 1)
        with torch.no_grad():  # forget everything, then resume
            for p in model.parameters():
                p.zero_()
            for s in opt.state.values():
                s["exp_avg"].zero_()
        step = load_checkpoint(ckpt, model, opt)
        return {"step": step, "after": after,
                "resumed": all(torch.equal(v.full_tensor(), after[k]) for k, v in model.state_dict().items()),
                "moments": all(torch.equal(s["exp_avg"].full_tensor(), m)
                               for s, m in zip(opt.state.values(), moments, strict=True)),
                "placements": str(model["qkv"].weight.placements)}
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_packed_checkpoint_keeps_the_original_layout(tmp_path):
    """A weight split part by part is checkpointed in its original layout: the TP run resumes exactly, and a plain
    (unsplit) model loads the same checkpoint."""
    import uuid

    import torch.distributed.checkpoint as dcp
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    ckpt = str(tmp_path / "step_1")
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, run_id=f"ckpt-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.05,
                          start_method="spawn")
    out = elastic_launch(config, _checkpoint_worker)(ckpt)
    assert all(r["step"] == 1 and r["resumed"] and r["moments"] for r in out.values()), out
    assert "_StridedShard" in out[0]["placements"]
    plain = {"model": {k: torch.zeros_like(v) for k, v in out[0]["after"].items()}}
    dcp.load(plain, checkpoint_id=ckpt, no_dist=True)
    for k, v in out[0]["after"].items():
        assert torch.equal(plain["model"][k], v), k


NANOGPT_ATTENTION_CELL = """\
import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):  # nanoGPT's, with the output re-assembled by view(B, T, -1)
    def __init__(self, n_embd=32, n_head=4):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, -1).transpose(1, 2)
        q = q.view(B, T, self.n_head, -1).transpose(1, 2)
        v = v.view(B, T, self.n_head, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, -1))


model = nn.Sequential(CausalSelfAttention())
example_inputs = (torch.randn(4, 16, 32),)
"""


def test_local_sizes_of_a_class_defined_in_the_cell():
    """A model class written in the notebook cell has no source file; its methods' lines come from the cell."""
    src = source(NANOGPT_ATTENTION_CELL)
    model, _, _ = src.build(device="meta")
    st = tp_styles(model, {"0.c_attn": "colwise", "0.c_proj": "rowwise"}, parts={"0.c_attn": [4, 4, 4]}, tp=4)
    assert st["0.c_attn"].source() == "PackedColwiseParallel(input_layouts=Replicate(), parts=3)"
    assert local_sizes(model, st, tp=4) == {"0": {"n_embd": 8, "n_head": 1}}


@pytest.mark.skipif(not has_transformers(), reason="transformers not installed")
def test_eager_attention_splits_q_k_and_v_together():
    """Gemma 2 runs eager attention by default (soft-capped scores, ``q @ k^T`` and ``scores @ v`` as plain matmuls,
    a metadata check before the softmax's ``.to()``): TP splits every attention's q, k and v projections by heads
    together. Splitting v alone (the planner did, once the metadata check was taken for a sharded model output that
    made q and k replicated) crashed the ranks: 4 query heads met 2 value heads. Layer 0's attention is split too:
    the model is captured without its key/value cache (as the script trains it), whose sliding-window slices were
    model outputs that kept that layer whole."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    import autopar_nb as ap

    config = Gemma2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    with torch.device("meta"):
        model = Gemma2ForCausalLM(config)
    graph = ap.capture(model, (torch.randint(0, 128, (4, 16)),))
    assert model.config.use_cache, "capture gives the cell's model back as it found it"
    plan = ap.plan(graph, ap.Cluster.preset("cpu", gpus_per_node=2), fix={"tp": 2})
    for layer in ("0", "1"):
        names = {n.rsplit(".", 1)[-1] for n in plan.tp_plan if f".layers.{layer}.self_attn." in n}
        assert names == {"q_proj", "k_proj", "v_proj", "o_proj"}, (layer, plan.tp_plan)
