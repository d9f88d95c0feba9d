"""Auto sizing through the real operator and API server: the CRD takes ``Auto``, the operator
sizes the job on the discovered nodes (the local control plane's two 8-GPU nodes), records the
choice in the plan and ``status.sizing``, launches the chosen gang, keeps what the user gave,
compares the trainer's tokens/s with the prediction, and refuses a job that fits nowhere with
the smallest shape that would.

Nothing here has a GPU: the worker pods name a scheduler that does not exist and stay Pending
(as in test_gpu_children_cluster); the gate is skipped (audited) so that the job launches.
"""

from __future__ import annotations

import json

import pytest

from moe_contracts.progress import progress_doc
from moejob_operator import constants as C
from operator_harness import (
    apply_job,
    condition,
    example,
    get_job,
    module_operator,
    seed_topology,
)

pytestmark = pytest.mark.cluster

NO_SCHEDULER = "moe-test-no-such-scheduler"
operator_proc = module_operator("sizing-operator")


def _job(name: str, tmp_path, *, model: str, nodes: dict, training: dict) -> dict:
    return example(
        "tiny-cpu.yaml",
        metadata={"name": name},
        device="GPU",
        model={"preset": model},
        nodes=nodes,
        placement={"strategy": "Contiguous"},
        training={"steps": 10, "learningRate": "1e-3", **training},
        checkpoint={"everySteps": 5, "volume": {"hostPath": {"path": str(tmp_path)}}},
        scheduling={"schedulerName": NO_SCHEDULER},
        gate={"skip": True, "skipReason": "no GPU here; the test checks the sizing"},
    )


def _workers(kube, namespace):
    return kube.core.list_namespaced_pod(
        namespace, label_selector=f"{C.LABEL_COMPONENT}=worker"
    ).items


def _env(pod) -> dict[str, str]:
    return {e.name: e.value for e in pod.spec.containers[0].env if e.value is not None}


def test_auto_job_is_sized_launched_and_compared(
    kube, namespace, operator_proc, wait_for, tmp_path
):
    seed_topology(kube, namespace)
    job = _job(
        "auto-3b",
        tmp_path,
        model="bench-mixtral-3b",
        nodes={"count": "Auto", "gpusPerNode": "Auto"},
        training={
            "seqLen": 2048,
            "globalBatch": 64,
            "microBatch": "Auto",
            "activationCheckpointing": "Auto",
        },
    )
    job["spec"]["placement"]["expertParallelSize"] = "Auto"
    apply_job(kube, namespace, job)

    def sized():
        st = get_job(kube, namespace, "auto-3b").get("status") or {}
        return st.get("sizing") and st

    st = wait_for(sized, timeout=120, message="status.sizing")
    s = st["sizing"]
    cm = kube.core.read_namespaced_config_map("auto-3b-plan", namespace)
    plan = json.loads(cm.data[C.PLAN_KEY])
    chosen = plan["sizing"]["chosen"]
    # status says what the plan chose, and the plan runs it
    assert (s["nodeCount"], s["gpusPerNode"], s["expertParallelSize"], s["microBatch"]) == (
        chosen["nodeCount"],
        chosen["gpusPerNode"],
        chosen["expertParallelSize"],
        chosen["microBatch"],
    )
    assert plan["worldSize"] == s["nodeCount"] * s["gpusPerNode"]
    assert plan["training"]["microBatch"] == s["microBatch"]
    assert s["predictedTokensPerSecond"] > 0 and s["predictedPeakBytesPerGpu"] > 0
    assert set(s["auto"]) >= {"nodes.count", "nodes.gpusPerNode", "training.microBatch"}
    planned = condition(get_job(kube, namespace, "auto-3b"), C.COND_PLANNED)
    assert planned["status"] == "True" and "sized (" in planned["message"]
    # the gang is the chosen shape
    pods = wait_for(
        lambda: len(_workers(kube, namespace)) == s["nodeCount"] and _workers(kube, namespace),
        timeout=90,
        message="worker pods of the chosen shape",
    )
    for p in pods:
        res = p.spec.containers[0].resources
        assert res.limits[C.GPU_RESOURCE] == str(s["gpusPerNode"])
        env = _env(p)
        assert env["NNODES"] == str(s["nodeCount"])
        assert env["NPROC_PER_NODE"] == str(s["gpusPerNode"])
        assert env["WORLD_SIZE"] == str(plan["worldSize"])

    # the trainer's tokens/s against the prediction (rank 0 publishes progress like this)
    measured = 0.8 * s["predictedTokensPerSecond"]
    doc = progress_doc(
        phase="Training",
        step=3,
        total_steps=10,
        loss=5.0,
        tokens_per_second=measured,
        eta_seconds=10.0,
        checkpoint=None,
        moe={},
        health=[],
    )
    wait_for(
        lambda: (
            kube.core.list_namespaced_config_map(
                namespace, field_selector="metadata.name=auto-3b-progress"
            ).items
        ),
        timeout=60,
        message="progress ConfigMap",
    )
    kube.core.patch_namespaced_config_map(
        "auto-3b-progress", namespace, {"data": {C.PROGRESS_KEY: json.dumps(doc)}}
    )

    def compared():
        st = get_job(kube, namespace, "auto-3b").get("status") or {}
        return (st.get("sizing") or {}).get("measuredVsPredicted") and st["sizing"]

    got = wait_for(compared, timeout=60, message="status.sizing.measuredVsPredicted")
    assert got["measuredVsPredicted"] == "0.800"
    assert got["measuredTokensPerSecond"] == round(measured)


