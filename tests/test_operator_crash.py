"""An operator killed mid-launch (after the plan, after RBAC, after the first worker) is replaced
by one that converges with no duplicate children. Its own module: no other operator may run
meanwhile. The workers use a scheduler nobody runs, so no trainer starts."""

from __future__ import annotations

import pytest

from moejob_operator import constants as C
from operator_harness import (
    Operator,
    apply_job,
    children,
    condition,
    example,
    get_job,
    install_crd,
    seed_topology,
)

pytestmark = pytest.mark.cluster


@pytest.mark.parametrize("point", ["after-plan", "after-rbac", "after-first-worker"])
def test_operator_killed_mid_launch_converges(
    control_plane, kube, namespace, node_agent, wait_for, tmp_path, point
):
    install_crd(kube)
    seed_topology(kube, namespace)
    # ready before any deadline: on a loaded machine the start alone can take most of a minute
    crashing = (
        Operator(control_plane, tmp_path / "op").start(MOE_OPERATOR_CRASH_AT=point).wait_ready()
    )
    job = example("tiny-cpu.yaml", metadata={"name": "crash"})
    # a scheduler nobody runs: the workers are created but never start (launch is what we test)
    job["spec"]["scheduling"] = {"schedulerName": "nobody-schedules-this"}
    # the launch is under test, not the gate: without a cached verdict the restarted operator
    # would first wait for a whole CPU smoke test (minutes on a loaded machine)
    job["spec"]["gate"] = {"skip": True, "skipReason": "test: the launch after a crash"}
    apply_job(kube, namespace, job)
    try:
        assert crashing.wait_exit(60) == 3, crashing.logs()
    finally:
        crashing.stop()
    partial = children(kube, namespace, "crash")
    assert "cm/crash-plan" in partial
    restarted = Operator(control_plane, tmp_path / "op2").start().wait_ready()
    try:
        want = sorted(
            [
                "cm/crash-plan",
                "cm/crash-progress",
                "cm/crash-routing-stats",
                "pod/crash-worker-0",
                "pod/crash-worker-1",
                "sa/crash-worker",
                "svc/crash-workers",
            ]
        )
        wait_for(
            lambda: children(kube, namespace, "crash") == want,
            timeout=60,
            message=f"children after restart: {children(kube, namespace, 'crash')}\n"
            f"{restarted.logs()}",
        )
        # the pass writes status after creating the pods
        st = wait_for(
            lambda: (
                "gangComplete" in (get_job(kube, namespace, "crash").get("status") or {})
                and get_job(kube, namespace, "crash")["status"]
            ),
            timeout=30,
            message="status.gangComplete",
        )
        assert st["gangComplete"] == 0 and st["restarts"] == 0
        assert condition(get_job(kube, namespace, "crash"), C.COND_PLANNED)["status"] == "True"
        pods = kube.core.list_namespaced_pod(namespace, label_selector=f"{C.LABEL_JOB}=crash").items
        assert sorted(p.metadata.labels[C.LABEL_ATTEMPT] for p in pods) == ["0", "0"]
        roles = kube.rbac.list_namespaced_role(
            namespace, label_selector=f"{C.LABEL_JOB}=crash"
        ).items
        assert [r.metadata.name for r in roles] == ["crash-worker"]
    finally:
        restarted.stop()
