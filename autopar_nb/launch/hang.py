"""Hang detection: which rank has made no step progress for too long (pure; the Run acts on the answer).

A rank that has not connected yet is still starting (importing torch, building the model): it gets
``STARTUP_TIMEOUT_S`` at least. While no rank at all has connected, the script may simply not speak the metrics
protocol: that is no hang.
"""

from __future__ import annotations

from .metrics import RankState

STARTUP_TIMEOUT_S = 120.0
"""seconds a rank may take to connect to the metrics channel before the hang check counts it as stalled"""


def stalled_rank(ranks: dict[int, RankState], *, now: float, t0: float, timeout: float) -> tuple[int, float] | None:
    """(rank, seconds without progress) of the longest-stalled rank when any rank exceeds its limit, else None.
    Call only once some rank has connected (see the module docstring)."""
    limit = {r: timeout if s.connected else max(timeout, STARTUP_TIMEOUT_S) for r, s in ranks.items()}
    stalled = {r: now - max(s.last_progress, t0) for r, s in ranks.items() if not s.done}
    if not any(t >= limit[r] for r, t in stalled.items()):
        return None
    worst = max(stalled, key=stalled.get)
    return worst, stalled[worst]


def hang_message(ranks: dict[int, RankState], worst: int, seconds: float, timeout: float) -> str:
    steps = ", ".join(f"rank {r}: {'-' if s.step is None else s.step}" for r, s in ranks.items())
    return (f"hung: no step progress on rank {worst} for {seconds:.1f} s (hang_timeout_s={timeout}); last step per "
            f"rank: {steps}; tearing down")


def silent_message() -> str:
    """The status line when no rank has connected after STARTUP_TIMEOUT_S."""
    return (f"no rank has reported metrics after {STARTUP_TIMEOUT_S:.0f} s: does the script implement the metrics "
            "protocol (AUTOPAR_METRICS)? See run.logs(0)")
