"""``brute_force``: the exact optimum of the cost model over all balanced assignments (tiny
sizes only; the reference the heuristics are tested against)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import numpy as np

from moe_contracts.routing import RoutingStats

from ..cost import cross_counts_for_candidates
from .packing import _lpt

BRUTE_FORCE_LIMIT = 200_000  # candidate assignments per layer


def _assignments(E: int, P: int, n: int) -> Iterator[list[int]]:
    """All ways to give each of P ranks n of E experts: yields ``e2r[E]``."""

    def rec(remaining: tuple[int, ...], rank: int, e2r: list[int]) -> Iterator[list[int]]:
        if not remaining:
            yield list(e2r)
            return
        for chosen in itertools.combinations(remaining, n):
            for e in chosen:
                e2r[e] = rank
            rest = tuple(e for e in remaining if e not in chosen)
            yield from rec(rest, rank + 1, e2r)

    yield from rec(tuple(range(E)), 0, [0] * E)


def brute_force_count(E: int, P: int) -> int:
    n = E // P
    return math.factorial(E) // math.prod([math.factorial(n)] * P)


def _brute_force_layer(
    stats: RoutingStats,
    layer: int,
    rank_node: np.ndarray,
    rank_group: np.ndarray,
    n: int,
    tol: float,
) -> np.ndarray:
    """Exact minimum of remote-group + remote-node sends (cost model) for one layer, over all
    assignments whose heaviest rank stays within ``tol`` of the balanced packing's."""
    E, P = stats.num_experts, len(rank_node)
    count = brute_force_count(E, P)
    if count > BRUTE_FORCE_LIMIT:
        raise ValueError(
            f"brute_force: {count} assignments of {E} experts to {P} ranks exceed the "
            f"limit {BRUTE_FORCE_LIMIT}; use topology_aware"
        )
    load = stats.load[layer].astype(float)
    cands = np.array(list(_assignments(E, P, n)))  # cands[C, E]
    rank_load = np.zeros((len(cands), P))
    np.add.at(rank_load, (np.arange(len(cands))[:, None], cands), load[None, :])
    ref = np.bincount(_lpt(load, np.full(P, n)), weights=load, minlength=P).max()
    feasible = rank_load.max(axis=1) <= (1 + tol) * ref + 1e-9
    cost = cross_counts_for_candidates(cands[feasible], rank_group, rank_node, stats, layer)
    order = np.lexsort((rank_load.max(axis=1)[feasible], cost))
    best: np.ndarray = cands[feasible][order[0]]
    return best
