"""How a pass treats errors and status it cannot trust, against an in-memory client (the cluster
tests in test_operator_hostile.py drive the same paths through the real API server):

- a child the API server refuses for good -> Failed / ChildRejected naming the object;
- a transient error -> Reconciled=False / TransientError, retried after the caller's backoff;
- an unexpected exception -> Reconciled=False / ReconcileError + Event, retried with backoff;
- status holds a hash of the launched spec, not a copy; hand-patched fields are re-derived;
- the fault-injection annotations work only in test mode.
"""

from __future__ import annotations

import json
import os

import pytest
from kubernetes.client.rest import ApiException

import test_deferred_launch
from moejob_operator import constants as C
from moejob_operator.reconcile import job as J
from moejob_operator.reconcile.client import Rejected
from moejob_operator.reconcile.settings import Settings
from test_deferred_launch import SETTINGS, MemoryClient

job = test_deferred_launch.job  # the fixture, shared with the deferred-launch tests


class Client(MemoryClient):
    """MemoryClient plus pods, Events and scripted failures."""

    def __init__(self, *, reject_kind=None, fail=None):
        super().__init__()
        self.reject_kind, self.fail = reject_kind, fail
        self.events: list[tuple[str, str, str]] = []

    def create(self, obj):
        if obj["kind"] == self.reject_kind:
            raise Rejected(
                obj["kind"],
                obj["metadata"]["name"],
                403,
                'pods "x" is forbidden: no PriorityClass with name gold was found',
            )
        if self.fail is not None and obj["kind"] == self.fail[0]:
            raise self.fail[1]
        return super().create(obj)

    def list_pods(self, namespace, selector):
        return [
            dict(o, status=o.get("status") or {"phase": "Pending"})
            for (kind, _), o in self.objects.items()
            if kind == "Pod"
            and all(o["metadata"]["labels"].get(k) == v for k, v in selector.items())
        ]

    def delete_pod(self, namespace, name, *, uid=None, grace_seconds=None):
        self.objects.pop(("Pod", name), None)
        self.writes.append(f"delete Pod/{name}")

    def get_job(self, namespace, name):
        return self.body

    def event(self, job, etype, reason, message):
        self.events.append((etype, reason, message))


def cond(c, ctype):
    return next((x for x in c.status.get("conditions", ()) if x["type"] == ctype), {})


def with_status(body, status):
    return {**body, "status": status}


def test_a_refused_child_fails_the_job_naming_it(job):
    c = Client(reject_kind="Pod")
    assert J.reconcile(c, "ns", "j", settings=SETTINGS, body=job, backoff=lambda: 99.0) is None
    failed = cond(c, C.COND_FAILED)
    assert failed["status"] == "True" and failed["reason"] == C.R_CHILD_REJECTED
    assert (
        "Pod j-worker-" in failed["message"]
        and "no PriorityClass with name gold" in failed["message"]
    )
    assert not any(w.startswith("Service/") for w in c.writes)  # no trainer children after it
    assert c.status["phase"] == "Failed"


def test_a_transient_error_is_visible_and_retried_with_backoff(job):
    c = Client(fail=("ServiceAccount", ApiException(status=503, reason="Service Unavailable")))
    delays = iter([4.0, 8.0])
    assert (
        J.reconcile(c, "ns", "j", settings=SETTINGS, body=job, backoff=lambda: next(delays)) == 4.0
    )
    rec = cond(c, C.COND_RECONCILED)
    assert rec["status"] == "False" and rec["reason"] == C.R_TRANSIENT_ERROR
    assert "503" in rec["message"] and "retrying in 4 s" in rec["message"]
    assert ("Warning", C.R_TRANSIENT_ERROR) in {(e[0], e[1]) for e in c.events}
    assert cond(c, C.COND_FAILED).get("status") != "True"
    # the server recovers: the next pass launches and says so
    c.fail = None
    J.reconcile(
        c,
        "ns",
        "j",
        settings=SETTINGS,
        body=with_status(job, c.status),
        backoff=lambda: next(delays),
    )
    assert cond(c, C.COND_RECONCILED)["status"] == "True"
    assert "Pod/j-worker-0" in c.writes


