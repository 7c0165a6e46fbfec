"""The batch a cell's make_batch produces is the batch the plan costs (issue 40): ``make_batch(step, rank)`` returns
one data-parallel rank's samples, so each rank trains on that many whatever dp; the plan's global batch is that x
its dp, and a --batch or example that disagrees is said in one line before anything runs; so is a dataset's
collate_fn that makes other rows than the samples a step reads."""

from __future__ import annotations

import pytest

import autopar_nb as ap
from autopar_nb.notebook.cell import run_model_cell

CELL = '''
import torch, torch.nn as nn
model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
example_inputs = (torch.randn(8, 256),)
def make_batch(step, rank):
    g = torch.Generator().manual_seed(step * 100 + rank)
    return (torch.randn(PER_RANK, 256, generator=g),)
'''


def test_make_batch_is_read_on_the_meta_device():
    result = run_model_cell(CELL.replace("PER_RANK", "12"), {})
    assert result.per_rank_batch == 12


def test_each_plan_trains_make_batch_per_rank(ip, capsys):
    session = ip.run_cell_magic("autoparallel", "--gpu cpu --gpus 2 --fix dp=2", CELL.replace("PER_RANK", "8"))
    assert session.plan.batch.global_batch == 16 == session.batch  # 8 per rank, not the example's 8 overall
    assert "make_batch returns 8 samples per rank" in session.plan.explain()
    out = capsys.readouterr().out.strip()  # the example said a global batch of 8: the 16 planned is said
    assert out.count("\n") == 0 and out.startswith("make_batch returns 8 samples per rank, so this plan (dp=2) "
                                                   "trains 16 per step, not example_inputs' batch of 8"), out


def test_an_example_that_agrees_with_make_batch_says_nothing(ip, capsys):
    """The example's batch is the global one (8 per rank x dp 2 = 16); a cell without example_inputs takes
    make_batch(0, 0) as its example, one rank's samples by construction: nothing disagrees in either."""
    cell = CELL.replace("PER_RANK", "8").replace("torch.randn(8, 256)", "torch.randn(16, 256)")
    ip.run_cell_magic("autoparallel", "--gpu cpu --gpus 2 --fix dp=2", cell)
    ip.run_cell_magic("autoparallel", "--gpu cpu --gpus 2 --fix dp=2", NO_EXAMPLE)
    assert capsys.readouterr().out == ""


def test_a_disagreeing_batch_flag_is_said_in_one_line(ip, capsys):
    session = ip.run_cell_magic("autoparallel", "--gpu cpu --gpus 2 --batch 8 --fix dp=2",
                                CELL.replace("PER_RANK", "8"))
    assert session.plan.batch.global_batch == 16
    out = capsys.readouterr().out.strip()
    assert out.count("\n") == 0 and out.startswith("make_batch returns 8 samples per rank, so this plan (dp=2) "
                                                   "trains 16 per step, not --batch 8"), out


def test_the_planner_compares_meshes_per_sample():
    """Each dp is planned at its own global batch; the plan with the most samples per second wins."""
    from autopar_nb.source import ModelSource

    model, inputs, _ = ModelSource(CELL.replace("PER_RANK", "8")).build(device="meta")
    graph = ap.capture(model, inputs)
    cluster = ap.Cluster.preset("h100-80gb", 1, 4)
    best = ap.plan(graph, cluster, per_rank_batch=8)
    for dp in (1, 2, 4):
        other = ap.plan(graph, cluster, global_batch=8 * dp, fix={"dp": dp})
        assert best.cost.samples_per_s >= other.cost.samples_per_s * (1 - 1e-9)
    assert best.batch.global_batch == 8 * best.mesh.dp


NO_EXAMPLE = '''
import torch, torch.nn as nn
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
def make_batch(step, rank):
    g = torch.Generator().manual_seed(step * 10 + rank)
    return (torch.randn(8, 16, generator=g),)
'''


def test_make_batch_alone_gives_the_example():
    """A cell with make_batch and no example inputs: make_batch(0, 0), on the meta device, is the example."""
    result = run_model_cell(NO_EXAMPLE, {})
    assert result.source.inputs_var is None and result.per_rank_batch == 8
    assert result.example_inputs[0].shape == (8, 16) and result.example_inputs[0].is_meta


@pytest.mark.multiprocess
def test_make_batch_alone_trains_like_one_process():
    from runtime_cases import make_plan

    from autopar_nb.verify import verify

    src = run_model_cell(NO_EXAMPLE, {}).source
    report = verify(src, make_plan(src, dp=2, zero=3), steps=2, nproc=2)
    assert report.ok, str(report)


