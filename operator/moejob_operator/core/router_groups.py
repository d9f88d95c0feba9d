"""Placement for models whose router picks groups of experts first (DeepSeek-V3 ``n_group`` /
``topk_group``).

Hugging Face and AutoEP take router group ``j`` to be the contiguous expert ids
``[j * gs, (j + 1) * gs)`` (``gs = E / n_group``). A permutation that mixes experts of different
groups into one block therefore changes which experts compete in a group: it changes the model.
A permutation keeps the model when every block of ``gs`` slots holds one whole original group
(the order of groups, and of experts inside a group, is free: group scores and top-k do not
depend on it).

``solve`` keeps groups whole by solving on the coarse problem (one item per router group, its
load and co-activation summed) with the same strategies, then expanding each group back to its
experts. With ``gs <= E / P`` groups sit inside one EP rank; with ``gs > E / P`` a group spans
``gs / (E / P)`` consecutive EP ranks, which the rank order (NVLink group, then node) keeps in
one NVLink group whenever that many ranks fit in it. Either way a router group lies inside one
NVLink group, so a token reaches at most ``topk_group`` groups of ranks: at most
``topk_group - 1`` remote NVLink groups.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from moe_contracts.routing import RoutingStats

from .placement import LOAD_TOLERANCE, Placement
from .placement import solve as solve_experts
from .topology import ClusterTopology


def coarse_stats(stats: RoutingStats, n_group: int) -> RoutingStats:
    """One item per router group: load and co-activation summed over the group's experts."""
    L, E = stats.load.shape
    gs = E // n_group
    load = stats.load.reshape(L, n_group, gs).sum(-1)
    coact = stats.coact.reshape(L, n_group, gs, n_group, gs).sum((2, 4))
    coact[:, np.arange(n_group), np.arange(n_group)] = 0
    te = None if stats.token_experts is None else stats.token_experts // gs
    return RoutingStats(
        L,
        n_group,
        min(stats.top_k, n_group),
        stats.tokens,
        load,
        coact,
        stats.steps,
        stats.source,
        stats.model,
        te,
    )


def keeps_groups(permutation: np.ndarray, n_group: int) -> bool:
    """Whether every block of ``E / n_group`` slots holds exactly one original router group."""
    L, E = permutation.shape
    gs = E // n_group
    blocks = np.sort(permutation.reshape(L, n_group, gs), axis=-1)
    return bool(
        ((blocks // gs) == (blocks[..., :1] // gs)).all() and (blocks % gs == np.arange(gs)).all()
    )


def solve(
    strategy: str,
    topo: ClusterTopology,
    stats: RoutingStats | None,
    *,
    ep_size: int,
    num_experts: int,
    num_layers: int,
    n_group: int = 1,
    seed: int = 0,
    tol: float | Sequence[float] = LOAD_TOLERANCE,
) -> Placement:
    """``core.placement.solve`` with router groups kept whole (``n_group`` > 1)."""
    if n_group <= 1:
        return solve_experts(
            strategy,
            topo,
            stats,
            ep_size=ep_size,
            num_experts=num_experts,
            num_layers=num_layers,
            seed=seed,
            tol=tol,
        )
    E, P = num_experts, ep_size
    if E % n_group:
        raise ValueError(f"n_group {n_group} does not divide num_experts {E}")
    gs, n = E // n_group, E // P
    if n % gs == 0 and n_group % P == 0:  # whole groups per rank: solve on groups
        coarse = None if stats is None else coarse_stats(stats, n_group)
        pl = solve_experts(
            strategy,
            topo,
            coarse,
            ep_size=P,
            num_experts=n_group,
            num_layers=num_layers,
            seed=seed,
            tol=tol,
        )
        perm = (pl.permutation[:, :, None] * gs + np.arange(gs)).reshape(num_layers, E)
        notes = (*pl.notes, f"router groups ({n_group} of {gs} experts) placed whole")
        return Placement(pl.strategy, perm, pl.rank2gpu, P, notes).validate(topo)
    if gs % n == 0:  # a group spans gs / n consecutive ranks
        rank2gpu = np.arange(topo.num_gpus) if strategy == "contiguous" else topo.gpu_order()
        perm = np.tile(np.arange(E), (num_layers, 1))
        return Placement(
            strategy,
            perm,
            rank2gpu,
            P,
            (
                (
                    f"router groups of {gs} experts span {gs // n} EP ranks: kept in id order, "
                    "ranks ordered by NVLink group"
                ),
            ),
        ).validate(topo)
    raise ValueError(
        f"router groups of {gs} experts neither fill nor divide the {n} experts per EP rank"
    )
