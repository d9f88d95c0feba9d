"""Progress reporting by rank 0: TrainerProgress v1 file, ConfigMap patch, Prometheus metrics.

Channels (docs/trainer.md):
The document is the contract's (``moe_contracts.progress.progress_doc``).
  file       $MOE_CHECKPOINT_DIR/progress.json, rewritten atomically every step;
  ConfigMap  when MOE_PROGRESS_CONFIGMAP names one and the pod has in-cluster credentials, a
             merge-patch of key `progress.json` (:mod:`moe_trainer.kubeapi`), at most every
             MOE_PROGRESS_INTERVAL_SECONDS (default 5) plus the final document and the
             document of a checkpoint that published routing statistics; failures are
             logged and never stop training;
  metrics    Prometheus on $MOE_METRICS_PORT (rank 0 only), prefix `moe_trainer_`.
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moe_contracts import env as E
from moe_trainer.kubeapi import SA_DIR, api_request, service_url

log = logging.getLogger("moe_trainer.telemetry.progress")


def write_json_atomic(path: str | os.PathLike[str], doc: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)


def _http_detail(exc: BaseException) -> str:
    """The API server's Status message of an HTTP error (why a patch was refused), else ''."""
    if not isinstance(exc, urllib.error.HTTPError):
        return ""
    try:
        body = exc.read().decode(errors="replace")
        return str(json.loads(body).get("message", body))[:300]
    except (OSError, ValueError, AttributeError):
        return ""


class ConfigMapPublisher:
    """PATCHes progress into a ConfigMap with the pod's service-account token.

    ``send`` merge-patches any body (``{"data": {...}, "binaryData": {...}}``) into the ConfigMap;
    ``publish`` sends a progress document, at most every ``interval_s`` unless forced. The routing
    statistics use ``send`` with their own ConfigMap (``moe_trainer.telemetry.routing_publish``)."""

    def __init__(
        self, name: str, sa_dir: Path = SA_DIR, interval_s: float = 5.0, timeout_s: float = 5.0
    ):
        self.name, self.sa_dir, self.interval_s, self.timeout_s = (
            name,
            Path(sa_dir),
            interval_s,
            timeout_s,
        )
        self._last = 0.0
        self.failures = 0
        self.last_error: str | None = None
        self.last_retryable = True

    @staticmethod
    def in_cluster() -> bool:
        return (SA_DIR / "token").is_file() and bool(os.environ.get("KUBERNETES_SERVICE_HOST"))

    @classmethod
    def from_env(
        cls, var: str = E.PROGRESS_CONFIGMAP, timeout_s: float = 5.0
    ) -> ConfigMapPublisher | None:
        name = os.environ.get(var)
        if not name:
            return None
        if not cls.in_cluster():
            log.warning("%s=%s but no in-cluster credentials; file only", var, name)
            return None
        return cls(
            name,
            interval_s=float(os.environ.get("MOE_PROGRESS_INTERVAL_SECONDS", "5")),
            timeout_s=timeout_s,
        )

    def patch_request(self, body: dict[str, Any]) -> urllib.request.Request:
        ns = (self.sa_dir / "namespace").read_text().strip()
        token = (self.sa_dir / "token").read_text().strip()
        base = service_url()
        if base is None:
            raise KeyError("KUBERNETES_SERVICE_HOST")
        url = f"{base}/api/v1/namespaces/{ns}/configmaps/{self.name}"
        return api_request(
            "PATCH", url, json.dumps(body).encode(), token, "application/merge-patch+json"
        )

    def request(self, doc: dict[str, Any]) -> urllib.request.Request:
        return self.patch_request({"data": {E.PROGRESS_KEY: json.dumps(doc)}})

    def send(self, body: dict[str, Any]) -> bool:
        """One merge-patch; failures are logged and counted, never raised."""
        try:
            ctx = ssl.create_default_context(cafile=str(self.sa_dir / "ca.crt"))
            with urllib.request.urlopen(
                self.patch_request(body), context=ctx, timeout=self.timeout_s
            ) as resp:
                resp.read()
            self.last_error = None
            return True
        except (urllib.error.URLError, OSError, ssl.SSLError, ValueError) as exc:
            self.failures += 1
            # A refusal (403 RBAC, 404 no such ConfigMap, 422) stays a refusal: only outages,
            # timeouts and 5xx / 408 / 429 answers are worth retrying.
            code = getattr(exc, "code", None) if isinstance(exc, urllib.error.HTTPError) else None
            self.last_retryable = code is None or code >= 500 or code in (408, 429)
            detail = _http_detail(exc)
            self.last_error = f"{exc} {detail}".strip()
            log.warning(
                "ConfigMap %s patch failed (%d so far): %s",
                self.name,
                self.failures,
                self.last_error,
            )
            return False

    # A forced document is a last word (finished, failed): it is retried through a short API
    # outage instead of being dropped, at most sum(FINAL_RETRY_SECONDS) before the process exits;
    # an answer that will not change (a 4xx refusal) is not retried.
    FINAL_RETRY_SECONDS = (1.0, 2.0, 4.0, 8.0, 15.0)

    def publish(
        self,
        doc: dict[str, Any],
        force: bool = False,
        sleep: Callable[[float], None] = time.sleep,
        *,
        prompt: bool = False,
    ) -> bool:
        """``force``: the last word, sent whatever the interval and retried through a short
        outage; ``prompt`` (and a document naming routing statistics published at its own step,
        a checkpoint's: the operator's re-placement check reads them once it says so): sent
        whatever the interval, not retried."""
        stats = doc.get("routingStats") or {}
        prompt = prompt or (stats.get("published") is True and stats.get("step") == doc.get("step"))
        now = time.monotonic()
        if not (force or prompt) and now - self._last < self.interval_s:
            return False
        self._last = now
        body = {"data": {E.PROGRESS_KEY: json.dumps(doc)}}
        ok = self.send(body)
        for delay in self.FINAL_RETRY_SECONDS if force else ():
            if ok or not self.last_retryable:
                break
            sleep(delay)
            ok = self.send(body)
        return ok


