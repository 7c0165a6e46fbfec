"""export(): the script runs under torchrun on CPU (gloo), its losses equal verify()'s, a resumed run equals an
uninterrupted one, it streams the metrics protocol, and it passes ruff."""

from __future__ import annotations

import ast
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from runtime_cases import make_plan

from autopar_nb.export import export, render_script, runtime_name
from autopar_nb.source import ModelSource
from autopar_nb.verify import verify_many

ROOT = Path(__file__).resolve().parents[1]

# a self-contained cell, as a user would write it: no loss_fn/make_batch, so the script makes synthetic data
CELL = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab=96, d=32, n_layer=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_layer))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


model = TinyLM()
example_inputs = (torch.randint(0, 96, (4, 16)),)
'''

FAILING = CELL + '''

def make_batch(step, rank):
    if step == 1:
        raise RuntimeError(f"no data for step {step}")
    return (torch.randint(0, 96, (4, 16)),)


def loss_fn(model, batch):
    logits = model(batch[0])
    return F.cross_entropy(logits.flatten(0, 1), batch[0].flatten())
'''

# fails once, at step 3 of the first attempt: torchrun --max-restarts restarts the ranks, which resume from a checkpoint
FLAKY = CELL.replace("import torch\n", "import os\n\nimport torch\n", 1) + '''

def make_batch(step, rank):
    if step == 3 and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
        raise RuntimeError("lost a node")
    g = torch.Generator().manual_seed(step * 10 + rank)
    return (torch.randint(0, 96, (4, 16), generator=g),)


def loss_fn(model, batch):
    logits = model(batch[0])
    return F.cross_entropy(logits.flatten(0, 1), batch[0].roll(-1, 1).flatten())
