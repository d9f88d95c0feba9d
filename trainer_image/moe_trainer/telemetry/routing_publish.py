"""Rank 0 publishes the RoutingStats v2 document into the ConfigMap `$MOE_ROUTING_STATS_CONFIGMAP`
(seeded empty by the operator; the worker Role may get/update/patch it), so that a later job with
`spec.placement.routingStatsFrom.jobName` can plan from it.

A ConfigMap holds at most 1 MiB (`data` + `binaryData`), and co-activation is `L x E x E` counts:
  - JSON (compact) up to LIMIT_BYTES        -> `data["routing_stats.json"]`;
  - else gzip + base64 up to LIMIT_BYTES    -> `binaryData["routing_stats.json.gz"]`;
  - else, when the document carries `tokenSamples` (whole run) or `window.tokenSamples` (the
    window's own), the same with the larger of the two samples cut in half (a prefix of a uniform
    sample is uniform; `steps` is cut with it) until it fits, down to none, then without the
    window (the contract's order, ``moe_contracts.routing``);
  - else nothing is patched: the log and the progress document say so, and the statistics stay in
    `<checkpoint dir>/routing_stats.json` (the file always keeps the whole sample).
Each patch removes the other key (merge-patch null), so a reader never sees two generations.
The codec is the contract's (``moe_contracts.routing.encode_configmap`` / ``decode_configmap``).
LIMIT_BYTES counts the base64 text for `binaryData` (what travels in the request and in etcd),
which is stricter than the API server's own check (decoded bytes), leaving room for metadata.
"""

from __future__ import annotations

import logging
from typing import Any, TypedDict

from moe_contracts import env as E
from moe_contracts.routing import LIMIT_BYTES, encode_configmap
from moe_trainer.telemetry.progress import ConfigMapPublisher

log = logging.getLogger("moe_trainer.telemetry.routing_publish")

ENV = E.ROUTING_STATS_CONFIGMAP


class RoutingStatsStatus(TypedDict):
    """The `routingStats` section of the progress document: the last publish attempt. Its keys
    are the document's (camelCase)."""

    configMap: str
    key: str | None  # which ConfigMap key it went to (None: too large for either)
    step: int
    jsonBytes: int
    storedBytes: int
    published: bool
    file: str | None  # the checkpoint dir's copy, None without a checkpoint dir
    message: str


class RoutingStatsPublisher:
    """Patches the ConfigMap; ``status`` is the `routingStats` section of the progress document."""

    def __init__(self, publisher: ConfigMapPublisher, limit: int = LIMIT_BYTES):
        self.publisher, self.limit = publisher, limit
        self.status: RoutingStatsStatus | None = None
        self._warned_too_large = False

    @classmethod
    def from_env(cls) -> RoutingStatsPublisher | None:
        pub = ConfigMapPublisher.from_env(ENV, timeout_s=30.0)
        return None if pub is None else cls(pub)

    def publish(self, doc: dict[str, Any], step: int, file_path: str | None) -> RoutingStatsStatus:
        enc = encode_configmap(doc, self.limit)
        status: RoutingStatsStatus = {
            "configMap": self.publisher.name,
            "key": enc.key,
            "step": int(step),
            "jsonBytes": enc.json_bytes,
            "storedBytes": enc.stored_bytes,
            "published": False,
            "file": file_path,
            "message": "",
        }
        if enc.body is None:
            status["message"] = (
                f"routing statistics too large for ConfigMap {self.publisher.name}: "
                f"{enc.json_bytes} bytes "
                f"of JSON, {enc.stored_bytes} gzip+base64 > limit {self.limit} "
                f"({doc['numLayers']} layers x {doc['numExperts']}^2 co-activation); "
                f"not published, kept in {file_path or 'no checkpoint dir'}"
            )
            if not self._warned_too_large:
                log.warning("%s", status["message"])
                self._warned_too_large = True
        elif self.publisher.send(enc.body):
            status["published"] = True
            status["message"] = f"published as {enc.key} ({enc.stored_bytes} bytes) at step {step}"
            full = len((doc.get("tokenSamples") or {}).get("experts", [[]])[0])
            window = (doc.get("window") or {}).get("tokenSamples") or {}
            window_full = len(window.get("experts", [[]])[0])
            if enc.samples < full or enc.window_samples < window_full:
                status["message"] += (
                    f", token samples cut from {full} to {enc.samples} (the window's from "
                    f"{window_full} to {enc.window_samples}) to fit "
                    f"(all of them in {file_path or 'no checkpoint dir'})"
                )
            log.info(
                "routing statistics of step %d -> ConfigMap %s key %s (%d bytes)",
                step,
                self.publisher.name,
                enc.key,
                enc.stored_bytes,
            )
        else:
            status["message"] = (
                f"ConfigMap {self.publisher.name} patch failed: {self.publisher.last_error}"
            )
        self.status = status
        return status
