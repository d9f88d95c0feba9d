"""kopf handlers: the only place with ``@kopf`` decorators. Each one parses the trigger and
delegates to :func:`moejob_operator.reconcile.job.reconcile`, which does a level-based pass.

Triggers: the job's watch events (kopf), its worker and discovery pods and the progress ConfigMap its
trainer writes (:mod:`moejob_operator.childwatch`: server-side label selectors, not kopf), node
deletions (kopf); plus this module's own requeue (a pass that says "again in N s") and a
resync of every known job every ``RESYNC_SECONDS`` (safety net for missed events). Passes for one
job are serialised by a per-job lock, whatever triggered them, and so is the deferred rest of a
launching pass (``reconcile(defer=...)``: run once a burst of passes is over, or first thing in
the job's next pass).

The job is watched with ``kopf.on.event``, not kopf's create/update/resume handlers and timers:
those keep state on the object (a finalizer, added in its own PATCH and then waiting for the
watch event it causes, and a last-handled-configuration annotation PATCH after every handler
run). The pass needs none of it: it is level-based, its state lives in ``status`` and in the
children (ownerReferences delete them with the job), and a spec change shows as
``metadata.generation != status.observedGeneration``: two PATCHes and one watch round trip fewer
per job.

Run: ``kopf run -A -m moejob_operator.handlers`` (``--standalone`` without peering).
"""

from __future__ import annotations

import concurrent.futures as cf
import heapq
import logging
import os
import threading
import time
from collections import defaultdict
from typing import Callable

import kopf
from kubernetes.client.rest import ApiException

from . import constants as C
from . import metrics
from .childwatch import ChildWatch
from .reconcile.client import Client
from .reconcile.deferred import YieldingQueue
from .reconcile import gate as gate_reconcile
from .reconcile.job import reconcile

log = logging.getLogger("moejob_operator")

RESYNC_SECONDS = 30.0       # every known job gets a pass this often (deadlines, TTLs, missed events)
TRANSIENT_RETRY_SECONDS = 2.0
ERROR_RETRY_SECONDS = (5.0, 60.0)   # first retry after an unexpected error, doubling up to the cap
REQUEUE_THREADS = 8
SMOKE_SWEEP_SECONDS = 300.0  # finished smoke Jobs are looked at this often (reconcile/gate.py)
DEFAULT_WORKERS = 8

_client: Client | None = None
_locks: defaultdict[tuple[str, str], threading.Lock] = defaultdict(threading.Lock)
_locks_guard = threading.Lock()


def client() -> Client:
    global _client
    if _client is None:
        _client = Client()
    return _client


