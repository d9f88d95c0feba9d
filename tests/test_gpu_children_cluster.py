"""GPU-mode children through the real operator and API server: the gate's GPU smoke Job, the
worker pods of a `device: GPU` job (with integer `spec.resources`) and a GPU-requesting discovery
pod are accepted by the API with the right `nvidia.com/gpu` requests.

The nodes of the local control plane advertise `nvidia.com/gpu: 8` (moe_localkube.nodes), but
nothing here has a GPU: the worker pods name a scheduler that does not exist, so they stay
Pending and no trainer runs; their specs are what is asserted. The smoke Job runs a stand-in
that passes at once (as in test_gate_cluster) so that the job goes on to its workers.
"""

from __future__ import annotations

import pytest

from moe_localkube.testing import WaitTimeout, unique_name
from moejob_operator import constants as C
from moejob_operator.builders import discovery as D
from moejob_operator.reconcile.client import Client
from operator_harness import (
    apply_job,
    condition,
    events_for,
    example,
    gate_operator,
    get_job,
    module_namespace,
    seed_topology,
)

pytestmark = pytest.mark.cluster

STAND_IN = r"""
import json
cases = [c["name"] for c in json.load(open("/etc/moe-smoke/plans.json"))["cases"]]
from moe_contracts.gate import SMOKE_VERSION, expected_checks
pairs = expected_checks(cases)
checks = [{"name": n, "case": c, "passed": True, "seconds": 0.1, "message": "stand-in"}
          for n, c in pairs]
v = {"kind": "SmokeVerdict", "version": SMOKE_VERSION, "passed": True, "failedCheck": None,
     "failedCase": None,
     "cases": cases, "checks": checks, "exception": None,
     "versions": {"deepspeed": "0.19.8", "torch": "2.13.0", "transformers": "5.17.0",
                  "cuda": "12.8", "device": "cuda", "gpu": "NVIDIA H100 80GB HBM3",
                  "computeCapability": "9.0", "cudaDriver": "12.8"},
     "durationSeconds": 0.1, "standIn": True}
open("/dev/termination-log", "w").write(json.dumps(v))
"""
NO_SCHEDULER = "moe-test-no-such-scheduler"  # keeps the GPU worker pods Pending


gate_ns = module_namespace("moe-gpu-gate")


@pytest.fixture(scope="module")
def operator_proc(control_plane, kube, node_agent, gate_ns, tmp_path_factory):
    op = gate_operator(
        control_plane, kube, gate_ns, tmp_path_factory.mktemp("gpu-operator"), STAND_IN
    )
    yield op
    op.stop()


def _gpu(container) -> tuple[str | None, str | None]:
    res = container.resources
    return ((res.requests or {}).get(C.GPU_RESOURCE), (res.limits or {}).get(C.GPU_RESOURCE))


def test_gpu_job_gets_its_gpu_smoke_job_and_gpu_worker_pods(
    kube, namespace, operator_proc, gate_ns, wait_for, tmp_path
):
    seed_topology(kube, namespace)
    image = f"registry.local/moe-trainer:{unique_name('gpu')}"
    job = example(
        "tiny-cpu.yaml",
        image=image,
        device="GPU",
        metadata={"name": "gpu-ints"},
        nodes={"count": 2, "gpusPerNode": 2},
        checkpoint={"everySteps": 5, "volume": {"hostPath": {"path": str(tmp_path)}}},
        placement={"strategy": "TopologyAware", "expertParallelSize": 4},
        training={
            "steps": 10,
            "seqLen": 64,
            "globalBatch": 8,
            "microBatch": 2,
            "learningRate": "1e-3",
        },
        # integers, as the CRD's int-or-string allows
        resources={"requests": {"cpu": 2, "memory": "1Gi"}, "limits": {"cpu": 4}},
        scheduling={"schedulerName": NO_SCHEDULER},
    )
    apply_job(kube, namespace, job)
    logs = operator_proc.logs

    def smoke_jobs():  # this image's (the identity key also covers the GPU model)
        return [
            j
            for j in kube.batch.list_namespaced_job(
                gate_ns, label_selector=f"{C.LABEL_COMPONENT}=smoke"
            ).items
            if (j.metadata.annotations or {}).get(f"{C.GROUP}/gate-image") == image
        ]

    try:
        smoke = wait_for(smoke_jobs, timeout=90, message="GPU smoke Job created")[0]
    except WaitTimeout as exc:
        pytest.fail(f"{exc}\n{get_job(kube, namespace, 'gpu-ints').get('status')}\n{logs()}")
    assert _gpu(smoke.spec.template.spec.containers[0]) == ("1", "1")
    # the job controller's pod carries it too (the API server accepted the template)
    pod = wait_for(
        lambda: (
            kube.core.list_namespaced_pod(
                gate_ns, label_selector=f"job-name={smoke.metadata.name}"
            ).items
        ),
        timeout=60,
        message="smoke pod",
    )[0]
    assert _gpu(pod.spec.containers[0]) == ("1", "1")

    def workers():
        return kube.core.list_namespaced_pod(
            namespace, label_selector=f"{C.LABEL_COMPONENT}=worker"
        ).items

    try:
        pods = wait_for(
            lambda: len(workers()) == 2 and workers(), timeout=90, message="GPU worker pods"
        )
    except WaitTimeout as exc:
        pytest.fail(f"{exc}\n{get_job(kube, namespace, 'gpu-ints').get('status')}\n{logs()}")
    for p in pods:
        c = p.spec.containers[0]
        assert _gpu(c) == ("2", "2")
        assert c.resources.requests["cpu"] == "2" and c.resources.limits["cpu"] == "4"
        assert c.resources.requests["memory"] == "1Gi"
        assert p.spec.scheduler_name == NO_SCHEDULER and p.status.phase == "Pending"
    status = get_job(kube, namespace, "gpu-ints")["status"]
    # the gate passed (workers exist); a later pass may briefly re-check the stored verdict
    wait_for(
        lambda: (
            condition(get_job(kube, namespace, "gpu-ints"), C.COND_UPGRADE_VERIFIED).get("status")
            == "True"
        ),
        timeout=60,
        message="UpgradeVerified=True",
    )
    assert status["plan"]["worldSize"] == 4
    # TopologyAware without routing statistics falls back to contiguous: status.plan and the
    # PlanReady Event say the layout the plan has, and what the spec asked for
    assert (status["plan"]["strategy"], status["plan"]["requestedStrategy"]) == (
        "contiguous",
        "topology_aware",
    )
    ready = wait_for(
        lambda: [
            e.message for e in events_for(kube, namespace, "gpu-ints") if e.reason == C.R_PLAN_READY
        ],
        timeout=10,
        message="PlanReady Event",
    )
    assert ready[0].startswith(
        "contiguous placement (topology_aware asked, no routing statistics) on "
    ), ready
    assert "ValidationError" not in logs()


def test_gpu_requesting_discovery_pod_is_accepted(kube, namespace, control_plane):
    client = Client(control_plane.api_client())
    pod = D.discovery_pod(
        "node-a",
        namespace=namespace,
        image="moe-trainer:local",
        service_account="default",
        gpu_access="request",
        gpu_count=8,
    )
    pod["spec"]["schedulerName"] = NO_SCHEDULER
    pod["spec"].pop("nodeName")  # leave it unbound: nothing must run
    assert client.create(pod)
    got = kube.core.read_namespaced_pod(pod["metadata"]["name"], namespace)
    assert _gpu(got.spec.containers[0]) == ("8", "8")
