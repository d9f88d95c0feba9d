"""``RoutingStats`` v1/v2 (docs/contracts.md) and its ConfigMap codec.

The trainer records the statistics and writes the document (:func:`routing_stats_doc`); the
planning core reads it (:func:`parse_routing_stats`, every invariant checked). In the
``<job>-routing-stats`` ConfigMap the document is compact JSON under ``data[routing_stats.json]``
or, above ``LIMIT_BYTES``, gzip + base64 under ``binaryData[routing_stats.json.gz]``
(:func:`encode_configmap` writes, :func:`decode_configmap` reads; each write nulls the other key).

``load[num_layers, num_experts]`` counts token->expert assignments, ``coact[num_layers,
num_experts, num_experts]`` counts tokens whose top-k held both i and j (symmetric, zero
diagonal); ``token_experts[num_layers, num_samples, top_k]`` (v2 ``tokenSamples``) keeps a
uniform sample of the window's tokens' expert sets (the same tokens, in the same order, in every
layer) and optionally ``token_steps[num_samples]`` the 1-based training step each sampled token
was routed at (``tokenSamples.steps``: lets the planner split the sample in time). Expert ids are
original ids.

Optional ``window`` (the trainer writes it; readers that do not know it ignore it): the counts of
the recent window only, the steps since the previous publish (the previous checkpoint), for
drift detection and re-planning during a job (``moe_contracts.placement_update``):
``{"fromStep", "toStep", "tokens", "steps", "load"[L][E], "coactivation"[L][E][E]}``, the same
invariants as the whole-run counts, and optionally its own ``tokenSamples`` (the top-level shape
and meaning: a uniform sample of the window's tokens, each ``steps`` in ``(fromStep, toStep]``),
which the trainer keeps apart from the whole run's so that a late, short window is not left with
its small share of the whole-run sample. :func:`window_stats` reads the window as a RoutingStats:
its own samples, else (older trainers) the whole-run ``tokenSamples`` whose ``steps`` are above
``fromStep``.

The ConfigMap copy (:func:`encode_configmap`) is cut until it fits: first the token samples, the
larger of the two halved each time (the whole run's on a tie), so both keep an equal share of the
room (the operator's re-placement decides on the window's, which it needs in quantity to decide
at all; a later job plans from the whole run's, which the checkpoint-dir file keeps in full);
then, with no samples left, the window is dropped and the whole-run counts kept.
"""

from __future__ import annotations

import base64
import binascii
import gzip
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field

from ._base import Doc, Int, Str, validate
from .env import ROUTING_STATS_GZ_KEY, ROUTING_STATS_KEY
from .errors import DocumentError, check_kind_version, read_json_document

DOCUMENT = "RoutingStats"
VERSIONS = (1, 2)  # v2 = v1 + optional tokenSamples
LIMIT_BYTES = (
    1_000_000  # what the trainer stores in the ConfigMap (JSON text, or base64 of the gzip)
)
MAX_JSON_BYTES = 256 * 2**20  # a reader refuses to inflate more than this (gzip bomb)


@dataclass(frozen=True, eq=False)
class RoutingStats:
    num_layers: int
    num_experts: int
    top_k: int
    tokens: int  # tokens routed per layer over the recording window
    load: np.ndarray  # load[num_layers, num_experts], int64
    coact: np.ndarray  # coact[num_layers, num_experts, num_experts], int64
    steps: int = 1
    source: str = "synthetic"
    model: str = ""
    token_experts: np.ndarray | None = field(default=None, repr=False)  # [L, T, top_k] or None
    planted_clusters: np.ndarray | None = field(default=None, repr=False)  # [L, E], synthetic only
    token_steps: np.ndarray | None = field(default=None, repr=False)  # [T] 1-based steps, or None

    def to_json(self) -> dict[str, Any]:
        doc = {
            "kind": DOCUMENT,
            "version": 2,
            "source": self.source,
            "model": self.model,
            "numLayers": self.num_layers,
            "numExperts": self.num_experts,
            "topK": self.top_k,
            "tokens": self.tokens,
            "steps": self.steps,
            "load": self.load.tolist(),
            "coactivation": self.coact.tolist(),
        }
        if self.token_experts is not None:
            doc["tokenSamples"] = {"experts": self.token_experts.tolist()}
            if self.token_steps is not None:
                doc["tokenSamples"]["steps"] = self.token_steps.tolist()
        return doc

    @property
    def exact(self) -> bool:
        """Whether placements can be scored exactly: token samples, or top-k <= 2 (pairs do)."""
        return self.token_experts is not None or self.top_k <= 2

    def without_tokens(self) -> RoutingStats:
        """The same statistics as a recorded document would carry (matrices only)."""
        return RoutingStats(
            self.num_layers,
            self.num_experts,
            self.top_k,
            self.tokens,
            self.load,
            self.coact,
            self.steps,
            self.source,
            self.model,
            None,
            self.planted_clusters,
        )


