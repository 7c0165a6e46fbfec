"""The walk over the captured graph that the whole cost model reads (:mod:`.layers`)."""

from .layers import (
    FLOAT,
    GROUPED_MATMULS,
    PRECISIONS,
    AmpTime,
    Comm,
    Crossing,
    GraphProfile,
    LayerProfile,
    Moment,
    Repeatable,
    Saved,
    cp_blocker,
    no_cycle_collection,
    once_per_graph,
    precision_of,
    profile,
    profile_of,
)
from .layers import _accumulating_gradients as _accumulating_gradients  # the moments' own checks read them
from .layers import _facts as _facts

__all__ = ["FLOAT", "GROUPED_MATMULS", "PRECISIONS", "AmpTime", "Comm", "Crossing", "GraphProfile", "LayerProfile",
           "Moment", "Repeatable", "Saved", "cp_blocker", "no_cycle_collection", "once_per_graph", "precision_of",
           "profile", "profile_of"]
