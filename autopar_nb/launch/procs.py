"""Finding and ending the processes of a run with psutil.

torch's agent starts every worker in its own session (``start_new_session=True``), so killing the agent's process
group does not reach the workers; and a worker whose agent was SIGKILLed is re-parented and lost to a tree walk.
Every process of a run therefore carries the run's ``AUTOPAR_TOKEN`` in its environment, and the last step of a
teardown looks for that token in the whole process table.
"""

from __future__ import annotations

import signal
import subprocess
import time

import psutil

TOKEN_ENV = "AUTOPAR_TOKEN"


def processes_with_token(token: str) -> list[psutil.Process]:
    """Every live process whose environment has ``AUTOPAR_TOKEN=token`` (the agent and its workers)."""
    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(TOKEN_ENV) == token and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (psutil.Error, OSError):
            continue
    return out


def workers_of(agent: psutil.Process) -> dict[int, psutil.Process]:
    """rank -> worker process among the agent's descendants (the rank read from the worker's ``RANK`` variable)."""
    out = {}
    try:
        children = agent.children(recursive=True)
    except psutil.Error:
        return out
    for p in children:
        try:
            rank = p.environ().get("RANK")
            if rank is not None and p.status() != psutil.STATUS_ZOMBIE:
                out[int(rank)] = p
        except (psutil.Error, OSError, ValueError):
            continue
    return out


def terminate(agent, token: str, *, grace_s: float = 2.5) -> list[int]:
    """End the agent (a ``subprocess.Popen``, or None) and every worker of the run: SIGTERM to the agent (torch's
    handler forwards it to the workers), SIGKILL to whatever is left after ``grace_s``, and a final sweep by token.
    Returns the pids that had to be SIGKILLed. Takes at most about ``grace_s + 1`` seconds."""
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
    if agent is not None and agent.poll() is None:
        agent.send_signal(signal.SIGTERM)
    else:
        for p in known.values():
            try:
                p.send_signal(signal.SIGTERM)
            except psutil.Error:
                pass
    killed = []
    if agent is not None:
        try:
            agent.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            agent.kill()
            killed.append(agent.pid)
            agent.wait(timeout=1.0)
    _, alive = psutil.wait_procs(list(known.values()), timeout=max(0.0, deadline - time.monotonic()))
    # anything started meanwhile (a restart racing the stop) carries the token too
    left = {p.pid: p for p in alive}
    for p in processes_with_token(token):
        left.setdefault(p.pid, p)
    for p in left.values():
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(list(left.values()), timeout=1.0)
    return killed + sorted(left)