def test_a_timeout_of_the_client_is_transient(job):
    import urllib3

    c = Client(
        fail=("ServiceAccount", urllib3.exceptions.ReadTimeoutError(None, "/api", "read timed out"))
    )
    assert J.reconcile(c, "ns", "j", settings=SETTINGS, body=job, backoff=lambda: 2.0) == 2.0
    assert cond(c, C.COND_RECONCILED)["reason"] == C.R_TRANSIENT_ERROR


def test_an_unexpected_exception_is_reported_and_retried(job):
    c = Client()
    c.list_nodes = lambda: (_ for _ in ()).throw(KeyError("metadata"))
    assert J.reconcile(c, "ns", "j", settings=SETTINGS, body=job, backoff=lambda: 5.0) == 5.0
    rec = cond(c, C.COND_RECONCILED)
    assert rec["reason"] == C.R_RECONCILE_ERROR and "KeyError" in rec["message"]
    assert any(e[1] == C.R_RECONCILE_ERROR for e in c.events)
    with pytest.raises(KeyError):  # without a backoff the caller handles it
        J.reconcile(c, "ns", "j", settings=SETTINGS, body=job)


def test_status_keeps_a_hash_of_the_launched_spec_not_a_copy(job):
    c = Client()
    job["spec"]["scheduling"] = {"podAnnotations": {"note": "x" * 60_000}}
    J.reconcile(c, "ns", "j", settings=SETTINGS, body=job)
    assert c.status["launchedSpecHash"] and "launchedSpec" not in c.status
    assert len(json.dumps(c.status)) < 8000
    plan_cm = c.objects[("ConfigMap", "j-plan")]
    assert json.loads(plan_cm["data"][C.LAUNCHED_SPEC_KEY])["scheduling"]["podAnnotations"]["note"]


def test_an_immutable_edit_after_launch_keeps_the_launched_values(job):
    c = Client()
    J.reconcile(c, "ns", "j", settings=SETTINGS, body=job)
    edited = with_status(job, c.status)
    edited["spec"] = {
        **job["spec"],
        "image": "moe-trainer:other",
        "runPolicy": {**job["spec"].get("runPolicy", {}), "backoffLimit": 7},
    }
    spec = J._accept_spec(J.Pass(c, edited, J.dt.datetime.now(J.dt.timezone.utc), SETTINGS))
    assert spec.image == job["spec"]["image"] and spec.run_policy.backoff_limit == 7
    # an object written by an operator before the hash (status.launchedSpec copy) still works
    legacy = dict(c.status)
    view = json.loads(c.objects[("ConfigMap", "j-plan")]["data"][C.LAUNCHED_SPEC_KEY])
    legacy.pop("launchedSpecHash"), legacy.pop("launchedFields")
    legacy["launchedSpec"] = view
    p = J.Pass(c, with_status(edited, legacy), J.dt.datetime.now(J.dt.timezone.utc), SETTINGS)
    assert J._accept_spec(p).image == job["spec"]["image"]
    assert cond(p, C.COND_SPEC_ACCEPTED)["reason"] == C.R_IMMUTABLE_FIELD_CHANGED
    assert "image" in cond(p, C.COND_SPEC_ACCEPTED)["message"]


@pytest.mark.parametrize(
    "patch",
    [
        {"attempt": "x"},
        {"launchedSpec": "garbage"},
        {"restarts": -3, "failedRestarts": [1]},
        {"launchedFields": 5},
        {"startTime": "yesterday"},
        {"startTime": 5},
        {"conditions": ["x", 5, {"type": 1}]},
        {"conditions": "Running"},
        {"health": "x"},
        {"health": [3, {"type": "DeadExpert"}]},
        {"plan": 7},
        {"progress": []},
    ],
)
def test_hand_patched_status_fields_are_rederived(job, patch):
    c = Client()
    J.reconcile(c, "ns", "j", settings=SETTINGS, body=job)
    J.reconcile(
        c,
        "ns",
        "j",
        settings=SETTINGS,
        body=with_status(job, {**c.status, **patch}),
        backoff=lambda: 1.0,
    )
    assert cond(c, C.COND_RECONCILED).get("status") != "False", c.status
    assert isinstance(c.status["attempt"], int) and cond(c, C.COND_FAILED).get("status") != "True"


