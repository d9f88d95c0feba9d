"""Routing statistics (``RoutingStats`` v1/v2) and a synthetic router trace generator.

``load[num_layers, num_experts]`` counts token->expert assignments, ``coact[num_layers,
num_experts, num_experts]`` counts tokens whose top-k held both i and j (symmetric, zero
diagonal). Optionally ``token_experts[num_layers, num_samples, top_k]`` keeps a uniform sample
of the window's tokens' expert sets (v2 ``tokenSamples``; the trainer records up to 64k tokens):
the cost model scores placements on them exactly, and without them top-k > 2 is only bounded.
"""

from __future__ import annotations

import numpy as np

from moe_contracts.routing import RoutingStats


def count_routing(token_experts: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """``token_experts[L, T, k]`` -> (``load[L, E]``, ``coact[L, E, E]``)."""
    L, _T, k = token_experts.shape
    E = num_experts
    load = np.zeros((L, E), dtype=np.int64)
    coact = np.zeros((L, E, E), dtype=np.int64)
    iu, ju = np.triu_indices(k, 1)
    for layer in range(L):
        te = token_experts[layer]
        load[layer] = np.bincount(te.ravel(), minlength=E)
        if k > 1:
            pairs = (te[:, iu] * E + te[:, ju]).ravel()
            c = np.bincount(pairs, minlength=E * E).reshape(E, E)
            coact[layer] = c + c.T
    return load, coact


def synthetic_trace(
    num_layers: int,
    num_experts: int,
    top_k: int,
    tokens: int,
    *,
    zipf_s: float = 0.4,
    num_clusters: int | None = None,
    cluster_affinity: float = 0.4,
    seed: int = 0,
    keep_tokens: bool = True,
) -> RoutingStats:
    """Sample real per-token top-k expert sets with skewed popularity and planted clusters.

    Per layer: expert popularity ``p_e ~ 1 / rank^zipf_s`` over a random expert order; experts
    are cut into ``num_clusters`` random clusters of (nearly) equal size (default E/8 experts
    each). Each token, with probability ``cluster_affinity``, picks a cluster (by its total
    popularity) and draws its top-k inside it (popularity-weighted, without replacement;
    when the cluster is smaller than k the rest come from all experts); otherwise it draws
    top-k from all experts. Sampling without replacement uses the Gumbel-top-k trick.
    """
    E, k = num_experts, top_k
    if not 1 <= k <= E:
        raise ValueError(f"top_k={k} must be in [1, num_experts={E}]")
    if not 0.0 <= cluster_affinity <= 1.0:
        raise ValueError(f"cluster_affinity={cluster_affinity} must be in [0, 1]")
    C = max(1, min(E, num_clusters if num_clusters is not None else E // 8))
    rng = np.random.default_rng(seed)
    token_experts = np.empty((num_layers, tokens, k), dtype=np.int64)
    planted = np.empty((num_layers, E), dtype=np.int64)
    for layer in range(num_layers):
        logp = -zipf_s * np.log(1.0 + rng.permutation(E))  # random popularity order
        cluster_of = rng.permutation(E) % C  # cluster_of[E]
        planted[layer] = cluster_of
        p = np.exp(logp)
        cluster_weight = np.bincount(cluster_of, weights=p, minlength=C)
        chosen = rng.choice(C, size=tokens, p=cluster_weight / cluster_weight.sum())
        in_cluster = rng.random(tokens) < cluster_affinity
        keys = logp[None, :] + rng.gumbel(size=(tokens, E))  # keys[T, E]
        inside = cluster_of[None, :] == chosen[:, None]
        # clustered tokens rank their cluster's experts above all others, then by key
        keys = keys + np.where(in_cluster[:, None] & inside, 1e3, 0.0)
        top = np.argpartition(-keys, k - 1, axis=1)[:, :k]
        token_experts[layer] = np.sort(top, axis=1)
    load, coact = count_routing(token_experts, E)
    return RoutingStats(
        num_layers,
        E,
        k,
        tokens,
        load,
        coact,
        1,
        "synthetic",
        f"synthetic(zipf_s={zipf_s}, clusters={C}, affinity={cluster_affinity})",
        token_experts if keep_tokens else None,
        planted,
    )


MIN_FOLD_TOKENS = 64  # fewer sampled tokens in a half: :func:`folds` does not split


def subset_stats(stats: RoutingStats, keep: np.ndarray) -> RoutingStats:
    """The statistics of the sampled tokens ``keep`` alone (indices, or a mask over the sample),
    counts recomputed from them; ``steps``: the steps they record, else the statistics' (a
    uniform part of the sample covers all of its steps)."""
    te = stats.token_experts
    if te is None:
        raise ValueError("the statistics hold no token sample")
    idx = np.flatnonzero(keep) if np.asarray(keep).dtype == bool else np.asarray(keep)
    sub = te[:, idx]
    load, coact = count_routing(sub, stats.num_experts)
    ts = None if stats.token_steps is None else stats.token_steps[idx]
    return RoutingStats(
        stats.num_layers,
        stats.num_experts,
        stats.top_k,
        len(idx),
        load,
        coact,
        len(np.unique(ts)) if ts is not None else stats.steps,
        stats.source,
        stats.model,
        sub,
        token_steps=ts,
    )


def folds(stats: RoutingStats) -> tuple[RoutingStats, RoutingStats, str] | None:
    """Two parts of the statistics' token sample, to fit on one and score on the other: the
    alternate training steps it records (1st, 3rd, ... and 2nd, 4th, ...; tokens of one step
    share their sequences), else (one step, no steps recorded, or a part under
    ``MIN_FOLD_TOKENS``) the sample's two halves (the trainer's sample is uniform in any prefix).
    With the basis in words; None without a sample or with a half under ``MIN_FOLD_TOKENS``."""
    te = stats.token_experts
    if te is None:
        return None
    T = te.shape[1]
    ts = stats.token_steps
    if ts is not None and len(np.unique(ts)) >= 2:
        first = np.unique(ts, return_inverse=True)[1] % 2 == 0
        if min(first.sum(), (~first).sum()) >= MIN_FOLD_TOKENS:
            return subset_stats(stats, first), subset_stats(stats, ~first), "alternate steps"
    if T // 2 < MIN_FOLD_TOKENS:
        return None
    half = np.arange(T) < T // 2
    return subset_stats(stats, half), subset_stats(stats, ~half), "the sample's halves"
