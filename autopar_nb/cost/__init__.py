"""The cost model: per-rank memory and step time of a candidate plan, from the captured graph and
the cluster.

Pipeline: :func:`profile` walks the graph once (FLOPs/bytes by op class, saved activations, TP
styles), then :class:`Evaluator` turns plain choices (:class:`Setting`, :class:`LayerChoice`) into a
:class:`~autopar_nb.plan.Cost` using :mod:`.memory`, :mod:`.comm` and :mod:`.time`; every
efficiency/overlap/margin factor is in :mod:`.factors`.
"""

from .estimate import Evaluator, estimate
from .factors import Factors, factors_for
from .memory import MIXED_ADAM, TORCH_ADAM, StateBytes, activation_bytes, in_flight, model_states
from .profile import GraphProfile, LayerProfile, profile, profile_of
from .setting import LayerChoice, Setting, setting_of

__all__ = ["MIXED_ADAM", "TORCH_ADAM", "Evaluator", "Factors", "GraphProfile", "LayerChoice",
           "LayerProfile", "Setting", "StateBytes", "activation_bytes", "estimate", "factors_for",
           "in_flight", "model_states", "profile", "profile_of", "setting_of"]
