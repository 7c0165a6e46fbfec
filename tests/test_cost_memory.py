"""Memory model: ZeRO paper figures, Korthikanti et al. activation formulas, and saved-tensor measurement."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar_nb as ap
from autopar_nb import zoo
from autopar_nb.cost import MIXED_ADAM, TORCH_ADAM, activation_bytes, in_flight, model_states, profile

GB = 1e9


# ---- ZeRO (Rajbhandari et al. 2020, Figure 1 / Table 1): 7.5B parameters, DP = 64, mixed-precision Adam (K = 12)
@pytest.mark.parametrize("stage, paper_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_model_states(stage, paper_gb):
    total = sum(model_states(7.5e9, dp=64, zero_stage=stage, states=MIXED_ADAM)) / GB
    # the paper prints one decimal: ZeRO-3 is (2 + 2 + 12) * 7.5e9 / 64 = 1.875 GB, printed as 1.9
    assert abs(round(total, 1) - paper_gb) / paper_gb <= 0.01
    closed_form = {0: 16 * 7.5, 1: 4 * 7.5 + 12 * 7.5 / 64, 2: 2 * 7.5 + 14 * 7.5 / 64, 3: 16 * 7.5 / 64}[stage]
    assert total == pytest.approx(closed_form, rel=1e-12)


def test_torch_layout_same_total_different_split():
    # PyTorch keeps fp32 params and grads (4 + 4) and Adam m, v (8): same 16 bytes/param unsharded
    assert sum(model_states(7.5e9, dp=64, zero_stage=0, states=TORCH_ADAM)) == pytest.approx(120e9)
    p, g, o = model_states(7.5e9, dp=64, zero_stage=1, states=TORCH_ADAM)
    assert (p, g, o) == (30e9, 30e9, 60e9 / 64)


def test_more_gpus_never_raise_per_rank_model_states():
    for states in (MIXED_ADAM, TORCH_ADAM):
        for stage in range(4):
            prev = None
            for dp in (1, 2, 3, 4, 8, 16, 64, 1024):
                cur = model_states(1e9, dp=dp, zero_stage=stage, states=states)
                if prev is not None:
                    assert all(c <= p for c, p in zip(cur, prev, strict=True))
                prev = cur


# ---- Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", sec. 4-5 ----------
class KorthikantiLayer(nn.Module):
    """The paper's GPT layer: explicit attention with dropout on the scores, dropout after both blocks."""

    def __init__(self, h: int, a: int, s: int, p: float = 0.1):
        super().__init__()
        self.a = a
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        # separate q/k/v, as the paper counts them (a fused [q | k | v] Linear is split part by part: the same)
        self.q, self.k, self.v, self.proj = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        self.fc, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
        self.drop_attn, self.drop1, self.drop2 = nn.Dropout(p), nn.Dropout(p), nn.Dropout(p)
        self.register_buffer("mask", torch.tril(torch.ones(s, s, dtype=torch.bool)).view(1, 1, s, s))

    def forward(self, x):
        B, T, C = x.shape
        y = self.ln1(x)
        q, k, v = self.q(y), self.k(y), self.v(y)
        q, k, v = (t.view(B, T, self.a, -1).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.shape[-1]))
        att = self.drop_attn(att.masked_fill(~self.mask[:, :, :T, :T], float("-inf")).softmax(-1))
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + self.drop1(self.proj(y))
        return x + self.drop2(self.fc2(F.gelu(self.fc(self.ln2(x)))))


S, B, H, A = 1024, 2, 1024, 16


@pytest.fixture(scope="module")
def kprof():
    with torch.device("meta"):
        model = nn.Sequential(KorthikantiLayer(H, A, S)).to(torch.bfloat16)
    graph = ap.capture(model, torch.empty(B, S, H, dtype=torch.bfloat16, device="meta"))
    return profile(graph, device_kind="cuda")


def _act(prof, **kw):
    return sum(activation_bytes(lp, scale=1.0, **kw) for lp in prof.layers)


def test_korthikanti_no_parallelism(kprof):
    sbh = S * B * H
    assert _act(kprof, tp=1, sp=False, recompute="none") == pytest.approx(sbh * (34 + 5 * A * S / H), rel=0.05)


@pytest.mark.parametrize("t", [2, 4, 8])
def test_korthikanti_tensor_parallel(kprof, t):
    sbh = S * B * H
    want = sbh * (10 + 24 / t + 5 * A * S / (H * t))
    assert _act(kprof, tp=t, sp=False, recompute="none") == pytest.approx(want, rel=0.05)


@pytest.mark.parametrize("t", [2, 4, 8])
def test_korthikanti_sequence_parallel(kprof, t):
    sbh = S * B * H
    megatron = _act(kprof, tp=t, sp=True, recompute="none", megatron_sp=True)
    assert megatron == pytest.approx(sbh / t * (34 + 5 * A * S / H), rel=0.05)
    # Systematic difference, by design: PyTorch's DTensor (what the runtime uses) all-gathers the sequence-sharded
    # input of each colwise Linear before the matmul, and autograd saves the gathered tensor. Megatron-LM saves the
    # shard and gathers again in backward. Two such inputs per layer (qkv and fc), 2sbh bytes each.
    dtensor = _act(kprof, tp=t, sp=True, recompute="none")
    assert dtensor - megatron == pytest.approx(2 * 2 * sbh * (1 - 1 / t), rel=1e-6)


@pytest.mark.parametrize("t", [1, 2, 8])
def test_selective_recompute_as_the_runtime_applies_it(kprof, t):
    """Not Korthikanti's 34 sbh / t (Megatron drops the attention scores and keeps the rest): runtime/ac.py's
    policy (torchtitan's) keeps the layer's input, the attention's batched matmuls and every other weight matmul's
    output (q, the scores q @ k^T, att @ v, v, fc: 2 + 2 + 2as/h + 2 + 8 sbh bytes in bf16) and recomputes k, proj,
    fc2, the norms, softmax, dropout and GELU. Under TP with SP all of it is split."""
    sbh = S * B * H
    got = _act(kprof, tp=t, sp=t > 1, recompute="selective")
    assert got == pytest.approx(sbh * (16 + 2 * A * S / H) / t, rel=0.05)


