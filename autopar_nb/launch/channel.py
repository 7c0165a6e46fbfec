"""The metrics channel: a TCP server (loopback, unless attached to a run on other hosts) that
receives JSON lines from the ranks of one run.

Protocol (the exported script implements the client side; see ``tests/fixtures/train_fixture.py``)::

    env AUTOPAR_METRICS="127.0.0.1:PORT", AUTOPAR_TOKEN=<random hex>
    rank -> server   {"token": TOKEN, "rank": RANK}                     first line: authenticates
                                                                        the connection
                     {"step": k, "loss": ..., "step_time_s": ..., ...}  one line per step
                     {"event": "done"}  or  {"event": "error", "error": "...", "traceback": "..."}

A connection whose first line is not valid JSON carrying the run's token (compared in constant time)
within ``AUTH_TIMEOUT_S`` is closed and its bytes discarded; lines longer than ``MAX_LINE``
(``MAX_AUTH_LINE`` before the token) close the connection. At most ``MAX_PENDING`` connections wait
unauthenticated: a new one closes the oldest (so held-open connections cannot use up the kernel's
file descriptors), and when ``accept`` itself fails for want of descriptors the oldest pending one
is closed to make room. Whatever a peer sends, only its own connection is closed: nothing it sends
raises out of ``poll`` (the monitor's loop). Messages are decoded with ``json.loads`` only (nothing
is unpickled), and the rank of every message is the one the connection authenticated with, whatever
a later line says. Not thread-safe: one thread (the monitor) calls ``poll``.
"""

from __future__ import annotations

import hmac
import json
import secrets
import selectors
import socket
import time
from dataclasses import dataclass, field

AUTH_TIMEOUT_S = 10.0
"""seconds a new connection may take to send its token line"""
MAX_LINE = 1 << 20
"""bytes: a longer line (or unterminated data) closes the connection"""
MAX_AUTH_LINE = 4096
"""bytes: the longest first (token) line; a longer one closes the connection"""
MAX_PENDING = 32
"""connections waiting to authenticate at once; a new one closes the oldest"""


@dataclass
class _Conn:
    sock: socket.socket
    opened: float
    buf: bytes = b""
    rank: int | None = None
    extra: dict = field(default_factory=dict)
    peer: str = ""
    """the address it came from: the host a rank runs on, which a lost rank's message names"""


@dataclass(frozen=True)
class Message:
    """One decoded JSON object from an authenticated rank; ``kind`` is "hello", "data" or
    "closed"."""

    rank: int
    kind: str
    data: dict
    time: float


class MetricsServer:
    """Listens on ``host`` (127.0.0.1 unless a run on other hosts is attached: ``attached.py``) and
    ``port`` (0: a free one) for the ranks of one run; ``poll()`` returns their messages."""

    def __init__(self, token: str | None = None, host: str = "127.0.0.1", port: int = 0):
        self.token = token or secrets.token_hex(16)
        self._sel = selectors.DefaultSelector()
        self._lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._lsock.bind((host, port))
        self._lsock.listen(64)
        self._lsock.setblocking(False)
        self._sel.register(self._lsock, selectors.EVENT_READ, None)
        self.address = f"{host}:{self._lsock.getsockname()[1]}"
        self.rejected = 0
        """connections closed for a missing/wrong token, bad JSON or an over-long line"""
        self._conns: dict[int, _Conn] = {}
        self._closed = False

    def poll(self, timeout: float) -> list[Message]:
        """Wait up to ``timeout`` seconds for traffic and return the messages that arrived (possibly
        none)."""
        if self._closed:
            time.sleep(timeout)
            return []
        out: list[Message] = []
        ready = self._sel.select(timeout)
        # one time for everything one select saw: the order of its descriptors is not the order of
        # the events, and a node's death and its peers' errors (their consequence) often arrive
        # together
        seen = time.time()
        for key, _ in ready:
            if key.data is None:
                self._accept()
            else:
                self._read(key.data, out, seen)
        now = time.monotonic()
        for c in [c for c in self._conns.values() if c.rank is None
                  and now - c.opened > AUTH_TIMEOUT_S]:
            self._drop(c, rejected=True)
        return out

    def _accept(self) -> None:
        try:
            sock, addr = self._lsock.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        # EMFILE/ENFILE/ENOBUFS: free a descriptor held by a peer that never authenticated
        except OSError:
            pending = self._pending()
            if pending:
                self._drop(pending[0], rejected=True)
            else:
                # nothing of ours to free: do not spin on a listening socket that stays readable
                time.sleep(0.01)
            return
        pending = self._pending()
        if len(pending) >= MAX_PENDING:
            self._drop(pending[0], rejected=True)
        sock.setblocking(False)
        conn = _Conn(sock, time.monotonic(), peer=str(addr[0]))
        self._conns[sock.fileno()] = conn
        self._sel.register(sock, selectors.EVENT_READ, conn)

    def _pending(self) -> list[_Conn]:
        """Connections not yet authenticated, oldest first."""
        return sorted((c for c in self._conns.values() if c.rank is None), key=lambda c: c.opened)

    def _read(self, c: _Conn, out: list[Message], seen: float) -> None:
        try:
            self._receive(c, out, seen)
        except Exception:  # whatever one peer sends costs it its connection, never the monitor
            if any(known is c for known in self._conns.values()):
                self._drop(c, rejected=c.rank is None)

    def _receive(self, c: _Conn, out: list[Message], seen: float) -> None:
        try:
            chunk = c.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            if c.rank is not None:
                out.append(Message(c.rank, "closed", {}, seen))
            self._drop(c, rejected=c.rank is None)
            return
        c.buf += chunk
        while b"\n" in c.buf:
            line, c.buf = c.buf.split(b"\n", 1)
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except (ValueError, UnicodeDecodeError, RecursionError):
                obj = None
            if not isinstance(obj, dict):
                self._drop(c, rejected=True)
                return
            if c.rank is None:
                token = obj.get("token")
                rank = obj.get("rank")
                if (not isinstance(token, str)
                    or not hmac.compare_digest(token.encode("utf-8", "surrogatepass"),
                                               self.token.encode())
                        or not isinstance(rank, int) or isinstance(rank, bool)
                    or not 0 <= rank < 1 << 31):
                    self._drop(c, rejected=True)
                    return
                c.rank = rank
                # seen here, not claimed
                hello = {k: v for k, v in obj.items() if k != "token"} | {"peer": c.peer}
                out.append(Message(rank, "hello", hello, seen))
            else:
                out.append(Message(c.rank, "data", obj, seen))
        if len(c.buf) > (MAX_LINE if c.rank is not None else MAX_AUTH_LINE):
            self._drop(c, rejected=True)

    def _drop(self, c: _Conn, *, rejected: bool) -> None:
        self.rejected += rejected
        try:
            self._sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        for fd, known in list(self._conns.items()):
            if known is c:
                del self._conns[fd]
        c.sock.close()

    def close(self) -> None:
        """Close the listening socket and every connection."""
        if self._closed:
            return
        self._closed = True
        for c in list(self._conns.values()):
            self._drop(c, rejected=False)
        self._sel.unregister(self._lsock)
        self._lsock.close()
        self._sel.close()
