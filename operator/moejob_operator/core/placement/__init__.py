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

Modules: ``strategies`` (the table of strategies: names, needs, solvers), ``layout`` (the
``Placement`` result), ``packing`` (greedy packing blocks), ``refine`` (``topology_aware``),
``exact`` (``brute_force``), ``heldout`` (held-out estimate of a fitted layout); ``solve`` here
runs a row of the table.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from moe_contracts.routing import RoutingStats

from ..topology import ClusterTopology
from .exact import BRUTE_FORCE_LIMIT, brute_force_count
from .heldout import HELDOUT_OPTIMISM, heldout_estimate, heldout_optimism
from .layout import LOAD_TOLERANCE, Placement
from .packing import _levels, _permutation_from_ranks
from .refine import MAX_STARTS, MULTI_START_WORK, tolerance_to_keep
from .strategies import CONTIGUOUS, FITTED, NAMES, LayerInputs, Strategy, lookup

STRATEGIES = NAMES  # the plan's strategy names (``strategies.REGISTRY``)
FITTED_STRATEGIES = FITTED

__all__ = [
    "BRUTE_FORCE_LIMIT",
    "FITTED_STRATEGIES",
    "HELDOUT_OPTIMISM",
    "LOAD_TOLERANCE",
    "MAX_STARTS",
    "STRATEGIES",
    "Placement",
    "Strategy",
    "brute_force_count",
    "heldout_estimate",
    "heldout_optimism",
    "lookup",
    "solve",
    "tolerance_to_keep",
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
    tol: float | Sequence[float] = LOAD_TOLERANCE,
) -> Placement:
    """Place ``num_experts`` experts of each of ``num_layers`` layers on ``ep_size`` EP ranks
    over all GPUs of ``topo`` (world size = ``topo.num_gpus``) with the row of
    ``strategies.REGISTRY`` named ``strategy``. ``tol``: the load tolerance, one for every layer
    or one per layer."""
    W, E, L, P = topo.num_gpus, num_experts, num_layers, ep_size
    row = lookup(strategy)
    if P < 1 or E % P or W % P:
        raise ValueError(f"ep_size {P} must divide num_experts {E} and the world size {W}")
    if stats is not None and (stats.num_layers, stats.num_experts) != (L, E):
        raise ValueError(
            f"routing stats are {stats.num_layers} layers x {stats.num_experts} experts, "
            f"the model has {L} x {E}"
        )
    notes: tuple[str, ...] = ()
    fell_back = row.needs_stats and stats is None
    if fell_back:
        notes = (f"{strategy}: no routing statistics, fell back to contiguous",)
        row = CONTIGUOUS
    rank2gpu = np.arange(W) if row.keeps_gpu_order else topo.gpu_order()
    rank_node, rank_group = _levels(topo, rank2gpu[:P])
    starts = max(1, min(MAX_STARTS, MULTI_START_WORK // (L * E)))
    tols = np.broadcast_to(np.asarray(tol, dtype=float), (L,))
    perm = np.empty((L, E), dtype=np.int64)
    for layer in range(L):
        inputs = LayerInputs(
            stats, layer, L, E, P, rank_node, rank_group, E // P, float(tols[layer]), seed, starts
        )
        perm[layer] = _permutation_from_ranks(row.solve_layer(inputs), P)
    return Placement(strategy, perm, rank2gpu, P, notes, fell_back=fell_back).validate(topo)