def test_korthikanti_full_recompute(kprof):
    assert _act(kprof, tp=1, sp=False, recompute="full") == pytest.approx(2 * S * B * H, rel=0.05)


def test_korthikanti_residual_is_small(kprof):
    # what the formula leaves out: LayerNorm mean/rstd (fp32, 2 x 2 x 4 bytes per token) and the boolean mask;
    # it must stay far below the 5% tolerance, so the comparison above is about the formula, not slack
    sbh = S * B * H
    got = _act(kprof, tp=1, sp=False, recompute="none")
    assert abs(got / (sbh * (34 + 5 * A * S / H)) - 1) < 0.005


# ---- measured: bytes autograd saves during a real CPU forward ------------------------------------------------------
def measured_saved_bytes(model: nn.Module, inputs: tuple) -> int:
    """Unique storages packed by autograd (parameters and buffers excluded), in bytes."""
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in own:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*inputs)
    return sum(seen.values())


def _gpt_block():
    block = zoo.GPTBlock(zoo.GPTConfig(n_embd=128, n_head=4, dropout=0.1))
    # CPU scaled_dot_product_attention with dropout falls back to the math kernel, which materialises the scores;
    # the model assumes a fused kernel (what CUDA runs), so attention dropout is off here (residual dropout stays on)
    block.attn.dropout = 0.0
    return block, (torch.randn(4, 64, 128),)


class _StackedExperts(nn.Module):
    """Weights used through views of the parameter, as Hugging Face MoE experts use ``weight.transpose(-2, -1)``:
    the views are the parameters' storage, not activations."""

    def __init__(self, experts: int = 4, dim: int = 64, hidden: int = 128):
        super().__init__()
        self.up = nn.Parameter(torch.randn(experts, hidden, dim) / dim**0.5)
        self.down = nn.Parameter(torch.randn(experts, dim, hidden) / hidden**0.5)
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x):  # (experts, tokens, dim)
        h = torch.nn.functional.silu(torch.bmm(x, self.up.transpose(-2, -1)))
        return torch.bmm(h, self.down.transpose(-2, -1)) * self.scale.view(1, 1, -1)


MEASURED_CASES = {
    "mlp": lambda: (nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.GELU(),
                                  nn.Linear(512, 10)), (torch.randn(64, 256),)),
    "gpt_block": _gpt_block,
    "llama": lambda: (zoo.Llama(zoo.LlamaConfig(vocab_size=1000, dim=128, n_layers=2, n_heads=4, n_kv_heads=2,
                                                ffn_dim=256)), (torch.randint(0, 1000, (4, 64)),)),
    "resnet_bn": lambda: (zoo.ResNet(), (torch.randn(8, 3, 32, 32),)),
    "recsys_embedding": lambda: (zoo.RecSys(table_sizes=(1000, 500, 100), dim=16),
                                 (torch.randn(32, 13), torch.randint(0, 100, (32, 3)))),
    "parameter_views": lambda: (_StackedExperts(), (torch.randn(4, 32, 64),)),
}


@pytest.mark.parametrize("name", list(MEASURED_CASES))
def test_saved_activations_match_measurement(name):
    torch.manual_seed(0)
    model, inputs = MEASURED_CASES[name]()
    model.train()
    measured = measured_saved_bytes(model, inputs)
    graph = ap.capture(model, inputs)
    prof = profile(graph, device_kind="cpu")
    predicted = sum(activation_bytes(lp, tp=1, sp=False, recompute="none", scale=1.0)
                    for lp in prof.layers)
    assert predicted == pytest.approx(measured, rel=0.05), (name, predicted, measured)


class _Eager(nn.Module):
    """Wraps a model so torch.export fails (a data pointer) and capture records one eager forward: dispatch-level
    ops (native_layer_norm, native_batch_norm, mm/addmm, the CPU flash-attention kernel)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        _aligned = args[0].data_ptr() % 16 == 0
        return self.inner(*args)


@pytest.mark.parametrize("name", ["gpt_block", "llama", "resnet_bn"])
def test_saved_activations_match_measurement_when_recorded_eagerly(name):
    torch.manual_seed(0)
    model, inputs = MEASURED_CASES[name]()
    model.train()
    measured = measured_saved_bytes(model, inputs)
    with pytest.warns(UserWarning, match="torch.export could not trace"):
        graph = ap.capture(_Eager(model), inputs)
    assert graph.tracer == "fx"
    prof = profile(graph, device_kind="cpu")
    predicted = sum(activation_bytes(lp, tp=1, sp=False, recompute="none", scale=1.0)
                    for lp in prof.layers)
    assert predicted == pytest.approx(measured, rel=0.02), (name, predicted, measured)


# ---- micro-batches in flight (Narayanan et al. 2021) ---------------------------------------------------------------
def test_in_flight_by_schedule():
    assert in_flight("gpipe", pp=4, stage=0, micro_batches=16) == 16
    assert [in_flight("1f1b", pp=4, stage=r, micro_batches=16) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight("1f1b", pp=4, stage=0, micro_batches=2) == 2
    assert in_flight("1f1b", pp=1, stage=0, micro_batches=8) == 1
    # interleaved: rank 0 holds (v - 1) pp + 2 (pp - 1) + 1 chunk-forwards of 1/v of its layers
    assert in_flight("interleaved_1f1b", pp=4, stage=0, micro_batches=16, virtual_stages=2) == pytest.approx(
        (4 + 6 + 1) / 2)



def test_in_flight_of_a_multi_stage_rank_reads_its_states_once(monkeypatch):
    """The search asks every rank's in-flight micro-batches of each candidate it costs, floors and bounds: a
    multi-stage rank's are read from its states once, the same figure after."""
    from autopar_nb.cost import memory, schedule

    walked = []

    def counted(*args, **kw):
        walked.append(kw)
        return schedule.rank_states(*args, **kw)

    memory._most_held.cache_clear()
    monkeypatch.setattr(memory, "rank_states", counted)
    first = in_flight("interleaved_1f1b", pp=4, stage=1, micro_batches=8, virtual_stages=2)
    again = in_flight("interleaved_1f1b", pp=4, stage=1, micro_batches=8, virtual_stages=2)
    states = schedule.rank_states("interleaved_1f1b", pp=4, rank=1, micro_batches=8, virtual_stages=2)
    assert first == again == max((sum(h.full) + sum(h.waiting) + 1) / 2 for h in states if h.kind in "BIW")
    assert len(walked) == 1


