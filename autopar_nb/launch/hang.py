"""Hang detection: which rank has made no step progress for too long (pure; the Run acts on the
answer).

A rank that has not connected yet is still starting (importing torch, building the model): it gets
``STARTUP_TIMEOUT_S`` at least. While no rank at all has connected, the script may simply not speak
the metrics protocol: that is no hang.
"""

from __future__ import annotations

from .metrics import RankState

STARTUP_TIMEOUT_S = 120.0
"""seconds a rank may take to connect to the metrics channel before the hang check counts it as
stalled"""


def stalled_rank(ranks: dict[int, RankState], *, now: float, t0: float,
                 timeout: float) -> tuple[int, float] | None:
    """(rank, seconds without progress) of the rank that stopped reporting first, once any rank
    exceeds its limit, else None: the lowest last step, then the earliest last report (a rank stuck
    before a collective leaves its peers waiting in it, one step on at most). Call only once some
    rank has connected (see the module docstring)."""
    limit = {r: timeout if s.connected else max(timeout, STARTUP_TIMEOUT_S)
             for r, s in ranks.items()}
    stalled = {r: now - max(s.last_progress, t0) for r, s in ranks.items() if not s.done}
    if not any(t >= limit[r] for r, t in stalled.items()):
        return None
    first = min(stalled,
                key=lambda r: (-1 if ranks[r].step is None else ranks[r].step, -stalled[r], r))
    return first, stalled[first]


def innermost_frame(stack: str) -> tuple[str, str] | None:
    """(file, function) of the innermost frame of a faulthandler dump's current thread (else its
    first thread)."""
    block = stack.split("Current thread", 1)[1] if "Current thread" in stack else stack
    for line in block.splitlines():
        line = line.strip()
        if line.startswith('File "') and " in " in line:
            return line.split('"')[1].replace("\\", "/"), line.rsplit(" in ", 1)[1]
    return None


def waited_for(ranks: dict[int, RankState], first: int, stacks: dict[int, str]) -> int:
    """The rank the others wait for, from their stacks: among the ranks whose last step is
    ``first``'s (they stopped together, so time cannot tell), one whose current frame is outside
    torch (its data loader, the cell's code) while another's is inside torch (a collective, a
    backward whose hooks all-reduce). Else ``first``."""
    tied = [r for r, s in ranks.items() if not s.done and s.step == ranks[first].step
            and r in stacks]
    frames = {r: innermost_frame(stacks[r]) for r in tied}
    outside = [r for r in tied if frames[r] and "/torch/" not in frames[r][0]]
    inside = [r for r in tied if frames[r] and "/torch/" in frames[r][0]]
    return first if not (outside and inside) or first in outside else min(outside)


def hang_message(ranks: dict[int, RankState], first: int, seconds: float, timeout: float,
                 stacks: dict[int, str] | None = None) -> str:
    step = ranks[first].step
    last = "before any step" if step is None else f"after step {step}"
    steps = ", ".join(f"rank {r}: {'-' if st.step is None else st.step}" for r, st in ranks.items())
    where = ""
    frame = innermost_frame((stacks or {}).get(first, ""))
    if frame and "/torch/" not in frame[0]:
        waiting = [r for r, t in (stacks or {}).items()
                   if "/torch/" in (innermost_frame(t) or ("/torch/",))[0]]
        where = f"; it is in {frame[1]}" + (f", while rank{'s' if len(waiting) > 1 else ''} "
                                            f"{', '.join(map(str, waiting))} "
                                            f"wait{'' if len(waiting) > 1 else 's'} inside torch"
                                            if waiting else "")
    return (f"hung: rank {first} stopped reporting first ({last}; no step progress for "
            f"{seconds:.1f} s, hang_timeout_s={timeout}{where}); last step per rank: {steps}; "
            "tearing down")


def silent_message() -> str:
    """The status line when no rank has connected after STARTUP_TIMEOUT_S."""
    return (f"no rank has reported metrics after {STARTUP_TIMEOUT_S:.0f} s: does the script "
            "implement the metrics protocol (AUTOPAR_METRICS)? See run.logs(0)")
