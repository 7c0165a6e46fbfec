"""CPU offload as a plan choice (``plan.mesh.offload``): FSDP2's ``CPUOffloadPolicy`` keeps the parameter and
gradient shards and the optimizer states in host memory and steps on the CPU. Costed with the host link and the CPU
optimizer's rate (cost/offload.py), taken by the planner only where nothing else fits, checked against the host's
RAM, and applied by the exported script. On this CPU-only machine the policy runs unpinned over gloo (the device is
the host: nothing moves, the same FSDP2 code path runs), and the runs match one process; the copies and pinned
memory need a GPU host (``make gpu-check``)."""

from __future__ import annotations

import dataclasses

import pytest
from runtime_cases import LLAMA_CELL, make_plan, source

from autopar_nb.plan import MeshPlan, Plan, PlanError, normalize_fix


def _plan(graph, preset: str = "h100-80gb", gpus: int = 1, **fix):
    import autopar_nb as ap
    from autopar_nb.hardware import Cluster

    cluster = Cluster.preset(preset, gpus_per_node=gpus)
    return ap.plan(graph, cluster, **({} if preset == "cpu" else {"global_batch": 8}), fix=fix)


def _offloaded(plan: Plan) -> Plan:
    return dataclasses.replace(plan, mesh=dataclasses.replace(plan.mesh, offload="cpu"))


def test_plan_field_fix_key_and_json():
    assert normalize_fix({"offload": "cpu"}) == {"offload": "cpu"}
    with pytest.raises(PlanError, match="fix\\['offload'\\]='gpu' is not supported"):
        normalize_fix({"offload": "gpu"})
    with pytest.raises(PlanError, match="needs FSDP \\(zero_stage 2 or 3\\), got 0"):
        MeshPlan(dp=2, offload="cpu")
    plan = _offloaded(make_plan(source(LLAMA_CELL), dp=2, zero=3))
    assert "offload=cpu" in plan.summary() and Plan.from_json(plan.to_json()).mesh.offload == "cpu"


def test_offload_moves_the_states_from_device_to_host_and_costs_the_copies(llama_8b):
    """The same ZeRO-3 split with and without offload: the device keeps no parameter, gradient or optimizer state
    (the host holds them: 16 bytes per parameter of the rank's shard), the step adds the host copies at the host
    link's rate and the optimizer step at the CPU's."""
    from autopar_nb.cost.estimate import estimate
    from autopar_nb.cost.offload import CPU_ADAM_PARAMS_PER_S, PCIE5, host_of
    from autopar_nb.hardware import Cluster

    cluster = Cluster.preset("h100-80gb", gpus_per_node=8)
    plain = _plan(llama_8b, gpus=8, zero_stage=3, tp=1, pp=1)
    off = _offloaded(plain)
    c0, c1 = estimate(llama_8b, cluster, plain), estimate(llama_8b, cluster, off)
    m0, m1 = c0.memory_by_rank[0], c1.memory_by_rank[0]
    assert m0.host == 0 and m1.params == m1.grads == m1.optimizer == 0
    shard = llama_8b.num_params / 8
    assert m1.host == pytest.approx(16 * shard, rel=1e-3)  # fp32 parameter and gradient, Adam's two moments
    assert m1.total < m0.total - 0.9 * (m0.params + m0.optimizer)
    zero2 = _plan(llama_8b, gpus=8, zero_stage=2, tp=1, pp=1)  # its gathered units are buffers, its shards states
    m2 = estimate(llama_8b, cluster, _offloaded(zero2)).memory_by_rank[0]
    assert m2.params == m2.grads == m2.optimizer == 0 and m2.host == pytest.approx(16 * shard, rel=1e-3)
    assert host_of(cluster).link == PCIE5 and 50e9 < PCIE5 < 56e9
    gathers = 2 * plain.batch.micro_batches  # ZeRO 3: forward and backward, each micro-batch
    assert c1.comm_by_kind["host_to_device"] == pytest.approx(gathers * shard * 4 / PCIE5, rel=1e-3)
    assert c1.optimizer_s == pytest.approx(shard * 8 / CPU_ADAM_PARAMS_PER_S, rel=1e-3)
    assert c1.step_time_s > c0.step_time_s


def test_the_planner_offloads_only_where_nothing_else_fits(llama_8b):
    """LLaMA 3 8B (16 bytes of states per parameter: 120 GiB) on one H100 fits only offloaded; on eight it fits
    without."""
    one = _plan(llama_8b)
    assert one.mesh.offload == "cpu" and one.mesh.zero_stage >= 2 and "offload=cpu" in one.summary()
    line = next(ln for ln in one.explanation if ln.startswith("CPU offload"))
    assert "nothing fits in device memory without it" in line and "of the host's" in line and "host copies" in line
    assert one.cost.memory_by_rank[0].host > 100 * 2**30 and one.cost.peak_memory_bytes < 80e9
    from autopar_nb.widget.differences import plan_summary

    assert "offload=cpu" in plan_summary(one) and line in one.explain()  # the widget's header and explain()
    eight = _plan(llama_8b, gpus=8)
    assert eight.mesh.offload == "none" and not any(ln.startswith("CPU offload") for ln in eight.explanation)
    fixed = _plan(llama_8b, gpus=8, offload="cpu")
    assert fixed.mesh.offload == "cpu" and any(ln.startswith("CPU offload (fix offload)") for ln in fixed.explanation)
    assert fixed.cost.step_time_s > eight.cost.step_time_s


