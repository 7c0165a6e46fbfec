"""Child of bench/gpu_check.py (CUDA is initialised here, not in the checker): tokens/s and MFU of a LLaMA 1B
training step in bf16 on one GPU, eager vs ``torch.compile`` per block vs compile + kernels_ext's fused
linear + cross-entropy and RMSNorm. Prints one JSON line: [{"variant", "tokens_per_s", "mfu"}, ...]."""

from __future__ import annotations

import json
import time

import torch
import torch.nn.functional as F

import kernels_ext
from autopar_nb import zoo
from autopar_nb.hardware import Cluster
from autopar_nb.runtime.compile import apply_compile

CFG = zoo.LlamaConfig(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192)
BATCH, SEQ, STEPS, WARMUP = 4, 2048, 10, 3


def build(variant: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = zoo.Llama(CFG).cuda()
    if "fused" in variant:  # kernels_ext's RMSNorm in place of nn.RMSNorm (same weight)
        for module in list(model.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, torch.nn.RMSNorm):
                    norm = kernels_ext.RMSNorm(child.weight.shape[0], child.eps).cuda()
                    norm.load_state_dict(child.state_dict())
                    setattr(module, name, norm)
    if "compile" in variant:
        apply_compile(model, "layers.*")
    return model


def loss_of(model, tokens, fused: bool):
    if not fused:
        return F.cross_entropy(model(tokens)[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    x = model.tok_embeddings(tokens)
    for layer in model.layers:
        x = layer(x)
    hidden = model.norm(x)[:, :-1]
    return kernels_ext.linear_cross_entropy(hidden, model.output.weight, tokens[:, 1:])


def measure(variant: str, peak: float) -> dict:
    model = build(variant)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, CFG.vocab_size, (BATCH, SEQ), device="cuda")
    for step in range(WARMUP + STEPS):
        if step == WARMUP:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_of(model, tokens, "fused" in variant)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / STEPS
    params = sum(p.numel() for p in model.parameters())
    attn = 12 * CFG.n_layers * CFG.dim * SEQ  # per token, causal attention counted as in torchtitan's estimate
    flops = (6 * params + attn) * BATCH * SEQ
    del model, opt
    torch.cuda.empty_cache()
    return {"variant": variant, "tokens_per_s": BATCH * SEQ / dt, "mfu": flops / dt / peak}


def main() -> None:
    peak = Cluster.detect().device.flops("bfloat16")
    rows = [measure(v, peak) for v in ("eager", "compile per block", "compile + fused kernels")]
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