class _Header(Doc):
    """The scalar fields; the arrays are checked with numpy below (they can be large)."""

    num_layers: Int = Field(ge=1)
    num_experts: Int = Field(ge=1)
    top_k: Int = Field(alias="topK", ge=1)
    tokens: Int = Field(ge=0)
    steps: Int = Field(default=1, ge=0)
    source: Str = "trainer"
    model: Str = ""


def _err(path: str, value: Any, what: str) -> DocumentError:
    text = repr(value)
    text = text if len(text) <= 80 else text[:77] + "..."
    return DocumentError(f"{DOCUMENT} {path}: {text} {what}")


def _array(obj: dict[str, Any], name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name not in obj:
        raise DocumentError(f"{DOCUMENT} {name}: required field is missing")
    try:
        arr = np.array(obj[name])
    except ValueError:
        raise _err(name, "...", "is a ragged array") from None
    if arr.shape != shape:
        raise DocumentError(
            f"{DOCUMENT} {name}: shape {list(arr.shape)} does not match "
            f"numLayers/numExperts {list(shape)}"
        )
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
    h = validate(
        DOCUMENT,
        _Header,
        {
            key: obj[key]
            for key in ("numLayers", "numExperts", "topK", "tokens", "steps", "source", "model")
            if key in obj
        },
    )
    L, E, k, tokens, steps = h.num_layers, h.num_experts, h.top_k, h.tokens, h.steps
    if k > E:
        raise _err("topK", k, f"exceeds numExperts {E}")
    load = _array(obj, "load", (L, E))
    coact = _array(obj, "coactivation", (L, E, E))
    sums = load.sum(axis=1)
    for layer in range(L):
        if sums[layer] != tokens * k:
            raise DocumentError(
                f"{DOCUMENT} load[{layer}]: sums to {int(sums[layer])}, "
                f"expected tokens*topK = {tokens * k}"
            )
        c = coact[layer]
        if (c != c.T).any():
            i, j = (int(x) for x in np.argwhere(c != c.T)[0])
            raise DocumentError(
                f"{DOCUMENT} coactivation[{layer}][{i}][{j}]: {int(c[i, j])} != "
                f"coactivation[{layer}][{j}][{i}] {int(c[j, i])} (not symmetric)"
            )
        if np.diagonal(c).any():
            i = int(np.flatnonzero(np.diagonal(c))[0])
            raise _err(
                f"coactivation[{layer}][{i}][{i}]", int(c[i, i]), "is not 0 (diagonal must be zero)"
            )
        rows, want = c.sum(axis=1), (k - 1) * load[layer]
        if (rows != want).any():
            i = int(np.flatnonzero(rows != want)[0])
            raise DocumentError(
                f"{DOCUMENT} coactivation[{layer}][{i}]: row sums to {int(rows[i])}, "
                f"expected (topK-1)*load[{layer}][{i}] = {int(want[i])}"
            )
    samples, sample_steps = (
        _token_samples(obj, L, E, k, tokens) if obj["version"] >= 2 else (None, None)
    )
    return RoutingStats(
        L, E, k, tokens, load, coact, steps, h.source, h.model, samples, token_steps=sample_steps
    )


def _token_samples(
    obj: dict[str, Any], L: int, E: int, k: int, tokens: int
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """``tokenSamples.experts[L][S][k]`` -> ``token_experts[L, S, k]`` and the optional
    ``tokenSamples.steps[S]`` -> ``token_steps[S]`` (None when absent)."""
    ts = obj.get("tokenSamples")
    if ts is None:
        return None, None
    if not isinstance(ts, dict) or "experts" not in ts:
        raise DocumentError(f"{DOCUMENT} tokenSamples: expected an object with 'experts'")
    try:
        ex = np.array(ts["experts"])
    except ValueError:
        raise _err("tokenSamples.experts", "...", "is a ragged array") from None
    if ex.size == 0:
        return None, None
    if ex.ndim != 3 or ex.shape[0] != L or ex.shape[2] != k or ex.dtype.kind not in "iu":
        raise DocumentError(
            f"{DOCUMENT} tokenSamples.experts: shape {list(ex.shape)} ({ex.dtype}) is "
            f"not [numLayers={L}][samples][topK={k}] of integers"
        )
    if ex.shape[1] > tokens:
        raise _err("tokenSamples.experts", f"{ex.shape[1]} samples", f"exceed tokens {tokens}")
    if (ex < 0).any() or (ex >= E).any():
        idx = tuple(int(i) for i in np.argwhere((ex < 0) | (ex >= E))[0])
        raise _err(
            "tokenSamples.experts" + "".join(f"[{i}]" for i in idx),
            int(ex[idx]),
            f"is not an expert id in [0, {E})",
        )
    srt = np.sort(ex, axis=-1)
    if k > 1 and (srt[..., 1:] == srt[..., :-1]).any():
        idx = tuple(int(i) for i in np.argwhere((srt[..., 1:] == srt[..., :-1]).any(-1))[0])
        raise _err(
            "tokenSamples.experts" + "".join(f"[{i}]" for i in idx),
            ex[idx].tolist(),
            "repeats an expert (a token's top-k are distinct)",
        )
    return srt.astype(np.int64), _sample_steps(ts, ex.shape[1])


def _sample_steps(ts: dict[str, Any], S: int) -> np.ndarray | None:
    """``tokenSamples.steps[S]``: one 1-based training step per sampled token, or None."""
    if ts.get("steps") is None:
        return None
    try:
        st = np.array(ts["steps"])
    except ValueError:
        raise _err("tokenSamples.steps", "...", "is a ragged array") from None
    if st.ndim != 1 or len(st) != S or (S and st.dtype.kind not in "iu"):
        raise DocumentError(
            f"{DOCUMENT} tokenSamples.steps: shape {list(st.shape)} ({st.dtype}) is not "
            f"[samples={S}] of integers (one step per sampled token)"
        )
    if (st < 1).any():
        i = int(np.flatnonzero(st < 1)[0])
        raise _err(f"tokenSamples.steps[{i}]", int(st[i]), "is not a 1-based step")
    return st.astype(np.int64)


def read_routing_stats(src: str | Path | dict[str, Any]) -> RoutingStats:
    """Read from a path or an already decoded object; raises ``DocumentError``."""
    if isinstance(src, dict):
        return parse_routing_stats(src)
    return parse_routing_stats(read_json_document(DOCUMENT, src))


def write_routing_stats(stats: RoutingStats, path: str | Path) -> None:
    Path(path).write_text(json.dumps(stats.to_json(), separators=(",", ":")) + "\n")


def routing_stats_doc(
    load: Any,
    coact: Any,
    tokens: int,
    steps: int,
    top_k: int,
    model: str,
    source: str = "trainer",
    samples: list[Any] | None = None,
    sample_steps: list[int] | None = None,
    window: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The RoutingStats v2 document the trainer writes: ``load[L, E]``, ``coact[L, E, E]`` in
    original expert ids; ``samples[L][S][k]`` (original ids) a uniform sample of the window's
    tokens' expert sets (left out when None or empty) and ``sample_steps[S]`` the 1-based step
    each of those tokens was routed at."""
    load = np.rint(np.asarray(load)).astype(np.int64)
    coact = np.rint(np.asarray(coact)).astype(np.int64)
    num_layers, num_experts = load.shape
    has_samples = samples is not None and len(samples[0]) > 0
    stats = RoutingStats(
        int(num_layers),
        int(num_experts),
        int(top_k),
        int(tokens),
        load,
        coact,
        int(steps),
        source,
        model,
    )
    doc = stats.to_json()
    if has_samples:
        doc["tokenSamples"] = {"experts": samples}
        if sample_steps is not None:
            doc["tokenSamples"]["steps"] = [int(x) for x in sample_steps]
    if window is not None:
        doc["window"] = window
    return doc


def window_stats(obj: dict[str, Any]) -> RoutingStats | None:
    """The document's ``window`` as a checked RoutingStats (its token samples: those routed after
    ``fromStep``), None when the document has none; raises DocumentError."""
    w = obj.get("window")
    if w is None:
        return None
    if not isinstance(w, dict):
        raise DocumentError(f"{DOCUMENT} window: expected an object")
    head = ("kind", "numLayers", "numExperts", "topK", "source", "model")
    sub: dict[str, Any] = {k: obj[k] for k in head if k in obj}
    sub.update(version=2, tokens=w.get("tokens"), steps=w.get("steps"))
    sub.update(load=w.get("load"), coactivation=w.get("coactivation"))
    ts = obj.get("tokenSamples") or {}
    if w.get("tokenSamples") is not None:  # the window's own sample
        sub["tokenSamples"] = w["tokenSamples"]
    elif ts.get("steps") is not None and ts.get("experts"):
        after = int(w.get("fromStep", 0))
        keep = [i for i, st in enumerate(ts["steps"]) if st > after]
        sub["tokenSamples"] = {
            "experts": [[layer[i] for i in keep] for layer in ts["experts"]],
            "steps": [ts["steps"][i] for i in keep],
        }
    try:
        stats = parse_routing_stats(sub)
    except DocumentError as exc:
        raise DocumentError(str(exc).replace(f"{DOCUMENT} ", f"{DOCUMENT} window.", 1)) from None
    if w.get("tokenSamples") is not None and stats.token_steps is not None:
        _check_window_steps(stats.token_steps, w)
    return stats


def _check_window_steps(st: np.ndarray, w: dict[str, Any]) -> None:
    """The window's own samples were routed in its steps: ``fromStep < steps[i] <= toStep``."""
    bounds = (w.get("fromStep", 0), w.get("toStep"))
    if not all(isinstance(b, int) and not isinstance(b, bool) for b in bounds):
        raise _err("window.fromStep/toStep", list(bounds), "are not integers")
    out = (st <= bounds[0]) | (st > bounds[1])
    if out.any():
        i = int(np.flatnonzero(out)[0])
        raise _err(f"window.tokenSamples.steps[{i}]", int(st[i]), "is outside (fromStep, toStep]")


# ---- the <job>-routing-stats ConfigMap ---------------------------------------------------------
@dataclass(frozen=True)
class Encoded:
    """What would go into the ConfigMap: ``body`` is the merge-patch, None when too large."""

    body: dict[str, Any] | None
    key: str | None  # ROUTING_STATS_KEY | ROUTING_STATS_GZ_KEY | None
    json_bytes: int  # compact JSON size
    stored_bytes: int  # size of the value stored (JSON text, or base64 of the gzip)
    samples: int = 0  # tokenSamples kept per layer
    window_samples: int = 0  # window.tokenSamples kept per layer (0 too when the window is cut)


def encode_configmap(doc: dict[str, Any], limit: int = LIMIT_BYTES) -> Encoded:
    """The merge-patch for the ConfigMap: the whole document when it fits, else the smallest cut
    (the module docstring's order) that fits: the larger of ``tokenSamples`` and
    ``window.tokenSamples`` halved each time (the trainer's samples are in key order, so a prefix
    is uniform; ``steps`` is cut with the experts and stays aligned), then the window dropped."""
    window = doc.get("window") if isinstance(doc.get("window"), dict) else None
    whole_ts, window_ts = doc.get("tokenSamples"), (window or {}).get("tokenSamples")
    n, m = _num_samples(whole_ts), _num_samples(window_ts)
    while True:
        cut = dict(doc)
        _put_samples(cut, _cut_samples(whole_ts, n))
        if "window" in cut and window is not None:
            cut["window"] = dict(window)
            _put_samples(cut["window"], _cut_samples(window_ts, m))
        enc = _encode(cut, limit)
        if enc.body is not None:
            return Encoded(enc.body, enc.key, enc.json_bytes, enc.stored_bytes, n, m)
        if n or m:
            n, m = (n // 2, m) if n >= m else (n, m // 2)
        elif "window" in doc:
            doc = {k: v for k, v in doc.items() if k != "window"}  # whole-run counts first
            window, m = None, 0
        else:
            return Encoded(None, None, enc.json_bytes, enc.stored_bytes, 0, 0)


def _num_samples(ts: Any) -> int:
    experts = ts.get("experts") if isinstance(ts, dict) else None
    return len(experts[0]) if experts else 0


def _cut_samples(ts: Any, n: int) -> dict[str, Any] | None:
    """The first ``n`` sampled tokens of a ``tokenSamples`` (None for none)."""
    if not n:
        return None
    out = {"experts": [layer[:n] for layer in ts["experts"]]}
    if ts.get("steps") is not None:
        out["steps"] = ts["steps"][:n]
    return out


def _put_samples(obj: dict[str, Any], ts: dict[str, Any] | None) -> None:
    if ts is None:
        obj.pop("tokenSamples", None)
    else:
        obj["tokenSamples"] = ts


def _encode(doc: dict[str, Any], limit: int) -> Encoded:
    raw = json.dumps(doc, separators=(",", ":")).encode()
    if len(raw) <= limit:
        return Encoded(
            {"data": {ROUTING_STATS_KEY: raw.decode()}, "binaryData": {ROUTING_STATS_GZ_KEY: None}},
            ROUTING_STATS_KEY,
            len(raw),
            len(raw),
        )
    b64 = base64.b64encode(gzip.compress(raw, compresslevel=9, mtime=0)).decode()
    if len(b64) <= limit:
        return Encoded(
            {"data": {ROUTING_STATS_KEY: None}, "binaryData": {ROUTING_STATS_GZ_KEY: b64}},
            ROUTING_STATS_GZ_KEY,
            len(raw),
            len(b64),
        )
    return Encoded(None, None, len(raw), len(b64))


def configmap_text(cm: dict[str, Any] | None) -> str | None:
    """The RoutingStats JSON text of a ConfigMap (either key; gzip + base64 as the API returns it),
    None when it holds none yet. Undecodable or oversized ``binaryData`` raises DocumentError."""
    cm = cm or {}
    raw = (cm.get("data") or {}).get(ROUTING_STATS_KEY)
    if raw:
        return str(raw)
    packed = (cm.get("binaryData") or {}).get(ROUTING_STATS_GZ_KEY)
    if not packed:
        return None
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(base64.b64decode(packed, validate=True))) as f:
            text = f.read(MAX_JSON_BYTES + 1)
    except (binascii.Error, OSError, EOFError) as exc:
        raise DocumentError(
            f"binaryData.{ROUTING_STATS_GZ_KEY} is not gzip+base64: {exc}"
        ) from None
    if len(text) > MAX_JSON_BYTES:
        raise DocumentError(
            f"binaryData.{ROUTING_STATS_GZ_KEY} inflates to more than {MAX_JSON_BYTES} bytes"
        )
    return text.decode("utf-8", errors="replace")


def decode_configmap(cm: dict[str, Any] | None) -> RoutingStats | None:
    """The checked RoutingStats of a ConfigMap, None while it holds none; raises DocumentError."""
    text = configmap_text(cm)
    if not text:
        return None
    try:
        obj = json.loads(text)
    except RecursionError:  # written by code in the user's image: any depth
        raise DocumentError(f"{DOCUMENT}: nested too deeply") from None
    except ValueError as exc:
        raise DocumentError(f"{DOCUMENT}: not JSON ({str(exc)[:80]})") from None
    return parse_routing_stats(obj)