class Requeue:
    """Passes wanted later: one timer thread, a small pool to run them, and the set of known jobs
    for the resync. A job has at most one pending entry (the earliest wins), at most one pass
    waiting in the pool, and a request that arrives while its pass runs gets exactly one more
    pass afterwards (the running one may have missed the change that asked for it)."""

    def __init__(self, run, *, threads: int = REQUEUE_THREADS, resync_seconds: float = RESYNC_SECONDS):
        self._run, self._resync = run, resync_seconds
        self._heap: list[tuple[float, tuple[str, str]]] = []
        self._due: dict[tuple[str, str], float] = {}
        self._queued: set[tuple[str, str]] = set()
        self._running: set[tuple[str, str]] = set()
        self._rerun: set[tuple[str, str]] = set()
        self.known: set[tuple[str, str]] = set()
        self._cv = threading.Condition()
        self._pool: cf.ThreadPoolExecutor | None = None
        self._threads, self._stopped = threads, True
        self._errors: dict[tuple[str, str], int] = {}

    def start(self) -> None:
        with self._cv:
            if not self._stopped:
                return
            self._stopped = False
            self._pool = cf.ThreadPoolExecutor(self._threads, thread_name_prefix="moe-requeue")
        threading.Thread(target=self._loop, name="moe-requeue-timer", daemon=True).start()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._heap.clear()
            self._due.clear()
            self._cv.notify_all()
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def after(self, key: tuple[str, str], seconds: float) -> None:
        due = time.monotonic() + max(0.0, seconds)
        with self._cv:
            if self._stopped or self._due.get(key, float("inf")) <= due:
                return
            self._due[key] = due
            heapq.heappush(self._heap, (due, key))
            self._cv.notify()

    def remember(self, key: tuple[str, str]) -> None:
        """A job the resync should visit (kopf threads call this while the timer iterates)."""
        with self._cv:
            self.known.add(key)

    def forget(self, key: tuple[str, str]) -> None:
        with self._cv:
            self.known.discard(key)
            self._due.pop(key, None)      # its heap entry is skipped when it comes up
            self._errors.pop(key, None)

    def failed(self, key: tuple[str, str], first: float | None = None) -> float:
        """Delay before retrying a pass that raised: 5 s (or ``first``), doubling, capped."""
        with self._cv:
            n = self._errors.get(key, 0)
            self._errors[key] = n + 1
        cap = ERROR_RETRY_SECONDS[1]
        return min(cap, (first or ERROR_RETRY_SECONDS[0]) * 2 ** min(n, 16))

    def succeeded(self, key: tuple[str, str]) -> None:
        with self._cv:
            self._errors.pop(key, None)

    def _loop(self) -> None:
        next_resync = time.monotonic() + self._resync
        while True:
            with self._cv:
                if self._stopped:
                    return
                now = time.monotonic()
                ready = []
                while self._heap and self._heap[0][0] <= now:
                    due, key = heapq.heappop(self._heap)
                    if self._due.get(key) == due:
                        del self._due[key]
                        ready.append(key)
                if now >= next_resync:
                    due_now = set(ready)
                    ready.extend(k for k in list(self.known) if k not in due_now)
                    next_resync = now + self._resync
                wait = next_resync - now
                if self._heap:
                    wait = min(wait, self._heap[0][0] - now)
                try:
                    for key in ready:
                        self._submit(key)
                except RuntimeError:          # the pool refuses work: the interpreter is exiting
                    log.info("requeue: pool closed; timer stops")
                    return
                if not ready:
                    self._cv.wait(timeout=max(0.01, wait))

    def _submit(self, key: tuple[str, str]) -> None:
        """Queue a pass (caller holds ``self._cv``). Like client-go's workqueue: a job waits in
        the pool at most once, and a job whose pass is running gets one more pass after it
        rather than a second pool thread blocked on its lock."""
        if self._pool is None or key in self._queued:
            return
        if key in self._running:
            self._rerun.add(key)
            return
        self._queued.add(key)

        def job():
            with self._cv:
                self._queued.discard(key)
                self._running.add(key)
            try:
                self._run(*key)
            finally:
                with self._cv:
                    self._running.discard(key)
                    if key in self._rerun:
                        self._rerun.discard(key)
                        self._submit(key)
        self._pool.submit(job)


# A launching pass's remainder (reconcile(defer=...)): at most one per job, run by the finisher
# once a burst of passes has passed, or first thing by the job's next pass, whichever comes first.
FINISH_QUIET_SECONDS = 0.1
FINISH_MAX_DELAY_SECONDS = 2.0
FINISH_THREADS = 4
_pending: dict[tuple[str, str], Callable[[], None]] = {}
_pending_guard = threading.Lock()
_finisher: YieldingQueue | None = None


def _defer(key: tuple[str, str], finish: Callable[[], None]) -> None:
    """reconcile's ``defer`` (called in the job's pass, under its lock)."""
    global _finisher
    with _pending_guard:
        _pending[key] = finish
        if _finisher is None:
            _finisher = YieldingQueue("moe-finish", _run_finish, client().clock,
                                      quiet=FINISH_QUIET_SECONDS, max_delay=FINISH_MAX_DELAY_SECONDS,
                                      threads=FINISH_THREADS)
        finisher = _finisher
    if not finisher.put(key):
        _finish_pending(key)      # queue full: now, in this pass


def _run_finish(key: tuple[str, str]) -> None:
    _serialised(key, lambda: _finish_pending(key))


