"""Lifecycle with the real operator, without running the trainer (workers use a scheduler nobody
runs, so they are created and stay Pending): immutable-field edits are refused with a condition,
a deleted worker pod brings the gang back, suspend deletes the workers and resume relaunches them,
a lost node fails the job when re-planning is not allowed."""

from __future__ import annotations

import contextlib
import json
import time

import pytest
from kubernetes.client.rest import ApiException

from moe_localkube.nodes import NodeSpec, node_manifest, node_status
from moejob_operator import constants as C
from operator_harness import (
    apply_job,
    condition,
    events_for,
    example,
    get_job,
    launched,
    module_operator,
    seed_topology,
)

pytestmark = pytest.mark.cluster


operator_proc = module_operator("operator-life")


@contextlib.contextmanager
def extra_node(kube, name: str):
    """A Ready, untainted Node that no agent runs pods on, deleted when the block ends (the
    deletion is what the node-loss tests are about)."""
    spec = NodeSpec(name)
    kube.core.create_node(node_manifest(spec))
    try:
        kube.core.patch_node_status(name, {"status": node_status(spec)})
        kube.core.patch_node(name, {"spec": {"taints": None}})
        yield
    finally:
        with contextlib.suppress(ApiException):
            kube.core.delete_node(name)


def _patch(kube, ns, name, spec):
    kube.custom.patch_namespaced_custom_object(
        C.GROUP, C.VERSION, ns, C.PLURAL, name, {"spec": spec}
    )


def _workers(kube, ns, name):
    return sorted(
        (p.metadata.name, p.metadata.labels[C.LABEL_ATTEMPT], p.metadata.uid)
        for p in kube.core.list_namespaced_pod(
            ns, label_selector=f"{C.LABEL_JOB}={name},{C.LABEL_COMPONENT}=worker"
        ).items
        if not p.metadata.deletion_timestamp
    )


def _parked(name: str) -> dict:
    job = example("tiny-cpu.yaml", metadata={"name": name})
    job["spec"]["scheduling"] = {"schedulerName": "nobody-schedules-this"}
    job["spec"]["gate"] = {"skip": True, "skipReason": "lifecycle test: the trainer never runs"}
    return job


def test_immutable_edit_deleted_worker_suspend_resume(kube, namespace, operator_proc, wait_for):
    seed_topology(kube, namespace)
    apply_job(kube, namespace, _parked("life"))
    wait_for(
        lambda: len(_workers(kube, namespace, "life")) == 2,
        timeout=60,
        message=operator_proc.logs(),
    )
    first = _workers(kube, namespace, "life")
    job = launched(kube, namespace, "life", wait_for)
    assert condition(job, C.COND_UPGRADE_VERIFIED)["reason"] == C.R_GATE_SKIPPED
    # Events trail the pass that raised them (the poster yields to passes: reconcile/client.py)
    wait_for(
        lambda: any(
            e.reason == C.R_GATE_SKIPPED and e.type == "Warning"
            for e in events_for(kube, namespace, "life")
        ),
        timeout=10,
        message="GateSkipped event",
    )

    # an immutable field: refused with a condition, nothing relaunched
    _patch(kube, namespace, "life", {"training": {"steps": 99}})
    wait_for(
        lambda: (
            condition(get_job(kube, namespace, "life"), C.COND_SPEC_ACCEPTED).get("reason")
            == C.R_IMMUTABLE_FIELD_CHANGED
        ),
        timeout=30,
        message=operator_proc.logs(),
    )
    assert (
        "training" in condition(get_job(kube, namespace, "life"), C.COND_SPEC_ACCEPTED)["message"]
    )
    assert _workers(kube, namespace, "life") == first
    _patch(kube, namespace, "life", {"training": {"steps": 10}})  # reverted: accepted again
    wait_for(
        lambda: (
            condition(get_job(kube, namespace, "life"), C.COND_SPEC_ACCEPTED).get("status")
            == "True"
        ),
        timeout=30,
    )

    # a worker deleted by someone: the gang comes back (attempt 1), not counted against backoff
    kube.core.delete_namespaced_pod("life-worker-1", namespace)
    wait_for(
        lambda: [a for _, a, _ in _workers(kube, namespace, "life")] == ["1", "1"],
        timeout=60,
        message=operator_proc.logs(),
    )
    st = get_job(kube, namespace, "life")["status"]
    assert st["restarts"] == 1 and st["failedRestarts"] == 0

    # suspend deletes the workers; resume relaunches them
    _patch(kube, namespace, "life", {"runPolicy": {"suspend": True}})
    wait_for(
        lambda: (
            _workers(kube, namespace, "life") == []
            and get_job(kube, namespace, "life")["status"]["phase"] == "Suspended"
        ),
        timeout=60,
        message=operator_proc.logs(),
    )
    _patch(kube, namespace, "life", {"runPolicy": {"suspend": False}})
    wait_for(
        lambda: len(_workers(kube, namespace, "life")) == 2,
        timeout=60,
        message=operator_proc.logs(),
    )
    assert condition(get_job(kube, namespace, "life"), C.COND_SUSPENDED)["reason"] == C.R_RESUMED


