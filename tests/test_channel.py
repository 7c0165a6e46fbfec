"""The metrics channel under attack before authentication (issue 17 point 1): what an unauthenticated peer sends or
holds costs it its own connection, never the server's loop, its descriptors or an authenticated rank's messages."""

from __future__ import annotations

import json
import resource
import socket
import time

import pytest

from autopar_nb.launch.channel import MAX_PENDING, MetricsServer


@pytest.fixture
def server():
    s = MetricsServer()
    yield s
    s.close()


def _connect(server: MetricsServer, data: bytes = b"") -> socket.socket:
    host, port = server.address.split(":")
    s = socket.create_connection((host, int(port)))
    if data:
        s.sendall(data)
    return s


def _hello(server: MetricsServer, rank: int) -> bytes:
    return json.dumps({"token": server.token, "rank": rank}).encode() + b"\n"


def _pump(server: MetricsServer, until, seconds: float = 5.0) -> list:
    msgs, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline and not until(msgs):
        msgs += server.poll(0.02)
    return msgs


@pytest.mark.parametrize("attack", [
    b'{"token": "\\ud800", "rank": 0}\n',               # a lone surrogate: token.encode() raised before
    b"[" * 100000 + b"\n",                               # nesting: json.loads raised RecursionError before
    b'{"token": ' + b"[" * 100000 + b"]" * 100000 + b', "rank": 0}\n',
    b"\xff\xfe\x00garbage\n",
    b'{"token": null, "rank": 1e999}\n',
    b"x" * 10000,                                        # no newline: over the first line's limit
])
def test_a_hostile_first_line_costs_only_its_connection(server, attack):
    good = _connect(server, _hello(server, 0))
    bad = _connect(server)
    bad.sendall(attack)
    good.sendall(b'{"step": 0, "loss": 1.0}\n')
    msgs = _pump(server, lambda m: server.rejected >= 1 and any(x.kind == "data" for x in m))
    assert server.rejected == 1
    assert [(m.rank, m.data) for m in msgs if m.kind == "data"] == [(0, {"step": 0, "loss": 1.0})]
    good.sendall(b'{"step": 1, "loss": 0.5}\n')  # the server still serves the rank afterwards
    assert any(m.kind == "data" for m in _pump(server, lambda m: any(x.kind == "data" for x in m)))
    good.close()
    bad.close()


def test_connections_held_open_cannot_use_up_descriptors(server):
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    held = []
    for _ in range(min(600, soft // 3)):  # each idle, never sending its token
        held.append(_connect(server))
        server.poll(0)  # the server accepts as it runs (the listen backlog holds 64)
    _pump(server, lambda m: False, seconds=0.5)
    assert len(server._pending()) <= MAX_PENDING
    assert server.rejected >= len(held) - MAX_PENDING
    good = _connect(server, _hello(server, 3) + b'{"step": 7}\n')
    msgs = _pump(server, lambda m: any(x.kind == "data" for x in m))
    assert [(m.rank, m.data) for m in msgs if m.kind == "data"] == [(3, {"step": 7})]
    for s in held + [good]:
        s.close()


def test_descriptors_run_out_in_accept(server):
    """With the process out of descriptors, accept() fails: the oldest pending peer is closed to make room."""
    idle = [_connect(server) for _ in range(4)]
    _pump(server, lambda m: len(server._pending()) == 4, seconds=3)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fillers = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        try:
            while True:
                fillers.append(socket.socket())
        except OSError:
            pass
        good = None
        for s in fillers[-1:]:  # one descriptor: the client socket takes it, the server end finds none
            s.close()
        fillers = fillers[:-1]
        good = _connect(server, _hello(server, 1) + b'{"step": 2}\n')
        msgs = _pump(server, lambda m: any(x.kind == "data" for x in m))
        assert [(m.rank, m.data) for m in msgs if m.kind == "data"] == [(1, {"step": 2})]
        assert len(server._pending()) < 4  # at least one idle peer was closed to accept the rank
    finally:
        for s in fillers:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    for s in idle + [good]:
        s.close()


def test_what_one_poll_sees_carries_one_time(server):
    """A node's death and its peer's error (its consequence) often arrive in one select: their order there is the
    order of the descriptors, not of the events, so they carry one time and neither looks earlier (attached.py's lost
    node is judged by these times)."""
    dead, peer = _connect(server, _hello(server, 0)), _connect(server, _hello(server, 1))
    _pump(server, lambda msgs: len(msgs) == 2)
    dead.close()
    peer.sendall(b'{"event": "error", "error": "RuntimeError: Connection closed by peer"}\n')
    time.sleep(0.2)  # both are waiting before the poll
    msgs = server.poll(0.02)
    assert sorted(m.kind for m in msgs) == ["closed", "data"] and msgs[0].time == msgs[1].time
    peer.close()


def test_the_monitors_batching_pause_is_never_negative(monkeypatch):
    """The monitor waits up to BATCH_S after a message for more: on a loaded host the clock can pass the pause's end
    between reading it and sleeping (time.sleep(-x) raised and crashed the monitor in a 30-minute soak)."""
    from autopar_nb.launch import monitor

    monkeypatch.setattr(monitor.time, "monotonic", lambda: 100.0)
    assert monitor.batch_rest(100.0 - monitor.BATCH_S / 2) == pytest.approx(monitor.BATCH_S / 2)
    assert monitor.batch_rest(100.0 - 3 * monitor.BATCH_S) == 0.0
