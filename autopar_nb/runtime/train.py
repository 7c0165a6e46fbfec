"""The training loop: batches, forward/backward (gradient accumulation or a pipeline schedule),
clipping, the optimizer step with its learning-rate schedule, metrics and checkpoints."""

from __future__ import annotations

import contextlib
import math
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .checkpoint import (
    PipelineStages,
    async_checkpointer,
    latest_checkpoint,
    load_checkpoint,
    resume_point,
    save_checkpoint,
)
from .data import first_tensor, split_batch, to_device
from .guard import NumericsGuard, grads_finite
from .metrics import Metrics, Run, memory_stats
from .optim import clip_grad_norm, lr_factor, parameters_of
from .units import fmt_time


def switch_off_kv_cache(model: nn.Module) -> list:
    """Switch off the key/value cache of a Hugging Face model (every ``config.use_cache`` under
    ``model``) and return the configs that had it on. Training never reads the cache, yet with it on
    every attention layer hands back a copy of its keys and values with the output (memory held for
    the whole step), and recompute runs the layer again and appends to it. Capture traces without it
    too, so the plan costs what the script runs."""
    configs = {id(c): c for m in model.modules()
               if getattr(c := getattr(m, "config", None), "use_cache", 0) is True}
    for config in configs.values():
        config.use_cache = False
    return list(configs.values())


def set_grad_sync(model: nn.Module, *, last: bool, zero_stage: int) -> None:
    """Before each micro-batch of gradient accumulation: replicated data parallelism (ZeRO-0: DDP,
    or FSDP2's replicate beside TP) all-reduces only the last micro-batch's gradients (``no_sync``
    before it); FSDP keeps the parameters gathered until the last one under ZeRO 1 and 2 (one
    all-gather per step), and reduce-scatters every micro-batch under ZeRO 2 and 3 but only the last
    under ZeRO-1, which accumulates the unsharded gradients in ``reduce_dtype`` until then
    (Megatron's distributed optimizer: one reduce-scatter per step, as torch's PipelineStage drives
    FSDP). The cost model counts the same."""
    if hasattr(model, "require_backward_grad_sync"):  # DDP
        model.require_backward_grad_sync = last
        return
    # replicate, or ZeRO-1's FSDP2
    if zero_stage <= 1 and hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(last)
    if zero_stage in (1, 2) and hasattr(model, "set_reshard_after_backward"):  # FSDP2
        model.set_reshard_after_backward(last)


