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
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moe_contracts.routing import RoutingStats

from .cost import cross_counts_for_candidates
from .topology import ClusterTopology

STRATEGIES = ("contiguous", "round_robin", "balanced", "topology_aware", "brute_force")
LOAD_TOLERANCE = 0.02  # bins may exceed the balanced packing's heaviest bin by 2 %
BRUTE_FORCE_LIMIT = 200_000  # candidate assignments per layer
# A placement fitted to one window's co-activation keeps less together on the tokens that follow:
# routing keeps moving while the model trains. Scored on the next window of the same run, the
# fitted strategies' cross-group ratio to contiguous came out above their in-sample ratio, by an
# amount that depends on top-k and held from one training run to the next. HELDOUT_OPTIMISM maps
# each recorded top-k to its mean over recordings and EP layouts of the held-out evaluation
# (benchmarks/results/placement-heldout.json, ``meanOptimismByTopK``; each recording predicted
# from the others, ``leaveOneRecordingOut``, in docs/placement.md); other top-k interpolate in
# log2(top-k) and clamp to the ends (``heldout_optimism``). A random split of one window's own
# samples shows no such optimism; a split in time (``tokenSamples.steps``) sees drift but not how
# much of it reaches the next window (benchmarks/results/placement-timesplit.json), so this is a
# calibration on recorded runs, not a per-plan measurement.
HELDOUT_OPTIMISM = {2: 0.051, 4: 0.046, 8: 0.024}
# topology_aware refines from several starts (the flat EPLB packing, then random packings under
# the load limit) and keeps the best: MULTI_START_WORK // (layers x experts) starts, 1..16. A start
# costs about layers x experts, so a model as large as 64 layers x 256 experts gets the one start
# the 1 s solve budget allows, 64 x 64 gets 4, a 4-layer 64-expert model 16.
MULTI_START_WORK = 64 * 256
MAX_STARTS = 16
FITTED_STRATEGIES = ("topology_aware", "brute_force")
# With token samples and top-k > 2, topology_aware's best start is refined on the samples' exact
# cost. One swap round costs ~E^2 T multiply-adds per layer; the samples are thinned so that
# layers x E^2 x T stays within TOKEN_REFINE_WORK (4 layers of 64 experts keep 16k samples each,
# 64 x 256 keep none: below MIN_REFINE_TOKENS the refinement is skipped).
TOKEN_REFINE_WORK = 2**28
MIN_REFINE_TOKENS = 2048
REFINE_TRIES = 256  # candidate swaps (best first) checked for a packing under the limit


@dataclass(frozen=True, eq=False)
class Placement:
    strategy: str
    permutation: np.ndarray  # permutation[num_layers, num_experts]: slot -> expert
    rank2gpu: np.ndarray  # rank2gpu[world_size]: global rank -> global GPU index
    ep_size: int
    notes: tuple[str, ...] = field(default=())
    fell_back: bool = False  # ``strategy`` needed routing statistics: the layout is contiguous

    @property
    def num_layers(self) -> int:
        return int(self.permutation.shape[0])

    @property
    def num_experts(self) -> int:
        return int(self.permutation.shape[1])

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

    def validate(self, topo: ClusterTopology | None = None) -> Placement:
        L, E = self.permutation.shape
        P, W = self.ep_size, self.world_size
        if P < 1 or E % P or W % P:
            raise ValueError(
                f"{self.strategy}: ep_size {P} must divide num_experts {E} and world size {W}"
            )
        want = np.arange(E)
        for layer in range(L):
            if not np.array_equal(np.sort(self.permutation[layer]), want):
                raise ValueError(
                    f"{self.strategy}: permutation[{layer}] is not a permutation of 0..{E - 1}"
                )
        if not np.array_equal(np.sort(self.rank2gpu), np.arange(W)):
            raise ValueError(f"{self.strategy}: rank2gpu is not a bijection onto 0..{W - 1}")
        if topo is not None and topo.num_gpus != W:
            raise ValueError(
                f"{self.strategy}: world size {W} != {topo.num_gpus} GPUs in the topology"
            )
        return self

    def to_json(self) -> dict[str, Any]:
        """``MoEPlan.placement`` without ``quality`` (docs/contracts.md); ``fellBackTo`` names the
        layout actually used when ``strategy`` needed routing statistics and had none."""
        out: dict[str, Any] = {
            "strategy": self.strategy,
            "numLayers": self.num_layers,
            "numExperts": self.num_experts,
            "epSize": self.ep_size,
            "permutation": self.permutation.tolist(),
        }
        if self.fell_back:
            out["fellBackTo"] = "contiguous"
        return out


# ---------------------------------------------------------------- building blocks


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