def _torch_actions(schedule: str, *, pp: int, rank: int, micro_batches: int,
                   virtual_stages: int) -> list:
    """torch's own compute actions for ``rank`` (its ``_calculate_single_rank_operations``, which
    needs neither stages nor a process group) as (local stage, kind, micro-batch)."""
    from torch.distributed.pipelining import schedules as S

    cls = {"interleaved_1f1b": S.ScheduleInterleaved1F1B, "looped_bfs": S.ScheduleLoopedBFS,
           "interleaved_zero_bubble": S.ScheduleInterleavedZeroBubble,
           "zbv_zero_bubble": S.ScheduleZBVZeroBubble}[schedule]
    m, v = micro_batches, virtual_stages
    sch = object.__new__(cls)
    sch.pp_group_size, sch.n_local_stages, sch._n_microbatches, sch.num_stages = pp, v, m, pp * v
    sch.number_of_rounds = max(1, m // pp)
    sch.microbatches_per_round = m // sch.number_of_rounds
    sch._stages = [None] * v
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
    local = (lambda st: int(st != rank)) if schedule == "zbv_zero_bubble" else (lambda st: st // pp)
    return [(local(a.stage_index), kinds[a.computation_type.name], a.microbatch_index)
            for a in sch._calculate_single_rank_operations(rank) if a is not None]


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble",
                                      "zbv_zero_bubble"])
