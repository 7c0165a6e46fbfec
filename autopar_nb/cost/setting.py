"""A candidate plan as plain values: the global choices (:class:`Setting`) and each layer's
(:class:`LayerChoice`), which the planner searches and the cost model prices."""

from __future__ import annotations

from dataclasses import dataclass

from ..plan import DTYPE_NAMES, ITEMSIZE, stage_rank
from ..plan.vocab import MOE_CAPACITY
from .schedule import ZERO_BUBBLE


@dataclass(frozen=True)
class Setting:
    """Global choices of a candidate plan (plain values)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero_stage: int = 0
    amp: str = "none"
    micro_batches: int = 1
    """micro-batches per step on each data-parallel rank"""
    mb_samples: float = 1.0
    """samples per micro-batch"""
    schedule: str = "1f1b"
    virtual_stages: int = 1
    sp: bool = False
    """sequence parallel (TP > 1 on a sequence model): over the layers up to
    ``GraphProfile.sp_last``, the next layer with parameters gathering the sequence back
    (``GraphProfile.sp_gather``)"""
    optimizer: str = "adam"
    ep: int = 1
    """expert parallelism: the experts modules split over ``ep`` of the dp ranks (1: experts whole
    everywhere)"""
    fused_loss: bool = False
    """the output head and the default loss run as one fused, chunked op (``Evaluator.head``;
    :mod:`.loss`)"""
    cp: int = 1
    """context parallelism: every sequence split over ``cp`` ranks (ring attention;
    ``runtime/cp.py``)"""
    fused_norm: bool = False
    """the RMSNorm modules run kernels_ext's fused RMSNorm (``Evaluator.norm_prof``;
    :mod:`.norm`)"""
    float8: str = "none"
    """torchao's float8 recipe the Linears train with (:mod:`.float8`); "none": bf16"""
    async_tp: bool = False
    """Inductor's micro-pipelined TP hides TP's all-gathers and reduce-scatters behind the matmuls
    (:mod:`.async_tp`)"""
    offload: str = "none"
    """"cpu": FSDP's shards and optimizer states in host memory, the step on the CPU
    (:mod:`.offload`)"""
    moe_capacity: float = MOE_CAPACITY
    """with ep > 1: the rows a rank's experts are costed for, as a multiple of balanced routing's
    (``mesh.moe_capacity``: the busiest rank's bound)"""

    def routed_rows(self, ch: LayerChoice) -> float:
        """The rows the experts of a layer (``ch``) run on this rank, as a multiple of balanced
        routing's: 1 without expert parallelism (a rank's experts then run its own (token, choice)
        pairs), else the layer's measured rows, else :attr:`moe_capacity`."""
        if self.ep == 1:
            return 1.0
        return self.moe_capacity if ch.routed is None else ch.routed

    @property
    def replicas(self) -> int:
        """ranks holding the same parameters, which average gradients: dp * cp
        (``mesh["dp_cp"]``)"""
        return self.dp * self.cp

    @property
    def compute_item(self) -> int:
        """bytes per element of the compute dtype (autocast's, else float32): of FSDP's gathered
        parameters and of the activations and logits"""
        return ITEMSIZE[DTYPE_NAMES.get(self.amp, "float32")]

    @property
    def held_zero_stage(self) -> int:
        """The ZeRO stage FSDP2 holds the parameters by: ``zero_stage``, but 2 for ZeRO-3 pipeline
        stages under a schedule that splits the backward, which keep their units gathered after
        forward (their input pass must find the parameters the forward used: ``runtime/pp.py``'s
        ``keep_gathered``), and for ZeRO-1 over several ranks, which is FSDP2 without resharding
        after forward too (``runtime/train.py``'s ``set_grad_sync``)."""
        if self.zero_stage == 3 and self.pp > 1 and self.schedule in ZERO_BUBBLE:
            return 2
        if self.zero_stage == 1 and self.replicas > 1:
            return 2
        return self.zero_stage

    @property
    def unsharded_accumulation(self) -> bool:
        """FSDP2 (or its ``replicate``) accumulates the micro-batches' gradients unsharded, in
        ``reduce_dtype`` (float32), and reduces them once per step: in a pipeline stage (torch's
        ``PipelineStage``), and over several micro-batches under ZeRO-1 (``set_grad_sync``:
        Megatron's distributed optimizer) and under FSDP2's replicate beside TP, which the same
        ``set_requires_gradient_sync(False)`` leaves to sync the last one's (measured: LLaMA, dp 2 x
        tp 2, 4 micro-batches, full recompute: the tracker's buffers 10.5 MiB, gradients 0.5, where
        sharded-by-replica gradients were predicted 5.5 and 5.5)."""
        return self.pp > 1 or (self.replicas > 1 and self.micro_batches > 1 and (
            self.zero_stage == 1 or (self.zero_stage == 0 and self.tp > 1)))

    def vocab_parallel_loss(self, *, capable: bool, head_tp: bool) -> bool:
        """The loss runs on the head's vocabulary shards (torch's ``loss_parallel``): TP splits the
        head (``head_tp``) of a graph whose head can keep its logits sharded (``capable``:
        ``GraphProfile.loss_parallel``), the head not fused with the loss. Pipelined too: the last
        stage's head returns its vocabulary shards and the schedule's loss runs under
        ``loss_parallel()`` (as torchtitan's 3-D runs)."""
        return self.tp > 1 and capable and head_tp and not self.fused_loss

    def rank_of(self, stage: int) -> int:
        """The pipeline rank holding ``stage`` under this schedule
        (:func:`~autopar_nb.plan.stage_rank`)."""
        return stage_rank(stage, self.pp, self.pp * self.virtual_stages, self.schedule)


