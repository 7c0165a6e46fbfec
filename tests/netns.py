"""Two "nodes" on this machine for multi-node tests: network namespaces joined by a veth pair (root only).

Each node is a network namespace with its own address on a small private subnet; the subnet exists only inside the
two namespaces, so nothing a test runs there can reach (or be reached from) the host's network. Both ends of the pair
carry the same interface name, so one ``GLOO_SOCKET_IFNAME`` serves every node. Names are unique per run; on exit the
processes left in the namespaces are killed and the namespaces deleted (which removes the veth pair), also when the
test failed.
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

IFNAME = "apn0"
"""the veth end's name inside every namespace (a namespace has its own interface names)"""
SUBNET = "10.231.0"
"""a /24 that exists only between the two namespaces"""


@dataclass(frozen=True)
class Node:
    """One namespace: ``name`` for ``ip netns exec``, ``addr`` its address on the pair."""

    name: str
    addr: str

    def argv(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this node's network namespace (``nsenter``, not ``ip netns exec``: that one also remounts
        /sys, which hides the cgroup filesystem that slurmd needs)."""
        return ["nsenter", f"--net=/run/netns/{self.name}", *argv]

    def popen(self, argv: list[str], *, env: dict, **kwargs) -> subprocess.Popen:
        """Start ``argv`` in this namespace, in a session of its own (so the test can kill its whole tree)."""
        return subprocess.Popen(self.argv(argv), env=env | {"GLOO_SOCKET_IFNAME": IFNAME}, start_new_session=True,
                                **kwargs)


def unavailable() -> str | None:
    """Why this machine cannot make namespaces, or None."""
    if os.geteuid() != 0:
        return f"network namespaces need root (ip netns add); this test runs as uid {os.geteuid()}"
    if shutil.which("ip") is None:
        return "no `ip` binary (Debian package iproute2) to create network namespaces"
    probe = f"apnb-probe-{os.getpid()}-{secrets.token_hex(2)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


def kill_namespace_processes(node: Node) -> None:
    """SIGKILL every process inside ``node``'s namespace (all of them were started by the test that made it)."""
    for _ in range(50):
        pids = subprocess.run(["ip", "netns", "pids", node.name], capture_output=True, text=True).stdout.split()
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


@contextmanager
def two_nodes() -> Iterator[tuple[Node, Node]]:
    """Two namespaces joined by a veth pair, addresses ``10.231.0.1`` and ``.2``; removed on exit."""
    tag = f"{os.getpid() % 100000:05d}{secrets.token_hex(2)}"
    nodes = (Node(f"apnb-{tag}-0", f"{SUBNET}.1"), Node(f"apnb-{tag}-1", f"{SUBNET}.2"))
    ends = (f"ap{tag}a", f"ap{tag}b")  # names in the host's namespace for a moment: <= 15 characters
    made: list[Node] = []
    try:
        for node in nodes:
            _ip("netns", "add", node.name)
            made.append(node)
        _ip("link", "add", ends[0], "type", "veth", "peer", "name", ends[1])
        for node, end in zip(nodes, ends, strict=True):
            _ip("link", "set", end, "netns", node.name)
            _ip("-n", node.name, "link", "set", end, "name", IFNAME)
            _ip("-n", node.name, "addr", "add", f"{node.addr}/24", "dev", IFNAME)
            _ip("-n", node.name, "link", "set", "lo", "up")
            _ip("-n", node.name, "link", "set", IFNAME, "up")
        yield nodes
    finally:
        for node in made:
            kill_namespace_processes(node)
            subprocess.run(["ip", "netns", "del", node.name], capture_output=True)
        subprocess.run(["ip", "link", "del", ends[0]], capture_output=True)  # only if it never left the host


def node_argv(command: str, node_index: int, nodes, *, script_dir, port: int) -> list[str]:
    """An exported script's multi-node command (``HOST:29500`` for the first node's rendezvous endpoint) as run on
    node ``node_index``: HOST is the first node's address with ``port``, and (as the script's docstring says for hosts
    whose name does not resolve to HOST) ``is_host`` and ``--local-addr`` are added."""
    words = command.replace("HOST:29500", f"{nodes[0].addr}:{port}").split()
    env = {}
    while "=" in words[0]:  # VAR=value before the command
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    assert words[0] == "torchrun"
    script = next(i for i, w in enumerate(words) if w.endswith(".py"))
    extra = ["--rdzv-conf", f"is_host={int(node_index == 0)},last_call_timeout=2,keep_alive_interval=1",
             "--local-addr", nodes[node_index].addr, "--monitor-interval", "0.2"]
    argv = [sys.executable, "-m", "torch.distributed.run", *words[1:script], *extra,
            str(Path(script_dir) / words[script]), *words[script + 1:]]
    return ["env", *(f"{k}={v}" for k, v in env.items()), *argv]


def link_bytes(node: Node) -> int:
    """Bytes received so far on ``node``'s end of the pair: what crossed between the two nodes."""
    out = subprocess.run(["ip", "-n", node.name, "-j", "-s", "link", "show", IFNAME], capture_output=True, text=True,
                         check=True).stdout
    return int(json.loads(out)[0]["stats64"]["rx"]["bytes"])


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a process started by :meth:`Node.popen` and everything in its session."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


CLONE_NEWNET = 0x40000000  # <sched.h>


def in_namespace(node: Node, fn):
    """``fn()`` called by a short-lived thread that entered ``node``'s network namespace (the sockets it makes live
    there, whichever thread uses them later); returns its result, or raises what it raised."""
    box: dict = {}

    def call():
        fd = os.open(f"/run/netns/{node.name}", os.O_RDONLY)
        try:
            if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns")
            box["result"] = fn()
        except BaseException as e:  # handed to the caller
            box["error"] = e
        finally:
            os.close(fd)

    thread = threading.Thread(target=call)  # only this thread changes namespace
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def server_socket(node: Node, host: str) -> socket.socket:
    """A listening TCP socket bound to ``host`` inside ``node``'s namespace."""
    return in_namespace(node, lambda: socket.create_server((host, 0)))


class MetricsSink:
    """The launcher's end of the metrics protocol (see tests/test_export.py's MetricsServer), listening inside a
    node's namespace: one list of JSON records per connection."""

    def __init__(self, node: Node, host: str):
        self.sock = server_socket(node, host)
        self.address = f"{host}:{self.sock.getsockname()[1]}"
        self.connections: list[list[dict]] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            records: list[dict] = []
            self.connections.append(records)
            threading.Thread(target=self._read, args=(conn, records), daemon=True).start()

    @staticmethod
    def _read(conn, records):
        with conn, conn.makefile() as lines:
            for line in lines:
                records.append(json.loads(line))

    def steps(self, rank: int = 0) -> list[dict]:
        """Every step record of ``rank``'s connections, in the order the connections came (restarts give more)."""
        return [r for c in self.connections if c and c[0].get("rank") == rank for r in c if "step" in r]

    def close(self):
        self.sock.close()
