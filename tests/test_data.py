"""Training on the cell's dataset (issue 18): the DataLoader over the data-parallel ranks reads every sample of an
epoch once, in global batches, and resumes from a checkpoint's position with the next unseen sample (also at another
data-parallel degree); the cell's dataset and collate_fn are found; the exported script reads them, its losses equal
verify's single-process reference, and a run stopped and resumed reads each sample once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from runtime_cases import make_plan
from torch.utils.data import Dataset, IterableDataset

from autopar_nb.export import export, render_script
from autopar_nb.notebook.cell import CellError, run_model_cell
from autopar_nb.runtime.data import DataSampler, DataStream, first_batch
from autopar_nb.source import EXAMPLE_SAMPLES

ROOT = Path(__file__).resolve().parents[1]


class Ids(Dataset):
    """Sample i is tensor([i])."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([i])


class IdStream(IterableDataset):
    """0, 1, ..., n - 1 in an order that depends on the epoch (set_epoch)."""

    def __init__(self, n):
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.epoch)
        return iter(torch.tensor([[i] for i in torch.randperm(self.n, generator=g).tolist()]))


def read(streams, steps):
    """{step: [ids of rank 0, ids of rank 1, ...]}"""
    return {s: [streams[r](s, r).flatten().tolist() for r in range(len(streams))] for s in steps}


def epochs_of(seen: dict, per_step: int, per_epoch: int) -> list[list[int]]:
    flat = [i for s in sorted(seen) for ids in seen[s] for i in ids]
    return [flat[k:k + per_epoch] for k in range(0, len(flat), per_epoch)]


def test_sampler_deals_contiguous_blocks_of_one_order_per_epoch():
    ds = Ids(40)
    a, b = (DataSampler(ds, num_replicas=2, rank=r, batch_size=3, seed=7) for r in range(2))
    order = a.order()
    assert sorted(order) == list(range(40)) and order == b.order()
    ra, rb = list(a), list(b)
    assert len(ra) == len(a) == 18  # 40 // 6 steps of 3 per rank; the last 4 samples wait for the next epoch
    for step in range(6):  # step k of both ranks reads positions [6k, 6k + 6) of the order, interleaved
        assert sorted(ra[3 * step:3 * step + 3] + rb[3 * step:3 * step + 3]) == sorted(order[6 * step:6 * step + 6])
    a.set_epoch(1)
    assert a.order() != order  # a new permutation per epoch (seed + epoch, as DistributedSampler)
    a.start = 12  # two steps consumed
    assert list(a) == order_rest(a, 12, rank=0, replicas=2)


