"""Trust boundaries through the real API server, operator and node agent (docs/security.md):

- a symlink planted under an allowed hostPath prefix that points outside it is not followed:
  the pods mount the prefix and reach the path by subPath, which the node agent (like the
  kubelet) refuses to resolve out of its volume; nothing is written outside the prefix;
- a neighbour's ConfigMap with the job's plan name is a ChildConflict condition: never used,
  never deleted, no worker pod starts;
- a neighbour's pod with the job's worker labels that fails does not fail the job and is not
  deleted; the job names it in ``status.foreignPods``."""

from __future__ import annotations

import pytest

from moejob_operator import constants as C
from operator_harness import (
    Operator,
    apply_job,
    condition,
    example,
    get_job,
    install_crd,
    seed_topology,
)

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def allowed(tmp_path_factory):
    return tmp_path_factory.mktemp("allowed-prefix")


@pytest.fixture(scope="module")
def trust_operator(control_plane, kube, node_agent, tmp_path_factory, allowed):
    install_crd(kube)
    op = (
        Operator(control_plane, tmp_path_factory.mktemp("operator-trust"))
        .start(MOE_ALLOWED_HOST_PATH_PREFIXES=str(allowed))
        .wait_ready()  # the tests' deadlines time the operator's work, not its start
    )
    yield op
    op.stop()


def _job(name: str, ckpt: str, **spec) -> dict:
    job = example(
        "tiny-cpu.yaml",
        metadata={"name": name},
        checkpoint={"everySteps": 2, "volume": {"hostPath": {"path": ckpt}}},
        gate={"skip": True, "skipReason": "test"},
        **spec,
    )
    job["spec"]["training"].update(steps=2, seqLen=32)
    return job


def test_a_symlink_under_an_allowed_prefix_does_not_mount_what_it_points_to(
    kube, namespace, trust_operator, wait_for, allowed, tmp_path
):
    outside = tmp_path / "outside"
    outside.mkdir()
    (allowed / "escape").symlink_to(outside)
    seed_topology(kube, namespace)
    apply_job(kube, namespace, _job("symlink", str(allowed / "escape")))

    def refused():
        for pod in kube.core.list_namespaced_pod(namespace).items:
            for cs in pod.status.container_statuses or ():
                w = cs.state.waiting if cs.state else None
                if w and "not within volume path" in (w.message or ""):
                    return pod
        return None

    try:
        pod = wait_for(refused, timeout=120, message="a worker refused its escaping subPath")
    except Exception:  # what the job did instead, for the report
        print(get_job(kube, namespace, "symlink").get("status"), trust_operator.logs()[-3000:])
        raise
    assert pod.spec.volumes[[v.name for v in pod.spec.volumes].index("checkpoint")].host_path.path
    assert list(outside.iterdir()) == [], "the trainer wrote outside the allowed prefix"
    # The worker pods exist before the handler that created them writes the job's status, so
    # wait for a phase (under load that patch can land well after the pod's refusal).
    phase = wait_for(
        lambda: get_job(kube, namespace, "symlink").get("status", {}).get("phase"),
        timeout=60,
        message="the job's status has a phase",
    )
    assert phase != "Succeeded"


def test_a_squatted_plan_configmap_is_reported_never_used_never_deleted(
    kube, namespace, trust_operator, wait_for, allowed
):
    forged = {
        "metadata": {
            "name": "squat-plan",
            "annotations": {C.ANNOTATION_SPEC_HASH: "forged"},
        },
        "data": {C.PLAN_KEY: '{"forged": true}'},
    }
    kube.core.create_namespaced_config_map(namespace, forged)
    seed_topology(kube, namespace)
    apply_job(kube, namespace, _job("squat", str(allowed / "squat")))

    def conflict():
        c = condition(get_job(kube, namespace, "squat"), C.COND_RECONCILED)
        return c if c.get("reason") == C.R_CHILD_CONFLICT else None

    c = wait_for(conflict, timeout=60, message="ChildConflict on the job")
    assert "ConfigMap squat-plan" in c["message"]
    cm = kube.core.read_namespaced_config_map("squat-plan", namespace)
    assert cm.data == {C.PLAN_KEY: '{"forged": true}'} and not cm.metadata.owner_references
    pods = kube.core.list_namespaced_pod(namespace, label_selector=f"{C.LABEL_JOB}=squat").items
    assert pods == []