@dataclass
class LayerChoice:
    """Per-layer choices of a candidate plan."""

    stage: int = 0
    tp: bool = True
    """apply the layer's TP styles (False: replicate it on every TP rank)"""
    recompute: str = "none"
    fsdp: bool = True
    compile: bool = False
    """run the layer under ``torch.compile`` (its memory-bound time scaled by
    ``Factors.compile_memory_bound``)"""
    routed: float | None = None
    """with ep > 1: the rows this rank's experts received in this layer, as a multiple of balanced
    routing's (a measured run's: ``estimate(routed=...)``); None: ``Setting.moe_capacity``"""


def setting_of(plan, routed: dict[str, float] | None = None) -> tuple[Setting, list[LayerChoice]]:
    """The (Setting, per-layer choices) a :class:`~autopar_nb.plan.Plan` stands for; ``routed``:
    layer path -> the rows one rank's experts received there as a multiple of balanced routing's
    (a measured run's, ``verify.measure.routed_rows``; a layer it lacks: 1), costed in place of the
    plan's ``mesh.moe_capacity`` (:attr:`LayerChoice.routed`)."""
    m = plan.mesh
    mb = plan.batch.global_batch / (m.dp * plan.batch.micro_batches)
    # a layer the planner put under TP: split modules, or only sequence-parallel norms (the final
    # norm between SP blocks and a vocab-parallel head): the runtime then shards its activations
    # along the sequence
    tp_on = [any(st in ("colwise", "rowwise", "sequence_parallel") for st in lp.tp.values())
             for lp in plan.layers]
    sp = any(lp.sequence_parallel for lp in plan.layers)
    s = Setting(m.dp, m.tp, m.pp, m.zero_stage, plan.precision.amp, plan.batch.micro_batches, mb,
                plan.pipeline.schedule, plan.pipeline.virtual_stages, sp, plan.optimizer.name, m.ep,
                bool(plan.fused_loss), m.cp, plan.fused_norm, plan.precision.float8, plan.async_tp,
                m.offload, m.moe_capacity)
    choices = [LayerChoice(lp.stage, on, lp.recompute, lp.fsdp, lp.compile,
                           None if routed is None else routed.get(lp.path, 1.0))
               for lp, on in zip(plan.layers, tp_on, strict=True)]
    return s, choices

