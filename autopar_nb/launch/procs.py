"""Finding and ending the processes of a run with psutil.

torch's agent starts every worker in its own session (``start_new_session=True``), so killing the agent's process
group does not reach the workers; and a worker whose agent was SIGKILLed is re-parented and lost to a tree walk.
Every process of a run therefore carries the run's ``AUTOPAR_TOKEN`` in its environment, and the last step of a
teardown looks for that token in the whole process table.
"""

from __future__ import annotations

import signal
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


def terminate(agent_pid: int | None, token: str, *, grace_s: float = 2.5) -> list[int]:
    """End the agent and every worker of the run: SIGTERM to the agent (torch's handler forwards it to the
    workers), SIGKILL to whatever is left after ``grace_s``, and a final sweep by token. Returns the pids that had
    to be SIGKILLed. Takes at most about ``grace_s + 1`` seconds."""
    known: list[psutil.Process] = []
    agent = None
    if agent_pid is not None:
        try:
            agent = psutil.Process(agent_pid)
            known = [agent, *agent.children(recursive=True)]
        except psutil.Error:
            agent = None
    known += [p for p in processes_with_token(token) if p.pid not in {k.pid for k in known}]
    if agent is not None:
        try:
            agent.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    else:
        for p in known:
            try:
                p.send_signal(signal.SIGTERM)
            except psutil.Error:
                pass
    _, alive = psutil.wait_procs(known, timeout=grace_s)
    # anything started meanwhile (a restart racing the stop) carries the token too
    alive = {p.pid: p for p in alive}
    for p in processes_with_token(token):
        alive.setdefault(p.pid, p)
    for p in alive.values():
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(list(alive.values()), timeout=1.0)
    return sorted(alive)
