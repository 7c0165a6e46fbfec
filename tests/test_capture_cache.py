"""Re-running the magic on an unchanged cell, or one changed outside the model, reuses its capture (issue 43): the
key covers what a trace depends on — module classes and their code, plain attributes, parameter shapes, the inputs —
so an edit to any of them captures again."""

from __future__ import annotations

import time

from autopar_nb.capture.cache import capture_key
from autopar_nb.notebook.cell import run_model_cell

CELL = '''
import torch, torch.nn as nn, torch.nn.functional as F

def act(x):
    return F.gelu(x)

class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc, self.scale = nn.Linear(d, d), 0.5
    def forward(self, x):
        return x + self.scale * act(self.fc(x))

model = nn.Sequential(*[Block(256) for _ in range(4)], nn.Linear(256, 8))
example_inputs = (torch.randn(16, 256),)
lr = 1e-3
'''


def key(cell: str) -> str:
    result = run_model_cell(cell, {})
    return capture_key(result.model, result.model_inputs)


def test_the_key_follows_what_the_trace_depends_on():
    base = key(CELL)
    assert key(CELL) == base  # a fresh build of the same cell
    assert key(CELL.replace("lr = 1e-3", "lr = 3e-4  # tuned")) == base  # outside the model
    for edit in (("F.gelu(x)", "F.relu(x)"),  # a function of the cell the forward calls
                 (", 0.5\n", ", 0.25\n"),  # a plain attribute
                 ("x + self.scale", "x - self.scale"),  # the forward's code
                 ("Block(256)", "Block(128)"),  # parameter shapes (the inputs too)
                 ("(16, 256)", "(32, 256)")):  # the inputs' shapes
        changed = CELL.replace(*edit)
        if edit[0] == "Block(256)":
            changed = changed.replace("nn.Linear(256, 8)", "nn.Linear(128, 8)").replace("(16, 256)", "(16, 128)")
        assert key(changed) != base, edit


def test_a_rerun_reuses_the_capture_and_is_quick(ip):
    first = ip.run_cell_magic("autoparallel", "--gpu cpu --gpus 2", CELL)
    t0 = time.perf_counter()
    again = ip.run_cell_magic("autoparallel", "--gpu cpu --gpus 2 --batch 32", CELL.replace("1e-3", "3e-4"))
    seconds = time.perf_counter() - t0
    assert again.graph is first.graph and again.graph.source.endswith("lr = 3e-4\n")
    assert again.batch == 32 and again.plan.batch.global_batch == 32
    print(f"re-run of the magic: {seconds:.3f} s")
    edited = ip.run_cell_magic("autoparallel", "--gpu cpu --gpus 2", CELL.replace("F.gelu", "F.silu"))
    assert edited.graph is not first.graph
