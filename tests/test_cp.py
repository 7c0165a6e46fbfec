"""Context parallelism (issue 18 point 4, seed §6.1 "the attention layers' special communication
pattern"): the plan's ``mesh.cp``, torch's ring attention made to run on CPU (runtime/cp.py
registers the CPU attention kernel with torch's own ring code), the exported script, and verify
against the single-process reference on 2 and 4 gloo processes, on the zoo's LLaMA and Hugging
Face decoders."""

from __future__ import annotations

import pytest
from runtime_cases import LLAMA_CELL, make_plan

from autopar_nb.export import render_script
from autopar_nb.plan import Plan, PlanError
from autopar_nb.source import ModelSource


def cp_plan(src: ModelSource, *, cp: int = 2, dp: int = 1, zero: int = 0, seq_len: int = 16, **kw) -> Plan:
    """``make_plan``'s plan with context parallelism, built through ``from_dict`` so every check runs."""
    d = make_plan(src, dp=dp, zero=zero, **kw).to_dict()
    d["mesh"]["cp"], d["batch"]["seq_len"] = cp, seq_len
    return Plan.from_dict(d)


def test_plan_checks_cp():
    src = ModelSource(LLAMA_CELL)
    plan = cp_plan(src)
    assert plan.mesh.world_size == 2 and "cp=2" in plan.summary()
    assert Plan.from_json(plan.to_json()).mesh.cp == 2
    with pytest.raises(PlanError, match=r"needs batch.seq_len divisible by 2 \* cp = 4 .*got seq_len 18"):
        cp_plan(src, seq_len=18)
    with pytest.raises(PlanError, match="mesh.cp=2 needs a sequence model: batch.seq_len is null"):
        cp_plan(src, seq_len=None)
    assert cp_plan(src, pp=2, micro_batches=2, stages={"layers.1": 1}).mesh.world_size == 4  # each stage's ring
    with pytest.raises(PlanError, match=r"mesh.cp must be >= 1, got 0"):
        cp_plan(src, cp=0)
    d = plan.to_dict()
    d["cluster"] = {"preset": "cpu", "nodes": 1, "gpus_per_node": 4}
    with pytest.raises(PlanError, match=r"dp\(1\) \* tp\(1\) \* pp\(1\) \* cp\(2\) = 2 != world_size\(4\)"):
        Plan.from_dict(d)


def test_script_splits_sequences_over_cp_ranks():
    src = ModelSource(LLAMA_CELL)
    text = render_script(src, cp_plan(src, zero=3))
    assert "PP, DP, CP, TP = 1, 1, 2, 1  # plan.mesh: world = PP * DP * CP * TP = 2" in text
    assert "mesh = build_mesh(device, PP, DP, TP, cp=CP)" in text
    assert 'apply_fsdp(part, mesh["dp_cp"]' in text  # gradients averaged over the dp * cp ranks
    assert 'shard = functools.partial(sequence_shards, mesh["cp"], causal=CAUSAL)' in text
    assert "loss = functools.partial(sequence_loss, cp=CP)" in text and "shard=shard" in text
    assert "def enable_cpu_ring_attention()" in text and "cp=CP" in text
    assert "build_mesh(device, PP, DP, TP)" in render_script(src, make_plan(src, dp=2))  # nothing without cp


def test_script_splits_sequences_beside_tensor_parallelism():
    """cp x tp: the ring runs over the cp ranks of one tp rank (its heads), gradients averaged over dp_cp."""
    src = ModelSource(LLAMA_CELL)
    tp = {"layers.0.feed_forward.w1": "colwise", "layers.0.feed_forward.w2": "rowwise"}
    text = render_script(src, cp_plan(src, tp=2, zero=3, tp_styles=tp))
    assert "PP, DP, CP, TP = 1, 1, 2, 2  # plan.mesh: world = PP * DP * CP * TP = 4" in text
    assert 'shard = functools.partial(sequence_shards, mesh["cp"], causal=CAUSAL)' in text
    assert "parallelize_module(" in text and 'apply_fsdp(part, mesh["dp_cp"]' in text
    # ZeRO-1: FSDP2 over dp_cp too, its parameters kept gathered after forward (its one reduce-scatter per step is
    # set_grad_sync's), no optimizer of its own
    text = render_script(src, cp_plan(src, tp=2, zero=1, tp_styles=tp))
    assert 'apply_fsdp(part, mesh["dp_cp"], units=FSDP_UNITS, reshard_after_forward=False' in text
    assert "zero1_group" not in text and "ZeroRedundancyOptimizer" not in text


