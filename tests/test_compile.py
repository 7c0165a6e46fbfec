"""runtime/compile.py: torch.compile per repeated block, for real with Inductor's C++ backend on CPU (one tiny model,
compiled once: Inductor compiles are slow on a few cores)."""

from __future__ import annotations

import torch

from autopar_nb import zoo
from autopar_nb.runtime.compile import apply_compile


def test_blocks_compile_in_place_and_match_eager():
    torch.manual_seed(0)
    cfg = zoo.LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)
    eager, compiled = zoo.Llama(cfg), zoo.Llama(cfg)
    compiled.load_state_dict(eager.state_dict())
    names = list(compiled.state_dict())
    assert apply_compile(compiled, "layers.*") == ["layers.0", "layers.1"]
    assert list(compiled.state_dict()) == names, "parameter names unchanged (no _orig_mod. prefix)"
    assert apply_compile(compiled, "no_such.*") == []
    tokens = torch.randint(0, 64, (2, 8))
    losses = []
    for model in (eager, compiled):
        out = model(tokens)
        loss = torch.nn.functional.cross_entropy(out.flatten(0, 1), tokens.flatten())
        loss.backward()
        losses.append((out, {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(losses[1][0], losses[0][0], rtol=1e-4, atol=1e-5)
    for name, g in losses[0][1].items():
        torch.testing.assert_close(losses[1][1][name], g, rtol=1e-4, atol=1e-5)
    # really compiled: Dynamo produced a graph for the blocks
    assert compiled.layers[0]._compiled_call_impl is not None
