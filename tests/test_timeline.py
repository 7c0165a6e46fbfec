"""The memory timeline of one step (autopar_nb/planner/timeline.py): the cost model's moments of each pipeline rank, in
the order the step runs them, whose largest is the plan's predicted peak."""

import pytest
import torch

import autopar_nb as ap
from autopar_nb.units import fmt_bytes
from autopar_nb.zoo import GPT, GPTConfig

CFG = GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_head=2, n_embd=64)


@pytest.fixture(scope="module")
def graph():
    return ap.capture(GPT(CFG), torch.randint(0, 256, (8, 32)))


def _plan(graph, schedule="1f1b", micro_batches=4):
    cluster = ap.Cluster.preset("cpu", 1, 2)
    return ap.plan(graph, cluster, global_batch=8, fix={"pp": 2, "dp": 1, "tp": 1, "micro_batches": micro_batches,
                                                        "schedule": schedule})


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved_1f1b"])
def test_the_timelines_largest_moment_is_the_plans_peak_on_each_rank(graph, schedule):
    """On each rank of a pp=2 plan the timeline's largest moment is the plan's predicted peak for the rank without
    its allocator margin (the figure a launched run's measured peak compares with), the margin it carries is the
    plan's, and ``rank=None`` picks the rank with the largest peak."""
    plan = _plan(graph, schedule)
    mem = plan.cost.memory_by_rank
    assert len(mem) == 2
    lines = [ap.memory_timeline(plan, graph, rank=r) for r in range(2)]
    for r, (tl, mb) in enumerate(zip(lines, mem, strict=True)):
        assert tl.rank == r and tl.ranks == 2 and len(tl) > 4
        assert max(m.bytes for m in tl) == pytest.approx(mb.total - mb.margin), (schedule, r)
        assert tl[tl.peak].bytes == tl.peak_bytes == max(m.bytes for m in tl)
        assert tl.margin == pytest.approx(mb.margin)
        for m in tl:  # a moment names its largest components, largest first, none more than it holds
            assert 1 <= len(m.terms) <= 3 and [b for _, b in m.terms] == sorted((b for _, b in m.terms), reverse=True)
            assert sum(b for _, b in m.terms) <= m.bytes * (1 + 1e-9)
    top = max(range(2), key=lambda r: mem[r].total - mem[r].margin)
    assert ap.memory_timeline(plan, graph).rank == top
    with pytest.raises(ValueError, match="pp=2, ranks 0 to 1"):
        ap.memory_timeline(plan, graph, rank=2)


def test_the_moments_run_in_the_steps_order(graph):
    """A one-stage-per-rank schedule's moments come as the step runs them: the forwards from the first layer, the
    loss (last rank only), the backwards from the last layer (each layer's recompute before its backward), the
    optimizer step last; the first micro-batch's before a later one's."""
    plan = _plan(graph, "1f1b")
    paths = [lay.path for lay in graph.layers]
    first, last = (ap.memory_timeline(plan, graph, rank=r) for r in range(2))
    for tl in (first, last):
        labels = [m.label for m in tl]
        assert labels[-1] == "optimizer step" and labels[0].startswith("forward")
        fwd = [paths.index(lab.split()[1]) for lab in labels if lab.startswith("forward")]
        bwd = [paths.index(lab.split()[1]) for lab in labels if lab.startswith("backward")]
        assert fwd == sorted(fwd) and bwd == sorted(bwd, reverse=True) and fwd and bwd
        assert max(i for i, lab in enumerate(labels) if lab.startswith("forward")) < min(
            i for i, lab in enumerate(labels) if lab.startswith("backward"))
    assert "loss" in [m.label for m in last] and "loss" not in [m.label for m in first]
    loss = [m.label for m in last].index("loss")
    assert all(not m.label.startswith("backward") for m in last[:loss])


def test_the_text_rendering_marks_the_peak_and_names_its_terms(graph):
    plan = _plan(graph, "1f1b")
    tl = ap.memory_timeline(plan, graph)
    text = str(tl)
    lines = text.splitlines()
    assert lines[0].startswith(f"Predicted memory over one step, pipeline rank {tl.rank} of 2")
    assert len(lines) == len(tl) + 2
    (marked,) = [line for line in lines if line.endswith("◀ peak")]
    p = tl[tl.peak]
    assert marked.startswith(p.label) and fmt_bytes(p.bytes) in marked
    name, size = p.terms[0]
    assert lines[-1].startswith(f"peak {fmt_bytes(p.bytes)} at {p.label}: {name} {fmt_bytes(size)}")
    # the session's call is the same timeline, for the plan shown
    from autopar_nb.session import Session
    from autopar_nb.source import ModelSource

    s = Session(graph, ap.Cluster.preset("cpu", 1, 2), ModelSource("# test"))
    s.plan = plan
    assert [tuple(m) for m in s.memory_timeline()] == [tuple(m) for m in tl]