def _refine(
    W: np.ndarray,
    load: np.ndarray,
    e2r: np.ndarray,
    A: np.ndarray,
    group_of_rank: np.ndarray,
    n: int,
    limit: float,
    max_rounds: int = 400,
    rows: int = 48,
    max_repacks: int = 64,
) -> np.ndarray:
    """Kernighan-Lin style descent over swaps of two experts on different GPUs that keep every
    GPU under ``limit``; maximises ``sum_ij W[i, j] * A[rank_i, rank_j]``.

    ``W[m, m]`` co-activation per token; ``A[P, P]`` what keeping a pair on two ranks saves
    (2 in one NVLink group: one group and one node send; 1 in one node; 0 apart): only the
    group and node of a rank matter. ``e2r[m]`` must be under the limit.
    A round scores the ``rows`` experts that gain most by moving against all partners, then
    applies the best swaps in order, each re-scored on the updated state (positive gain, both
    GPUs under the limit, neither expert moved this round). When no such swap gains, swaps
    between groups whose GPUs would only fit after re-packing are tried: the best few that leave
    both groups *packable* (their LPT packing stays under the limit) are applied together with
    that re-packing, so a hot expert can join its partners where a light one makes way (a repair
    inside the group, which costs no co-activation). One full m x m round confirms the end.
    """
    e2r = e2r.copy()
    m, P = len(e2r), len(A)
    W = W.astype(np.float32)
    A = A.astype(np.float32)
    group_ranks = np.bincount(group_of_rank)
    C = (W @ np.eye(P, dtype=np.float32)[e2r]) @ A.T  # C[e, r]: affinity of e placed on rank r
    rank_load = np.bincount(e2r, weights=load, minlength=P)
    d = float(A[0, 0])
    cap = limit + 1e-9
    load32 = load.astype(np.float32)
    idx = np.arange(m)
    full, repacks = rows >= m, 0
    for _ in range(max_rounds):
        own = C[idx, e2r]
        R = idx if full else np.argpartition(-(C.max(axis=1) - own), rows)[:rows]
        pr = e2r[R]
        raw = C[R][:, e2r] - own[R][:, None] + C[:, pr].T - own[None, :]
        raw -= 2 * W[R] * (d - A[pr][:, e2r])
        dl = load32[None, :] - load32[R][:, None]  # rank of R[i] changes by dl[i, e]
        gain = np.where(
            (rank_load[pr][:, None] + dl > cap) | (rank_load[e2r][None, :] - dl > cap), -np.inf, raw
        )
        best = gain.argmax(axis=1)
        top = gain[np.arange(len(R)), best]
        moved: set[int] = set()
        applied = 0
        for i in np.argsort(-top)[: int((top > 1e-7).sum())].tolist():
            a, e = int(R[i]), int(best[i])
            if a in moved or e in moved:
                continue
            pa, pe = e2r[a], e2r[e]
            g = C[a, pe] - C[a, pa] + C[e, pa] - C[e, pe] - 2 * W[a, e] * (d - A[pa, pe])
            dl1 = load[e] - load[a]
            if g <= 1e-7 or rank_load[pa] + dl1 > cap or rank_load[pe] - dl1 > cap:
                continue
            C += np.outer(W[:, e] - W[:, a], A[:, pa] - A[:, pe])
            rank_load[pa] += dl1
            rank_load[pe] -= dl1
            e2r[a], e2r[e] = pe, pa
            moved.update((a, e))
            applied += 1
        if applied:
            full = rows >= m
            continue
        if full and repacks < max_repacks:
            ga, ge = group_of_rank[pr][:, None], group_of_rank[e2r][None, :]
            group_load = np.bincount(group_of_rank, weights=rank_load)
            raw[
                (ga == ge)
                | (group_load[ga] + dl > group_ranks[ga] * cap)
                | (group_load[ge] - dl > group_ranks[ge] * cap)
            ] = -np.inf
            if _repacking_swap(raw, R, e2r, load, group_of_rank, n, cap):
                repacks += 1
                C = (W @ np.eye(P, dtype=np.float32)[e2r]) @ A.T
                rank_load = np.bincount(e2r, weights=load, minlength=P)
                continue
        if full:
            break
        full = True
    return e2r


