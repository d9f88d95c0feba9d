"""``topology_aware``: co-activation partitioning under a load limit. Seeded with the flat EPLB
packing and random packings (``packing``), improved by Kernighan-Lin swaps on the pair objective
(``_refine``) and, for top-k > 2 with token samples, on the samples' exact cost
(``_refine_tokens``)."""

from __future__ import annotations

import numpy as np

from moe_contracts.routing import RoutingStats

from .packing import _lpt, _pack_groups, _random_packing

# topology_aware refines from several starts (the flat EPLB packing, then random packings under
# the load limit) and keeps the best: MULTI_START_WORK // (layers x experts) starts, 1..16. A start
# costs about layers x experts, so a model as large as 64 layers x 256 experts gets the one start
# the 1 s solve budget allows, 64 x 64 gets 4, a 4-layer 64-expert model 16.
MULTI_START_WORK = 64 * 256
MAX_STARTS = 16
# With token samples and top-k > 2, topology_aware's best start is refined on the samples' exact
# cost. One swap round costs ~E^2 T multiply-adds per layer; the samples are thinned so that
# layers x E^2 x T stays within TOKEN_REFINE_WORK (4 layers of 64 experts keep 16k samples each,
# 64 x 256 keep none: below MIN_REFINE_TOKENS the refinement is skipped).
TOKEN_REFINE_WORK = 2**28
MIN_REFINE_TOKENS = 2048
REFINE_TRIES = 256  # candidate swaps (best first) checked for a packing under the limit


def tolerance_to_keep(load: np.ndarray, expert2rank: np.ndarray, ep_size: int) -> float:
    """The smallest load tolerance under which ``_topology_aware_layer`` may keep the layout
    ``expert2rank[E]`` for ``load[E]``: its heaviest rank over the limit's base (the flat EPLB
    packing's heaviest rank, at least the mean), minus 1; 0 when it is under the base."""
    n = len(load) // ep_size
    flat = _lpt(load, np.full(ep_size, n))
    base = max(np.bincount(flat, weights=load, minlength=ep_size).max(), load.sum() / ep_size)
    heaviest = np.bincount(expert2rank, weights=load, minlength=ep_size).max()
    return max(0.0, float(heaviest / base - 1)) if base > 0 else 0.0


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
