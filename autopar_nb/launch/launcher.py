"""``launch()``: run a training script on N local processes through torch's elastic launcher,
without blocking.

Process layout::

    kernel ── monitor thread (channel server, device sampling)     autopar_nb/launch/monitor.py
       └── agent: python agent.py  (torch.distributed.run's config + elastic_launch,
                                    c10d rendezvous on 127.0.0.1)
              ├── worker rank 0: python -u script.py --steps N ...
                                 env: RANK, ..., AUTOPAR_METRICS, AUTOPAR_TOKEN
              └── worker rank 1: ...

Warm (the default, ``pool.py``): the agent is a standby started ahead of the run, and the workers
are children of its forkserver, forked with torch and the script's imports loaded, running the
script by ``runpy.run_path`` (torchrun's ``--run-path --start-method forkserver``)::

       └── agent: python agent.py --standby ...
              ├── forkserver (python -c 'from multiprocessing.forkserver import main; ...'),
                  resource tracker
              │     ├── worker rank 0: runpy.run_path(script.py, run_name="__main__"),
                                       sys.argv = [script.py, ...]
              │     └── worker rank 1: ...

The agent is a separate process so the kernel never runs torch's signal handling or rendezvous, a
crashed kernel takes its workers with it (the agent watches its parent), and the kernel's own CUDA
state cannot leak into workers. Every live run is stopped when the kernel exits (``atexit``).
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..hardware import nvml_visible_gpus, visible_gpus
from ..units import fmt_bytes
from .channel import MetricsServer
from .monitor import Monitor
from .pool import POOL, job_env, script_preload
from .procs import TOKEN_ENV
from .run import TERMINAL, Run, cpu_limit_env

AGENT = Path(__file__).with_name("agent.py")
_live: weakref.WeakSet[Run] = weakref.WeakSet()
_live_lock = threading.Lock()
_launch_lock = threading.Lock()
"""held while one launch() checks for a live run, starts its own and registers it"""
RDZV_JOIN_TIMEOUT_S = 60.0
"""seconds the agent may take to complete the rendezvous (torch's default is 600)"""


class LaunchError(RuntimeError):
    """A run cannot be started: the message says why and what to do."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def script_args(steps: int | None, flags: dict[str, Any]) -> list[str]:
    """``--steps N`` and ``key=value`` pairs as command-line flags: ``ckpt_dir="d"`` -> ``--ckpt-dir
    d``; True -> ``--flag``; False or None -> omitted; lists and tuples -> repeated values after one
    flag."""
    out = [] if steps is None else ["--steps", str(steps)]
    for key, value in flags.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, (list, tuple)):
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return out


def shutdown_timeout_args() -> list[str]:
    """``--shutdown-timeout 1`` where this torch's torchrun takes it (2.12 and later): the agent
    SIGKILLs a worker that ignores SIGTERM for 1 s, so a stop finishes within 5 s; older torchruns
    (the GPU image's 2.11) wait their own default."""
    from torch.distributed.run import get_args_parser

    takes = any("--shutdown-timeout" in a.option_strings for a in get_args_parser()._actions)
    return ["--shutdown-timeout", "1"] if takes else []


def elastic_agent_env(nproc: int, env: dict[str, str]) -> dict[str, str]:
    """What torchrun's ``main`` and torch's ``elastic_launch`` add to the agent's environment before
    they start the workers, which cold workers inherit: a warm standby's forkserver was started
    before that, so the standby is started with it (``env``: the workers' environment so far, which
    a user's own value in it keeps)."""
    import dataclasses

    from torch.distributed.launcher.api import LaunchConfig

    default = {f.name: f.default for f in dataclasses.fields(LaunchConfig)}["signals_to_handle"]
    out = {"TORCHELASTIC_SIGNALS_TO_HANDLE": default}
    # torch.distributed.run's rule; OpenMP reads it at import
    if "OMP_NUM_THREADS" not in env and nproc > 1:
        out["OMP_NUM_THREADS"] = "1"
    return out


def live_runs() -> list[Run]:
    """The runs of this process that have not ended."""
    with _live_lock:
        return [r for r in _live if not r.done]


def _gpu_count(env: dict[str, str]) -> int:
    """GPUs workers with environment ``env`` could use (NVML, reading their CUDA_VISIBLE_DEVICES as
    CUDA does: indices, UUIDs, MIG instances), without initialising CUDA here; 0 without NVML."""
    return len(nvml_visible_gpus(env) or [])


def _cuda_state(env: dict[str, str] | None = None) -> dict:
    """What CUDA looks like in this process, without initialising it: {"initialized": bool,
    "compute_modes": {k: "default"|"exclusive_process"|"prohibited"|"other"}, "held": {k: bytes this
    process holds}, "total": {k: bytes}}, keyed by the workers' local rank k: the k-th GPU their
    environment ``env`` shows (default: this process's). The per-GPU figures only when CUDA is
    initialised here and NVML works. What this process holds is its CUDA allocator's reserved bytes
    on that GPU (matched by UUID), or NVML's figure for this PID when larger (it includes the CUDA
    context; in a container NVML lists host PIDs, so only the allocator's figure is found)."""
    torch = sys.modules.get("torch")
    initialized = bool(torch is not None and torch.cuda.is_initialized())
    state: dict = {"initialized": initialized, "compute_modes": {}, "held": {}, "total": {}}
    if not initialized:
        return state
    try:
        import pynvml

        mine = visible_gpus(dict(os.environ))[:torch.cuda.device_count()]
        reserved = {g.uuid: float(torch.cuda.memory_reserved(j)) for j, g in enumerate(mine)}
        theirs = visible_gpus(dict(os.environ if env is None else env))
        pynvml.nvmlInit()
    except Exception:  # NVML unavailable: nothing known, nothing to check
        return state
    try:
        for k, gpu in enumerate(theirs):
            h = pynvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
            state["compute_modes"][k] = _compute_mode(pynvml, h)
            state["total"][k] = gpu.memory_bytes
            ours = sum(p.usedGpuMemory or 0 for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)
                       if p.pid == os.getpid())
            state["held"][k] = max(float(ours), reserved.get(gpu.uuid, 0.0))
    except Exception:  # a query the driver does not answer: check what was found
        pass
    finally:
        pynvml.nvmlShutdown()
    return state


def _compute_mode(nv, handle) -> str:
    """NVML's compute mode of a device, as a word."""
    names = {nv.NVML_COMPUTEMODE_DEFAULT: "default",
             nv.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS: "exclusive_process",
             nv.NVML_COMPUTEMODE_PROHIBITED: "prohibited"}
    try:
        return names.get(nv.nvmlDeviceGetComputeMode(handle), "other")
    except Exception:  # MIG instances have no compute mode of their own
        return "default"


HELD_FRACTION = 0.5
"""a kernel holding more than this fraction of a GPU the workers need is refused (they would run out
of memory)"""


def check_cuda(nproc: int, backend: str, env: dict[str, str] | None = None) -> None:
    """Raise LaunchError when this kernel's CUDA state would break the workers (environment ``env``,
    default this process's): CUDA is initialised here and a GPU the workers need is in
    exclusive-process (or prohibited) compute mode, so their contexts would be refused, or this
    kernel holds more than half of its memory."""
    if backend != "nccl":
        return
    state = _cuda_state(env)
    if not state["initialized"]:
        return
    bad = {i: m for i, m in state["compute_modes"].items() if i < nproc
           and m in ("exclusive_process", "prohibited")}
    if bad:
        which = ", ".join(f"GPU {i} ({m})" for i, m in sorted(bad.items()))
        raise LaunchError(
            f"CUDA is already initialised in this kernel and {which} admits one process only, so "
            "the workers could not open it. Restart the kernel and launch before any CUDA work in "
            "the notebook (capture and planning never need CUDA), or set the GPUs to the default "
            "compute mode (`nvidia-smi -c DEFAULT`).")
    full = {i: b for i, b in state.get("held", {}).items()
            if i < nproc and state.get("total", {}).get(i)
            and b > HELD_FRACTION * state["total"][i]}
    if full:
        which = ", ".join(f"GPU {i} ({fmt_bytes(b)} of {fmt_bytes(state['total'][i])})"
                          for i, b in sorted(full.items()))
        raise LaunchError(
            f"this kernel holds most of the memory of {which}, so the workers would run out of "
            "memory. Free it first (`del` the CUDA tensors and models, then "
            "`torch.cuda.empty_cache()`), or restart the kernel and launch before any CUDA work in "
            "the notebook.")


def launch(script: str | os.PathLike | Callable[[Path], Any], nproc: int | None = None,
           steps: int | None = 50, *, plan: Any = None, max_restarts: int = 0,
           hang_timeout_s: float | None = 600.0, run_dir: str | os.PathLike | None = None,
           backend: str | None = None, monitor: bool = True, env: dict[str, str] | None = None,
           warm: bool = True, memory_threshold: float = 0.92, **script_flags: Any) -> Run:
    """Start ``script`` on ``nproc`` local processes with torch's elastic launcher and return a
    :class:`Run` at once.

    Args:
        script: a training script path, or a callable ``export(path)`` that writes the script to
            ``path`` (the run directory's ``train.py``); it must implement the metrics protocol
            in ``channel.py`` to be monitored.
        nproc: worker processes; default one per visible GPU, else the plan's world size, else 2.
        steps: passed as ``--steps N`` (None: not passed).
        plan: the Plan that was launched: its predicted step time and memory are shown against
            the measured ones.
        max_restarts: elastic restarts of the whole worker group after a failure (the script
            should resume from its last checkpoint, e.g. ``ckpt_dir=..., ckpt_every=...``).
        hang_timeout_s: a run in which some rank made no step progress for this long is reported
            as hung and torn down (None: never).
        run_dir: where the script copy, logs and result go (default: a new temporary directory).
        backend: "gloo" (CPU) or "nccl" (GPUs); default nccl when GPUs are visible. Only chooses
            the checks, the device sampling and the default nproc: the script picks its own
            backend.
        monitor: False leaves out the metrics channel and device sampling (the run then reports
            only its end).
        env: extra environment variables for the workers.
        warm: run through the warm pool (``pool.py``): the agent was started ahead with torch
            imported, and each rank is forked from a forkserver that preloaded torch and the
            script's imports, then runs the script with torchrun's ``--run-path --start-method
            forkserver`` (``runpy.run_path(script, run_name="__main__")`` with the same
            ``sys.argv``, environment, working directory and ``sys.path[0]``). The first warm
            launch of a kernel starts the pool; when a run ends the next standby starts. False: a
            fresh agent and ``python -u script.py`` per rank, as torchrun does by default.
        memory_threshold: the share of a rank's memory limit above which its memory is an event
            (``memory_high``, ``run.events``; re-planning acts on it, see ``replan.py``).
        **script_flags: more flags for the script: ``ckpt_dir="/tmp/ck"`` becomes
            ``--ckpt-dir /tmp/ck``.

    Every rank starts in this process's working directory (a notebook's kernel: the notebook's
    folder), as ``torchrun /abs/path/train.py`` run from there would start it, so paths the cell
    opens relative to the notebook (``data/tokens.bin``) hold in every rank; the script's own
    directory is ``sys.path[0]``, as with ``python script.py``. Warm and cold alike; the run
    directory's ``command.txt`` is that ``cd`` and torchrun line.

    Raises:
        LaunchError: another run of this kernel is still alive, the kernel's CUDA state would
            break the workers, or this process's working directory no longer exists.
    """
    # one run per kernel: checked and registered under one lock, so two threads cannot both start a
    # run
    if not _launch_lock.acquire(blocking=False):
        raise LaunchError("another launch() of this kernel is starting a run right now (from "
                          "another thread): wait for it, then call run.stop() or run.wait() on "
                          "that run first")
    try:
        alive = live_runs()
        if alive:
            r = alive[0]
            raise LaunchError(f"a run is still {r.status} ({r.run_id[:8]}, {r.nproc} processes, "
                              f"started {time.time() - r.started:.0f} s ago): call run.stop() or "
                              "run.wait() on it first (autopar_nb.launch.live_runs() lists it)")
        if not 0 < memory_threshold <= 1:
            raise LaunchError(f"memory_threshold must be in (0, 1], got {memory_threshold}")
        return _start(script, nproc, steps, plan=plan, max_restarts=max_restarts,
                      hang_timeout_s=hang_timeout_s, run_dir=run_dir, backend=backend,
                      monitor=monitor, env=env, warm=warm, memory_threshold=memory_threshold,
                      script_flags=script_flags)
    finally:
        _launch_lock.release()


def _start(script, nproc, steps, *, plan, max_restarts, hang_timeout_s, run_dir, backend, monitor,
           env, warm, script_flags, memory_threshold: float = 0.92) -> Run:
    """launch()'s work, under ``_launch_lock``: export, start the agent, register and monitor the
    run."""
    seen = {**os.environ, **(env or {})}  # what the workers will see
    backend, nproc = _backend_and_nproc(plan, nproc, backend, seen)
    workdir = _kernel_workdir()
    run_id = secrets.token_hex(8)
    run_dir = _fresh_run_dir(run_dir, run_id)
    script_path = _script_path(script, run_dir)
    if plan is not None and hasattr(plan, "to_json"):
        (run_dir / "plan.json").write_text(plan.to_json())

    worker_env = _worker_env(env, plan, backend, nproc, warm)
    torchrun_args = _torchrun_args(nproc, run_id, run_dir, max_restarts, warm, script_path,
                                   script_args(steps, script_flags))
    command = [sys.executable, "-m", "torch.distributed.run", *torchrun_args]
    (run_dir / "command.txt").write_text(f"cd {shlex.quote(workdir)} && {shlex.join(command)}\n")
    # cwd: the ranks' working directory; path: their sys.path[0] (what `python script.py` puts
    # first)
    cfg = {"parent_pid": os.getpid(), "result_path": str(run_dir / "result.json"),
           "torchrun_args": torchrun_args, "warm": warm, "cwd": workdir,
           "path": str(script_path.parent), "log": str(run_dir / "agent.log")}
    (run_dir / "agent.json").write_text(json.dumps(cfg, indent=1))

    if warm:
        preload = script_preload(script_path)
        server, token, proc = _hand_standby(run_dir, script_path, worker_env, monitor, preload)
    else:
        server, token, proc = _start_agent(run_dir, worker_env, monitor, workdir)

    run = Run(run_id=run_id, run_dir=run_dir, script=script_path, nproc=nproc, steps=steps,
              token=token, backend=backend, max_restarts=max_restarts,
              hang_timeout_s=hang_timeout_s, plan=plan, command=command)
    run.warm = warm
    run.worker_env = worker_env
    run.memory_threshold = memory_threshold
    run._proc = proc
    if warm:
        # when the run is over the next standby warms up (not before: its imports would compete with
        # the run)
        run._end_hooks.append(lambda _: POOL.refill("launch", env=worker_env, monitor=monitor,
                                                    preload=preload))
    run._server = server
    _announce_and_monitor(run, plan, monitor)
    return run


def _backend_and_nproc(plan, nproc: int | None, backend: str | None,
                       seen: dict[str, str]) -> tuple[str, int]:
    """The backend (nccl when GPUs are visible) and the worker count (one per GPU, else the plan's
    world size, else 2), checked against the GPUs the workers will see."""
    gpus = _gpu_count(seen)
    backend = backend or ("nccl" if gpus else "gloo")
    if nproc is None:
        mesh = getattr(plan, "mesh", None)
        nproc = gpus if backend == "nccl" and gpus else (mesh.world_size if mesh is not None else 2)
    if nproc < 1:
        raise LaunchError(f"nproc must be >= 1, got {nproc}")
    if backend == "nccl" and gpus and nproc > gpus:
        raise LaunchError(f"nproc={nproc} but only {gpus} GPU(s) are visible: pass nproc <= "
                          f"{gpus}, or backend='gloo' for CPU workers")
    check_cuda(nproc, backend, seen)
    return backend, nproc


def _kernel_workdir() -> str:
    """Where the ranks start: the kernel's (the notebook's) working directory."""
    try:
        return os.getcwd()
    except FileNotFoundError:
        raise LaunchError("this kernel's working directory was deleted, so the ranks would have "
                          "none to start in: os.chdir() to an existing directory (the one the "
                          "cell's relative paths are relative to) and launch again") from None


def _fresh_run_dir(run_dir, run_id: str) -> Path:
    """The run directory, made and absolute (the log and result paths hold from any working
    directory), without a previous run's result."""
    if run_dir is None:
        run_dir = tempfile.mkdtemp(prefix=f"autopar-run-{run_id[:8]}-")
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    # a reused run_dir: the previous run's end is not this one's
    for stale in ("result.json", "result.json.tmp"):
        (run_dir / stale).unlink(missing_ok=True)
    return run_dir


def _script_path(script, run_dir: Path) -> Path:
    """The training script's absolute path: ``script`` itself, or what the export callable wrote
    into ``run_dir``."""
    if callable(script) and not isinstance(script, (str, os.PathLike)):
        target = run_dir / "train.py"
        produced = script(target)
        script_path = Path(produced) if isinstance(produced, (str, os.PathLike)) else target
    else:
        script_path = Path(script)
    script_path = script_path.resolve()
    if not script_path.is_file():
        raise LaunchError(f"training script {script_path} does not exist: export the plan first "
                          "(ap.export(path)) or pass the path of an existing script")
    return script_path


def _worker_env(env, plan, backend: str, nproc: int, warm: bool) -> dict[str, str]:
    """The workers' environment, less the run's token and metrics address (set when the agent
    starts)."""
    worker_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    if backend == "gloo":
        # one thread per CPU worker (oversubscription pitfall)
        worker_env.setdefault("OMP_NUM_THREADS", "1")
    # a CPU memory limit: RSS that tracks the tensors (run.py)
    for k, v in cpu_limit_env(plan, backend).items():
        worker_env.setdefault(k, v)
    # Restarts: by default the c10d rendezvous shares the agent's TCPStore with the workers and
    # keeps it across attempts, so a restarted group finds the failed attempt's keys (gloo:
    # "connectFullMesh failed ... Connection refused", ../shared/notes/torch-cpu-distributed.md
    # pitfall 3). Unshared, every attempt gets a fresh store hosted by its rank 0, and a script's
    # plain init_process_group() restarts cleanly.
    worker_env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    worker_env = job_env(worker_env)
    if warm:
        worker_env.update(elastic_agent_env(nproc, worker_env))
    return worker_env


def _torchrun_args(nproc: int, run_id: str, run_dir: Path, max_restarts: int, warm: bool,
                   script_path: Path, sargs: list[str]) -> list[str]:
    """torch.distributed.run's command line for one local node."""
    return [
        "--nnodes", "1", "--nproc-per-node", str(nproc),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id",
        run_id,
        # the agent must host the rendezvous store: a port taken since free_port() is then an error
        # at once (else torch falls back to connecting to whoever holds it, and waits); and joining
        # has its own time limit
        "--rdzv-conf", f"is_host=1,join_timeout={RDZV_JOIN_TIMEOUT_S:.0f}",
        "--local-addr", "127.0.0.1",
        "--max-restarts", str(max_restarts), "--monitor-interval", "0.1",
        "--log-dir", str(run_dir / "logs"), "--redirects", "3",
        *shutdown_timeout_args(),
        # warm: each rank forked from the standby's preloaded forkserver runs the script with
        # runpy.run_path
        *(["--run-path", "--start-method", "forkserver"] if warm else []),
        str(script_path), *sargs,
    ]


def _hand_standby(run_dir: Path, script_path: Path, worker_env: dict[str, str], monitor: bool,
                  preload):
    """The warm pool's standby agent takes the run: its (metrics server, token, process). A standby
    comes with its token and metrics channel: its processes were started with them."""
    try:
        standby = POOL.hand("launch", run_dir / "agent.json", env=worker_env, monitor=monitor,
                            preload=preload, script_dir=script_path.parent)
    except RuntimeError as e:
        raise LaunchError(str(e)) from None
    return standby.server, standby.token, standby.proc


def _start_agent(run_dir: Path, worker_env: dict[str, str], monitor: bool, workdir: str):
    """A fresh agent process for the run: its (metrics server, token, process)."""
    server = MetricsServer() if monitor else None
    token = server.token if server is not None else secrets.token_hex(16)
    full_env = {**worker_env, TOKEN_ENV: token}
    if server is not None:
        full_env["AUTOPAR_METRICS"] = server.address
    with open(run_dir / "agent.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, str(AGENT), str(run_dir / "agent.json")],
                                env=full_env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT,
                                cwd=workdir, start_new_session=True)  # see procs.py
    return server, token, proc


def _announce_and_monitor(run: Run, plan, monitor: bool) -> None:
    """The run's first event, its monitor started and the run registered as live."""
    what = plan.summary() if hasattr(plan, "summary") and getattr(plan, "mesh", None) is not None \
        else run.script.name
    nproc, warm = run.nproc, run.warm
    run._lifecycle("launch",
                   f"{nproc} {'warm ' if warm else ''}process{'es' if nproc > 1 else ''}: {what}",
                   t=0.0)
    run._monitor = Monitor(run, sample=monitor)
    with _live_lock:
        _live.add(run)
    run._monitor.start()


@atexit.register
def _stop_all_at_exit() -> None:
    """Kernel shutdown: end every live run's workers (runs are stopped in parallel)."""
    runs = [r for r in list(_live) if r.status not in TERMINAL or not r.done]
    threads = [threading.Thread(target=r.stop, args=("the kernel is shutting down",)) for r in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(6.0)