def accumulate(model: nn.Module, batch, *, micro_batches: int, loss_fn, context, scaler=None,
               zero_stage: int = 0, shard=None) -> torch.Tensor:
    """Forward and backward of ``batch`` in ``micro_batches`` pieces, gradients summed; returns the
    batch's loss on this rank. ``context()``: what each piece runs under (autocast, loss_parallel);
    ``shard(piece)``: one that yields this rank's part of it (context parallelism's
    ``sequence_shards``)."""
    total = 0.0
    for i, micro in enumerate(split_batch(batch, micro_batches)):
        set_grad_sync(model, last=i == micro_batches - 1, zero_stage=zero_stage)
        with context(), (shard(micro) if shard is not None
                         else contextlib.nullcontext(micro)) as piece:
            loss = loss_fn(model, piece) / micro_batches
            (scaler.scale(loss) if scaler is not None else loss).backward()
        total += (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach().float()
    return total


def global_loss(local: torch.Tensor, *, counts: bool, dp: int) -> float:
    """The global batch's loss: the mean over data-parallel ranks of the last stage's loss, counted
    once per replica (``counts``: this rank is TP rank 0 on the last stage). Collective: every rank
    calls it."""
    buf = local.detach().clone() if counts else torch.zeros_like(local)
    dist.all_reduce(buf)
    return buf.item() / dp


def train(args, parts: list, optimizer, *, forward_backward, make_batch, dp_rank: int, device: str,
          dp: int, counts_loss: bool, metrics=None, scaler=None, pp_group=None, tied=None,
          tokens: bool = False, observer=None, cp: int = 1) -> None:
    """Run ``args.steps`` optimizer steps (resuming from the latest whole checkpoint in
    ``args.ckpt_dir``, saving one every ``args.ckpt_every`` steps and keeping ``args.keep``, in the
    background unless ``args.async_checkpoint`` says "off" (:func:`async_checkpointer`); ending
    early at step ``args.stop_at`` when given: the learning-rate schedule still spans
    ``args.steps``). The numerics guard (``runtime/guard.py``) skips steps with a non-finite loss or
    gradient, or a loss ``args.spike_factor`` (or more) times its running median, and rolls back to
    the last checkpoint after ``args.max_skips`` in a row.

    ``forward_backward(batch)`` returns this rank's loss with gradients accumulated;
    ``make_batch(step, dp_rank)`` this data-parallel rank's share (None: a middle pipeline stage
    reads none; a ``DataStream`` is checkpointed). ``tied``: parameters tied across pipeline stages
    (:class:`TiedGradients`); ``cp``: ranks splitting a sequence, each loss its share times cp
    (``runtime/cp.py``). ``metrics``: the launcher's stream (default: that of the open
    :func:`distributed` block); ``observer`` (verify's and measure's; default: ``Run.observer``):
    ``after_backward(step, parts, loss)`` and ``after_step(step, parts)``, called on every rank."""
    metrics = metrics or Run.current or Metrics(dist.get_rank())
    observer = observer or Run.observer
    ckpt_model = parts[0] if len(parts) == 1 else PipelineStages(parts)
    # a dataset's stream: its position is saved
    data = make_batch if hasattr(make_batch, "state_dict") else None
    start = 0
    if (resume := resume_point(args.ckpt_dir)) is not None:
        start = load_checkpoint(resume, ckpt_model, optimizer, data=data)
        if dist.get_rank() == 0:
            print(f"resumed from {resume} at step {start}")
    params = parameters_of(parts)
    guard = NumericsGuard(spike_factor=args.spike_factor, max_skips=args.max_skips)
    saver = (async_checkpointer(args.async_checkpoint, params, device=device) if args.ckpt_dir
             else None)
    # seconds waiting for batches, and in all, over the steps after this run's first
    waited = busy = 0.0
    for step in range(start, min(args.steps, args.stop_at or args.steps)):
        t0 = time.perf_counter()
        # this rank's share
        batch = None if make_batch is None else to_device(make_batch(step, dp_rank), device)
        data_wait = time.perf_counter() - t0
        for group in optimizer.param_groups:
            group["lr"] = args.lr * lr_factor(step, warmup=args.warmup, total=args.steps,
                                              schedule=args.lr_schedule,
                                              min_ratio=args.min_lr_ratio)
        loss = global_loss(forward_backward(batch), counts=counts_loss, dp=dp * cp)
        if tied is not None:
            tied.sync()
        if observer is not None:
            observer.after_backward(step, parts, loss)
        if scaler is not None:
            scaler.unscale_(optimizer)
        norm = clip_grad_norm(params, args.grad_clip, pp_group=pp_group,
                              repeated=tied.repeated() if tied else ()) \
            if args.grad_clip else None
        # the loss scaler skips a step whose gradients overflowed itself (and lowers the scale): not
        # the guard's
        grads_ok = scaler is not None or (bool(norm.isfinite()) if norm is not None
                                          else grads_finite(params))
        skipped = guard.verdict(loss, grads_ok=grads_ok, device=device) if guard.on else None
        apply_step(optimizer, scaler, skip=skipped is not None)
        if observer is not None:
            observer.after_step(step, parts)
        dt = time.perf_counter() - t0
        # the first starts the loader
        waited, busy = (waited + data_wait, busy + dt) if step > start else (0.0, 0.0)
        report(step, loss, dt, batch, metrics=metrics, device=device, dp=dp, tokens=tokens,
               data_wait=data_wait, skipped=skipped and f"{skipped}, {guard.skips} in a row")
        if skipped and guard.skips >= guard.max_skips:
            # the save in flight: done first
            saved(args, saver.wait() if saver else None, metrics=metrics)
            roll_back(args, ckpt_model, optimizer, step=step,
                      why=f"{guard.skips} steps in a row skipped, the last for {skipped}",
                      metrics=metrics)
            guard.rolled_back()
        # not weights gone bad
        if args.ckpt_dir and (step + 1) % args.ckpt_every == 0 and not guard.skips:
            save(args, ckpt_model, optimizer, step + 1, data=data, metrics=metrics, saver=saver)
    # the last save written before the group closes
    saved(args, saver.close() if saver else None, metrics=metrics)
    data_summary(waited, busy, loader=data is not None, metrics=metrics, device=device)


def apply_step(optimizer, scaler, *, skip: bool) -> None:
    """The optimizer step, unless the numerics guard skips it; the gradients zeroed either way. With
    a loss scaler, ``update`` follows every ``unscale_`` (the scaler requires it), a skipped step's
    too."""
    if scaler is not None:
        if not skip:
            scaler.step(optimizer)
        scaler.update()
    elif not skip:
        optimizer.step()
    optimizer.zero_grad()


def roll_back(args, model, optimizer, *, step: int, why: str, metrics) -> None:
    """Reload the weights and optimizer state of the newest whole checkpoint after steps skipped in
    a row; the data goes on with the next batches (those since the checkpoint are not replayed).
    Without one, stop: raise on every rank. Collective."""
    path = resume_point(args.ckpt_dir)
    if path is None:
        raise RuntimeError(f"step {step}: {why}, and there is no checkpoint to roll back to (run "
                           "with --ckpt-dir DIR --ckpt-every K; --max-skips N sets how many "
                           "skipped steps in a row roll back): stopping")
    load_checkpoint(path, model, optimizer)  # no data: the stream is not rewound
    text = f"step {step} | rolled back to {path} ({why}); going on with the next batches"
    if dist.get_rank() == 0:
        print(text, flush=True)
        metrics.send({"event": "numerics", "step": step, "action": "rollback", "checkpoint": path,
                      "message": text})


def save(args, model, optimizer, step: int, *, data, metrics, saver=None) -> None:
    """Checkpoint ``step`` into ``args.ckpt_dir``, keeping the newest ``args.keep``, through
    ``saver`` (an :class:`AsyncCheckpointer`) when given; a save that failed is said in one line and
    the run goes on (the checkpoint before stays the latest). Collective."""
    path = f"{args.ckpt_dir}/step_{step}"
    if saver is not None:
        saved(args, saver.save(path, model, optimizer, step, data=data, keep=args.keep),
              metrics=metrics)
    else:
        saved(args,
              (step, save_checkpoint(path, model, optimizer, step, data=data, keep=args.keep)),
              metrics=metrics)


def saved(args, outcome: tuple[int, str | None] | None, *, metrics) -> None:
    """Say a failed save, ``outcome`` = (its step, why), in one line on rank 0 (an event too)."""
    if outcome is not None and outcome[1] is not None and dist.get_rank() == 0:
        step, error = outcome
        text = (f"step {step} | checkpoint not saved ({error}); the latest stays "
                f"{latest_checkpoint(args.ckpt_dir)}")
        print(text, flush=True)
        metrics.send({"event": "checkpoint", "step": step, "action": "failed", "message": text})


def report(step: int, loss: float, dt: float, batch, *, metrics, device: str, dp: int, tokens: bool,
           data_wait: float = 0.0, skipped: str | None = None) -> None:
    """Print the step on rank 0 and stream it to the launcher (loss, time, throughput, data wait,
    memory); ``skipped``: why the numerics guard skipped it (an event too)."""
    if dist.get_rank() == 0:
        print(f"step {step} | loss {loss:.5g} | {fmt_time(dt)}"
              + (f" | skipped: {skipped}" if skipped else ""), flush=True)
        if skipped:
            metrics.send({"event": "numerics", "step": step, "action": "skip",
                          "message": f"step {step} skipped: {skipped}"})
    # no batch: a pipeline stage between the first and the last
    first, rate = first_tensor(batch), {}
    if first is not None:
        rate[("tokens_per_s" if tokens else "samples_per_s")] = (first.numel() if tokens
                                                                 else first.shape[0]) * dp / dt
    metrics.send({"step": step, "loss": loss if math.isfinite(loss) else None, "step_time_s": dt,
                  **rate, "data_wait_s": data_wait, **memory_stats(device)})


# the share of step time waiting for batches above which data loading is the bottleneck
DATA_BOUND = 0.1


def data_summary(waited: float, busy: float, *, loader: bool, metrics, device: str) -> None:
    """Say whether data loading held training back: the largest share of step time (``busy`` s) a
    rank waited for batches (``waited`` s), above DATA_BOUND with remedies. Collective: every rank
    calls it (on ``device``: NCCL)."""
    dist.all_reduce(share := torch.tensor([waited / busy if busy else 0.0], device=device),
                    op=dist.ReduceOp.MAX)
    # the slowest rank's: the others wait for its batch at the step's collectives
    share = share.item()
    fix = ("more DataLoader workers (--num-workers), a deeper --prefetch-factor, pinned memory "
           "(GPUs), samples tokenised ahead of time" if loader
           else "a faster make_batch (precompute, or a dataset with workers)")
    text = (f"data loading is the bottleneck: a rank waited {share:.0%} of its step time for "
            f"batches; try {fix}" if share > DATA_BOUND
            else f"data wait: {share:.1%} of step time on the slowest rank (not the bottleneck)")
    if dist.get_rank() == 0 and busy:
        print(text, flush=True)
    metrics.send({"event": "data", "data_wait_share": share, "bottleneck": share > DATA_BOUND,
                  "message": text})


def print_parameter_counts(parts: list) -> None:
    """Print how many parameter elements every rank holds (collective: every rank calls it)."""
    mine = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel()
               for p in parameters_of(parts))
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, mine)
    if dist.get_rank() == 0:
        for rank, n in enumerate(counts):
            print(f"rank {rank}: {n:,} parameters")