def order_rest(sampler, start, *, rank, replicas):
    rest = sampler.order()[start:]
    return rest[rank:len(rest) // (3 * replicas) * 3 * replicas:replicas]


@pytest.mark.parametrize("iterable", [False, True])
def test_every_sample_of_an_epoch_once_across_epochs(iterable):
    ds = IdStream(40) if iterable else Ids(40)
    streams = [DataStream(ds, batch_size=3, dp=2, dp_rank=r, seed=1) for r in range(2)]
    seen = read(streams, range(13))  # 6 steps per epoch: two epochs and a step
    e0, e1, e2 = epochs_of(seen, 6, 36)
    assert len(set(e0)) == len(set(e1)) == 36 and e0 != e1  # no repeats inside an epoch; reshuffled
    assert len(e2) == 6 and streams[0].state_dict() == {"epoch": 2, "consumed": 6, "step": 13}
    assert streams[0](12, 0) is streams[0](12, 0)  # the step handed out last: the same batch again


@pytest.mark.parametrize("iterable", [False, True])
@pytest.mark.parametrize("dp_after", [2, 1, 4])
def test_resumed_stream_reads_the_next_unseen_sample(iterable, dp_after):
    """Stopped after 4 steps of 2 ranks (its position saved), resumed with dp_after data-parallel ranks (each keeping
    its 3 samples a step): every global batch before and after is the next block of the uninterrupted order (one
    rank reading alone), to the end of the second epoch: nothing repeated, nothing skipped."""
    make = (lambda: IdStream(48)) if iterable else (lambda: Ids(48))
    alone = DataStream(make(), batch_size=3, dp=1, dp_rank=0, seed=3)
    order = [i for s in range(32) for i in alone(s, 0).flatten().tolist()]  # two epochs of 48
    assert sorted(order[:48]) == sorted(order[48:]) == list(range(48)) and order[:48] != order[48:]

    before = [DataStream(make(), batch_size=3, dp=2, dp_rank=r, seed=3) for r in range(2)]
    first = read(before, range(4))
    state = before[0].state_dict()
    assert state == before[1].state_dict() == {"epoch": 0, "consumed": 24, "step": 4}
    after = [DataStream(make(), batch_size=3, dp=dp_after, dp_rank=r, seed=3) for r in range(dp_after)]
    for stream in after:
        stream.load_state_dict(state)
    second = read(after, range(4, 4 + (96 - 24) // (3 * dp_after)))
    pos = 0
    for part in (first, second):
        for step in sorted(part):
            batch = sorted(i for ids in part[step] for i in ids)
            assert batch == sorted(order[pos:pos + len(batch)]), step
            pos += len(batch)
    assert pos == 96


def test_stream_without_a_saved_position_counts_from_the_step():
    streams = [DataStream(Ids(40), batch_size=3, dp=2, dp_rank=r) for r in range(2)]
    reference = read(streams, range(9))
    late = DataStream(Ids(40), batch_size=3, dp=2, dp_rank=1)
    assert late(7, 1).flatten().tolist() == reference[7][1]  # epoch 1, step 1 of it


def test_worker_processes_read_the_same_batches():
    plain = DataStream(Ids(40), batch_size=4, dp=2, dp_rank=1, seed=5)
    workers = DataStream(Ids(40), batch_size=4, dp=2, dp_rank=1, seed=5, num_workers=2, prefetch_factor=2)
    assert [plain(s, 1).tolist() for s in range(7)] == [workers(s, 1).tolist() for s in range(7)]


def test_too_small_a_dataset_says_so():
    with pytest.raises(ValueError, match=r"fewer than one step reads: batch_size\(8\) x data-parallel ranks\(2\)"):
        DataStream(Ids(10), batch_size=8, dp=2, dp_rank=0)


# ---- the cell -------------------------------------------------------------------------------------------------------
TEXT = ("Plan, show, run and export parallel training for PyTorch models, from a Jupyter notebook. " * 40).encode()

DATA_CELL = '''\
import os

import torch
from torch.utils.data import Dataset

from autopar_nb.zoo import Llama, LlamaConfig

TOKENS = os.environ.get("AUTOPAR_TOKENS", "corpus.u8")  # byte-level tokens (one byte each) of a text corpus
SEQ = 16


class TokenWindows(Dataset):
    """Consecutive windows of SEQ byte tokens of a memory-mapped token file."""

    def __init__(self, path, seq):
        self.tokens = torch.from_file(path, shared=False, size=os.path.getsize(path), dtype=torch.uint8)
        self.seq = seq

    def __len__(self):
        return len(self.tokens) // self.seq

    def __getitem__(self, i):
        return self.tokens[i * self.seq:(i + 1) * self.seq].long()


model = Llama(LlamaConfig(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64))
dataset = TokenWindows(TOKENS, SEQ)
'''

# the samples carry their index; the loss writes the indices it trained on (when AUTOPAR_SEEN names a folder)
SEEN_CELL = DATA_CELL + '''

class Indexed(Dataset):
    def __init__(self, windows):
        self.windows = windows

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        return self.windows[i], i


def collate_fn(samples):
    return torch.stack([s[0] for s in samples]), torch.tensor([s[1] for s in samples])


def loss_fn(model, batch):
    tokens, index = batch
    if os.environ.get("AUTOPAR_SEEN"):
        with open(os.path.join(os.environ["AUTOPAR_SEEN"], f"rank{os.environ['RANK']}"), "a") as f:
            f.write(" ".join(map(str, index.tolist())) + "\\n")
    logits = model(tokens)
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


dataset = Indexed(dataset)
example_inputs = (torch.zeros(4, SEQ, dtype=torch.long),)  # what the model takes
'''


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, monkeypatch_module):
    path = tmp_path_factory.mktemp("data") / "corpus.u8"
    path.write_bytes(TEXT)  # byte-level: the UTF-8 bytes are the tokens
    monkeypatch_module.setenv("AUTOPAR_TOKENS", str(path))
    return path


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_cell_binds_a_dataset_without_example_inputs(corpus):
    result = run_model_cell(DATA_CELL, {})
    src = result.source
    assert (src.dataset_var, src.inputs_var, src.collate_fn_var) == ("dataset", None, None)
    (tokens,) = (result.example_inputs,)
    assert tokens.shape == (EXAMPLE_SAMPLES, 16) and tokens.dtype == torch.long
    assert tokens[0].tolist() == list(TEXT[:16])
    model, inputs, _ = src.build(device="meta")
    assert inputs.shape == (EXAMPLE_SAMPLES, 16)  # the workers derive the same example


def test_cell_binds_dataset_and_collate_fn(corpus):
    src = run_model_cell(SEEN_CELL, {}).source
    assert (src.dataset_var, src.collate_fn_var, src.inputs_var, src.loss_fn_var) == (
        "dataset", "collate_fn", "example_inputs", "loss_fn")
    ns = src.run()
    tokens, index = first_batch(ns["dataset"], batch_size=3, collate_fn=ns["collate_fn"])
    assert tokens.shape == (3, 16) and index.tolist() == [0, 1, 2]


def test_cell_with_two_datasets_is_refused(corpus):
    with pytest.raises(CellError, match=r"several datasets \(a, b\)"):
        run_model_cell(DATA_CELL.replace("dataset = TokenWindows(TOKENS, SEQ)",
                                         "a = TokenWindows(TOKENS, SEQ)\nb = TokenWindows(TOKENS, SEQ)"), {})


def test_script_reads_the_dataset_and_passes_ruff(corpus, tmp_path):
    for cell, kw in ((DATA_CELL, {}), (SEEN_CELL, {}), (DATA_CELL, {"pp": 2, "micro_batches": 2,
                                                                    "stages": {"layers.1": 1}})):
        src = run_model_cell(cell, {}).source
        plan = make_plan(src, dp=2 if "pp" not in kw else 1, **kw)
        text = render_script(src, plan)
        path = tmp_path / "train.py"
        path.write_text(text)
        proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--config", str(ROOT / "pyproject.toml"),
                               str(path)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout
        assert "make_batch_fn = DataStream(dataset, batch_size=BATCH_SIZE" in text
        assert "--num-workers" in text and "default=default_num_workers()" in text
        assert ("dp_rank=dp_rank, collate_fn=collate_fn" in " ".join(text.split())) == (cell is SEEN_CELL)
        if "pp" in kw:
            assert "first = first_batch(dataset, batch_size=BATCH_SIZE)" in text
            assert "make_batch_fn = None  # a stage between" in text and "if 0 in ids or NUM_STAGES - 1 in ids:" in text


# ---- every strategy that reads data, against the single-process reference -----------------------------------------
ITER_CELL = DATA_CELL + '''

class TokenStream(torch.utils.data.IterableDataset):
    """The windows as a stream (no len, no indexing): read in order, once per epoch."""

    def __init__(self, windows):
        self.windows = windows

    def __iter__(self):
        return (self.windows[i] for i in range(len(self.windows)))


dataset = TokenStream(dataset)
'''


def cp_plans(src) -> list:
    """cp=2 with DDP and with FSDP2 (ZeRO-3): sequences of 16, each rank of the one replica takes half of each."""
    from autopar_nb.plan import Plan

    plans = []
    for zero in (0, 3):
        d = make_plan(src, zero=zero).to_dict()
        d["mesh"]["cp"], d["batch"]["seq_len"] = 2, 16
        plans.append(Plan.from_dict(d))
    return plans


def data_cases() -> dict[int, dict[str, tuple]]:
    """{processes: {name: (source, plan)}}: each strategy's ranks read the dataset (map-style or a stream, torch's
    collate or the cell's) through the exported script's DataLoader; the cp cases are
    test_context_parallel_ranks_read_the_dataset's (in the same launch of 2)."""
    from runtime_cases import llama_tp

    data, seen, stream = (run_model_cell(c, {}).source for c in (DATA_CELL, SEEN_CELL, ITER_CELL))
    return {
        2: {"ddp": (data, make_plan(data, dp=2)),
            "fsdp_accumulate": (data, make_plan(data, dp=2, zero=3, micro_batches=2)),
            "zero2_collate": (seen, make_plan(seen, dp=2, zero=2)),
            "ddp_stream": (stream, make_plan(stream, dp=2)),
            "tp": (data, make_plan(data, tp=2, tp_styles=llama_tp())),
            "pp_collate": (seen, make_plan(seen, pp=2, micro_batches=2, stages={"layers.1": 1})),
            **dict(zip(("cp_ddp", "cp_fsdp"), ((data, plan) for plan in cp_plans(data)), strict=True))},
        3: {"pp3_middle_reads_nothing": (data, make_plan(data, pp=3, micro_batches=4,
                                                         stages={"layers.0": 1, "layers.1": 2}))},
        4: {"dp2_tp2_collate": (seen, make_plan(seen, dp=2, tp=2, tp_styles=llama_tp())),
            "dp2_pp2": (data, make_plan(data, dp=2, pp=2, micro_batches=2, stages={"layers.1": 1}))},
    }


@pytest.fixture(scope="module")
def data_reports(corpus):
    from autopar_nb.verify import verify_many

    out = {}
    for nproc, cases in data_cases().items():
        out.update(zip(cases, verify_many(list(cases.values()), steps=4, nproc=nproc), strict=True))
    return out


DATA_CASES = ("ddp", "fsdp_accumulate", "zero2_collate", "ddp_stream", "tp", "pp_collate", "pp3_middle_reads_nothing",
              "dp2_tp2_collate", "dp2_pp2")


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", DATA_CASES)
def test_every_strategy_reading_the_dataset_matches_the_reference(data_reports, name):
    report = data_reports[name]
    assert report.ok, str(report)
    assert len(report.steps) == 4


@pytest.mark.multiprocess
# ---- the exported script, stopped in the middle of an epoch and resumed ---------------------------------------------
def test_script_resumed_mid_epoch_reads_each_sample_once(corpus, tmp_path, monkeypatch):
    """20 windows, 2 ranks x 4 per step: 2 steps an epoch (4 windows left over). Stopped after step 3 (the middle of
    epoch 1) and resumed (with a DataLoader worker process): each rank trained on exactly what an uninterrupted
    stream reads, every epoch's 16 samples once, reshuffled between epochs."""
    from autopar_nb.export.values import script_values

    small = tmp_path / "small.u8"
    small.write_bytes(TEXT[:320])
    monkeypatch.setenv("AUTOPAR_TOKENS", str(small))
    src = run_model_cell(SEEN_CELL, {}).source
    plan = make_plan(src, dp=2)
    script = export(src, plan, tmp_path / "train.py", steps=6, quiet=True).script
    seen_dir = tmp_path / "seen"
    seen_dir.mkdir()
    env = dict(os.environ, PYTHONWARNINGS="ignore", AUTOPAR_SEEN=str(seen_dir))
    ckpt = ["--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", "3"]
    for extra in (["--stop-at", "3", "--num-workers", "0"], ["--num-workers", "1"]):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                               str(script), *ckpt, *extra], capture_output=True, text=True, timeout=300, env=env,
                              cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "resumed from" in proc.stdout and "step_3" in proc.stdout
    seen = {r: [list(map(int, line.split())) for line in (seen_dir / f"rank{r}").read_text().splitlines()]
            for r in range(2)}
    batch = script_values(src, plan).defaults["batch_size"]
    assert batch == 4 and len(seen[0]) == len(seen[1]) == 6  # one line per step, none repeated at the resume
    ns = src.run()
    streams = [DataStream(ns["dataset"], batch_size=batch, dp=2, dp_rank=r, collate_fn=ns["collate_fn"])
               for r in range(2)]
    assert seen == {r: [streams[r](s, r)[1].tolist() for s in range(6)] for r in range(2)}
    epochs = [seen[0][2 * e] + seen[0][2 * e + 1] + seen[1][2 * e] + seen[1][2 * e + 1] for e in range(3)]
    assert all(len(set(e)) == 16 for e in epochs) and epochs[0] != epochs[1]


def test_verify_runs_dataset_scripts_without_loader_workers(corpus, tmp_path):
    """verify's ranks read the dataset in-process, as its reference does: the script is run with --num-workers 0
    whatever the machine's cores would give by default; a script without a dataset gets no such flag."""
    import runpy

    from autopar_nb.verify.ranks import script_argv

    src = run_model_cell(DATA_CELL, {}).source
    path = tmp_path / "train.py"
    path.write_text(render_script(src, make_plan(src, dp=2)))
    ns = runpy.run_path(str(path), run_name="__autopar_verify__")
    assert script_argv(ns, 3) == ["--steps", "3", "--num-workers", "0"]
    assert ns["parse_args"](script_argv(ns, 3)).num_workers == 0
    assert script_argv({"main": None}, 3) == ["--steps", "3"]


# ---- a dataset path relative to the notebook, under launch ----------------------------------------------------------
@pytest.mark.multiprocess
@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_launched_ranks_read_a_dataset_path_relative_to_the_notebook(corpus, tmp_path, monkeypatch, warm):
    """The cell opens `data/corpus.u8` relative to the kernel's working directory (the notebook's); launch's ranks
    start there too, as `torchrun /abs/path/train.py` run from that directory would, while the script itself lives
    in the run directory and its directory stays sys.path[0]."""
    from autopar_nb.launch import launch, live_runs

    notebook = tmp_path / "notebook"
    (notebook / "data").mkdir(parents=True)
    (notebook / "data" / "corpus.u8").write_bytes(TEXT[:640])
    monkeypatch.chdir(notebook)
    monkeypatch.setenv("AUTOPAR_TOKENS", "data/corpus.u8")  # relative, as a notebook cell would write it
    src = run_model_cell(DATA_CELL, {}).source
    plan = make_plan(src, dp=2)
    run = launch(lambda path: export(src, plan, path, steps=2, quiet=True), nproc=2, steps=2, plan=plan,
                 run_dir=tmp_path / "run", warm=warm, monitor=False)
    try:
        assert run.wait(120) == "finished", f"{run.message}\n{run.logs(0)}"
    finally:
        for r in live_runs():
            r.stop("test cleanup")
    assert run.warm is warm and run.script == tmp_path / "run" / "train.py"
    assert f"cd {notebook} && " in (tmp_path / "run" / "command.txt").read_text()


@pytest.mark.multiprocess  # measure() runs the script in a child process
def test_measure_runs_where_the_cells_relative_paths_hold(tmp_path, monkeypatch):
    """``measure`` (the memory tracker's run of a plan's script in a child process) runs in the kernel's working
    directory, as verify and launch do: a cell opening ``width.txt`` next to the notebook builds its model there.
    (Before, the child ran in the temporary folder the script was exported to: FileNotFoundError.)"""
    from runtime_cases import source

    from autopar_nb.verify.measure import measure

    (tmp_path / "width.txt").write_text("12")
    monkeypatch.chdir(tmp_path)
    cell = ('import torch\nimport torch.nn as nn\n\nwidth = int(open("width.txt").read())\n'
            'model = nn.Sequential(nn.Linear(width, 16), nn.ReLU(), nn.Linear(16, 4))\n'
            'example_inputs = (torch.randn(8, width),)\n')
    src = source(cell)
    (got,) = measure(src, make_plan(src), ranks=(0,), steps=1)
    assert got["rank"] == 0 and got["peak"]


@pytest.mark.multiprocess
def test_context_parallel_ranks_read_the_dataset(data_reports):
    """cp=2 fed by the cell's dataset (issue 18 points 1 and 4 together): both cp ranks of the one replica read the
    same samples (the sampler deals over the data-parallel ranks only) and each takes its half of every sequence;
    losses, gradients and parameters equal the single process's on 2 gloo processes, with DDP and with FSDP2, to
    float32's tolerance (verify's default for these fp32 plans)."""
    from autopar_nb.verify import FP32_RTOL

    src = run_model_cell(DATA_CELL, {}).source
    text = render_script(src, cp_plans(src)[0])
    assert "make_batch_fn = DataStream(dataset, batch_size=BATCH_SIZE" in text
    assert 'shard = functools.partial(sequence_shards, mesh["cp"], causal=CAUSAL)' in text
    for name in ("cp_ddp", "cp_fsdp"):
        report = data_reports[name]
        assert report.ok and report.rtol == FP32_RTOL, f"{name}\n{report}"
        assert len(report.steps) == 4 and report.max_loss_rel < 1e-5, str(report)
