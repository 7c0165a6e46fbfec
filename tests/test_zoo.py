"""The models people bring, end to end (issue: "the models people bring"): twenty-six families built from Hugging
Face configs with their default flags, and a CNN, go through capture + plan, verify of the planner's plan, of ``tp=2``
and of ``dp=2,zero=3``, and export + torchrun (tests/families.py; the verify cases of each half of the families in one
launch of 2 processes, and their exported scripts in one torchrun launch, so that each half stays within the per-test
timeout on a loaded machine)."""

from __future__ import annotations

import pytest
from families import (
    BRINGS,
    CAPABILITIES,
    FAMILIES,
    README,
    REFUSED,
    STEPS,
    capabilities,
    capability_markdown,
    markdown,
    readme_section,
    run_matrix,
    steps_table,
)
from runtime_cases import has_transformers

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


def test_the_readme_lists_every_family_of_the_matrix():
    """The README's family tables are made from this matrix (``families.py --readme``, issue 40): the steps table is
    what :func:`test_every_family_runs_every_step` asserts, row for row, and the capability table has a row for every
    family, in order. A family added to tests/families.py fails here until the README is written again."""
    assert set(BRINGS) == set(FAMILIES)
    text = README.read_text()
    assert readme_section(text, "steps") == steps_table()
    rows = [line.split(" | ")[0].strip("| ") for line in readme_section(text, "capabilities").splitlines()
            if line.startswith("| ")][1:]
    assert rows == list(FAMILIES)


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


@pytest.mark.skipif(not has_transformers(), reason="transformers not installed")
def test_every_linear_tp_leaves_whole_says_why():
    """Under ``tp=2`` every Linear (or Conv1D) of every family that the plan leaves whole inside a layer it splits
    (or in a model it splits nowhere) has a reason in words, and ``explain()`` prints it (issue 40: "TP leaves
    attention unsplit with no reason")."""
    from IPython.core.interactiveshell import InteractiveShell

    from autopar_nb.cost.profile.driver import profile
    from autopar_nb.planner.explain import whole_notes, whole_under_tp

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "autopar_nb")
    seen = {}
    for name, cell in FAMILIES.items():
        session = ip.run_cell_magic("autoparallel", "--gpu cpu --gpus 2 --batch 4 --name zoo_session", cell)
        try:
            plan = session.replan(fix={"tp": 2})
        except Exception as e:  # a model TP has nothing to split in says so (the CNN)
            assert "no Linear/Embedding that TP can split" in str(e), (name, e)
            continue
        prof = profile(session.graph, device_kind="cpu")
        whole = whole_under_tp(plan, prof)
        linear = {n.module_path for n in session.graph.nodes if n.params and n.op_class == "matmul" and
                  n.module_type in ("Linear", "Conv1D")}
        # "shared" (MLA's kv_a_proj_with_mqa) and "per_head" modules are whole by a layout explain() describes
        split = {m for lp in plan.layers for m, st in lp.tp.items() if st != "replicate"}
        for lp in plan.layers:
            if not lp.tp:
                continue
            for m in linear - split:
                if m.startswith(lp.path + ".") or m == lp.path:
                    pattern = m if m == lp.path else ".".join("*" if p.isdigit() else p for p in m.split("."))
                    assert whole.get(pattern, "") not in ("", "no cause recorded"), (name, m, whole)
        if whole:
            assert "Kept whole under TP: " in plan.explain(), name
            assert " whole: " in "".join(whole_notes(session.graph, plan).values()), name  # the widget's table
        seen[name] = whole
    print("\n".join(f"{name}: {whole}" for name, whole in seen.items() if whole))
    assert not any("query_key_value" in m for m in seen.get("Falcon", {})), seen.get("Falcon")
