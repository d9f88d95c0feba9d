"""Routing statistics (``RoutingStats`` v1/v2) and a synthetic router trace generator.

``load[num_layers, num_experts]`` counts token->expert assignments, ``coact[num_layers,
num_experts, num_experts]`` counts tokens whose top-k held both i and j (symmetric, zero
diagonal). Optionally ``token_experts[num_layers, num_samples, top_k]`` keeps a uniform sample
of the window's tokens' expert sets (v2 ``tokenSamples``; the trainer records up to 64k tokens):
the cost model scores placements on them exactly, and without them top-k > 2 is only bounded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .errors import DocumentError, check_kind_version, read_json_document

DOCUMENT = "RoutingStats"
VERSIONS = (1, 2)               # v2 = v1 + optional tokenSamples


@dataclass(frozen=True, eq=False)
class RoutingStats:
    num_layers: int
    num_experts: int
    top_k: int
    tokens: int                     # tokens routed per layer over the recording window
    load: np.ndarray                # load[num_layers, num_experts], int64
    coact: np.ndarray               # coact[num_layers, num_experts, num_experts], int64
    steps: int = 1
    source: str = "synthetic"
    model: str = ""
    token_experts: np.ndarray | None = field(default=None, repr=False)  # [L, T, top_k] or None
    planted_clusters: np.ndarray | None = field(default=None, repr=False)  # [L, E], synthetic only

    def to_json(self) -> dict[str, Any]:
        doc = {"kind": DOCUMENT, "version": 2, "source": self.source, "model": self.model,
               "numLayers": self.num_layers, "numExperts": self.num_experts, "topK": self.top_k,
               "tokens": self.tokens, "steps": self.steps,
               "load": self.load.tolist(), "coactivation": self.coact.tolist()}
        if self.token_experts is not None:
            doc["tokenSamples"] = {"experts": self.token_experts.tolist()}
        return doc

    @property
    def exact(self) -> bool:
        """Whether placements can be scored exactly: token samples, or top-k <= 2 (pairs suffice)."""
        return self.token_experts is not None or self.top_k <= 2

    def without_tokens(self) -> RoutingStats:
        """The same statistics as a recorded document would carry (matrices only)."""
        return RoutingStats(self.num_layers, self.num_experts, self.top_k, self.tokens, self.load,
                            self.coact, self.steps, self.source, self.model, None, self.planted_clusters)


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


def _err(path: str, value: Any, what: str) -> DocumentError:
    text = repr(value)
    text = text if len(text) <= 80 else text[:77] + "..."
    return DocumentError(f"{DOCUMENT} {path}: {text} {what}")


def _int_field(obj: dict[str, Any], name: str, minimum: int) -> int:
    if name not in obj:
        raise DocumentError(f"{DOCUMENT} {name}: required field is missing")
    v = obj[name]
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise _err(name, v, f"is not an integer >= {minimum}")
    return v


def _array(obj: dict[str, Any], name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name not in obj:
        raise DocumentError(f"{DOCUMENT} {name}: required field is missing")
    try:
        arr = np.array(obj[name])
    except ValueError:
        raise _err(name, "...", "is a ragged array") from None
    if arr.shape != shape:
        raise DocumentError(f"{DOCUMENT} {name}: shape {list(arr.shape)} does not match "
                            f"numLayers/numExperts {list(shape)}")
    if arr.size and (arr.dtype.kind not in "iu"):
        if arr.dtype.kind == "f" and np.all(np.isfinite(arr)) and np.all(arr == np.round(arr)):
            arr = arr.astype(np.int64)
        else:
            raise DocumentError(f"{DOCUMENT} {name}: counts must be integers (got {arr.dtype})")
    arr = arr.astype(np.int64)
    if (arr < 0).any():
        idx = tuple(int(i) for i in np.argwhere(arr < 0)[0])
        raise _err(name + "".join(f"[{i}]" for i in idx), int(arr[idx]), "is negative")
    return arr


def parse_routing_stats(obj: Any) -> RoutingStats:
    """Validate a decoded RoutingStats document (all invariants of docs/contracts.md)."""
    check_kind_version(DOCUMENT, obj, VERSIONS)
    L = _int_field(obj, "numLayers", 1)
    E = _int_field(obj, "numExperts", 1)
    k = _int_field(obj, "topK", 1)
    tokens = _int_field(obj, "tokens", 0)
    steps = _int_field(obj, "steps", 0) if "steps" in obj else 1
    if k > E:
        raise _err("topK", k, f"exceeds numExperts {E}")
    load = _array(obj, "load", (L, E))
    coact = _array(obj, "coactivation", (L, E, E))
    sums = load.sum(axis=1)
    for layer in range(L):
        if sums[layer] != tokens * k:
            raise DocumentError(f"{DOCUMENT} load[{layer}]: sums to {int(sums[layer])}, "
                                f"expected tokens*topK = {tokens * k}")
        c = coact[layer]
        if (c != c.T).any():
            i, j = (int(x) for x in np.argwhere(c != c.T)[0])
            raise DocumentError(f"{DOCUMENT} coactivation[{layer}][{i}][{j}]: {int(c[i, j])} != "
                                f"coactivation[{layer}][{j}][{i}] {int(c[j, i])} (not symmetric)")
        if np.diagonal(c).any():
            i = int(np.flatnonzero(np.diagonal(c))[0])
            raise _err(f"coactivation[{layer}][{i}][{i}]", int(c[i, i]), "is not 0 (diagonal must be zero)")
        rows, want = c.sum(axis=1), (k - 1) * load[layer]
        if (rows != want).any():
            i = int(np.flatnonzero(rows != want)[0])
            raise DocumentError(f"{DOCUMENT} coactivation[{layer}][{i}]: row sums to {int(rows[i])}, "
                                f"expected (topK-1)*load[{layer}][{i}] = {int(want[i])}")
    samples = _token_samples(obj, L, E, k, tokens) if obj["version"] >= 2 else None
    return RoutingStats(L, E, k, tokens, load, coact, steps,
                        str(obj.get("source", "trainer")), str(obj.get("model", "")), samples)


def _token_samples(obj: dict[str, Any], L: int, E: int, k: int, tokens: int) -> np.ndarray | None:
    """``tokenSamples.experts[L][S][k]`` -> ``token_experts[L, S, k]`` (None when absent)."""
    ts = obj.get("tokenSamples")
    if ts is None:
        return None
    if not isinstance(ts, dict) or "experts" not in ts:
        raise DocumentError(f"{DOCUMENT} tokenSamples: expected an object with 'experts'")
    try:
        ex = np.array(ts["experts"])
    except ValueError:
        raise _err("tokenSamples.experts", "...", "is a ragged array") from None
    if ex.size == 0:
        return None
    if ex.ndim != 3 or ex.shape[0] != L or ex.shape[2] != k or ex.dtype.kind not in "iu":
        raise DocumentError(f"{DOCUMENT} tokenSamples.experts: shape {list(ex.shape)} ({ex.dtype}) is "
                            f"not [numLayers={L}][samples][topK={k}] of integers")
    if ex.shape[1] > tokens:
        raise _err("tokenSamples.experts", f"{ex.shape[1]} samples", f"exceed tokens {tokens}")
    if (ex < 0).any() or (ex >= E).any():
        idx = tuple(int(i) for i in np.argwhere((ex < 0) | (ex >= E))[0])
        raise _err("tokenSamples.experts" + "".join(f"[{i}]" for i in idx), int(ex[idx]),
                   f"is not an expert id in [0, {E})")
    srt = np.sort(ex, axis=-1)
    if k > 1 and (srt[..., 1:] == srt[..., :-1]).any():
        idx = tuple(int(i) for i in np.argwhere((srt[..., 1:] == srt[..., :-1]).any(-1))[0])
        raise _err("tokenSamples.experts" + "".join(f"[{i}]" for i in idx), ex[idx].tolist(),
                   "repeats an expert (a token's top-k are distinct)")
    return srt.astype(np.int64)


def read_routing_stats(src: str | Path | dict[str, Any]) -> RoutingStats:
    """Read from a path or an already decoded object; raises ``DocumentError``."""
    if isinstance(src, dict):
        return parse_routing_stats(src)
    return parse_routing_stats(read_json_document(DOCUMENT, src))


def write_routing_stats(stats: RoutingStats, path: str | Path) -> None:
    Path(path).write_text(json.dumps(stats.to_json(), separators=(",", ":")) + "\n")


def synthetic_trace(num_layers: int, num_experts: int, top_k: int, tokens: int, *,
                    zipf_s: float = 0.4, num_clusters: int | None = None,
                    cluster_affinity: float = 0.4, seed: int = 0,
                    keep_tokens: bool = True) -> RoutingStats:
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
        logp = -zipf_s * np.log(1.0 + rng.permutation(E))          # random popularity order
        cluster_of = rng.permutation(E) % C                         # cluster_of[E]
        planted[layer] = cluster_of
        p = np.exp(logp)
        cluster_weight = np.bincount(cluster_of, weights=p, minlength=C)
        chosen = rng.choice(C, size=tokens, p=cluster_weight / cluster_weight.sum())
        in_cluster = rng.random(tokens) < cluster_affinity
        keys = logp[None, :] + rng.gumbel(size=(tokens, E))         # keys[T, E]
        inside = cluster_of[None, :] == chosen[:, None]
        # clustered tokens rank their cluster's experts above all others, then by key
        keys = keys + np.where(in_cluster[:, None] & inside, 1e3, 0.0)
        top = np.argpartition(-keys, k - 1, axis=1)[:, :k]
        token_experts[layer] = np.sort(top, axis=1)
    load, coact = count_routing(token_experts, E)
    return RoutingStats(num_layers, E, k, tokens, load, coact, 1, "synthetic",
                        f"synthetic(zipf_s={zipf_s}, clusters={C}, affinity={cluster_affinity})",
                        token_experts if keep_tokens else None, planted)