def test_script_splits_sequences_before_the_pipeline():
    """cp x pp: the batch split over the cp ranks before the schedule splits it, every stage traced on this rank's
    part (positions given, one sequence per row: causal attention, no mask), the ring on for every stage."""
    src = hf_source("LLaMA")
    text = render_script(src, cp_plan(src, pp=2, zero=3, seq_len=64, micro_batches=2,
                                      stages={"model.layers.1": 1}))
    assert 'shard = functools.partial(sequence_shards, mesh["cp"], causal=CAUSAL, per_sample=True)' in text
    assert "loss = functools.partial(sequence_loss, cp=CP, positions=takes_positions(model))" in text
    assert "example = model_call(loss, shard_of(shard, split_batch(" in text
    assert "one_sequence_per_row=True" in text and "shard=shard" in text
    assert 'apply_fsdp(part, mesh["dp_cp"]' in text and "def attention_called_late(" in text


def test_script_refuses_what_cp_cannot_run():
    own_loss = ModelSource(LLAMA_CELL + "\ndef loss_fn(model, batch):\n    return model(batch[0]).float().mean()\n",
                           loss_fn_var="loss_fn")
    with pytest.raises(PlanError, match="defines its own loss_fn: context parallelism computes the default loss"):
        render_script(own_loss, cp_plan(own_loss))


def hf_source(family: str) -> ModelSource:
    """A Hugging Face decoder of tests/memcells.py, small: hidden 64, 2 layers, seq 64 (4 chunks of
    16 on 2 cp ranks), 2 samples. GPT-2's attention dropout is 0 (its default 0.1 is refused on CPU:
    :func:`test_attention_dropout_is_refused_on_cpu`)."""
    from memcells import CELLS

    cell = CELLS[family](hidden=64, layers=2, seq=64, batch=2)
    return ModelSource(cell.replace("n_head=", "attn_pdrop=0.0, n_head=") if family == "GPT-2" else cell)


