"""Resuming under another plan (issue 14, point 3): a DCP checkpoint the exported script wrote under plan A loads
under plan B (another TP degree, ZeRO stage and world size), and training goes on with the losses of a single-process
run that never stopped."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runtime_cases import llama_tp, make_plan

from autopar_nb.export import export
from autopar_nb.launch.channel import MetricsServer
from autopar_nb.notebook.cell import run_model_cell
from autopar_nb.verify import FP32_RTOL, reference

# a dataset: one global batch (8 windows) per step whatever the data-parallel degree, so plans with different dp
# train on the same samples, and the checkpoint's data position says where the resumed run continues
CELL = '''\
import torch
from torch.utils.data import Dataset

from autopar_nb.zoo import Llama, LlamaConfig


class Windows(Dataset):
    """64 windows of 16 token ids, drawn once with a fixed seed (every process reads the same)."""

    def __init__(self, n=64, seq=16):
        self.tokens = torch.randint(0, 64, (n, seq), generator=torch.Generator().manual_seed(7))

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return self.tokens[i]


model = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64))
dataset = Windows()
'''

STEPS, STOP = 4, 2  # plan A trains steps 0-1 and checkpoints at 2; plan B resumes there and trains steps 2-3
GLOBAL_BATCH = 8
LR = 1e-2  # large enough that a step without the saved AdamW moments shows in the next losses


def plans(src):
    """(A, B): tensor parallelism on 2 processes, then FSDP (ZeRO-3) on 4, the same global batch."""
    a = make_plan(src, tp=2, tp_styles=llama_tp(), lr=LR)
    b = make_plan(src, dp=4, zero=3, lr=LR)
    for p in (a, b):
        p.batch.global_batch = GLOBAL_BATCH
    return a, b


def torchrun(script: Path, nproc: int, *args: str, timeout_s: float = 400) -> tuple[str, dict[int, float]]:
    """The script on ``nproc`` gloo processes, streaming to a metrics channel: (its stdout, {step: rank 0's loss}
    at full precision). Fails the test with the output when the script fails."""
    server, out = MetricsServer(), script.with_suffix(f".{nproc}.log")
    env = dict(os.environ, PYTHONWARNINGS="ignore", AUTOPAR_METRICS=server.address, AUTOPAR_TOKEN=server.token)
    messages = []
    try:
        with out.open("w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                                     "--standalone", str(script), *args], stdout=log, stderr=subprocess.STDOUT,
                                    text=True, env=env, cwd=script.parent)
            deadline = time.monotonic() + timeout_s
            while proc.poll() is None and time.monotonic() < deadline:
                messages += server.poll(0.1)
            if proc.poll() is None:
                proc.kill()
            messages += server.poll(0.2)
    finally:
        server.close()
    text = out.read_text()
    assert proc.wait() == 0, f"{script.name} failed:\n{text[-8000:]}"
    return text, {m.data["step"]: m.data["loss"] for m in messages if m.rank == 0 and "step" in m.data}


def _scripts(src, a, b, tmp_path, names: tuple[str, str]) -> tuple[Path, Path, list[str]]:
    """Plans ``a`` and ``b`` exported for STEPS steps, and the checkpoint flags both runs take (every STOP steps)."""
    script_a = export(src, a, tmp_path / f"train_{names[0]}.py", steps=STEPS, quiet=True).script
    script_b = export(src, b, tmp_path / f"train_{names[1]}.py", steps=STEPS, quiet=True).script
    return script_a, script_b, ["--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", str(STOP), "--num-workers", "0"]


def _joined(first: dict, second: dict, stdout: str, tmp_path) -> list[float]:
    """The losses of the run stopped at STOP and of the one that resumed from its checkpoint, as one curve."""
    assert f"resumed from {tmp_path / 'ckpt' / f'step_{STOP}'} at step {STOP}" in stdout
    assert sorted(first) == list(range(STOP)) and sorted(second) == list(range(STOP, STEPS))
    return [{**first, **second}[s] for s in range(STEPS)]


@pytest.mark.multiprocess
def test_zero1_checkpoint_resumes_under_ddp_on_more_processes(tmp_path):
    """ZeRO-1 (FSDP2, gradients accumulated over 2 micro-batches) on 2 processes checkpoints at step 2 through DCP,
    as every stage does; DDP on 4 processes resumes from it (its AdamW moments gathered whole) and finishes: every
    step's loss equals the single-process reference's. (ZeroRedundancyOptimizer's per-rank files loaded only
    under ZeRO-1 at the same dp.)"""
    src = run_model_cell(CELL, {}).source
    a, b = make_plan(src, dp=2, zero=1, micro_batches=2, lr=LR), make_plan(src, dp=4, zero=0, lr=LR)
    for p in (a, b):
        p.batch.global_batch = GLOBAL_BATCH
    script_a, script_b, ckpt = _scripts(src, a, b, tmp_path, ("zero1", "ddp"))
    _, first = torchrun(script_a, 2, "--stop-at", str(STOP), *ckpt)
    stdout, second = torchrun(script_b, 4, *ckpt)
    losses = _joined(first, second, stdout, tmp_path)
    assert losses == pytest.approx(reference(src, b, steps=STEPS)["losses"], rel=FP32_RTOL, abs=0)


@pytest.mark.multiprocess
def test_tp_checkpoint_resumes_under_fsdp_on_more_processes(tmp_path):
    """TP on 2 processes checkpoints at step 2; FSDP (ZeRO-3) on 4 processes resumes from it (DCP reshards model and
    AdamW state) and finishes: every step's loss equals the single-process reference's."""
    src = run_model_cell(CELL, {}).source
    a, b = plans(src)
    script_a, script_b, ckpt = _scripts(src, a, b, tmp_path, ("tp", "fsdp"))
    _, first = torchrun(script_a, 2, "--stop-at", str(STOP), *ckpt)
    t0 = time.perf_counter()
    stdout, second = torchrun(script_b, 4, *ckpt)
    print(f"plan B: start to finish from the checkpoint {time.perf_counter() - t0:.1f} s")
    losses = _joined(first, second, stdout, tmp_path)
    expected = reference(src, b, steps=STEPS)["losses"]
    assert reference(src, a, steps=STEPS)["losses"] == pytest.approx(expected, rel=FP32_RTOL)  # one curve, either plan
    assert losses == pytest.approx(expected, rel=FP32_RTOL, abs=0)


@pytest.mark.multiprocess
def test_zbv_pipeline_checkpoint_resumes_without_pipelining(tmp_path):
    """A zero-bubble V pipeline on 2 processes (each rank holds two stages: rank 0 the embedding and the head)
    checkpoints at step 2 by the model's parameter names, not by stage index; plain data parallelism (DDP on 2
    processes) resumes from it and finishes with the losses of the single-process run that never stopped."""
    import torch.distributed.checkpoint as dcp

    src = run_model_cell(CELL, {}).source
    a = make_plan(src, pp=2, stages={"layers.0": 1, "layers.1": 2, "norm": 3}, schedule="zbv_zero_bubble",
                  virtual_stages=2, micro_batches=2, lr=LR)
    b = make_plan(src, dp=2, zero=0, lr=LR)
    for p in (a, b):
        p.batch.global_batch = GLOBAL_BATCH
    script_a, script_b, ckpt = _scripts(src, a, b, tmp_path, ("zbv", "ddp"))
    _, first = torchrun(script_a, 2, "--stop-at", str(STOP), *ckpt)
    keys = dcp.FileSystemReader(str(tmp_path / "ckpt" / f"step_{STOP}")).read_metadata().state_dict_metadata
    model, _, _ = src.build(device="meta")
    names = {n for n, _ in model.named_parameters()}
    assert {k.removeprefix("model.") for k in keys if k.startswith("model.")} == names
    assert {k.removeprefix("optim.state.").rsplit(".", 1)[0] for k in keys if k.startswith("optim.state.")} == names
    stdout, second = torchrun(script_b, 2, *ckpt)
    losses = _joined(first, second, stdout, tmp_path)
    expected = reference(src, b, steps=STEPS)["losses"]
    assert reference(src, a, steps=STEPS)["losses"] == pytest.approx(expected, rel=FP32_RTOL)
    assert losses == pytest.approx(expected, rel=FP32_RTOL, abs=0)