def test_a_hand_patched_succeeded_is_undone_while_workers_run(job):
    c = Client()
    J.reconcile(c, "ns", "j", settings=SETTINGS, body=job)
    lie = dict(
        c.status,
        completionTime="2026-01-01T00:00:00Z",
        conditions=[
            *[x for x in c.status["conditions"] if x["type"] != C.COND_SUCCEEDED],
            {"type": C.COND_SUCCEEDED, "status": "True", "reason": "Patched", "message": "by hand"},
        ],
    )
    J.reconcile(c, "ns", "j", settings=SETTINGS, body=with_status(job, lie))
    succeeded = cond(c, C.COND_SUCCEEDED)
    assert succeeded["status"] == "False" and succeeded["reason"] == C.R_STATUS_CORRECTED
    assert "completionTime" not in c.status and c.status["phase"] != "Succeeded"


def test_fault_annotations_only_in_test_mode(job):
    job["metadata"]["annotations"] = {f"{C.GROUP}/fault-exit-at-step": "3"}
    for mode, expected in (("", set()), ("1", {"MOE_FAULT_EXIT_AT_STEP"})):
        settings = Settings.from_env(
            {**os.environ, "MOE_GATE_ENABLED": "false", "MOE_OPERATOR_TEST_MODE": mode}
        )
        c = Client()
        J.reconcile(c, "ns", "j", settings=settings, body=job)
        env = {e["name"] for e in c.objects[("Pod", "j-worker-0")]["spec"]["containers"][0]["env"]}
        assert env & {"MOE_FAULT_EXIT_AT_STEP"} == expected


def test_cpu_mode_checks_memory_against_the_nodes(job):
    """CPU mode had no memory limit to check against ("fits" at any size): the nodes' allocatable
    memory (512 GiB on the in-memory nodes) or the container's limit is it now."""
    job["spec"]["model"] = {"preset": "deepseek-v3"}
    job["spec"].pop("placement", None)
    c = Client()
    J.reconcile(c, "ns", "j", settings=SETTINGS, body=job)
    failed = cond(c, C.COND_FAILED)
    assert failed["reason"] == C.R_INSUFFICIENT_MEMORY and "GiB per process" in failed["message"], (
        failed
    )
    tiny = Client()
    job["spec"]["model"] = {"preset": "tiny-mixtral"}
    job["spec"]["resources"] = {"limits": {"memory": "64Mi"}}
    J.reconcile(tiny, "ns", "j", settings=SETTINGS, body=job)
    assert cond(tiny, C.COND_FAILED)["reason"] == C.R_INSUFFICIENT_MEMORY


@pytest.mark.parametrize(
    ("nodes", "sched"),
    [
        ({"count": 3}, {}),  # more than the cluster has
        (
            {"count": 2, "nodeNames": ["node-a", "node-b"]},
            {"nodeSelector": {"pool": "x"}},
        ),  # contradiction
    ],
)
def test_too_few_matching_nodes_is_insufficient_nodes_not_discovery(job, nodes, sched):
    job["spec"]["nodes"] = {**job["spec"]["nodes"], **nodes}
    job["spec"]["training"]["globalBatch"] = 6 if nodes["count"] == 3 else 4
    job["spec"].pop("placement", None)
    job["spec"]["scheduling"] = sched
    c = Client()
    J.reconcile(c, "ns", "j", settings=SETTINGS, body=job)
    assert cond(c, C.COND_PLANNED)["reason"] == C.R_NO_CANDIDATE_NODES
    assert cond(c, C.COND_TOPOLOGY)["reason"] == C.R_NO_CANDIDATE_NODES
    assert c.status["phase"] == "Discovering" and not [w for w in c.writes if w.startswith("Pod/")]


def test_an_invalid_edit_after_launch_keeps_the_gang_tracked(job):
    """SpecAccepted=False names the field, and the pass still tracks the workers with the
    launched values (a worker finishing is still seen)."""
    c = Client()
    J.reconcile(c, "ns", "j", settings=SETTINGS, body=job)
    edited = with_status(job, c.status)
    edited["spec"] = {**job["spec"], "image": "not an image", "runPolicy": {"backoffLimit": 1}}
    for rank in (0, 1):
        c.objects[("Pod", f"j-worker-{rank}")]["status"] = {
            "phase": "Succeeded",
            "containerStatuses": [{"state": {"terminated": {"exitCode": 0}}}],
        }
    J.reconcile(c, "ns", "j", settings=SETTINGS, body=edited)
    accepted = cond(c, C.COND_SPEC_ACCEPTED)
    assert accepted["status"] == "False" and accepted["message"].startswith("spec.image:")
    assert cond(c, C.COND_SUCCEEDED)["status"] == "True", c.status
