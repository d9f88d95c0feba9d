"""Replicated experts (``placement.replicas``): extra copies of hot, co-activated experts in the
NVLink groups whose tokens call them, so the de-duplicating dispatcher finds them at home.

Pure array code in the style of DeepSeek's EPLB, one layer at a time. Inputs: the single-copy
layout ``home[E]`` (EP rank of each original expert, from ``permutation``), ``rank_group[P]``
(NVLink group of each EP rank, grouped as ``moe_contracts.dispatch.dispatch_groups`` does),
the token samples of the fit window ``token_experts[T, K]`` with ``src[T]`` (the EP rank each
token starts on) and a budget: ``slots`` extra copies per rank, ``total`` per layer.

The dedup dispatcher (``moe_contracts.dispatch``) sends a token one row per *remote group* that
serves any of its experts (stage A; stage B stays inside a group). A copy of expert ``e`` in
group ``g`` changes who serves ``e`` to the tokens of ``g`` from the home's group ``h`` to ``g``:
the token saves its row to ``h`` exactly when ``e`` was its last expert served from ``h``. The
greedy picks, each round, the (expert, group) with the largest score: every (token, missing
expert) pair adds ``1 / n**2``, ``n`` = how many of that token's experts its remote group ``h``
serves (so ``n = 1`` is the exact byte gain of this copy, and larger ``n`` credits a part of the
row that this copy brings closer, which single-copy gains miss for top-k > 1: a token needs all
its experts at home). Ties break by the lower expert id, then group. The copy goes to the rank
of ``g`` with a free slot that keeps the heaviest rank lightest (then the lower rank); a choice
that would push any rank's load over ``max(load_limit x mean, single-copy max)`` is skipped until
a later copy moves load. A local search then moves single copies of a group to experts it lacks
while that cuts the group's exact rows within the load limit (``_swap``).

Serve table: a token's expert goes to a copy on its own rank, else the least-loaded holder in its
own group (load as the greedy went), else the home (deterministic, no extra sync).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moe_contracts.dispatch import dispatch_groups

LOAD_LIMIT = 1.05  # a copy may not push a rank's load above 1.05 x the mean (or the 1-copy max)
# weight 1 / n**SCORE_EXPONENT of a (token, expert) pair whose remote group serves n of the token's
# experts; 2 beat 0.5, 1, 3 and 5 on the real-text recordings (top-2 and top-8, held out)
SCORE_EXPONENT = 2
SWAP_ROUNDS = 64  # accepted swaps of the local search after the greedy, at most
SWAP_CANDIDATES = 16  # experts a group lacks that a swap tries, best greedy score first
# Work caps per layer (so the planner stays fast at EP 64 with 256 experts): the greedy's samples
# are thinned (evenly) to ``tokens x copies x K^2 <= GREEDY_WORK``; the local search stops after
# ``SWAP_WORK`` token-expert evaluations. replica_bench.py's recordings are not thinned.
GREEDY_WORK = 2**25
SWAP_WORK = 2**25


@dataclass(frozen=True)
class LayerCopies:
    """One layer's replicas: ``holders[e]`` (home first) and ``serve[P, E]``; ``load[P]``: the
    (token, expert) assignments each EP rank computes on the fit samples."""

    holders: tuple[tuple[int, ...], ...]
    serve: np.ndarray  # serve[P, E]: EP rank that computes expert e for tokens of EP rank p
    load: np.ndarray  # load[P]

    @property
    def extra_copies(self) -> int:
        return sum(len(h) - 1 for h in self.holders)

    def to_json(self) -> dict[str, list[list[int]]]:
        """``moe_contracts.plan.LayerReplicas`` (docs/contracts.md, "placement.replicas")."""
        return {"holders": [list(h) for h in self.holders], "serve": self.serve.tolist()}


def copy_slots(experts_per_rank: int, overhead_percent: int) -> int:
    """Extra expert copies one rank may hold: ``floor(overhead x experts per rank)``."""
    return experts_per_rank * overhead_percent // 100


def single_copy(home: np.ndarray, num_ranks: int) -> np.ndarray:
    """``serve[P, E]`` with one copy per expert: every rank is served by the home."""
    return np.broadcast_to(np.asarray(home)[None, :], (num_ranks, len(home))).copy()


def pair_load(
    token_experts: np.ndarray, src: np.ndarray, num_ranks: int, num_experts: int
) -> np.ndarray:
    """``pair_load[P, E]``: (token, expert) assignments of tokens starting on EP rank p."""
    flat = np.repeat(np.asarray(src), token_experts.shape[1]) * num_experts + token_experts.ravel()
    return np.bincount(flat, minlength=num_ranks * num_experts).reshape(num_ranks, num_experts)


def rank_load(serve: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """``load[P]``: what each EP rank computes under ``serve[P, E]`` for ``pairs[P, E]``."""
    return np.bincount(serve.ravel(), weights=pairs.ravel(), minlength=serve.shape[0])


def cross_rows(
    serve: np.ndarray, token_experts: np.ndarray, src: np.ndarray, group: np.ndarray
) -> int:
    """Stage-A rows (token, remote group) the dedup dispatcher sends under ``serve[P, E]``."""
    K = token_experts.shape[1]
    g = group[serve[np.asarray(src)[:, None], token_experts]]  # [T, K] serving group
    own = group[np.asarray(src)][:, None]
    g = np.where(g == own, -1, g)
    gs = np.sort(g, axis=1)
    distinct = (gs[:, 1:] != gs[:, :-1]).sum(1) + 1 if K > 1 else np.ones(len(gs), dtype=int)
    return int((distinct - (gs == -1).any(1)).sum())


def _scores(te: np.ndarray, served_group: np.ndarray, own: int, num_experts: int) -> np.ndarray:
    """Score of a copy of each expert in group ``own`` for its tokens ``te[t, K]`` whose experts
    are served from ``served_group[t, K]`` (module docstring)."""
    remote = served_group != own
    if not remote.any():
        return np.zeros(num_experts)
    # n[t, k]: how many of token t's experts the group serving (t, k) serves
    n = (served_group[:, :, None] == served_group[:, None, :]).sum(2)
    w = np.where(remote, 1.0 / n.astype(float) ** SCORE_EXPONENT, 0.0)
    return np.bincount(te.ravel(), weights=w.ravel(), minlength=num_experts)


def solve_layer(
    home: np.ndarray,
    rank_group: np.ndarray,
    token_experts: np.ndarray,
    src: np.ndarray,
    *,
    slots: int,
    total: int | None = None,
    load_limit: float = LOAD_LIMIT,
) -> LayerCopies:
    """Replicas of one layer: ``home[E]`` EP rank per expert, ``rank_group[P]`` NVLink group per EP
    rank, ``token_experts[T, K]`` fit samples starting on EP ranks ``src[T]``; at most ``slots``
    copies per rank and ``total`` per layer (default ``slots x P``)."""
    home = np.asarray(home, dtype=np.int64)
    E, P = len(home), len(rank_group)
    src = np.asarray(src, dtype=np.int64)
    te = np.asarray(token_experts, dtype=np.int64)
    budget = slots * P if total is None else min(total, slots * P)
    keep = GREEDY_WORK // max(1, budget * te.shape[1] ** 2)
    if len(te) > keep:  # thin evenly: every EP rank keeps its share
        pick = np.linspace(0, len(te) - 1, max(keep, 1)).astype(np.int64)
        te, src = te[pick], src[pick]
    groups = dispatch_groups(np.asarray(rank_group))
    group = np.empty(P, dtype=np.int64)
    for gi, ranks in enumerate(groups):
        group[ranks] = gi
    serve = single_copy(home, P)
    holders = [[int(h)] for h in home]
    pairs = pair_load(te, src, P, E).astype(float)
    load = rank_load(serve, pairs)
    if budget <= 0 or len(groups) < 2 or not len(te):
        return LayerCopies(tuple(tuple(h) for h in holders), serve, load)
    cap = max(load_limit * load.mean(), load.max())
    free = np.full(P, slots)
    tokens_of = [np.flatnonzero(group[src] == gi) for gi in range(len(groups))]
    blocked = np.zeros((len(groups), E), dtype=bool)  # (group, expert) pairs ruled out
    for gi in range(len(groups)):
        blocked[gi, home[group[home] == gi]] = True
    overloaded = np.zeros_like(blocked)
    # scores[g]: a copy in group g changes who serves the tokens of g only, so only g's row is
    # recomputed after it
    scores: list[np.ndarray | None] = [None] * len(groups)
    placed = 0
    while placed < budget:
        best: tuple[float, int, int] | None = None
        for gi, idx in enumerate(tokens_of):
            if not free[groups[gi]].any():
                blocked[gi] = True
                continue
            cached = scores[gi]
            if cached is None:
                t = te[idx]
                cached = scores[gi] = _scores(t, group[serve[src[idx][:, None], t]], gi, E)
            sc = np.where(blocked[gi], -1.0, cached)
            e = int(np.argmax(sc))  # lowest id among ties
            if sc[e] > 0 and (best is None or sc[e] > best[0]):
                best = (float(sc[e]), e, gi)
        if best is None:
            break
        _, e, gi = best
        choice = _best_rank(e, groups[gi], free, serve, pairs, load, holders[e])
        if choice is None or choice[1].max() > cap + 1e-9:
            blocked[gi, e] = overloaded[gi, e] = True  # until a copy elsewhere moves load
            continue
        r, load, serve = choice[0], choice[1], choice[2]
        holders[e].append(r)
        free[r] -= 1
        scores[gi] = None
        blocked[gi, e] = True
        blocked[overloaded] = False
        overloaded[:] = False
        placed += 1
    _swap(holders, groups, group, te, src, tokens_of, serve, pairs, load, cap)
    return LayerCopies(tuple(tuple(h) for h in holders), serve, load)


def _assign(
    e: int,
    ranks: list[int],
    holders: list[int],
    serve: np.ndarray,
    pairs: np.ndarray,
    load: np.ndarray,
) -> None:
    """Serve ``e`` to the tokens of ``ranks`` (one group) by the rule (module docstring), in
    place: own rank if it holds ``e``, else the least-loaded holder in the group, else the home."""
    mine = [h for h in holders if h in ranks]
    for p in ranks:
        old = serve[p, e]
        new = p if p in mine else min(mine, key=lambda h: (load[h], h)) if mine else holders[0]
        load[old] -= pairs[p, e]
        load[new] += pairs[p, e]
        serve[p, e] = new


def _best_rank(
    e: int,
    ranks: list[int],
    free: np.ndarray,
    serve: np.ndarray,
    pairs: np.ndarray,
    load: np.ndarray,
    holders: list[int],
) -> tuple[int, np.ndarray, np.ndarray] | None:
    """The rank of ``ranks`` (one group) with a free slot whose copy of ``e`` leaves the heaviest
    rank lightest: ``(rank, load[P], serve[P, E])`` after the copy, or None."""
    best = None
    for r in ranks:
        if free[r] <= 0 or r in holders:
            continue
        new_serve, new_load = serve.copy(), load.copy()
        _assign(e, ranks, [*holders, r], new_serve, pairs, new_load)
        key = (new_load.max(), r)
        if best is None or key < best[0]:
            best = (key, (r, new_load, new_serve))
    return None if best is None else best[1]


def _swap(
    holders: list[list[int]],
    groups: list[list[int]],
    group: np.ndarray,
    te: np.ndarray,
    src: np.ndarray,
    tokens_of: list[np.ndarray],
    serve: np.ndarray,
    pairs: np.ndarray,
    load: np.ndarray,
    cap: float,
) -> None:
    """Local search after the greedy: move one copy of a group to another expert (same rank)
    while that cuts the group's exact stage-A rows and keeps every rank within ``cap``; first
    improvement, candidates the ``SWAP_CANDIDATES`` best-scored experts the group lacks."""
    E = len(holders)
    work = 0
    for _ in range(SWAP_ROUNDS):
        moved = False
        for gi, ranks in enumerate(groups):
            idx = tokens_of[gi]
            if not len(idx):
                continue
            t, s = te[idx], src[idx]
            rows = cross_rows(serve, t, s, group)
            sc = _scores(t, group[serve[s[:, None], t]], gi, E)
            lacking = [e for e in np.argsort(-sc, kind="stable") if group[holders[e][0]] != gi]
            lacking = [int(e) for e in lacking if not any(h in ranks for h in holders[e])]
            copies = [(e, r) for e in range(E) for r in holders[e][1:] if r in ranks]
            for e_out, r in copies:
                for e_in in lacking[:SWAP_CANDIDATES]:
                    work += t.size
                    if work > SWAP_WORK:
                        return
                    new_serve, new_load = serve.copy(), load.copy()
                    out_holders = [h for h in holders[e_out] if h != r]
                    _assign(e_out, ranks, out_holders, new_serve, pairs, new_load)
                    _assign(e_in, ranks, [*holders[e_in], r], new_serve, pairs, new_load)
                    if new_load.max() > cap + 1e-9:
                        continue
                    if cross_rows(new_serve, t, s, group) < rows:
                        holders[e_out].remove(r)
                        holders[e_in].append(r)
                        serve[:], load[:] = new_serve, new_load
                        moved = True
                        break
                if moved:
                    break
            if moved:
                break
        if not moved:
            return


def solve(
    permutation: np.ndarray,
    rank_group: np.ndarray,
    token_experts: np.ndarray,
    src: np.ndarray,
    *,
    slots: int,
    total: int | None = None,
    load_limit: float = LOAD_LIMIT,
) -> list[LayerCopies]:
    """Every layer: ``permutation[L, E]`` (slot -> expert), ``token_experts[L, T, K]``, ``src[T]``
    EP rank of each token (see :func:`solve_layer`)."""
    L, E = permutation.shape
    P = len(rank_group)
    out = []
    for layer in range(L):
        home = np.empty(E, dtype=np.int64)
        home[permutation[layer]] = np.arange(E) // (E // P)
        out.append(
            solve_layer(
                home,
                rank_group,
                token_experts[layer],
                src,
                slots=slots,
                total=total,
                load_limit=load_limit,
            )
        )
    return out


def serve_table(layers: list[LayerCopies]) -> np.ndarray:
    """``expert2rank[L, P, E]`` for ``moe_contracts.dispatch.tier_bytes``."""
    return np.stack([c.serve for c in layers])
