"""Hostile and broken input against the real API server and an operator started with the
production defaults (no host path allowed, test hooks off), one test per class:

- host filesystem: a hostPath is refused with InvalidSpec naming the field;
- a child the API server refuses (a PriorityClass that does not exist: 403 on every worker pod)
  ends Failed / ChildRejected naming the pod and the server's message, not an endless retry;
- a 403 the cluster may lift (an exceeded ResourceQuota) is retried with backoff, visible as
  Reconciled=False / TransientError, and the job launches once the quota allows it;
- bounded status: a 60 KB spec leaves a hash in status, not a copy;
- status not trusted: a hand-patched ``Succeeded`` while the workers run is undone, a
  hand-patched ``attempt: "x"`` re-derived;
- test hooks off: the fault-injection annotations reach no pod.

Worker pods name a scheduler that does not exist, so they stay Pending (created, inspectable,
never running a trainer)."""

from __future__ import annotations

import json

import pytest

from moejob_operator import constants as C
from operator_harness import (
    Operator,
    apply_job,
    condition,
    events_for,
    get_job,
    install_crd,
    seed_topology,
)

pytestmark = pytest.mark.cluster

BASE = {
    "image": "moe-trainer:local",
    "device": "CPU",
    "model": {"preset": "tiny-mixtral"},
    "nodes": {"count": 2},
    "training": {"steps": 5, "seqLen": 32, "globalBatch": 4, "microBatch": 2},
    "gate": {"skip": True, "skipReason": "test"},
}
NO_SCHEDULER = {"schedulerName": "none-such"}


def manifest(name: str, **spec) -> dict:
    return {
        "apiVersion": C.API_VERSION,
        "kind": C.KIND,
        "metadata": {"name": name},
        "spec": {**BASE, **spec},
    }


@pytest.fixture(scope="module")
def production_operator(control_plane, kube, node_agent, tmp_path_factory):
    install_crd(kube)
    op = (
        Operator(control_plane, tmp_path_factory.mktemp("operator-hostile"))
        .start(MOE_ALLOWED_HOST_PATH_PREFIXES="", MOE_OPERATOR_TEST_MODE="")
        .wait_ready()
    )
    yield op
    op.stop()


def failed_with(kube, namespace, name, wait_for, reason, timeout=60):
    def done():
        c = condition(get_job(kube, namespace, name), C.COND_FAILED)
        return c if c.get("status") == "True" else None

    c = wait_for(done, timeout=timeout, message=f"{name} Failed")
    assert c["reason"] == reason, c
    return c


def test_host_path_refused_by_default(kube, namespace, production_operator, wait_for, tmp_path):
    seed_topology(kube, namespace)
    apply_job(
        kube,
        namespace,
        manifest("hostpath", checkpoint={"volume": {"hostPath": {"path": str(tmp_path)}}}),
    )
    c = failed_with(kube, namespace, "hostpath", wait_for, C.R_INVALID_SPEC)
    assert c["message"].startswith("spec.checkpoint.volume.hostPath.path:")
    assert "hostPathPolicy.allowedPrefixes" in c["message"]
    assert not kube.core.list_namespaced_pod(namespace).items


def test_a_refused_child_ends_the_job_naming_it(kube, namespace, production_operator, wait_for):
    seed_topology(kube, namespace)
    apply_job(kube, namespace, manifest("nopc", scheduling={"priorityClassName": "does-not-exist"}))
    c = failed_with(kube, namespace, "nopc", wait_for, C.R_CHILD_REJECTED)
    assert "Pod nopc-worker-" in c["message"] and "does-not-exist" in c["message"], c
    assert "403" in c["message"]
    wait_for(
        lambda: [e for e in events_for(kube, namespace, "nopc") if e.reason == C.R_CHILD_REJECTED],
        timeout=15,
        message="ChildRejected Event",
    )
    # terminal: no more passes retry the create (the log has one refusal, not a loop)
    job = get_job(kube, namespace, "nopc")
    assert job["status"]["phase"] == "Failed"
    assert production_operator.logs().count("nopc: Pod nopc-worker-") <= 2


