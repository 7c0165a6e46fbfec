"""The warm pool: launch and verify reach their first step in about a second instead of paying
Python's and torch's start-up on every call.

A *standby* is one process started ahead of a job, fresh from ``python`` (never forked from the
kernel, so nothing of the kernel's CUDA state, threads or modules comes along), that imported torch
and started multiprocessing's forkserver with the modules the job's workers will import preloaded
(``multiprocessing.set_forkserver_preload``). It waits for one job on its standard input:

* ``launch``: the elastic agent (``agent.py --standby``), which runs the job exactly as the cold
  path does (torch's own ``torchrun`` argument parsing and ``elastic_launch``) with torchrun's
  ``--run-path --start-method forkserver``: each rank is forked from the preloaded forkserver and
  runs the exported script with ``runpy.run_path(script, run_name="__main__")`` and ``sys.argv`` set
  (``torch.distributed.run.run_script_path``);
* ``verify``: ``python -m autopar_nb.verify.job --standby``, which runs
  :func:`autopar_nb.verify.check.verify_here` with ``start_method="forkserver"`` (and the
  single-process reference in the same warm process).

A standby serves one job, so everything it hands its workers is the job's own: it is started with
the job's environment (the kernel's, the run's extra variables, and the run's ``AUTOPAR_TOKEN`` and
metrics address, drawn in advance), which its forkserver and so every worker inherit, as torchrun's
workers inherit the agent's — and ``/proc/PID/environ`` of every process of the run carries the
token, so a teardown finds them all (``procs.py``). When a job ends, the pool starts the next
standby (after the job, so its imports never compete with a run). A standby whose environment no
longer matches the next job's is replaced; one that died (crashed, or quit after ``IDLE_TIMEOUT_S``
or ``AUTOPAR_POOL_IDLE_S`` without a job) is replaced transparently; a standby quits when the kernel
goes (the watchdog of ``agent.py``, and end of file on its standard input), and its forkserver quits
with it. The standbys' logs live in an ``autopar-pool-*`` temporary folder, removed at the kernel's
normal exit; a killed kernel's folder is removed by the next pool that starts (its owner file names
a process that is gone).
"""

from __future__ import annotations

import ast
import atexit
import importlib
import importlib.util
import json
import os
import secrets
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from ..export.files import runtime_name
from .channel import MetricsServer
from .procs import TOKEN_ENV, terminate

AGENT = Path(__file__).with_name("agent.py")
RUNTIME = Path(__file__).resolve().parent.parent / "runtime"

IDLE_TIMEOUT_S = 300.0
"""seconds a standby waits for a job before it quits (the next job then starts a new one): a standby
holds 375 MiB (launch) or 455 MiB (verify) of its own (USS of the standby and its forkserver, both
with torch imported; ``bench/launch.py --part standby``), so after a run it is kept for the next
edit-and-relaunch of a notebook session, not for the rest of the afternoon; ``AUTOPAR_POOL_IDLE_S``
sets it (0: none is kept)"""
IDLE_ENV = "AUTOPAR_POOL_IDLE_S"
ON_DEMAND_IDLE_S = 60.0
"""a standby started for a job that waits (``Pool.take``) waits at least this long for it, whatever
the idle timeout"""
OWNER_FILE = "owner.json"
"""in a pool's log folder: {"pid", "create_time"} of the process (the kernel) whose pool it is"""
LEGACY_STALE_S = 86400.0
"""a pool folder without an owner file (written by an older autopar-nb) is stale when untouched this
long"""

BASE_PRELOAD = ("torch", "torch.distributed.run",
                "torch.distributed.elastic.multiprocessing.errors", "torch._dynamo",
                "torch.distributed.checkpoint", "torch.distributed.pipelining", "torch.export",
                "torch.export._trace", "encodings.idna")
"""imported by every forkserver: torch, torchrun's ``run_script_path`` (the ranks' entry point),
``@record``, and what torch imports on first use, measured in warm ranks: torch._dynamo (DTensor's
``distribute_tensor``: 0.7 s of a rank's first step), DCP and pipelining (FSDP2 and the
optimizer-state helpers), torch.export and its tracer (every pipelined rank traces the model:
``pipeline()``'s first call imports 400 modules, aot_autograd, parts of inductor and networkx, 0.3
of its 0.7 CPU s on a 2-layer LLaMA; 0.28 CPU s once in the forkserver), the idna codec (a socket to
127.0.0.1)"""