def test_multi_stage_schedules_run_torchs_order(schedule):
    """The cost model walks a multi-stage rank's actions in the order torch's schedule runs them."""
    from autopar_nb.cost.schedule import rank_actions

    for pp in (2, 3, 4):
        for m in (2, 3, 4, 8):
            for v in (2,) if schedule == "zbv_zero_bubble" else (2, 3):
                if schedule.startswith("interleaved") and m % max(1, m // pp):
                    continue  # torch refuses these
                for rank in range(pp):
                    kw = {"pp": pp, "rank": rank, "micro_batches": m, "virtual_stages": v}
                    ours = [tuple(a) for a in rank_actions(schedule, **kw)]
                    assert ours == _torch_actions(schedule, **kw), kw


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble"])
def test_rank_states_keeps_exactly_the_undominated_states(schedule):
    """``rank_states`` (walked as arrays) keeps the states the one-action-at-a-time walk (``_Walk``) notes, less
    those another of the same stage, kind, gradients, units and ``later`` holds at least as many micro-batches
    everywhere (pairwise, here), by group in the order each first appears and within one in descending order of
    the counts; 32 micro-batches make groups of more than 16 states, 2 of one, 7 on 3 ranks micro-batches past the
    last (the walk's fallback). Its arrays (``state_arrays``) are those made afresh from the states."""
    import numpy as np

    from autopar_nb.cost import schedule as sched

    for pp, m in ((2, 2), (4, 8), (4, 32), (3, 7)):
        v = 2
        for rank in range(pp):
            walk = sched._Walk(v)
            for a in sched.rank_actions(schedule, pp=pp, rank=rank, micro_batches=m, virtual_stages=v):
                walk.run(a, first=rank == 0 and a.local == 0, last_mb=m - 1)
            groups: dict[tuple, list[tuple]] = {}
            for h in dict.fromkeys(walk.out):
                groups.setdefault((*h[:2], *h[6:]), []).append(h)
            want = []
            for alike in groups.values():
                counts = {h: sum(h[2:6], ()) for h in alike}
                want += sorted((h for h in alike if not any(
                    o != h and all(x >= y for x, y in zip(counts[o], counts[h], strict=True)) for o in alike)),
                    key=counts.get, reverse=True)
            got = sched.rank_states(schedule, pp=pp, rank=rank, micro_batches=m, virtual_stages=v)
            assert got == tuple(want)
            def types(states):
                return [type(x) for h in states for f in h[2:9] for x in f]

            assert types(got) == types(want)
            made = sched.state_arrays(got)
            sched._ARRAYS.clear()
            for name, x, y in zip(made._fields, made, sched.state_arrays(got), strict=True):
                assert np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y, name


def test_a_multi_stage_rank_holds_each_stages_micro_batches():
    """Interleaved 1F1B over 2 ranks x 2 stages, 4 micro-batches: rank 0 runs 0F0 0F1 2F0 2F1 0F2
    2B0 0F3 2B1 2F2 0B0 2F3 0B1 ...; at 0B1 its stage 0 holds micro-batches 2 and 3 besides the
    running one, its stage 2 holds 2 and 3 (the tracker's peak, LLaMA). ZBV: rank 1 (stages 1 and
    2) runs its cool-down's input passes 1I2 2I3 1I3 before their weight passes: at 1I3 stage 1's
    micro-batch 2 and stage 2's 3 wait for theirs, keeping their activations and the gradients
    hooked for them."""
    from autopar_nb.cost.schedule import rank_states

    interleaved = rank_states("interleaved_1f1b", pp=2, rank=0, micro_batches=4, virtual_stages=2)
    assert any(h.local == 0 and h.kind == "B" and h.full == (2, 2) and h.later for h in interleaved)
    zbv = rank_states("zbv_zero_bubble", pp=2, rank=1, micro_batches=4, virtual_stages=2)
    assert any(h.local == 0 and h.kind == "I" and h.full == (0, 0) and h.waiting == (1, 1)
               for h in zbv)
    # by 0B1 both stages forwarded all 4
    assert max(h.forwarded for h in interleaved if h.local == 0 and h.kind == "B") == (4, 4)


@pytest.mark.parametrize("schedule, tracked", [("interleaved_1f1b", (69.9, 60.3)),
                                               ("zbv_zero_bubble", (77.9, 65.7))])
def test_multi_stage_ranks_peak_as_the_tracker_measured(schedule, tracked):
    """LLaMA (tests/memcells.py, hidden 256, 4 layers, seq 256, batch 8) over 2 ranks x 2 stages,
    4 micro-batches, fp32: each rank's peak within 2 % of MemTracker's on real gloo processes (MiB;
    ``bench/memory.py LLaMA --plans pp-interleaved,pp-zbv``, torch 2.13). Each stage holds its own
    micro-batches in flight (``cost/staged.py``), an input gradient a stage sent stays referenced
    by its send until a lower stage of the rank runs that micro-batch's backward (the rank's lowest
    stage's to the step's end: ``runtime/pp.py`` ``Sends``; torch's schedule kept every send, outputs
    too, to the step's end: 72.5 / 62.3 and 78.9 / 67.2 MiB), and a zero-bubble input pass keeps the micro-batch's
    activations and the gradients its weight pass starts from (``weight_pass_gradients``). Without
    these the model was -2.4 % / -3.3 % (interleaved) and -9.8 % / -35.9 % (ZBV)."""
    from memcells import CELLS

    from autopar_nb.cost import estimate
    from autopar_nb.source import ModelSource

    cell = CELLS["LLaMA"](hidden=256, layers=4, seq=256, batch=8)
    meta, example, _ = ModelSource(cell).build(device="meta")
    graph = ap.capture(meta, example)
    cluster = ap.Cluster.preset("cpu", 1, 2)
    plan = ap.plan(graph, cluster, global_batch=8,
                   fix={"dp": 1, "tp": 1, "pp": 2, "micro_batches": 4, "schedule": schedule,
                        "virtual_stages": 2, "amp": "none", "recompute": "none"})
    for mb, mib in zip(estimate(graph, cluster, plan).memory_by_rank, tracked, strict=True):
        assert (mb.total - mb.margin) / 2**20 == pytest.approx(mib, rel=0.02), (schedule, mb.terms)
    if schedule == "zbv_zero_bubble":
        assert mb.terms["weight_pass_gradients"] > 0


def test_pipeline_outputs_are_those_of_the_micro_batches_in_flight_at_the_peak():
    """A stage keeps each micro-batch's output from its forward to its backward (runtime/pp.py's LeanStage). The
    first rank of 1F1B over 2 stages and 2 micro-batches runs F0 F1 B0 B1: during B0 both outputs are kept, during
    B1 only the second. Under full recompute its peak is B1's (every gradient alive, one checkpoint set), so it holds
    one output there, not one per micro-batch of the schedule (measured: GPT-NeoX's first rank predicted +6.2 % with
    both, +3.7 % with one; bench/memory.py --plans pp --recompute full)."""
    from autopar_nb.cost import estimate

    cfg = zoo.GPTConfig(n_layer=4, n_head=4, n_embd=64, vocab_size=256, block_size=32)
    with torch.device("meta"):
        graph = ap.capture(zoo.GPT(cfg), torch.randint(0, 256, (8, 32)))
    cluster = ap.Cluster.preset("cpu", 1, 2)
    one_output = 4 * 32 * 64 * 4  # a micro-batch of 4 sequences of 32, hidden 64, float32
    for recompute, outputs in (("full", 1), ("none", 2)):  # none: B0's, both micro-batches' activations alive
        plan = ap.plan(graph, cluster, global_batch=8, fix={"pp": 2, "micro_batches": 2, "schedule": "1f1b",
                                                            "recompute": recompute, "dp": 1, "tp": 1})
        first = estimate(graph, cluster, plan).memory_by_rank[0]
        assert first.terms["pipeline_outputs"] == pytest.approx(outputs * one_output), (recompute, first.terms)
        if outputs == 1:  # B1: every gradient of the stage alive
            assert first.grads == pytest.approx(first.params), first
        else:  # B0: the gradients of the layers after the one in backward only
            assert first.grads < first.params, first


class _Skip(nn.Module):
    """h = a(x) is read by b and, after c, by the skip add: autograd accumulates h's gradient from the add's
    backward (through c's, b's) until a's. (c's output is scaled: its gradient is then a tensor of its own, not the
    add's, which h's shares.)"""

    def __init__(self, d: int = 16):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        h = self.a(x)
        return 2 * self.c(self.b(h)) + h


def test_backward_moments_hold_the_gradients_still_accumulating():
    """At c's backward, h's gradient (begun by the skip add's backward) is alive beside c's own; at b's, b's new
    gradient for h is added to it out of place, so the accumulated one, the new one and their sum are alive at once
    (the census of T5's decoder backward shows the encoder output's so: ``bench/memory.py --largest``). Tensors read
    only by the next op (b's output at c) hold no gradient yet; a's moment is past h's last reader."""
    from autopar_nb.cost.profile import _accumulating_gradients, _facts

    graph = ap.capture(_Skip(), torch.randn(4, 8, 16))
    f = _facts(graph, {}, "cpu")
    acc = _accumulating_gradients(f)
    linear = {n.module_path: n.name for n in graph.nodes if n.op_class == "matmul"}
    h = f.size[linear["a"]].nbytes
    assert h == 4 * 8 * 16 * 4
    assert sum(s.nbytes for s in acc[linear["c"]]) == h
    assert sum(s.nbytes for s in acc[linear["b"]]) == 2 * h
    assert linear["a"] not in acc


class _Parallel(nn.Module):
    """A parallel residual (GPT-NeoX): h = a(x) feeds b and c, and out = (b(h) + c(h)) + h."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        h = self.a(x)
        return (self.b(h) + self.c(h)) + h


def test_gradients_an_add_hands_on_are_one_storage():
    """Both adds' backward hand their output's gradient G itself to their operands: at c's backward, c's output,
    b's output and h all have G as their gradient (one storage, c's own), so what accumulates is only the sum c's
    new gradient for h goes into; at b's, h's gradient is that sum (a storage of its own) beside the next sum."""
    from autopar_nb.cost.profile import _accumulating_gradients, _facts

    graph = ap.capture(_Parallel(), torch.randn(4, 8, 16))
    acc = _accumulating_gradients(_facts(graph, {}, "cpu"))
    linear = {n.module_path: n.name for n in graph.nodes if n.op_class == "matmul"}
    h = 4 * 8 * 16 * 4
    assert sum(s.nbytes for s in acc[linear["c"]]) == h
    assert sum(s.nbytes for s in acc[linear["b"]]) == 2 * h


class _TiedLM(nn.Module):
    """An embedding, two blocks and a head tied to the embedding's weight (GPT-2, BERT, T5 by default)."""

    def __init__(self, vocab: int = 64, d: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(2))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        h = self.emb(idx)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


