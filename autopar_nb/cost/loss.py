"""The loss at the end of the model: which output head the fused linear + cross-entropy can stand in
for (``plan.fused_loss``), and what fusing changes in memory and time.

Units: bytes, FLOPs, seconds. Tokens N (per micro-batch), hidden H, vocab V, chunk C tokens
(``kernels_ext.default_chunk``), p the compute dtype's bytes (2 under AMP, else 4).

Unfused (the default loss, counted by :meth:`.moments.RankMemory.moments`): at the loss's backward
the fp32 log-softmax (saved), its gradient and the logits' gradient are alive, N x V x (4 + 4 + p)
bytes, and the head's backward works on the N x V logits' gradient.

Fused (``kernels_ext.linear_cross_entropy``'s chunked op): forward keeps the head's input (the
Linear saved it anyway) and one fp32 log-sum-exp per token (N x 4). Its backward recomputes each
chunk's logits and holds, at its peak, three fp32 C x V buffers (the previous chunk's probabilities
while the next chunk's shifted logits and their exp are made) and under AMP the previous chunk's
p-byte gradient cast (C x V x 2), plus the weight's gradient accumulated in fp32 (V x H x 4, and its
p-byte cast under AMP) and the hidden's gradient (N x H x p). Measured on CPU with the profiler's
allocation events (N 2048, H 64, V 8192, C 256): 3.00 C x V x 4 above the gradients in fp32, 3.63
under bf16 autocast (3.5 by this count; the rest is the bf16 copies of the inputs). Time: the head's
forward matmul once more (2 N H V FLOPs): the logits are recomputed in backward. On CUDA with
Liger-kernel installed, its kernel computes the gradients in forward instead (no recompute; a peak
of the same order), which this does not model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kernels_ext.fused import default_chunk

from ..plan import layer_of

CHUNK_FP32_BUFFERS = 3
"""fp32 C x V buffers alive at once in the fused backward (see the module docstring)"""


@dataclass(frozen=True)
class FusedHead:
    """The output head that ``plan.fused_loss`` names, as the cost model needs it."""

    module: str
    """the head Linear's module path ("lm_head")"""
    layer: int
    """index of the layer (``ModelGraph.layers``) that holds it"""
    hidden: int
    """H: the Linear's in_features"""
    vocab: int
    """V: its out_features"""
    tokens: int
    """N at the captured batch (batch x sequence)"""

    def chunk(self, tokens: float) -> int:
        """Tokens per chunk for ``tokens`` per micro-batch (``kernels_ext.default_chunk``, as the
        runtime picks)."""
        return default_chunk(max(1, math.ceil(tokens)), self.hidden, self.vocab)

    def saved_bytes(self, tokens: float) -> float:
        """What the fused op keeps for backward beyond its input: one fp32 log-sum-exp per token."""
        return tokens * 4

    def temp_bytes(self, tokens: float, *, half: bool, tp: int = 1) -> float:
        """The fused backward's peak temporaries (module docstring): chunk buffers, the weight's
        gradient accumulated in fp32 (plus its cast under AMP) and the hidden's gradient. Split on
        the vocabulary over ``tp`` ranks (kernels_ext's vocab-parallel op, the same chunk length): a
        rank's rows, ceil(V / tp)."""
        p = 2 if half else 4
        rows = math.ceil(self.vocab / tp)
        chunk = self.chunk(tokens) * rows * (CHUNK_FP32_BUFFERS * 4 + (2 if half else 0))
        weight_grad = rows * self.hidden * (4 + (2 if half else 0))
        return chunk + weight_grad + tokens * self.hidden * p

    def tp_forward_bytes(self, tokens: float) -> float:
        """Bytes the vocab-parallel forward all-reduces: per token the logits' maximum (one fp32),
        then the sum of exponentials and the picked target logit (two fp32)."""
        return tokens * 3 * 4

    def recompute_flops(self, tokens: float) -> float:
        """FLOPs the fused backward adds: the logits again, 2 N H V."""
        return 2.0 * tokens * self.hidden * self.vocab


def gathered_logits(s, prof, seq_ratio: float) -> float:
    """Bytes a TP-split output head's forward holds beyond its logits' shard when the loss does not
    run on the shards (a model that transforms its logits: ``Setting.vocab_parallel_loss``):
    DTensor's all-gather into a buffer of tp shards and the whole logits its chunks are concatenated
    into, in the compute dtype; on CPU one more such buffer, which gloo gathers into first
    (ProcessGroupGloo's allgather makes a flat output and copies it out: a storage no op made, in a
    MemTracker census of a pipelined LLaMA's last stage)."""
    if s.fused_loss or s.vocab_parallel_loss(capable=prof.loss_parallel, head_tp=True):
        return 0.0
    numel = prof.output_numel * (s.mb_samples / prof.batch) * seq_ratio / s.cp
    return numel * s.compute_item * (3 if prof.device_kind == "cpu" else 2)


def unfused_loss_bytes(logits_numel: float, *, half: bool) -> float:
    """The unfused default loss at its backward: fp32 log-softmax (saved) and its gradient, and the
    logits' gradient in the compute dtype (``RankMemory.moments``'s loss moment, before the head's
    own backward)."""
    return logits_numel * (4 + 4 + (2 if half else 4))


def fused_head(graph) -> tuple[FusedHead | None, str]:
    """(the head ``plan.fused_loss`` can name, "") or (None, why not). The default loss's case: 2-D
    token ids in, and the model's output is the output of its last ``aten.linear``, a bias-free
    ``nn.Linear`` whose result nothing else reads (the fused head returns the loss in its place,
    which must reach the output unchanged)."""
    if graph.seq_len is None:
        first = graph.inputs[0] if graph.inputs else None
        return None, (f"the first input is not token ids of shape (batch, seq) (got "
                      f"{tuple(first.shape) if first else None}): the default loss is not a "
                      "next-token cross-entropy")
    if len(graph.outputs) != 1 or len(graph.outputs[0].shape) != 3:
        return None, "the model's output is not one (batch, seq, vocab) tensor of logits"
    read = {i for n in graph.nodes for i in n.inputs}
    linear = next((n for n in reversed(graph.nodes) if n.op.startswith("aten.linear")), None)
    if linear is None:
        return None, "the model has no Linear output head"
    out = graph.outputs[0]
    if linear.name in read or tuple(linear.out_shapes[0]) != tuple(out.shape):
        return None, (f"the output of the last Linear ({linear.module_path or 'the model'}) is not "
                      "the model's output (the model transforms its logits)")
    if len(linear.in_shapes) > 2 or linear.module_type != "Linear" or not linear.module_path:
        return None, (f"the output head {linear.module_path or 'of the model'} is not a bias-free "
                      "nn.Linear")
    vocab, hidden = linear.in_shapes[1]
    layers = [lay.path for lay in graph.layers]
    layer = layer_of(linear.module_path, layers)
    if layer is None:
        return None, f"no layer holds the output head {linear.module_path}"
    return FusedHead(linear.module_path, layers.index(layer), hidden, vocab,
                     math.prod(out.shape[:2])), ""
