"""The models people bring, end to end (issue: "the models people bring"): twenty-five families built from Hugging
Face configs with their default flags, and a CNN, go through capture + plan, verify of the planner's plan, of ``tp=2``
and of ``dp=2,zero=3``, and export + torchrun (tests/families.py; the verify cases of each half of the families in one
launch of 2 processes, so that each half stays within the per-test timeout on a loaded machine)."""

from __future__ import annotations

import pytest
from families import CAPABILITIES, FAMILIES, STEPS, capabilities, capability_markdown, markdown, run_matrix
from runtime_cases import has_transformers

REFUSED = {("CNN + BatchNorm", "verify tp=2"): "no Linear/Embedding that TP can split"}
"""what may be refused, and the reason the refusal must give (a CNN has nothing TP splits)"""


HALVES = {"first": list(FAMILIES)[:len(FAMILIES) // 2], "second": list(FAMILIES)[len(FAMILIES) // 2:]}


@pytest.mark.multiprocess
@pytest.mark.skipif(not has_transformers(), reason="transformers not installed")
@pytest.mark.parametrize("half", HALVES)
def test_every_family_runs_every_step(tmp_path, half):
    names = HALVES[half]
    table = run_matrix(names, tmp_path)
    print(markdown(table, names))
    for name in names:
        for step in STEPS:
            got = table.get((name, step), "not run")
            if (name, step) in REFUSED:
                assert REFUSED[(name, step)] in got, (name, step, got)
            else:
                assert got == "ok", (name, step, got)


@pytest.mark.skipif(not has_transformers(), reason="transformers not installed")
def test_what_each_family_gets_is_generated_from_the_planner():
    """The README's family table (issue 40): what TP splits inside a block, SP, PP, EP, CP, as the planner gives it;
    a decoder gets everything but EP, an MoE gets EP, a CNN has nothing for TP and says so."""
    table = capabilities(["LLaMA", "Mixtral", "CNN + BatchNorm"])
    print(capability_markdown(table))
    assert all(table["LLaMA"][c] == "✓" for c in CAPABILITIES if c != "EP") and "no experts" in table["LLaMA"]["EP"]
    assert table["Mixtral"]["EP"] == "✓" and table["Mixtral"]["TP: attention"] == "✓"
    assert table["CNN + BatchNorm"]["TP: attention"] == "✗ the model has no Linear/Embedding that TP can split"
    assert table["CNN + BatchNorm"]["PP"] == "✓"
