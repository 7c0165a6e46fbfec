"""The worker's death signal under torchrun, set by the exported script in its first lines, before
torch's import (so standard library only: an agent may die while its worker imports torch), and
again by ``mesh.init_distributed``.

torchrun starts workers in sessions of their own and sets no death signal, so a worker whose agent
was SIGKILLed (a killed job step, an OOM-killed agent) trained on as an orphan with the other nodes:
nothing restarted the group, and nothing ended it. Killed with its agent, its peers' collectives
fail and their agents restart the group. SIGKILL, not SIGTERM: a rank blocked in a collective never
runs a Python handler. libc's prctl(PR_SET_PDEATHSIG) through ctypes, as
``torch.multiprocessing.spawn`` sets it through torch (Linux only).

The function imports what it needs itself: its source is copied verbatim above the script's imports
and the user's cell, whose own module-level ``import os`` would otherwise redefine names only the
function used (ruff F811).
"""

from __future__ import annotations


def end_with_the_agent() -> None:
    """Under torchrun, have the kernel SIGKILL this worker when the process that started it dies."""
    import ctypes
    import os
    import signal
    import sys
    if "TORCHELASTIC_RESTART_COUNT" in os.environ and sys.platform == "linux":
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG (<linux/prctl.h>)
