"""What the planner predicts for a plan: a step's :class:`Cost` and each rank's
:class:`MemoryBreakdown` at its peak."""

from __future__ import annotations

from dataclasses import dataclass, field

from .checks import (
    PlanError,
    check_bool,
    check_choice,
    check_int,
    check_list,
    check_number,
    check_numbers,
    check_str,
)


@dataclass
class MemoryBreakdown:
    """Predicted bytes on one rank at its peak."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    buffers: float = 0.0
    """temporary buffers: FSDP all-gather/reduce-scatter buffers, TP comm buffers, pipeline
    send/recv"""
    margin: float = 0.0
    """allocator fragmentation and workspace margin"""
    host: float = 0.0
    """bytes this rank keeps in host memory (``mesh.offload``: its FSDP shards and optimizer
    states), not in total"""
    terms: dict[str, float] = field(default_factory=dict)
    """the named terms ``activations`` and ``buffers`` are made of, by :data:`MEMORY_TERMS` name
    (bytes)"""

    def __post_init__(self):
        check_numbers(self, "memory", _MEMORY_FIELDS)
        if not isinstance(self.terms, dict):
            raise PlanError(f"memory.terms must be a JSON object, got {self.terms!r} "
                            f"({type(self.terms).__name__})")
        # (the planner makes one per rank and candidate: fast when valid)
        for name, value in self.terms.items():
            if type(name) is not str or name not in MEMORY_TERMS:
                check_choice("memory.terms", name, tuple(MEMORY_TERMS))
            if type(value) is not float:
                check_number(f"memory.terms[{name!r}]", value, finite=False)

    @property
    def total(self) -> float:
        return (self.params + self.grads + self.optimizer + self.activations + self.buffers
                + self.margin)


_MEMORY_FIELDS = ("params", "grads", "optimizer", "activations", "buffers", "margin", "host")
MEMORY_TERMS = {
    "saved_activations": "activations", "loss_saved": "activations",
    "autocast_weight_copies": "buffers", "ddp_buckets": "buffers",
    "fsdp_unsharded_params": "buffers", "fsdp_kept_params": "buffers",
    "fsdp_root_params": "buffers",
    "fsdp_gathered_units": "buffers", "fsdp_reduce_scatter": "buffers",
    "fsdp_unsharded_grads": "buffers", "fsdp_weight_pass_grads": "buffers",
    "pipeline_buffers": "buffers", "pipeline_outputs": "activations",
    "pipeline_sent_gradients": "buffers", "weight_pass_gradients": "buffers",
    "backward_working_set": "buffers", "new_weight_gradients": "buffers",
    "forward_working_set": "activations", "fsdp_all_gather": "buffers",
    "replicate_gathered_experts": "buffers", "replicate_reduce_buffers": "buffers",
    "ep_received_rows": "activations", "cp_merge_copies": "activations",
    "loss_temporaries": "buffers", "optimizer_step_temporaries": "buffers",}
"""term of a rank's peak -> the MemoryBreakdown field it is part of: what autograd saves for
backward (every micro-batch in flight); the loss's saved log-softmax; autocast's 16-bit copies of
the weights its lower-precision ops read; DDP's gradient buckets; FSDP's parameters kept unsharded
from forward to backward (ZeRO 2, and replicate) and, under ZeRO-2's gradient accumulation, those
a backward before the last micro-batch keeps gathered; the parameters left in the root unit (ZeRO
3), and the unit being computed plus the prefetched one (ZeRO 3: parameters and their unsharded
gradients); a pipelined FSDP stage's gradients, accumulated unsharded over its micro-batches and
reduce-scattered once after the last, and under a zero-bubble schedule and mixed precision the
16-bit gradients a weight pass leaves until FSDP takes them in; the buffers pipeline stages receive
inputs and gradients into (per micro-batch in flight) and their outputs, kept until each
micro-batch's backward, and the input gradients of the micro-batch before, whose send the schedule
still holds; the gradients a zero-bubble schedule's input pass keeps for each micro-batch's weight
pass; the largest layer's backward working set; the weight gradients a micro-batch's backward makes
where the earlier ones' are accumulated, until autograd adds them in; at a layer's forward, what it
holds then (its saved tensors so far and the storages alive: output, operands still to be read,
autocast's copies) and its FSDP unit's all-gather output; the loss's temporaries (logits and their
copies, loss_parallel's shards); the optimizer step's temporaries; beside DDP, the experts'
replicas' gathered parameters and reduction buffers; under expert parallelism, the token rows
its all-to-all delivered to a layer's experts, held through their forward; under context
parallelism, the merged attention outputs the output projections save (part of what autograd
saves, named apart)"""


@dataclass
class Cost:
    """Predicted cost of one training step, filled by the planner."""

    step_time_s: float = 0.0
    compute_s: float = 0.0
    comm_exposed_s: float = 0.0
    """communication time not hidden behind compute"""
    comm_total_s: float = 0.0
    comm_by_kind: dict[str, float] = field(default_factory=dict)
    """seconds per collective kind: all_reduce, all_gather, reduce_scatter, send_recv, ..."""
    comm_exposed_by_kind: dict[str, float] = field(default_factory=dict)
    """the part of comm_by_kind not hidden behind compute, per kind (sums to comm_exposed_s)"""
    bubble_s: float = 0.0
    optimizer_s: float = 0.0
    cpu_wait_s: float = 0.0
    """time the GPU waits for the host to issue work: the step is CPU-bound where issuing it (eager
    ops, FSDP's and DDP's hooks, TP's DTensor dispatch, the optimizer step) takes longer than
    running it. With compute_s, comm_exposed_s, bubble_s and optimizer_s it sums to step_time_s"""
    cpu_s: float = 0.0
    """the host's time issuing one step (``cost/cpu.py``)"""
    cpu_by_part: dict[str, float] = field(default_factory=dict)
    """cpu_s by part: eager ops, tensor parallel, FSDP, DDP, pipeline, collectives, optimizer"""
    memory_by_rank: list[MemoryBreakdown] = field(default_factory=list)
    peak_memory_bytes: float = 0.0
    model_tflops_per_gpu: float = 0.0
    """model FLOPs (``cost.time.MFU_BASIS``: recompute not counted) per GPU per second, in
    TFLOP/s"""
    hardware_tflops_per_gpu: float = 0.0
    """FLOPs actually executed (with recompute) per GPU per second, in TFLOP/s"""
    mfu: float = 0.0
    """model FLOPs per GPU per second over the device's datasheet peak for the plan's precision"""
    tokens_per_s: float | None = None
    samples_per_s: float = 0.0

    def __post_init__(self):
        check_numbers(self, "cost", _COST_FIELDS)
        if self.tokens_per_s is not None:
            check_number("cost.tokens_per_s", self.tokens_per_s, finite=False)
        for name in ("comm_by_kind", "comm_exposed_by_kind", "cpu_by_part"):
            d = getattr(self, name)
            if not isinstance(d, dict):
                raise PlanError(f"cost.{name} must be a dict of name -> seconds, got {d!r}")
            for k, v in d.items():
                check_str(f"cost.{name} key", k)
                check_number(f"cost.{name}[{k!r}]", v, finite=False)
        check_list("cost.memory_by_rank", self.memory_by_rank, MemoryBreakdown)


_COST_FIELDS = ("step_time_s", "compute_s", "comm_exposed_s", "comm_total_s", "bubble_s",
                "optimizer_s", "cpu_wait_s", "cpu_s", "peak_memory_bytes", "model_tflops_per_gpu",
                "hardware_tflops_per_gpu", "mfu", "samples_per_s")



LEVERS = ("compile", "float8", "async_tp", "offload", "recompute", "fused_loss", "fused_norm")


@dataclass
class Lever:
    """The chosen plan with one speed or memory lever (:data:`LEVERS`) flipped alone, as the planner
    costs it."""

    name: str
    on: bool
    """the lever is on in the plan, so the variant turns it off"""
    step_time_s: float
    peak_memory_bytes: float
    fits: bool = True
    """the variant's predicted step time and peak, and whether that peak fits the device"""
    startup_s: float = 0.0
    """compile's: the seconds Inductor takes at start-up (``cost/compile.py``), weighed over
    ``steps`` of the run"""
    steps: int = 0

    def __post_init__(self):
        check_choice("lever.name", self.name, LEVERS)
        check_bool("lever.on", self.on)
        check_bool("lever.fits", self.fits)
        check_numbers(self, "lever", ("step_time_s", "peak_memory_bytes", "startup_s"))
        check_int("lever.steps", self.steps, minimum=0)