def test_status_bounded_untrusted_and_no_test_hooks(kube, namespace, production_operator, wait_for):
    seed_topology(kube, namespace)
    doc = manifest("big", scheduling={**NO_SCHEDULER, "podAnnotations": {"note": "x" * 60_000}})
    doc["metadata"]["annotations"] = {
        f"{C.GROUP}/fault-exit-at-step": "2",
        f"{C.GROUP}/fault-exit-code": "1",
    }
    apply_job(kube, namespace, doc)
    job = wait_for(
        lambda: (
            (get_job(kube, namespace, "big").get("status") or {}).get("gangComplete") == 0
            and get_job(kube, namespace, "big")
        ),
        timeout=60,
        message="launched\n" + production_operator.logs(),
    )
    status = job["status"]
    assert status["launchedSpecHash"] and "launchedSpec" not in status
    assert len(json.dumps(status)) < 8000
    pods = kube.core.list_namespaced_pod(namespace, label_selector=f"{C.LABEL_JOB}=big").items
    assert len(pods) == 2
    for pod in pods:
        env = {e.name for e in pod.spec.containers[0].env}
        assert not env & {"MOE_FAULT_EXIT_AT_STEP", "MOE_FAULT_EXIT_CODE"}

    # a hand-patched Succeeded (and a garbage attempt) while both workers are still Pending
    conds = [c for c in status["conditions"] if c["type"] != C.COND_SUCCEEDED]
    conds.append(
        {
            "type": C.COND_SUCCEEDED,
            "status": "True",
            "reason": "ByHand",
            "message": "patched",
            "lastTransitionTime": "2026-01-01T00:00:00Z",
        }
    )
    kube.custom.patch_namespaced_custom_object_status(
        C.GROUP,
        C.VERSION,
        namespace,
        C.PLURAL,
        "big",
        {"status": {"conditions": conds, "attempt": "x", "completionTime": "2026-01-01T00:00:00Z"}},
    )
    # a status patch starts no pass; the resync (30 s) does, or this spec edit at once
    kube.custom.patch_namespaced_custom_object(
        C.GROUP, C.VERSION, namespace, C.PLURAL, "big", {"spec": {"runPolicy": {"backoffLimit": 4}}}
    )

    def corrected():
        s = get_job(kube, namespace, "big")["status"]
        c = condition({"status": s}, C.COND_SUCCEEDED)
        return c.get("reason") == C.R_STATUS_CORRECTED and s.get("attempt") == 0 and s

    s = wait_for(corrected, timeout=60, message="status corrected\n" + production_operator.logs())
    assert s["phase"] != "Succeeded" and "completionTime" not in s
    assert (
        len(kube.core.list_namespaced_pod(namespace, label_selector=f"{C.LABEL_JOB}=big").items)
        == 2
    )


def test_an_exceeded_quota_is_retried_visibly_until_it_frees_up(
    kube, namespace, production_operator, wait_for
):
    """A 403 the cluster may lift (a ResourceQuota: other pods finish) is transient, not terminal:
    Reconciled=False / TransientError with the server's message and the backoff, then the launch
    once the quota allows it."""
    seed_topology(kube, namespace)
    kube.core.create_namespaced_resource_quota(
        namespace, {"metadata": {"name": "no-pods"}, "spec": {"hard": {"pods": "0"}}}
    )
    wait_for(
        lambda: kube.core.read_namespaced_resource_quota("no-pods", namespace).status.hard or {},
        timeout=30,
        message="quota status",
    )
    apply_job(kube, namespace, manifest("quota", scheduling=NO_SCHEDULER))

    def retrying():
        c = condition(get_job(kube, namespace, "quota"), C.COND_RECONCILED)
        return c if c.get("status") == "False" else None

    c = wait_for(retrying, timeout=60, message=production_operator.logs())
    assert c["reason"] == C.R_TRANSIENT_ERROR and "exceeded quota" in c["message"], c
    assert "retrying in" in c["message"]
    assert condition(get_job(kube, namespace, "quota"), C.COND_FAILED).get("status") != "True"
    kube.core.delete_namespaced_resource_quota("no-pods", namespace)
    wait_for(
        lambda: (
            len(
                kube.core.list_namespaced_pod(
                    namespace, label_selector=f"{C.LABEL_JOB}=quota"
                ).items
            )
            == 2
        ),
        timeout=120,
        message=production_operator.logs(),
    )
    wait_for(
        lambda: (
            condition(get_job(kube, namespace, "quota"), C.COND_RECONCILED).get("status") == "True"
        ),
        timeout=60,
        message=production_operator.logs(),
    )
