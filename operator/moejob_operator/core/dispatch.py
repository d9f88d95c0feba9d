"""Bytes per tier that each expert-parallel dispatcher sends, exactly, for sampled tokens.

Two dispatchers (``placement.dispatcher`` in the plan):

- ``autoep``: DeepSpeed 0.19.8 AutoEP's all-to-all (``AutoEPMoELayer._forward``): one row of
  ``H`` elements per (token, expert) whose expert is on another EP rank, there and back; plus its
  per-layer count exchange (an all-to-all of ``E`` int32 counts, ``E / P`` to each peer).
- ``dedup``: the trainer's two-stage dispatcher (``moe_trainer.dedup_ep``): EP ranks form G
  groups of R (the NVLink groups of the EP group; unequal groups run flat, R = 1). A token on
  EP rank ``s`` (index ``i`` in its group) sends one row to rank ``i`` of every other group it
  needs (stage A), and from there (or from ``s`` for its own group) one row to every other rank
  of that group holding one of its experts (stage B). A dispatched row carries ``H`` elements +
  ``K`` int32 ids + ``K`` fp32 weights; a combined row ``H`` elements. Backward sends the
  gradients back the same ways (``H`` elements each way, + ``K`` fp32 weight gradients on the
  dispatch side); ids have no gradient.

Every send is charged to the tier between sender and receiver: ``intraGroup`` (same NVLink
group), ``crossGroup`` (different group), of which ``crossNode`` leaves the node. These are the
figures the trainer's counters measure (``moe.allToAllBytesPerStepByTier`` in progress).
Sampled token ``t`` starts on global rank ``t % world_size`` (as in :mod:`.cost`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .topology import ClusterTopology

if TYPE_CHECKING:
    from .placement import Placement

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


def dispatch_bytes(
    placement: Placement,
    topo: ClusterTopology,
    token_experts: np.ndarray,
    *,
    hidden_size: int,
    bytes_per_elem: int,
    backward: bool = True,
) -> dict[str, dict[str, float]]:
    """``token_experts[L, T, K]`` (original ids) -> ``{"autoep": {tier: bytes}, "dedup": {...}}``
    for routing those T tokens through every layer once (forward, + backward when asked)."""
    L, T, K = token_experts.shape
    W, P = placement.world_size, placement.ep_size
    H = hidden_size * bytes_per_elem
    grp = topo.group_of[placement.rank2gpu]  # grp[W]: NVLink group of each global rank
    node = topo.node_of[placement.rank2gpu]
    # bytes per send: (forward + backward) for AutoEP rows, dedup rows (dispatch side, combine side)
    a_row = 2 * H * (2 if backward else 1)
    d_row = 2 * H + K * (ID_BYTES + WEIGHT_BYTES) + ((2 * H + K * WEIGHT_BYTES) if backward else 0)
    out = {d: dict.fromkeys(TIERS, 0.0) for d in DISPATCHERS}
    src = np.arange(T) % W
    base = (src // P) * P
    s = src % P
    for layer in range(L):
        e2r = placement.expert2rank(layer)
        dest = e2r[token_experts[layer]]  # [T, K] EP ranks
        # AutoEP: one row per (token, expert) on another rank, there and back (+ count exchange)
        _charge(out["autoep"], np.repeat(src, K), (base[:, None] + dest).ravel(), a_row, grp, node)
        peers = np.arange(W)
        for p in range(P):
            _charge(
                out["autoep"],
                peers,
                (peers // P) * P + p,
                placement.num_experts // P * COUNT_BYTES,
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
            mine = base == b
            t_idx = np.flatnonzero(mine)
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


def per_step(
    bytes_by_dispatcher: dict[str, dict[str, float]], scale: float
) -> dict[str, dict[str, int]]:
    """Scale to a step and round: ``{dispatcher: {tierBytesPerStep: int}}`` for the plan."""
    return {
        d: {f"{tier}BytesPerStep": round(v * scale) for tier, v in tiers.items()}
        for d, tiers in bytes_by_dispatcher.items()
    }
