"""Cost model for an expert placement: bytes across NVLink groups and nodes, load, all-to-all time.

Per MoE layer (docs/placement.md): a token on GPU g is sent once to every *remote* NVLink group
holding at least one of its top-k experts (hierarchical dispatch de-duplicates within a group)
and once to every remote node; the combine sends the same volume back. Tokens originate evenly
on all GPUs: sampled token t starts on global rank ``t % world_size`` and is dispatched inside
that rank's EP group.

Two evaluation paths:
- **tokens** (exact): when the RoutingStats carry sampled ``token_experts``;
- **pairwise** (approximation from ``load``/``coact``): the chance a token hits a set S of
  experts is estimated from the expected count of its experts in S and of its expert pairs in
  S (``_hit_prob``). Exact for top-1 and top-2; for top-k > 2 it is a lower bound, so it
  under-estimates bytes (the benchmark prints how much).

**What AutoEP actually sends.** DeepSpeed 0.19.8's AutoEP all-to-all (``_AllToAllV`` in
``module_inject/auto_ep_layer.py``) sends one row per (token, expert) assignment whose expert
lives on another EP rank: nothing is de-duplicated, so co-activation does not change its bytes.
``autoep_sends`` models that path exactly from ``load`` alone: per EP group of P ranks carrying
``T`` assignments per layer, rank r (experts with load ``L_r``) sends ``(T - L_r) / P`` rows in
the dispatch and ``L_r (P - 1) / P`` in the combine. The total, ``2 T (P-1)/P``, is the same for
every placement; only the split across GPUs follows the load. The de-duplicated figures above
are what a per-rank/hierarchical dispatcher (DeepEP) would send.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from moe_contracts.routing import RoutingStats

from .topology import TIER_NODE, TIER_NVLINK, ClusterTopology

if TYPE_CHECKING:
    from .placement import Placement


@dataclass(frozen=True)
class Score:
    cross_group_bytes_per_step: float  # dispatch + combine, summed over layers
    cross_node_bytes_per_step: float
    max_mean_load: float  # mean over layers of max/mean tokens received per GPU
    worst_layer_max_mean_load: float
    all_to_all_seconds_per_step: float  # sum over layers of max over GPUs, dispatch + combine
    method: str  # "tokens" | "pairwise"
    autoep_bytes_per_gpu: tuple[float, ...] = ()  # AutoEP forward dispatch + combine, per GPU

    @property
    def autoep_max_gpu_bytes_per_step(self) -> float:
        return max(self.autoep_bytes_per_gpu, default=0.0)

    def quality(self, contiguous: Score | None = None) -> dict[str, Any]:
        """``MoEPlan.placement.quality`` (docs/contracts.md)."""
        out: dict[str, Any] = {
            "crossGroupBytesPerStep": round(self.cross_group_bytes_per_step),
            "crossNodeBytesPerStep": round(self.cross_node_bytes_per_step),
            "maxMeanLoad": round(self.max_mean_load, 4),
            "allToAllSecondsPerStep": self.all_to_all_seconds_per_step,
            "autoEpMaxGpuBytesPerStep": round(self.autoep_max_gpu_bytes_per_step),
        }
        if contiguous is not None:
            base = contiguous.cross_group_bytes_per_step
            out["crossGroupVsContiguous"] = (
                round(self.cross_group_bytes_per_step / base, 4) if base else 1.0
            )
        return out


def distinct_remote(dest: np.ndarray, src: np.ndarray) -> np.ndarray:
    """``dest[..., T, k]`` unit ids (group/node/GPU), ``src[T]`` -> ``count[..., T]`` of distinct
    dest units that differ from the token's own unit."""
    d = np.where(dest == src[:, None], -1, dest)
    d = np.sort(d, axis=-1)
    first = d[..., 0] >= 0
    new = (d[..., 1:] != d[..., :-1]) & (d[..., 1:] >= 0)
    count: np.ndarray = first + new.sum(axis=-1)
    return count


