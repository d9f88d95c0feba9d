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