'''

SRC = ModelSource(CELL)
TP = {"embed": "rowwise", "blocks.0.up": "colwise", "blocks.0.down": "rowwise", "blocks.1.up": "colwise",
      "blocks.1.down": "rowwise", "head": "colwise"}
PLANS = {
    "fsdp_recompute": make_plan(SRC, dp=2, zero=3, recompute={"blocks.0": "full", "blocks.1": "selective"}),
    "tp_loss_parallel": make_plan(SRC, tp=2, tp_styles=TP, loss_parallel=True),
    "pp_1f1b": make_plan(SRC, pp=2, schedule="1f1b", micro_batches=2, stages={"blocks.1": 1}),
    # built on the meta device and initialised stage by stage: the same weights, so the same losses
    "pp_meta_init": make_plan(SRC, pp=2, schedule="gpipe", micro_batches=2, stages={"blocks.1": 1}),
}
META_INIT = {"pp_meta_init"}


class MetricsServer:
    """The launcher's end of the metrics protocol: one JSON line per record, per connection."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections: list[list[dict]] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            conn, _ = self.sock.accept()
            records: list[dict] = []
            self.connections.append(records)
            threading.Thread(target=self._read, args=(conn, records), daemon=True).start()

    @staticmethod
    def _read(conn, records):
        with conn, conn.makefile() as lines:
            for line in lines:
                records.append(json.loads(line))

    def reset(self):
        self.connections = []


@pytest.fixture(scope="module")
def server():
    return MetricsServer()


def torchrun(script: Path, *args: str, server: MetricsServer | None = None, check: bool = True,
             launcher_args: tuple[str, ...] = ()):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    if server is not None:
        server.reset()
        env |= {"AUTOPAR_METRICS": server.address, "AUTOPAR_TOKEN": "t0k"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                           *launcher_args, str(script), *args], capture_output=True, text=True, timeout=300, env=env,
                          cwd=script.parent)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script.name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def losses_of(server: MetricsServer) -> list[float]:
    """Rank 0's per-step losses (every rank reports the same global loss)."""
    # the first line: the token and rank, and (under torchrun) the elastic attempt's restart count and world size
    (rank0,) = [c for c in server.connections if c and (c[0].get("token"), c[0].get("rank")) == ("t0k", 0)]
    return [r["loss"] for r in rank0 if "step" in r]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("export")
    scripts = {name: export(SRC, plan, out / f"train_{name}.py", steps=4, quiet=True,
                            meta_init=name in META_INIT).script
               for name, plan in PLANS.items()}
    return scripts


@pytest.fixture(scope="module")
def verified():
    return dict(zip(PLANS, verify_many([(SRC, p) for p in PLANS.values()], steps=4), strict=True))


def runtime_of(script: Path) -> Path:
    return script.with_name(runtime_name(script.name) + ".py")


def both(script: Path) -> str:
    """The script's text and its runtime module's."""
    return script.read_text() + runtime_of(script).read_text()


def test_script_is_plain_torch_and_passes_ruff(exported):
    for name, script in exported.items():
        for text in (script.read_text(), runtime_of(script).read_text()):
            imported = {a.name for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Import) for a in n.names} | {
                n.module for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ImportFrom)}
            assert not any(m.startswith("autopar_nb") for m in imported), name  # named in comments only
        text = script.read_text()
        assert f"from {runtime_name(script.name)} import" in text
        assert "torchrun --nproc-per-node 2" in text and "--rdzv-endpoint" in text and "--nnodes 2" in text
        assert text.count(CELL.strip().splitlines()[-1]) == 1  # the cell is embedded verbatim
        assert "AUTOPAR_METRICS" not in text and "observer" not in text  # the notebook's telemetry: in the runtime
        proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--config", str(ROOT / "pyproject.toml"),
                               str(script), str(runtime_of(script))], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout
    assert "parallelize_module" in both(exported["tp_loss_parallel"])
    assert "loss_parallel()" in both(exported["tp_loss_parallel"])
    fsdp = both(exported["fsdp_recompute"])
    assert "fully_shard" in fsdp and "checkpoint_wrapper" in fsdp and "parallelize_module" not in fsdp
    assert 'SCHEDULE = "1f1b"' in exported["pp_1f1b"].read_text()
    meta = exported["pp_meta_init"].read_text()
    assert 'torch.set_default_device("meta")' in meta and "materialize(parts, skeleton, device=device" in meta


def test_plan_json_round_trips(exported):
    from autopar_nb.plan import Plan

    for name, script in exported.items():
        plan = Plan.from_json(script.with_name(script.stem + ".plan.json").read_text())
        assert plan == PLANS[name]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(PLANS))
def test_losses_equal_verify(exported, verified, server, name):
    assert verified[name].ok, str(verified[name])
    proc = torchrun(exported[name], server=server)
    losses = losses_of(server)
    assert len(losses) == 4
    assert losses == pytest.approx(verified[name].losses, rel=1e-6, abs=0)
    assert "step 3 | loss " in proc.stdout
    # the metrics protocol: a hello line, one record per step, then done, from every rank
    assert sorted(c[0]["rank"] for c in server.connections) == [0, 1]
    for records in server.connections:
        steps = [r for r in records if "step" in r]
        assert [r["step"] for r in steps] == [0, 1, 2, 3]
        assert all(r["step_time_s"] > 0 and r["tokens_per_s"] > 0 and r["rss"] > 0 for r in steps)
        assert "mem_allocated" not in steps[0]  # CUDA only
        assert records[-1] == {"event": "done"}


@pytest.mark.multiprocess
def test_resume_from_checkpoint_equals_uninterrupted(exported, server, tmp_path):
    script = exported["fsdp_recompute"]
    torchrun(script, server=server)
    uninterrupted = losses_of(server)
    ckpt = tmp_path / "ckpt"
    torchrun(script, "--stop-at", "2", "--ckpt-dir", str(ckpt), "--ckpt-every", "2", server=server)
    first = losses_of(server)
    (ckpt / "step_3").mkdir()  # what a run killed in the middle of a save leaves: a folder without its manifest
    proc = torchrun(script, "--steps", "4", "--ckpt-dir", str(ckpt), "--ckpt-every", "2", server=server)
    second = losses_of(server)
    assert "resumed from" in proc.stdout and "step_2" in proc.stdout and (ckpt / "step_4" / "manifest.json").exists()
    assert first + second == pytest.approx(uninterrupted, rel=1e-6, abs=0)


@pytest.mark.multiprocess
def test_dry_run_prints_per_rank_parameter_counts(exported):
    proc = torchrun(exported["fsdp_recompute"], "--dry-run")
    counts = [int(line.split(": ")[1].split()[0].replace(",", "")) for line in proc.stdout.splitlines()
              if line.startswith("rank ")]
    model, _, _ = SRC.build(device="meta")
    full = sum(p.numel() for p in model.parameters())
    assert len(counts) == 2 and sum(counts) == full and max(counts) < full  # sharded, nothing lost
    assert "step 0" not in proc.stdout


@pytest.mark.multiprocess
def test_error_is_streamed_then_raised(tmp_path, server):
    src = ModelSource(FAILING, loss_fn_var="loss_fn", make_batch_var="make_batch")
    script = export(src, make_plan(src, dp=2), tmp_path / "train_fail.py", steps=3, quiet=True).script
    proc = torchrun(script, server=server, check=False)
    assert proc.returncode != 0
    errors = [r for c in server.connections for r in c if r.get("event") == "error"]
    assert errors and errors[0]["error"] == "RuntimeError: no data for step 1"
    assert "make_batch" in errors[0]["traceback"]
    assert "no data for step 1" in proc.stderr  # @record: the rank's traceback reaches the launcher's output


@pytest.mark.multiprocess
def test_restarted_ranks_resume_from_checkpoint(tmp_path, server):
    """A rank fails; torchrun restarts every rank (fresh rendezvous keys per attempt); they resume from the last
    checkpoint and the run ends with the losses of a run that never failed."""
    src = ModelSource(FLAKY, loss_fn_var="loss_fn", make_batch_var="make_batch")
    plan = make_plan(src, dp=2, zero=3)
    script = export(src, plan, tmp_path / "train_flaky.py", steps=5, quiet=True).script
    ckpt = ["--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", "2"]
    proc = torchrun(script, *ckpt, launcher_args=("--max-restarts", "1"))
    assert "lost a node" in proc.stderr and "resumed from" in proc.stdout
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert [s.split(" |")[0] for s in steps] == ["step 0", "step 1", "step 2", "step 2", "step 3", "step 4"]
    steady = ModelSource(FLAKY.replace('os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"', "False"),
                         loss_fn_var="loss_fn", make_batch_var="make_batch")
    reference = verify_many([(steady, plan)], steps=5)[0]
    printed = [float(s.split("loss ")[1].split(" |")[0]) for s in steps]
    expected = [reference.losses[i] for i in (0, 1, 2, 2, 3, 4)]
    assert printed == pytest.approx(expected, abs=1e-4)  # the printed 4 decimals


def test_render_takes_zero1_beside_tp_under_fp16():
    """dp x tp with ZeRO-1 under fp16 renders: ZeRO-1 is FSDP2, whose gradients ShardedGradScaler sees (it was
    refused while torch's ZeroRedundancyOptimizer stepped TP's local shards, unseen by the scaler)."""
    plan = make_plan(SRC, dp=2, tp=1, zero=1)
    plan.mesh.tp, plan.mesh.dp = 2, 2
    plan.precision.amp = "fp16"
    text = render_script(SRC, plan)
    assert "apply_fsdp(" in text and "sharded=True" in text and "ZeroRedundancyOptimizer" not in text


def test_script_carries_the_runtime_source_verbatim(exported):
    """One implementation: every function, class and constant of the script's runtime module that autopar_nb.runtime
    defines is that definition's source, character for character (so what verify checked is what the user runs)."""
    from autopar_nb.export import kit

    for name, script in exported.items():
        text = runtime_of(script).read_text()
        carried = [n for n in ast.parse(text).body if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.Assign))]
        found = 0
        for node in carried:
            defined = node.targets[0].id if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) \
                else getattr(node, "name", None)
            try:
                module = kit.where(defined)
            except KeyError:
                continue  # the plan's settings, the cell, parallelize/parse_args/main
            assert kit._module(module).segment(defined) in text, f"{name}: {defined} differs from runtime/{module}.py"
            found += 1
        assert found >= 20, (name, found)


@pytest.mark.multiprocess
def test_tied_weights_across_pipeline_stages_resume_exactly(server, tmp_path):
    """An embedding tied to its head, the two on different pipeline stages (each holds a copy, gradients summed):
    a run interrupted after a DCP checkpoint and resumed ends with the losses of one that never stopped."""
    from runtime_cases import TIED_CELL, source

    src = source(TIED_CELL)
    plan = make_plan(src, pp=2, schedule="1f1b", micro_batches=2, stages={"h.1": 1})
    script = export(src, plan, tmp_path / "train_tied_pp.py", steps=4, quiet=True).script
    assert "TiedGradients(parts, TIES, mesh)" in script.read_text()
    torchrun(script, server=server)
    uninterrupted = losses_of(server)
    ckpt = ["--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", "2"]
    torchrun(script, "--stop-at", "2", *ckpt, server=server)
    first = losses_of(server)
    torchrun(script, *ckpt, server=server)
    assert first + losses_of(server) == pytest.approx(uninterrupted, rel=1e-6, abs=0)
