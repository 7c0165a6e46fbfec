"""The processes of a launched run: torch's elastic agent and its workers, watched from the monitor
thread.

:class:`Supervision` is one side of :class:`~autopar_nb.launch.run.Run`: it follows the agent's
restarts (its per-attempt log directories), finds hangs and asks the stalled ranks for their stacks,
tears every process down, reads the agent's ``result.json`` into the final status, and ends the run
once (its end hooks, then ``done``), also when the monitor thread itself failed. ``AttachedRun``
overrides these hooks: its ranks are no local processes.
"""

from __future__ import annotations

import json
import signal
import time

import psutil

from . import logfiles, procs
from .hang import STARTUP_TIMEOUT_S, hang_message, silent_message, stalled_rank, waited_for
from .ingest import TERMINAL
from .metrics import RankState

END_KINDS = {"finished": "finish", "failed": "fail", "stopped": "stop", "hung": "hang"}
"""the event kind of each final status"""
LOG_TAIL_LINES = 8
STACK_WAIT_S = 0.5
"""seconds the ranks get to print their stacks when a hang is found"""
ERROR_LOG_LINES = 60
"""lines of a rank's log shown for a failure that left no Python traceback"""


class Supervision:
    """The run's processes, from its launch to its end: restarts, hangs, teardown and the final
    status."""

    def _refresh_workers(self) -> dict[int, psutil.Process]:
        w = {}
        if self._proc is not None and self._proc.poll() is None:
            try:
                w = procs.workers_of(psutil.Process(self._proc.pid))
            except psutil.Error:
                w = {}
        with self._lock:
            self._workers = w
        return w

    def _check_attempt(self) -> None:
        """A new attempt directory means torch's agent restarted the worker group: every rank starts
        over (its start-up allowance for the hang check too), and the status says so."""
        latest = self._latest_attempt()
        if latest <= self._attempt_seen:
            return
        now = time.monotonic()
        with self._lock:
            first = self._attempt_seen < 0
            self._attempt_seen = latest
            if first:
                return
            self._lifecycle("restart",
                            f"restart {latest} of {self.max_restarts}: the agent restarts every "
                            "worker"
                            + (f" after rank {self._error['rank']} failed" if self._error else ""))
            # else a rank's hello said so first
            if len(self._behind(latest, now)) == len(self._ranks):
                self._set_status("restarting",
                                 f"restart {latest} of {self.max_restarts}: the agent restarts "
                                 "every worker")

    def _latest_attempt(self) -> int:
        """The agent's latest restart attempt, from its per-attempt log directories (-1 before
        any)."""
        return logfiles.latest_attempt(self.run_dir, self.run_id)

    def _read_log_tails(self) -> None:
        tails = {r: logfiles.tagged(self.logs(r, tail=LOG_TAIL_LINES).splitlines(), r)
                 for r in range(self.nproc)}
        with self._lock:
            for r, t in tails.items():
                self._ranks[r].log_tail = t

    def _check_hang(self) -> None:
        """Tear the run down when a rank has made no step progress for ``hang_timeout_s`` (see
        hang.py); after a failure with no restart left, make sure torch's agent really ends the
        other ranks."""
        now = time.monotonic()
        off = self.hang_timeout_s is None or self._server is None
        if off or self._status in TERMINAL or self._stop_reason is not None:
            if (self._error_time is not None and now - self._error_time > 3.0
                and self._agent_alive()):
                self._stop_reason = self._stop_reason or "failure"
                self._teardown()
            return
        with self._lock:
            if not any(s.connected for s in self._ranks.values()):
                if now - self._t0 > STARTUP_TIMEOUT_S and self._status == "starting":
                    self._message = silent_message()
                return
            found = stalled_rank(self._ranks, now=now, t0=self._t0, timeout=self.hang_timeout_s)
            if found is None:
                return
            self._status = "hung"
            self._message = hang_message(self._ranks, *found, self.hang_timeout_s)
            self._stop_reason = "hang"
            self.hang = {"rank": found[0], "seconds": found[1], "stacks": {}}
        self._notify()
        stacks = self._dump_stacks()
        with self._lock:
            # the stacks may tell who the others wait for
            first = waited_for(self._ranks, found[0], stacks)
            seconds = time.monotonic() - max(self._ranks[first].last_progress, self._t0)
            self.hang = {"rank": first, "seconds": seconds, "stacks": stacks}
            self._message = hang_message(self._ranks, first, seconds, self.hang_timeout_s, stacks)
        self._notify()
        self._teardown()

    def _dump_stacks(self, wait_s: float = STACK_WAIT_S) -> dict[int, str]:
        """rank -> where its threads are: each rank whose script registered faulthandler for SIGUSR1
        (the exported script does when launched) prints every thread's Python stack to its stderr;
        the new part of that log."""
        sizes = {}
        for r, proc in self.workers().items():
            st = self._ranks.get(r)
            d = logfiles.rank_dir(self.run_dir, self.run_id, r)
            if st is None or not st.dumps_stacks or d is None:
                continue
            try:
                sizes[r] = (d / "stderr.log").stat().st_size if (d / "stderr.log").exists() else 0
                proc.send_signal(signal.SIGUSR1)
            except (OSError, psutil.Error):
                continue
        if not sizes:
            return {}
        time.sleep(wait_s)  # faulthandler writes from a signal handler: it takes milliseconds
        out = {}
        for r, size in sizes.items():
            try:
                with open(logfiles.rank_dir(self.run_dir, self.run_id, r) / "stderr.log",
                          "rb") as f:
                    f.seek(size)
                    out[r] = f.read(logfiles.TAIL_BYTES).decode(errors="replace")
            except OSError:
                continue
        return out

    def _agent_alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _agent_exited(self) -> bool:
        return self._proc is None or self._proc.poll() is not None

    def _teardown(self) -> None:
        """End the agent and every worker (idempotent, any thread)."""
        with self._teardown_lock:
            procs.terminate(self._proc, self._token)

    def _finalise(self) -> None:
        """The agent has exited: make sure nothing of the run is left, read its result, set the
        final status."""
        if procs.processes_with_token(self._token):  # even if the agent itself was killed
            self._teardown()
        self._drain_ended_ranks()
        try:
            result = json.loads((self.run_dir / "result.json").read_text())
        except (OSError, ValueError):
            rc = self._proc.returncode if self._proc is not None else None
            how = (f"was killed by {signal.Signals(-rc).name}" if isinstance(rc, int) and rc < 0 and
                   -rc in signal.Signals._value2member_map_ else f"exited with code {rc}")
            result = {"state": "killed" if self._stop_reason else "error", "agent_died": True,
                      "error": f"the elastic agent {how} before it wrote result.json; every worker "
                               "was ended (see agent.log in the run directory)"}
        with self._lock:
            self._result = result
            self.ended = time.time()
            self._set_final_status(result, f"{self.ended - self.started:.1f} s")
            self._lifecycle(END_KINDS.get(self._status, self._status), self._message)
            self._watch_tick()  # the agent's account of a killed rank (its signal) arrives only now
        self._server_close()
        self._read_log_tails()  # a run shorter than a tick has shown no log yet
        if self._tick >= 0:  # sampled: the end as a last sample, how each rank finished
            self._record_tick(self._tick + 1, {})
        self._notify()  # listeners see the final status before wait() returns
        self._ended()

    def _set_final_status(self, result: dict, elapsed: str) -> None:
        if self._status == "hung":  # the hang check said why already
            return
        if self._stop_reason not in (None, "failure"):
            self._status, self._message = "stopped", (f"stopped ({self._stop_reason}) after "
                                                      f"{elapsed}")
        elif result.get("state") == "succeeded":
            self._status, self._message = "finished", f"finished {self.summary_line()} in {elapsed}"
            if self.data and self.data["bottleneck"]:
                self._message += f"; {self.data['message']}"
        elif result.get("agent_died"):
            self._blame_the_agent(result["error"])
        else:
            self._errors_from_result(result)
            e = self._error
            self._status = "failed"
            if e is None:
                self._message = f"failed: {result}"
            elif e["rank"] is None:  # the agent itself failed (rendezvous, killed): no rank to name
                self._message = f"failed: {e['error']}"
            else:
                self._message = f"failed: rank {e['rank']}: {e['error']}"

    def _blame_the_agent(self, error: str) -> None:
        """The agent died before it wrote its result: its death is the cause, and what the ranks
        said then is its consequence (torch starts each worker with SIGINT as its parent-death
        signal, so a worker whose forkserver ended with the agent raises KeyboardInterrupt)."""
        ranks = [] if self._error is None else [self._error, *self._error["knock_on"]]
        t0 = self._error["time_s"] if self._error is not None else time.time() - self.started
        self._error = {"rank": None, "attempt": 0, "error": error, "traceback": "",
                       "time_s": t0, "knock_on": [
                           {"rank": e["rank"], "error": e["error"],
                            "after_s": e.get("after_s", 0.0)} for e in ranks]}
        self._status, self._message = "failed", f"failed: {error}"

    def _errors_from_result(self, result: dict) -> None:
        """The agent's account of the failed ranks (exit codes, signals, @record tracebacks) joins
        what the channel said: ranks that died without a word get their exit code and log; then
        ``error`` names the first."""
        failures = logfiles.failures_from_result(result,
                                                 lambda rank: self.logs(rank, tail=ERROR_LOG_LINES))
        if not failures and self._error is None:
            self._error = logfiles.error_from_result(result, lambda rank: "")
            return
        for r, f in failures.items():
            st = self._ranks.setdefault(r, RankState(r))
            # its own error message, with a traceback
            said = st.error is not None and bool(st.error["traceback"])
            if said:
                continue
            if st.failed_at is None:
                st.failed_at = (st.closed_at or (float(f["timestamp"]) if f.get("timestamp")
                                                 else None) or time.time())
            # the agent knows how it ended: its exit code and signal, and its Python stack or its
            # log's end
            note = "" if f["python"] else (" (no Python traceback: killed, or a crash outside "
                                           "Python)")
            st.error = {"error": f"{f['error']}{note}", "traceback": f["traceback"]}
        self._update_error()

    def _drain_ended_ranks(self, limit_s: float = 2.0) -> None:
        """Read what ranks left behind by their agent's end sent before the teardown ended them: a
        SIGKILLed agent leaves its workers training until then, and every step they reported
        happened (a checkpoint they wrote is where the next launch resumes). Their connections are
        closed now; what they sent waits in the sockets."""
        deadline = time.monotonic() + limit_s
        while self._server is not None and time.monotonic() < deadline:
            msgs = self._server.poll(0.05)
            if not msgs:
                return
            self._ingest(msgs)

    def _server_close(self) -> None:
        if self._server is not None:
            self._server.close()

    def _monitor_crashed(self, e: BaseException, *, tries: int = 3, pause_s: float = 1.0) -> None:
        """The monitor thread failed: the run has failed, and every process of it is ended here
        (tried ``tries`` times); if even that fails (no file descriptors left), ``stop()`` tries
        again and marks the run done."""
        with self._lock:
            self._status, self._message = "failed", ("the monitor thread crashed "
                                                     f"({type(e).__name__}: {e})")
        self._stop_reason = self._stop_reason or "monitor error"
        for i in range(tries):
            if self._end_without_monitor():
                return
            if i + 1 < tries:
                time.sleep(pause_s)
        with self._lock:
            self._message += "; its processes could not all be ended yet: call run.stop()"

    def _end_without_monitor(self) -> bool:
        """End the agent and every worker, and once none is left mark the run ended and done (any
        thread, when the monitor cannot; idempotent). True when nothing of the run is left."""
        try:
            self._teardown()
            left = self._agent_alive() or bool(procs.processes_with_token(self._token))
        except Exception:  # e.g. out of file descriptors: not ended yet
            return False
        if left:
            return False
        try:
            self._server_close()
        except Exception:  # a channel that cannot close: its sockets go with the kernel
            pass
        with self._lock:
            if self._status not in TERMINAL:
                self._status, self._message = "stopped", f"stopped ({self._stop_reason})"
            if self.ended is None:
                self.ended = time.time()
        self._ended()
        return True

    def _ended(self) -> None:
        """Every process of the run is gone: the end hooks, then ``done`` (so a launch right after
        ``wait()`` finds the next standby the hooks started). Once only."""
        with self._teardown_lock:
            if self._ending:
                return
            self._ending = True
        for hook in self._end_hooks:
            try:
                hook(self)
            # a pool that cannot start its next standby: the next launch starts one
            except Exception:
                pass
        self._done.set()

    def _notify(self) -> None:
        for fn in list(self._listeners):
            try:
                fn(self)
            except Exception:  # a broken listener (a closed widget) must not stop the monitor
                pass
