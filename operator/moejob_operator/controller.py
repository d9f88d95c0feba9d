"""The operator's running state in one object: the API client, the work queue, the per-job locks,
the deferred launch remainders, the child watches and their pod cache, the smoke-Job sweeper.

``moectl operator`` (:mod:`moejob_operator.run`) creates one :class:`Controller` from its flags and
hands it to kopf as the operator's ``memo``; the kopf handlers (:mod:`moejob_operator.handlers`)
only parse their trigger and call it. Nothing here is a module global, nothing reads the
environment: a test builds a controller with its own client and reconcile function.

Passes for one job are serialised by a per-job lock, whatever triggered them (the job's watch
event, a child's, the work queue's requeue or resync), and so is the deferred rest of a
launching pass (``reconcile(defer=...)``: run once a burst of passes is over, or first thing in
the job's next pass). A lock lives only while a pass holds or waits for it, and a deleted job's
entries (queue, error count, pod cache, pending remainder) go with it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from kubernetes.client.exceptions import ApiException

from . import constants as C
from . import metrics
from .childwatch import ChildWatch
from .reconcile import gate as gate_reconcile
from .reconcile.client import Client
from .reconcile.deferred import YieldingQueue
from .reconcile.job import reconcile as reconcile_job
from .reconcile.planning import PlanMemo
from .reconcile.settings import Settings
from .workqueue import RESYNC_SECONDS, Key, Requeue

log = logging.getLogger("moejob_operator")

TRANSIENT_RETRY_SECONDS = 2.0
MIN_REQUEUE_SECONDS = 0.5
POD_SELECTOR = f"{C.LABEL_JOB},{C.LABEL_MANAGED_BY}={C.MANAGED_BY}"
PROGRESS_SELECTOR = f"{C.LABEL_COMPONENT}=progress,{C.LABEL_MANAGED_BY}={C.MANAGED_BY}"


class Reconcile(Protocol):
    def __call__(
        self,
        client: Client,
        namespace: str,
        name: str,
        *,
        settings: Settings,
        body: dict[str, Any] | None = ...,
        defer: Callable[[Callable[[], None]], None] | None = ...,
        backoff: Callable[[], float] | None = ...,
        plan_memo: PlanMemo | None = ...,
    ) -> float | None: ...


@dataclass(frozen=True)
class ControllerConfig:
    """What ``moectl operator``'s flags (and, for ``settings``, its environment, read once at
    start-up) decide about the loop."""

    namespaces: tuple[str, ...] = ()  # watched namespaces; empty: all
    # kopf's threads for sync handlers (new jobs' first passes). Where a burst is CPU-bound (API
    # server and operator on one small machine) fewer threads keep passes closer to first-in
    # first-out; with a remote API server a pass mostly waits on round trips and more help.
    workers: int = 8
    resync_seconds: float = RESYNC_SECONDS
    requeue_threads: int = 8
    # a launching pass's remainder runs once no pass has started for this long, at most this
    # late, in this many threads
    finish_quiet_seconds: float = 0.1
    finish_max_delay_seconds: float = 2.0
    finish_threads: int = 4
    smoke_sweep_seconds: float = 300.0  # finished smoke Jobs are looked at this often
    # every pass's admission policy and gate settings (the defaults: no host path, gate on)
    settings: Settings = field(default_factory=Settings)

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")


class _JobLock:
    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0


class Controller:
    def __init__(
        self,
        config: ControllerConfig | None = None,
        *,
        client: Client | None = None,
        reconcile: Reconcile = reconcile_job,
    ):
        self.config = config or ControllerConfig()
        self._client = client
        self._client_guard = threading.Lock()
        self._reconcile = reconcile
        self.plan_memo = PlanMemo()  # plans by input, shared by every job's passes
        self.requeue = Requeue(
            self.run_pass,
            threads=self.config.requeue_threads,
            resync_seconds=self.config.resync_seconds,
        )
        self._locks: dict[Key, _JobLock] = {}
        self._locks_guard = threading.Lock()
        self._pending: dict[Key, Callable[[], None]] = {}
        self._pending_guard = threading.Lock()
        self._finisher: YieldingQueue[Key] | None = None
        self._pod_seen: dict[Key, dict[str, tuple[Any, ...]]] = {}  # job -> pod uid -> signature
        self._pod_seen_guard = threading.Lock()
        self._watches: list[ChildWatch] = []
        self._sweeper_stop = threading.Event()

    @property
    def client(self) -> Client:
        """The API client (made on first use from the kubeconfig or in-cluster credentials)."""
        with self._client_guard:
            if self._client is None:
                self._client = Client()
            return self._client

    @property
    def namespaces(self) -> list[str] | None:
        return list(self.config.namespaces) or None

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self.requeue.start()
        api = self.client.api
        ns = self.namespaces
        self._watches = [
            ChildWatch(api, "pods", POD_SELECTOR, self.on_child_pod, namespaces=ns).start(),
            ChildWatch(
                api, "configmaps", PROGRESS_SELECTOR, self.on_progress, namespaces=ns
            ).start(),
        ]
        self._start_smoke_sweeper()

    def stop(self, drain_seconds: float = 5.0) -> None:
        """Stop the watches and the queue; launched jobs' remainders (status) still run: a new
        operator would redo those launches otherwise."""
        self._sweeper_stop.set()
        while self._watches:
            self._watches.pop().stop()
        self.requeue.stop()
        self.drain_deferred(drain_seconds)

    def _start_smoke_sweeper(self) -> None:
        """Deletes finished smoke Jobs the gate no longer needs (1.20 has no Job TTL)."""
        self._sweeper_stop.clear()

        def loop() -> None:
            while not self._sweeper_stop.wait(self.config.smoke_sweep_seconds):
                try:
                    gate_reconcile.sweep_smoke_jobs(self.client, self.config.settings.gate)
                except Exception:  # housekeeping; tried again next round
                    log.exception("smoke Job sweep failed")

        threading.Thread(target=loop, name="moe-smoke-sweep", daemon=True).start()

    # ---- triggers ------------------------------------------------------------------------
    def job_seen(self, namespace: str, name: str, body: dict[str, Any] | None = None) -> None:
        """A job was listed, created or had its spec changed: a pass now (in the caller's
        thread). ``body``: a new job as its watch event delivered it (one GET fewer)."""
        self.requeue.remember((namespace, name))
        self.run_pass(namespace, name, body=body)

    def job_deleted(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        self.requeue.forget(key)
        with self._pod_seen_guard:
            self._pod_seen.pop(key, None)
        with self._pending_guard:
            self._pending.pop(key, None)
        metrics.forget_job(namespace, name)

    def node_deleted(self, node: str) -> None:
        """Every job planned on the node re-plans or fails now, not at the next resync."""
        self.client.forget_nodes()
        for ns, job in self.client.jobs_planned_on(node):
            self.run_pass(ns, job)

    def on_child_pod(self, type: str, pod: dict[str, Any]) -> None:
        """A worker or discovery pod changed (child watch thread): queue a pass for its job."""
        meta = pod.get("metadata") or {}
        job = (meta.get("labels") or {}).get(C.LABEL_JOB)
        if not job:
            return
        key = (meta.get("namespace", ""), job)
        if self._pod_changed(key, type, pod):
            self.requeue.after(key, 0.0)

    def on_progress(self, type: str, cm: dict[str, Any]) -> None:
        """The trainer updated its progress ConfigMap (child watch thread): queue a pass."""
        meta = cm.get("metadata") or {}
        job = (meta.get("labels") or {}).get(C.LABEL_JOB)
        if job and type == "MODIFIED":
            self.requeue.after((meta.get("namespace", ""), job), 0.0)

    def _pod_changed(self, key: Key, type: str, pod: dict[str, Any]) -> bool:
        """Pod events worth a pass: DELETED, and changes of phase, container state or deletion.
        ADDED is the operator's own create (the watch starts from "now"; jobs' passes after a
        restart come from kopf's initial listing of the jobs)."""
        uid = (pod.get("metadata") or {}).get("uid", "")
        sig = _pod_signature(pod)
        with self._pod_seen_guard:
            seen = self._pod_seen.setdefault(key, {})
            if type == "DELETED":
                seen.pop(uid, None)
                if not seen:
                    del self._pod_seen[key]
                return True
            old = seen.get(uid)
            seen[uid] = sig
        if type != "MODIFIED":
            return False
        return old != sig if old is not None else sig[0] != "Pending"

    # ---- passes --------------------------------------------------------------------------
    def run_pass(
        self, namespace: str, name: str, body: dict[str, Any] | None = None
    ) -> float | None:
        """One serialised pass (after the remainder of the job's previous pass, if one is still
        deferred); schedules the next one it asks for (or a retry after an error)."""
        key = (namespace, name)
        errored: list[bool] = []

        def backoff() -> float:
            errored.append(True)
            return self.requeue.failed(key)

        def once() -> float | None:
            self._finish_pending(key)
            return self._reconcile(
                self.client,
                namespace,
                name,
                settings=self.config.settings,
                body=body,
                defer=lambda f: self._defer(key, f),
                backoff=backoff,
                plan_memo=self.plan_memo,
            )

        return self._serialised(key, once, errored)

    @contextmanager
    def _job_lock(self, key: Key) -> Iterator[None]:
        """The job's lock; the entry goes when no pass holds or waits for it."""
        with self._locks_guard:
            entry = self._locks.get(key)
            if entry is None:
                entry = self._locks[key] = _JobLock()
            entry.users += 1
        try:
            with entry.lock:
                yield
        finally:
            with self._locks_guard:
                entry.users -= 1
                if entry.users == 0:
                    del self._locks[key]

    def lock_count(self) -> int:
        """Job locks held or waited for now (tests: they are pruned)."""
        with self._locks_guard:
            return len(self._locks)

    def _serialised(
        self, key: Key, work: Callable[[], float | None], errored: list[bool] | None = None
    ) -> float | None:
        """``work`` under the job's lock; schedules the pass it asks for, or a retry after an
        error. ``errored`` non-empty after ``work``: it reported an error on the job and asked
        for a backoff delay itself (the error count keeps growing until a pass goes through)."""
        namespace, name = key
        delay: float | None
        with self._job_lock(key):
            try:
                delay = work()
                if not errored:
                    self.requeue.succeeded(key)
            except ApiException as exc:
                if exc.status in (409, 429) or exc.status >= 500:  # conflicts, overload: soon
                    delay = self.requeue.failed(key, first=TRANSIENT_RETRY_SECONDS)
                    log.info(
                        "%s/%s: API server said %s %s; again in %.0f s",
                        namespace,
                        name,
                        exc.status,
                        exc.reason,
                        delay,
                    )
                else:
                    delay = self.requeue.failed(key)
                    log.error(
                        "%s/%s: pass failed (%s %s); again in %.0f s",
                        namespace,
                        name,
                        exc.status,
                        exc.reason,
                        delay,
                    )
            except Exception:  # a bug must not stop this job's passes for good
                delay = self.requeue.failed(key)
                log.exception("%s/%s: pass failed; again in %.0f s", namespace, name, delay)
        if delay is not None:
            self.requeue.after(key, max(MIN_REQUEUE_SECONDS, delay))
        return delay

    # ---- a launching pass's remainder ----------------------------------------------------
    def _defer(self, key: Key, finish: Callable[[], None]) -> None:
        """reconcile's ``defer`` (called in the job's pass, under its lock): at most one per
        job, run by the finisher once a burst of passes has passed, or first thing by the
        job's next pass, whichever comes first."""
        cfg = self.config
        with self._pending_guard:
            self._pending[key] = finish
            if self._finisher is None:
                self._finisher = YieldingQueue(
                    "moe-finish",
                    self._run_finish,
                    self.client.clock,
                    quiet=cfg.finish_quiet_seconds,
                    max_delay=cfg.finish_max_delay_seconds,
                    threads=cfg.finish_threads,
                )
            finisher = self._finisher
        if not finisher.put(key):
            self._finish_pending(key)  # queue full: now, in this pass

    def _run_finish(self, key: Key) -> None:
        self._serialised(key, lambda: self._finish_pending(key))

    def _finish_pending(self, key: Key) -> None:
        with self._pending_guard:
            finish = self._pending.pop(key, None)
        if finish is not None:
            finish()

    def drain_deferred(self, timeout: float = 10.0) -> bool:
        """Run every deferred launch remainder now-ish (shutdown, tests); False on timeout."""
        with self._pending_guard:
            finisher = self._finisher
        return finisher is None or finisher.drain(timeout)


def _pod_signature(body: dict[str, Any]) -> tuple[Any, ...]:
    status = body.get("status") or {}
    states = tuple(
        sorted(
            (
                cs.get("name", ""),
                tuple(sorted((cs.get("state") or {}).keys())),
                ((cs.get("state") or {}).get("terminated") or {}).get("exitCode"),
            )
            for cs in status.get("containerStatuses") or ()
        )
    )
    deleting = bool((body.get("metadata") or {}).get("deletionTimestamp"))
    return (status.get("phase"), states, deleting)
