"""RandomOff: every random op of a forward switched off at the call, whatever attribute its probability came from
(verify's two runs; the multi-process cases are ``random_dp``/``random_tp`` in test_verify.py)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar_nb.randomness import RandomOff
from autopar_nb.verify.report import StepDiff, VerifyReport


class DropPath(nn.Module):
    """timm's drop_path: a per-sample bernoulli(keep) mask, scaled by 1 / keep."""

    def __init__(self, drop_prob: float):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x):
        if not self.training:
            return x
        keep = 1 - self.drop_prob
        return x * x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep).div_(keep)


class Noisy(nn.Module):
    """Dropout under names no list guesses, nn.MultiheadAttention's, nn.Dropout, a router-style jitter and noise."""

    def __init__(self, sdpa_p: float = 0.3):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 8)
        self.attn_dropout, self.mixing_noise = 0.1, sdpa_p
        self.drop_path, self.drop = DropPath(0.2), nn.Dropout(0.5)
        self.mha = nn.MultiheadAttention(64, 4, dropout=0.2, batch_first=True)

    def forward(self, x):
        h = F.dropout(F.relu(self.fc1(x)), self.attn_dropout, self.training)
        q = h.view(*h.shape[:2], -1, 16).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, q, q, dropout_p=self.mixing_noise).transpose(1, 2).reshape(h.shape)
        h = h + self.drop_path(a) + self.mha(h, h, h)[0]
        jitter = torch.empty_like(h).uniform_(0.9, 1.1) if self.training else 1.0
        noise = torch.randn_like(h) * 0.1 if self.training else 0.0
        return self.fc2(self.drop(h) * jitter + noise)


def test_a_training_forward_equals_the_deterministic_one_exactly():
    """With RandomOff the training forward and backward are the model without its random ops (eval mode, SDPA's
    dropout_p at 0), exactly: dropout's p set to 0, stochastic depth's mask at its mean keep (divided by keep: 1),
    jitter at 1, noise at 0; each is named with its module, once per forward."""
    torch.manual_seed(0)
    model, x = Noisy(), torch.randn(4, 8, 32)
    clean = Noisy(sdpa_p=0.0)
    clean.load_state_dict(model.state_dict())
    want = clean.eval()(x)
    with RandomOff(model) as off:
        got = model(x)
        again = model(x)
        got.sum().backward()
    assert torch.equal(got, want) and torch.equal(got, again)
    assert off.forwards == 2 and not off.left
    assert sorted(off.counts()[0]) == sorted([
        "1 x dropout p=0.1 (Noisy)", "1 x scaled_dot_product_attention dropout_p=0.3 (Noisy)",
        "1 x bernoulli_ -> its mean 0.8 (drop_path)", "1 x multi_head_attention_forward dropout_p=0.2 (mha)",
        "1 x uniform_ -> its mean 1 (Noisy)", "1 x randn_like -> its mean 0 (Noisy)", "1 x dropout p=0.5 (drop)"])


def test_only_forwards_lose_their_randomness():
    """Outside a module forward (weight initialisation, batches) random draws stay random; a random op with no
    stand-in (randint) runs and is reported as left on; the hooks leave with the context."""

    class Draws(nn.Linear):
        def forward(self, x):
            return super().forward(x) + torch.randint(0, 2, (1,))

    model = Draws(3, 3)
    with RandomOff(model) as off:
        assert not torch.equal(torch.rand(8), torch.rand(8))
        model(torch.randn(2, 3))
    assert off.counts() == ([], ["1 x randint (Draws)"])
    hooks = nn.modules.module._global_forward_hooks, nn.modules.module._global_forward_pre_hooks
    assert not any(off._enter == h or off._exit == h for d in hooks for h in d.values())


def test_traced_aten_dropout_is_switched_off_too():
    """A traced program (a pipeline stage's) calls aten ops: ``aten.dropout``/``native_dropout`` get p = 0 there,
    and the backward is the identity's."""

    class Traced(nn.Module):
        def forward(self, x):
            y = torch.ops.aten.dropout.default(x, 0.5, True)
            return torch.ops.aten.native_dropout.default(y, 0.25, True)[0]

    x = torch.randn(6, 5, requires_grad=True)
    with RandomOff() as off:
        y = Traced()(x)
        y.sum().backward()
    assert torch.equal(y, x) and torch.equal(x.grad, torch.ones_like(x))
    assert off.counts()[0] == ["1 x dropout p=0.5 (Traced)", "1 x native_dropout p=0.25 (Traced)"]


def test_the_report_names_random_ops_left_first_when_it_mismatches():
    """A mismatch where random ops stayed on says so before the table (they may be its cause); a match mentions
    them after; what was switched off is listed after the table."""
    def report(loss):
        return VerifyReport(plan="p", nproc=2, rtol=1e-5, steps=[StepDiff(0, loss, 1.0, 0, 0, 0, 0)],
                            random_off=["2 x dropout p=0.1 (h.0)"], random_left=["1 x randint (Net)"])

    bad, good = str(report(1.5)).splitlines(), str(report(1.0)).splitlines()
    assert bad[0].startswith("random ops verify could not switch off ran in the forward: 1 x randint (Net)")
    assert "may come from them" in bad[0] and bad[1].startswith("verify p") and "MISMATCH" in bad[1]
    assert good[0].startswith("verify p") and any("1 x randint (Net)" in line for line in good[1:])
    assert any(line.startswith("random ops switched off in both runs (per forward): 2 x dropout p=0.1 (h.0)")
               for line in good)