def test_lost_node_fails_without_replan(kube, namespace, operator_proc, wait_for):
    with extra_node(kube, "node-lost"):
        seed_topology(kube, namespace, nodes=("node-a", "node-lost"))
        job = _parked("lost")
        job["spec"]["nodes"]["nodeNames"] = ["node-a", "node-lost"]
        apply_job(kube, namespace, job)
        wait_for(
            lambda: len(_workers(kube, namespace, "lost")) == 2,
            timeout=60,
            message=operator_proc.logs(),
        )
    wait_for(
        lambda: (
            condition(get_job(kube, namespace, "lost"), C.COND_FAILED).get("reason")
            == C.R_NODE_LOST
        ),
        timeout=60,
        message=operator_proc.logs(),
    )
    assert "node-lost" in condition(get_job(kube, namespace, "lost"), C.COND_FAILED)["message"]
    wait_for(lambda: _workers(kube, namespace, "lost") == [], timeout=30)


def test_lost_node_replans_on_the_remaining_nodes(kube, namespace, operator_proc, wait_for):
    """runPolicy.allowReplanOnNodeLoss: the gang planned on node-a + node-aa loses node-aa ->
    the plan is made again on the nodes that are left (node-a + node-b) and the gang relaunches
    (attempt 1), instead of failing. Only node-a and node-aa have cached reports, which is enough
    to plan without probing node-b; after the loss node-b's discovery pod runs first."""
    with extra_node(kube, "node-aa"):
        seed_topology(kube, namespace, nodes=("node-a", "node-aa"))
        time.sleep(2.5)  # the operator lists nodes through a 2 s cache (reconcile/client.py)
        job = _parked("replan")
        job["spec"]["runPolicy"] = {"allowReplanOnNodeLoss": True, "backoffLimit": 2}
        apply_job(kube, namespace, job)
        wait_for(
            lambda: len(_workers(kube, namespace, "replan")) == 2,
            timeout=60,
            message=operator_proc.logs(),
        )
        assert set(launched(kube, namespace, "replan", wait_for)["status"]["plan"]["nodes"]) == {
            "node-a",
            "node-aa",
        }

    def relaunched():
        st = get_job(kube, namespace, "replan").get("status", {})
        workers = _workers(kube, namespace, "replan")
        return (
            len(workers) == 2
            and all(a == "1" for _, a, _ in workers)
            and set((st.get("plan") or {}).get("nodes", ())) == {"node-a", "node-b"}
        )

    wait_for(relaunched, timeout=90, message=operator_proc.logs())
    job = get_job(kube, namespace, "replan")
    assert condition(job, C.COND_PLANNED)["status"] == "True"
    assert condition(job, C.COND_FAILED).get("status") != "True"
    assert job["status"]["restarts"] == 1
    plan = json.loads(
        kube.core.read_namespaced_config_map("replan-plan", namespace).data[C.PLAN_KEY]
    )
    assert {r["node"] for r in plan["ranks"]} == {"node-a", "node-b"}
    wait_for(
        lambda: any(e.reason == C.R_NODE_LOST for e in events_for(kube, namespace, "replan")),
        timeout=10,
        message="NodeLost event",
    )


def test_job_with_the_finalizer_of_an_older_operator_can_be_deleted(
    kube, namespace, operator_proc, wait_for
):
    """Operators before 2026-11-29 added C.FINALIZER (kopf does for timer handlers); this one keeps
    no finalizer, and kopf removes the old one so such jobs still delete."""
    job = example("tiny-cpu.yaml", metadata={"name": "legacy", "finalizers": [C.FINALIZER]})
    job["spec"]["runPolicy"] = {**job["spec"].get("runPolicy", {}), "suspend": True}
    apply_job(kube, namespace, job)
    wait_for(
        lambda: (
            condition(get_job(kube, namespace, "legacy"), C.COND_SUSPENDED).get("status") == "True"
        ),
        timeout=60,
        message="legacy job suspended\n" + operator_proc.logs(),
    )
    kube.custom.delete_namespaced_custom_object(C.GROUP, C.VERSION, namespace, C.PLURAL, "legacy")

    def gone():
        try:
            get_job(kube, namespace, "legacy")
            return False
        except ApiException as exc:
            return exc.status == 404

    wait_for(gone, timeout=30, message="job deleted\n" + operator_proc.logs())
