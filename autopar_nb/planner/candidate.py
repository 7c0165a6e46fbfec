"""A costed candidate plan: the search's setting and per-layer choices with their cost."""

from __future__ import annotations

from dataclasses import dataclass

from ..cost.setting import LayerChoice, Setting
from ..plan import Cost


@dataclass
class Candidate:
    """A costed candidate plan."""

    setting: Setting
    choices: list[LayerChoice]
    cost: Cost
    limit: float
    other: Candidate | None = None
    """the same setting with the loss fused where this one is not, or not fused where it is, when
    both were costed (``Search.fused_variant``): what the choice saved or would have saved"""
    norm_other: Candidate | None = None
    """the same setting with the other choice of fused RMSNorms, when both were costed
    (``Search.norm_variant``)"""
    origin: tuple | None = None
    """the (setting, choices) its variants were made from (``Search._variants``)"""
    roomier_than: Candidate | None = None  # a faster one, tight in memory (levers.roomier)

    @property
    def fits(self) -> bool:
        return self.cost.peak_memory_bytes <= self.limit

    @property
    def key(self) -> tuple:
        s = self.setting
        return (s.dp, s.tp, s.pp, s.zero_stage, s.micro_batches, s.schedule, s.virtual_stages, s.ep,
                s.cp)



def memory_limit(cluster) -> float:
    """Bytes one rank may use (``Cluster.rank_memory_bytes``)."""
    return cluster.rank_memory_bytes