def gpu_load(placement: Placement, load: np.ndarray) -> np.ndarray:
    """``load[L, E]`` -> ``gpu_load[L, W]`` tokens received per GPU (replicas split tokens
    evenly)."""
    L, _E = load.shape
    P, W = placement.ep_size, placement.world_size
    out = np.zeros((L, W))
    for layer in range(L):
        rank_load = np.bincount(placement.expert2rank(layer), weights=load[layer], minlength=P)
        out[layer, placement.rank2gpu] = np.tile(rank_load, W // P) / (W // P)
    return out


def _tier_seconds(topo: ClusterTopology, sent: np.ndarray) -> float:
    """``sent[W_gpus, 3]`` bytes per GPU on (nvlink, node, network) -> slowest GPU's seconds."""
    nv = np.where(topo.nvlink_gbps > 0, topo.nvlink_gbps, topo.pcie_gbps) * 1e9
    t = (
        sent[:, 0] / nv
        + sent[:, 1] / (topo.pcie_gbps * 1e9)
        + sent[:, 2] / (topo.network_gbps * 1e9)
    )
    return float(t.max()) if len(t) else 0.0


def score(
    placement: Placement,
    topo: ClusterTopology,
    trace: RoutingStats,
    *,
    hidden_size: int,
    bytes_per_elem: int = 2,
) -> Score:
    """Score a placement on a trace: exact on sampled tokens when present, else pairwise."""
    if placement.world_size != topo.num_gpus:
        raise ValueError(f"placement world size {placement.world_size} != {topo.num_gpus} GPUs")
    if (trace.num_layers, trace.num_experts) != placement.permutation.shape:
        raise ValueError(
            f"trace is {trace.num_layers} layers x {trace.num_experts} experts, placement "
            f"is {placement.permutation.shape[0]} x {placement.permutation.shape[1]}"
        )
    token_bytes = float(hidden_size * bytes_per_elem)
    per_step = 1.0 / max(trace.steps, 1)
    if trace.token_experts is not None:
        cg, cn, secs = _token_costs(placement, topo, trace)
        method = "tokens"
    else:
        cg, cn, secs = _pairwise_costs(placement, topo, trace)
        method = "pairwise"
    loads = gpu_load(placement, trace.load.astype(float))
    mean = loads.mean(axis=1)
    ratio = np.where(mean > 0, loads.max(axis=1) / np.where(mean > 0, mean, 1), 1.0)
    f = 2.0 * token_bytes * per_step  # x2: dispatch + combine
    autoep = autoep_sends(placement, trace.load.astype(float)) * token_bytes * per_step
    return Score(
        float(cg * f),
        float(cn * f),
        float(ratio.mean()),
        float(ratio.max()),
        float(secs * f),
        method,
        tuple(float(x) for x in autoep),
    )


def autoep_sends(placement: Placement, load: np.ndarray) -> np.ndarray:
    """Rows each GPU sends to other GPUs in AutoEP's forward dispatch + combine, summed over
    layers, for ``load[L, E]`` assignments; ``[W]``. Each source rank is assumed to route like the
    whole (its share of ``load`` is ``load / W``); backward sends the same again."""
    P = placement.ep_size
    received = gpu_load(placement, load)  # [L, W]: each GPU's L_r
    per_group = load.sum(axis=1, keepdims=True) / (placement.world_size // P)  # T per EP group
    sends: np.ndarray = ((per_group - received) / P + received * (P - 1) / P).sum(axis=0)
    return sends


def _token_costs(
    placement: Placement, topo: ClusterTopology, trace: RoutingStats
) -> tuple[float, float, float]:
    """Remote-group and remote-node sends (token counts) and per-layer slowest-GPU seconds/byte."""
    te = trace.token_experts  # [L, T, k]
    if te is None:
        raise ValueError("per-token costs need the trace's token samples")
    L, T, _ = te.shape
    scale = trace.tokens / T if T else 0.0  # samples may be a subset of the recorded tokens
    W, P = placement.world_size, placement.ep_size
    src_rank = np.arange(T) % W
    base = (src_rank // P) * P
    src_gpu = placement.rank2gpu[src_rank]
    tier = topo.tier_matrix()
    cg = cn = secs = 0.0
    for layer in range(L):
        dest_gpu = placement.rank2gpu[base[:, None] + placement.expert2rank(layer)[te[layer]]]
        g = distinct_remote(topo.group_of[dest_gpu], topo.group_of[src_gpu])
        n = distinct_remote(topo.node_of[dest_gpu], topo.node_of[src_gpu])
        cg += g.sum() * scale
        cn += n.sum() * scale
        # per source GPU: distinct GPUs over NVLink, remote groups in-node over PCIe, remote nodes
        in_group = tier[src_gpu[:, None], dest_gpu] == TIER_NVLINK
        nv = distinct_remote(np.where(in_group, dest_gpu, -2), np.full(T, -2))
        node_groups = tier[src_gpu[:, None], dest_gpu] == TIER_NODE
        pc = distinct_remote(np.where(node_groups, topo.group_of[dest_gpu], -2), np.full(T, -2))
        sent = np.stack(
            [np.bincount(src_gpu, weights=x * scale, minlength=W) for x in (nv, pc, n)], 1
        )
        secs += _tier_seconds(topo, sent)
    return cg, cn, secs


def _hit_prob(member: np.ndarray, load: np.ndarray, coact: np.ndarray, tokens: int) -> np.ndarray:
    """``member[U, E]`` one-hot expert sets -> P(token hits set u) from first and second moments.

    With X = number of a token's experts in the set, ``mu = E[X] = sum load / T`` and
    ``pairs = E[X(X-1)/2] = sum_{i<j} coact_ij / T``. Both ``mu - pairs`` (Bonferroni) and
    ``mu^2 / E[X^2]`` (second-moment bound) are lower bounds of P(X > 0); the first is exact when
    X <= 2 (top-1/top-2), so we take the larger, clamped to ``[max load / T, 1]``.
    """
    if tokens <= 0:
        return np.zeros(len(member))
    mu = member @ load / tokens
    pairs = 0.5 * np.einsum("ue,ef,uf->u", member, coact, member) / tokens
    second = np.divide(mu * mu, mu + 2 * pairs, out=np.zeros_like(mu), where=mu > 0)
    floor = (member * load[None, :]).max(axis=1) / tokens
    prob: np.ndarray = np.clip(np.maximum(mu - pairs, second), floor, 1.0)
    return prob


def _pairwise_costs(
    placement: Placement, topo: ClusterTopology, trace: RoutingStats
) -> tuple[float, float, float]:
    W, P = placement.world_size, placement.ep_size
    R = W // P
    T = trace.tokens / R  # tokens per EP replica
    cg = cn = secs = 0.0
    tier = topo.tier_matrix()
    for layer in range(trace.num_layers):
        load, coact = trace.load[layer].astype(float), trace.coact[layer].astype(float)
        e2r = placement.expert2rank(layer)
        sent = np.zeros((W, 3))
        for r in range(R):
            gpus = placement.rank2gpu[r * P : (r + 1) * P]  # gpus[P]
            e2gpu = gpus[e2r]  # e2gpu[E]
            for unit_of, col in ((topo.group_of, None), (topo.node_of, 2)):
                units = np.unique(unit_of[gpus])
                member = (unit_of[e2gpu][None, :] == units[:, None]).astype(float)
                hit = _hit_prob(member, load, coact, trace.tokens) * T  # tokens hitting each unit
                share = (unit_of[gpus][None, :] == units[:, None]).sum(1) / P
                remote = float((hit * (1 - share)).sum())
                if col is None:
                    cg += remote
                else:
                    cn += remote
                    per_src = hit[None, :] * (unit_of[gpus][:, None] != units[None, :]) / P
                    sent[gpus, 2] += per_src.sum(1)
            # NVLink (distinct GPUs in own group) and PCIe (remote groups in own node) per source
            gpu_member = (e2gpu[None, :] == gpus[:, None]).astype(float)
            hit_gpu = _hit_prob(gpu_member, load, coact, trace.tokens) * T / P
            groups = np.unique(topo.group_of[gpus])
            gm = (topo.group_of[e2gpu][None, :] == groups[:, None]).astype(float)
            hit_grp = _hit_prob(gm, load, coact, trace.tokens) * T / P
            t = tier[np.ix_(gpus, gpus)]
            sent[gpus, 0] += ((t == TIER_NVLINK) * hit_gpu[None, :]).sum(1)
            grp_tier = tier[
                np.ix_(gpus, [gpus[np.argmax(topo.group_of[gpus] == g)] for g in groups])
            ]
            sent[gpus, 1] += ((grp_tier == TIER_NODE) * hit_grp[None, :]).sum(1)
        secs += _tier_seconds(topo, sent)
    return cg, cn, secs


def cross_counts_for_candidates(
    e2r: np.ndarray, rank_group: np.ndarray, rank_node: np.ndarray, trace: RoutingStats, layer: int
) -> np.ndarray:
    """Exact remote group + node sends for many candidate ``e2r[C, E]`` of one EP group (brute
    force).

    Uses sampled tokens when present (source EP rank ``t % P``), else the pairwise formula.
    """
    P = len(rank_group)
    if trace.token_experts is not None:
        te = trace.token_experts[layer]  # [T, k]
        src = np.arange(len(te)) % P
        dest = e2r[:, te]  # [C, T, k]
        g = distinct_remote(rank_group[dest], rank_group[src]).sum(-1)
        n = distinct_remote(rank_node[dest], rank_node[src]).sum(-1)
        sends: np.ndarray = (g + n) * (trace.tokens / max(len(te), 1))
        return sends
    load, coact = trace.load[layer].astype(float), trace.coact[layer].astype(float)
    out = np.zeros(len(e2r))
    for unit_of in (rank_group, rank_node):
        units = np.unique(unit_of)
        share = (unit_of[None, :] == units[:, None]).sum(1) / P
        for c, cand in enumerate(e2r):
            member = (unit_of[cand][None, :] == units[:, None]).astype(float)
            out[c] += (
                _hit_prob(member, load, coact, trace.tokens) * trace.tokens * (1 - share)
            ).sum()
    return out