def test_the_host_must_hold_the_offloaded_states(llama_8b):
    """An L4 node's assumed host (RAM twice its GPU memory: 48 GB) cannot hold 8B's 128 GB of states: the fix is
    refused with the host's figures, and the planner does not offload there."""
    with pytest.raises(PlanError, match="fix offload='cpu': its offloaded states need 120 GiB of the host's 44.7 GiB "
                                        "per node \\(assumed: RAM twice the node's GPU memory"):
        _plan(llama_8b, "l4", offload="cpu")
    with pytest.raises(PlanError, match="nothing fits .*; with CPU offload its offloaded states need 120 GiB"):
        _plan(llama_8b, "l4")


def test_a_detected_machine_offloads_into_its_own_ram(llama_8b):
    """A cluster detected on this machine (``--gpu auto``) checks the offloaded states against the machine's RAM, not
    its GPU's reference system (a DGX H100's 2 TB): one H100 on a 64 GiB host cannot hold the 8B's 120 GiB, so the
    fix is refused with the machine's figure and the planner offers no plan; with 256 GiB it offloads."""
    import autopar_nb as ap
    from autopar_nb.hardware import Cluster, GiB

    small = dataclasses.replace(Cluster.preset("h100-80gb", gpus_per_node=1), host_memory=64 * GiB)
    with pytest.raises(PlanError, match="fix offload='cpu': its offloaded states need 120 GiB of the host's 64.0 GiB "
                                        "per node \\(this machine's RAM, as detected\\)"):
        ap.plan(llama_8b, small, global_batch=8, fix={"offload": "cpu"})
    with pytest.raises(PlanError, match="nothing fits .*; with CPU offload its offloaded states need 120 GiB of the "
                                        "host's 64.0 GiB"):
        ap.plan(llama_8b, small, global_batch=8)
    big = ap.plan(llama_8b, dataclasses.replace(small, host_memory=256 * GiB), global_batch=8)
    assert big.mesh.offload == "cpu"
    assert "of the host's 256 GiB per node (this machine's RAM" in next(ln for ln in big.explanation
                                                                      if ln.startswith("CPU offload"))


def test_fix_offload_needs_fsdp_and_no_pipelining(small_llama):
    with pytest.raises(PlanError, match="fix offload='cpu': CPU offload needs FSDP"):
        _plan(small_llama, "cpu", 2, offload="cpu", zero_stage=0)
    with pytest.raises(PlanError, match="runs with pp=1"):
        _plan(small_llama, "cpu", 2, offload="cpu", pp=2)


def test_on_cpu_the_accounting_moves_but_nothing_is_copied(small_llama):
    """The ``cpu`` preset: never chosen (the device is the host), taken when fixed, priced without copies."""
    auto = _plan(small_llama, "cpu", 2)
    assert auto.mesh.offload == "none"
    plan = _plan(small_llama, "cpu", 2, offload="cpu")
    mem = plan.cost.memory_by_rank[0]
    assert plan.mesh.offload == "cpu" and mem.host > 0 and mem.optimizer == 0
    assert "host_to_device" not in plan.cost.comm_by_kind
    assert any("nothing is copied" in ln for ln in plan.explanation)


def test_the_script_offloads_with_one_fsdp_call_at_dp_1_too(tmp_path):
    from autopar_nb.export import export

    src = source(LLAMA_CELL)
    plan = _offloaded(make_plan(src, dp=1, zero=3))
    text = export(src, plan, tmp_path / "train.py", quiet=True, single_file=True).script.read_text()
    compile(text, "train.py", "exec")
    assert "offload_policy=op" in text and "CPUOffloadPolicy(pin_memory=cuda)" in text
    assert 'apply_fsdp(part, mesh["dp"], units=FSDP_UNITS, reshard_after_forward=True, offload=True)' in text
    assert "net = model  # on the host" in text and "buffers_to(parts, device)" in text and "fused=True" in text
    meta = export(src, plan, tmp_path / "meta.py", quiet=True, single_file=True, meta_init=True).script.read_text()
    assert 'materialize(parts, skeleton, device="cpu", seed=SEED)' in meta
    plain = export(src, dataclasses.replace(plan, mesh=MeshPlan(dp=1, zero_stage=3)), tmp_path / "plain.py",
                   quiet=True, single_file=True).script.read_text()
    assert "offload=True" not in plain and "buffers_to(parts" not in plain and "apply_fsdp(part" not in plain


@pytest.mark.multiprocess
def test_offload_on_two_gloo_processes_matches_one_process():
    """FSDP2's CPUOffloadPolicy (unpinned: pinning needs an accelerator) runs on gloo, every unit offloaded, the
    optimizer fused on the CPU: ZeRO 3, ZeRO 2 and a meta-initialised ZeRO 3 match the single-process run (losses
    equal, gradients within 1.4e-7 and parameters within 3e-8 of the largest when this was written)."""
    from autopar_nb.verify import verify_many

    src = source(LLAMA_CELL)
    cases = [(src, _offloaded(make_plan(src, dp=2, zero=z))) for z in (3, 2, 3)]
    reports = verify_many(cases, steps=3, nproc=2, warm=False, meta_init=[False, False, True])
    for report in reports:
        assert report.ok, str(report)
        assert report.max_loss_rel < 1e-6
        assert all(i["offloaded"] > 0 for i in report.per_rank), report.per_rank
