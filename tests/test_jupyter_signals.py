"""Jupyter's signals and a background run (issue 17 point 2), sent exactly as jupyter_client sends them: the kernel is
started in its own session, Interrupt kernel is ``os.killpg(pgid, SIGINT)`` and a forced kill
``os.killpg(pgid, SIGKILL)``. The interrupt stops the cell, not the run; the forced kill takes every process of the
run with it within seconds."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from autopar_nb.launch.procs import processes_with_token

FIXTURE = Path(__file__).parent / "fixtures" / "train_fixture.py"
REPO = Path(__file__).parent.parent

KERNEL = textwrap.dedent("""
    import sys, time
    from autopar_nb.launch import launch
    run = launch(sys.argv[1], nproc=2, steps=10_000, sleep=0.05, warm=sys.argv[2] == "warm")
    while run.status != "running":
        time.sleep(0.05)
    token = run._token
    while True:  # a kernel between cells; an interrupt raises KeyboardInterrupt in its main thread, as ipykernel's does
        try:
            if token:
                print(token, flush=True)
                token = None
            time.sleep(600)
        except KeyboardInterrupt:
            time.sleep(1.0)  # the run gets a moment to fail, if the signal reached it
            print(run.status, flush=True)
""")


def _wait_for(cond, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["warm", "cold"])
def test_interrupt_spares_the_run_and_a_forced_kill_ends_it(mode):
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL, str(FIXTURE), mode], stdout=subprocess.PIPE, text=True,
                              cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
    token = ""
    try:
        token = kernel.stdout.readline().strip()
        assert re.fullmatch(r"[0-9a-f]{32}", token), token
        before = {p.pid for p in processes_with_token(token)}
        os.killpg(kernel.pid, signal.SIGINT)  # Interrupt kernel
        status = kernel.stdout.readline().split()
        assert status and status[0] == "running", status
        assert {p.pid for p in processes_with_token(token)} == before  # every process of the run is still there
        os.killpg(kernel.pid, signal.SIGKILL)  # a forced kill of the kernel's process group
        took = _wait_for(lambda: not processes_with_token(token), 10, "every process of the run to end")
        assert took < 5, took
    finally:
        if kernel.poll() is None:
            os.killpg(kernel.pid, signal.SIGKILL)
        kernel.wait()
        for p in processes_with_token(token) if token else []:
            p.kill()
