"""Checkpoint integrity (runtime/checkpoint.py): every checkpoint's manifest (sizes and CRC-32s, written last,
atomically); a truncated or damaged checkpoint passed over at resume for the one before, said in one line; a save
that fails (a full disk) leaves the checkpoint before as the latest; old ones pruned (``--keep``). In one process
(a gloo group of one) first, then the exported script on 2 gloo processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from autopar_nb.runtime.checkpoint import (
    MANIFEST,
    checkpoints,
    load_checkpoint,
    manifest_problem,
    resume_point,
    save_checkpoint,
)


def _model_and_optimizer():
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return model, opt


def test_manifest_prune_damage_and_a_failed_save_in_one_process(world_of_one, tmp_path, capsys):
    model, opt = _model_and_optimizer()
    ckpt = tmp_path / "ckpt"
    for step in (1, 2, 3):
        assert save_checkpoint(str(ckpt / f"step_{step}"), model, opt, step, keep=2) is None
    assert checkpoints(str(ckpt)) == [str(ckpt / "step_3"), str(ckpt / "step_2")]  # step_1 pruned
    manifest = json.loads((ckpt / "step_3" / MANIFEST).read_text())
    on_disk = sorted(f for f in os.listdir(ckpt / "step_3") if f != MANIFEST)
    assert sorted(manifest["files"]) == on_disk and ".metadata" in on_disk and manifest["step"] == 3
    assert manifest_problem(str(ckpt / "step_3")) is None
    # a shard cut short, then one byte changed in the one before
    shard = next(f for f in on_disk if f.endswith(".distcp"))
    (ckpt / "step_3" / shard).write_bytes((ckpt / "step_3" / shard).read_bytes()[:-10])
    data = bytearray((ckpt / "step_2" / shard).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (ckpt / "step_2" / shard).write_bytes(bytes(data))
    assert "bytes, the manifest" in manifest_problem(str(ckpt / "step_3"))
    assert manifest_problem(str(ckpt / "step_2")) == f"{shard} does not match its checksum"
    assert resume_point(str(ckpt)) is None
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[0].startswith(f"checkpoint {ckpt / 'step_3'} is damaged ({shard} has ")
    # a save that fails (its folder cannot be made: a file is in the way) says why and leaves the latest alone
    assert save_checkpoint(str(ckpt / "step_4"), model, opt, 4) is None
    (tmp_path / "blocked").write_text("")
    error = save_checkpoint(str(tmp_path / "blocked" / "step_5"), model, opt, 5)
    assert error and "blocked" in error, error
    assert resume_point(str(ckpt)) == str(ckpt / "step_4")
    fresh = nn.Linear(8, 8)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert load_checkpoint(str(ckpt / "step_4"), fresh, fresh_opt) == 4
    assert torch.equal(fresh.weight, model.weight)


def test_an_async_save_is_marked_whole_only_once_written(world_of_one, tmp_path, monkeypatch):
    """AsyncCheckpointer: the save returns while the files are still being written (held back here until released);
    meanwhile the folder has no manifest and the checkpoint before stays the latest, and the weights changed in
    place by the next step do not reach the files (the staging copy). A write that fails in the background removes
    its folder and is reported by the next wait."""
    import threading

    from torch.distributed.checkpoint import FileSystemWriter

    from autopar_nb.runtime.checkpoint import AsyncCheckpointer

    model, opt = _model_and_optimizer()
    ckpt = tmp_path / "ckpt"
    saver = AsyncCheckpointer()
    assert saver.save(str(ckpt / "step_1"), model, opt, 1) is None
    assert saver.wait() is None and checkpoints(str(ckpt)) == [str(ckpt / "step_1")]
    release, write = threading.Event(), FileSystemWriter.write_data
    monkeypatch.setattr(FileSystemWriter, "write_data", lambda self, *a, **k: release.wait(60) and write(self, *a, **k))
    saved = model.weight.detach().clone()
    assert saver.save(str(ckpt / "step_2"), model, opt, 2) is None
    with torch.no_grad():
        model.weight.add_(1.0)  # the next step, while the save is in flight
    assert (ckpt / "step_2").is_dir() and not (ckpt / "step_2" / MANIFEST).exists()
    assert checkpoints(str(ckpt)) == [str(ckpt / "step_1")]
    release.set()
    assert saver.wait() is None and checkpoints(str(ckpt))[0] == str(ckpt / "step_2")
    assert manifest_problem(str(ckpt / "step_2")) is None
    fresh = nn.Linear(8, 8)
    assert load_checkpoint(str(ckpt / "step_2"), fresh, torch.optim.AdamW(fresh.parameters())) == 2
    assert torch.equal(fresh.weight, saved)

    def fail(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", fail)
    assert saver.save(str(ckpt / "step_3"), model, opt, 3) is None
    step, error = saver.close()
    assert step == 3 and "No space left on device" in error, error
    assert not (ckpt / "step_3").exists() and checkpoints(str(ckpt))[0] == str(ckpt / "step_2")


def test_async_checkpoint_auto_is_on_with_an_accelerator_where_the_copy_fits(world_of_one, monkeypatch, capsys):
    """--async-checkpoint: "on" and "off" as said; "auto" off on CPU (the writer would take the training's cores),
    on with a GPU, unless the staging copies (weights and AdamW's two moments, twice over) exceed the host's
    available memory, which is said in one line."""
    from autopar_nb.runtime import checkpoint
    from autopar_nb.runtime.checkpoint import AsyncCheckpointer, async_checkpointer

    params = list(nn.Linear(256, 256).parameters())  # 257 KiB
    assert async_checkpointer("off", params, device="cuda:0") is None
    assert async_checkpointer("auto", params, device="cpu") is None
    for mode, device in (("on", "cpu"), ("auto", "cuda:0")):
        saver = async_checkpointer(mode, params, device=device)
        assert isinstance(saver, AsyncCheckpointer) and saver.close() is None
    monkeypatch.setattr(checkpoint, "available_host_memory", lambda: 1.5e6)  # < 2 x 3 x 257 KiB
    assert async_checkpointer("auto", params, device="cuda:0") is None
    assert capsys.readouterr().out == ("checkpoints saved synchronously: twice the staging copies (1.51 MiB: every "
                                       "local rank's weights and optimizer state) exceed the available host memory "
                                       "(--async-checkpoint on forces it)\n")
    assert isinstance(saver := async_checkpointer("on", params, device="cuda:0"), AsyncCheckpointer)
    saver.close()


# ---- the exported script on 2 processes -----------------------------------------------------------------------------
CELL = '''\
import torch, torch.nn as nn

model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))


def make_batch(step, rank):
    g = torch.Generator().manual_seed(step * 10 + rank)
    return (torch.randn(8, 64, generator=g),)
'''


def exported(tmp_path: Path) -> Path:
    return exported_cell(tmp_path, CELL)


def exported_cell(tmp_path: Path, cell: str) -> Path:
    from runtime_cases import make_plan

    from autopar_nb.export import export
    from autopar_nb.notebook.cell import run_model_cell

    src = run_model_cell(cell, {}).source
    return export(src, make_plan(src, dp=2, zero=0, lr=1e-2), tmp_path / "train_ckpt.py", steps=8, quiet=True).script


def torchrun(script: Path, *args: str) -> tuple[int, str]:
    """(exit code, output) of ``script`` on 2 gloo processes."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                           str(script), *args], capture_output=True, text=True, timeout=300, cwd=script.parent,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))
    return proc.returncode, proc.stdout + proc.stderr


def losses(out: str) -> dict[int, str]:
    """{step: its printed loss} of a script's output."""
    return {int(line.split()[1]): line.split("|")[1].split()[1] for line in out.splitlines()
            if line.startswith("step ") and "| loss " in line}


@pytest.mark.multiprocess
def test_a_damaged_checkpoint_resumes_from_the_one_before_on_two_processes(tmp_path):
    """Checkpoints at steps 2, 4, 6; the shard of step 6 cut short and one of step 4 changed: the next run says so in
    one line each, resumes from step 2 with the same losses as before, and keeps the newest 2 (--keep 2)."""
    script = exported(tmp_path)
    ckpt = tmp_path / "ckpt"
    flags = ["--ckpt-dir", str(ckpt), "--ckpt-every", "2"]
    rc, first = torchrun(script, "--stop-at", "6", *flags)
    assert rc == 0, first[-4000:]
    assert sorted(os.listdir(ckpt)) == ["step_2", "step_4", "step_6"]  # --keep 3, the default
    shards = sorted(f for f in os.listdir(ckpt / "step_6") if f.endswith(".distcp"))
    (ckpt / "step_6" / shards[-1]).write_bytes((ckpt / "step_6" / shards[-1]).read_bytes()[:100])
    data = bytearray((ckpt / "step_4" / shards[0]).read_bytes())
    data[-20] ^= 0x01
    (ckpt / "step_4" / shards[0]).write_bytes(bytes(data))
    rc, second = torchrun(script, "--keep", "2", *flags)
    assert rc == 0, second[-4000:]
    said = [line for line in second.splitlines() if line.startswith(("checkpoint ", "resumed from"))]
    assert len(said) == 3, said
    assert said[0].startswith(f"checkpoint {ckpt / 'step_6'} is damaged ({shards[-1]} has 100 bytes, the manifest ")
    assert said[1:] == [f"checkpoint {ckpt / 'step_4'} is damaged ({shards[0]} does not match its checksum): trying "
                        "the one before", f"resumed from {ckpt / 'step_2'} at step 2"]
    before, after = losses(first), losses(second)
    assert sorted(after) == list(range(2, 8)) and all(after[s] == before[s] for s in range(2, 6))
    assert sorted(os.listdir(ckpt)) == ["step_6", "step_8"]
    assert all(manifest_problem(str(ckpt / d)) is None for d in ("step_6", "step_8"))


@pytest.mark.multiprocess
def test_a_full_disk_leaves_the_checkpoint_before_as_the_latest(tmp_path):
    """Checkpoints on a 600 KiB tmpfs that holds one (~400 KiB: the model and AdamW's two moments): the saves at steps
    4 and 6 fail with ENOSPC, each said in one line, their folders removed; the run trains on to its end, and step 2
    stays the latest, whole."""
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    try:
        script = exported(tmp_path)
        rc, out = torchrun(script, "--steps", "6", "--ckpt-dir", str(mount / "ckpt"), "--ckpt-every", "2")
        assert rc == 0, out[-4000:]
        failed = [line for line in out.splitlines() if "checkpoint not saved" in line]
        assert [line.split(" |")[0] for line in failed] == ["step 4", "step 6"], out[-4000:]
        # the full disk surfaces as ENOSPC, or as torch's zip writer finding its file shorter than it wrote
        assert any(why in failed[0] for why in ("No space left on device", "unexpected pos")), failed[0]
        assert failed[0].endswith(f"the latest stays {mount}/ckpt/step_2"), failed[0]
        assert sorted(losses(out)) == list(range(6))
        assert sorted(os.listdir(mount / "ckpt")) == ["step_2"]
        assert manifest_problem(str(mount / "ckpt" / "step_2")) is None
    finally:
        subprocess.run(["umount", str(mount)], check=False)


BIG_CELL = CELL.replace("nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)",
                        "nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 64)")
"""a model whose save (~13 MB with AdamW's moments) lasts long enough to be caught in the middle"""


@pytest.mark.multiprocess
def test_a_crash_during_an_async_save_resumes_the_same_loss_curve(tmp_path):
    """The exported script with --async-checkpoint on and a checkpoint every step, a worker killed (SIGKILL) while a
    save is being written in the background: that folder has no manifest and is never the latest; the next run
    resumes from the newest whole checkpoint and continues the loss curve of a run never interrupted, step for
    step (2 gloo processes)."""
    import signal
    import time

    import psutil

    from autopar_nb.runtime.checkpoint import latest_checkpoint

    script = exported_cell(tmp_path, BIG_CELL)
    rc, reference = torchrun(script, "--steps", "10")
    assert rc == 0, reference[-4000:]
    ckpt = tmp_path / "ckpt"
    flags = ["--steps", "10", "--ckpt-dir", str(ckpt), "--ckpt-every", "1", "--async-checkpoint", "on"]
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                              str(script), *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             cwd=tmp_path, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    caught, deadline = None, time.monotonic() + 240
    while caught is None and agent.poll() is None and time.monotonic() < deadline:
        done = checkpoints(str(ckpt))
        writing = [d for d in (ckpt.iterdir() if ckpt.is_dir() else ()) if not (d / MANIFEST).exists()]
        if done and writing:  # a save in flight beside a whole one: kill a worker now
            psutil.Process(agent.pid).children()[0].send_signal(signal.SIGKILL)
            caught = writing[0]
        time.sleep(0.002)
    out = agent.communicate(timeout=120)[0]
    assert caught is not None, f"no save caught in flight\n{out[-4000:]}"
    assert agent.returncode != 0, out[-4000:]
    latest = latest_checkpoint(str(ckpt))
    assert latest != str(caught) and manifest_problem(latest) is None, (latest, caught)
    rc, resumed = torchrun(script, *flags)
    assert rc == 0, resumed[-4000:]
    start = int(latest.rsplit("_", 1)[1])
    assert f"resumed from {latest} at step {start}" in resumed, resumed[-4000:]
    before, after = losses(reference), losses(resumed)
    assert start < 10 and sorted(after) == list(range(start, 10)), resumed[-4000:]
    assert all(after[s] == before[s] for s in after), (before, after)
    assert manifest_problem(latest_checkpoint(str(ckpt))) is None
