"""``attach()``: the launch dashboard for a run on other hosts, read from its metrics stream alone.

The notebook's metrics server (``channel.py``) listens on an address the remote hosts reach; the
user starts the exported script there with ``AUTOPAR_METRICS=<address> AUTOPAR_TOKEN=<token>`` in
front of the torchrun command (:attr:`AttachedRun.commands`). No process of the run is local, so
everything comes from the stream: each rank's hello, steps, data verdict, its error or its "done"
(the exported script's runtime module sends one or the other). A rank is *lost* when its connection
closes without either, when it sends nothing for ``lost_after_s``, or when it never connects within
``lost_after_s`` of the first rank that did. The run ends when every rank has finished, failed or
been lost ("finished" only when all finished), or when :meth:`AttachedRun.stop` detaches from it
(the remote ranks train on).

Elastic restarts are followed: each rank's hello carries torchrun's restart count, restart limit and
world size (``runtime/metrics.py``). After a failure or a lost rank with restarts left the run is
"restarting" and waits up to ``restart_wait_s`` for the next attempt's hellos; a smaller world after
the restart (a node that left) makes the ranks beyond it "lost" without failing the run, which
finishes when the ranks of the new world do.

A lost node is one event: when every rank whose connection came from one host closed without an end
message within ``NODE_WINDOW_S``, before any rank of another host of the attempt ended,
``run.events`` gets one "node_lost" event naming the host and its ranks (ranks that end after
another host's are its consequence: their agent stops them; with one host left, its agent ending its
ranks to admit a returning node looks the same, so no event). When that host is the rendezvous
endpoint's (``rendezvous=``, or ``--rdzv-endpoint`` in ``commands``), no torchrun can restart the
group (the survivors' agents cannot meet again): once every other rank has ended too, the run fails
at once with that reason instead of waiting ``restart_wait_s``, unless a restart's hello came first
— or unless the rendezvous port still takes a connection: then that host's agent lives (it hosts the
store), only its ranks ended (one killed, the rest stopped by the agents to restart the group; with
one rank per host this is what a lost node looks like on the stream), the event is withdrawn and the
run waits for the restart as after any failure.
"""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
import shlex
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from .channel import MetricsServer
from .compare import plan_device
from .launcher import LaunchError
from .metrics import RankState
from .monitor import Monitor
from .run import Run

RESTART_WAIT_S = 120.0
"""seconds an attached run waits for the next attempt's first hello after a failure with restarts
left (torchrun stops the group, meets again at the rendezvous, whose last call alone waits 30 s by
default, and restarts it)"""
LOST_AFTER_S = 300.0
"""seconds without a message after which a rank of an attached run is lost (a first step that
compiles or loads a large checkpoint may need more: pass ``lost_after_s``)"""
NODE_WINDOW_S = 5.0
"""seconds within which the connections of every rank of one host closing are one lost node (a
killed host's sockets close together; its agent ending its workers one by one takes a few seconds at
most)"""
RDZV_PORT = 29400
"""torchrun's rendezvous port where ``--rdzv-endpoint`` names none (torch.distributed.run's
documented default)"""
PROBE_TIMEOUT_S = 1.0
PROBE_EVERY_S = 1.0
"""while a rendezvous host's agent answers, it is asked again this often (not at every poll of the
stream)"""
"""seconds a connection to the rendezvous port may take before its host counts as gone"""


