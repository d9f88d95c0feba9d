"""Packing blocks shared by the solvers: EPLB-style greedy packing (flat, by level, per
NVLink group), random packings under a load limit, and the rank -> node/group relabelling."""

from __future__ import annotations

import heapq

import numpy as np

from ..topology import ClusterTopology


def _lpt(load: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """EPLB-style greedy: heaviest item first into the lightest bin (load per slot) with room.
    ``load[m]``, ``sizes[B]`` (sum == m) -> ``bin_of[m]``."""
    heap = [(0.0, b) for b in range(len(sizes))]  # (load per slot, bin); ties -> lower bin
    free = [int(x) for x in sizes]
    bin_load = [0.0] * len(sizes)
    out = np.empty(len(load), dtype=np.int64)
    for i in np.argsort(-load, kind="stable").tolist():
        _, b = heapq.heappop(heap)
        out[i] = b
        bin_load[b] += float(load[i])
        free[b] -= 1
        if free[b]:
            heapq.heappush(heap, (bin_load[b] / sizes[b], b))
    return out


def _levels(topo: ClusterTopology, gpus: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For EP ranks running on ``gpus[P]``: (``rank_node[P]``, ``rank_group[P]``) relabelled 0.."""
    return (
        np.unique(topo.node_of[gpus], return_inverse=True)[1],
        np.unique(topo.group_of[gpus], return_inverse=True)[1],
    )


def _permutation_from_ranks(expert2rank: np.ndarray, ep_size: int) -> np.ndarray:
    """Slots of rank r hold its experts in increasing id order."""
    return np.lexsort((np.arange(len(expert2rank)), expert2rank))


def _hierarchical(
    load: np.ndarray, rank_node: np.ndarray, rank_group: np.ndarray, n: int
) -> np.ndarray:
    """EPLB packing by level: experts -> nodes -> groups -> ranks, heaviest first into the
    lightest bin (per slot) at each level."""
    P = len(rank_node)
    e2r = np.empty(len(load), dtype=np.int64)

    def split(experts: np.ndarray, ranks: np.ndarray, labels: list[np.ndarray]) -> None:
        if not labels:
            e2r[experts] = ranks[_lpt(load[experts], np.full(len(ranks), n))]
            return
        lab = labels[0][ranks]
        units = np.unique(lab)
        b = _lpt(load[experts], np.array([n * (lab == u).sum() for u in units]))
        for i, u in enumerate(units):
            split(experts[b == i], ranks[lab == u], labels[1:])

    split(np.arange(len(load)), np.arange(P), [rank_node, rank_group])
    return e2r


def _pack_groups(
    load: np.ndarray,
    group_of_expert: np.ndarray,
    groups: tuple[int, ...],
    group_ranks: list[np.ndarray],
    n: int,
    cap: float,
) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """LPT-pack each of ``groups``' experts onto its GPUs: ``[(experts, ranks)]``, or None when
    a GPU would exceed ``cap`` (the load limit with its tolerance)."""
    out = []
    for g in groups:
        ranks = group_ranks[g]
        experts = np.flatnonzero(group_of_expert == g)
        b = _lpt(load[experts], np.full(len(ranks), n))
        if np.bincount(b, weights=load[experts], minlength=len(ranks)).max() > cap:
            return None
        out.append((experts, ranks[b]))
    return out


def _random_packing(
    load: np.ndarray, P: int, n: int, limit: float, rng: np.random.Generator
) -> np.ndarray | None:
    """Heaviest expert first onto a random rank with a free slot that stays under ``limit``;
    None when an expert finds no such rank."""
    e2r = np.empty(len(load), dtype=np.int64)
    rank_load, free = np.zeros(P), np.full(P, n)
    for e in np.argsort(-load, kind="stable").tolist():
        ok = np.flatnonzero((free > 0) & (rank_load + load[e] <= limit + 1e-9))
        if not len(ok):
            return None
        r = int(rng.choice(ok))
        e2r[e], rank_load[r], free[r] = r, rank_load[r] + load[e], free[r] - 1
    return e2r