@pytest.mark.parametrize("pp, pending", [(1, True), (2, False)])
def test_a_tied_heads_gradient_waits_for_the_embeddings_backward(pp, pending):
    """The head's backward gives the tied weight its first gradient, which autograd holds until the embedding's
    backward adds the second: every layer from the embedding up to (not including) the head has the weight's bytes
    pending in its backward (float32). Pipelined with the head on the other stage, that stage's copy of the weight
    gets its own gradient: nothing pending (the census of BERT's tracked peak: the decoder weight's gradient, a
    float32 temporary through the encoder's backward)."""
    from autopar_nb.cost import Evaluator, setting_of
    from autopar_nb.cost.layer_sums import tied_gradients
    from autopar_nb.cost.profile import profile_of

    graph = ap.capture(_TiedLM(), torch.randint(0, 64, (4, 8)))
    cluster = ap.Cluster.preset("cpu", 1, pp)
    fix = {"pp": pp, "dp": 1, "tp": 1, "micro_batches": pp} | ({"schedule": "1f1b"} if pp > 1 else {})
    plan = ap.plan(graph, cluster, global_batch=4, fix=fix)
    s, choices = setting_of(plan)
    tied = tied_gradients(Evaluator(profile_of(graph, "cpu"), cluster), s, choices)
    paths = [lay.path for lay in graph.layers]
    head = paths.index("head")
    if pending:
        assert {paths[i]: b for i, b in tied.items() if b} == dict.fromkeys(paths[:head], 64 * 16 * 4), tied
    else:
        assert choices[0].stage != choices[head].stage and not any(tied.values()), (choices, tied)


def test_a_vocab_split_embeddings_gradient_accumulates_whole_on_a_pipelined_fsdp_stage():
    """DTensor's embedding backward has no vocab-split strategy (torch 2.13 ``embedding_dense_backward_strategy``):
    a rowwise Embedding's weight gradient is Partial, the whole table on each TP rank, and a pipelined FSDP stage
    accumulates it so, in float32, until its reduction lays it out as the parameter. Measured (MemTracker's census,
    ``bench/memory.py GPT-2 --plans zero3-tp-pp --amp bf16 --recompute full --largest 25``): the first stage's
    wte gradient [1024, 256] float32 on each of 2 TP ranks; the model counted [512, 256] and rank 0 was -5.7 %
    (buffers 5.9 / 6.7 MiB). The last stage's tied head copy is a colwise Linear, its gradient split as it is."""
    from memcells import CELLS

    from autopar_nb.cost import Evaluator, setting_of
    from autopar_nb.cost.estimate import peak_moments
    from autopar_nb.cost.profile import profile_of
    from autopar_nb.source import ModelSource

    meta, example, _ = ModelSource(CELLS["GPT-2"](hidden=256, layers=4, seq=256, batch=8)).build(device="meta")
    graph = ap.capture(meta, example)
    cluster = ap.Cluster.preset("cpu", 1, 8)
    plan = ap.plan(graph, cluster, global_batch=16,
                   fix={"dp": 2, "tp": 2, "pp": 2, "zero_stage": 3, "micro_batches": 4, "schedule": "1f1b",
                        "amp": "bf16", "recompute": "full"})
    s, choices = setting_of(plan)
    params = Evaluator(profile_of(graph, "cpu"), cluster).sum_layers(s, choices).params
    reduce = [next(mo[2] for mo in stage if mo[0] == "reduce") for stage in peak_moments(graph, cluster, plan)]
    grads = [mo.terms["fsdp_unsharded_grads"] for mo in reduce]
    assert grads == [(params[0] + 1024 * 256 / 2) * 4, params[1] * 4], (grads, params)


def test_a_multi_stage_ranks_vocab_split_embedding_accumulates_whole_too():
    """The same on a rank holding several stages (``cost/staged.py``): interleaved 1F1B, ZeRO-3 x TP x PP, rank 0
    holds stages 0 (wte) and 2. Stage 0's reduction holds its gradients with wte's whole; stage 2's holds stage
    0's, still accumulating, beside its own."""
    from memcells import CELLS

    from autopar_nb.cost import Evaluator, setting_of
    from autopar_nb.cost.estimate import peak_moments
    from autopar_nb.cost.profile import profile_of
    from autopar_nb.source import ModelSource

    meta, example, _ = ModelSource(CELLS["GPT-2"](hidden=256, layers=4, seq=256, batch=8)).build(device="meta")
    graph = ap.capture(meta, example)
    cluster = ap.Cluster.preset("cpu", 1, 8)
    plan = ap.plan(graph, cluster, global_batch=16,
                   fix={"dp": 2, "tp": 2, "pp": 2, "zero_stage": 3, "micro_batches": 4, "amp": "bf16",
                        "schedule": "interleaved_1f1b", "virtual_stages": 2, "recompute": "none"})
    s, choices = setting_of(plan)
    first, third = Evaluator(profile_of(graph, "cpu"), cluster).sum_layers(s, choices).stages[0]
    assert (first.stage, third.stage, first.whole_grads, third.whole_grads) == (0, 2, 1024 * 256 / 2, 0.0)
    reduce = {mo[2].terms["fsdp_unsharded_grads"] for mo in peak_moments(graph, cluster, plan)[0] if mo[0] == "reduce"}
    held = (first.params + first.whole_grads) * 4
    assert reduce == {held, held + third.params * 4}, (reduce, first, third)


