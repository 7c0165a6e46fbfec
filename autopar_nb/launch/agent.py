"""The elastic agent process of a launched run: ``python agent.py CONFIG.json``.

Started by :func:`autopar_nb.launch.launch` as a child of the notebook kernel, it runs torch's own launcher — the
same ``torch.distributed.run`` argument parsing and ``elastic_launch`` that ``torchrun`` uses — so the workers are
started exactly as ``torchrun`` would start them (c10d rendezvous on 127.0.0.1, one subprocess per rank, per-rank
log files, restarts). It adds two things torchrun lacks:

* a watchdog thread: when the kernel that started it disappears (killed, crashed), the agent signals itself, and
  torch's SIGTERM handling ends every worker;
* ``result.json`` in the run directory: the exit state and, on failure, each failed rank's exit code and error.

This file is run as a script and imports only the standard library and torch: never autopar_nb, IPython or widgets.
"""

from __future__ import annotations

import json
import os
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


def main(config_path: str) -> int:
    with open(config_path) as f:
        cfg = json.load(f)
    threading.Thread(target=_watch_parent, args=(cfg["parent_pid"],), daemon=True, name="autopar-parent-watch").start()

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
                "error_file": failure.error_file, "signal": failure.signal_name() if failure.exitcode < 0 else "",
                "timestamp": failure.timestamp,
            }
    except SignalException as e:
        rc = 2
        result["state"] = "stopped"
        result["signal"] = str(e.sigval)
    except Exception as e:  # rendezvous or agent errors: reported as they are
        rc = 3
        result["state"] = "error"
        result["error"] = f"{type(e).__name__}: {e}"
    _write_result(cfg["result_path"], result)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
