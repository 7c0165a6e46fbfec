"""The shapes datasets come in (issue 40): a cell whose ``loss_fn`` unpacks ``(x, y)`` samples, dict samples or
``(inputs, labels)`` with a dict of inputs is captured on the arguments the loss gives the model — found by calling
the loss with a hook that stops at the model's first call — and trains like one process in every shape."""

from __future__ import annotations

import pytest
from runtime_cases import has_transformers, make_plan

from autopar_nb.notebook.cell import CellError, run_model_cell

DATASET = '''
import torch, torch.nn as nn, torch.nn.functional as F
class Samples(torch.utils.data.Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {sample}
dataset = Samples()
'''
MLP = "model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))\n"
XY = DATASET.format(sample="torch.randn(16, generator=g), torch.tensor(i % 4)") + MLP + '''
def loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)
'''
DICT = DATASET.format(sample='{"pixels": torch.randn(16, generator=g), "label": torch.tensor(i % 4)}') + MLP + '''
def loss_fn(model, batch):
    return F.cross_entropy(model(batch["pixels"]), batch["label"])
'''
HF = DATASET.format(sample='({"input_ids": torch.randint(0, 128, (12,), generator=g), '
                           '"attention_mask": torch.ones(12, dtype=torch.long)}, torch.tensor(i % 3))') + '''
from transformers import BertConfig, BertForSequenceClassification
model = BertForSequenceClassification(BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2,
                                                 num_attention_heads=2, intermediate_size=64, num_labels=3))
def loss_fn(model, batch):
    inputs, labels = batch
    return F.cross_entropy(model(**inputs).logits, labels)
'''
CELLS = {"xy": XY, "dict": DICT, "inputs_labels": HF}


def _cells():
    return {k: v for k, v in CELLS.items() if k != "inputs_labels" or has_transformers()}


@pytest.mark.parametrize("name", list(CELLS))
def test_each_dataset_shape_captures_and_plans(ip, name):
    if name not in _cells():
        pytest.skip("transformers not installed")
    session = ip.run_cell_magic("autoparallel", "--gpu cpu --gpus 2 --batch 16", CELLS[name])
    inputs = session.graph.inputs
    assert session.cluster.world_size == 2 and inputs
    assert all(i.shape[0] == 8 for i in inputs)  # the model's own inputs: the labels never reach it


def test_model_inputs_are_what_the_loss_passes():
    xy = run_model_cell(XY, {})
    assert isinstance(xy.model_inputs, tuple) and len(xy.model_inputs) == 1  # x, not (x, y)
    assert xy.model_inputs[0].shape == (8, 16)
    mixed = XY.replace("model(x)", "model(x, **{})").replace("nn.Sequential(", "Wrapped(").replace(
        "model = ", "class Wrapped(nn.Sequential):\n    def forward(self, x, scale=1.0):\n"
                    "        return super().forward(x) * scale\nmodel = ").replace("**{}", "scale=2.0")
    got = run_model_cell(mixed, {}).model_inputs
    assert set(got) == {"x", "scale"} and got["scale"] == 2.0  # mixed call: keywords by the forward's names


def test_a_batch_the_forward_cannot_take_says_to_define_loss_fn():
    with pytest.raises(CellError, match=r"does not take the batch's 2 parts .* define loss_fn\(model, batch\)"):
        run_model_cell(XY.split("def loss_fn")[0], {})
    silent = XY.replace("return F.cross_entropy(model(x), y)", "return x.sum()")
    with pytest.raises(CellError, match=r"loss_fn\(model, batch\) returned without calling the model"):
        run_model_cell(silent, {})


@pytest.mark.multiprocess
def test_every_shape_trains_like_one_process():
    from autopar_nb.verify import verify_many

    sources = [run_model_cell(cell, {}).source for cell in _cells().values()]
    reports = verify_many([(src, make_plan(src, dp=2, zero=3)) for src in sources], steps=2, nproc=2)
    for name, report in zip(_cells(), reports, strict=True):
        assert report.ok, (name, str(report))
