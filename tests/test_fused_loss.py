"""runtime/fused_loss.py: the output head's Linear and the default next-token cross-entropy as kernels_ext's fused,
chunked op, against the unfused default loss (same loss and gradients, same parameter names)."""

from __future__ import annotations

import copy

import pytest
import torch
from test_compile import lm_source

from autopar_nb.runtime.data import default_loss
from autopar_nb.runtime.fused_loss import LinearCrossEntropyHead, apply_fused_loss, fused_default_loss


@pytest.mark.parametrize("causal", [True, False])
def test_fused_head_and_loss_equal_the_default_loss(causal):
    ns = lm_source(vocab=300, dim=16).run(seed=0)
    model, (ids,) = ns["model"], ns["example_inputs"]
    fused = copy.deepcopy(model)
    names = list(fused.state_dict())
    head = apply_fused_loss(fused, "head")
    assert isinstance(fused.head, LinearCrossEntropyHead) and head is fused.head
    assert list(fused.state_dict()) == names, "the same weight Parameter under the same name"
    results = []
    for m, fn in ((model, default_loss), (fused, fused_default_loss)):
        loss = fn(m, (ids,), causal=causal)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in m.named_parameters()}))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, rtol=1e-4, atol=1e-6)
    assert head.target is None and fused(ids).shape == (*ids.shape, 300), "outside the loss: logits, as before"


def test_apply_fused_loss_refuses_what_is_not_a_bias_free_linear():
    model = lm_source().run(seed=0)["model"]
    with pytest.raises(ValueError, match="bias-free nn.Linear.*with a bias"):
        apply_fused_loss(model, "layers.0.up")
    with pytest.raises(ValueError, match="found LayerNorm"):
        apply_fused_loss(model, "norm")
    with pytest.raises(ValueError, match="needs a model whose head apply_fused_loss replaced"):
        fused_default_loss(model, (torch.zeros(2, 4, dtype=torch.long),))
