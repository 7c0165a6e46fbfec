"""export/synthetic_ids.py: synthetic ids cover each integer input's own table (the vocabulary the head predicts),
not only the model's smallest table (the verify case under TP is ``ids_tp`` in test_verify.py)."""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from runtime_cases import GPT_CELL, TYPED_CELL, make_plan, source

from autopar_nb.export import render_script
from autopar_nb.export.synthetic_ids import id_ranges
from autopar_nb.export.values import script_values
from autopar_nb.runtime.data import default_loss, synthetic_batch


def test_each_input_is_drawn_over_its_own_table():
    """Token ids over the 64-row vocabulary (before: below the 2-row token-type table, so a vocabulary split over 2
    TP ranks was only ever looked up on the first), token types over their 2 rows; the script says so. A model
    with one integer input keeps one int."""
    src = source(TYPED_CELL)
    plan = make_plan(src, tp=2, tp_styles={"wte": "rowwise", "lm_head": "colwise"})
    highs = script_values(src, plan).defaults["int_high"]
    assert highs == {"input_ids": 64, "token_type_ids": 2}
    assert "INT_HIGH = {'input_ids': 64, 'token_type_ids': 2}" in render_script(src, plan)
    example = src.build()[1]
    batches = [synthetic_batch(example, step, 0, batch_size=4, int_high=highs) for step in range(3)]
    ids = torch.cat([b["input_ids"] for b in batches])
    types = torch.cat([b["token_type_ids"] for b in batches])
    assert ids.max() >= 32 and ids.max() < 64 and ids.min() < 32  # both halves of the split vocabulary
    assert set(types.unique().tolist()) == {0, 1}
    gpt = source(GPT_CELL)
    assert isinstance(script_values(gpt, make_plan(gpt, dp=2)).defaults["int_high"], int)


class Lookups(nn.Module):
    """ids reach a 100-row table through a view and a copy, and a head of 50 classes predicts them; ``rows``
    index three tables by column, as a recommender's sparse features do."""

    def __init__(self):
        super().__init__()
        self.tok, self.head = nn.Embedding(100, 8), nn.Linear(8, 50)
        self.tables = nn.ModuleList(nn.Embedding(n, 8) for n in (400, 200, 64))

    def forward(self, ids, rows, lengths):
        h = self.tok(ids.view(-1, ids.shape[-1]).contiguous())
        h = h + sum(t(rows[:, i]) for i, t in enumerate(self.tables)).unsqueeze(1)
        return self.head(h) * lengths.float().mean()


def test_bounds_follow_values_to_tables_and_targets():
    """The bound of an input is the fewest rows (or classes) its values reach, through the calls that keep them
    (view, contiguous, the default loss's slice and flatten): ids 50, the head's classes (ids beyond would fail
    the loss); the columns of ``rows`` 64, the smallest of their tables; ``lengths``, used in arithmetic only,
    the model's smallest table, as before."""
    with torch.device("meta"):
        model = Lookups()
        example = (torch.randint(0, 50, (2, 6)), torch.randint(0, 64, (2, 3)), torch.randint(0, 6, (2,)))
    assert id_ranges(model, example, loss_fn=functools.partial(default_loss, causal=True)) == (50, 64, 64)
    # no loss: the tables alone
    assert id_ranges(model, example)[0] == 100

    class FailsLate(Lookups):
        def forward(self, ids, rows, lengths):
            out = super().forward(ids, rows, lengths)
            return out[: int(lengths.max())]  # .item() on meta: the lookups before it still count

    with torch.device("meta"):
        late = FailsLate()
    assert id_ranges(late, example)[0] == 100
