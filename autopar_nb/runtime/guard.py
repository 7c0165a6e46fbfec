"""The numerics guard: a step whose loss or gradients are not finite, or whose loss spikes far above
the recent ones, is skipped on every rank at once; several in a row roll the weights back to the
last checkpoint.

Large runs check every step (Megatron-LM looks for NaN in the loss and the gradients; PaLM restarted
from a checkpoint before a spike and skipped the batches around it). The verdict is one all-reduce
of three flags, so every rank skips the same steps even where only one rank's gradients went bad.
Skipped steps leave the weights and the optimizer state as they were (the next step is what a run
that never saw the bad batch would take, at its step count), and several in a row say the weights
themselves went bad: the run reloads the last checkpoint and goes on with the next batches (those
since the checkpoint are not replayed, as PaLM skipped them)."""

from __future__ import annotations

import collections
import math
import statistics

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

SPIKE_WINDOW = 20
"""the running median of the loss is over this many of the latest applied steps ..."""
SPIKE_WARMUP = 10
"""... and spikes count once it holds this many (the first steps' losses fall fast: no median
yet)"""
SPIKE_SIGMAS = 6.0
"""... and a spike also lies this many of the window's own standard deviations above its median, in
log space (the deviation estimated robustly, 1.4826 x the median absolute deviation): losses that
already swing by several times from step to step, as a regression's near zero do, are not each
other's spikes. OLMo-core's SkipStepOptimizer skips a step 6 standard deviations above its rolling
window's mean; in log space the rule does not depend on the loss's scale"""


def grads_finite(params: list) -> bool:
    """Whether this rank's gradients (its shards of DTensor ones) are all finite: their 2-norm
    is."""
    local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params
             if p.grad is not None]
    return not local or bool(torch.isfinite(torch.nn.utils.get_total_norm(local)))


class NumericsGuard:
    """Which steps to skip (:meth:`verdict`, collective) and when to roll back (:attr:`skips`
    reaching ``max_skips``). ``spike_factor``: a loss above this times the running median of the
    last :data:`SPIKE_WINDOW` applied steps' is a spike (0: no spike check), or above more where
    those losses spread wider (:data:`SPIKE_SIGMAS`); ``max_skips``: skipped steps in a row after
    which the run rolls back (0: the guard is off, every step is applied)."""

    def __init__(self, *, spike_factor: float, max_skips: int):
        self.spike_factor, self.max_skips = spike_factor, max_skips
        self.losses: collections.deque = collections.deque(maxlen=SPIKE_WINDOW)
        self.skips = 0
        """steps skipped in a row"""

    @property
    def on(self) -> bool:
        return self.max_skips > 0

    def spike(self, loss: float) -> tuple[float, float] | None:
        """(the running median, the factor) when ``loss`` is more than that factor times the median:
        ``spike_factor``, or more where the window's losses spread wider (:data:`SPIKE_SIGMAS`);
        None: not a spike, or too early."""
        if not self.spike_factor or len(self.losses) < SPIKE_WARMUP or not math.isfinite(loss):
            return None
        median = statistics.median(self.losses)
        # a loss that reaches zero or below has no scale to spike from
        if median <= 0 or min(self.losses) <= 0:
            return None
        logs = [math.log(x) for x in self.losses]
        spread = 1.4826 * statistics.median(abs(x - math.log(median)) for x in logs)
        factor = max(self.spike_factor, math.exp(SPIKE_SIGMAS * spread))
        return (median, factor) if loss > factor * median else None

    def verdict(self, loss: float, *, grads_ok: bool, device: str) -> str | None:
        """Why this step is skipped, the same text on every rank (None: apply it). ``loss``: the
        global batch's (equal on every rank); ``grads_ok``: this rank's gradients are finite.
        Collective: every rank calls it."""
        spike = self.spike(loss)
        flags = torch.tensor([not math.isfinite(loss), not grads_ok, spike is not None],
                             dtype=torch.float32, device=device)
        # a rank's bad gradients skip the step everywhere
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        bad_loss, bad_grads, spiked = flags.tolist()
        if not (bad_loss or bad_grads or spiked):
            self.losses.append(loss)
            self.skips = 0
            return None
        self.skips += 1
        return ("non-finite loss" if bad_loss else "non-finite gradients" if bad_grads
                else f"loss spike ({loss:.4g} > {spike[1]:.3g} x median {spike[0]:.4g})")

    def rolled_back(self) -> None:
        """After a roll-back: the count starts over, and so does the median (the loss may have moved
        for good)."""
        self.skips = 0
        self.losses.clear()