def _finish_pending(key: tuple[str, str]) -> None:
    with _pending_guard:
        finish = _pending.pop(key, None)
    if finish is not None:
        finish()


def drain_deferred(timeout: float = 10.0) -> bool:
    """Run every deferred launch remainder now-ish (shutdown, tests); False on timeout."""
    return _finisher is None or _finisher.drain(timeout)


def run_pass(namespace: str, name: str, body: dict | None = None) -> float | None:
    """One serialised pass (after the remainder of the job's previous pass, if one is still
    deferred); schedules the next one it asks for (or a retry after an error)."""
    key = (namespace, name)

    errored = []

    def backoff() -> float:
        errored.append(True)
        return requeue.failed(key)

    def once() -> float | None:
        _finish_pending(key)
        return reconcile(client(), namespace, name, body=body, defer=lambda f: _defer(key, f),
                         backoff=backoff)
    return _serialised(key, once, errored)


def _serialised(key: tuple[str, str], work: Callable[[], float | None],
                errored: list | None = None) -> float | None:
    """``work`` under the job's lock; schedules the pass it asks for, or a retry after an error.
    ``errored`` non-empty after ``work``: it reported an error on the job and asked for a
    backoff delay itself (the error count keeps growing until a pass goes through)."""
    namespace, name = key
    with _locks_guard:
        lock = _locks[key]
    delay: float | None
    with lock:
        try:
            delay = work()
            if not errored:
                requeue.succeeded(key)
        except ApiException as exc:
            if exc.status in (409, 429) or exc.status >= 500:   # conflicts, overload: soon again
                delay = requeue.failed(key, first=TRANSIENT_RETRY_SECONDS)
                log.info("%s/%s: API server said %s %s; again in %.0f s", namespace, name, exc.status,
                         exc.reason, delay)
            else:
                delay = requeue.failed(key)
                log.error("%s/%s: pass failed (%s %s); again in %.0f s", namespace, name, exc.status,
                          exc.reason, delay)
        except Exception:   # noqa: BLE001 - a bug must not stop this job's passes for good
            delay = requeue.failed(key)
            log.exception("%s/%s: pass failed; again in %.0f s", namespace, name, delay)
    if delay is not None:
        requeue.after(key, max(0.5, delay))
    return delay


requeue = Requeue(run_pass)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_) -> None:
    settings.posting.enabled = False               # the reconciler posts its own Events
    # Sync handlers (new jobs' first passes) run in this many threads. Where a burst is CPU-bound
    # (API server and operator on one small machine) fewer threads keep passes closer to
    # first-in first-out; with a remote API server a pass mostly waits on round trips and more
    # threads help: $MOE_OPERATOR_WORKERS.
    settings.execution.max_workers = int(os.environ.get("MOE_OPERATOR_WORKERS", DEFAULT_WORKERS))
    # kopf waits this long after an object's event for more events to batch (default 0.1 s):
    # on every pass's path, and the reconciler re-reads the job anyway.
    settings.batching.batch_window = 0.02
    # No handler needs a finalizer any more; naming ours lets kopf remove it from jobs created by
    # an older operator version (which added it for its timer) instead of blocking their deletion.
    settings.persistence.finalizer = C.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=C.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=C.GROUP)
    settings.watching.server_timeout = 300
    logging.getLogger("kubernetes").setLevel(logging.WARNING)
    requeue.start()
    start_child_watches()
    _start_smoke_sweeper()


_sweeper_stop = threading.Event()


def _start_smoke_sweeper() -> None:
    """Deletes finished smoke Jobs the gate no longer needs (1.20 has no Job TTL)."""
    _sweeper_stop.clear()

    def loop() -> None:
        while not _sweeper_stop.wait(SMOKE_SWEEP_SECONDS):
            try:
                gate_reconcile.sweep_smoke_jobs(client())
            except Exception:  # noqa: BLE001 - housekeeping; tried again next round
                log.exception("smoke Job sweep failed")
    threading.Thread(target=loop, name="moe-smoke-sweep", daemon=True).start()


