"""kopf handlers: the only place with ``@kopf`` decorators. Each one parses the trigger and
delegates to :func:`moejob_operator.reconcile.job.reconcile`, which does a level-based pass.

Triggers: the job itself (create/resume/spec update, plus a slow timer as a safety net for
deadlines and TTLs), its worker and discovery pods, and the progress ConfigMap its trainer
writes. Passes for one job are serialised by a per-job lock, whatever triggered them.

Run: ``kopf run -A -m moejob_operator.handlers`` (``--standalone`` without peering).
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict

import kopf
from kubernetes.client.rest import ApiException

from . import constants as C
from .reconcile.client import Client
from .reconcile.job import reconcile

_client: Client | None = None
_locks: defaultdict[tuple[str, str], threading.Lock] = defaultdict(threading.Lock)
_locks_guard = threading.Lock()


def client() -> Client:
    global _client
    if _client is None:
        _client = Client()
    return _client


def _pass(namespace: str, name: str) -> float | None:
    with _locks_guard:
        lock = _locks[(namespace, name)]
    with lock:
        try:
            return reconcile(client(), namespace, name)
        except ApiException as exc:
            if exc.status in (409, 429) or exc.status >= 500:   # conflicts, overload: soon again
                raise kopf.TemporaryError(f"API server said {exc.status} {exc.reason}", delay=2) from None
            raise


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_) -> None:
    settings.posting.enabled = False               # the reconciler posts its own Events
    # Sync handlers run in this many threads. A pass is mostly waiting on API round trips, so
    # a burst of new jobs is bounded by it; the client's connection pool is larger (client.py).
    settings.execution.max_workers = 32
    # kopf waits this long after an object's event for more events to batch (default 0.1 s):
    # on every pass's path, and the reconciler re-reads the job anyway.
    settings.batching.batch_window = 0.02
    settings.persistence.finalizer = C.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=C.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=C.GROUP)
    settings.watching.server_timeout = 300
    logging.getLogger("kubernetes").setLevel(logging.WARNING)


@kopf.on.resume(C.GROUP, C.VERSION, C.PLURAL)
@kopf.on.create(C.GROUP, C.VERSION, C.PLURAL)
@kopf.on.update(C.GROUP, C.VERSION, C.PLURAL, field="spec")
def on_job(namespace: str, name: str, **_) -> None:
    delay = _pass(namespace, name)
    if delay is not None and delay < 30:
        raise kopf.TemporaryError("not yet", delay=max(0.5, delay))


@kopf.timer(C.GROUP, C.VERSION, C.PLURAL, interval=30, initial_delay=30)
def resync(namespace: str, name: str, **_) -> None:
    _pass(namespace, name)


def _owner_job(labels: dict[str, str]) -> str | None:
    return labels.get(C.LABEL_JOB)


_pod_seen: dict[str, tuple] = {}
_pod_seen_lock = threading.Lock()


def _pod_signature(body) -> tuple:
    status = body.get("status") or {}
    states = tuple(sorted((cs.get("name", ""), tuple(sorted((cs.get("state") or {}).keys())),
                           ((cs.get("state") or {}).get("terminated") or {}).get("exitCode"))
                          for cs in status.get("containerStatuses") or ()))
    return (status.get("phase"), states, bool(body.get("metadata", {}).get("deletionTimestamp")))


def _phase_changed(type: str, body, **_) -> bool:
    """Pod events worth a pass: DELETED, and changes of phase, container state or deletion.
    ADDED is the operator's own create; None is the initial listing, which resume handles."""
    uid = body.get("metadata", {}).get("uid", "")
    sig = _pod_signature(body)
    with _pod_seen_lock:
        if type == "DELETED":
            _pod_seen.pop(uid, None)
            return True
        old = _pod_seen.get(uid)
        _pod_seen[uid] = sig
    return type == "MODIFIED" and old is not None and old != sig or (type == "MODIFIED" and old is None and sig[0] != "Pending")


@kopf.on.event("v1", "pods", labels={C.LABEL_JOB: kopf.PRESENT, C.LABEL_MANAGED_BY: C.MANAGED_BY},
               when=_phase_changed)
def on_child_pod(namespace: str, labels: dict, **_) -> None:
    job = _owner_job(labels)
    if job:
        _pass(namespace, job)


@kopf.on.event("v1", "configmaps", labels={C.LABEL_COMPONENT: "progress",
                                           C.LABEL_MANAGED_BY: C.MANAGED_BY},
               when=lambda type, **_: type == "MODIFIED")
def on_progress(namespace: str, labels: dict, **_) -> None:
    job = _owner_job(labels)
    if job:
        _pass(namespace, job)


@kopf.on.event("v1", "nodes", when=lambda type, **_: type == "DELETED")
def on_node_deleted(name: str, **_) -> None:
    """A node went away: every job planned on it re-plans or fails now, not at the next resync."""
    client().forget_nodes()
    for ns, job in client().jobs_planned_on(name):
        _pass(ns, job)
