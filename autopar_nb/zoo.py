"""Reference models for examples, tests and benchmarks: the seed's MLP, a GPT-2 style decoder, a
LLaMA style decoder (RMSNorm, RoPE-free for brevity, grouped-query attention, SwiGLU), a
ResNet-style CNN with BatchNorm, and a recommender with large embedding tables. Plain PyTorch,
written the way users write models; nothing here is special to autopar-nb.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


class SeedMLP(nn.Module):
    """The seed's MLP: Linear(1024, 1024) -> ReLU -> Linear(1024, 512)."""

    def __init__(self, d_in: int = 1024, d_hidden: int = 1024, d_out: int = 512):
        super().__init__()
        self.linear1 = nn.Linear(d_in, d_hidden)
        self.linear2 = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.linear2(F.relu(self.linear1(x)))


@dataclass
class GPTConfig:
    vocab_size: int = 50257
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_embd, self.head_dim = cfg.n_embd, cfg.n_embd // cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x):
        B, T, C = x.shape
        # nanoGPT's fused projection; under TP a rank holds [q_r|k_r|v_r] and n_embd is set per
        # rank. The heads are counted from the width (view(..., -1, head_dim)), as torchtitan's and
        # Hugging Face's attention do: a pipeline stage's trace fixes a head count read from an
        # attribute, where the -1 follows the rank's width
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        # (B, nh, T, hs)
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


class GPTMLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class GPTBlock(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = GPTMLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT-shaped decoder; the output head is untied so each layer owns its parameters (pipeline
    friendly)."""

    def __init__(self, cfg: GPTConfig | None = None):
        super().__init__()
        cfg = cfg or GPTConfig()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


@dataclass
class LlamaConfig:
    vocab_size: int = 128256
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    ffn_dim: int = 14336
    norm_eps: float = 1e-5


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * head_dim, cfg.dim, bias=False)
        self.head_dim = head_dim

    def forward(self, x):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = self.wk(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class LlamaFeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = LlamaAttention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = LlamaFeedForward(cfg)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """LLaMA-3 shaped decoder (torchtitan naming)."""

    def __init__(self, cfg: LlamaConfig | None = None):
        super().__init__()
        cfg = cfg or LlamaConfig()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens):
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


LLAMA3_8B = LlamaConfig()
LLAMA_70B = LlamaConfig(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                        ffn_dim=28672)


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                                            nn.BatchNorm2d(c_out))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet(nn.Module):
    """ResNet-style CNN with BatchNorm (torchvision naming, small by default)."""

    def __init__(self, widths=(16, 32, 64), blocks_per_stage: int = 2, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        c_in = widths[0]
        self.num_stages = len(widths)
        for i, w in enumerate(widths):  # layer1, layer2, ... as torchvision names them
            setattr(self, f"layer{i + 1}", nn.Sequential(*[
                BasicBlock(c_in if j == 0 else w, w, 2 if (j == 0 and i > 0) else 1)
                for j in range(blocks_per_stage)]))
            c_in = w
        self.fc = nn.Linear(widths[-1], num_classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        for i in range(self.num_stages):
            x = getattr(self, f"layer{i + 1}")(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class RecSys(nn.Module):
    """DLRM-style recommender: one embedding table per sparse feature, a dense MLP, dot-product
    interaction."""

    def __init__(self, table_sizes=(1_000_000, 100_000, 10_000), dim: int = 64, dense_in: int = 13):
        super().__init__()
        self.tables = nn.ModuleList(nn.Embedding(n, dim) for n in table_sizes)
        self.bottom = nn.Sequential(nn.Linear(dense_in, 128), nn.ReLU(), nn.Linear(128, dim))
        n = len(table_sizes) + 1
        self.top = nn.Sequential(nn.Linear(dim + n * (n - 1) // 2, 128), nn.ReLU(),
                                 nn.Linear(128, 1))

    def forward(self, dense, sparse):
        # dense: (B, dense_in) float, sparse: (B, num_tables) int ids
        feats = [self.bottom(dense)] + [t(sparse[:, i]) for i, t in enumerate(self.tables)]
        z = torch.stack(feats, dim=1)  # (B, n, dim)
        inter = torch.bmm(z, z.transpose(1, 2))
        i, j = torch.triu_indices(z.shape[1], z.shape[1], offset=1)
        return self.top(torch.cat([feats[0], inter[:, i, j]], dim=1))


# ---- Mixture of Experts --------------------------------------------------------------------------
# A DeepSeekMoE-style decoder: each MoE layer has shared experts every token goes through plus
# routed experts, of which a softmax top-k router picks k per token. The routed experts are stacked
# weights with the layout and forward signature of Hugging Face's experts modules (MixtralExperts,
# Qwen2MoeExperts, DeepseekV3Experts in transformers 5): gate_up_proj (E, 2*I, D), down_proj (E, D,
# I), forward(hidden (T, D), top_k_index (T, K), top_k_weights (T, K)).


@torch.library.custom_op("autopar_zoo::grouped_linear", mutates_args=())
def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows ``offs[g-1]:offs[g]`` of ``x`` (S, K) times ``weight[g].T`` (weight (G, N, K), nn.Linear
    layout) -> (S, N).

    A loop of matmuls, the portable form of ``torch.nn.functional.grouped_mm`` (which needs bf16 on
    CUDA, or 16-byte-aligned strides on CPU); as a custom op it traces on the meta device as one
    node that kernels_ext costs.
    """
    out = x.new_zeros(x.shape[0], weight.shape[1])
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = x[start:end] @ weight[g].T
        start = end
    return out


@grouped_linear.register_fake
def _(x, weight, offs):
    return x.new_empty(x.shape[0], weight.shape[1])


@torch.library.custom_op("autopar_zoo::grouped_linear_backward", mutates_args=())
def grouped_linear_backward(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                            grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`grouped_linear` with respect to ``x`` and ``weight``."""
    grad_x, grad_w = torch.zeros_like(x), torch.zeros_like(weight)
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            grad_x[start:end] = grad[start:end] @ weight[g]
            grad_w[g] = grad[start:end].T @ x[start:end]
        start = end
    return grad_x, grad_w


@grouped_linear_backward.register_fake
def _(x, weight, offs, grad):
    return torch.empty_like(x), torch.empty_like(weight)


def _grouped_linear_setup(ctx, inputs, output):
    x, weight, offs = inputs
    ctx.save_for_backward(x, weight)
    ctx.offs = offs


def _grouped_linear_grad(ctx, grad):
    x, weight = ctx.saved_tensors
    grad_x, grad_w = grouped_linear_backward(x, weight, ctx.offs, grad.contiguous())
    return grad_x, grad_w, None


grouped_linear.register_autograd(_grouped_linear_grad, setup_context=_grouped_linear_setup)


@dataclass
class MoEConfig:
    """DeepSeekMoE 16B by default (deepseek-ai/deepseek-moe-16b-base, config.json: 16.4B parameters,
    2.8B active per token); ``MIXTRAL_8X7B`` below is the same class without shared experts."""

    vocab_size: int = 102400
    dim: int = 2048
    n_layers: int = 28
    n_heads: int = 16
    n_kv_heads: int = 16
    ffn_dim: int = 10944
    """hidden width of the dense SwiGLU feed-forward of the first ``n_dense_layers`` layers"""
    n_dense_layers: int = 1
    """DeepSeek's first_k_dense_replace: leading layers with a dense feed-forward instead of
    experts"""
    n_routed_experts: int = 64
    n_shared_experts: int = 2
    """experts every token goes through, fused into one SwiGLU of width n_shared_experts *
    moe_ffn_dim (0: none)"""
    top_k: int = 6
    """routed experts per token"""
    moe_ffn_dim: int = 1408
    """hidden width of one expert"""
    norm_topk_prob: bool = False
    """renormalise the k chosen router probabilities to sum to 1 (Mixtral: yes, DeepSeekMoE: no)"""
    route_scale: float = 1.0
    """factor on the routing weights (DeepSeek-V3's routed_scaling_factor)"""
    norm_eps: float = 1e-6

    def _llama(self, ffn_dim: int) -> LlamaConfig:
        return LlamaConfig(vocab_size=self.vocab_size, dim=self.dim, n_layers=0,
                           n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, ffn_dim=ffn_dim,
                           norm_eps=self.norm_eps)


class TopKRouter(nn.Module):
    """Softmax over all experts (in fp32), the top k per token: returns (weights (T, K), expert ids
    (T, K))."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.top_k, self.norm_topk_prob, self.route_scale = (cfg.top_k, cfg.norm_topk_prob,
                                                             cfg.route_scale)
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.dim))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)  # nn.Linear's default

    def forward(self, x):
        probs = F.softmax(F.linear(x, self.weight).float(), dim=-1)  # (T, E)
        weights, index = torch.topk(probs, self.top_k, dim=-1)  # (T, K)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights * self.route_scale).to(x.dtype), index


class GroupedExperts(nn.Module):
    """E SwiGLU experts as stacked weights; each token-expert pair goes through its expert once
    (grouped matmuls over the pairs sorted by expert), so the work is that of k experts per token,
    not E."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.num_experts = cfg.n_routed_experts
        e, d, i = cfg.n_routed_experts, cfg.dim, cfg.moe_ffn_dim
        # [w1 | w3] of each expert, (out, in)
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, i))
        self.reset_parameters()

    def reset_parameters(self):
        # nn.Linear's default per expert: U(-1/sqrt(in), 1/sqrt(in))
        for w in (self.gate_up_proj, self.down_proj):
            nn.init.uniform_(w, -w.shape[-1] ** -0.5, w.shape[-1] ** -0.5)

    def forward(self, x, top_k_index, top_k_weights):
        T, K = top_k_index.shape
        flat = top_k_index.reshape(-1)  # (T*K,) expert of each token-expert pair
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert
        # histc, not bincount: its output size does not depend on the data, so it traces on the meta
        # device
        counts = torch.histc(flat.float(), bins=self.num_experts, min=0, max=self.num_experts - 1)
        offs = torch.cumsum(counts, dim=0).to(torch.int32)
        # (T*K, 2I)
        h = grouped_linear(x[order // K].to(self.gate_up_proj.dtype), self.gate_up_proj, offs)
        gate, up = h.chunk(2, dim=-1)
        y = grouped_linear(F.silu(gate) * up, self.down_proj, offs)  # (T*K, D)
        # back to (token, k) order, weighted
        y = y[torch.argsort(order)] * top_k_weights.reshape(-1, 1)
        return y.view(T, K, -1).sum(dim=1).to(x.dtype)


class MoE(nn.Module):
    """Shared experts (every token) + routed experts (k of E per token), DeepSeekMoE style."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.gate = TopKRouter(cfg)
        self.experts = GroupedExperts(cfg)
        self.shared_experts = (LlamaFeedForward(cfg._llama(cfg.n_shared_experts * cfg.moe_ffn_dim))
                               if cfg.n_shared_experts else None)

    def forward(self, x):
        B, T, D = x.shape
        h = x.reshape(-1, D)  # (B*T, D): routing is per token
        weights, index = self.gate(h)
        out = self.experts(h, index, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(h)
        return out.view(B, T, D)


class MoEBlock(nn.Module):
    def __init__(self, cfg: MoEConfig, layer_id: int):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = LlamaAttention(cfg._llama(cfg.ffn_dim))
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = (LlamaFeedForward(cfg._llama(cfg.ffn_dim))
                             if layer_id < cfg.n_dense_layers else MoE(cfg))

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class MoETransformer(nn.Module):
    """DeepSeekMoE-shaped decoder (LLaMA attention, torchtitan naming); ``layers.{i}.feed_forward``
    is a dense SwiGLU in the first ``n_dense_layers`` layers and an :class:`MoE` after them."""

    def __init__(self, cfg: MoEConfig | None = None):
        super().__init__()
        cfg = cfg or MoEConfig()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(MoEBlock(cfg, i) for i in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens):
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


DEEPSEEK_MOE_16B = MoEConfig()
MIXTRAL_8X7B = MoEConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                         ffn_dim=14336, n_dense_layers=0, n_routed_experts=8, n_shared_experts=0,
                         top_k=2, moe_ffn_dim=14336, norm_topk_prob=True, norm_eps=1e-5)
