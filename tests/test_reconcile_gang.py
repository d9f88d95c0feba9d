"""Volcano gangs through reconcile passes against an in-memory client (issue 37): the attempt's
PodGroup is written before its pods, replaced when the gang is relaunched, deleted when the job
finishes; Auto's choice is made once; a cluster without the PodGroup CRD fails the job naming it.
test_gang_cluster.py drives the same through the real operator and API server."""

from __future__ import annotations

import copy

import test_deferred_launch
from moejob_operator import constants as C
from moejob_operator.reconcile import job as J
from moejob_operator.reconcile.client import Rejected
from test_deferred_launch import SETTINGS
from test_reconcile_errors import Client

job = test_deferred_launch.job  # the fixture


class GangClient(Client):
    """Pods and PodGroups in memory; ``podgroup_crd``: whether the cluster has Volcano's CRD."""

    def __init__(self, *, podgroup_crd: bool = True):
        super().__init__()
        self.volcano_installed = podgroup_crd

    def create(self, obj):
        if obj["kind"] == "PodGroup" and not self.volcano_installed:
            raise Rejected(
                "PodGroup",
                obj["metadata"]["name"],
                404,
                "the server could not find the requested resource",
            )
        obj = copy.deepcopy(obj)
        obj["metadata"].setdefault("uid", f"uid-{obj['metadata']['name']}")
        return super().create(obj)

    def get_pod_group(self, namespace, name):
        return copy.deepcopy(self.objects.get(("PodGroup", name)))

    def delete_pod_group(self, namespace, name, *, uid):
        if self.objects.get(("PodGroup", name), {}).get("metadata", {}).get("uid") == uid:
            del self.objects[("PodGroup", name)]
            self.writes.append(f"delete PodGroup/{name}")

    def pods(self):
        return [o for (kind, _), o in sorted(self.objects.items()) if kind == "Pod"]

    def groups(self):
        return {name: o for (kind, name), o in self.objects.items() if kind == "PodGroup"}


def _pass(c, job):
    J.reconcile(c, "ns", "j", settings=SETTINGS, body={**job, "status": c.status or {}})


def _end_pods(c, exit_code: int) -> None:
    phase = "Succeeded" if exit_code == 0 else "Failed"
    for pod in c.pods():
        pod["status"] = {
            "phase": phase,
            "containerStatuses": [
                {"name": "trainer", "state": {"terminated": {"exitCode": exit_code}}}
            ],
        }


def test_volcano_podgroup_comes_before_the_pods_and_is_replaced_per_attempt(job):
    job["spec"]["scheduling"] = {"gang": "Volcano"}
    c = GangClient()
    _pass(c, job)
    first_pod = next(i for i, w in enumerate(c.writes) if w.startswith("Pod/"))
    assert c.writes.index("PodGroup/j-u-1-a0") < first_pod
    pg = c.groups()["j-u-1-a0"]
    assert pg["spec"] == {"minMember": 2}
    assert pg["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert c.status["gangScheduler"] == "Volcano"
    assert [
        (p["metadata"]["annotations"][C.VOLCANO_GROUP_NAME_ANNOTATION], p["spec"]["schedulerName"])
        for p in c.pods()
    ] == [("j-u-1-a0", "volcano")] * 2

    _end_pods(c, 1)  # a retryable failure: the gang is relaunched as attempt 1
    for _ in range(3):
        _pass(c, job)
    assert c.status["attempt"] == 1 and set(c.groups()) == {"j-u-1-a1"}
    assert c.writes.index("delete PodGroup/j-u-1-a0") < c.writes.index("PodGroup/j-u-1-a1")
    assert c.groups()["j-u-1-a1"]["spec"] == {"minMember": 2}
    assert {p["metadata"]["annotations"][C.VOLCANO_GROUP_NAME_ANNOTATION] for p in c.pods()} == {
        "j-u-1-a1"
    }

    job["spec"]["runPolicy"]["suspend"] = True  # suspended: no pods, no PodGroup
    _pass(c, job)
    assert c.pods() == [] and c.groups() == {}
    job["spec"]["runPolicy"]["suspend"] = False  # resumed: the same attempt's PodGroup first
    before = len(c.writes)
    _pass(c, job)
    new = c.writes[before:]
    assert set(c.groups()) == {"j-u-1-a1"} and len(c.pods()) == 2
    assert new.index("PodGroup/j-u-1-a1") < min(
        i for i, w in enumerate(new) if w.startswith("Pod/")
    )

    _end_pods(c, 0)  # the gang finishes: its PodGroup goes
    _pass(c, job)
    assert c.status["phase"] == "Succeeded" and c.groups() == {}


def test_auto_is_chosen_once_from_the_cluster(job):
    c = GangClient(podgroup_crd=True)
    _pass(c, job)
    assert c.status["gangScheduler"] == "Volcano" and set(c.groups()) == {"j-u-1-a0"}

    plain = GangClient(podgroup_crd=False)
    _pass(plain, job)
    assert plain.status["gangScheduler"] == "None" and plain.groups() == {}
    assert all("schedulerName" not in p["spec"] for p in plain.pods())
    plain.volcano_installed = True  # installed later: this job's next attempt stays as it was
    _end_pods(plain, 1)
    for _ in range(3):
        _pass(plain, job)
    assert plain.status["attempt"] == 1 and len(plain.pods()) == 2 and plain.groups() == {}


def test_volcano_without_the_podgroup_crd_fails_the_job_before_any_pod(job):
    job["spec"]["scheduling"] = {"gang": "Volcano"}
    c = GangClient(podgroup_crd=False)
    _pass(c, job)
    assert c.status["phase"] == "Failed" and c.pods() == []
    failed = next(x for x in c.status["conditions"] if x["type"] == C.COND_FAILED)
    assert failed["reason"] == C.R_CHILD_REJECTED
    assert "PodGroup j-u-1-a0" in failed["message"] and "PodGroup CRD" in failed["message"]