class AttachedRun(Run):
    """A :class:`Run` whose ranks run elsewhere: no agent, no local processes, no log files; what it
    shows comes from the metrics stream. ``commands`` are the torchrun lines to run on the hosts
    (with ``env`` in front)."""

    def __init__(self, *, address: str, lost_after_s: float, commands: list[str],
                 restart_wait_s: float = RESTART_WAIT_S, rendezvous: str | None = None,
                 **kwargs: Any):
        super().__init__(**kwargs)
        self.address = address
        """host:port the ranks stream to (``AUTOPAR_METRICS``)"""
        self.env = {"AUTOPAR_METRICS": address, "AUTOPAR_TOKEN": self._token}
        """what every rank's environment needs"""
        self.commands = [f"{env_prefix(self.env)} {c}" for c in commands]
        """the script's torchrun commands with ``env`` in front"""
        self.lost_after_s = float(lost_after_s)
        self.restart_wait_s = float(restart_wait_s)
        self.rendezvous = rendezvous_host(rendezvous, commands)
        """the host of torchrun's rendezvous endpoint (None: unknown); losing it ends every
        torchrun"""
        self._rdzv_port = rendezvous_port(rendezvous, commands)
        self._agent_answered: dict[str, tuple[str, list[dict]]] = {}
        """host -> the reason and the withdrawn "node_lost" events of a host whose ranks all closed
        in the current attempt while its rendezvous port still answered"""
        self._probed_at = 0.0
        self._nodes_lost: dict[str, str] = {}
        """host -> the reason of its "node_lost" event, in the current attempt"""
        self._reported: set[int] = set()
        """ranks that sent their own error in the current attempt (their closed connection is no
        loss)"""
        self.world = self.nproc
        """ranks in the current attempt (fewer than ``nproc`` after an elastic restart without a
        node)"""
        self._attempt = 0
        """the attempt as counted here (see ``_on_hello``)"""
        self._spoke: set[int] = set()
        """ranks that said hello in the current attempt"""
        self._restarts = 0
        """the most restarts a rank's agent reported in the current attempt
        (TORCHELASTIC_RESTART_COUNT)"""
        self._accounted_at: float | None = None
        self._end_note = ""
        self._heard: dict[int, float] = {}
        self._first_hello: float | None = None
        self._message = f"waiting for {self.nproc} rank(s) to connect to {address}"

    # ---- public API: nothing of the run is local -------------------------------------------------
    def workers(self) -> dict:
        """Always empty: the ranks run on other hosts."""
        return {}

    def processes(self) -> list:
        """Always empty: the ranks run on other hosts."""
        return []

    def logs(self, rank: int = 0, *, attempt: int | None = None, tail: int | None = None) -> str:
        """Always "": the ranks' output stays on their hosts (their errors and tracebacks come over
        the stream)."""
        return ""

    def stop(self, reason: str = "detached by the user") -> str:
        """Stop listening and end the run here (status "stopped"); the remote ranks train on,
        without a dashboard."""
        return super().stop(reason)

    def __repr__(self) -> str:
        return (f"AttachedRun({self.run_id[:8]}, {self.nproc} ranks at {self.address}, "
                f"{self._status}: {self._message})")

    # ---- monitor side ----------------------------------------------------------------------------
    def _ingest(self, msgs: list) -> bool:
        now = time.monotonic()
        with self._lock:
            for m in msgs:
                self._heard[m.rank] = now
                if m.kind == "hello" and self._first_hello is None:
                    self._first_hello = now
                st = self._ranks.get(m.rank)
                if (st is not None and st.lost is not None and m.kind != "closed"
                        and st.closed_at is None and st.rank < self.world):
                    self._found(st)  # silent for a while, but it is back
        changed = super()._ingest(msgs)
        if changed and self._status == "starting":
            with self._lock:
                joined = sum(s.connected for s in self._ranks.values())
                self._message = f"{joined} of {self.nproc} rank(s) connected to {self.address}"
        return changed

    def _on_hello(self, st: RankState, data: dict, now: float) -> None:
        """A rank's hello. A second hello from a rank in one attempt, or one from another world
        size, means torchrun restarted the group (a worker never reconnects): a new attempt, counted
        here, since each node's agent counts its own restarts (a node that joins later starts at 0;
        a membership change counts none). The hello also says torchrun's restart limit and how many
        restarts its node's agent has made."""
        limit, restarts, world = (data.get(k) for k in ("max_restarts", "attempt", "world"))
        world = world if _whole(world) and 1 <= world <= self.nproc else None
        if _whole(limit):
            self.max_restarts = max(self.max_restarts, limit)
        if st.rank in self._spoke or (world is not None and world != self.world and self._spoke):
            self._attempt, self._spoke, self._accounted_at, self._restarts = (self._attempt + 1,
                                                                              set(), None, 0)
            self._nodes_lost, self._reported, self._agent_answered = {}, set(), {}
        if not self._spoke and world is not None:
            self.world = world
        self._spoke.add(st.rank)
        st.host = data.get("peer") if isinstance(data.get("peer"), str) else None
        if _whole(restarts):
            self._restarts = max(self._restarts, restarts)
        super()._on_hello(st, {**data, "attempt": self._attempt}, now)
        for other in self._ranks.values():
            if other.rank >= self.world and other.attempt < self._attempt \
                    and not (other.lost or "").startswith("not in attempt"):
                other.lost = (f"not in attempt {self._attempt}: torchrun restarted the job with "
                              f"{self.world} rank(s)")

    def _on_error(self, st: RankState, data: dict, sent: float, now: float) -> None:
        """As a local run's, except that whether a restart follows is torchrun's restart limit
        against the count its node's agent reported (the notebook's attempts also count membership
        changes)."""
        super()._on_error(st, data, sent, now)
        self._reported.add(st.rank)
        e = self._error
        if self._restarts_left():
            self._status, self._message = "restarting", (f"rank {e['rank']} failed ({e['error']}); "
                                                         "waiting for torchrun to restart the "
                                                         "group")
        else:
            self._status, self._message = "failed", f"rank {e['rank']} failed: {e['error']}"

    def _behind(self, attempt: int, now: float) -> list[RankState]:
        behind = super()._behind(attempt, now)
        for st in behind:
            if st.rank < self.world:  # those beyond the world stay lost: their node left
                st.lost = None
        return behind

    def _found(self, st: RankState) -> None:
        st.lost = st.error = st.failed_at = None
        self._error = None
        self._update_error()

    def _check_hang(self) -> None:
        """Ranks that closed without an end message, went silent or never came are lost (see the
        module)."""
        now = time.monotonic()
        with self._lock:
            if self._stop_reason is not None or self._status in ("stopped", "hung"):
                return
            for st in list(self._ranks.values()):
                why = self._why_lost(st, now)
                if why is not None:
                    st.lost, st.error, st.failed_at = why, {"error": f"lost: {why}",
                                                            "traceback": ""}, time.time()
                    self._update_error()
                    if self._restarts_left():
                        self._set_status("restarting",
                                         f"rank {st.rank} lost ({why}); waiting for torchrun to "
                                                       "restart the group")
                    else:
                        self._message = f"rank {st.rank} lost: {why}"
            self._check_nodes()

    def _check_nodes(self) -> None:
        """One "node_lost" event for each host all of whose ranks' connections closed within
        ``NODE_WINDOW_S`` without an end message or an error of their own (under ``_lock``)."""
        hosts: dict[str, list[RankState]] = {}
        for r in range(self.world):
            st = self._ranks[r]
            if st.host is not None:
                hosts.setdefault(st.host, []).append(st)
        # one host: its agent ending its ranks for a restart looks the same as losing it
        if len(hosts) < 2:
            return
        for host, ranks in hosts.items():
            closed = [st.closed_at for st in ranks if st.closed_at is not None
                      and st.rank not in self._reported]
            if (host in self._nodes_lost or host in self._agent_answered or len(closed) < len(ranks)
                    or max(closed) - min(closed) > NODE_WINDOW_S):
                continue
            # ranks that end after another host's went are its consequence (their agent stops them
            # to restart)
            before = [st.closed_at or st.failed_at for h, others in hosts.items() if h != host
                      for st in others]
            if min((t for t in before if t is not None), default=min(closed)) < min(closed):
                continue
            reason = (f"node {host} lost ({rank_span([st.rank for st in ranks])}): the connections "
                      f"of all its ranks closed within {max(closed) - min(closed):.1f} s without "
                      "an end message")
            if host == self.rendezvous:
                reason += "; it hosted the rendezvous, so torchrun cannot restart the group"
            self._nodes_lost[host] = reason
            self.events.append({"t": min(closed) - self.started, "kind": "node_lost", "rank": None,
                                "reason": reason})
            if self._status not in ("failed", "finished", "stopped", "hung"):
                self._message = reason + ("" if self._status != "restarting"
                                          or host == self.rendezvous
                                          else "; waiting for torchrun to restart the group")

    def _restarts_left(self) -> bool:
        return self._restarts < self.max_restarts

    def _why_lost(self, st: RankState, now: float) -> str | None:
        if st.done or st.error is not None or st.lost is not None or st.rank >= self.world:
            return None
        # the host named: a lost node shows as the ranks of one address
        if st.closed_at is not None:
            return (f"its connection from {st.host or 'its host'} closed without an end message "
                    "(its process or that host ended, or the network dropped it)")
        heard = self._heard.get(st.rank)
        if heard is not None and now - heard > self.lost_after_s:
            return f"it sent nothing for {now - heard:.0f} s (from {st.host or 'its host'})"
        if (heard is None and self._first_hello is not None
            and now - self._first_hello > self.lost_after_s):
            return (f"it never connected to {self.address} within {self.lost_after_s:.0f} s of the "
                    "first rank (its host cannot reach this address, or it never started)")
        return None

    def _agent_exited(self) -> bool:
        """The run has ended: detached, or every rank of the current world finished, failed or was
        lost, and no restart follows (none left, every rank finished, or none came within
        ``restart_wait_s``)."""
        if self._stop_reason is not None:
            return True
        with self._lock:
            ranks = [self._ranks[r] for r in range(self.world)]
            if not all(st.done or st.error is not None for st in ranks):
                self._accounted_at = None
                return False
            if all(st.done for st in ranks) or not self._restarts_left():
                return True
            if self.rendezvous in self._nodes_lost or self.rendezvous in self._agent_answered:
                if not self._agent_answers():  # every other rank ended as well: no restart can come
                    self._end_note = self._nodes_lost[self.rendezvous] + (" (every other rank has "
                                                                          "ended)")
                    return True
            now = time.monotonic()
            self._accounted_at = self._accounted_at or now
            if now - self._accounted_at <= self.restart_wait_s:
                return False
            self._end_note = (f"no restart came within {self.restart_wait_s:.0f} s "
                              f"({self._restarts} of {self.max_restarts} restart(s) made)")
            return True

    def _agent_answers(self) -> bool:
        """Whether the rendezvous host's agent lives although its ranks all ended (under ``_lock``):
        its port takes a connection (nothing is sent or read). Asked at every check until the group
        restarts, since a killed node's agent can answer for a moment after its ranks' connections
        closed: while it answers its "node_lost" event is withdrawn (the group restarts); once it
        stops, the event is back."""
        host, now = self.rendezvous, time.monotonic()
        if host in self._agent_answered and now - self._probed_at < PROBE_EVERY_S:
            return True
        self._probed_at = now
        try:
            socket.create_connection((host, self._rdzv_port), timeout=PROBE_TIMEOUT_S).close()
        except OSError:
            if host in self._agent_answered:
                self._nodes_lost[host], withdrawn = self._agent_answered.pop(host)
                self.events.extend(withdrawn)
            return False
        if host in self._nodes_lost:
            reason = self._nodes_lost.pop(host)
            withdrawn = [e for e in self.events if e["kind"] == "node_lost"
                         and e["reason"] == reason]
            self.events[:] = [e for e in self.events if e not in withdrawn]
            self._agent_answered[host] = reason, withdrawn
        self._message = (f"the ranks of {host} ended, but its torchrun agent answers at the "
                         f"rendezvous (port {self._rdzv_port}): waiting for torchrun to restart "
                         "the group")
        return True

    def _agent_alive(self) -> bool:
        return False

    def _teardown(self) -> None:
        """Nothing to end here: the ranks belong to the hosts they run on."""

    def _refresh_workers(self) -> dict:
        return {}

    def _latest_attempt(self) -> int:
        return -1

    def _read_log_tails(self) -> None:
        pass

    def _finalise(self) -> None:
        """Every rank has ended (or the user detached): the final status from the stream alone."""
        with self._lock:
            ok = all(self._ranks[r].done for r in range(self.world))
            self._result = {"state": "succeeded" if ok else "failed"}
            self.ended = time.time()
            self._set_final_status(self._result, f"{self.ended - self.started:.1f} s")
            if self._end_note and self._status == "failed":
                self._message += f"; {self._end_note}"
            self._watch_tick()
        self._server_close()
        if self._tick >= 0:
            self._record_tick(self._tick + 1, {})
        self._notify()
        self._ended()


