"""benchmarks/operator_floor.py: the floor replays what a real operator pass writes, in the pass's
batches (no cluster: the pass reads from an in-memory client)."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml
from kubernetes import client as k8s

from moejob_operator.reconcile import job as J
from test_deferred_launch import ROOT, SETTINGS, MemoryClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import operator_floor as F


def test_the_recorder_keeps_the_passs_writes_in_its_batches_and_the_uid_is_replaced():
    job = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
    job["metadata"] = {"name": "j", "namespace": "ns", "uid": "u-1", "generation": 1}
    rec = F.Recorder(k8s.ApiClient())
    mem = MemoryClient()
    rec.list_nodes = mem.list_nodes  # type: ignore[method-assign]
    rec.get_configmap = mem.get_configmap  # type: ignore[method-assign]
    rec.serves = mem.serves  # type: ignore[method-assign]  # gang Auto asks for Volcano
    J.reconcile(rec, "ns", "j", settings=SETTINGS, body=job)
    kinds = [[o["kind"] for o in b] for b in rec.batches]
    assert kinds == [
        ["ConfigMap", "ServiceAccount"],
        ["Pod", "Pod"],
        ["Role"],
        ["Service", "ConfigMap", "ConfigMap", "RoleBinding"],
        [F.STATUS],
    ]
    assert rec.batches[-1][0]["status"]["gangComplete"] == 0
    assert [e["reason"] for e in rec.events] == [
        "Discovered",
        "PlanReady",
        "GateNotConfigured",
        "WorkersCreated",
    ]
    writes = {"uid": "u-1", "batches": rec.batches, "events": rec.events}
    moved = F.with_uid(writes, "real-uid")
    pod = moved["batches"][1][0]
    assert pod["metadata"]["ownerReferences"][0]["uid"] == "real-uid"
    assert "u-1" not in str(moved["batches"])


def test_ratios_and_the_goal_count():
    runs = [
        {"ratios": {"p50Seconds": x, "p99Seconds": 1.0, "launchP50Seconds": 1.0}}
        | {side: dict.fromkeys(F.SUMMARY_KEYS, 1.0) for side in ("floor", "operator")}
        for x in (1.2, 2.0, 1.5)
    ]
    s = F.summarize(runs, "cmd")
    assert s["goalMetRuns"] == 2 and s["p50RatioMedian"] == 1.5
    assert F.ratio(3.0, 2.0) == 1.5 and F.ratio(1.0, None) is None
