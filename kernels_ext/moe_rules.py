"""Rules for the ops of Mixture-of-Experts layers: grouped matmuls over experts and the routing ops around them.

Expert FLOPs are counted by *active* parameters: a grouped matmul multiplies each of its S rows (token-expert pairs,
S = tokens x top_k) by the weight of one expert only, so its forward costs 2 * S * K * N whatever the number of
experts E and however the tokens are spread over them (balanced or not, the sum of the groups is S). Bytes count
every expert's weights once per call (each is read once when it got at least one token; balanced routing with
S >= E reaches all of them).

Which op a model's experts record at capture (transformers 5.x, ``transformers/integrations/moe.py``):

* ``config._experts_implementation == "grouped_mm"`` (the default): ``torch.nn.functional.grouped_mm`` ->
  ``aten._grouped_mm`` where torch can run it (bf16 on the meta device; CUDA; CPU with torch > 2.8), else the
  custom op ``transformers.grouped_mm_fallback`` (fp32 weights under ``torch.export``/compile, which is what a
  default fp32 model captured on the meta device records); its backward is
  ``transformers.grouped_mm_fallback_backward``.
* ``"batched_mm"``: ``aten.bmm`` on weights gathered per pair (already costed by the ATen rules, with the right FLOPs).
* ``"eager"``: a Python loop over ``nonzero()`` experts, data-dependent: it cannot be traced on the meta device.
* ``autopar_nb.zoo.GroupedExperts``: the custom op ``autopar_zoo.grouped_linear`` (a portable loop of matmuls).

The routing ops (top-k, sort, histc, ...) do no matmul arithmetic: they are costed by the bytes they move. They are
registered here only when no other rule already covers them.
"""

from __future__ import annotations

from .registry import OpRule, lookup, register_op


def _grouped_mm(args, kwargs, outs):
    # aten._grouped_mm(mat_a, mat_b, offs): 2D (S, K) x 3D (G, K, N) -> (S, N); 3D x 3D -> (G, M, N); 3D x 2D (jagged
    # N) -> (M, N_total): 2 * out.numel * K. 2D (M, K_total) x 2D (K_total, N), K jagged by offs -> (G, M, N): each
    # group contracts only its own slice of K, 2 * M * N * K_total.
    a, b, out = args[0], args[1], outs[0]
    if len(a.shape) == 2 and len(b.shape) == 2:
        return 2 * (out.numel // out.shape[0]) * a.shape[1]
    return 2 * out.numel * a.shape[-1]


def _grouped_rows(args, kwargs, outs):
    # x (S, K) rows grouped by expert times one (K, N) expert weight each -> (S, N): 2 * S * K * N
    return 2 * outs[0].numel * args[0].shape[-1]


def _fallback_backward(args, kwargs, outs):
    # transformers.grouped_mm_fallback_backward(input (S, K), weight (E, K, N), offs, grad (S, N)): dX and dW
    x, w = args[0], args[1]
    return 2 * 2 * x.numel * w.shape[-1]


def _zoo_backward(args, kwargs, outs):
    # autopar_zoo.grouped_linear_backward(x (S, K), weight (G, N, K), offs, grad (S, N)): dX and dW
    x, w = args[0], args[1]
    return 2 * 2 * x.numel * w.shape[1]


def _per_output(args, kwargs, outs):
    return sum(o.numel for o in outs)


# backward of a grouped matmul: grad wrt input and grad wrt the expert weights, like a Linear (factor 2). It keeps
# its token rows for backward ("input"), not "inputs": the weight often arrives as a transposed view of the stacked
# expert parameter (HF's weight.transpose(-2, -1)), which the memory model would otherwise count as an activation.
_SAVES_ROWS = ("input",)
GROUPED_MATMULS = [
    OpRule(name="aten._grouped_mm", op_class="matmul", flops=_grouped_mm, backward_factor=2.0, saves=_SAVES_ROWS),
    OpRule(name="aten._scaled_grouped_mm", op_class="matmul", flops=_grouped_mm, backward_factor=2.0,
           saves=_SAVES_ROWS),
    OpRule(name="aten._scaled_grouped_mm_v2", op_class="matmul", flops=_grouped_mm, backward_factor=2.0,
           saves=_SAVES_ROWS),
    OpRule(name="transformers.grouped_mm_fallback", op_class="matmul", flops=_grouped_rows, backward_factor=2.0,
           saves=_SAVES_ROWS),
    OpRule(name="transformers.grouped_mm_fallback_backward", op_class="matmul", flops=_fallback_backward,
           backward_factor=0.0),
    OpRule(name="autopar_zoo.grouped_linear", op_class="matmul", flops=_grouped_rows, backward_factor=2.0,
           saves=_SAVES_ROWS),
    OpRule(name="autopar_zoo.grouped_linear_backward", op_class="matmul", flops=_zoo_backward, backward_factor=0.0),
]
# routing around the experts: memory-bound, costed by bytes (index bookkeeping, no matmul FLOPs)
ROUTING = [
    OpRule(name=f"aten.{name}", op_class="reduction", flops=None, backward_factor=0.0)
    for name in ("topk", "sort", "argsort", "histc", "bincount")
] + [
    OpRule(name=f"aten.{name}", op_class="elementwise", flops=_per_output, backward_factor=1.0)
    for name in ("floor_divide", "index_put", "index_add", "scatter_add", "one_hot")
]

for _rule in GROUPED_MATMULS:
    register_op(_rule)
for _rule in ROUTING:
    if lookup(_rule.name) is None:  # an ATen rule elsewhere may come to cover it: that one wins
        register_op(_rule)
