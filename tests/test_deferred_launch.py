"""A launching pass ends at the worker pods; the trainer-only children and the status write follow
later (``reconcile(defer=...)``), from a queue that yields to passes (``reconcile.deferred``), or
first thing in the job's next pass; and the client's throttled token refresh. No cluster: an
in-memory client records the writes."""

from __future__ import annotations

import copy
import json
import os
import threading
import time
from pathlib import Path

import pytest
import yaml
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from moe_contracts.topology import report_to_json
from moe_localkube.nodes import NodeSpec, node_manifest, node_status
from moejob_operator import constants as C
from moejob_operator import metrics
from moejob_operator.controller import Controller, ControllerConfig
from moejob_operator.core.topology import load_topology
from moejob_operator.reconcile import job as J
from moejob_operator.reconcile.client import ChildConflict, Client, controller_uid
from moejob_operator.reconcile.deferred import PassClock, YieldingQueue
from moejob_operator.reconcile.settings import Settings
from moejob_operator.status import now_iso

ROOT = Path(__file__).resolve().parents[1]


def wait(cond, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not cond():
        time.sleep(0.005)
    return cond()


# ---- YieldingQueue -----------------------------------------------------------------------------
class FakeTime:
    """Virtual time for ``reconcile.deferred``: it moves only when the test calls ``advance``, so
    what the tests assert does not depend on how fast a loaded machine schedules threads. The
    queue's worker sleeps for real (briefly) and counts its polls, so a test can wait until the
    worker has seen the current time."""

    def __init__(self):
        self.now, self.polls = 100.0, 0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.polls += 1
        time.sleep(0.001)

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def settle(self, done=lambda: False) -> None:
        """Wait until the worker has polled twice at the current time (or ``done``)."""
        n = self.polls
        assert wait(lambda: self.polls >= n + 2 or done(), 60.0), (
            "the queue's worker stopped polling"
        )


@pytest.fixture
def fake_time(monkeypatch):
    from moejob_operator.reconcile import deferred

    ft = FakeTime()
    monkeypatch.setattr(deferred, "time", ft)
    return ft


def test_items_wait_while_passes_keep_starting_and_run_once_quiet(fake_time):
    clock, ran = PassClock(), []
    q = YieldingQueue(
        "t-quiet", lambda item: ran.append((item, fake_time.now)), clock, quiet=0.1, max_delay=10.0
    )
    t0 = fake_time.now
    clock.started()
    q.put("a")
    for _ in range(25):  # a pass every 0.02 s for 0.5 s
        fake_time.advance(0.02)
        clock.started()
        fake_time.settle(lambda: ran)
        assert not ran, "ran while passes kept starting"
    fake_time.advance(0.09)  # quiet for less than 0.1 s: still waits
    fake_time.settle(lambda: ran)
    assert not ran
    fake_time.advance(0.02)
    assert wait(lambda: ran, 60.0)
    assert ran == [("a", pytest.approx(t0 + 0.61))]


def test_max_delay_bounds_the_wait_in_an_endless_burst(fake_time):
    clock, ran = PassClock(), []
    q = YieldingQueue(
        "t-max", lambda item: ran.append(fake_time.now), clock, quiet=0.1, max_delay=0.3
    )
    t0 = fake_time.now
    q.put("a")
    for _ in range(14):  # passes keep starting: 0.28 s
        fake_time.advance(0.02)
        clock.started()
        fake_time.settle(lambda: ran)
        assert not ran
    fake_time.advance(0.03)  # 0.31 s after it was queued, a pass 0.03 s ago
    clock.started()
    assert wait(lambda: ran, 60.0)
    assert ran == [pytest.approx(t0 + 0.31)]


def test_one_thread_keeps_order_a_failing_item_does_not_stop_the_rest_and_drain_waits():
    clock, ran = PassClock(), []

    def run(item):
        if item == 2:
            raise RuntimeError("boom")
        ran.append(item)

    q = YieldingQueue("t-order", run, clock, quiet=0.0, max_delay=1.0)
    for i in range(6):
        assert q.put(i)
    assert q.drain(60.0)
    assert ran == [0, 1, 3, 4, 5]


def test_a_full_queue_refuses():
    clock, release = PassClock(), threading.Event()
    q = YieldingQueue(
        "t-full", lambda item: release.wait(60), clock, quiet=0.0, max_delay=0.0, maxsize=1
    )
    assert q.put(1)
    assert wait(lambda: q._q.qsize() == 0)  # the thread holds item 1
    assert q.put(2)
    assert not q.put(3)
    release.set()
    assert q.drain(60.0)


# ---- reconcile(defer=...) against an in-memory client --------------------------------------------
class MemoryClient(Client):
    """The API calls of a new job's passes, in memory. ``fail_kind``: creating that kind raises
    500."""

    def __init__(self, fail_kind: str | None = None):
        super().__init__(k8s.ApiClient())  # never used to send: every call below is overridden
        self.objects: dict[tuple[str, str], dict] = {}
        self.writes: list[str] = []
        self.status: dict | None = None
        self.fail_kind = fail_kind
        self.volcano_installed = False  # Volcano's PodGroup API served (gang: Auto)
        for n in ("node-a", "node-b"):
            doc = report_to_json(load_topology("nvswitch-h100-8"))
            doc.update(node=n, collectedAt=now_iso())
            name = f"{C.TOPOLOGY_CONFIGMAP_PREFIX}{n}"
            self.objects[("ConfigMap", name)] = {
                "metadata": {"name": name, "uid": n, "resourceVersion": "1"},
                "data": {C.TOPOLOGY_KEY: json.dumps(doc)},
            }

    def list_nodes(self):
        return [
            {**node_manifest(NodeSpec(n)), "status": node_status(NodeSpec(n))}
            for n in ("node-a", "node-b")
        ]

    def get_configmap(self, namespace, name):
        return copy.deepcopy(self.objects.get(("ConfigMap", name)))

    def serves(self, group, version, plural):
        return self.volcano_installed and (group, version, plural) == (
            C.VOLCANO_GROUP,
            C.VOLCANO_VERSION,
            C.VOLCANO_PODGROUPS,
        )

    def create(self, obj):
        kind, name = obj["kind"], obj["metadata"]["name"]
        if kind == self.fail_kind:
            raise ApiException(status=500, reason="Internal Server Error")
        if (kind, name) in self.objects:
            return False
        self.objects[(kind, name)] = copy.deepcopy(obj)
        self.writes.append(f"{kind}/{name}")
        return True

    def create_all(self, objs, *, claim=()):
        for o in claim:  # reads, as the real client's claim: a name held by another is a conflict
            have = self.objects.get((o["kind"], o["metadata"]["name"]))
            if have is not None and controller_uid(have) != controller_uid(o):
                raise ChildConflict(o["kind"], o["metadata"]["name"], controller_uid(have))
        out, err = [], None
        for o in objs:
            try:
                out.append(self.create(o))
            except ApiException as exc:
                err = err or exc
        if err:
            raise err
        return out

    def patch_job_status(self, namespace, name, status):
        self.writes.append("status")
        self.status = {k: v for k, v in {**(self.status or {}), **status}.items() if v is not None}

    def event(self, job, etype, reason, message):
        pass


# The passes' settings as ``moectl operator`` reads them at start-up from its environment
# (conftest's: host paths under the temp directory, test hooks on), with the gate off.
SETTINGS = Settings.from_env({**os.environ, "MOE_GATE_ENABLED": "false"})


@pytest.fixture
def job():
    body = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
    body["metadata"] = {"name": "j", "namespace": "ns", "uid": "u-1", "generation": 1}
    return body


TRAINER_ONLY = {
    "Service/j-workers",
    "ConfigMap/j-progress",
    "ConfigMap/j-routing-stats",
    "Role/j-worker",
    "RoleBinding/j-worker",
}


def test_the_pass_stops_at_the_pods_and_the_deferred_rest_writes_status_last(job):
    c = MemoryClient()
    deferred = []
    J.reconcile(c, "ns", "j", settings=SETTINGS, body=job, defer=deferred.append)
    assert c.writes == [
        "ConfigMap/j-plan",
        "ServiceAccount/j-worker",
        "Pod/j-worker-0",
        "Pod/j-worker-1",
    ]
    assert c.status is None and len(deferred) == 1
    deferred[0]()
    assert set(c.writes[4:-1]) == TRAINER_ONLY and c.writes[-1] == "status"
    assert c.status["launchedSpecHash"] and c.status["gangComplete"] == 0
    # the operator's metrics see the status as written (phase is set by the write)
    assert metrics.JOBS._jobs[("ns", "j")].phase == c.status["phase"] == "Launching"


def test_without_defer_the_same_pass_does_it_all(job):
    c = MemoryClient()
    J.reconcile(c, "ns", "j", settings=SETTINGS, body=job)
    assert set(c.writes[4:-1]) == TRAINER_ONLY and c.writes[-1] == "status"


def test_a_failed_trainer_child_leaves_the_launch_unrecorded_and_the_next_pass_completes_it(job):
    c = MemoryClient(fail_kind="Role")
    deferred = []
    J.reconcile(c, "ns", "j", settings=SETTINGS, body=job, defer=deferred.append)
    with pytest.raises(ApiException):
        deferred[0]()
    assert c.writes[-1] == "status" and "launchedSpecHash" not in c.status  # launches again
    c.fail_kind = None
    again = {**job, "status": c.status}
    J.reconcile(c, "ns", "j", settings=SETTINGS, body=again, defer=deferred.append)
    deferred[1]()
    assert "Role/j-worker" in c.writes and c.status["launchedSpecHash"]
    assert sorted(w for w in c.writes if w.startswith("Pod/")) == [
        "Pod/j-worker-0",
        "Pod/j-worker-1",
    ]


# ---- the controller: one pending remainder per job, run before its next pass
# --------------------------
def test_a_pending_remainder_runs_before_the_jobs_next_pass_and_only_once():
    order = []

    def fake_reconcile(client, namespace, name, *, settings, body=None, defer=None, **_):
        order.append(f"pass {name}")
        defer(lambda: order.append(f"rest {name}"))
        return

    # the finisher waits 30 s for quiet: the next pass runs the remainder
    ctl = Controller(
        ControllerConfig(finish_quiet_seconds=30.0), client=MemoryClient(), reconcile=fake_reconcile
    )
    ctl.run_pass("ns", "a")
    ctl.run_pass("ns", "a")  # within the quiet time: the first pass's rest comes first
    assert order == ["pass a", "rest a", "pass a"]
    assert ctl.drain_deferred(60.0)
    assert order == ["pass a", "rest a", "pass a", "rest a"]
    assert ctl.lock_count() == 0  # no pass holds or waits for a lock: none is kept


def test_a_failed_remainder_is_retried_as_a_pass(monkeypatch):
    retried = []

    def fake_reconcile(client, namespace, name, *, settings, body=None, defer=None, **_):
        def rest():
            raise ApiException(status=403, reason="Forbidden")

        defer(rest)
        return

    ctl = Controller(client=MemoryClient(), reconcile=fake_reconcile)
    monkeypatch.setattr(ctl.requeue, "after", lambda key, delay: retried.append((key, delay)))
    ctl.run_pass("ns", "b")
    assert ctl.drain_deferred(60.0)
    assert retried and retried[0][0] == ("ns", "b") and retried[0][1] >= 0.5


def test_a_deleted_jobs_state_goes_with_it():
    """Locks, pending remainder, pod cache, queue entry and error count of a deleted job are
    dropped: a long-running operator does not grow with every job it ever saw."""

    def fake_reconcile(client, namespace, name, *, settings, body=None, defer=None, **_):
        defer(lambda: None)
        return 600.0

    ctl = Controller(
        ControllerConfig(finish_quiet_seconds=30.0), client=MemoryClient(), reconcile=fake_reconcile
    )
    pod = {
        "metadata": {"uid": "u1", "namespace": "ns", "labels": {C.LABEL_JOB: "c"}},
        "status": {"phase": "Running"},
    }
    ctl.job_seen("ns", "c")
    ctl.on_child_pod("MODIFIED", pod)
    assert ctl.requeue.known == {("ns", "c")} and ctl._pending and ctl._pod_seen
    ctl.job_deleted("ns", "c")
    assert not ctl.requeue.known and not ctl._pending and not ctl._pod_seen
    assert ctl.lock_count() == 0


def test_child_pod_events_queue_a_pass_only_when_the_pod_changed():
    ctl = Controller(client=MemoryClient(), reconcile=lambda *a, **k: None)
    queued = []
    ctl.requeue.after = lambda key, delay: queued.append(key)
    pod = {
        "metadata": {"uid": "u1", "namespace": "ns", "labels": {C.LABEL_JOB: "j"}},
        "status": {"phase": "Pending"},
    }
    ctl.on_child_pod("ADDED", pod)  # the operator's own create
    ctl.on_child_pod("MODIFIED", pod)  # nothing a pass looks at changed
    assert queued == []
    running = {**pod, "status": {"phase": "Running"}}
    ctl.on_child_pod("MODIFIED", running)
    ctl.on_child_pod("MODIFIED", running)
    assert queued == [("ns", "j")]
    ctl.on_child_pod("DELETED", running)
    assert queued == [("ns", "j")] * 2 and not ctl._pod_seen
    ctl.on_child_pod("MODIFIED", {"metadata": {"uid": "u2", "namespace": "ns", "labels": {}}})
    assert len(queued) == 2  # not one of a job's pods


# ---- the client's token refresh ------------------------------------------------------------------
def test_token_refresh_hook_runs_at_most_every_few_seconds(monkeypatch):
    from moejob_operator.reconcile import client as client_mod

    now = [100.0]
    monkeypatch.setattr(
        client_mod, "time", type("T", (), {"monotonic": staticmethod(lambda: now[0])})
    )
    calls = []
    refresh = client_mod._at_most_every(calls.append, 0.3)
    for _ in range(50):
        refresh("cfg")
        now[0] += 0.005
    assert calls == ["cfg"]  # 0.25 s of calls: one refresh
    now[0] += 0.06
    refresh("cfg")
    assert len(calls) == 2


class ReadCountingClient(MemoryClient):
    """MemoryClient that records every read a pass makes; reads a new job's pass must not need
    (the job, its pods, its plan ConfigMap) are recorded and answered as absent."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def list_nodes(self):
        self.reads.append("list nodes")
        return super().list_nodes()

    def get_configmap(self, namespace, name):
        self.reads.append(f"get ConfigMap/{name}")
        return super().get_configmap(namespace, name)

    def get_job(self, namespace, name):
        self.reads.append(f"get job/{name}")  # answered as absent (None)

    def list_pods(self, namespace, selector):
        self.reads.append(f"list pods {sorted(selector.items())}")
        return []

    def list_owned_pods(self, namespace, selector, uid):
        self.reads.append(f"list pods {sorted(selector.items())}")
        return [], []


def test_a_new_jobs_launch_makes_only_the_requests_the_floor_makes_plus_planning_reads(job):
    """The requests of a new job's launch (docs/operator.md, "Requests per job"): the writes are
    the children the worker gang needs and the status, once each, in the operator's batches (the
    floor of benchmarks/operator_floor.py replays exactly these); the only reads are the planning
    inputs, nodes and the cached topology reports (the client caches both: one GET per report and
    one node LIST per 2 s for a whole burst). No GET of the job (the watch event's body is used),
    no listing of its pods, no read of its plan ConfigMap: each was once on this path."""
    c = ReadCountingClient()
    J.reconcile(c, "ns", "j", settings=SETTINGS, body=job)
    assert c.writes[:4] == [
        "ConfigMap/j-plan",
        "ServiceAccount/j-worker",
        "Pod/j-worker-0",
        "Pod/j-worker-1",
    ]
    assert set(c.writes[4:-1]) == TRAINER_ONLY and c.writes[-1] == "status"
    assert len(c.writes) == 10
    topology = {f"get ConfigMap/{C.TOPOLOGY_CONFIGMAP_PREFIX}{n}" for n in ("node-a", "node-b")}
    assert {r for r in c.reads if r != "list nodes"} == topology, c.reads
    assert sorted(r for r in c.reads if r in topology) == sorted(topology)  # each report once
