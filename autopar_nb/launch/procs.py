"""Finding and ending the processes of a run with psutil.

torch's agent starts every worker in its own session (``start_new_session=True``), so killing the
agent's process group does not reach the workers; and a worker whose agent was SIGKILLed is
re-parented and lost to a tree walk. The agent (and a warm pool's standby) is started in its own
session too: Jupyter's Interrupt kernel signals the kernel's whole process group (``os.killpg(pgid,
SIGINT)``), which must interrupt the cell, not a background run; a forced kill of that group takes
the kernel only, and the agent, which watches its parent, then ends the run. Every process of a run
therefore carries the run's ``AUTOPAR_TOKEN`` in its environment, and the last step of a teardown
looks for that token in the whole process table.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import psutil

TOKEN_ENV = "AUTOPAR_TOKEN"


def processes_with_token(token: str) -> list[psutil.Process]:
    """Every live process whose environment has ``AUTOPAR_TOKEN=token`` (the agent and its
    workers)."""
    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(TOKEN_ENV) == token and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (psutil.Error, OSError):
            continue
    return out


def rank_of(p: psutil.Process) -> int | None:
    """The rank of a worker process: its ``RANK`` variable (a worker torch's agent started with
    ``exec``), else the rank whose log its standard output is (a worker forked from a forkserver,
    warm: ``/proc/PID/environ`` shows the environment the forkserver was started with, not what
    torch set after the fork; torch's agent points each rank's stdout at
    ``.../attempt_<n>/<local_rank>/stdout.log``, and local rank == rank on one node). None for any
    other process (the forkserver, multiprocessing's resource tracker)."""
    rank = p.environ().get("RANK")
    if rank is not None:
        return int(rank)
    for f in p.open_files():
        parts = Path(f.path).parts
        if (f.fd == 1 and len(parts) >= 3 and parts[-1] == "stdout.log"
            and parts[-3].startswith("attempt_")):
            return int(parts[-2])
    return None


def workers_of(agent: psutil.Process) -> dict[int, psutil.Process]:
    """rank -> worker process among the agent's descendants (see :func:`rank_of`)."""
    out = {}
    try:
        children = agent.children(recursive=True)
    except psutil.Error:
        return out
    for p in children:
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            rank = rank_of(p)
            if rank is not None:
                out[rank] = p
        except (psutil.Error, OSError, ValueError):
            continue
    return out


def terminate(agent, token: str, *, grace_s: float = 2.5) -> list[int]:
    """End the agent (a ``subprocess.Popen``, or None) and every worker of the run: SIGTERM to the
    agent (torch's handler forwards it to the workers), SIGKILL to whatever is left after
    ``grace_s``, and a final sweep by token. Returns the pids that had to be SIGKILLed. Takes at
    most about ``grace_s + 1`` seconds."""
    deadline = time.monotonic() + grace_s
    known: dict[int, psutil.Process] = {}
    if agent is not None and agent.poll() is None:
        try:
            known = {p.pid: p for p in psutil.Process(agent.pid).children(recursive=True)}
        except psutil.Error:
            pass
    for p in processes_with_token(token):
        if agent is None or p.pid != agent.pid:
            known.setdefault(p.pid, p)
    killed = []
    if agent is not None and agent.poll() is None:
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            agent.kill()
            killed.append(agent.pid)
            agent.wait(timeout=1.0)
    # what the agent did not end: workers of a killed agent, and (warm) its forkserver, which would
    # otherwise unload torch before it goes
    for p in known.values():
        if running(p):
            try:
                p.send_signal(signal.SIGTERM)
            except psutil.Error:
                pass
    alive = wait_gone(list(known.values()), deadline)
    # anything started meanwhile (a restart racing the stop) carries the token too
    left = {p.pid: p for p in alive}
    for p in processes_with_token(token):
        left.setdefault(p.pid, p)
    for p in left.values():
        try:
            p.kill()
        except psutil.Error:
            pass
    wait_gone(list(left.values()), time.monotonic() + 1.0)
    return killed + sorted(left)


def running(p: psutil.Process) -> bool:
    """Alive and not a zombie: a process that ended but that its parent has not reaped yet is gone
    for us (one re-parented to a container's init may stay a zombie for a second or more)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_gone(processes: list[psutil.Process], deadline: float, *,
              poll_s: float = 0.02) -> list[psutil.Process]:
    """Wait until every process has ended (see :func:`running`) or ``deadline`` (monotonic); return
    those left."""
    alive = [p for p in processes if running(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(poll_s)
        alive = [p for p in alive if running(p)]
    return alive