def _repacking_swap(
    gain: np.ndarray,
    R: np.ndarray,
    e2r: np.ndarray,
    load: np.ndarray,
    group_of_rank: np.ndarray,
    n: int,
    cap: float,
    tries: int = 8,
) -> bool:
    """In place: of the ``tries`` best positive ``gain[i, e]`` (swap ``R[i]`` with ``e``, in
    different groups), apply the first that leaves both groups packable under ``cap``, with
    both groups LPT-packed onto their GPUs. Returns whether one was applied."""
    flat = np.argsort(-gain, axis=None)[:tries]
    grp = group_of_rank[e2r]
    group_ranks = [np.flatnonzero(group_of_rank == g) for g in range(group_of_rank.max() + 1)]
    for i, e in zip(*np.unravel_index(flat, gain.shape), strict=True):
        if not gain[i, e] > 1e-7:
            return False
        a = int(R[i])
        trial = grp.copy()
        trial[a], trial[e] = grp[e], grp[a]
        packed = _pack_groups(load, trial, (grp[a], grp[e]), group_ranks, n, cap)
        if packed is not None:
            for experts, ranks in packed:
                e2r[experts] = ranks
            return True
    return False


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


# ---------------------------------------------------------------- the interface


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


def _topology_aware_layer(
    load: np.ndarray,
    coact: np.ndarray,
    rank_node: np.ndarray,
    rank_group: np.ndarray,
    n: int,
    tol: float,
    rng: np.random.Generator | None = None,
    starts: int = 1,
    tokens: np.ndarray | None = None,
) -> np.ndarray:
    """Co-activation partitioning under a per-GPU load limit of ``(1 + tol)`` x the flat EPLB
    packing's heaviest GPU. Seeded with that packing (under the limit by construction) and
    improved only by moves that stay under it (``_refine``): the load never needs repairing
    afterwards, so no co-activation is traded away for load. The descent ends in a local optimum
    that depends on its start, so it also starts from ``starts - 1`` random packings under the
    limit (``_random_packing``) and keeps the best objective (ties: the earliest start). With
    sampled tokens ``tokens[T, k]`` (top-k > 2) the best start is then refined on their exact
    cost (``_refine_tokens``), which the pair objective only approximates."""
    P = len(rank_node)
    flat = _lpt(load, np.full(P, n))
    limit = (1 + tol) * max(np.bincount(flat, weights=load, minlength=P).max(), load.sum() / P)
    if len(np.unique(rank_group)) == 1:
        return flat
    A = (rank_node[:, None] == rank_node[None, :]).astype(float) + (
        rank_group[:, None] == rank_group[None, :]
    )
    rng = rng if rng is not None else np.random.default_rng(0)
    best = _refine(coact, load, flat, A, rank_group, n, limit)
    best_value = float((coact * A[best][:, best]).sum())
    for _ in range(starts - 1):
        start = _random_packing(load, P, n, limit, rng)
        if start is None:
            continue
        e2r = _refine(coact, load, start, A, rank_group, n, limit)
        value = float((coact * A[e2r][:, e2r]).sum())
        if value > best_value * (1 + 1e-9):
            best, best_value = e2r, value
    if tokens is not None:
        best = _refine_tokens(tokens, load, best, rank_group, rank_node, n, limit)
    return best


