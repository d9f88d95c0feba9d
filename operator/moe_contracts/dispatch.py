"""The byte model behind ``placement.quality.dispatch`` (docs/contracts.md): what each
expert-parallel dispatcher sends, by tier of the receiver, for a given routing of tokens.

Both sides use it: the planner predicts a plan's figures with it (``core.dispatch``, on the
routing statistics' token samples), and the smoke test's ``dispatch`` check compares the bytes
the trainer's counters measured in a real step with it (on the tokens that step routed), so the
prediction the plan shows and the one the gate verifies are the same arithmetic.

Two dispatchers (``placement.dispatcher``):

- ``autoep``: DeepSpeed 0.19.8 AutoEP's all-to-all (``AutoEPMoELayer._forward``): one row of
  ``H`` bytes per (token, expert) whose expert is on another EP rank, there and back; plus its
  per-layer count exchange (an all-to-all of ``E`` int32 counts, ``E / P`` to each peer).
- ``dedup``: the trainer's two-stage dispatcher (``moe_trainer.dispatch.dedup_ep``): EP ranks form G
  groups of R (the NVLink groups of the EP group; unequal groups run flat, R = 1). A token on EP
  rank ``s`` (index ``i`` in its group) sends one row to rank ``i`` of every other group it needs
  (stage A), and from there (or from ``s`` for its own group) one row to every other rank of that
  group holding one of its experts (stage B). A dispatched row carries ``H`` bytes + ``K`` int32
  ids + ``K`` fp32 weights; a combined row ``H`` bytes. Backward sends the gradients back the
  same ways (``H`` each way, + ``K`` fp32 weight gradients on the dispatch side).

Every send is charged to the tier between sender and receiver: ``intraGroup`` (same NVLink
group), ``crossGroup`` (different group), of which ``crossNode`` leaves the node. A forward pass
that runs again under activation checkpointing sends its forward bytes again
(``forward_passes``); the backward runs once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

DISPATCHERS = ("autoep", "dedup")
TIERS = ("intraGroup", "crossGroup", "crossNode")
ID_BYTES = 4
WEIGHT_BYTES = 4
COUNT_BYTES = 4


def dispatch_groups(rank_group: np.ndarray) -> list[list[int]]:
    """EP ranks by NVLink group id ``rank_group[P]`` (first appearance order); unequal group
    sizes fall back to one rank per group, as the dispatcher does."""
    ids = list(dict.fromkeys(rank_group.tolist()))
    groups = [[r for r in range(len(rank_group)) if rank_group[r] == g] for g in ids]
    if len({len(g) for g in groups}) != 1:
        return [[r] for r in range(len(rank_group))]
    return groups


def _charge(
    out: dict[str, float],
    a: np.ndarray,
    b: np.ndarray,
    nbytes: float,
    grp: np.ndarray,
    node: np.ndarray,
) -> None:
    """Add ``nbytes`` for each send ``a[i] -> b[i]`` (global ranks) to its tier."""
    moved = a != b
    a, b = a[moved], b[moved]
    cross = grp[a] != grp[b]
    out["intraGroup"] += float((~cross).sum()) * nbytes
    out["crossGroup"] += float(cross.sum()) * nbytes
    out["crossNode"] += float((node[a] != node[b]).sum()) * nbytes


def copy_sync_bytes(
    holder: int,
    home: int,
    group: Sequence[int] | np.ndarray,
    node: Sequence[int] | np.ndarray,
    nbytes: int,
) -> dict[str, int]:
    """What one copy of an expert on EP rank ``holder`` costs in one forward + backward, by tier
    (every tier keyed, 0 where nothing goes): its weights ``home -> holder`` and their gradients
    back, ``2 * nbytes`` (``nbytes``: the expert's weight bytes), charged to the tier between the
    two ranks (``group[r]``, ``node[r]``: EP rank ``r``'s NVLink group and node; ``crossNode`` is
    the part of ``crossGroup`` that leaves the node). The one rule behind the planner's
    ``quality.replicas.syncBytesPerStep`` and the trainer's weight-sync counters."""
    out = dict.fromkeys(TIERS, 0)
    moved = 2 * nbytes
    if group[holder] == group[home]:
        out["intraGroup"] = moved
    else:
        out["crossGroup"] = moved
        if node[holder] != node[home]:
            out["crossNode"] = moved
    return out


def dedup_row_bytes(
    hidden_bytes: int, top_k: int, *, backward: bool = True, forward_passes: int = 1
) -> int:
    """Bytes one send of the de-duplicating dispatcher (a stage-A or stage-B row, per token and
    receiver) moves in a training step: the dispatched row (``hidden_bytes`` + ``top_k`` int32
    ids + ``top_k`` fp32 weights) and the combined row (``hidden_bytes``) per forward pass, and
    their gradients back (``hidden_bytes`` each way + ``top_k`` fp32 weight gradients)."""
    H, K = hidden_bytes, top_k
    fwd = 2 * H + K * (ID_BYTES + WEIGHT_BYTES)
    return fwd * forward_passes + ((2 * H + K * WEIGHT_BYTES) if backward else 0)


def tier_bytes(
    expert2rank: np.ndarray,
    token_experts: np.ndarray,
    src: np.ndarray,
    rank_group: Sequence[int] | np.ndarray,
    rank_node: Sequence[int] | np.ndarray,
    ep_size: int,
    *,
    hidden_bytes: int,
    backward: bool = True,
    forward_passes: int = 1,
) -> dict[str, dict[str, float]]:
    """Bytes per dispatcher and tier for routing T tokens through L MoE layers once.

    ``expert2rank[L, E]``: EP rank of each router expert id per layer, or ``[L, P, E]``: with
    replicated experts, the EP rank that serves expert ``e`` to tokens that start on EP rank ``p``
    (the dispatcher's serve table; ``[L, E]`` is the single-copy case, the same for every ``p``);
    ``token_experts[L, T, K]``:
    the experts each token chose; ``src[T]``: the global rank each token starts on (it is
    dispatched inside that rank's EP group of ``ep_size`` consecutive ranks); ``rank_group[W]`` /
    ``rank_node[W]``: NVLink group and node of each global rank; ``hidden_bytes``: one hidden
    state row (``H x`` bytes per element). Returns ``{"autoep": {tier: bytes}, "dedup": {...}}``.
    """
    L, _, K = token_experts.shape
    P = ep_size
    grp, node = np.asarray(rank_group), np.asarray(rank_node)
    W = len(grp)
    H = hidden_bytes
    f = forward_passes
    # bytes per send: AutoEP rows (dispatch + combine), dedup rows (dispatch side + combine side)
    a_row = 2 * H * f + (2 * H if backward else 0)
    d_row = dedup_row_bytes(H, K, backward=backward, forward_passes=f)
    out = {d: dict.fromkeys(TIERS, 0.0) for d in DISPATCHERS}
    src = np.asarray(src, dtype=np.int64)
    base = (src // P) * P
    s = src % P
    expert2rank = np.asarray(expert2rank)
    if expert2rank.ndim == 2:  # one copy per expert: every source rank is served by the same rank
        expert2rank = np.broadcast_to(expert2rank[:, None, :], (L, P, expert2rank.shape[1]))
    num_experts = expert2rank.shape[2]
    peers = np.arange(W)
    for layer in range(L):
        dest = expert2rank[layer][s[:, None], token_experts[layer]]  # [T, K] EP ranks
        # AutoEP: one row per (token, expert) on another rank, there and back (+ count exchange)
        _charge(out["autoep"], np.repeat(src, K), (base[:, None] + dest).ravel(), a_row, grp, node)
        for p in range(P):
            _charge(
                out["autoep"],
                peers,
                (peers // P) * P + p,
                num_experts // P * COUNT_BYTES * f,
                grp,
                node,
            )
        # dedup: stage A per (token, remote group), stage B per (token, rank) inside the group
        for b in range(0, W, P):
            groups = dispatch_groups(grp[b : b + P])
            group_of = np.empty(P, dtype=np.int64)
            local_of = np.empty(P, dtype=np.int64)
            for g, ranks in enumerate(groups):
                group_of[ranks], local_of[ranks] = g, np.arange(len(ranks))
            table = np.array(groups)  # table[G, R]
            t_idx = np.flatnonzero(base == b)
            if not len(t_idx):
                continue
            d = dest[t_idx]  # [t, K]
            pairs = np.unique(
                np.stack([np.repeat(np.arange(len(t_idx)), K), group_of[d].ravel()], 1), axis=0
            )
            tok, tgt = pairs[:, 0], pairs[:, 1]
            sender = s[t_idx][tok]
            hub = table[tgt, local_of[sender]]  # rank i of group tgt
            _charge(out["dedup"], b + sender, b + hub, d_row, grp, node)
            rpairs = np.unique(
                np.stack([np.repeat(np.arange(len(t_idx)), K), d.ravel()], 1), axis=0
            )
            tok, r = rpairs[:, 0], rpairs[:, 1]
            hub = table[group_of[r], local_of[s[t_idx][tok]]]
            _charge(out["dedup"], b + hub, b + r, d_row, grp, node)
    return out