KINDS = ("launch", "verify")

TEST_RUNNER_ENV = ("PYTEST_CURRENT_TEST",)
"""variables a test runner rewrites on every test: left out of every run's environment, warm and
cold alike (see :func:`job_env`), else no standby could ever serve a job of the next test"""


def job_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` without :data:`TEST_RUNNER_ENV` and the run's own token and metrics address (a
    standby draws those)."""
    return {k: v for k, v in env.items()
            if k not in (*TEST_RUNNER_ENV, TOKEN_ENV, "AUTOPAR_METRICS")}


def _installed_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple({os.path.realpath(paths[k]) + os.sep
                  for k in ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(k)})


def importable_here(names: list[str] | set[str]) -> list[str]:
    """The module names among ``names`` that come from Python's own or installed packages (never a
    user's file that a script directory could shadow: a forkserver that preloaded ``utils`` from
    site-packages would hand it to a script with its own ``utils.py``). A module is looked up
    without importing anything new here: by its file when this process imported it (the cell's
    imports, run on the meta device), else by its spec when its package is imported here (or it has
    none)."""
    roots = _installed_roots()
    out = []
    for name in sorted(set(names)):
        mod = sys.modules.get(name)
        if mod is not None:
            path = getattr(mod, "__file__", None)
        elif "." not in name or name.rsplit(".", 1)[0] in sys.modules:
            try:
                spec = importlib.util.find_spec(name)
            except (ImportError, ValueError):
                spec = None
            path = spec.origin if spec is not None else None
        else:
            path = None
        if path and os.path.realpath(path).startswith(roots):
            out.append(name)
    return out


def imports_of(code: str) -> set[str]:
    """Absolute module names imported anywhere in ``code`` (``import a.b`` -> a.b; ``from a.b import
    c`` -> a.b)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return set()
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
    return out


def script_preload(script: str | os.PathLike) -> list[str]:
    """What a launch standby preloads for ``script``: torch's basics and the imports of the script
    and its runtime module that are safe to preload (see :func:`importable_here`)."""
    code = ""
    # and its runtime's
    for path in (Path(script), Path(script).with_name(runtime_name(Path(script).name) + ".py")):
        try:
            code += Path(path).read_text() + "\n"
        except OSError:
            pass
    return sorted(
        set(BASE_PRELOAD) | set(importable_here(imports_of(code))) | set(lazily_loaded(code)))


def lazily_loaded(code: str) -> list[str]:
    """The modules that the names ``code`` imports from installed packages are defined in, when
    those packages load them on first access (transformers' ``from transformers import
    LlamaForCausalLM`` imports its modelling module then: seconds of each warm rank's start-up),
    found by resolving the names here. Only a package :func:`importable_here` passes is imported to
    find out (a notebook's kernel has imported it already, to build the model), never a user's own
    module."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return []
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
            and importable_here([node.module])):
            try:
                module = importlib.import_module(node.module)
            except Exception:  # an install that fails to import: its ranks report it, not this
                continue
            found += [getattr(getattr(module, a.name, None), "__module__", None)
                      for a in node.names]
    return importable_here([m for m in found if isinstance(m, str) and m in sys.modules])


def verify_preload(cell_code: str = "") -> list[str]:
    """What a verify standby preloads: torch's basics, every torch module the runtime imports (which
    the exported scripts import), ``autopar_nb.verify.ranks`` (the ranks' entry point) and the
    cell's safe imports."""
    runtime = set()
    for f in sorted(RUNTIME.glob("*.py")):
        runtime |= {m for m in imports_of(f.read_text()) if m.split(".")[0] == "torch"}
    cell = set(importable_here(imports_of(cell_code))) | set(lazily_loaded(cell_code))
    return sorted(set(BASE_PRELOAD) | runtime | cell | {"autopar_nb.verify.ranks"})


def shadowed(preload: tuple[str, ...] | list[str],
             script_dir: str | os.PathLike | None) -> list[str]:
    """The preloaded top-level modules that ``script_dir`` has a file or package of the same name
    for: a script there would import its own, not the preloaded one (unless it is the very file this
    process imported that module from: autopar_nb run from its own checkout)."""
    if script_dir is None:
        return []
    d = Path(script_dir)
    out = []
    for t in sorted({m.split(".")[0] for m in preload if m != "__main__"}):
        there = next((f for f in (d / f"{t}.py", d / t / "__init__.py") if f.exists()), None)
        mine = getattr(sys.modules.get(t), "__file__", None)
        if there is not None and not (mine and os.path.realpath(mine) == os.path.realpath(there)):
            out.append(t)
    return out


def idle_timeout_s() -> float:
    """Seconds a standby waits for a job: ``AUTOPAR_POOL_IDLE_S`` when set (0: no standby is kept
    after a job; the next warm launch or verify starts one), else :data:`IDLE_TIMEOUT_S`."""
    raw = os.environ.get(IDLE_ENV, "").strip()
    if not raw:
        return IDLE_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < float("inf"):
        raise ValueError(f"{IDLE_ENV}={raw!r}: give the seconds a warm standby waits for the next "
                         "launch or verify (a number >= 0; 0 keeps none after a run; default "
                         f"{IDLE_TIMEOUT_S:.0f})")
    return value


def owner_alive(folder: Path) -> bool | None:
    """Whether the process named in ``folder``'s owner file still runs (the same process: its start
    time matches, so a reused PID does not count); None when the folder has no readable owner
    file."""
    try:
        owner = json.loads((folder / OWNER_FILE).read_text())
        pid, started = int(owner["pid"]), float(owner["create_time"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        return abs(psutil.Process(pid).create_time() - started) < 0.01
    except psutil.Error:
        return False


def remove_stale_folders(root: str | os.PathLike | None = None) -> list[Path]:
    """Delete this user's ``autopar-pool-*`` log folders in ``root`` (default: the temporary
    directory) whose owner is gone: a kernel that was killed never ran its exit clean-up. A folder
    without an owner file (older versions) goes when untouched for :data:`LEGACY_STALE_S`. Returns
    the folders removed."""
    removed = []
    for folder in Path(root or tempfile.gettempdir()).glob("autopar-pool-*"):
        try:
            st = folder.lstat()
        except OSError:
            continue
        if not folder.is_dir() or folder.is_symlink() or st.st_uid != os.getuid():
            continue
        alive = owner_alive(folder)
        if alive is False or (alive is None and time.time() - st.st_mtime > LEGACY_STALE_S):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def make_pool_folder(root: str | os.PathLike | None = None) -> Path:
    """A new log folder for this process's pool, with its owner file; stale ones are removed
    first."""
    remove_stale_folders(root)
    folder = Path(tempfile.mkdtemp(prefix="autopar-pool-", dir=root))
    me = psutil.Process()
    (folder / OWNER_FILE).write_text(json.dumps({"pid": me.pid, "create_time": me.create_time()}))
    return folder


def standby_command(kind: str, preload: list[str], idle_timeout_s: float) -> list[str]:
    """The command line of a standby of ``kind``."""
    tail = ["--standby", json.dumps(list(preload)), repr(float(idle_timeout_s)), str(os.getpid())]
    if kind == "launch":
        return [sys.executable, str(AGENT), *tail]
    if kind == "verify":
        return [sys.executable, "-m", "autopar_nb.verify.job", *tail]
    raise ValueError(f"unknown standby kind {kind!r}: {', '.join(KINDS)}")


@dataclass(eq=False)
class Standby:
    """One warm process waiting for a job; the job's token and metrics channel are its own, made
    with it."""

    kind: str
    proc: subprocess.Popen
    token: str
    server: MetricsServer | None
    env: dict[str, str]
    """the environment it was started with, less its token and metrics address (what a job must
    match)"""
    monitor: bool
    preload: tuple[str, ...]
    log: Path
    started: float = field(default_factory=time.monotonic)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def hand(self, job: str | os.PathLike) -> bool:
        """Give it its job (a path it reads the job from); False when it can no longer take one."""
        if not self.alive():
            return False
        try:
            self.proc.stdin.write(f"{job}\n".encode())
            self.proc.stdin.close()
        except (BrokenPipeError, OSError, ValueError):
            return False
        return True

    def discard(self) -> None:
        """End it (and its forkserver) and close its metrics channel."""
        terminate(self.proc, self.token, grace_s=1.0)
        if self.server is not None:
            self.server.close()


class Pool:
    """At most one standby per kind (``launch``, ``verify``) for this process (the kernel)."""

    def __init__(self, idle_timeout_s: float | None = None):
        self.idle_timeout_s = idle_timeout_s
        """seconds a standby waits for a job; None: :func:`idle_timeout_s` (the environment's, read
        at each start)"""
        self._standby: dict[str, Standby] = {}
        self._lock = threading.Lock()
        self._dir: Path | None = None
        self.started = 0
        """standbys started so far (a test reads it: reuse starts none)"""

    def take(self, kind: str, *, env: dict[str, str], monitor: bool, preload: list[str],
             script_dir: str | os.PathLike | None = None) -> Standby:
        """A standby for a job with environment ``env`` (``monitor``: with a metrics channel): the
        waiting one when it is alive, its environment matches and ``script_dir`` (the directory a
        launched script imports from first) shadows none of its preloaded modules; else a new one
        (the job then waits for its start-up)."""
        with self._lock:
            s = self._standby.pop(kind, None)
        if s is not None and s.alive() and s.env == env and s.monitor == monitor \
                and not shadowed(s.preload, script_dir):
            return s
        if s is not None:
            s.discard()
        return self._start(kind, env=env, monitor=monitor, preload=preload,
                           idle_s=max(self._idle_s(), ON_DEMAND_IDLE_S))

    def hand(self, kind: str, job: str | os.PathLike, *, env: dict[str, str], monitor: bool,
             preload: list[str], script_dir: str | os.PathLike | None = None) -> Standby:
        """Give ``job`` to a standby (see :meth:`take`) and return it; one that died since it was
        checked is replaced at once. Raises RuntimeError, with the end of its log, when even a new
        standby cannot take the job."""
        want = dict(env=env, monitor=monitor, preload=preload, script_dir=script_dir)
        standby = self.take(kind, **want)
        if standby.hand(job):
            return standby
        standby.discard()
        standby = self.take(kind, **want)
        if standby.hand(job):
            return standby
        standby.discard()
        try:
            tail = standby.log.read_text(errors="replace")[-2000:]
        except OSError:
            tail = ""
        raise RuntimeError(f"the warm pool's {kind} process exited before it took its job "
                           f"(warm=False starts a fresh one); its output:\n{tail}")

    def refill(self, kind: str, *, env: dict[str, str], monitor: bool, preload: list[str]) -> None:
        """Start the next standby of ``kind`` unless one is waiting or the idle timeout is 0 (called
        when a job has ended)."""
        idle = self._idle_s()
        with self._lock:
            s = self._standby.get(kind)
            if idle == 0 or (s is not None and s.alive()):
                return
        new = self._start(kind, env=env, monitor=monitor, preload=preload, idle_s=idle)
        with self._lock:
            old, self._standby[kind] = self._standby.get(kind), new
        if old is not None:
            old.discard()

    def waiting(self, kind: str) -> Standby | None:
        """The standby of ``kind`` waiting now, if any."""
        with self._lock:
            s = self._standby.get(kind)
        return s if s is not None and s.alive() else None

    def wait_ready(self, kind: str, timeout: float = 60.0) -> bool:
        """Block until the waiting standby of ``kind`` has finished its imports (it writes "ready"
        to its log)."""
        s = self.waiting(kind)
        deadline = time.monotonic() + timeout
        while s is not None and s.alive() and time.monotonic() < deadline:
            try:
                if b"standby ready" in s.log.read_bytes():
                    return True
            except OSError:
                pass
            time.sleep(0.02)
        return False

    def close(self) -> None:
        """End every standby (the kernel is shutting down, or a test wants a cold start)."""
        with self._lock:
            standbys, self._standby = list(self._standby.values()), {}
        for s in standbys:
            s.discard()

    def _idle_s(self) -> float:
        return idle_timeout_s() if self.idle_timeout_s is None else self.idle_timeout_s

    def _start(self, kind: str, *, env: dict[str, str], monitor: bool, preload: list[str],
               idle_s: float) -> Standby:
        server = MetricsServer() if monitor else None
        token = server.token if server is not None else secrets.token_hex(16)
        full = {**env, TOKEN_ENV: token}
        if server is not None:
            full["AUTOPAR_METRICS"] = server.address
        else:
            full.pop("AUTOPAR_METRICS", None)
        if self._dir is None:
            self._dir = make_pool_folder()
        log = self._dir / f"{kind}-{token[:8]}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(standby_command(kind, preload, idle_s), env=full,
                                    stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # see procs.py
        self.started += 1
        return Standby(kind=kind, proc=proc, token=token, server=server, env=dict(env),
                       monitor=monitor, preload=tuple(preload), log=log)

    def _cleanup(self) -> None:
        self.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


POOL = Pool()
"""this process's pool"""

atexit.register(POOL._cleanup)
