"""Expert copies in a re-placement decision (``core.replan``; a plan with ``placement.replicas``).

A layout is a permutation and, per layer, its copies (:class:`.placement.replicas.LayerCopies`:
``holders[e]`` home first, ``serve[P, E]``). The decision fits copies the way the planner does
(:func:`.placement.replicas.solve` on the single-copy layout the solver found, fitted on the same
token samples) and scores a layout per layer in the trainer counters' measure: the dedup
dispatcher's cross-group token bytes under the serve table (``moe_contracts.dispatch.tier_bytes``,
exact on the samples, scaled to the job's tokens per step) plus the copies' own cross-group weight
sync (``moe_contracts.dispatch.copy_sync_bytes``, a fixed cost per step and copy): the
``netCrossGroupBytesPerStep`` of the plan's ``quality.replicas``.

The budget is the plan's own, so the plan's memory estimate stays true: a layer gets at most as
many copies on one rank as the plan's fullest layer had on one rank (:attr:`Budget.slots`), with
an explicit ``replicas: N`` at most as many per layer as the plan's fullest layer got
(:attr:`Budget.total`), and no rank holds more copies over all layers than the plan's fullest rank
did (:attr:`Budget.per_rank`): the memory model counts those (``core.memory``). A decision that
would exceed it keeps the running layout, least saving first, in the switched layers that add
copies on a rank over the budget, until it fits (:func:`fit_memory`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from moe_contracts.dispatch import copy_sync_bytes, tier_bytes
from moe_contracts.routing import RoutingStats

from .placement import replicas as rep
from .topology import ClusterTopology


@dataclass(frozen=True)
class Budget:
    """The plan's copies as a budget (module docstring); ``slots == 0``: the plan has none."""

    slots: int  # extra copies one EP rank may hold in one layer
    total: int | None  # most extra copies per layer (an explicit ``replicas: N``), None: no cap
    per_rank: int  # extra copies one EP rank may hold over all layers
    expert_bytes: int  # one expert's w1 + w2 + w3 as a copy receives them
    micro_steps: int  # each micro step syncs the copies once per layer


def held(copies: Sequence[rep.LayerCopies], P: int) -> np.ndarray:
    """``held[L, P]``: extra copies each EP rank holds in each layer."""
    out = np.zeros((len(copies), P), dtype=np.int64)
    for layer, c in enumerate(copies):
        for h in c.holders:
            np.add.at(out[layer], list(h[1:]), 1)
    return out


def budget(placement: Any, expert_bytes: int, micro_steps: int) -> Budget:
    """The budget of a parsed plan's ``placement`` (``moe_contracts.plan.Placement``) with
    copies; ``slots == 0`` without."""
    reps = placement.replicas
    if not reps:
        return Budget(0, None, 0, expert_bytes, micro_steps)
    h = held(from_contract(reps, placement.permutation, placement.ep_size), placement.ep_size)
    mode = str(((placement.quality or {}).get("replicas") or {}).get("mode", ""))
    total = int(h.sum(1).max()) if mode.isdigit() else None
    return Budget(int(h.max()), total, int(h.sum(0).max()), expert_bytes, micro_steps)


def from_contract(
    reps: Sequence[Any] | None, permutation: Sequence[Sequence[int]], P: int
) -> list[rep.LayerCopies]:
    """``LayerReplicas`` or their JSON (the plan's, a PlacementUpdate's, a decision's; None: one
    copy per expert under ``permutation``) -> one :class:`LayerCopies` per layer."""
    out = []
    for layer, row in enumerate(permutation):
        E = len(row)
        holders: tuple[tuple[int, ...], ...]
        if reps is None:
            home = np.empty(E, dtype=np.int64)
            home[np.asarray(row)] = np.arange(E) // (E // P)
            holders = tuple((int(r),) for r in home)
            serve = rep.single_copy(home, P)
        else:
            r = reps[layer]
            holders = tuple(tuple(int(x) for x in h) for h in _field(r, "holders"))
            serve = np.asarray(_field(r, "serve"), dtype=np.int64)
        out.append(rep.LayerCopies(holders, serve, np.zeros(P)))
    return out


def _field(layer: Any, name: str) -> Any:
    return layer[name] if isinstance(layer, dict) else getattr(layer, name)


def to_contract(copies: Sequence[rep.LayerCopies]) -> list[dict[str, list[list[int]]]]:
    return [c.to_json() for c in copies]


def fit(
    permutation: np.ndarray,
    stats: RoutingStats,
    topo: ClusterTopology,
    ep_size: int,
    b: Budget,
) -> list[rep.LayerCopies]:
    """The planner's copies for ``permutation`` on ``stats``' token samples (one GPU per rank, in
    rank order, as ``core.replan.plan_topology``)."""
    te = stats.token_experts
    assert te is not None
    W = topo.num_gpus
    src = (np.arange(te.shape[1]) % W) % ep_size
    return rep.solve(permutation, topo.group_of[:ep_size], te, src, slots=b.slots, total=b.total)


def layer_bytes(
    copies: Sequence[rep.LayerCopies],
    stats: RoutingStats,
    topo: ClusterTopology,
    ep_size: int,
    b: Budget,
    *,
    hidden_bytes: int,
    tokens_per_step: int,
) -> np.ndarray:
    """Net cross-group bytes per step of each layer (module docstring): ``[L]``."""
    te = stats.token_experts
    assert te is not None
    T, W, P = te.shape[1], topo.num_gpus, ep_size
    out = np.zeros(len(copies))
    for layer, c in enumerate(copies):
        got = tier_bytes(
            c.serve[None],
            te[layer : layer + 1],
            np.arange(T) % W,
            topo.group_of,
            topo.node_of,
            P,
            hidden_bytes=hidden_bytes,
        )
        token = float(got["dedup"]["crossGroup"]) * tokens_per_step / max(T, 1)
        sync = 0
        for base in range(0, W, P):  # every EP group syncs its own copies
            group, node = topo.group_of[base : base + P], topo.node_of[base : base + P]
            for h in c.holders:
                for r in h[1:]:
                    sync += copy_sync_bytes(r, h[0], group, node, b.expert_bytes * b.micro_steps)[
                        "crossGroup"
                    ]
        out[layer] = token + sync
    return out


def fit_memory(
    take: np.ndarray,
    saving: np.ndarray,
    running: Sequence[rep.LayerCopies],
    candidate: Sequence[rep.LayerCopies],
    P: int,
    per_rank: int,
) -> np.ndarray:
    """``take[L]`` with switched layers given back to the running layout, least saving first and
    only those that hold more copies than the running layout on a rank over ``per_rank``, until no
    EP rank holds more than ``per_rank`` copies over all layers."""
    take = take.copy()
    h_run, h_cand = held(running, P), held(candidate, P)
    for layer in [int(i) for i in np.argsort(saving, kind="stable") if take[i]]:
        over = np.where(take[:, None], h_cand, h_run).sum(0) > per_rank
        if not over.any():
            break
        if (h_cand[layer, over] > h_run[layer, over]).any():
            take[layer] = False
    return take
