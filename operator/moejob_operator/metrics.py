"""Prometheus metrics of the operator.

The reconcile code reports what it saw; this module keeps the numbers and renders them at scrape
time. Nothing here calls the Kubernetes API. Call sites (one line each):

- ``observe_job(namespace, name, status)`` after a pass flushed the job's status: jobs by
  condition and phase, and the placement quality of the job's current plan (``status.plan``);
- ``forget_job(namespace, name)`` when the job is gone;
- ``with reconcile_timer(): ...`` around one reconcile pass: duration histogram, and errors by
  exception type when the pass raises;
- ``observe_plan(namespace, name, plan)`` with a full MoEPlan document: adds the byte counts
  ``status.plan`` leaves out;
- ``record_smoke_verdict(image, verdict)`` when the upgrade gate reaches or reuses a verdict;
- ``set_leader(bool)`` from the leader election in :mod:`moejob_operator.run`.

Label sets stay small: per-job series carry ``namespace`` and ``job`` only; aggregate series carry
the condition type/status or the exception type. Everything lives in :data:`REGISTRY` (not the
process-global default registry) so tests can read it in isolation.
"""

from __future__ import annotations

import threading
import time
from collections import Counter as _Tally
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from moe_contracts.plan import MoEPlan

from . import constants as C

PREFIX = "moe_operator"
REGISTRY = CollectorRegistry()
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)

RECONCILE_SECONDS = Histogram(
    f"{PREFIX}_reconcile_duration_seconds",
    "Seconds one reconcile pass of a MoETrainingJob took",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
    registry=REGISTRY,
)
RECONCILE_ERRORS = Counter(
    f"{PREFIX}_reconcile_errors",
    "Reconcile passes that raised, by exception type",
    ["error"],
    registry=REGISTRY,
)
SMOKE_VERDICTS = Counter(
    f"{PREFIX}_smoke_verdicts",
    "Smoke-test gate verdicts reached or reused (cached)",
    ["verdict", "cached"],
    registry=REGISTRY,
)
SMOKE_CURRENT = Gauge(
    f"{PREFIX}_smoke_verdict",
    "1 for the current verdict of each trainer image",
    ["image", "verdict"],
    registry=REGISTRY,
)
LEADER = Gauge(
    f"{PREFIX}_leader",
    "1 while this process reconciles (holds the leader Lease, or runs with leader election off)",
    registry=REGISTRY,
)
BUILD_INFO = Gauge(
    f"{PREFIX}_build_info", "Version of the running operator", ["version"], registry=REGISTRY
)

VERDICTS = ("Passed", "Failed")

# status.plan (and MoEPlan placement.quality / memory) keys -> per-job gauge names
_PLAN_GAUGES = {
    "crossGroupVsContiguous": (
        "plan_cross_group_vs_contiguous",
        "Cross-NVLink-group bytes of the plan / those of contiguous placement",
    ),
    "maxMeanLoad": ("plan_max_mean_load", "Max/mean expected GPU load of the plan's placement"),
    "crossGroupBytesPerStep": (
        "plan_cross_group_bytes_per_step",
        "Bytes per step the plan sends across NVLink groups",
    ),
    "crossNodeBytesPerStep": (
        "plan_cross_node_bytes_per_step",
        "Bytes per step the plan sends across nodes",
    ),
    "worldSize": ("plan_world_size", "Ranks in the plan"),
    "epSize": ("plan_ep_size", "Expert-parallel size of the plan"),
    "estimatedPeakBytesPerGpu": (
        "plan_estimated_peak_bytes",
        "Estimated peak memory per GPU (or process) of the plan",
    ),
    "fits": ("plan_fits", "1 when the plan's memory estimate fits the device"),
    # status.sizing (jobs with Auto fields)
    "predictedTokensPerSecond": (
        "sizing_predicted_tokens_per_second",
        "Tokens/s the sizing predicted for the shape it chose",
    ),
    "measuredVsPredicted": (
        "sizing_measured_vs_predicted",
        "Measured tokens/s (trainer progress) over the sizing's predicted tokens/s",
    ),
}


class _JobState:
    __slots__ = ("conditions", "phase", "plan")

    def __init__(self) -> None:
        self.conditions: dict[str, str] = {}
        self.phase: str | None = None
        self.plan: dict[str, float] = {}