class Metrics:
    """Prometheus gauges/counters for rank 0."""

    def __init__(self, port: int, job: str):
        from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

        self.registry = CollectorRegistry()
        labels = ["job"]
        self.job = job
        self.step = Gauge(
            "moe_trainer_step", "Last finished optimizer step", labels, registry=self.registry
        )
        self.loss = Gauge(
            "moe_trainer_loss",
            "Language-model loss of the last step",
            labels,
            registry=self.registry,
        )
        self.tps = Gauge(
            "moe_trainer_tokens_per_second",
            "Tokens per second, all ranks",
            labels,
            registry=self.registry,
        )
        self.tokens = Counter(
            "moe_trainer_tokens", "Tokens trained on", labels, registry=self.registry
        )
        self.comm = Gauge(
            "moe_trainer_comm_seconds_per_step",
            "Seconds per step in a collective",
            [*labels, "op"],
            registry=self.registry,
        )
        self.maxmean = Gauge(
            "moe_trainer_expert_load_max_mean",
            "Max/mean expert load of a layer (window)",
            [*labels, "layer"],
            registry=self.registry,
        )
        self.dead = Gauge(
            "moe_trainer_dead_experts", "Experts flagged dead", labels, registry=self.registry
        )
        self.frag = Gauge(
            "moe_trainer_allocator_fragmentation",
            "1 - allocated/reserved (CUDA)",
            labels,
            registry=self.registry,
        )
        self.tier_bytes = Gauge(
            "moe_trainer_all_to_all_bytes_per_step",
            "Expert all-to-all bytes sent to other ranks in the last step, all ranks, by "
            "the receiver's tier (crossNode is part of crossGroup)",
            [*labels, "tier"],
            registry=self.registry,
        )
        self.tier_bytes_total = Counter(
            "moe_trainer_all_to_all_bytes",
            "Expert all-to-all bytes sent to other ranks since this attempt started, all ranks, "
            "by the receiver's tier",
            [*labels, "tier"],
            registry=self.registry,
        )
        self.placement = Gauge(
            "moe_trainer_placement_generation",
            "PlacementUpdate generation the trainer runs (0: the plan's own placement)",
            labels,
            registry=self.registry,
        )
        self.server, self.thread = start_http_server(port, registry=self.registry)

    def update(self, doc: dict[str, Any], tokens: int) -> None:
        j = self.job
        self.step.labels(j).set(doc["step"])
        if doc["loss"] is not None:
            self.loss.labels(j).set(doc["loss"])
        self.tps.labels(j).set(doc["tokensPerSecond"])
        self.tokens.labels(j).inc(tokens)
        moe = doc["moe"]
        self.comm.labels(j, "all_to_all").set(moe.get("allToAllSecondsPerStep") or 0.0)
        self.comm.labels(j, "all_gather").set(moe.get("allGatherSecondsPerStep") or 0.0)
        for layer, v in enumerate(moe.get("maxMeanLoadPerLayer") or []):
            self.maxmean.labels(j, str(layer)).set(v)
        self.dead.labels(j).set(len(moe.get("deadExperts") or []))
        if moe.get("fragmentation") is not None:
            self.frag.labels(j).set(moe["fragmentation"])
        if doc.get("placement"):
            self.placement.labels(j).set(doc["placement"]["generation"])
        for tier, v in (moe.get("allToAllBytesPerStepByTier") or {}).items():
            self.tier_bytes.labels(j, tier).set(v)
            self.tier_bytes_total.labels(j, tier).inc(v)

    def close(self) -> None:
        self.server.shutdown()