class _Mlp(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class _MlpLM(_TiedLM):
    """:class:`_TiedLM` with MLP blocks: a block saves more than its input."""

    def __init__(self, vocab: int = 64, d: int = 16):
        super().__init__(vocab, d)
        self.blocks = nn.ModuleList(_Mlp(d) for _ in range(2))


def test_a_ranks_peak_is_the_largest_of_its_moments_and_a_recompute_holds_what_it_saves_again():
    """``peak_moments`` lists every moment ``estimate`` weighs (each layer's backward and recompute, the loss, the
    optimizer step): per rank the largest is the predicted peak, term for term. Under full recompute each block's
    recompute holds, beside the earlier layers' kept inputs, every tensor its forward saves re-made (``act['none']``
    minus what the checkpoint keeps) and its output's gradient."""
    from autopar_nb.cost import Evaluator, setting_of
    from autopar_nb.cost.estimate import estimate, peak_moments
    from autopar_nb.cost.layer_sums import tied_gradients
    from autopar_nb.cost.profile import profile_of

    graph = ap.capture(_MlpLM(), torch.randint(0, 64, (4, 8)))
    for pp, rec in ((1, "none"), (1, "full"), (2, "full")):
        cluster = ap.Cluster.preset("cpu", 1, pp)
        fix = {"pp": pp, "dp": 1, "tp": 1, "micro_batches": pp, "recompute": rec} | (
            {"schedule": "1f1b"} if pp > 1 else {})
        plan = ap.plan(graph, cluster, global_batch=4, fix=fix)
        cost = estimate(graph, cluster, plan)
        moments = peak_moments(graph, cluster, plan)
        assert len(moments) == pp
        for r, mb in enumerate(cost.memory_by_rank):
            phases = {ph for ph, _, _ in moments[r]}
            assert "step" in phases and "backward" in phases and ("recompute" in phases) == (rec == "full")
            assert ("loss" in phases) == (r == pp - 1)
            top = max((m for _, _, m in moments[r]), key=lambda m: m.total)
            assert top == mb, (r, top, mb)
        # 1F1B with as many micro-batches as stages: rank 0 runs both forwards before its first backward, so its
        # moments come twice, the first micro-batch's (no gradient of another) and the later one's (every gradient
        # of the first); the last rank's one moment stands for both (PeakMoment.later None)
        per_op = peak_moments(graph, cluster, plan, per_op=True)
        later = [{mo[4] for mo in per_op[r] if mo[0] == "backward"} for r in range(pp)]
        assert later == ([{False, True}, {None}] if pp > 1 else [{None}])
        if pp > 1:
            first, late = (max((mo for mo in per_op[0] if mo[:2] == ("backward", 1) and mo[4] is w),
                               key=lambda mo: mo[2].total) for w in (False, True))
            # the later one holds every gradient, one micro-batch's stage output fewer, and at its heaviest op the
            # weight gradients that op makes beside the accumulated ones (memory.accumulating_op)
            assert late[2].grads > first[2].grads
            assert late[2].terms["pipeline_outputs"] < first[2].terms["pipeline_outputs"]
            assert late[2].terms["new_weight_gradients"] > 0 and "new_weight_gradients" not in first[2].terms
            from autopar_nb.verify.moments import moment_at
            where, paths = "train/backward in Pipe.split_gm.submod_pp_0." + graph.layers[1].path, [
                lay.path for lay in graph.layers]
            assert moment_at(where, paths, per_op[0], micro_batch=0)[4] is False
            assert moment_at(where, paths, per_op[0], micro_batch=1)[4] is True
    # the recompute moment, closed form (pp 1, full): the earlier layers' kept tensors, the block's, all it saves
    # re-made, and the down projection's output (the checkpoint's recompute stops at its last saver, the down
    # projection, once that op has run); beside its output's gradient and the tied weight's pending one. Its
    # backward's largest op has freed what only the ops after it saved
    s, choices = setting_of(ap.plan(graph, ap.Cluster.preset("cpu", 1, 1), global_batch=4,
                                    fix={"pp": 1, "dp": 1, "tp": 1, "recompute": "full"}))
    ev = Evaluator(profile_of(graph, "cpu"), ap.Cluster.preset("cpu", 1, 1))
    block = [lay.path for lay in graph.layers].index("blocks.1")
    terms = [ev.choice_terms(k, s, choices[k]) for k in range(block + 1)]
    lt = terms[-1]
    again = lt.act["none"] - lt.act["full"]
    assert choices[block].recompute == "full" and again > 0
    by = {mo[:2]: mo[2] for mo in ev.rank_moments(s, choices)[0]}
    rec, bwd = by["recompute", block], by["backward", block]
    kept = sum(t.act[ch.recompute] for t, ch in zip(terms, choices, strict=False))
    down = 4 * 8 * 16 * 4  # (batch, seq, d) float32
    assert rec.terms["saved_activations"] == pytest.approx(kept + again + down)
    assert rec.terms["backward_working_set"] == pytest.approx(lt.out_bytes + tied_gradients(ev, s, choices)[block])
    assert rec.terms["saved_activations"] - bwd.terms["saved_activations"] == pytest.approx(lt.freed + down)
    # per op (bench/memory.py's comparison): the layer's moment at each of its ops, the largest one among them
    per_op = ev.rank_moments(s, choices, per_op=True)[0]
    assert [mo[:3] for mo in per_op if mo[3] is None] == ev.rank_moments(s, choices)[0]
    at_ops = [mo[2] for mo in per_op if mo[:2] == ("backward", block) and mo[3] is not None]
    assert len(at_ops) == len(lt.op_deltas) > 1
    assert max(m.total for m in at_ops) == pytest.approx(bwd.total)


def test_a_layers_forward_holds_what_it_saved_so_far_and_the_storages_still_read():
    """The forward moment (no recompute, pp 1): at the last block's residual add, every earlier layer's saved
    tensors, the block's own (its input, the up projection's output, the GELU's), and the storages alive that
    nothing saves — the down projection's output, which the add reads, and the add's output —; no gradient exists
    yet in the step's first forward. Under full recompute the recompute's moments are cut at the layer's last saver
    and leave out the input its checkpoint keeps (memory.forward_peak)."""
    from autopar_nb.cost import Evaluator, setting_of
    from autopar_nb.cost.memory import forward_peak
    from autopar_nb.cost.profile import profile_of

    graph = ap.capture(_MlpLM(), torch.randint(0, 64, (4, 8)))
    cluster = ap.Cluster.preset("cpu", 1, 1)
    s, choices = setting_of(ap.plan(graph, cluster, global_batch=4,
                                    fix={"pp": 1, "dp": 1, "tp": 1, "recompute": "none"}))
    prof = profile_of(graph, "cpu")
    ev = Evaluator(prof, cluster)
    block = [lay.path for lay in graph.layers].index("blocks.1")
    terms = [ev.choice_terms(k, s, choices[k]) for k in range(block + 1)]
    x = 4 * 8 * 16 * 4  # (batch, seq, d) float32: the block's input, the down projection's output, the add's
    lp = prof.layers[block]
    assert terms[-1].act["none"] == pytest.approx(x + 2 * 4 * x)  # its input, up's output, GELU's output (4 d)
    assert forward_peak(lp, tp=1, sp=False, scale=1.0) == pytest.approx(terms[-1].act["none"] + 2 * x)
    by = {mo[:2]: mo[2] for mo in ev.rank_moments(s, choices)[0]}
    fwd = by["forward", block]
    assert fwd.grads == 0.0
    assert fwd.terms["saved_activations"] == pytest.approx(sum(t.act["none"] for t in terms[:-1]))
    assert fwd.terms["forward_working_set"] == pytest.approx(terms[-1].act["none"] + 2 * x)
    # recomputed: up to the down projection (its output made, the add not run again), less the kept input
    assert forward_peak(lp, tp=1, sp=False, scale=1.0, recompute="full") == pytest.approx(2 * 4 * x + x)


def test_a_tracked_peak_is_matched_to_the_models_moment_there():
    """``moments.moment_at``: the tracker's "<phase>/<side> in <module>" names the moment of the model's that its
    components compare with — a layer's backward or recompute (the layer whose path holds the module: the root's
    name, DDP's ``module``, a pipeline stage's ``Pipe.split_gm.submod_pp_<n>`` and checkpoint wrappers dropped), the
    loss's forward or backward (outside every module), the step; none for a layer's forward the model has no moment
    for or a module that names no layer."""
    from autopar_nb.verify.moments import moment_at

    paths = ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.10", "lm_head"]
    small, big = ap.MemoryBreakdown(params=1.0), ap.MemoryBreakdown(params=2.0)
    moments = [("backward", 1, small), ("backward", 1, big), ("recompute", 1, small), ("backward", 3, small),
               ("loss", None, small), ("step", None, big)]
    assert moment_at("train/backward in LlamaForCausalLM.model.layers.0._checkpoint_wrapped_module.mlp.down_proj",
                     paths, moments) == ("backward", 1, big)
    assert moment_at("train/recompute in Pipe.split_gm.submod_pp_1.model.layers.0._checkpoint_wrapped_module.mlp",
                     paths, moments) == ("recompute", 1, small)
    assert moment_at("train/backward in FSDPLlamaForCausalLM.model.layers.10.mlp.experts", paths,
                     moments) == ("backward", 3, small)
    assert moment_at("train/backward", paths, moments) == ("loss", None, small)
    assert moment_at("train/forward", paths, moments) == ("loss", None, small)
    assert moment_at("train/backward in DistributedDataParallel.module.model.layers.0.mlp", paths,
                     moments) == ("backward", 1, big)
    assert moment_at("train/backward in LlamaForCausalLM", paths, moments) is None  # the root's own ops
    assert moment_at("step/forward", paths, moments) == ("step", None, big)
    assert moment_at("train/forward in LlamaForCausalLM.model.layers.1", paths, moments) is None
    assert moment_at("train/backward in CheckpointWrapper._checkpoint_wrapped_module", paths, moments) is None
    assert moment_at("train/backward in LlamaForCausalLM.lm_head", paths, moments) is None  # no such moment
    # per-op moments (peak_moments(per_op=True)): a layer's backward at the ops of the tracker's very module, else
    # at the layer's largest (op None)
    mid = ap.MemoryBreakdown(params=1.5)
    per_op = [("backward", 1, big, None), ("backward", 1, small, 7), ("backward", 1, mid, 9), ("backward", 1, big, 8),
              ("step", None, big, None)]
    ops = {7: "model.layers.0.mlp", 8: "model.layers.0.mlp.down_proj", 9: "model.layers.0.mlp"}
    assert moment_at("train/backward in LlamaForCausalLM.model.layers.0._checkpoint_wrapped_module.mlp", paths,
                     per_op, ops) == ("backward", 1, mid, 9)
    assert moment_at("train/backward in LlamaForCausalLM.model.layers.0.self_attn", paths, per_op,
                     ops) == ("backward", 1, big, None)
    assert moment_at("step/forward", paths, per_op, ops) == ("step", None, big, None)
    # a repeated block's moments carry its first instance's ops (model.layers.0's for model.layers.1): matched by
    # the op's path within its layer
    later = [("backward", 2, big, None), ("backward", 2, small, 7), ("backward", 2, mid, 9), ("backward", 2, big, 8)]
    assert moment_at("train/backward in LlamaForCausalLM.model.layers.1.mlp", paths, later,
                     ops) == ("backward", 2, mid, 9)
    assert moment_at("train/backward in LlamaForCausalLM.model.layers.1", paths, later,
                     ops) == ("backward", 2, big, None)  # the block's own ops: none among these
    # the autograd node running names the op's kind among the module's ops (Mixtral's experts: their last index)
    names = {7: "aten.index.Tensor", 8: "aten.mm.default", 9: "aten.mul.Tensor"}
    assert moment_at("train/backward in LlamaForCausalLM.model.layers.1.mlp", paths, later, ops, node="IndexBackward0",
                     op_names=names) == ("backward", 2, small, 7)
    assert moment_at("train/backward in LlamaForCausalLM.model.layers.1.mlp", paths, later, ops, node="SiluBackward0",
                     op_names=names) == ("backward", 2, mid, 9)  # no op of that kind: the module's largest
    from autopar_nb.verify.moments import op_kind, op_kind_of_node
    assert op_kind_of_node("NativeLayerNormBackward0") == op_kind("aten.native_layer_norm.default")
    assert op_kind_of_node("MmBackward0") == op_kind("aten.mm.default") != op_kind("aten.addmm.default")


def test_a_layers_backward_moment_holds_the_gradients_of_the_parameters_its_later_ops_read():
    """Backward runs a layer's ops last to first, so at an op's backward the weight gradients of the ops after it
    exist (``Moment.later``): in an MLP block (up, GELU, down) the GELU's moment holds the down projection's weight
    and bias gradients, the up projection's none; ``backward_peak`` weighs them (float32) and returns their local
    numel, which ``estimate`` counts as gradients there (measured: the tracker's gradients at a pipelined LLaMA's
    first layer, 2.8 MiB, were 2.2 MiB before)."""
    from autopar_nb.cost.memory import backward_peak
    from autopar_nb.cost.profile import profile_of

    d = 16
    graph = ap.capture(_MlpLM(d=d), torch.randint(0, 64, (4, 8)))
    lp = profile_of(graph, "cpu").layers[[lay.path for lay in graph.layers].index("blocks.0")]
    ops = {graph.nodes[m.op].module_path: m.later for m in lp.moments["fp32"]}
    down = 4 * d * d + d
    assert ops["blocks.0.down"] == (0, 0), ops  # the last op: nothing after it
    assert sum(ops["blocks.0.up"]) == down, ops  # everything but its own weight
    assert max(sum(v) for v in ops.values()) == down
    work, freed, later = backward_peak(lp, tp=1, sp=False, scale=1.0)
    assert later in {sum(v) for v in ops.values()}
    tp2 = backward_peak(lp, tp=2, sp=False, scale=1.0, grad_item=0)
    # TP divides what it splits (the weights, the up projection's bias), not the down projection's bias
    assert tp2[2] in {v[0] / 2 + v[1] for v in ops.values()}


def test_the_allocator_margin_follows_the_share_of_fully_recomputed_layers():
    """On a GPU the margin covers the caching allocator's reserve beyond the tensors' peak: 5 % by default, and
    under full recompute, whose backward re-allocates each layer's forward beside its gradients, the 30.5 % measured
    on the H200 (``Factors.margin_full_recompute``), by the share of the rank's layers recomputed so; a CPU run has
    no such allocator."""
    from autopar_nb.cost.factors import factors_for

    cfg = zoo.LlamaConfig(vocab_size=512, dim=256, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=512)
    with torch.device("meta"):
        graph = ap.capture(zoo.Llama(cfg), torch.randint(0, 512, (8, 256)))
    gpu = ap.Cluster.preset("h100-80gb", 1, 1)
    f = factors_for(gpu)
    assert (f.margin_fraction, f.margin_full_recompute) == (0.05, 0.305)
    assert factors_for(ap.Cluster.preset("cpu", 1, 1)).margin_full_recompute == factors_for(
        ap.Cluster.preset("cpu", 1, 1)).margin_fraction

    def fraction(recompute):
        plan = ap.plan(graph, gpu, global_batch=8, fix={"recompute": recompute, "amp": "bf16"})
        mb = plan.cost.memory_by_rank[0]
        share = sum(lp.recompute == "full" for lp in plan.layers) / len(plan.layers)
        return (mb.margin - f.margin_fixed_bytes) / (mb.total - mb.margin), share

    assert fraction("none") == (pytest.approx(0.05), 0.0)
    margin, share = fraction("full")
    assert 0.5 < share < 1  # the blocks, not the embedding or the head
    assert margin == pytest.approx(0.05 + 0.255 * share)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
def test_no_moment_of_a_later_backward_holds_more_than_the_ranks_peak(schedule):
    """Once every gradient exists (a backward after a pipeline rank's first), a layer's backward moments differ
    from op to op by the working set, the saved bytes still alive and the gradients the op makes beside the
    accumulated ones, not by the gradients still to come that place the first backward's peak op: the layer's
    moment is at the op where those weigh most, so no moment at an op holds more than the rank's peak. Under
    FSDP's 16-bit parameters, which make no gradient beside the float32 sum, Mixtral's experts' index backward
    was 1.2 MiB above the peak of ZeRO-3 x PP in bf16 with full recompute, where the tracker peaked
    (bench/memory.py, interleaved, stage 1: 59.2 MiB at that op, 57.9 predicted, 61.1 measured)."""
    from memcells import CELLS

    from autopar_nb.cost.estimate import estimate, peak_moments
    from autopar_nb.source import ModelSource

    meta, example, _ = ModelSource(CELLS["Mixtral"](hidden=256, layers=4, seq=256, batch=8)).build(device="meta")
    graph = ap.capture(meta, example)
    cluster = ap.Cluster.preset("cpu", 1, 4)
    fix = {"dp": 2, "tp": 1, "pp": 2, "ep": 1, "zero_stage": 3, "micro_batches": 4, "schedule": schedule,
           "amp": "bf16", "recompute": "full"} | ({"virtual_stages": 2} if schedule != "1f1b" else {})
    plan = ap.plan(graph, cluster, global_batch=16, fix=fix)
    cost = estimate(graph, cluster, plan)
    for r, moments in enumerate(peak_moments(graph, cluster, plan, per_op=True)):
        heaviest = max(moments, key=lambda mo: mo[2].total)
        assert heaviest[2].total <= cost.memory_by_rank[r].total + 1, (r, heaviest[:2], heaviest[3:])