def test_a_foreign_pod_with_worker_labels_neither_fails_the_job_nor_is_deleted(
    kube, namespace, trust_operator, wait_for, allowed
):
    seed_topology(kube, namespace)
    labels = {
        C.LABEL_JOB: "victim",
        C.LABEL_COMPONENT: "worker",
        C.LABEL_NODE_RANK: "0",
        C.LABEL_ATTEMPT: "0",
    }
    intruder = {
        "metadata": {"name": "intruder", "labels": labels},
        "spec": {
            "nodeName": "node-a",
            "restartPolicy": "Never",
            "containers": [{"name": "c", "image": "busybox", "command": ["false"]}],
        },
    }
    kube.core.create_namespaced_pod(namespace, intruder)
    wait_for(
        lambda: kube.core.read_namespaced_pod("intruder", namespace).status.phase == "Failed",
        timeout=180,
        message="the intruder pod failed",
    )
    job = _job("victim", str(allowed / "victim"), runPolicy={"backoffLimit": 0})
    job["spec"]["scheduling"] = {"schedulerName": "none-such"}  # own workers stay Pending
    apply_job(kube, namespace, job)

    def ignored():
        st = get_job(kube, namespace, "victim").get("status") or {}
        return st if st.get("foreignPods") == ["intruder"] and st.get("workers") else None

    st = wait_for(ignored, timeout=60, message="victim names the intruder as foreign")
    assert condition({"status": st}, C.COND_FAILED).get("status") != "True", st
    assert st["workers"].get("failed", 0) == 0, st
    assert kube.core.read_namespaced_pod("intruder", namespace).metadata.deletion_timestamp is None


@pytest.mark.parametrize(
    ("kind", "name"),
    [("Service", "svcsquat-workers"), ("ConfigMap", "cmsquat-progress")],
    ids=["service", "progress"],
)
def test_a_squatted_trainer_child_stops_the_launch_before_any_worker_pod(
    kube, namespace, trust_operator, wait_for, allowed, kind, name
):
    """The children only the running trainer uses (headless Service, progress and routing
    ConfigMaps, Role, RoleBinding) are created after the worker pods; a neighbour's object with
    one of their names was reported only once the pods existed, which then ran with its Service
    (rendezvous DNS) or a Role that let them write its ConfigMap. Their names are claimed before
    the pods now."""
    job_name = name.split("-")[0]
    if kind == "Service":
        body = {
            "metadata": {"name": name},
            "spec": {"clusterIP": "None", "selector": {"x": "y"}, "ports": [{"port": 1}]},
        }
        kube.core.create_namespaced_service(namespace, body)
    else:
        kube.core.create_namespaced_config_map(namespace, {"metadata": {"name": name}})
    seed_topology(kube, namespace)
    job = _job(job_name, str(allowed / job_name))
    job["spec"]["scheduling"] = {"schedulerName": "none-such"}
    apply_job(kube, namespace, job)

    def conflict():
        c = condition(get_job(kube, namespace, job_name), C.COND_RECONCILED)
        return c if c.get("reason") == C.R_CHILD_CONFLICT else None

    c = wait_for(conflict, timeout=60, message="ChildConflict on the job")
    assert f"{kind} {name}" in c["message"], c
    sel = f"{C.LABEL_JOB}={job_name}"
    assert kube.core.list_namespaced_pod(namespace, label_selector=sel).items == []