class JobCollector(Collector):
    """Renders the last status seen per job at scrape time (so deleted jobs vanish at once)."""

    def __init__(self) -> None:
        self._jobs: dict[tuple[str, str], _JobState] = {}
        self._lock = threading.Lock()

    def update(self, namespace: str, name: str, status: dict[str, Any] | None) -> None:
        status = status or {}
        conditions = {
            c.get("type"): c.get("status") for c in status.get("conditions") or () if c.get("type")
        }
        plan = _numbers({**(status.get("plan") or {}), **(status.get("sizing") or {})})
        with self._lock:
            st = self._jobs.setdefault((namespace, name), _JobState())
            st.conditions = conditions
            st.phase = status.get("phase")
            st.plan.update(plan)

    def update_plan(self, namespace: str, name: str, values: dict[str, float]) -> None:
        with self._lock:
            self._jobs.setdefault((namespace, name), _JobState()).plan.update(values)

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._jobs.pop((namespace, name), None)

    def clear(self) -> None:
        with self._lock:
            self._jobs.clear()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            jobs = {k: (dict(v.conditions), v.phase, dict(v.plan)) for k, v in self._jobs.items()}
        by_cond = _Tally((t, s) for conds, _, _ in jobs.values() for t, s in conds.items())
        fam = GaugeMetricFamily(
            f"{PREFIX}_jobs",
            "MoETrainingJobs by condition type and status",
            labels=["condition", "status"],
        )
        for ctype in C.CONDITION_TYPES:  # a stable series set: zeros included
            for cstatus in ("True", "False", "Unknown"):
                fam.add_metric([ctype, cstatus], by_cond.get((ctype, cstatus), 0))
        yield fam
        by_phase = _Tally(phase or "Pending" for _, phase, _ in jobs.values())
        fam = GaugeMetricFamily(
            f"{PREFIX}_jobs_by_phase", "MoETrainingJobs by status.phase", labels=["phase"]
        )
        for phase, n in sorted(by_phase.items()):
            fam.add_metric([phase], n)
        yield fam
        fam = GaugeMetricFamily(
            f"{PREFIX}_job_phase",
            "1 for each job's current phase",
            labels=["namespace", "job", "phase"],
        )
        for (ns, name), (_, job_phase, _) in sorted(jobs.items()):
            fam.add_metric([ns, name, job_phase or "Pending"], 1)
        yield fam
        for key, (suffix, doc) in _PLAN_GAUGES.items():
            fam = GaugeMetricFamily(f"{PREFIX}_{suffix}", doc, labels=["namespace", "job"])
            for (ns, name), (_, _, plan) in sorted(jobs.items()):
                if key in plan:
                    fam.add_metric([ns, name], plan[key])
            yield fam


JOBS = JobCollector()
REGISTRY.register(JOBS)


def _numbers(d: dict[str, Any]) -> dict[str, float]:
    """The gauge-worthy numbers of ``status.plan`` / ``placement.quality`` / ``memory``
    (status.plan carries ratios as strings such as ``"0.500"``; booleans become 0/1)."""
    out: dict[str, float] = {}
    for key in _PLAN_GAUGES:
        if key not in d or d[key] is None:
            continue
        try:
            out[key] = float(d[key])
        except (TypeError, ValueError):
            continue
    return out


# ---- the call sites' API ------------------------------------------------------------------
def observe_job(namespace: str, name: str, status: dict[str, Any] | None) -> None:
    """Record a job's status after a pass (conditions, phase, ``status.plan``)."""
    JOBS.update(namespace, name, status)


def forget_job(namespace: str, name: str) -> None:
    JOBS.forget(namespace, name)


def observe_plan(namespace: str, name: str, plan: MoEPlan) -> None:
    """Record a MoEPlan's placement quality and memory estimate."""
    quality = (plan.placement.quality if plan.placement is not None else None) or {}
    memory = plan.memory
    values = _numbers(
        {
            **quality,
            "worldSize": plan.world_size,
            "epSize": plan.ep_size,
            "estimatedPeakBytesPerGpu": memory.estimated_peak_bytes if memory else None,
            "fits": memory.fits if memory else None,
        }
    )
    JOBS.update_plan(namespace, name, values)


@contextmanager
def reconcile_timer() -> Iterator[None]:
    """Time one reconcile pass; count it as an error (by exception type) when it raises."""
    start = time.perf_counter()
    try:
        yield
    except BaseException as exc:
        RECONCILE_ERRORS.labels(type(exc).__name__).inc()
        raise
    finally:
        RECONCILE_SECONDS.observe(time.perf_counter() - start)


def record_smoke_verdict(image: str, verdict: str, *, cached: bool = False) -> None:
    """``verdict`` is ``Passed`` or ``Failed``; ``cached`` when an earlier verdict was reused."""
    if verdict not in VERDICTS:
        raise ValueError(f"smoke verdict {verdict!r} is not one of {', '.join(VERDICTS)}")
    SMOKE_VERDICTS.labels(verdict, "true" if cached else "false").inc()
    for v in VERDICTS:
        SMOKE_CURRENT.labels(image, v).set(1 if v == verdict else 0)


def set_leader(leading: bool) -> None:
    LEADER.set(1 if leading else 0)


def set_build_info(version: str) -> None:
    BUILD_INFO.labels(version).set(1)


def render() -> bytes:
    """The text exposition format, as a scrape would return it."""
    return generate_latest(REGISTRY)


def start_server(port: int, addr: str = "0.0.0.0") -> tuple[WSGIServer, threading.Thread]:
    """Serve ``/metrics`` on ``addr:port`` in a daemon thread; returns (server, thread)."""
    return start_http_server(port, addr=addr, registry=REGISTRY)
