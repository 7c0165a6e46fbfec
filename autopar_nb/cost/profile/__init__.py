"""One walk over the captured graph that the whole cost model reads: per layer, the FLOPs and bytes
by op class (split into the part tensor parallelism divides and the part it replicates), what
autograd saves for backward, the tensor-parallel styles of its modules, and the collectives those
styles imply.

Everything is measured at the captured batch and scales linearly with samples per micro-batch
(attention-score terms with the square of the sequence length). Computed once per (graph, device
kind); the planner only does arithmetic on the result.

Tensor-parallel styles come from :mod:`..tp_styles`.

What each op keeps for backward, how it splits under TP and how a view lays out its result come from
its ``kernels_ext`` rule (``OpRule.saves``, ``splits``, ``tp_role``, ``layout``), so a registered
custom op is costed like a built-in one. Saved tensors are counted once per storage: views share
their base's storage, a non-contiguous view that an op flattens (``OpRule.flattens_ndim``) or a
reshape copies becomes a copy of its own. On CUDA dropout saves a 1-byte mask and RMSNorm is fused
(input + rstd); on CPU dropout saves a noise tensor of the input's dtype and RMSNorm is decomposed
(input, normalised input and rstd are saved).

The modules: :mod:`.driver` runs the passes (:func:`profile`) and caches the result
(:func:`profile_of`); :mod:`.layers` holds what they produce; :mod:`.facts` what they all read.
The passes: :mod:`.compute` (FLOPs, bytes, autocast's time terms), :mod:`.saved` and
:mod:`.moments` (saved activations, what each op's backward and forward holds beside them),
:mod:`.comms` (TP collectives), :mod:`.tp` (styles, divisors), :mod:`.params` (parameters,
experts), :mod:`.crossings` (layer boundaries, pipeline cuts), :mod:`.blockers` (what rules out
pipeline or context parallelism).
"""

from .blockers import cp_blocker
from .driver import no_cycle_collection, once_per_graph, profile, profile_of
from .facts import FLOAT, graph_facts
from .layers import (
    PRECISIONS,
    AmpTime,
    Comm,
    Crossing,
    GraphProfile,
    LayerProfile,
    Moment,
    Repeatable,
    Saved,
    precision_of,
)
from .moments import accumulating_gradients
from .params import GROUPED_MATMULS

# checks outside the package build facts and read accumulating gradients by these names
_facts, _accumulating_gradients = graph_facts, accumulating_gradients

__all__ = ["FLOAT", "GROUPED_MATMULS", "PRECISIONS", "AmpTime", "Comm", "Crossing",
           "GraphProfile", "LayerProfile", "Moment", "Repeatable", "Saved", "cp_blocker",
           "no_cycle_collection", "once_per_graph", "precision_of", "profile", "profile_of"]
