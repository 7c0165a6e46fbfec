"""export(path, target="slurm"): the sbatch script, submitted for real to a Slurm cluster of two nodes started by
the test (Debian's slurm-wlm: slurmctld and two slurmd in two network namespaces, a munged of its own; see
tests/slurmcluster.py). The job trains the exported script on both nodes (one torchrun per node, rendezvous on the
first), is sent the signal Slurm sends before its time limit, requeues itself, and its second run resumes from the
checkpoint: the losses of both runs together are the single-process reference's.

Needs root (namespaces, daemons); installs slurm-wlm and munge with apt-get when missing; skips, saying why, when
the machine cannot run them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from netns import IFNAME, MetricsSink, two_nodes, unavailable
from runtime_cases import make_plan
from slurmcluster import SlurmUnavailable, ensure_installed, slurm_cluster
from test_export import CELL, SRC

from autopar_nb.export import export
from autopar_nb.export.slurm import sbatch_script
from autopar_nb.source import ModelSource
from autopar_nb.verify import FP32_RTOL, reference

VENV_BIN = str(Path(sys.executable).parent)

# the first run holds at step 2 until the test lets it go (after it has been told to requeue)
GATED = CELL.replace("import torch\n", "import os\nimport time\n\nimport torch\n", 1) + '''

def make_batch(step, rank):
    gate = os.environ.get("GATE_DIR")
    if gate and step == 2 and os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
        open(os.path.join(gate, f"reached{rank}"), "w").close()
        while not os.path.exists(os.path.join(gate, "go")):
            time.sleep(0.05)
    g = torch.Generator().manual_seed(step * 10 + rank)
    return (torch.randint(0, 96, (4, 16), generator=g),)


def loss_fn(model, batch):
    logits = model(batch[0])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[0].roll(-1, 1).flatten())
'''


@pytest.fixture(scope="module")
def cluster():
    why = unavailable() or ensure_installed()
    if why:
        pytest.skip(why)
    with two_nodes() as nodes:
        try:
            with slurm_cluster(nodes) as c:
                yield c
        except SlurmUnavailable as e:
            pytest.skip(str(e))


def test_sbatch_script_for_a_gpu_plan():
    """What the batch script asks for and runs, for 16 processes on nodes of 8 GPUs; bash reads it."""
    plan = make_plan(SRC, dp=8, tp=2, zero=3, tp_styles=None)
    plan.cluster = {"preset": "h100-80gb", "nodes": 2, "gpus_per_node": 8}
    text = sbatch_script("train_big.py", plan, time="1-00:00:00", partition="gpu")
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --requeue", "#SBATCH --signal=B:USR1@120", "#SBATCH --time=1-00:00:00",
                 "#SBATCH --partition=gpu", "#SBATCH --exclusive"):
        assert line in text.splitlines(), line
    assert "srun --kill-on-bad-exit=1 bash -c 'exec torchrun --nnodes \"$SLURM_NNODES\" --nproc-per-node 8" in text
    assert '--rdzv-endpoint "$RDZV_HOST:$RDZV_PORT"' in text and "is_host=$((SLURM_NODEID == 0))" in text
    assert 'export CKPT_DIR="${CKPT_DIR:-$SLURM_SUBMIT_DIR/train_big-ckpt}"' in text
    assert "scontrol requeue" in text
    assert all(len(line) <= 120 for line in text.splitlines())
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    cpu = sbatch_script("train.py", make_plan(SRC, dp=2), nodes=2)
    assert "--gpus-per-node" not in cpu and "--nproc-per-node 1" in cpu
    for bad in ({"ckpt_dir": "/x'; rm -rf /"}, {"job_name": "a b"}, {"time": "soon"}, {"script_args": ("$(id)",)},
                {"nodes": 3}):
        with pytest.raises(ValueError):
            sbatch_script("train.py", make_plan(SRC, dp=2), **bad)


@pytest.mark.multiprocess
def test_sbatch_job_trains_on_two_nodes_requeues_and_resumes(cluster, tmp_path):
    src = ModelSource(GATED, loss_fn_var="loss_fn", make_batch_var="make_batch")
    plan = make_plan(src, dp=2, zero=3)  # FSDP across the two nodes
    steps = 4
    job_name = f"autopar-{os.getpid()}"
    exported = export(src, plan, tmp_path / "train_slurm.py", steps=steps, quiet=True, target="slurm", nodes=2,
                      job_name=job_name, ckpt_every=1, requeue_before_s=30)
    assert exported.job == tmp_path / "train_slurm.sbatch" and exported.submit[0].startswith("sbatch ")
    gate = tmp_path / "gate"
    gate.mkdir()
    sink = MetricsSink(cluster.nodes[0], cluster.nodes[0].addr)
    env = dict(os.environ, PATH=f"{VENV_BIN}:{os.environ['PATH']}", GLOO_SOCKET_IFNAME=IFNAME, PYTHONWARNINGS="ignore",
               GATE_DIR=str(gate), AUTOPAR_METRICS=sink.address, AUTOPAR_TOKEN="t")
    try:
        t0 = time.perf_counter()
        job = cluster.run(["sbatch", "--parsable", str(exported.job)], env=env, cwd=tmp_path).stdout.strip()
        deadline = time.monotonic() + 180
        while not ((gate / "reached0").exists() and (gate / "reached1").exists()):  # both nodes at step 2
            assert time.monotonic() < deadline and cluster.job_state(job) in ("PENDING", "RUNNING"), (
                cluster.job_state(job), cluster.logs(), _output(tmp_path, job_name, job))
            time.sleep(0.1)
        t_held = time.perf_counter()
        assert (tmp_path / "train_slurm-ckpt" / "step_2" / "manifest.json").exists()
        # what Slurm sends requeue_before_s before the time limit: the batch script's trap requeues the job
        cluster.run(["scancel", "--batch", "--signal=USR1", job])
        deadline = time.monotonic() + 60
        while cluster.job_state(job) != "PENDING" and time.monotonic() < deadline:
            time.sleep(0.2)
        (gate / "go").touch()
        begin = cluster.run(["squeue", "--noheader", "-j", job, "-o", "%r %S"]).stdout.split()
        # Slurm holds a requeued batch job back (its begin time, ~2 minutes here): let it start now
        cluster.run(["scontrol", "update", f"JobId={job}", "StartTime=now"])
        state = cluster.wait_job(job, timeout_s=240)
        t_end = time.perf_counter()
    finally:
        sink.close()
    out = _output(tmp_path, job_name, job)
    assert state == "COMPLETED", f"{state}\n{out}\n{cluster.logs()}"
    assert f"job {job} (restart 0) on n[0-1]" in out and f"requeueing job {job}" in out
    assert f"job {job} (restart 1) on n[0-1]" in out and "resumed from" in out and "step_2 at step 2" in out
    records = sink.steps(0)
    assert [r["step"] for r in records] == [0, 1, 2, 3]  # 0-1 in the first run, 2-3 in the requeued one
    expected = reference(src, plan, steps=steps)["losses"]
    assert [r["loss"] for r in records] == pytest.approx(expected, rel=FP32_RTOL, abs=0)
    assert {c[0]["rank"] for c in sink.connections} == {0, 1}
    print(f"job {job}: held at step 2 after {t_held - t0:.1f} s, requeued (pending: {' '.join(begin)}), completed "
          f"at {t_end - t0:.1f} s")


def _output(directory: Path, job_name: str, job: str) -> str:
    path = directory / f"{job_name}-{job}.out"
    return path.read_text(errors="replace") if path.exists() else f"(no {path.name})"
