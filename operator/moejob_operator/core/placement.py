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
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from .cost import cross_counts_for_candidates
from .routing import RoutingStats
from .topology import ClusterTopology

STRATEGIES = ("contiguous", "round_robin", "balanced", "topology_aware", "brute_force")
LOAD_TOLERANCE = 0.02          # bins may exceed the balanced packing's heaviest bin by 2 %
BRUTE_FORCE_LIMIT = 200_000    # candidate assignments per layer


@dataclass(frozen=True, eq=False)
class Placement:
    strategy: str
    permutation: np.ndarray        # permutation[num_layers, num_experts]: slot -> expert
    rank2gpu: np.ndarray           # rank2gpu[world_size]: global rank -> global GPU index
    ep_size: int
    notes: tuple[str, ...] = field(default=())
    fell_back: bool = False        # ``strategy`` needed routing statistics: the layout is contiguous

    @property
    def num_layers(self) -> int:
        return self.permutation.shape[0]

    @property
    def num_experts(self) -> int:
        return self.permutation.shape[1]

    @property
    def world_size(self) -> int:
        return len(self.rank2gpu)

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ep_size

    def expert2slot(self, layer: int) -> np.ndarray:
        """``expert2slot[num_experts]`` for one layer (inverse permutation)."""
        inv = np.empty(self.num_experts, dtype=np.int64)
        inv[self.permutation[layer]] = np.arange(self.num_experts)
        return inv

    def expert2rank(self, layer: int) -> np.ndarray:
        """``expert2rank[num_experts]``: EP rank holding each expert of ``layer``."""
        return self.expert2slot(layer) // self.experts_per_rank

    def validate(self, topo: ClusterTopology | None = None) -> "Placement":
        L, E = self.permutation.shape
        P, W = self.ep_size, self.world_size
        if P < 1 or E % P or W % P:
            raise ValueError(f"{self.strategy}: ep_size {P} must divide num_experts {E} and world size {W}")
        want = np.arange(E)
        for layer in range(L):
            if not np.array_equal(np.sort(self.permutation[layer]), want):
                raise ValueError(f"{self.strategy}: permutation[{layer}] is not a permutation of 0..{E - 1}")
        if not np.array_equal(np.sort(self.rank2gpu), np.arange(W)):
            raise ValueError(f"{self.strategy}: rank2gpu is not a bijection onto 0..{W - 1}")
        if topo is not None and topo.num_gpus != W:
            raise ValueError(f"{self.strategy}: world size {W} != {topo.num_gpus} GPUs in the topology")
        return self

    def to_json(self) -> dict:
        """``MoEPlan.placement`` without ``quality`` (docs/contracts.md)."""
        return {"strategy": self.strategy, "numLayers": self.num_layers, "numExperts": self.num_experts,
                "epSize": self.ep_size, "permutation": self.permutation.tolist()}


# ---------------------------------------------------------------- building blocks