@pytest.mark.multiprocess
def test_a_sequence_tp_cannot_split_is_one_line_before_the_first_step():
    """Sequence parallelism cuts each sequence into tp equal parts: make_batch's 33 tokens (the plan was made for 16)
    under tp=2 is a ValueError naming the length and tp in the first forward, not a gloo collective failing on two
    sizes (``17408 vs 16384``)."""
    from runtime_cases import LLAMA_CELL, llama_tp, make_plan, source

    from autopar_nb.verify import VerifyError, verify

    src = source(LLAMA_CELL + "\n\ndef make_batch(step, rank):\n    g = torch.Generator().manual_seed(step)\n"
                              "    return (torch.randint(0, 64, (4, 33), generator=g),)\n")
    with pytest.raises(VerifyError) as info:
        verify(src, make_plan(src, tp=2, tp_styles=llama_tp(sp=True), sp=True), steps=1, nproc=2)
    line = str(info.value)
    assert "\n" not in line and "splits each sequence over the 2 TP ranks, but this batch's are 33 long" in line, line


DATASET = '''
import torch, torch.nn as nn
class Samples(torch.utils.data.Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        return torch.randn(16, generator=torch.Generator().manual_seed(i))
dataset = Samples()
def collate_fn(samples):
    return (torch.cat([torch.stack(samples)] * ROWS),)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
'''


def test_the_plan_costs_the_rows_a_collate_fn_makes(ip, capsys):
    """A collate_fn that makes two rows of each sample: --batch 8 counts samples, the model trains on their 16 rows,
    and the plan is made for those 16 (8 rows per rank under dp=2: the activations of a 16-row plan); each rank
    still reads 4 samples per step. Said in one line, with the global batch planned."""
    from autopar_nb.export.values import script_values

    cell = DATASET.replace("torch.randn(16, gen", "torch.randn(256, 16, gen").replace(  # rows of 256 steps
        "nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)", "nn.Linear(16, 1024), nn.ReLU(), nn.Linear(1024, 16)")
    doubled = ip.run_cell_magic("autoparallel", "--gpu h100-80gb --gpus 2 --batch 8 --fix dp=2",
                                cell.replace("ROWS", "2"))
    out = capsys.readouterr().out.strip()
    assert out == ("collate_fn makes 2 rows of each sample, so the 8 samples of --batch 8 are 16 rows per step: the "
                   "rows are planned, a global batch of 16 (dp=2: 4 samples, 8 rows per rank)"), out
    assert doubled.source.rows_per_sample == 2 and doubled.plan.batch.global_batch == 16
    rows = ip.run_cell_magic("autoparallel", "--gpu h100-80gb --gpus 2 --batch 16 --fix dp=2",
                             cell.replace("ROWS", "1"))
    assert capsys.readouterr().out == "" and rows.source.rows_per_sample == 1
    got, want = doubled.plan.cost.memory_by_rank[0], rows.plan.cost.memory_by_rank[0]
    assert got.activations == pytest.approx(want.activations, rel=1e-6) and got.activations > 0
    assert doubled.plan.cost.compute_s == pytest.approx(rows.plan.cost.compute_s, rel=1e-6)
    assert script_values(doubled.source, doubled.plan).defaults["batch_size"] == 4  # samples read per rank
    assert script_values(rows.source, rows.plan).defaults["batch_size"] == 8


def test_a_collate_fn_that_makes_no_whole_rows_per_sample_is_said_in_one_line(ip, capsys):
    """A collate_fn that drops a sample of each batch (a packing one makes rows unrelated to the samples too) has no
    whole number of rows per sample to plan with: the plan costs the samples and the rows that run are said."""
    cell = DATASET.replace("torch.cat([torch.stack(samples)] * ROWS)", "torch.stack(samples[:-1])")
    session = ip.run_cell_magic("autoparallel", "--gpu cpu --gpus 2 --batch 8 --fix dp=2", cell)
    assert session.source.rows_per_sample == 1 and session.plan.batch.global_batch == 8
    out = capsys.readouterr().out.strip()
    assert out == ("collate_fn makes 3 rows of the 4 samples each rank reads per step, so this plan (dp=2) trains 6 "
                   "rows per step, not the 8 its memory and time are for: the rows are what runs (have collate_fn "
                   "return the same number of rows of each sample)"), out
    ip.run_cell_magic("autoparallel", "--gpu cpu --gpus 2 --batch 8 --fix dp=2", DATASET.replace("ROWS", "1"))
    assert capsys.readouterr().out == ""


@pytest.mark.multiprocess
def test_a_plan_of_collated_rows_trains_like_one_process():
    """The plan of a collate_fn's rows (16 rows: 8 samples of 2 rows) runs: each of the 2 ranks reads 4 samples per
    step, as one process reads 8, and the losses agree."""
    from autopar_nb.verify import verify

    result = run_model_cell(DATASET.replace("ROWS", "2"), {})
    graph = ap.capture(result.model, result.model_inputs)
    plan = ap.plan(graph, ap.Cluster.preset("cpu", 1, 2), global_batch=16, fix={"dp": 2, "zero_stage": 0})
    assert result.source.rows_per_sample == 2 and plan.batch.global_batch == 16
    report = verify(result.source, plan, steps=2, nproc=2)
    assert report.ok, str(report)
