"""Re-placement during a job through the real operator and API server (spec.placement.replan).

No trainer runs: the worker pods name a scheduler that does not exist and stay Pending (as in
test_sizing_cluster); the test writes what rank 0 would publish at its checkpoints (the routing
statistics into ``<job>-routing-stats``, the progress document into ``<job>-progress``). Drifted
statistics (co-activation clusters the launch plan, made on uniform routing, knows nothing of)
give generation 1 in ``<job>-placement`` with an Event and ``status.placementHistory``; once the
trainer reports it applied, the same statistics again (no drift since) give no new generation.
"""

from __future__ import annotations

import json

import pytest

from moe_contracts import placement_update
from moe_contracts.env import PLACEMENT_CONFIGMAP
from moe_contracts.progress import progress_doc
from moe_contracts.routing import encode_configmap
from moe_localkube.testing import WaitTimeout
from moejob_operator import constants as C
from moejob_operator.core import routing
from operator_harness import apply_job, events_for, example, get_job, module_operator, seed_topology

pytestmark = pytest.mark.cluster

operator_proc = module_operator("replan-operator")
NAME = "replan"


def _job(tmp_path) -> dict:
    return example(
        "tiny-cpu.yaml",
        metadata={"name": NAME},
        device="GPU",
        nodes={"count": 2, "gpusPerNode": 1},
        placement={
            "strategy": "TopologyAware",
            "expertParallelSize": 2,
            "replan": {"everySteps": 10, "minPredictedGainPercent": 10},
        },
        training={"steps": 100, "seqLen": 64, "globalBatch": 4, "microBatch": 2},
        checkpoint={"everySteps": 5, "volume": {"hostPath": {"path": str(tmp_path)}}},
        scheduling={"schedulerName": "moe-test-no-such-scheduler"},
        gate={"skip": True, "skipReason": "no GPU here; the test checks re-placement"},
    )


def _placement(kube, namespace):
    cm = kube.core.read_namespaced_config_map(f"{NAME}-placement", namespace)
    return placement_update.loads(cm.data[placement_update.KEY])


def _publish(kube, namespace, stats, step, placement=None):
    """What rank 0 writes at a checkpoint: the statistics, then the progress document."""
    body = encode_configmap(stats.to_json()).body
    kube.core.patch_namespaced_config_map(f"{NAME}-routing-stats", namespace, body)
    doc = progress_doc(
        phase="Training",
        step=step,
        total_steps=100,
        loss=5.0,
        tokens_per_second=100.0,
        eta_seconds=10.0,
        checkpoint={"step": step, "path": "/ckpt"},
        moe={},
        health=[],
    )
    doc["routingStats"] = {"step": step, "published": True}
    if placement is not None:
        doc["placement"] = placement
    kube.core.patch_namespaced_config_map(
        f"{NAME}-progress", namespace, {"data": {C.PROGRESS_KEY: json.dumps(doc)}}
    )


def test_drift_switches_at_a_checkpoint_and_no_drift_stays(
    kube, namespace, operator_proc, wait_for, tmp_path
):
    seed_topology(kube, namespace)
    apply_job(kube, namespace, _job(tmp_path))

    def seeded():
        try:
            return _placement(kube, namespace)
        except Exception:  # noqa: BLE001 - not there yet
            return None

    gen0 = wait_for(seeded, timeout=120, message="the placement ConfigMap")
    plan = json.loads(
        kube.core.read_namespaced_config_map(f"{NAME}-plan", namespace).data[C.PLAN_KEY]
    )
    assert gen0.generation == 0 and gen0.permutation == plan["placement"]["permutation"]
    L, E = plan["placement"]["numLayers"], plan["placement"]["numExperts"]
    pods = wait_for(
        lambda: (
            kube.core.list_namespaced_pod(
                namespace, label_selector=f"{C.LABEL_JOB}={NAME},{C.LABEL_COMPONENT}=worker"
            ).items
        ),
        timeout=60,
        message="worker pods",
    )
    env = {e.name: e.value for e in pods[0].spec.containers[0].env}
    assert env[PLACEMENT_CONFIGMAP] == f"{NAME}-placement"

    # two co-activation clusters of equal popularity: kept in one group each, far fewer bytes
    drifted = routing.synthetic_trace(
        L, E, 2, 4096, zipf_s=0.0, num_clusters=2, cluster_affinity=0.9, seed=11
    )
    _publish(kube, namespace, drifted, 10)

    def switched():
        got = _placement(kube, namespace)
        return got if got.generation == 1 else None

    try:
        gen1 = wait_for(switched, timeout=120, message="placement generation 1")
    except WaitTimeout as exc:
        st = get_job(kube, namespace, NAME).get("status") or {}
        raise AssertionError(
            f"{exc}; status.replan {st.get('replan')}, conditions {st.get('conditions')}\n"
            f"{operator_proc.logs()[-3000:]}"
        ) from None
    gen1.check(L, E, ep_size=2)
    assert gen1.decided_at_step == 10 and gen1.permutation != gen0.permutation
    assert gen1.predicted.cross_group_bytes_after <= 0.9 * gen1.predicted.cross_group_bytes_before

    def recorded():
        st = get_job(kube, namespace, NAME).get("status") or {}
        return st.get("placementHistory") and st

    st = wait_for(recorded, timeout=60, message="status.placementHistory")
    (h,) = st["placementHistory"]
    assert (h["generation"], h["decidedAtStep"]) == (1, 10)
    assert h["predictedCrossGroupBytesAfter"] < h["predictedCrossGroupBytesBefore"]
    assert st["replan"]["decision"] == "Switch"
    wait_for(
        lambda: any(e.reason == C.R_PLACEMENT_UPDATED for e in events_for(kube, namespace, NAME)),
        timeout=60,
        message="the PlacementUpdated Event",
    )

    # the trainer applied generation 1 at step 15; at step 30 the routing is what it was at 10
    _publish(kube, namespace, drifted, 30, {"generation": 1, "appliedAtStep": 15})

    def checked():
        st = get_job(kube, namespace, NAME).get("status") or {}
        return (st.get("replan") or {}).get("checkedAtStep") == 30 and st

    st = wait_for(checked, timeout=120, message="the check at step 30")
    assert st["replan"]["decision"] == "Stay", st["replan"]
    assert st["placementHistory"][0]["appliedAtStep"] == 15
    assert len(st["placementHistory"]) == 1
    assert _placement(kube, namespace).generation == 1
    assert [e.reason for e in events_for(kube, namespace, NAME)].count(C.R_PLACEMENT_UPDATED) == 1
