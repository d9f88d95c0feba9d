"""The controller's work queue: passes wanted later, run in a small pool, one at a time per job.

Like client-go's workqueue: a job has at most one pending entry (the earliest due time wins), at
most one pass waiting in the pool, and a request that arrives while its pass runs gets exactly
one more pass afterwards. The known jobs get a pass every ``resync_seconds`` (deadlines, TTLs,
missed events), and a job whose passes fail backs off (``failed``).
"""

from __future__ import annotations

import concurrent.futures as cf
import heapq
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("moejob_operator")

Key = tuple[str, str]  # (namespace, name) of a job

RESYNC_SECONDS = 30.0  # every known job gets a pass this often
ERROR_RETRY_SECONDS = (5.0, 60.0)  # first retry after an unexpected error, doubling up to the cap
REQUEUE_THREADS = 8


class Requeue:
    """Passes wanted later: one timer thread, a small pool to run them, and the set of known jobs
    for the resync. A job has at most one pending entry (the earliest wins), at most one pass
    waiting in the pool, and a request that arrives while its pass runs gets exactly one more
    pass afterwards (the running one may have missed the change that asked for it)."""

    def __init__(
        self,
        run: Callable[[str, str], object],
        *,
        threads: int = REQUEUE_THREADS,
        resync_seconds: float = RESYNC_SECONDS,
    ):
        self._run, self._resync = run, resync_seconds
        self._heap: list[tuple[float, Key]] = []
        self._due: dict[Key, float] = {}
        self._queued: set[Key] = set()
        self._running: set[Key] = set()
        self._rerun: set[Key] = set()
        self.known: set[Key] = set()
        self._cv = threading.Condition()
        self._pool: cf.ThreadPoolExecutor | None = None
        self._threads, self._stopped = threads, True
        self._errors: dict[Key, int] = {}

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

    def after(self, key: Key, seconds: float) -> None:
        due = time.monotonic() + max(0.0, seconds)
        with self._cv:
            if self._stopped or self._due.get(key, float("inf")) <= due:
                return
            self._due[key] = due
            heapq.heappush(self._heap, (due, key))
            self._cv.notify()

    def remember(self, key: Key) -> None:
        """A job the resync should visit (kopf threads call this while the timer iterates)."""
        with self._cv:
            self.known.add(key)

    def forget(self, key: Key) -> None:
        with self._cv:
            self.known.discard(key)
            self._due.pop(key, None)  # its heap entry is skipped when it comes up
            self._errors.pop(key, None)

    def failed(self, key: Key, first: float | None = None) -> float:
        """Delay before retrying a pass that raised: 5 s (or ``first``), doubling, capped."""
        with self._cv:
            n = self._errors.get(key, 0)
            self._errors[key] = n + 1
        cap = ERROR_RETRY_SECONDS[1]
        return min(cap, (first or ERROR_RETRY_SECONDS[0]) * 2.0 ** min(n, 16))

    def succeeded(self, key: Key) -> None:
        with self._cv:
            self._errors.pop(key, None)

    def _loop(self) -> None:
        next_resync = time.monotonic() + self._resync
        while True:
            with self._cv:
                if self._stopped:
                    return
                now = time.monotonic()
                ready: list[Key] = []
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
                except RuntimeError:  # the pool refuses work: the interpreter is exiting
                    log.info("requeue: pool closed; timer stops")
                    return
                if not ready:
                    self._cv.wait(timeout=max(0.01, wait))

    def _submit(self, key: Key) -> None:
        """Queue a pass (caller holds ``self._cv``). Like client-go's workqueue: a job waits in
        the pool at most once, and a job whose pass is running gets one more pass after it
        rather than a second pool thread blocked on its lock."""
        if self._pool is None or key in self._queued:
            return
        if key in self._running:
            self._rerun.add(key)
            return
        self._queued.add(key)

        def job() -> None:
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
