"""Bytes per tier that each expert-parallel dispatcher sends, exactly, for sampled tokens: the
planner's side of ``placement.quality.dispatch``.

The byte model itself (AutoEP's all-to-all and the trainer's de-duplicating two-stage dispatcher,
per tier of the receiver) is :mod:`moe_contracts.dispatch`, shared with the smoke test, which
checks the trainer's measured counters against it. Here it is applied to a :class:`Placement` on
a topology, for sampled tokens: token ``t`` starts on global rank ``t % world_size`` (as in
:mod:`.cost`). These are the figures the trainer's counters measure
(``moe.allToAllBytesPerStepByTier`` in progress).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from moe_contracts.dispatch import (
    COUNT_BYTES,
    DISPATCHERS,
    ID_BYTES,
    TIERS,
    WEIGHT_BYTES,
    dispatch_groups,
    tier_bytes,
)

from .topology import ClusterTopology

if TYPE_CHECKING:
    from .placement import Placement

__all__ = [
    "COUNT_BYTES",
    "DISPATCHERS",
    "ID_BYTES",
    "TIERS",
    "WEIGHT_BYTES",
    "dispatch_bytes",
    "dispatch_groups",
    "per_step",
]


def dispatch_bytes(
    placement: Placement,
    topo: ClusterTopology,
    token_experts: np.ndarray,
    *,
    hidden_size: int,
    bytes_per_elem: int,
    backward: bool = True,
) -> dict[str, dict[str, float]]:
    """``token_experts[L, T, K]`` (original ids) -> ``{"autoep": {tier: bytes}, "dedup": {...}}``
    for routing those T tokens through every layer once (forward, + backward when asked); the byte
    model is :func:`moe_contracts.dispatch.tier_bytes` (the smoke test checks the trainer's
    counters against the same function)."""
    L, T, _ = token_experts.shape
    W = placement.world_size
    expert2rank = np.stack([placement.expert2rank(layer) for layer in range(L)])
    return tier_bytes(
        expert2rank,
        token_experts,
        np.arange(T) % W,
        topo.group_of[placement.rank2gpu],
        topo.node_of[placement.rank2gpu],
        placement.ep_size,
        hidden_bytes=hidden_size * bytes_per_elem,
        backward=backward,
    )


def per_step(
    bytes_by_dispatcher: dict[str, dict[str, float]], scale: float
) -> dict[str, dict[str, int]]:
    """Scale to a step and round: ``{dispatcher: {tierBytesPerStep: int}}`` for the plan."""
    return {
        d: {f"{tier}BytesPerStep": round(v * scale) for tier, v in tiers.items()}
        for d, tiers in bytes_by_dispatcher.items()
    }
