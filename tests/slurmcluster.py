"""A real Slurm cluster of two nodes on this machine, for the Slurm export test (root only).

Debian's ``slurm-wlm`` daemons run inside the two network namespaces of :func:`netns.two_nodes`: ``slurmctld`` and
the first ``slurmd`` in node 0, the second ``slurmd`` in node 1, each node known to Slurm by its namespace address,
so a job's ``srun`` really starts one task per "node". Authentication is a ``munged`` of the test's own (its key,
socket and files in a temporary directory), never the system's. Everything the cluster writes stays in that
directory; on exit the daemons are stopped by their pid files and the directory removed, also when the test failed.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from netns import Node

DAEMONS = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "munged")
PACKAGES = ("slurm-wlm", "munge")
"""Debian packages that hold the daemons (``slurm-wlm`` 22.05 on Debian 12)"""


def ensure_installed(timeout_s: float = 600) -> str | None:
    """Install Debian's ``slurm-wlm`` and ``munge`` when a daemon is missing (root, apt-get); returns why Slurm cannot
    run here, or None."""
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if not missing:
        return None
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return (f"Slurm is not installed ({', '.join(missing)} missing) and cannot be: installing Debian's "
                f"{' '.join(PACKAGES)} needs root and apt-get")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *PACKAGES]):
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout_s)
        if proc.returncode != 0:
            return f"`{' '.join(argv)}` failed: {proc.stderr.strip()[-300:]}"
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    return f"{' '.join(PACKAGES)} installed, but {', '.join(missing)} still missing" if missing else None


class SlurmUnavailable(RuntimeError):
    """A Slurm daemon exits at start-up on this machine (the test skips, saying why)."""


@dataclass
class Cluster:
    """A running cluster: ``run(argv)`` runs a Slurm command (sbatch, squeue, ...) on node 0 against it."""

    conf: Path
    nodes: tuple[Node, Node]
    names: tuple[str, str]
    directory: Path

    def run(self, argv: list[str], *, env: dict | None = None, cwd: Path | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(self.nodes[0].argv(argv), capture_output=True, text=True, timeout=60, cwd=cwd,
                              env=(env or dict(os.environ)) | {"SLURM_CONF": str(self.conf)})
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {proc.stdout}{proc.stderr}\n{self.logs()}")
        return proc

    def logs(self) -> str:
        """The daemons' last log lines (for failure messages)."""
        out = []
        for log in sorted(self.directory.glob("*.log")):
            out.append(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:]))
        return "\n".join(out)

    def wait_idle(self, timeout_s: float = 60) -> None:
        """Until both nodes are up and idle."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            states = self.run(["sinfo", "--noheader", "-N", "-o", "%N %t"], check=False).stdout.split()
            if states.count("idle") == 2:
                return
            time.sleep(0.3)
        raise RuntimeError(f"the nodes did not come up idle: {states}\n{self.logs()}")

    def job_state(self, job: str) -> str:
        """A job's state (PENDING, RUNNING, COMPLETED, FAILED, ...), from the controller."""
        out = self.run(["scontrol", "show", "job", job], check=False).stdout
        for field in out.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return "UNKNOWN"

    def wait_job(self, job: str, *, timeout_s: float, done=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                            "NODE_FAIL", "OUT_OF_MEMORY")) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.job_state(job)
            if state in done:
                return state
            time.sleep(0.5)
        raise TimeoutError(f"job {job} still {self.job_state(job)} after {timeout_s} s\n{self.logs()}")


def _conf(d: Path, nodes: tuple[Node, Node], names: tuple[str, str], cpus: int) -> str:
    host = socket.gethostname()
    return "\n".join([
        "ClusterName=autopar-test",
        f"SlurmctldHost={host}({nodes[0].addr})",
        "AuthType=auth/munge",
        f"AuthInfo=socket={d}/munge.sock",
        "CredType=cred/munge",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SchedulerType=sched/backfill",
        "SlurmUser=root",
        "SlurmdUser=root",
        "MpiDefault=none",
        "ReturnToService=2",
        "JobRequeue=1",
        f"StateSaveLocation={d}/state",
        f"SlurmdSpoolDir={d}/spool-%n",
        f"SlurmctldPidFile={d}/slurmctld.pid",
        f"SlurmdPidFile={d}/slurmd-%n.pid",
        f"SlurmctldLogFile={d}/slurmctld.log",
        f"SlurmdLogFile={d}/slurmd-%n.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "JobAcctGatherType=jobacct_gather/none",
        "SlurmctldTimeout=30",
        "SlurmdTimeout=30",
        "InactiveLimit=0",
        "MinJobAge=300",
        "KillWait=5",
        "Waittime=0",
        *(f"NodeName={n} NodeAddr={node.addr} NodeHostname={host} CPUs={cpus} RealMemory=2000 State=UNKNOWN"
          for n, node in zip(names, nodes, strict=True)),
        f"PartitionName=debug Nodes={','.join(names)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
        "",
    ])


def _stop(pid_files: list[Path], timeout_s: float = 5.0) -> None:
    """SIGTERM the daemons named by ``pid_files`` together, SIGKILL those still alive after ``timeout_s``."""
    pids = []
    for pid_file in pid_files:
        try:
            pids.append(int(pid_file.read_text().split()[0]))
        except (OSError, ValueError, IndexError):
            continue
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = []
        for pid in pids:
            try:
                os.kill(pid, sig)
                alive.append(pid)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout_s
        while alive and time.monotonic() < deadline:
            time.sleep(0.1)
            alive = [pid for pid in alive if _running(pid)]
        if not alive:
            return
        pids = alive


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@contextmanager
def slurm_cluster(nodes: tuple[Node, Node], *, cpus: int = 2) -> Iterator[Cluster]:
    """``slurmctld`` + two ``slurmd`` (nodes ``n0``, ``n1`` at the namespaces' addresses) and a private ``munged``."""
    d = Path(tempfile.mkdtemp(prefix="autopar-slurm-"))
    d.chmod(0o755)  # the munge socket must be reachable by path
    names = ("n0", "n1")
    pid_files = [d / "slurmd-n1.pid", d / "slurmd-n0.pid", d / "slurmctld.pid", d / "munged.pid"]
    try:
        for sub in ("state", "spool-n0", "spool-n1"):
            (d / sub).mkdir()
        key = d / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        munged = subprocess.run(["munged", "--force", f"--socket={d}/munge.sock", f"--key-file={key}",
                                 f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log",
                                 f"--seed-file={d}/munged.seed"], capture_output=True, text=True, timeout=30)
        if munged.returncode != 0:
            raise SlurmUnavailable(f"munged cannot start here: {munged.stderr.strip()[-300:]}")
        conf = d / "slurm.conf"
        conf.write_text(_conf(d, nodes, names, cpus))
        env = dict(os.environ, SLURM_CONF=str(conf))
        cluster = Cluster(conf, nodes, names, d)
        starts = [(nodes[0], ["slurmctld", "-f", str(conf)])]
        starts += [(node, ["slurmd", "-f", str(conf), "-N", name]) for name, node in zip(names, nodes, strict=True)]
        for node, argv in starts:
            proc = subprocess.run(node.argv(argv), env=env, capture_output=True, text=True, timeout=60)
            if proc.returncode != 0:
                raise SlurmUnavailable(f"{argv[0]} cannot start here (exit {proc.returncode}): "
                                       f"{proc.stderr.strip()[-300:]}\n{cluster.logs()}")
        cluster.wait_idle()
        yield cluster
    finally:
        _stop(pid_files)
        shutil.rmtree(d, ignore_errors=True)