def _refine_sample(stats: RoutingStats, layer: int, num_layers: int) -> np.ndarray | None:
    """Token samples ``[T, k]`` of ``layer`` for ``_refine_tokens``, or None: for top-2 and
    below the pair objective is already exact, and without samples there is nothing to refine
    on. A swap round costs about ``E^2 T`` per layer, so at most ``TOKEN_REFINE_WORK //
    (num_layers E^2)`` samples are used (evenly spaced; none when fewer than
    ``MIN_REFINE_TOKENS`` would remain)."""
    te = stats.token_experts
    if te is None or te.shape[2] <= 2:
        return None
    keep = min(te.shape[1], TOKEN_REFINE_WORK // (num_layers * stats.num_experts**2))
    if keep < MIN_REFINE_TOKENS:
        return None
    sample: np.ndarray = te[layer, np.linspace(0, te.shape[1] - 1, keep).astype(np.int64)]
    return sample


def _swap_deltas(X: np.ndarray, label: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """``delta[a, b]``: change in ``sum_t sum_l weight[l]`` over the distinct labels l among
    token t's experts when experts a and b trade labels, for ``X[T, E]`` (token t routed to
    expert e) and ``label[E]`` in ``0..len(weight) - 1``. Exact when a and b have different
    labels (same labels: meaningless).

    A token with a but not b loses a's label when a was its only expert there (count 1) and
    gains b's when it had none (count 0); symmetrically for b. Tokens with both keep theirs."""
    onehot = np.eye(len(weight), dtype=np.float32)[label]  # [E, levels]
    count = X @ onehot  # [T, levels]
    w = weight.astype(np.float32)
    only = (count == 1) * w
    none = (count == 0) * w
    x_only = X * (only @ onehot.T)  # weight of a's label where a is t's only expert there
    t1 = ((X.T @ none) @ onehot.T) - x_only.sum(axis=0)[:, None] + x_only.T @ X
    delta: np.ndarray = t1 + t1.T
    return delta


def _refine_tokens(
    te: np.ndarray,
    load: np.ndarray,
    e2r: np.ndarray,
    rank_group: np.ndarray,
    rank_node: np.ndarray,
    n: int,
    limit: float,
    max_swaps: int = 64,
) -> np.ndarray:
    """Steepest descent on the exact cost of sampled tokens ``te[T, k]``: swaps of two experts
    in different NVLink groups that lower ``sum_t`` remote-group sends + remote-node sends
    (each distinct group / node among a token's experts, weighted by the chance that the token
    starts outside it, as the cost model counts them). For top-k > 2 this is what the pair
    objective of ``_refine`` only approximates: a token costs nothing more once one of its
    experts sits in a group, however many pairs it has there. A swap is taken only when both
    groups still pack onto their GPUs under ``limit`` (LPT); the two groups are re-packed."""
    E = len(e2r)
    e2r = e2r.copy()
    X = np.zeros((len(te), E), dtype=np.float32)
    X[np.arange(len(te))[:, None], te] = 1.0
    G, N, P = int(rank_group.max()) + 1, int(rank_node.max()) + 1, len(rank_group)
    # a token reaching group / node u is sent there unless it starts there (origins spread
    # evenly over the EP ranks)
    w_group = 1 - np.bincount(rank_group, minlength=G) / P
    w_node = 1 - np.bincount(rank_node, minlength=N) / P
    group_ranks = [np.flatnonzero(rank_group == g) for g in range(G)]
    node_of_group = np.array([rank_node[r[0]] for r in group_ranks])
    room = np.array([len(r) for r in group_ranks]) * limit + 1e-9  # a group's load limit
    one_group_per_node = len(np.unique(node_of_group)) == G
    dl = load[None, :] - load[:, None]  # a swap moves load[b] - load[a] into a's group
    for _ in range(max_swaps):
        grp = rank_group[e2r]
        if one_group_per_node:  # a node's sends are its group's: one pass with both weights
            delta = _swap_deltas(X, grp, w_group + w_node[node_of_group])
        else:
            delta = _swap_deltas(X, grp, w_group)
            if N > 1:
                node = node_of_group[grp]
                delta += np.where(
                    node[:, None] == node[None, :], 0.0, _swap_deltas(X, node, w_node)
                )
        delta[grp[:, None] == grp[None, :]] = np.inf
        group_load = np.bincount(grp, weights=load, minlength=G)
        delta[(group_load[grp][:, None] + dl > room[grp][:, None])] = np.inf
        delta[(group_load[grp][None, :] - dl > room[grp][None, :])] = np.inf
        order = np.argsort(delta, axis=None)
        for a, b in zip(*np.unravel_index(order[:REFINE_TRIES], delta.shape), strict=True):
            if not delta[a, b] < -1e-6:
                return e2r
            trial = grp.copy()
            trial[a], trial[b] = grp[b], grp[a]
            packed = _pack_groups(load, trial, (grp[a], grp[b]), group_ranks, n, limit + 1e-9)
            if packed is not None:
                for experts, ranks in packed:
                    e2r[experts] = ranks
                break
        else:
            return e2r
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


def heldout_optimism(top_k: int, table: dict[int, float] | None = None) -> float:
    """The held-out optimism for ``top_k`` from ``table`` (default ``HELDOUT_OPTIMISM``): the
    measured value where there is one, else linear in log2(top-k) between the nearest measured
    top-k on either side, clamped to the nearest end outside them."""
    table = HELDOUT_OPTIMISM if table is None else table
    if not table:
        raise ValueError("heldout_optimism: empty table")
    ks = sorted(table)
    if top_k <= ks[0]:
        return table[ks[0]]
    if top_k >= ks[-1]:
        return table[ks[-1]]
    hi = next(k for k in ks if k >= top_k)
    lo = max(k for k in ks if k <= top_k)
    if hi == lo:
        return table[lo]
    w = (math.log2(top_k) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
    return table[lo] + w * (table[hi] - table[lo])


def heldout_estimate(placement: Placement, in_sample_ratio: float, top_k: int) -> float:
    """Expected cross-group ratio to contiguous on tokens after the recorded window: the in-sample
    ratio, raised by ``heldout_optimism(top_k)`` for layouts fitted to the co-activation (capped
    at 1); layouts that ignore it (contiguous, round_robin, balanced, a fallback) keep theirs."""
    if placement.fell_back or placement.strategy not in FITTED_STRATEGIES:
        return in_sample_ratio
    return min(1.0, in_sample_ratio * (1 + heldout_optimism(top_k)))


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
