"""The elastic agent process of a launched run: ``python agent.py CONFIG.json``.

Started by :func:`autopar_nb.launch.launch` as a child of the notebook kernel, it runs torch's own
launcher — the same ``torch.distributed.run`` argument parsing and ``elastic_launch`` that
``torchrun`` uses — so the workers are started exactly as ``torchrun`` would start them (c10d
rendezvous on 127.0.0.1, one process per rank, per-rank log files, restarts). It adds two things
torchrun lacks:

* a watchdog thread: when the kernel that started it disappears (killed, crashed), the agent signals
  itself, and torch's SIGTERM handling ends every worker;
* ``result.json`` in the run directory: the exit state and, on failure, each failed rank's exit code
  and error.

Warm (``python agent.py --standby PRELOAD IDLE_S PARENT_PID``, see ``pool.py``): the agent starts
ahead of its run, starts multiprocessing's forkserver with ``PRELOAD`` imported in it, imports
torch's launcher itself meanwhile, and waits for the path of its run's config on standard input
(quitting after ``IDLE_S`` seconds, or at end of file). The run's torchrun flags then carry
``--run-path --start-method forkserver``: each rank is forked from that forkserver and runs the
script through torchrun's ``run_script_path``. Before starting them the agent takes the place a cold
agent started for the run has: the kernel's working directory (``cwd`` in the config) and the
script's directory as ``sys.path[0]`` (``path``; multiprocessing hands both to each rank, as
``python script.py`` run from that directory would have them), its own output in the run's
``agent.log``.

This file is run as a script and imports only the standard library and torch: never autopar_nb,
IPython or widgets.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import threading
import time


def _watch_parent(parent_pid: int) -> None:
    """SIGTERM ourselves once the kernel that started us is gone (we get re-parented)."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGTERM)
            return


def _write_result(path: str, result: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, path)


def start_forkserver(preload: list[str]) -> None:
    """Start multiprocessing's forkserver now, with ``preload`` imported in it (it imports while
    this process goes on). ``__main__`` is preloaded too, so a forked child need not import this
    file again.

    The forkserver is a fresh interpreter (never a fork of this process) and inherits this process's
    environment; torch is only imported there, so no CUDA context exists in it to be forked."""
    import multiprocessing
    from multiprocessing import forkserver

    multiprocessing.set_forkserver_preload(["__main__", *preload])
    forkserver.ensure_running()


def forkserver_ready() -> None:
    """Block until the forkserver has imported its preload: start one child through it and wait for
    it."""
    import multiprocessing

    child = multiprocessing.get_context("forkserver").Process(target=time.sleep, args=(0,),
                                                              daemon=True)
    child.start()
    child.join()


def wait_for_job(idle_timeout_s: float) -> str | None:
    """The first line of standard input, or None after ``idle_timeout_s`` seconds or at end of
    file."""
    ready, _, _ = select.select([sys.stdin], [], [], idle_timeout_s)
    line = sys.stdin.readline() if ready else ""
    return line.strip() or None


def standby(preload: list[str], idle_timeout_s: float, parent_pid: int) -> int:
    """Warm up, then run the one job given on standard input (see the module docstring)."""
    # torch's own handler replaces it
    signal.signal(signal.SIGTERM, lambda *_: exit_now(128 + signal.SIGTERM))
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True,
                     name="autopar-parent-watch").start()
    here = os.path.dirname(os.path.abspath(__file__))
    if sys.path and os.path.abspath(sys.path[0] or ".") == here:
        del sys.path[0]  # this file's directory: not where any script's imports come from
    start_forkserver(preload)
    # what main() imports, imported now
    from torch.distributed.launcher.api import elastic_launch  # noqa: F401
    from torch.distributed.run import config_from_args  # noqa: F401

    forkserver_ready()
    print(f"standby ready after {time.process_time():.2f} s CPU; preloaded in the forkserver: "
          f"{', '.join(preload)}", flush=True)
    job = wait_for_job(idle_timeout_s)
    if job is None:
        return 0
    return main(job, watch=False)


def _into_run(cfg: dict) -> None:
    """Warm: the run's log, working directory and import path, as a cold agent started for it would
    have."""
    if cfg.get("log"):
        fd = os.open(cfg["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        for std in (1, 2):
            os.dup2(fd, std)
        os.close(fd)
    if cfg.get("cwd"):
        os.chdir(cfg["cwd"])
    if cfg.get("path"):
        sys.path.insert(0, cfg["path"])  # `python script.py` puts the script's directory first


def main(config_path: str, *, watch: bool = True) -> int:
    with open(config_path) as f:
        cfg = json.load(f)
    if watch:
        threading.Thread(target=_watch_parent, args=(cfg["parent_pid"],), daemon=True,
                         name="autopar-parent-watch").start()
    if cfg.get("warm"):
        _into_run(cfg)

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    # the same flags a user would give torchrun (see the run directory's command.txt)
    args = parse_args(cfg["torchrun_args"])
    config, cmd, cmd_args = config_from_args(args)
    result: dict = {"state": "running", "failures": {}}
    rc = 0
    try:
        elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
        result["state"] = "succeeded"
    except ChildFailedError as e:
        rc = 1
        result["state"] = "failed"
        for rank, failure in e.failures.items():
            result["failures"][str(rank)] = {
                "exitcode": failure.exitcode, "pid": failure.pid, "message": str(failure.message),
                "error_file": failure.error_file, "signal": failure.signal_name()
                if failure.exitcode < 0 else "", "timestamp": failure.timestamp,}
    except SignalException as e:
        rc = 2
        result["state"] = "stopped"
        result["signal"] = str(e.sigval)
    # rendezvous or agent errors: reported with their causes (torch's say "see inner")
    except Exception as e:
        from torch.distributed.elastic.rendezvous import RendezvousError

        rc = 3
        result["state"] = "error"
        chain, c = [], e
        while c is not None and len(chain) < 5:
            chain.append(f"{type(c).__name__}: {c}")
            c = c.__cause__ or c.__context__
        where = (f"the rendezvous at {args.rdzv_endpoint} failed (a port taken since it was "
                 "chosen: launch again, which picks another): " if isinstance(e, RendezvousError)
                 else "")
        result["error"] = where + "; caused by ".join(chain)
    _write_result(cfg["result_path"], result)
    return rc


def exit_now(rc: int) -> None:
    """Exit without the interpreter's clean-up: result.json is written and every worker has ended;
    unloading torch would take the kernel's view of the run another second or two to end. A
    forkserver this process started ends first (on its own it would notice our exit and unload torch
    too)."""
    fs = sys.modules.get("multiprocessing.forkserver")
    pid = getattr(getattr(fs, "_forkserver", None), "_forkserver_pid", None)
    if pid:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(rc)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--standby"]:
        exit_now(standby(json.loads(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])))
    exit_now(main(sys.argv[1]))
