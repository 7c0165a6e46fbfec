"""A hand-written FSDP2 (ZeRO-3) training script: the baseline bench/runtime.py compares the exported script with.

    torchrun --nproc-per-node 2 bench/handwritten_fsdp.py --steps 30

Same model, data and loss as the cell in bench/runtime.py; written the way one would write it by hand.
"""

import argparse
import gc
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

VOCAB, D, N_LAYER, BATCH, SEQ = 2048, 128, 4, 8, 64


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab=VOCAB, d=D, n_layer=N_LAYER):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_layer))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device, (world,))

    torch.manual_seed(0)
    model = TinyLM().to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)

    for step in range(args.steps):
        t0 = time.perf_counter()
        for group in optimizer.param_groups:  # cosine decay to a tenth of the peak over the run
            group["lr"] = 1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        g = torch.Generator().manual_seed(1_000_003 * step + rank)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(device)
        logits = model(tokens)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())  # the next token
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        dt = time.perf_counter() - t0
        if rank == 0:
            print(f"step {step} | loss {loss.item():.4f} | {dt * 1e3:.1f} ms", flush=True)
    gc.collect()  # before destroy: a gloo thread taking the GIL at exit can abort the process
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