@kopf.on.cleanup()
def shutdown(**_) -> None:
    _sweeper_stop.set()
    stop_child_watches()
    requeue.stop()
    drain_deferred(5.0)    # launched jobs' status; a new operator would redo them otherwise


def _job_event_wanted(type: str | None, body, **_) -> bool:
    """The initial listing (None: resume after a restart), a new job, a spec change (generation
    ahead of status.observedGeneration), a deletion. Not the MODIFIED events of the operator's own
    status patches, which leave the generation alone."""
    if type in (None, "ADDED", "DELETED"):
        return True
    meta = body.get("metadata") or {}
    return meta.get("generation") != (body.get("status") or {}).get("observedGeneration")


@kopf.on.event(C.GROUP, C.VERSION, C.PLURAL, when=_job_event_wanted)
def on_job(type: str | None, namespace: str, name: str, body, **_) -> None:
    key = (namespace, name)
    if type == "DELETED":
        requeue.forget(key)
        metrics.forget_job(namespace, name)
        return
    requeue.remember(key)
    # a new job's first pass works on the body the watch delivered (one GET fewer on the way to
    # its workers); every other pass reads the job fresh
    run_pass(namespace, name, body=dict(body) if type == "ADDED" else None)


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


def _phase_changed(type: str, body) -> bool:
    """Pod events worth a pass: DELETED, and changes of phase, container state or deletion.
    ADDED is the operator's own create (the watch starts from "now"; jobs' passes after a restart
    come from kopf's initial listing of the jobs)."""
    uid = body.get("metadata", {}).get("uid", "")
    sig = _pod_signature(body)
    with _pod_seen_lock:
        if type == "DELETED":
            _pod_seen.pop(uid, None)
            return True
        old = _pod_seen.get(uid)
        _pod_seen[uid] = sig
    return type == "MODIFIED" and old is not None and old != sig or (type == "MODIFIED" and old is None and sig[0] != "Pending")


def on_child_pod(type: str, pod: dict) -> None:
    """A worker or discovery pod changed (childwatch thread): queue a pass for its job."""
    meta = pod.get("metadata") or {}
    job = _owner_job(meta.get("labels") or {})
    if job and _phase_changed(type, pod):
        requeue.after((meta.get("namespace", ""), job), 0.0)


def on_progress(type: str, cm: dict) -> None:
    """The trainer updated its progress ConfigMap (childwatch thread): queue a pass."""
    meta = cm.get("metadata") or {}
    job = _owner_job(meta.get("labels") or {})
    if job and type == "MODIFIED":
        requeue.after((meta.get("namespace", ""), job), 0.0)


POD_SELECTOR = f"{C.LABEL_JOB},{C.LABEL_MANAGED_BY}={C.MANAGED_BY}"
PROGRESS_SELECTOR = f"{C.LABEL_COMPONENT}=progress,{C.LABEL_MANAGED_BY}={C.MANAGED_BY}"
_watches: list[ChildWatch] = []


def watched_namespaces() -> list[str] | None:
    """$MOE_WATCH_NAMESPACES (comma-separated; ``moectl operator -n`` sets it), else all."""
    names = [n for n in os.environ.get("MOE_WATCH_NAMESPACES", "").split(",") if n]
    return names or None


def start_child_watches() -> None:
    api = client().api
    ns = watched_namespaces()
    _watches.extend([ChildWatch(api, "pods", POD_SELECTOR, on_child_pod, namespaces=ns).start(),
                     ChildWatch(api, "configmaps", PROGRESS_SELECTOR, on_progress, namespaces=ns).start()])


def stop_child_watches() -> None:
    while _watches:
        _watches.pop().stop()


@kopf.on.event("v1", "nodes", when=lambda type, **_: type == "DELETED")
def on_node_deleted(name: str, **_) -> None:
    """A node went away: every job planned on it re-plans or fails now, not at the next resync."""
    client().forget_nodes()
    for ns, job in client().jobs_planned_on(name):
        run_pass(ns, job)
