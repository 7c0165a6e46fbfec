"""Which rank failed first (pure; the Run acts on the answer).

When one rank dies, its peers fail soon after in their next collective ("Connection closed by peer"
from gloo, an NCCL communicator error, or torch's agent ending them): those are consequences, not
causes. Failures are ordered by the time the launcher saw them (a rank's error message, or its
connection closing without one); among failures seen within ``SAME_TIME_S`` of the first, one whose
error does not read like a vanished peer's consequence wins.
"""

from __future__ import annotations

from .metrics import RankState

SAME_TIME_S = 0.05
"""failures seen this close together are not told apart by time (one poll of the channel can hold
both)"""
KNOCK_ON = ("connection closed by peer", "connection reset by peer", "broken pipe",
            "socket timeout", "nccl communicator was aborted", "ncclremoteerror",
            "watchdog caught collective operation timeout", "process group has been destroyed",
            "signalexception", "terminated by signal", "keyboardinterrupt")
"""what the error of a rank whose peer vanished says (lower case); KeyboardInterrupt: torch starts
each worker with SIGINT as its parent-death signal, and workers run in sessions of their own (no
terminal's Ctrl-C reaches them)"""


def knock_on(error: str) -> bool:
    """Whether an error message reads like the consequence of another rank's death."""
    text = error.lower()
    return any(k in text for k in KNOCK_ON)


def failure_order(ranks: dict[int, RankState]) -> list[int]:
    """The ranks that failed (``RankState.error`` set), the cause first, then the others in time
    order."""
    failed = sorted((r for r, s in ranks.items() if s.error is not None),
                    key=lambda r: (ranks[r].failed_at or 0.0, r))
    if not failed:
        return []
    first = failed[0]
    if knock_on(ranks[first].error.get("error", "")):
        t0 = ranks[first].failed_at or 0.0
        for r in failed[1:]:
            if (ranks[r].failed_at or 0.0) - t0 > SAME_TIME_S:
                break
            if not knock_on(ranks[r].error.get("error", "")):
                first = r
                break
    return [first, *(r for r in failed if r != first)]
