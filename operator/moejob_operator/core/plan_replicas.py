"""The replicas step of :func:`.plan.build_plan` (``spec.placement.replicas``): whether to give hot
experts extra copies, the copies (:mod:`.placement.replicas`) and their figures for
``placement.quality.replicas``.

``replicas``: None / ``"none"``: one copy per expert, nothing in the plan changes. ``"auto"``:
``floor(overhead x experts per rank)`` copies per rank and layer when the routing statistics
carry token samples, the dispatcher is ``dedup`` and the EP group spans more than one NVLink
group; otherwise none, with the reason in ``quality.replicas.reason``. An integer N: N extra
copies per layer, refused (``FieldError("replicas")``) when one of those conditions fails or N is
above the memory budget. Bytes and load are exact on the token samples (the byte model of
``moe_contracts.dispatch``), scaled to the job's tokens per step like ``quality.dispatch``.

A copy is not free: every micro step and layer it receives its expert's weights from the home and
sends their gradients back (``moe_trainer.dispatch.dedup_replicas.sync_bytes``), ``2 x
expert_bytes`` per copy, once per EP group. ``quality.replicas.syncBytesPerStep`` holds that by
tier and ``netCrossGroupBytesPerStep`` the token bytes plus the sync's cross-group bytes. ``"auto"``
keeps copies only when they cut the net cross-group bytes (the token bytes they save exceed the
weights they move); an explicit N is kept as asked, with the same figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from moe_contracts.dispatch import TIERS, copy_sync_bytes, dispatch_groups, tier_bytes
from moe_contracts.routing import RoutingStats

from . import placement as placement_mod
from .errors import FieldError
from .placement import replicas as rep
from .topology import ClusterTopology


@dataclass(frozen=True)
class Replicas:
    """``layers``: the chosen copies per layer (None: one copy per expert); ``quality``:
    ``placement.quality.replicas`` (None when the job did not ask); ``copies_per_rank``: the most
    extra copies one EP rank holds over all layers (for the memory model)."""

    layers: list[rep.LayerCopies] | None = None
    quality: dict[str, Any] | None = None
    copies_per_rank: int = 0
    dedup_per_step: dict[str, int] | None = None  # quality.dispatch.dedup with the copies

    def to_json(self) -> list[dict[str, Any]] | None:
        return None if self.layers is None else [c.to_json() for c in self.layers]


def _why_not(stats: RoutingStats | None, dispatcher: str, groups: int) -> str | None:
    if dispatcher != "dedup":
        return f"dispatcher {dispatcher!r} serves one copy per expert (replicas need 'dedup')"
    if groups < 2:
        return "the EP group lies inside one NVLink group: copies cannot cut cross-group bytes"
    if stats is None or stats.token_experts is None:
        return "no routing statistics with tokenSamples to place copies on"
    return None


def plan_replicas(
    mode: int | str | None,
    overhead_percent: int,
    pl: placement_mod.Placement,
    topo: ClusterTopology,
    stats: RoutingStats | None,
    dispatcher: str,
    *,
    hidden_bytes: int,
    tokens_per_step: int,
    expert_bytes: int = 0,
    micro_steps: int = 1,
) -> Replicas:
    """The replicas for ``mode`` (module docstring) on placement ``pl``; ``expert_bytes``: one
    expert's weights (w1 + w2 + w3) as the copies receive them, ``micro_steps``: micro steps per
    optimizer step (each syncs the copies once per layer)."""
    bad_word = isinstance(mode, str) and mode not in ("auto", "none")
    if bad_word or (isinstance(mode, int) and mode < 0):
        raise FieldError("replicas", f"{mode!r} is not 'auto', 'none' or a number of copies")
    if mode is None or mode == "none" or mode == 0:
        return Replicas()
    P, n = pl.ep_size, pl.experts_per_rank
    rank_group = topo.group_of[pl.rank2gpu[:P]]
    groups = len(dispatch_groups(rank_group))
    slots = rep.copy_slots(n, overhead_percent)
    why = _why_not(stats, dispatcher, groups)
    if isinstance(mode, int):
        if why is not None:
            raise FieldError("replicas", f"{mode} extra copies per layer: {why}")
        if mode > slots * P:
            raise FieldError(
                "replicas",
                f"{mode} extra copies per layer exceed maxExpertMemoryOverhead "
                f"{overhead_percent}% = {slots} per rank x {P} EP ranks = {slots * P}",
            )
    elif why is None and slots == 0:
        why = f"maxExpertMemoryOverhead {overhead_percent}% of {n} experts per rank is no copy"
    if why is not None:
        return Replicas(quality={"mode": str(mode), "chosen": False, "reason": why})
    assert stats is not None and stats.token_experts is not None
    te = stats.token_experts
    src = (np.arange(te.shape[1]) % pl.world_size) % P
    layers = rep.solve(
        pl.permutation,
        rank_group,
        te,
        src,
        slots=slots,
        total=mode if isinstance(mode, int) else None,
    )
    quality, per_rank, dedup = _figures(layers, pl, topo, te, hidden_bytes, tokens_per_step)
    sync = _sync_per_step(layers, pl, topo, expert_bytes, micro_steps)
    token = quality["crossGroupBytesPerStep"]
    net = token["withCopies"] + sync["crossGroupBytesPerStep"]
    quality["syncBytesPerStep"] = sync
    quality["netCrossGroupBytesPerStep"] = {
        "withCopies": net,
        "withoutCopies": token["withoutCopies"],
    }
    if mode == "auto" and quality["extraCopies"] and net >= token["withoutCopies"]:
        saved = token["withoutCopies"] - token["withCopies"]
        return Replicas(
            quality={
                "mode": str(mode),
                "chosen": False,
                "reason": (
                    f"the copies' weights ({sync['crossGroupBytesPerStep']} cross-group bytes per "
                    f"step, there and back) would cost more than the token bytes they save "
                    f"({saved})"
                ),
                **quality,
            }
        )
    extra = quality["extraCopies"]
    budget = "" if isinstance(mode, int) else f" within maxExpertMemoryOverhead {overhead_percent}%"
    quality = {
        "mode": str(mode),
        "chosen": extra > 0,
        "reason": f"{extra} extra copies over {pl.num_layers} layers{budget}"
        if extra
        else "no copy cuts cross-group bytes within the load limit",
        **quality,
    }
    if not extra:
        return Replicas(quality=quality)
    return Replicas(layers, quality, per_rank, dedup)


def _sync_per_step(
    layers: list[rep.LayerCopies],
    pl: placement_mod.Placement,
    topo: ClusterTopology,
    expert_bytes: int,
    micro_steps: int,
) -> dict[str, int]:
    """Bytes per optimizer step the copies' weights move (home -> copy forward, gradients back),
    by tier, over every EP group of the world (``dedup_replicas.sync_bytes``, per micro step and
    layer: ``moe_contracts.dispatch.copy_sync_bytes``)."""
    P = pl.ep_size
    out = {f"{t}BytesPerStep": 0 for t in TIERS}
    for b in range(0, pl.world_size, P):
        gpus = pl.rank2gpu[b : b + P]
        group, node = topo.group_of[gpus], topo.node_of[gpus]
        for c in layers:
            for h in c.holders:
                for r in h[1:]:
                    for t, n in copy_sync_bytes(
                        r, h[0], group, node, expert_bytes * micro_steps
                    ).items():
                        out[f"{t}BytesPerStep"] += n
    return out


def _figures(
    layers: list[rep.LayerCopies],
    pl: placement_mod.Placement,
    topo: ClusterTopology,
    te: np.ndarray,
    hidden_bytes: int,
    tokens_per_step: int,
) -> tuple[dict[str, Any], int, dict[str, int]]:
    """``quality.replicas`` figures and the most copies one EP rank holds over all layers."""
    P, n, T = pl.ep_size, pl.experts_per_rank, te.shape[1]
    held = np.zeros(P, dtype=np.int64)
    for c in layers:
        for h in c.holders:
            np.add.at(held, list(h[1:]), 1)
    single = np.stack([pl.expert2rank(layer) for layer in range(pl.num_layers)])
    scale = tokens_per_step / max(T, 1)

    def dedup(serve: np.ndarray) -> dict[str, int]:
        b = tier_bytes(
            serve,
            te,
            np.arange(T) % pl.world_size,
            topo.group_of[pl.rank2gpu],
            topo.node_of[pl.rank2gpu],
            P,
            hidden_bytes=hidden_bytes,
        )
        return {f"{tier}BytesPerStep": round(v * scale) for tier, v in b["dedup"].items()}

    def worst_load(serve: np.ndarray) -> float:
        src = (np.arange(T) % pl.world_size) % P
        worst = 0.0
        for layer in range(pl.num_layers):
            load = rep.rank_load(serve[layer], rep.pair_load(te[layer], src, P, pl.num_experts))
            worst = max(worst, float(load.max() / max(load.mean(), 1e-12)))
        return round(worst, 4)

    with_copies = rep.serve_table(layers)
    without = np.broadcast_to(single[:, None, :], with_copies.shape)
    per_rank = int(held.max())
    ours, base = dedup(with_copies), dedup(without)
    return (
        {
            "extraCopies": int(sum(c.extra_copies for c in layers)),
            "copiesPerRankPerLayer": max(
                int(np.bincount([r for h in c.holders for r in h[1:]], minlength=P).max())
                for c in layers
            ),
            "memoryOverheadFraction": round(per_rank / (n * pl.num_layers), 4),
            "crossGroupBytesPerStep": {
                "withCopies": ours["crossGroupBytesPerStep"],
                "withoutCopies": base["crossGroupBytesPerStep"],
            },
            "loadMaxOverMean": {
                "withCopies": worst_load(with_copies),
                "withoutCopies": worst_load(without),
            },
            "basis": f"{T} sampled tokens",
        },
        per_rank,
        ours,
    )
