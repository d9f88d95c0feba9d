"""The controller's work queue (no kopf state on the job): delayed passes, one pending entry per
job (the earliest wins), no second pass queued while one waits, the resync of known jobs, and
error backoff."""

from __future__ import annotations

import threading
import time

import pytest

from moejob_operator.workqueue import ERROR_RETRY_SECONDS, Requeue


class Recorder:
    """Records each pass (seconds since it was made, key); ``hold``: an Event every pass waits
    for."""

    def __init__(self, hold: threading.Event | None = None):
        self.calls: list[tuple[float, tuple[str, str]]] = []
        self.hold = hold
        self.lock = threading.Lock()
        self.t0 = time.monotonic()

    def __call__(self, ns: str, name: str) -> None:
        with self.lock:
            self.calls.append((time.monotonic() - self.t0, (ns, name)))
        if self.hold is not None:
            self.hold.wait(60)

    def keys(self):
        with self.lock:
            return [k for _, k in self.calls]


@pytest.fixture
def rq():
    made = []

    def make(run, **kw):
        r = Requeue(run, **kw)
        r.start()
        made.append(r)
        return r

    yield make
    for r in made:
        r.stop()


def wait(cond, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not cond():
        time.sleep(0.01)
    return cond()


def test_delay_is_honoured_and_earliest_entry_wins(rq):
    rec = Recorder()
    r = rq(rec, threads=1, resync_seconds=3600)
    t_a = time.monotonic() - rec.t0
    r.after(("ns", "a"), 0.3)
    r.after(("ns", "a"), 5.0)  # later: ignored, the 0.3 s entry stays
    r.after(("ns", "b"), 0.0)
    assert wait(lambda: len(rec.calls) == 2)
    (_tb, kb), (ta, ka) = rec.calls
    assert (kb, ka) == (("ns", "b"), ("ns", "a"))
    assert ta >= t_a + 0.3  # not before its delay (how much later depends on the load)
    time.sleep(0.3)
    assert len(rec.calls) == 2  # nothing left over from the superseded 5 s entry... yet
    r.after(("ns", "a"), 0.0)
    assert wait(lambda: len(rec.calls) == 3)


def test_one_waiting_pass_per_job(rq):
    """While a pass of job a runs (held until released), many requests queue exactly one more."""
    release = threading.Event()
    rec = Recorder(hold=release)
    r = rq(rec, threads=4, resync_seconds=3600)
    r.after(("ns", "a"), 0.0)
    assert wait(lambda: len(rec.calls) == 1)
    for _ in range(20):
        r.after(("ns", "a"), 0.0)

    def all_taken():  # the timer has handed every request on
        with r._cv:
            return not r._due and ("ns", "a") in r._rerun

    assert wait(all_taken)
    release.set()
    assert wait(lambda: len(rec.calls) == 2)
    time.sleep(0.5)
    assert rec.keys() == [("ns", "a"), ("ns", "a")]


def test_resync_runs_every_known_job_and_forget_stops_it(rq):
    rec = Recorder()
    r = rq(rec, resync_seconds=0.2)
    r.remember(("ns", "a"))
    r.remember(("ns", "b"))
    assert wait(lambda: {("ns", "a"), ("ns", "b")} <= set(rec.keys()))
    r.forget(("ns", "a"))
    n = len(rec.calls)
    assert wait(lambda: len(rec.calls) >= n + 2)
    assert ("ns", "a") not in rec.keys()[n + 1 :]


def test_error_backoff_doubles_and_resets():
    r = Requeue(lambda *a: None)
    key = ("ns", "a")
    first, cap = ERROR_RETRY_SECONDS
    got = [r.failed(key) for _ in range(8)]
    assert got[:3] == [first, 2 * first, 4 * first] and got[-1] == cap
    r.succeeded(key)
    assert r.failed(key) == first


def test_stopped_requeue_runs_nothing():
    rec = Recorder()
    r = Requeue(rec, resync_seconds=0.05)
    r.start()
    r.stop()
    r.after(("ns", "a"), 0.0)
    r.remember(("ns", "b"))
    time.sleep(0.3)
    assert rec.calls == []


def test_jobs_remembered_while_the_resync_iterates(rq):
    """kopf threads add jobs while the timer walks the set: the timer must survive (it once
    iterated the live set: 'Set changed size during iteration' would have ended all requeues)."""
    import sys

    rec = Recorder()
    r = rq(rec, threads=2, resync_seconds=0.005)
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, so adds land inside the iteration

    def add(base):
        for i in range(5000):
            r.remember(("ns", f"{base}-{i}"))

    threads = [threading.Thread(target=add, args=(b,)) for b in ("a", "b", "c")]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old_interval)
    r.after(("ns", "late"), 0.0)
    assert wait(lambda: ("ns", "late") in rec.keys())  # noqa: SIM118 - Recorder is no mapping