def rendezvous_host(rendezvous: str | None, commands: list[str]) -> str | None:
    """The host of ``rendezvous`` ("host" or "host:port"), else of the first ``--rdzv-endpoint`` in
    ``commands``."""
    if rendezvous is None:
        found = (re.search(r"--rdzv[-_]endpoint[= ]+['\"]?([^\s'\"]+)", c) for c in commands)
        rendezvous = next((m.group(1) for m in found if m), None)
    if not rendezvous:
        return None
    host = (rendezvous.rsplit(":", 1)[0] if rendezvous.count(":") == 1 or rendezvous.startswith("[")
            else rendezvous)
    host = host.strip("[]")
    # the exported commands' placeholders name no host
    return None if host == "HOST" or "$" in host else host


def rendezvous_port(rendezvous: str | None, commands: list[str]) -> int:
    """The port of ``rendezvous`` or of the first ``--rdzv-endpoint`` in ``commands``
    (:func:`rendezvous_host`'s endpoint); :data:`RDZV_PORT` where it names none."""
    if rendezvous is None:
        found = (re.search(r"--rdzv[-_]endpoint[= ]+['\"]?([^\s'\"]+)", c) for c in commands)
        rendezvous = next((m.group(1) for m in found if m), None)
    port = re.search(r"(?:^[^:]*|\])+:(\d+)$", rendezvous or "")
    return int(port.group(1)) if port and int(port.group(1)) < 65536 else RDZV_PORT


