"""Rank 0 publishes the RoutingStats v1 document into the ConfigMap `$MOE_ROUTING_STATS_CONFIGMAP`
(seeded empty by the operator; the worker Role may get/update/patch it), so that a later job with
`spec.placement.routingStatsFrom.jobName` can plan from it.

A ConfigMap holds at most 1 MiB (`data` + `binaryData`), and co-activation is `L x E x E` counts:
  - JSON (compact) up to LIMIT_BYTES        -> `data["routing_stats.json"]`;
  - else gzip + base64 up to LIMIT_BYTES    -> `binaryData["routing_stats.json.gz"]`;
  - else, when the document carries `tokenSamples`, the same with the sample cut in half (a
    prefix of a uniform sample is uniform) until it fits, down to none;
  - else nothing is patched: the log and the progress document say so, and the statistics stay in
    `<checkpoint dir>/routing_stats.json` (the file always keeps the whole sample).
Each patch removes the other key (merge-patch null), so a reader never sees two generations.
LIMIT_BYTES counts the base64 text for `binaryData` (what travels in the request and in etcd),
which is stricter than the API server's own check (decoded bytes), leaving room for metadata.
"""

from __future__ import annotations

import base64
import gzip
import json
import logging
from dataclasses import dataclass

from moe_trainer.progress import ConfigMapPublisher

log = logging.getLogger("moe_trainer.routing_publish")

KEY = "routing_stats.json"
GZ_KEY = "routing_stats.json.gz"
LIMIT_BYTES = 1_000_000
ENV = "MOE_ROUTING_STATS_CONFIGMAP"


@dataclass(frozen=True)
class Encoded:
    """What would go into the ConfigMap: ``body`` is the merge-patch, None when too large."""
    body: dict | None
    key: str | None           # KEY | GZ_KEY | None
    json_bytes: int           # compact JSON size
    stored_bytes: int         # size of the value stored (JSON text, or base64 of the gzip)
    samples: int = 0          # tokenSamples kept per layer


def encode(doc: dict, limit: int = LIMIT_BYTES) -> Encoded:
    """The smallest cut of ``tokenSamples`` (halving) that fits; the full document when it fits."""
    samples = (doc.get("tokenSamples") or {}).get("experts")
    n = len(samples[0]) if samples else 0
    while True:
        enc = _encode(doc, limit)
        if enc.body is not None or not n:
            return Encoded(enc.body, enc.key, enc.json_bytes, enc.stored_bytes, n)
        n //= 2
        doc = dict(doc)
        if n:
            doc["tokenSamples"] = {"experts": [layer[:n] for layer in samples]}
        else:
            doc.pop("tokenSamples")


def _encode(doc: dict, limit: int) -> Encoded:
    raw = json.dumps(doc, separators=(",", ":")).encode()
    if len(raw) <= limit:
        return Encoded({"data": {KEY: raw.decode()}, "binaryData": {GZ_KEY: None}}, KEY, len(raw), len(raw))
    b64 = base64.b64encode(gzip.compress(raw, compresslevel=9, mtime=0)).decode()
    if len(b64) <= limit:
        return Encoded({"data": {KEY: None}, "binaryData": {GZ_KEY: b64}}, GZ_KEY, len(raw), len(b64))
    return Encoded(None, None, len(raw), len(b64))


def decode(configmap: dict) -> dict | None:
    """The RoutingStats document of a ConfigMap (either key), None when it holds none yet.
    The operator has its own reader (moejob_operator.reconcile.planning); this one is for tests/tools."""
    data = configmap.get("data") or {}
    if data.get(KEY):
        return json.loads(data[KEY])
    gz = (configmap.get("binaryData") or {}).get(GZ_KEY)
    if gz:
        return json.loads(gzip.decompress(base64.b64decode(gz)))
    return None


class RoutingStatsPublisher:
    """Patches the ConfigMap; ``status`` is the `routingStats` section of the progress document."""

    def __init__(self, publisher: ConfigMapPublisher, limit: int = LIMIT_BYTES):
        self.publisher, self.limit = publisher, limit
        self.status: dict | None = None
        self._warned_too_large = False

    @classmethod
    def from_env(cls) -> RoutingStatsPublisher | None:
        pub = ConfigMapPublisher.from_env(ENV, timeout_s=30.0)
        return None if pub is None else cls(pub)

    def publish(self, doc: dict, step: int, file_path: str | None) -> dict:
        enc = encode(doc, self.limit)
        status = {"configMap": self.publisher.name, "key": enc.key, "step": int(step),
                  "jsonBytes": enc.json_bytes, "storedBytes": enc.stored_bytes, "published": False,
                  "file": file_path, "message": ""}
        if enc.body is None:
            status["message"] = (
                f"routing statistics too large for ConfigMap {self.publisher.name}: {enc.json_bytes} bytes "
                f"of JSON, {enc.stored_bytes} gzip+base64 > limit {self.limit} "
                f"({doc['numLayers']} layers x {doc['numExperts']}^2 co-activation); "
                f"not published, kept in {file_path or 'no checkpoint dir'}")
            if not self._warned_too_large:
                log.warning("%s", status["message"])
                self._warned_too_large = True
        elif self.publisher.send(enc.body):
            status["published"] = True
            status["message"] = f"published as {enc.key} ({enc.stored_bytes} bytes) at step {step}"
            full = len((doc.get("tokenSamples") or {}).get("experts", [[]])[0])
            if enc.samples < full:
                status["message"] += (f", token samples cut from {full} to {enc.samples} to fit "
                                      f"(all of them in {file_path or 'no checkpoint dir'})")
            log.info("routing statistics of step %d -> ConfigMap %s key %s (%d bytes)", step,
                     self.publisher.name, enc.key, enc.stored_bytes)
        else:
            status["message"] = f"ConfigMap {self.publisher.name} patch failed: {self.publisher.last_error}"
        self.status = status
        return status
