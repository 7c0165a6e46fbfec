"""Capture traces one member per class of identical repeated blocks and copies its ops (capture/blocks.py): the
graph must be the one a full trace gives, node for node, on every family of the zoo."""

import dataclasses
import importlib
import re
import warnings

import pytest
import torch
import torch.nn as nn
from families import FAMILIES

import autopar_nb as ap

capture_module = importlib.import_module("autopar_nb.capture")  # the package's `capture` is the function
COPY_FIELDS = ("copied_layers", "full_trace_reason")  # what says how the graph was made, not what it is


def _four_layers(cell: str) -> str:
    return re.sub(r"\b(num_hidden_layers|n_layers?|num_layers)=2\b", r"\1=4", cell)


ZOO = """\
import torch
from autopar_nb import zoo
model = zoo.{model}
example_inputs = {inputs}
"""
TOKENS = "(torch.randint(0, 128, (2, 16)),)"
CELLS = {name: _four_layers(cell) for name, cell in FAMILIES.items()} | {
    "zoo GPT": ZOO.format(model="GPT(zoo.GPTConfig(n_layer=4, n_head=4, n_embd=64, block_size=32, vocab_size=128))",
                          inputs=TOKENS),
    "zoo Llama": ZOO.format(model="Llama(zoo.LlamaConfig(vocab_size=128, dim=64, n_layers=4, n_heads=4, "
                                  "n_kv_heads=2, ffn_dim=128))", inputs=TOKENS),
    "zoo MoE": ZOO.format(model="MoETransformer(zoo.MoEConfig(vocab_size=128, dim=64, n_layers=4, n_heads=4, "
                                "n_kv_heads=4, ffn_dim=128, n_routed_experts=4, n_shared_experts=1, top_k=2, "
                                "moe_ffn_dim=32))", inputs=TOKENS),
    "zoo ResNet": ZOO.format(model="ResNet(blocks_per_stage=3)", inputs="(torch.randn(2, 3, 16, 16),)"),
}
NO_REPEATS = {"CNN + BatchNorm"}  # its blocks differ in width: nothing to copy


def _model(cell: str):
    ns: dict = {}
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(cell, ns)
    return ns["model"], ns["example_inputs"]


def _assert_same_graph(fast, full) -> None:
    """Every field of every node, parameter, layer, block, input and output equal."""
    for f in dataclasses.fields(full):
        if f.name in COPY_FIELDS or not f.compare:  # the stand-in model copy is no part of the graph
            continue
        a, b = getattr(fast, f.name), getattr(full, f.name)
        if f.name == "nodes":
            assert len(a) == len(b)
            for x, y in zip(a, b, strict=True):
                assert x == y, f"copied {x}\n  traced {y}"
        assert a == b, f.name


def test_the_families_have_four_layers():
    assert all("=4" in cell for name, cell in CELLS.items() if name not in NO_REPEATS | {"T5", "ViT", "BERT"}
               and not name.startswith("zoo"))


@pytest.mark.parametrize("name", list(CELLS))
def test_copied_blocks_give_the_graph_of_a_full_trace(name):
    model, inputs = _model(CELLS[name])
    fast = ap.capture(model, inputs)
    full = ap.capture(model, inputs, copy_blocks=False)
    _assert_same_graph(fast, full)
    assert full.copied_layers == 0 and full.full_trace_reason is None
    assert fast.full_trace_reason is None
    if name not in NO_REPEATS:  # each member of a class of identical blocks but the first was copied
        assert fast.copied_layers >= (2 if name in ("Gemma2", "DeepSeek-V3", "zoo MoE", "zoo ResNet") else 3), name


def test_copied_blocks_under_the_eager_recorder(monkeypatch):
    """Where torch.export cannot trace, the eager recorder runs with the same stand-ins."""
    def no_export(*args, **kwargs):
        raise RuntimeError("torch.export switched off for this test")

    monkeypatch.setattr(capture_module.tracers, "from_export", no_export)
    for name in ("zoo GPT", "zoo Llama", "BERT", "T5"):
        model, inputs = _model(CELLS[name])
        with pytest.warns(UserWarning, match="captured by recording one eager forward pass"):
            fast = ap.capture(model, inputs)
        with pytest.warns(UserWarning):
            full = ap.capture(model, inputs, copy_blocks=False)
        assert fast.tracer == "fx" and fast.copied_layers >= 2, name
        _assert_same_graph(fast, full)


class _Scaled(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.lin, self.scale = nn.Linear(8, 8), scale

    def forward(self, x):
        return self.lin(x) * self.scale if self.scale != 1 else self.lin(x)


class _Stack(nn.Module):
    def __init__(self, scales, reuse_first: bool = False, lead: bool = True):
        super().__init__()
        self.inp = nn.Linear(8, 8) if lead else nn.Identity()  # the first block's input requires grad, or not
        self.blocks = nn.ModuleList(_Scaled(s) for s in scales)
        self.reuse_first = reuse_first

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.blocks[0](x) if self.reuse_first else x


def test_blocks_that_differ_are_traced_and_the_full_trace_says_why():
    with torch.device("meta"):
        differ = _Stack([1.0, 2.0, 3.0])  # an attribute changes the ops: no two members are identical
        twice = _Stack([2.0, 2.0, 2.0], reuse_first=True)  # a member called twice cannot be copied
        classes = _Stack([2.0, 1.0, 2.0, 1.0])  # two classes, one member of each traced
        # the first block's input does not require grad, the others' do: each block traced (with its parameters,
        # which capture takes out of the members it expects to copy while torch.export traces)
        no_grad_first = _Stack([2.0, 2.0, 2.0], lead=False)
    x = torch.randn(4, 8, device="meta")
    for model, copied, reason in ((differ, 0, "no two members"), (twice, 0, "called more than once"),
                                  (classes, 2, None), (no_grad_first, 0, None)):
        fast, full = ap.capture(model, x), ap.capture(model, x, copy_blocks=False)
        _assert_same_graph(fast, full)
        assert fast.copied_layers == copied
        assert (fast.full_trace_reason is None) if reason is None else reason in fast.full_trace_reason
        assert ("every layer traced: " in fast.summary()) == (reason is not None)  # the fallback says why
    assert "2 of 5 layers copied" in ap.capture(classes, x).summary().splitlines()[0]
