"""End to end with the real operator, API server and node agent: discovery pods -> plan
ConfigMap -> 2 worker pods running the real trainer (DeepSpeed ZeRO-3 + AutoEP on CPU) ->
Succeeded with progress in the status, and `kubectl wait --for=condition=Succeeded` works."""

from __future__ import annotations

import json

import pytest

from moejob_operator import constants as C
from operator_harness import apply_job, condition, events_for, example, get_job, module_operator

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


operator_proc = module_operator()


def test_tiny_cpu_job_succeeds(kube, kubectl, namespace, operator_proc, wait_for, tmp_path):
    job = example(
        "tiny-cpu.yaml",
        checkpoint={"everySteps": 5, "volume": {"hostPath": {"path": str(tmp_path)}}},
    )
    apply_job(kube, namespace, job)
    name = job["metadata"]["name"]

    wait_for(
        lambda: condition(get_job(kube, namespace, name), C.COND_TOPOLOGY).get("status") == "True",
        timeout=60,
        message="topology discovered\n" + operator_proc.logs(),
    )

    # The reports land in ConfigMaps before each discovery process exits: the pods end Succeeded
    # shortly after TopologyDiscovered turns True.
    def discovery_pods():
        return kube.core.list_namespaced_pod(
            namespace, label_selector=f"{C.LABEL_COMPONENT}=discovery"
        ).items

    wait_for(
        lambda: (
            len(discovery_pods()) == 2
            and all(p.status.phase == "Succeeded" for p in discovery_pods())
        ),
        timeout=60,
        message="discovery pods Succeeded: "
        + ", ".join(f"{p.metadata.name}={p.status.phase}" for p in discovery_pods()),
    )
    plan_cm = wait_for(
        lambda: kube.core.read_namespaced_config_map(f"{name}-plan", namespace), timeout=30
    )
    plan = json.loads(plan_cm.data[C.PLAN_KEY])
    assert plan["worldSize"] == 2 and {r["node"] for r in plan["ranks"]} == {"node-a", "node-b"}

    out = kubectl.run(
        "wait",
        "--for=condition=Succeeded",
        f"moejob/{name}",
        "-n",
        namespace,
        "--timeout=400s",
        check=False,
        timeout=420,
    )
    status = get_job(kube, namespace, name)["status"]
    assert out.returncode == 0, (
        f"{out.stdout}{out.stderr}\n{json.dumps(status, indent=1)}\n{operator_proc.logs()}"
    )
    assert status["phase"] == "Succeeded"
    assert status["progress"]["step"] == status["progress"]["totalSteps"] == 10
    assert status["plan"]["worldSize"] == 2
    assert status["observedGeneration"] == 1
    pods = kube.core.list_namespaced_pod(
        namespace, label_selector=f"{C.LABEL_COMPONENT}=worker"
    ).items
    assert sorted(p.metadata.name for p in pods) == [f"{name}-worker-0", f"{name}-worker-1"]
    assert all(p.metadata.owner_references[0].name == name for p in pods)
    want = {C.R_DISCOVERED, C.R_PLAN_READY, "WorkersCreated", C.R_TRAINING_FINISHED}
    reasons = wait_for(
        lambda: (
            {e.reason for e in events_for(kube, namespace, name)} >= want
            and {e.reason for e in events_for(kube, namespace, name)}
        ),
        timeout=10,
        message=f"events {want}",
    )
    # ranks exit one by one at the end: that is not "pending" (it read "1 of 2 worker pods running")
    assert C.R_WORKERS_PENDING not in reasons
    got = kubectl.run("get", "moejob", "-n", namespace)
    assert "Succeeded" in got.stdout