def _lpt(load: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """EPLB-style greedy: heaviest item first into the lightest bin (load per slot) with room.
    ``load[m]``, ``sizes[B]`` (sum == m) -> ``bin_of[m]``."""
    heap = [(0.0, b) for b in range(len(sizes))]      # (load per slot, bin); ties -> lower bin
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


def _rebalance(load: np.ndarray, bin_of: np.ndarray, nbins: int, max_iter: int = 200) -> np.ndarray:
    """Swap items between the heaviest bin and others while that lowers the heavier of the two."""
    bin_of = bin_of.copy()
    for _ in range(max_iter):
        bl = np.bincount(bin_of, weights=load, minlength=nbins)
        h = int(np.argmax(bl))
        a = np.flatnonzero(bin_of == h)
        b = np.flatnonzero(bin_of != h)
        if not len(b):
            break
        delta = load[a][:, None] - load[b][None, :]                     # moved from h to other
        new_max = np.maximum(bl[h] - delta, bl[bin_of[b]][None, :] + delta)
        i, j = np.unravel_index(np.argmin(new_max), new_max.shape)
        if new_max[i, j] >= bl[h] - 1e-9:
            break
        bin_of[a[i]], bin_of[b[j]] = bin_of[b[j]], h
    return bin_of


def _refine_swaps(W: np.ndarray, load: np.ndarray, part: np.ndarray, cap: np.ndarray,
                  max_rounds: int = 1000, rows: int = 32) -> np.ndarray:
    """Kernighan-Lin style steepest descent: apply the swap of two items in different bins
    with the largest co-activation gain that keeps both bins under the cap (an already
    overloaded bin may not get heavier), until no swap gains.

    ``W[m, m]`` co-activation, ``load[m]``, ``part[m]`` bin per item, ``cap[B]``. For speed a
    round scores only the ``rows`` items that gain most by moving against all partners (a
    positive swap needs one side that gains at least half of it); before stopping, one full
    m x m round confirms no swap gains.
    """
    part = part.copy()
    m, B = len(part), len(cap)
    W = W.astype(np.float32)
    C = W @ np.eye(B, dtype=np.float32)[part]            # C[e, b]: co-activation of e with bin b
    bin_load = np.bincount(part, weights=load, minlength=B)
    load32 = load.astype(np.float32)
    idx = np.arange(m)
    full = rows >= m
    for _ in range(max_rounds):
        own = C[idx, part]                               # own[e]
        if full:
            R = idx
        else:
            best_move = (C - own[:, None]).max(axis=1)
            R = np.argpartition(-best_move, rows)[:rows]
        gain = C[R][:, part] + C[:, part[R]].T           # gain[i, b] for swapping R[i] with b
        gain -= own[R][:, None]
        gain -= own[None, :]
        gain -= 2 * W[R]
        slack = (np.maximum(cap, bin_load) - bin_load).astype(np.float32)[part] + 1e-6   # slack[e]
        d = load32[None, :] - load32[R][:, None]         # bin of R[i] changes by d[i, b]
        gain[(d > slack[R][:, None]) | (-d > slack[None, :])] = -np.inf
        i, b = np.unravel_index(np.argmax(gain), gain.shape)
        if not gain[i, b] > 1e-7:
            if full:
                break
            full = True                                  # confirm on the whole neighbourhood
            continue
        full = rows >= m
        a = R[i]
        pa, pb = part[a], part[b]
        C[:, pa] += W[:, b] - W[:, a]
        C[:, pb] += W[:, a] - W[:, b]
        bin_load[pa] += load[b] - load[a]
        bin_load[pb] += load[a] - load[b]
        part[a], part[b] = pb, pa
    return part


def _strict_cap(load: np.ndarray, sizes: np.ndarray, tol: float) -> np.ndarray:
    """Per-bin load cap: ``(1 + tol)`` x the EPLB packing's heaviest bin, per slot."""
    ref = _lpt(load, sizes)
    per_slot = max((np.bincount(ref, weights=load, minlength=len(sizes)) / sizes).max(),
                   load.sum() / sizes.sum())
    return (1 + tol) * per_slot * sizes


def _partition(W: np.ndarray, load: np.ndarray, sizes: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """Load-capped partition maximising co-activation inside bins. Returns ``bin_of[m]``.

    Seeded with the EPLB packing (balanced by construction), then improved by capped swaps.
    (A co-activation-greedy seed was tried: same final quality on the benchmark traces at
    twice the time.)"""
    if len(sizes) == 1:
        return np.zeros(len(load), dtype=np.int64)
    return _refine_swaps(W, load, _lpt(load, sizes), cap)


def _levels(topo: ClusterTopology, gpus: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For EP ranks running on ``gpus[P]``: (``rank_node[P]``, ``rank_group[P]``) relabelled 0.."""
    return (np.unique(topo.node_of[gpus], return_inverse=True)[1],
            np.unique(topo.group_of[gpus], return_inverse=True)[1])


def _permutation_from_ranks(expert2rank: np.ndarray, ep_size: int) -> np.ndarray:
    """Slots of rank r hold its experts in increasing id order."""
    return np.lexsort((np.arange(len(expert2rank)), expert2rank))


def _hierarchical(load, W, rank_node, rank_group, n, tol, affinity: bool,
                  rank_limit: float | None = None) -> np.ndarray:
    """Experts -> nodes -> groups -> ranks. ``affinity`` False is plain EPLB packing.

    With ``rank_limit`` a bin of r ranks may carry up to ``r * rank_limit`` (only the final
    per-GPU load matters); without it each level is capped near its own balanced packing."""
    P = len(rank_node)
    e2r = np.empty(len(load), dtype=np.int64)

    def split(experts: np.ndarray, ranks: np.ndarray, labels: list[np.ndarray]) -> None:
        if not labels:                                   # ranks: balance load only
            sizes = np.full(len(ranks), n)
            b = _lpt(load[experts], sizes)
            if affinity:
                b = _rebalance(load[experts], b, len(ranks))
            e2r[experts] = ranks[b]
            return
        lab = labels[0][ranks]
        units = np.unique(lab)
        if len(units) == 1:
            return split(experts, ranks, labels[1:])
        sizes = np.array([n * (lab == u).sum() for u in units])
        if affinity:
            cap = (sizes / n * rank_limit if rank_limit is not None
                   else _strict_cap(load[experts], sizes, tol))
            b = _partition(W[np.ix_(experts, experts)], load[experts], sizes, cap)
        else:
            b = _lpt(load[experts], sizes)
        for i, u in enumerate(units):
            split(experts[b == i], ranks[lab == u], labels[1:])

    split(np.arange(len(load)), np.arange(P), [rank_node, rank_group])
    return e2r


# ---------------------------------------------------------------- the interface


def solve(strategy: str, topo: ClusterTopology, stats: RoutingStats | None, *, ep_size: int,
          num_experts: int, num_layers: int, seed: int = 0, tol: float = LOAD_TOLERANCE) -> Placement:
    """Place ``num_experts`` experts of each of ``num_layers`` layers on ``ep_size`` EP ranks
    over all GPUs of ``topo`` (world size = ``topo.num_gpus``)."""
    W, E, L, P = topo.num_gpus, num_experts, num_layers, ep_size
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown placement strategy {strategy!r} (choose from {', '.join(STRATEGIES)})")
    if P < 1 or E % P or W % P:
        raise ValueError(f"ep_size {P} must divide num_experts {E} and the world size {W}")
    if stats is not None and (stats.num_layers, stats.num_experts) != (L, E):
        raise ValueError(f"routing stats are {stats.num_layers} layers x {stats.num_experts} experts, "
                         f"the model has {L} x {E}")
    n = E // P
    notes: list[str] = []
    if strategy == "contiguous" or (stats is None and strategy != "round_robin"):
        if strategy != "contiguous":
            notes.append(f"{strategy}: no routing statistics, fell back to contiguous")
        perm = np.tile(np.arange(E), (L, 1))
        return Placement(strategy, perm, np.arange(W), P, tuple(notes),
                         fell_back=strategy != "contiguous").validate(topo)
    rank2gpu = topo.gpu_order()
    if strategy == "round_robin":
        perm = np.tile(_permutation_from_ranks(np.arange(E) % P, P), (L, 1))
        return Placement(strategy, perm, rank2gpu, P).validate(topo)
    rank_node, rank_group = _levels(topo, rank2gpu[:P])
    perm = np.empty((L, E), dtype=np.int64)
    for layer in range(L):
        load = stats.load[layer].astype(float)
        coact = stats.coact[layer].astype(float) / max(stats.tokens, 1)
        if strategy == "brute_force":
            e2r = _brute_force_layer(stats, layer, rank_node, rank_group, n, tol)
        elif strategy == "balanced":
            e2r = _hierarchical(load, coact, rank_node, rank_group, n, tol, affinity=False)
        else:
            e2r = _topology_aware_layer(load, coact, rank_node, rank_group, n, tol)
        perm[layer] = _permutation_from_ranks(e2r, P)
    return Placement(strategy, perm, rank2gpu, P, tuple(notes)).validate(topo)


def _topology_aware_layer(load, coact, rank_node, rank_group, n, tol) -> np.ndarray:
    """First with bins capped only by what their GPUs may carry (``(1 + tol)`` x the flat EPLB
    packing's heaviest GPU); if balancing inside the bins then misses that limit, load-only
    swaps across bins repair it, and failing that, again with every level capped near its own
    balanced packing."""
    P = len(rank_node)
    limit = (1 + tol) * max(np.bincount(_lpt(load, np.full(P, n)), weights=load, minlength=P).max(),
                            load.sum() / P)
    e2r = _hierarchical(load, coact, rank_node, rank_group, n, tol, True, rank_limit=limit)
    if np.bincount(e2r, weights=load, minlength=P).max() > limit + 1e-9:
        # repair: a few load-only swaps across groups (cheap, usually loses little co-activation)
        e2r = _rebalance(load, e2r, P)
    if np.bincount(e2r, weights=load, minlength=P).max() <= limit + 1e-9:
        return e2r
    return _hierarchical(load, coact, rank_node, rank_group, n, tol, True)


def _assignments(E: int, P: int, n: int):
    """All ways to give each of P ranks n of E experts: yields ``e2r[E]``."""
    def rec(remaining: tuple[int, ...], rank: int, e2r: list[int]):
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
    return math.factorial(E) // (math.factorial(n) ** P)


def _brute_force_layer(stats, layer, rank_node, rank_group, n, tol) -> np.ndarray:
    """Exact minimum of remote-group + remote-node sends (cost model) for one layer, over all
    assignments whose heaviest rank stays within ``tol`` of the balanced packing's."""
    E, P = stats.num_experts, len(rank_node)
    count = brute_force_count(E, P)
    if count > BRUTE_FORCE_LIMIT:
        raise ValueError(f"brute_force: {count} assignments of {E} experts to {P} ranks exceed the "
                         f"limit {BRUTE_FORCE_LIMIT}; use topology_aware")
    load = stats.load[layer].astype(float)
    cands = np.array(list(_assignments(E, P, n)))                       # cands[C, E]
    rank_load = np.zeros((len(cands), P))
    np.add.at(rank_load, (np.arange(len(cands))[:, None], cands), load[None, :])
    ref = np.bincount(_lpt(load, np.full(P, n)), weights=load, minlength=P).max()
    feasible = rank_load.max(axis=1) <= (1 + tol) * ref + 1e-9
    cost = cross_counts_for_candidates(cands[feasible], rank_group, rank_node, stats, layer)
    order = np.lexsort((rank_load.max(axis=1)[feasible], cost))
    return cands[feasible][order[0]]
