"""A worker's reason to exit reaches the job: real trainer processes on the node agent write a
TrainerExit document to the termination-message file, the operator reads it from the pods and
names the cause in the Failed reason (not just "exit code 78")."""

from __future__ import annotations

import pytest

from moejob_operator import constants as C
from operator_harness import apply_job, condition, example, get_job, module_operator, seed_topology

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

operator_proc = module_operator("operator-causes")


def test_empty_data_directory_fails_with_data_not_found(
    kube, namespace, operator_proc, wait_for, tmp_path
):
    seed_topology(kube, namespace)
    empty = tmp_path / "corpus"
    empty.mkdir()
    job = example(
        "tiny-cpu.yaml",
        metadata={"name": "nodata"},
        data={"kind": "Text", "path": "/data", "volume": {"hostPath": {"path": str(empty)}}},
        checkpoint={"everySteps": 5, "volume": {"hostPath": {"path": str(tmp_path / "ck")}}},
        gate={"skip": True, "skipReason": "test"},
    )
    apply_job(kube, namespace, job)

    def failed():
        c = condition(get_job(kube, namespace, "nodata"), C.COND_FAILED)
        return c if c.get("status") == "True" else None

    c = wait_for(failed, timeout=240, message=operator_proc.logs())
    assert c["reason"] == C.R_DATA_NOT_FOUND, c
    assert "holds no text" in c["message"] and "exit code 78" in c["message"], c
    pods = kube.core.list_namespaced_pod(namespace, label_selector=f"{C.LABEL_JOB}=nodata").items
    msgs = [
        cs.state.terminated.message
        for p in pods
        for cs in p.status.container_statuses or ()
        if cs.state.terminated and cs.state.terminated.message
    ]
    assert any('"kind": "TrainerExit"' in m and '"DataNotFound"' in m for m in msgs), msgs