def verify_cp(cases: dict[str, tuple[str | None, int]], *, nproc: int) -> None:
    """Verify every case (name -> (family, ZeRO stage); family None: the zoo's LLaMA) at cp=2 and
    dp=nproc/2 in one launch of ``nproc`` gloo processes: losses, gradients and parameters equal to
    the single process's within float32's tolerance."""
    from autopar_nb.verify import FP32_RTOL, verify_many

    runs = []
    for family, zero in cases.values():
        src = ModelSource(LLAMA_CELL) if family is None else hf_source(family)
        seq = 16 if family is None else 64
        runs.append((src, cp_plan(src, dp=nproc // 2, zero=zero, seq_len=seq)))
    reports = verify_many(runs, steps=3, nproc=nproc, rtol=FP32_RTOL)
    for name, report in zip(cases, reports, strict=True):
        assert report.ok, f"{name}\n{report}"
        assert report.max_loss_rel < 1e-5, f"{name}\n{report}"


@pytest.mark.multiprocess
def test_verify_cp_against_one_process():
    """2 gloo processes, each holding half of every sequence (torch's head-tail load balancing),
    attention as torch's ring, the gradients averaged by DDP and by FSDP2 over the cp ranks. The
    Hugging Face decoders are given each token's global position (their rotary tables, GPT-2's
    learned position embedding): numbering its own half from 0, a rank would leave the gradients
    beyond tolerance."""
    verify_cp({"zoo LLaMA ddp": (None, 0), "zoo LLaMA fsdp": (None, 3),
               "HF LLaMA ddp": ("LLaMA", 0), "HF LLaMA fsdp": ("LLaMA", 3),
               "Qwen2 ddp": ("Qwen2", 0), "Qwen2 fsdp": ("Qwen2", 3),
               "GPT-2 ddp": ("GPT-2", 0), "GPT-2 fsdp": ("GPT-2", 3)}, nproc=2)


@pytest.mark.multiprocess
def test_verify_cp_beside_data_parallelism():
    """4 gloo processes: 2 replicas (dp=2), each splitting its sequences over 2 cp ranks, gradients
    averaged over the 4 ranks of ``dp_cp``; Mixtral's experts route each rank's tokens on their
    own."""
    verify_cp({"HF LLaMA ddp": ("LLaMA", 0), "HF LLaMA fsdp": ("LLaMA", 3),
               "Qwen2 ddp": ("Qwen2", 0), "Qwen2 fsdp": ("Qwen2", 3),
               "GPT-2 ddp": ("GPT-2", 0), "GPT-2 fsdp": ("GPT-2", 3),
               "Mixtral fsdp": ("Mixtral", 3)}, nproc=4)


@pytest.mark.multiprocess
def test_verify_cp_beside_tensor_parallelism():
    """4 gloo processes, cp=2 x tp=2 as the planner plans a Hugging Face LLaMA (hidden 256, 4 layers, seq 256): its
    TP styles, sequence parallelism and loss_parallel on each cp rank's part of the sequences, the ring over the cp
    ranks of one tp rank (its heads), FSDP2 (ZeRO 1 and 3) or its replicate (ZeRO 0) over dp_cp; losses, gradients
    and parameters equal to one process's."""
    from memcells import CELLS

    import autopar_nb as ap
    from autopar_nb.verify import FP32_RTOL, verify_many

    src = ModelSource(CELLS["LLaMA"](hidden=256, layers=4, seq=256, batch=2))
    model, inputs, _ = src.build(device="meta")
    graph = ap.capture(model, inputs)
    plans = [ap.plan(graph, ap.Cluster.preset("cpu", 1, 4), global_batch=2,
                     fix={"cp": 2, "tp": 2, "zero_stage": zero, "amp": "none", "recompute": "none"})
             for zero in (0, 1, 3)]
    assert all(p.loss_parallel and any(lp.sequence_parallel for lp in p.layers) for p in plans)
    for plan, report in zip(plans, verify_many([(src, p) for p in plans], steps=3, nproc=4, rtol=FP32_RTOL),
                            strict=True):
        assert report.ok and report.max_loss_rel < 1e-5, f"{plan.summary()}\n{report}"


@pytest.mark.multiprocess
def test_verify_cp_beside_pipelining():
    """4 gloo processes, cp=2 x pp=2 as the planner plans a Hugging Face LLaMA (hidden 256, 4 layers, seq 256) under
    interleaved 1F1B (several stages a rank, as many as the planner takes; test_pp_families leaves the schedule free
    too): each batch's sequences split over the cp ranks
    before the schedule splits it into micro-batches, each stage traced on this rank's part and calling SDPA when it
    runs (torch's context_parallel makes it the ring over the stage's cp ranks; the traced op would attend over this
    rank's part only), FSDP2 (ZeRO-3) over dp_cp; losses, gradients and parameters equal to one process's. No stage
    starts at the rotary table, which reads only the positions cp hands in: its stage ran before the embedding's, and
    was called without the hidden states."""
    from memcells import CELLS

    import autopar_nb as ap
    from autopar_nb.verify import FP32_RTOL, verify_many

    src = ModelSource(CELLS["LLaMA"](hidden=256, layers=4, seq=256, batch=2))
    model, inputs, _ = src.build(device="meta")
    plan = ap.plan(ap.capture(model, inputs), ap.Cluster.preset("cpu", 1, 4), global_batch=2,
                   fix={"cp": 2, "pp": 2, "zero_stage": 3, "amp": "none", "recompute": "none",
                        "schedule": "interleaved_1f1b"})  # free, the cpu preset's handoffs make it 1F1B
    assert (plan.mesh.cp, plan.mesh.pp) == (2, 2) and plan.pipeline.virtual_stages > 1, plan.summary()
    assert {lp.path: lp.stage for lp in plan.layers}["model.rotary_emb"] == 0, plan.summary()
    report, = verify_many([(src, plan)], steps=3, nproc=4, rtol=FP32_RTOL)
    assert report.ok and report.max_loss_rel < 1e-5, f"{plan.summary()}\n{report}"


def tiny_llama_graph():
    import torch

    import autopar_nb as ap
    from autopar_nb.zoo import Llama, LlamaConfig

    with torch.device("meta"):
        model = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64))
    return ap.capture(model, (torch.randint(0, 64, (4, 16), device="meta"),))


def test_planner_splits_sequences_only_when_nothing_else_fits():
    """Two 16k-token sequences on two CPU ranks with TP pinned off: within 46.1 MiB only cp=2 fits (dp=2 needs 0.09
    GiB without recompute, 0.05 with it: a whole sequence's activations on each rank; one micro-batch of one sample
    is too few for 1F1B over 2 stages); with room to spare the planner keeps cp=1 and splits the batch. The RMSNorms
    stay eager (fused, they save each norm's normalised input, which lets dp=2 fit with recompute:
    tests/test_fused_norm.py)."""
    import autopar_nb as ap

    graph = tiny_llama_graph()
    tight = ap.Cluster.preset("cpu", gpus_per_node=2, memory_gb=0.045)
    plan = ap.plan(graph, tight, seq_len=16384, fix={"tp": 1, "fused_norm": False}, global_batch=2)
    assert plan.mesh.cp == 2 and plan.mesh.world_size == 2 and plan.batch.seq_len == 16384
    assert "because no plan without it fits in memory" in plan.explain()
    loose = ap.plan(graph, ap.Cluster.preset("cpu", gpus_per_node=2), seq_len=16384, fix={"tp": 1}, global_batch=2)
    assert (loose.mesh.cp, loose.mesh.dp) == (1, 2)
    with pytest.raises(PlanError, match=r"nothing fits in 46.1 MiB .* \(dp=2 tp=1 pp=1 zero="):
        ap.plan(graph, tight, seq_len=16384, fix={"tp": 1, "fused_norm": False}, global_batch=2, default_loss=False)
    # with dp fixed to the world there is no mesh with a cp share: the answer is why nothing fits (it was "fix dp=2
    # does not divide the world size 1", from the cp retry)
    with pytest.raises(PlanError, match=r"nothing fits in 46.1 MiB .* \(dp=2 tp=1 pp=1 zero="):
        ap.plan(graph, tight, seq_len=16384, fix={"tp": 1, "dp": 2, "fused_norm": False}, global_batch=2)
    with pytest.raises(PlanError, match=r"fix cp=2: the cell defines its own loss_fn"):
        ap.plan(graph, tight, seq_len=16384, fix={"cp": 2}, global_batch=1, default_loss=False)
    with pytest.raises(PlanError, match=r"cuts seq_len 16386 into 2 \* cp equal chunks"):
        ap.plan(graph, tight, seq_len=16386, fix={"cp": 2}, global_batch=1)


def test_cost_of_context_parallelism():
    """cp=2 halves a rank's activations and compute and adds the ring's collectives: the keys and values
    all-gathered in forward and backward, their float32 gradients sent round the ring."""
    import autopar_nb as ap
    from autopar_nb.cost.estimate import Evaluator
    from autopar_nb.cost.profile import profile
    from autopar_nb.cost.setting import LayerChoice, Setting

    graph = tiny_llama_graph()
    prof = profile(graph, device_kind="cpu")
    ev = Evaluator(prof, ap.Cluster.preset("cpu", gpus_per_node=2), seq_ratio=1024)  # 16k tokens
    one, two = (ev.terms(1, tp=1, sp=False, precision="fp32", mb_samples=1.0, cp=cp) for cp in (1, 2))
    assert prof.layers[1].kv_bytes == 2 * 4 * 4 * 16 * 8 * 4  # K and V: (4, 4 heads, 16, 8) float32 each
    # half of everything, plus the copy of the attention output the ring's merge leaves (one rank's q-sized share)
    share = 1.0 / prof.batch * 1024 / 2  # one sample's 16k tokens, halved
    assert two.act["none"] == pytest.approx(one.act["none"] / 2 + prof.layers[1].q_bytes * share)
    assert two.fwd < one.fwd and not one.tp_comm
    assert set(two.tp_comm) == {"all_gather", "send_recv"} and two.tp_exposed > 0
    cost = ev.evaluate(Setting(cp=2), [LayerChoice() for _ in prof.layers])
    assert cost.comm_by_kind["all_gather"] > 0 and cost.comm_by_kind["all_reduce"] > 0  # dp_cp gradient all-reduce


def test_cost_of_context_parallelism_beside_tensor_parallelism():
    """Under TP a rank's attention has half the heads: the ring's keys and values, its working set and the
    attention output's copy are half of those at tp=1 (the cp group is the ranks with the same tp rank)."""
    import autopar_nb as ap
    from autopar_nb.cost.estimate import Evaluator
    from autopar_nb.cost.per_layer import ring_comm
    from autopar_nb.cost.profile import profile

    prof = profile(tiny_llama_graph(), device_kind="cpu")
    ev = Evaluator(prof, ap.Cluster.preset("cpu", gpus_per_node=4), seq_ratio=1024)
    terms = {(tp, cp): ev.terms(1, tp=tp, sp=False, precision="fp32", mb_samples=1.0, cp=cp)
             for tp in (1, 2) for cp in (1, 2)}
    share = 1.0 / prof.batch * 1024 / 2
    one, two = terms[2, 1], terms[2, 2]
    assert two.act["none"] == pytest.approx(one.act["none"] / 2 + prof.layers[1].q_bytes * share / 2)
    held = {tp: ring_comm(ev, prof.layers[1], {}, cp=2, tp=tp, half=False, scale=share) for tp in (1, 2)}
    assert held[2] == pytest.approx(held[1] / 2)  # what the ring's backward holds at the attention op
    assert terms[2, 2].tp_comm["send_recv"] < terms[1, 2].tp_comm["send_recv"]


def test_planner_offers_context_beside_tensor_parallelism():
    """cp x tp is planned (the TP styles, sequence parallelism and loss_parallel as without cp), with ZeRO over the
    dp x cp ranks where it fits only so; cp x pp is refused with the reason."""
    import autopar_nb as ap

    src = hf_source("LLaMA")
    model, inputs, _ = src.build(device="meta")
    graph = ap.capture(model, inputs)
    cluster = ap.Cluster.preset("cpu", gpus_per_node=4)
    plan = ap.plan(graph, cluster, fix={"cp": 2, "tp": 2}, global_batch=2)
    assert (plan.mesh.cp, plan.mesh.tp, plan.mesh.dp) == (2, 2, 1) and plan.loss_parallel
    assert any(lp.sequence_parallel for lp in plan.layers) and "cp=2" in plan.summary()
    # the cp ranks of the one replica hold the same parameters: where ZeRO 0's 2.5 MiB does not fit, ZeRO-1 or FSDP
    # over dp x cp
    tight = ap.Cluster.preset("cpu", gpus_per_node=4, memory_gb=2.2 / 1024)
    assert ap.plan(graph, tight, fix={"cp": 2, "tp": 2}, global_batch=2).mesh.zero_stage in (1, 2)
    staged = ap.plan(graph, cluster, fix={"cp": 2, "pp": 2}, global_batch=2)  # beside pipelining too
    assert (staged.mesh.cp, staged.mesh.pp) == (2, 2)
    assert ap.plan(graph, cluster, fix={"cp": 2, "tp": 2, "zero_stage": 1}, global_batch=2).mesh.zero_stage == 1


def test_what_context_parallelism_cannot_split():
    import torch

    import autopar_nb as ap
    from autopar_nb.cost.profile import profile
    from autopar_nb.zoo import GPT, GPTConfig

    assert profile(tiny_llama_graph()).cp_blocker == ""
    with torch.device("meta"):
        gpt = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16))
    graph = ap.capture(gpt, (torch.randint(0, 64, (2, 16), device="meta"),))
    assert "computes positions with torch.arange inside forward" in profile(graph).cp_blocker
    assert not graph.takes_positions and "takes no position_ids" in profile(graph).cp_blocker
    with pytest.raises(PlanError, match="fix cp=2: .*torch.arange"):
        ap.plan(graph, ap.Cluster.preset("cpu", gpus_per_node=2), fix={"cp": 2})


