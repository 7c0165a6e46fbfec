"""What PyTorch refuses, or autopar-nb has not verified, in a plan whose fields are each valid:
checked when the plan is built, so that a plan that cannot run never reaches the ranks (where torch
would refuse it after start-up)."""

from __future__ import annotations

from .checks import PlanError, check_module_path


def check_fused_loss(plan) -> None:
    """``fused_loss``: a module path or ""; the fused head runs where the head is (under pipelining
    on the last stage, which ends at its input), vocab-parallel under TP (its own loss, not torch's
    loss_parallel), not both pipelined and vocab-parallel (not verified)."""
    check_module_path("fused_loss", plan.fused_loss, root=True)
    if not plan.fused_loss:
        return
    m = plan.mesh
    if plan.loss_parallel:
        raise PlanError(f"fused_loss={plan.fused_loss!r} with loss_parallel=true (the fused head "
                        "computes a vocab-parallel loss itself under TP; torch's loss_parallel "
                        "takes logits, which it never makes): set loss_parallel to false, or "
                        "fused_loss to \"\" (or fix fused_loss=false)")
    if m.pp > 1 and m.tp > 1:
        raise PlanError(f"fused_loss={plan.fused_loss!r} with mesh.pp={m.pp} and mesh.tp={m.tp}: "
                        "the fused head runs on the last pipeline stage unsplit, or vocab-parallel "
                        "without pipelining, not both (not verified yet); use tp=1 or pp=1, or set "
                        "fused_loss to \"\" (fix fused_loss=false)")


def check_cp(plan) -> None:
    """``mesh.cp`` > 1: a sequence model whose sequence splits into 2 * cp equal chunks (torch's
    head-tail load balancing of causal attention), without pipelining, experts or a fused loss
    head."""
    m, seq = plan.mesh, plan.batch.seq_len
    if m.cp == 1:
        return
    if seq is None:
        raise PlanError(f"mesh.cp={m.cp} needs a sequence model: batch.seq_len is null (context "
                        "parallelism splits every sample's sequence); set mesh.cp to 1")
    if seq % (2 * m.cp):
        raise PlanError(f"mesh.cp={m.cp} needs batch.seq_len divisible by 2 * cp = {2 * m.cp} "
                        "(torch's load balancing cuts each sequence into 2 * cp chunks), got "
                        f"seq_len {seq}")
    why = ("mesh.ep > 1" if m.ep > 1 else
           "fused_loss (the fused head computes the unsplit sequence's loss)" if plan.fused_loss
           else "")
    if why:
        raise PlanError(f"mesh.cp={m.cp} with {why} is not supported; set mesh.cp to 1")


def check_compiled(plan) -> None:
    """Compiled blocks only without pipelining; async TP only with them, on CUDA, under TP; float8
    only without pipelining (not verified there)."""
    compiled = [lp.path for lp in plan.layers if lp.compile]
    if compiled and plan.mesh.pp > 1:
        raise PlanError(f"layers {', '.join(compiled[:3])}{', ...' if len(compiled) > 3 else ''} "
                        f"are compiled, but mesh.pp={plan.mesh.pp}: compile applies to whole "
                        "blocks with pp=1 only (a pipeline stage is a traced graph); set their "
                        "compile to false or pp to 1")
    if plan.async_tp and (plan.mesh.tp == 1 or not compiled or plan.cluster.get("preset") == "cpu"):
        raise PlanError("async_tp=true needs CUDA (symmetric memory), compiled blocks and mesh.tp "
                        f"> 1; got cluster {plan.cluster.get('preset')!r}, {len(compiled)} "
                        f"compiled layers, tp={plan.mesh.tp}")
    if plan.precision.float8 != "none" and plan.mesh.pp > 1:
        raise PlanError(f"precision.float8={plan.precision.float8!r} with mesh.pp={plan.mesh.pp}: "
                        "float8 runs with pp=1 only (not verified under pipelining, whose stages "
                        "are traced graphs); set float8 to 'none' or pp to 1")


def check_schedule(plan) -> None:
    """What torch.distributed.pipelining's schedules refuse when they are built (in every rank,
    after start-up): 1F1B needs a micro-batch per stage at least; the interleaved schedules a number
    of micro-batches that splits into rounds of pp; zero-bubble V exactly 2 stages per rank."""
    m, pl, mb = plan.mesh, plan.pipeline, plan.batch.micro_batches
    if m.pp == 1:
        return
    if pl.schedule == "1f1b" and mb < m.pp:
        raise PlanError(f"pipeline.schedule='1f1b' with mesh.pp={m.pp} needs batch.micro_batches "
                        f">= {m.pp} (torch's Schedule1F1B runs at least one micro-batch per "
                        f"stage), got {mb}; raise micro_batches or use 'gpipe'")
    rounds = max(1, mb // m.pp)
    if pl.schedule in ("interleaved_1f1b", "interleaved_zero_bubble") and mb % rounds:
        raise PlanError(f"pipeline.schedule={pl.schedule!r} with mesh.pp={m.pp} needs "
                        "batch.micro_batches to be a multiple of its rounds (micro_batches // pp "
                        f"= {rounds}), got {mb}; use a multiple of {m.pp} or fewer than {2 * m.pp}")
    if pl.schedule == "zbv_zero_bubble" and pl.virtual_stages != 2:
        raise PlanError(f"pipeline.schedule='zbv_zero_bubble' runs exactly 2 stages per rank: "
                        f"pipeline.virtual_stages must be 2, got {pl.virtual_stages}")
