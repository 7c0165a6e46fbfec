"""Reading a run's log files: torch's elastic agent writes, per restart attempt and rank,
``<run_dir>/logs/<run_id>_<random>/attempt_<n>/<local_rank>/{stdout,stderr}.log``
(``DefaultLogsSpecs``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from ..failures import where_failed

TAIL_BYTES = 64 * 1024
"""bytes read from the end of each log file for a tail"""


def attempt_dirs(run_dir: Path, run_id: str) -> list[Path]:
    """The agent's per-attempt log directories, in attempt order."""
    return sorted(Path(run_dir, "logs").glob(f"{run_id}_*/attempt_*"),
                  key=lambda p: int(p.name.split("_")[1]))


def latest_attempt(run_dir: Path, run_id: str) -> int:
    """The agent's latest restart attempt (-1 before any)."""
    found = [int(p.name.split("_")[1]) for p in Path(run_dir, "logs").glob(f"{run_id}_*/attempt_*")]
    return max(found, default=-1)


def rank_dir(run_dir: Path, run_id: str, rank: int, attempt: int | None = None) -> Path | None:
    """The log directory of ``rank`` in ``attempt`` (default: the latest); None before the agent
    made it. Local rank == global rank on one node."""
    attempts = attempt_dirs(run_dir, run_id)
    if attempt is not None:
        attempts = [p for p in attempts if p.name == f"attempt_{attempt}"]
    return attempts[-1] / str(rank) if attempts else None


def read_end(path: Path, limit: int | None) -> str:
    """The text of ``path`` (its last ``limit`` bytes, from a line start, when given); "" if it
    cannot be read."""
    try:
        with open(path, "rb") as f:
            if limit is not None:
                size = f.seek(0, 2)
                f.seek(max(0, size - limit))
                data = f.read()
                if size > limit:
                    data = data.split(b"\n", 1)[-1]
            else:
                data = f.read()
    except OSError:
        return ""
    text = data.decode(errors="replace")
    return text if not text or text.endswith("\n") else text + "\n"


def rank_output(d: Path | None, tail: int | None = None) -> str:
    """A rank's stdout then stderr from its log directory ``d``, or their last ``tail`` lines. With
    a tail only the end of each file is read: the monitor asks every second, and logs grow with the
    run."""
    if d is None:
        return ""
    limit = None if tail is None else TAIL_BYTES
    text = "".join(read_end(d / name, limit) for name in ("stdout.log", "stderr.log"))
    if tail is not None:
        text = "\n".join(text.splitlines()[-tail:])
    return text


def tagged(lines: list[str], rank: int) -> list[str]:
    """Lines prefixed with ``[rankN]`` (torch already prefixes stderr lines so: those are kept as
    they are)."""
    return [line if line.startswith(f"[rank{rank}]") else f"[rank{rank}] {line}" for line in lines]


def failures_from_result(result: dict, logs: Callable[[int], str]) -> dict[int, dict]:
    """rank -> {"rank", "attempt", "error", "traceback", "timestamp", "python"} of every failed rank
    in the agent's ``result.json``: the message and Python stack from the worker's ``@record`` error
    file ("python": True), else the end of its log (``logs(rank)``)."""
    out = {}
    for rank, f in (result.get("failures") or {}).items():
        msg = f.get("message") or ""
        tb = ""
        if f.get("error_file"):
            # written by @record in the worker: {"message": {"message": ..., "extraInfo":
            # {"py_callstack"}}}
            try:
                data = json.loads(Path(f["error_file"]).read_text())["message"]
                msg = data.get("message", msg) if isinstance(data, dict) else str(data)
                tb = (data.get("extraInfo", {}).get("py_callstack", "") if isinstance(data, dict)
                      else "")
            except (OSError, ValueError, KeyError, TypeError):
                pass
        sig = f" ({f['signal']})" if f.get("signal") else ""
        r = int(rank)
        out[r] = {"rank": r, "attempt": 0,
                  "error": at_site(f"exit code {f.get('exitcode')}{sig}: {msg}".strip(), tb),
                  "traceback": tb or logs(r), "timestamp": f.get("timestamp"), "python": bool(tb)}
    return out


def at_site(error: str, traceback_text: str) -> str:
    """``error`` with where the user's code failed (:func:`~autopar_nb.source.where_failed`) in
    front: "at train.py line 96 in loss_fn (`...`): ValueError: ..." (the exported script is the
    user's file)."""
    where = where_failed(traceback_text)
    return f"at {where}: {error}" if where else error


def reported_error(data: dict) -> dict:
    """A rank's own error event (``{"error", "traceback"}`` from its channel) as the run keeps it:
    the error with where it failed in front (:func:`at_site`)."""
    tb = str(data.get("traceback", ""))
    return {"error": at_site(str(data.get("error", "")), tb), "traceback": tb}


def error_from_result(result: dict, logs: Callable[[int], str]) -> dict | None:
    """{"rank", "attempt", "error", "traceback"} of the rank that failed first in the agent's
    ``result.json`` (the earliest failure time torch recorded, then the lowest rank); see
    :func:`failures_from_result`."""
    failures = failures_from_result(result, logs)
    if not failures:
        err = result.get("error")
        return {"rank": None, "attempt": 0, "error": str(err), "traceback": ""} if err else None
    first = min(failures.values(), key=lambda f: (f["timestamp"] or 0, f["rank"]))
    return {k: first[k] for k in ("rank", "attempt", "error", "traceback")}