def test_attention_dropout_is_refused_on_cpu():
    """SDPA with dropout has no fused CPU kernel: its math form's separate ops (the mask's add) mix
    the ring's DTensors with plain tensors, so GPT-2 at its default attn_pdrop 0.1 crashed in the
    exported script's first forward on 2 gloo processes (verify, which switches dropout off, passed).
    The planner refuses it on CPU, names the setting, and plans it for GPUs."""
    from memcells import CELLS

    import autopar_nb as ap

    src = ModelSource(CELLS["GPT-2"](hidden=64, layers=2, seq=64, batch=2))
    model, inputs, _ = src.build(device="meta")
    graph = ap.capture(model, inputs)
    with pytest.raises(PlanError, match=r"fix cp=2: the attention of transformer.h.0.attn has dropout 0.1.*"
                                        r"set the attention dropout to 0"):
        ap.plan(graph, ap.Cluster.preset("cpu", gpus_per_node=2), fix={"cp": 2}, global_batch=2)
    assert ap.plan(graph, ap.Cluster.preset("h100-80gb", 1, 2), fix={"cp": 2}, global_batch=2).mesh.cp == 2


def test_positions_lift_the_refusal():
    """A Hugging Face decoder numbers its positions with torch.arange only when it is given none:
    its forward takes position_ids, which the runtime passes (each rank's share of the global
    positions), so the planner splits its sequences; the exported script reads the forward's
    signature the same way."""
    import torch

    import autopar_nb as ap
    from autopar_nb.runtime.cp import takes_positions

    src = hf_source("LLaMA")
    model, inputs, _ = src.build(device="meta")
    graph = ap.capture(model, inputs)
    assert graph.takes_positions and any(n.op.startswith("aten.arange") for n in graph.nodes)
    plan = ap.plan(graph, ap.Cluster.preset("cpu", gpus_per_node=2), fix={"cp": 2}, global_batch=2)
    assert plan.mesh.cp == 2
    text = render_script(src, plan)
    assert "def takes_positions(" in text and "masks_as_in_eager(own_positions=True)" in text
    assert takes_positions(model) and not takes_positions(torch.nn.Linear(2, 2))
