"""Why a model cannot be pipelined or context-parallel ("" when it can): checks of the whole graph
that the planner reads before it searches those degrees."""

from __future__ import annotations

from .facts import FLOAT, Facts


def pp_blocker(f: Facts) -> str:
    """Why pipeline stages cannot be cut between layers ("" when they can): ``runtime/pp_split.py``
    traces the model with ``torch.export`` (torch's ``pipeline()``), so a model only the eager
    fallback of capture could record cannot be split. Anything else the layers pass on is a tensor
    the stages send (a non-contiguous view as its contiguous copy, a value read further on passed
    through the stages between)."""
    if f.graph.tracer != "torch.export":
        return (f"pipelining traces the model with torch.export, which could not trace "
                f"{f.graph.model_type} (capture recorded an eager forward pass instead); make the "
                "model exportable (torch.export.export) to pipeline it")
    return ""


def cp_blocker(graph, device_kind: str = "cuda") -> str:
    """Why context parallelism (``runtime/cp.py``: torch's ring attention over SDPA, each rank
    holding a load-balanced part of every sequence) cannot run this model; "" when it can: one
    (batch, seq) input of token ids, attention only through ``scaled_dot_product_attention`` without
    a mask, and no position computed with ``torch.arange`` inside forward (it would number the
    rank's part, not the sequence) unless the forward takes ``position_ids``: the runtime then
    passes each token's place in the whole sequence, and the model numbers nothing itself
    (Hugging Face's decoders). On the CPU, attention without dropout: the CPU's fused SDPA kernel
    takes none, so SDPA with dropout falls back to its math form, whose separate ops (the mask's
    add among them) the ring cannot split (GPT-2's default attn_pdrop 0.1 fails so on 2 gloo
    processes; CUDA's flash and efficient kernels take dropout)."""
    if graph.seq_len is None or len(graph.inputs) != 1 or len(graph.inputs[0].shape) != 2 or \
            graph.inputs[0].dtype in FLOAT:
        return "the model does not take one (batch, seq) tensor of token ids"
    attention = [n for n in graph.nodes if n.op_class == "attention"]
    if not attention or any("scaled_dot_product" not in n.op for n in attention):
        return ("its attention is not torch's scaled_dot_product_attention (which the ring "
                "replaces)")
    masked = next((n for n in attention if len(n.inputs) > 3), None)
    if masked is not None:
        return (f"the attention of {masked.module_path or 'the model'} takes a mask (ring "
                "attention takes none)")
    dropped = next((n for n in attention if n.dropout_p), None)
    if device_kind == "cpu" and dropped is not None:
        return (f"the attention of {dropped.module_path or 'the model'} has dropout "
                f"{dropped.dropout_p:g}, which the CPU's fused attention kernel, the one the ring "
                "splits, does not take (set the attention dropout to 0 in the model's config to "
                "split its sequences on CPU)")
    arange = next((n for n in graph.nodes if n.op.startswith("aten.arange")), None)
    if arange is not None and not graph.takes_positions:
        return (f"{arange.module_path or 'the model'} computes positions with torch.arange inside "
                "forward (each rank would number its own part of the sequence), and its forward "
                "takes no position_ids to be given them")
    return ""
