"""Work that yields to reconcile passes.

In a burst of new jobs the API server is the bottleneck, and what a person waits for is each
job's worker pods. Writes that nothing on that path needs (Events; a launching pass's
trainer-only children and its status write, see ``reconcile.job``) wait in a
:class:`YieldingQueue` until no pass has started for ``quiet`` seconds, but never longer than
``max_delay`` seconds after they were queued, so a long burst cannot starve them. Kubernetes'
own controllers rate-limit their Events for the same reason.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger("moejob_operator")
Item = TypeVar("Item")


class PassClock:
    """When the latest reconcile pass started (monotonic seconds)."""

    def __init__(self) -> None:
        self.last = 0.0

    def started(self) -> None:
        self.last = time.monotonic()


class YieldingQueue(Generic[Item]):
    """Items handed to ``run`` by ``threads`` daemon threads, oldest first, each once no pass has
    started (``clock``) for ``quiet`` seconds or ``max_delay`` seconds after it was queued. With
    one thread the items run in order. ``run`` raising is logged; the item is dropped (callers
    that must not lose work retry on their own)."""

    def __init__(
        self,
        name: str,
        run: Callable[[Item], None],
        clock: PassClock,
        *,
        quiet: float,
        max_delay: float,
        threads: int = 1,
        maxsize: int = 10000,
    ):
        self.name, self._run, self._clock = name, run, clock
        self.quiet, self.max_delay = quiet, max_delay
        self._threads = threads
        self._q: queue.Queue[tuple[float, Item]] = queue.Queue(maxsize)
        self._started = False
        self._lock = threading.Lock()

    def put(self, item: Item) -> bool:
        """Queue ``item``; False when the queue is full (the item is not queued)."""
        with self._lock:
            if not self._started:
                self._started = True
                for i in range(self._threads):
                    threading.Thread(
                        target=self._worker, name=f"{self.name}-{i}", daemon=True
                    ).start()
        try:
            self._q.put_nowait((time.monotonic(), item))
            return True
        except queue.Full:
            return False

    def drain(self, timeout: float = 10.0) -> bool:
        """Wait until every queued item has run; False on timeout."""
        deadline = time.monotonic() + timeout
        while self._q.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._q.unfinished_tasks

    def _worker(self) -> None:
        while True:
            queued, item = self._q.get()
            try:
                while True:
                    wait = (
                        min(self._clock.last + self.quiet, queued + self.max_delay)
                        - time.monotonic()
                    )
                    if wait <= 0:
                        break
                    time.sleep(min(wait, 0.05))
                self._run(item)
            except Exception:  # one item must not stop the queue
                log.exception("%s: deferred work failed", self.name)
            finally:
                self._q.task_done()
