"""Finished smoke Jobs are deleted once their verdict is stored and they are older than the keep
time (batch/v1 on 1.20 has no ttlSecondsAfterFinished), and so are orphans nobody recorded past
the keep time (their last waiting job was deleted); running ones and recent ones stay."""

from __future__ import annotations

import datetime as dt
import json
from types import SimpleNamespace

from kubernetes import client as k8s

from moejob_operator import constants as C
from moejob_operator.builders.smoke import SMOKE_COMMAND
from moejob_operator.core import gate as G
from moejob_operator.reconcile import gate as RG

NOW = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)


def stamp(hours_ago: float) -> str:
    return (NOW - dt.timedelta(hours=hours_ago)).strftime("%Y-%m-%dT%H:%M:%SZ")


def smoke_job(name: str, finished_hours_ago: float | None, kind: str = "Complete") -> dict:
    status = {}
    if finished_hours_ago is not None:
        status = {
            "completionTime": stamp(finished_hours_ago),
            "conditions": [
                {"type": kind, "status": "True", "lastTransitionTime": stamp(finished_hours_ago)}
            ],
        }
    key = name.removeprefix(G.SMOKE_JOB_PREFIX).rpartition("-")[0]
    container = {"name": "smoke", "image": "x", "command": list(SMOKE_COMMAND)}
    pod = {"containers": [container], "volumes": [{"name": "plans", "configMap": {"name": name}}]}
    return {
        "metadata": {
            "name": name,
            "labels": {G.LABEL_GATE_KEY: key},
            "annotations": {f"{C.GROUP}/gate-image": "x"},
        },
        "spec": {"template": {"spec": pod}},
        "status": status,
    }


def verdict(key: str, attempt: int) -> dict:
    return {
        "data": {
            G.VERDICT_KEY: json.dumps(
                {
                    "kind": "GateVerdict",
                    "version": 1,
                    "identity": {"image": "x", "key": key},
                    "attempt": attempt,
                    "passed": True,
                    "failedCheck": None,
                    "message": "ok",
                    "smokeJob": f"moe-smoke-{key}-{attempt}",
                    "verifiedAt": stamp(3),
                    "expiresAt": stamp(-100),
                }
            )
        }
    }


class Batch:
    def __init__(self, jobs):
        self.jobs, self.deleted = jobs, []

    def list_namespaced_job(self, namespace, label_selector, _preload_content):
        return SimpleNamespace(data=json.dumps({"items": self.jobs}).encode())

    def delete_namespaced_job(self, name, namespace, propagation_policy, _preload_content):
        assert propagation_policy == "Background"  # its pod goes with it
        self.deleted.append(name)
        return SimpleNamespace(data=b"{}")


def test_sweep_deletes_old_finished_jobs_recorded_or_orphaned():
    config = G.GateConfig(enabled=True, namespace="gate-ns")
    store = {
        "moe-gate-aaaa": verdict("aaaa", 1),
        "moe-gate-bbbb": verdict("bbbb", 2),
        "moe-gate-dddd": {"data": {G.VERDICT_KEY: "not json"}},
    }
    client = SimpleNamespace(
        api=k8s.ApiClient(),
        get_configmap=lambda ns, name: store.get(name),
        delete_configmap=lambda ns, name: None,
    )  # the smoke plans ConfigMap
    forged = smoke_job("moe-smoke-gggg-1", 9)
    forged["spec"]["template"]["spec"]["containers"][0]["image"] = "busybox"
    batch = Batch(
        [
            smoke_job("moe-smoke-aaaa-1", 2),  # verdict stored, 2 h old: goes
            smoke_job("moe-smoke-bbbb-1", 5, "Failed"),  # superseded by attempt 2: goes
            smoke_job("moe-smoke-bbbb-2", 0.2),  # recent: stays (logs readable)
            smoke_job("moe-smoke-cccc-1", None),  # running: stays
            smoke_job("moe-smoke-dddd-1", 4),  # verdict unreadable, 4 h: an orphan, goes
            smoke_job("moe-smoke-eeee-1", 4),  # never recorded, 4 h: an orphan, goes
            smoke_job("moe-smoke-ffff-1", 0.1),  # not recorded yet, recent: stays
            smoke_job("moe-smoke-odd", 4),  # not ours by name: stays
            forged,  # a smoke Job's name, another image: not the gate's, never deleted
        ]
    )
    deleted = RG.sweep_smoke_jobs(client, config, NOW, batch=batch)
    assert deleted == batch.deleted
    assert deleted == [f"moe-smoke-{k}-1" for k in ("aaaa", "bbbb", "dddd", "eeee")]


def test_sweep_does_nothing_with_the_gate_off_or_misconfigured():
    batch = Batch([smoke_job("moe-smoke-aaaa-1", 9)])
    for config in (G.GateConfig(enabled=False), G.GateError("MOE_GATE_PASS_TTL_SECONDS: 'x'")):
        client = SimpleNamespace(api=k8s.ApiClient())
        assert RG.sweep_smoke_jobs(client, config, NOW, batch=batch) == []
    assert batch.deleted == []
