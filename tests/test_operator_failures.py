"""Failure policy with the real operator: a retryable worker exit restarts the gang from the
checkpoint (the step count continues), exceeding backoffLimit fails the job with the reason.
(Operator crashes mid-launch: test_operator_crash.py.)"""

from __future__ import annotations

import pytest

from moe_faults import FAULT_ANNOTATIONS
from moejob_operator import constants as C
from operator_harness import (
    apply_job,
    condition,
    events_for,
    example,
    get_job,
    module_operator,
    seed_topology,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
AT_STEP, CODE = list(FAULT_ANNOTATIONS)[:2]


operator_proc = module_operator("operator-fail")


def _job(name, tmp_path, *, steps, backoff, fault_step, code=75):
    job = example(
        "tiny-cpu.yaml",
        metadata={"name": name, "annotations": {AT_STEP: str(fault_step), CODE: str(code)}},
        checkpoint={"everySteps": 2, "volume": {"hostPath": {"path": str(tmp_path)}}},
        runPolicy={"backoffLimit": backoff},
    )
    job["spec"]["training"].update(steps=steps, seqLen=32)
    return job


def test_retryable_exit_restarts_gang_from_checkpoint(
    kube, namespace, operator_proc, node_agent, wait_for, tmp_path
):
    seed_topology(kube, namespace)
    apply_job(kube, namespace, _job("retry", tmp_path, steps=6, backoff=2, fault_step=3))

    def done():
        st = get_job(kube, namespace, "retry").get("status") or {}
        return st.get("phase") in ("Succeeded", "Failed") and st

    st = wait_for(
        done, timeout=420, interval=1, message="retry job finished\n" + operator_proc.logs()
    )
    assert st["phase"] == "Succeeded", st
    assert st["restarts"] == 1 and st["failedRestarts"] == 1 and st["attempt"] == 1
    assert st["progress"]["step"] == 6
    log = node_agent.read_log(namespace, "retry-worker-0")
    assert "resumed from step 2" in log, log[-3000:]  # checkpoint every 2, fault after step 3
    wait_for(
        lambda: C.R_RESTARTING in [e.reason for e in events_for(kube, namespace, "retry")],
        timeout=10,
        message="Restarting event",
    )


def test_backoff_limit_exceeded_fails(kube, namespace, operator_proc, wait_for, tmp_path):
    seed_topology(kube, namespace)
    apply_job(kube, namespace, _job("nobackoff", tmp_path, steps=4, backoff=0, fault_step=1))
    wait_for(
        lambda: (
            condition(get_job(kube, namespace, "nobackoff"), C.COND_FAILED).get("status") == "True"
        ),
        timeout=300,
        interval=1,
        message=operator_proc.logs(),
    )
    failed = condition(get_job(kube, namespace, "nobackoff"), C.COND_FAILED)
    assert failed["reason"] == C.R_BACKOFF_LIMIT_EXCEEDED
    assert "exit code 75" in failed["message"] and "backoffLimit is 0" in failed["message"]
    wait_for(
        lambda: (
            not [
                p
                for p in kube.core.list_namespaced_pod(
                    namespace, label_selector=f"{C.LABEL_JOB}=nobackoff"
                ).items
                if p.status.phase in ("Pending", "Running")
            ]
        ),
        timeout=60,
    )
