"""Expert placement solvers: which expert goes to which EP rank, and which GPU each rank runs on.

DeepSpeed puts slot ``s`` of a layer on EP rank ``s // (E / P)`` and forms EP groups from
consecutive global ranks, so a placement is (a) ``permutation[layer, slot] = expert`` applied
to the checkpoint before ``deepspeed.initialize`` and (b) ``rank2gpu[global_rank] = gpu``
(a global GPU index of the ClusterTopology). Every solver except ``contiguous`` orders ranks by
(node, NVLink group, GPU) so consecutive EP ranks fill an NVLink group, then a node, then the
next node; ``contiguous`` keeps node/GPU order (DeepSpeed's default).

Solvers (``solve(strategy, ...)``): ``contiguous``, ``round_robin``, ``balanced`` (EPLB-style
greedy, heaviest expert first into the lightest bin, nodes then groups then GPUs),
``topology_aware`` (co-activation graph partitioning with a load cap, same hierarchy, then
load balancing across the GPUs of a group) and ``brute_force`` (exact, tiny sizes only).

Modules: ``layout`` (the ``Placement`` result), ``packing`` (greedy packing blocks),
``refine`` (``topology_aware``), ``exact`` (``brute_force``), ``heldout`` (held-out estimate of
a fitted layout); ``solve`` here dispatches on the strategy.
"""

from __future__ import annotations

import numpy as np

from moe_contracts.routing import RoutingStats

from ..topology import ClusterTopology
from .exact import BRUTE_FORCE_LIMIT, _brute_force_layer, brute_force_count
from .heldout import FITTED_STRATEGIES, HELDOUT_OPTIMISM, heldout_estimate, heldout_optimism
from .layout import LOAD_TOLERANCE, STRATEGIES, Placement
from .packing import _hierarchical, _levels, _permutation_from_ranks
from .refine import MAX_STARTS, MULTI_START_WORK, _refine_sample, _topology_aware_layer

__all__ = [
    "BRUTE_FORCE_LIMIT",
    "FITTED_STRATEGIES",
    "HELDOUT_OPTIMISM",
    "LOAD_TOLERANCE",
    "MAX_STARTS",
    "STRATEGIES",
    "Placement",
    "brute_force_count",
    "heldout_estimate",
    "heldout_optimism",
    "solve",
]


def solve(
    strategy: str,
    topo: ClusterTopology,
    stats: RoutingStats | None,
    *,
    ep_size: int,
    num_experts: int,
    num_layers: int,
    seed: int = 0,
    tol: float = LOAD_TOLERANCE,
) -> Placement:
    """Place ``num_experts`` experts of each of ``num_layers`` layers on ``ep_size`` EP ranks
    over all GPUs of ``topo`` (world size = ``topo.num_gpus``)."""
    W, E, L, P = topo.num_gpus, num_experts, num_layers, ep_size
    if strategy not in STRATEGIES:
        raise ValueError(
            f"unknown placement strategy {strategy!r} (choose from {', '.join(STRATEGIES)})"
        )
    if P < 1 or E % P or W % P:
        raise ValueError(f"ep_size {P} must divide num_experts {E} and the world size {W}")
    if stats is not None and (stats.num_layers, stats.num_experts) != (L, E):
        raise ValueError(
            f"routing stats are {stats.num_layers} layers x {stats.num_experts} experts, "
            f"the model has {L} x {E}"
        )
    n = E // P
    notes: list[str] = []
    if strategy == "contiguous" or (stats is None and strategy != "round_robin"):
        if strategy != "contiguous":
            notes.append(f"{strategy}: no routing statistics, fell back to contiguous")
        perm = np.tile(np.arange(E), (L, 1))
        return Placement(
            strategy, perm, np.arange(W), P, tuple(notes), fell_back=strategy != "contiguous"
        ).validate(topo)
    rank2gpu = topo.gpu_order()
    if strategy == "round_robin":
        perm = np.tile(_permutation_from_ranks(np.arange(E) % P, P), (L, 1))
        return Placement(strategy, perm, rank2gpu, P).validate(topo)
    rank_node, rank_group = _levels(topo, rank2gpu[:P])
    perm = np.empty((L, E), dtype=np.int64)
    assert stats is not None  # without statistics every other strategy fell back above
    starts = max(1, min(MAX_STARTS, MULTI_START_WORK // (L * E)))
    for layer in range(L):
        load = stats.load[layer].astype(float)
        coact = stats.coact[layer].astype(float) / max(stats.tokens, 1)
        if strategy == "brute_force":
            e2r = _brute_force_layer(stats, layer, rank_node, rank_group, n, tol)
        elif strategy == "balanced":
            e2r = _hierarchical(load, rank_node, rank_group, n)
        else:
            e2r = _topology_aware_layer(
                load,
                coact,
                rank_node,
                rank_group,
                n,
                tol,
                np.random.default_rng([seed, layer]),
                starts,
                _refine_sample(stats, layer, L),
            )
        perm[layer] = _permutation_from_ranks(e2r, P)
    return Placement(strategy, perm, rank2gpu, P, tuple(notes)).validate(topo)