def rank_span(ranks: list[int]) -> str:
    """``ranks 0-3``, ``ranks 0, 2`` or ``rank 5``."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 20


def env_prefix(env: dict[str, str]) -> str:
    """``KEY=value ...`` for a shell command line."""
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())


def check_host(host: str | None, advertise: str | None) -> str:
    """The address the ranks connect to, or LaunchError saying what to pass."""
    if not host:
        raise LaunchError("attach() needs host=: the address of this machine that the ranks' hosts "
                          "reach (e.g. host='10.1.2.3', an interface address), or host='0.0.0.0' "
                          "(every interface) with advertise='<that address>'")
    try:
        wildcard = ipaddress.ip_address(host).is_unspecified
    except ValueError:
        wildcard = False
    if wildcard and not advertise:
        raise LaunchError(f"host={host!r} listens on every interface, so it does not say where the "
                          "ranks should connect: pass advertise='<an address of this machine that "
                          "their hosts reach>'")
    return advertise or host


def attach(script: str | os.PathLike, nproc: int, steps: int | None = None, *,
           host: str | None = None, port: int = 0, advertise: str | None = None, plan: Any = None,
           commands: list[str] | None = None, lost_after_s: float = LOST_AFTER_S,
           restart_wait_s: float = RESTART_WAIT_S, backend: str | None = None,
           run_dir: str | os.PathLike | None = None, rendezvous: str | None = None) -> AttachedRun:
    """Listen for the ``nproc`` ranks of ``script`` run on other hosts and return an
    :class:`AttachedRun` at once; displayed, it is the launch dashboard.

    Args:
        script: the exported script the hosts run (kept for the record; nothing is started here).
        nproc: the run's world size (every rank streams to this notebook).
        steps: the run's steps, for the status line (None: unknown).
        host: the local address to listen on: an interface address the hosts reach, or
            "0.0.0.0" with ``advertise``. Connections are accepted only with the run's token
            (``channel.py``).
        port: the port (0: a free one).
        advertise: the address the ranks are told (``AUTOPAR_METRICS``), when it is not ``host``.
        plan: the Plan that runs, for predicted figures on the dashboard.
        commands: the torchrun command lines to print with the environment in front
            (``AttachedRun.commands``).
        lost_after_s: a rank silent this long (or, once the first rank connected, never
            connected) is lost.
        restart_wait_s: after a failure with torchrun restarts left, how long to wait for the
            next attempt.
        backend: "nccl" (the hosts' GPUs) or "gloo" (CPU processes): which of the plan's
            predictions compare; default from the plan's device (a GPU preset: "nccl").
        run_dir: kept for the record (default: a new temporary directory).
        rendezvous: torchrun's ``--rdzv-endpoint`` ("host:port" or "host", as the ranks'
            connections come from it; default: read from ``commands`` unless a placeholder):
            when its host is lost and every other rank has ended, the run fails at once (no
            torchrun can restart).
    """
    if nproc < 1:
        raise LaunchError(f"nproc must be >= 1, got {nproc}")
    if lost_after_s <= 0 or restart_wait_s < 0:
        raise LaunchError(f"lost_after_s must be > 0 and restart_wait_s >= 0, got {lost_after_s} "
                          f"and {restart_wait_s}")
    told = check_host(host, advertise)
    if backend is None:
        backend = "gloo" if plan_device(plan) in ("", "cpu") else "nccl"
    if backend not in ("gloo", "nccl"):
        raise LaunchError(f"backend={backend!r}: 'nccl' (GPUs) or 'gloo' (CPU processes)")
    try:
        server = MetricsServer(host=host, port=port)
    except OSError as e:
        raise LaunchError(f"cannot listen on {host}:{port} ({e}): pass host= an address of this "
                          "machine (`ip -brief addr` lists them)") from None
    address = f"{told}:{server.address.rsplit(':', 1)[1]}"
    run_id = secrets.token_hex(8)
    run_dir = Path(run_dir or tempfile.mkdtemp(prefix=f"autopar-attach-{run_id[:8]}-")).resolve()
    run = AttachedRun(run_id=run_id, run_dir=run_dir, script=Path(script), nproc=nproc, steps=steps,
                      token=server.token, backend=backend, max_restarts=0, hang_timeout_s=None,
                      plan=plan, address=address, lost_after_s=lost_after_s,
                      restart_wait_s=restart_wait_s, commands=commands or [], rendezvous=rendezvous)
    run._server = server
    run._monitor = Monitor(run, nvml=False)  # this machine's GPUs are not the run's
    run._monitor.start()
    return run