def test_given_values_are_kept(kube, namespace, operator_proc, wait_for, tmp_path):
    seed_topology(kube, namespace)
    job = _job(
        "auto-kept",
        tmp_path,
        model="bench-mixtral",
        nodes={"count": "Auto", "gpusPerNode": 2},
        training={
            "seqLen": 512,
            "globalBatch": 32,
            "microBatch": 1,
            "activationCheckpointing": "Disabled",
        },
    )
    apply_job(kube, namespace, job)

    def sized():
        st = get_job(kube, namespace, "auto-kept").get("status") or {}
        return st.get("sizing")

    s = wait_for(sized, timeout=120, message="status.sizing")
    assert (s["gpusPerNode"], s["microBatch"], s["activationCheckpointing"]) == (2, 1, False)
    assert s["auto"] == [
        "nodes.count",
        "zero_optimization.stage3_param_persistence_threshold",
    ]
    pods = wait_for(
        lambda: len(_workers(kube, namespace)) == s["nodeCount"] and _workers(kube, namespace),
        timeout=90,
        message="worker pods",
    )
    assert {p.spec.containers[0].resources.limits[C.GPU_RESOURCE] for p in pods} == {"2"}


def test_a_job_that_fits_nowhere_names_the_smallest_shape(
    kube, namespace, operator_proc, wait_for, tmp_path
):
    seed_topology(kube, namespace)
    job = _job(
        "auto-huge",
        tmp_path,
        model="mixtral-8x22b",
        nodes={"count": "Auto", "gpusPerNode": "Auto"},
        training={"seqLen": 4096, "globalBatch": 64, "microBatch": "Auto"},
    )
    apply_job(kube, namespace, job)

    def failed():
        j = get_job(kube, namespace, "auto-huge")
        c = condition(j, C.COND_FAILED)
        return c.get("status") == "True" and c

    c = wait_for(failed, timeout=180, message="Failed")
    assert c["reason"] == C.R_INSUFFICIENT_MEMORY
    assert "no shape fits in GPU memory on node-a, node-b" in c["message"]
    assert "It needs " in c["message"] and "nodes x 8 NVIDIA H100" in c["message"]
    assert not _workers(kube, namespace)
