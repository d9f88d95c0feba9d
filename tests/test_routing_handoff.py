"""Routing statistics from one job to the next plan (trainer -> ConfigMap -> operator).

Unit part (no cluster): what the planning step does when the source ConfigMap is empty (wait,
bounded) and when the statistics will never come (source Failed, or Succeeded without them).
Cluster part: job A trains and publishes; job B (suspended, never trains) plans from A's stats.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest

from moe_contracts.progress import progress_doc
from moejob_operator import constants as C
from moejob_operator.builders.common import JobRef
from moejob_operator.reconcile import planning
from moejob_operator.spec import parse_spec
from operator_harness import module_operator

NOW = dt.datetime(2026, 11, 29, 14, 0, 0, tzinfo=dt.UTC)


def iso(seconds_ago: float) -> str:
    return (NOW - dt.timedelta(seconds=seconds_ago)).strftime("%Y-%m-%dT%H:%M:%SZ")


class FakeClient:
    def __init__(self, configmaps=None, jobs=None):
        self.configmaps, self.jobs = configmaps or {}, jobs or {}

    def get_configmap(self, namespace, name):
        return self.configmaps.get(name)

    def get_job(self, namespace, name):
        return self.jobs.get(name)


def job_b(**source):
    spec = parse_spec(
        {
            "image": "moe-trainer:local",
            "device": "CPU",
            "model": {"preset": "tiny-mixtral"},
            "nodes": {"count": 1},
            "placement": {"strategy": "TopologyAware", "routingStatsFrom": source},
        }
    )
    return JobRef.from_body({"metadata": {"name": "b", "namespace": "ns", "uid": "u" * 36}}), spec


def body(created_ago: float, *conds, completion_ago: float | None = None, phase="Running"):
    status = {
        "phase": phase,
        "conditions": [
            {
                "type": t,
                "status": s,
                "reason": r,
                "message": m,
                "lastTransitionTime": iso(created_ago / 2),
            }
            for t, s, r, m in conds
        ],
    }
    if completion_ago is not None:
        status["completionTime"] = iso(completion_ago)
    return {"metadata": {"creationTimestamp": iso(created_ago)}, "status": status}


def read(client, **source):
    job, spec = job_b(**source)
    return planning.read_routing_stats(client, job, spec, now=NOW)


def test_source_still_training_is_a_bounded_wait():
    client = FakeClient(jobs={"a": body(600), "b": body(100)})
    with pytest.raises(
        planning.NotYet,
        match=r"waiting for source job a \(phase Running\).*waited 100 s of 86400 s",
    ) as exc:
        read(client, jobName="a")
    assert exc.value.reason == C.R_ROUTING_STATS_UNAVAILABLE and exc.value.delay == 30.0
    client.jobs["b"] = body(planning.SOURCE_ACTIVE_WAIT_SECONDS + 5)
    with pytest.raises(planning.Refused, match=r"gave up after 86405 s \(limit 86400 s\)"):
        read(client, jobName="a")


def test_missing_source_job_waits_less():
    client = FakeClient(jobs={"b": body(60)})
    with pytest.raises(planning.NotYet, match=r"source job nope .* does not exist"):
        read(client, jobName="nope")
    client.jobs["b"] = body(planning.SOURCE_MISSING_WAIT_SECONDS + 1)
    with pytest.raises(planning.Refused, match=r"does not exist .*gave up"):
        read(client, jobName="nope")


def test_failed_source_job_is_permanent_at_once():
    client = FakeClient(
        jobs={
            "b": body(10),
            "a": body(600, ("Failed", "True", "BackoffLimitExceeded", "3 restarts")),
        }
    )
    with pytest.raises(
        planning.Refused,
        match=r"source job a failed .BackoffLimitExceeded: 3 restarts. and will "
        "never publish",
    ) as exc:
        read(client, jobName="a")
    assert exc.value.reason == C.R_ROUTING_STATS_UNAVAILABLE


def test_succeeded_source_without_stats_quotes_its_trainer():
    progress = dict(
        progress_doc(
            phase="Finished",
            step=20,
            total_steps=20,
            loss=1.0,
            tokens_per_second=1.0,
            eta_seconds=0.0,
            checkpoint=None,
            moe={},
            health=[],
        ),
        routingStats={
            "message": "routing statistics too large for ConfigMap a-routing-stats: 4749633 bytes"
        },
    )
    client = FakeClient(
        jobs={
            "b": body(10),
            "a": body(600, ("Succeeded", "True", "Finished", "done"), completion_ago=3),
        },
        configmaps={
            "a-progress": {"data": {C.PROGRESS_KEY: json.dumps(progress)}},
            "a-routing-stats": {"data": {}},
        },
    )
    with pytest.raises(planning.NotYet, match="succeeded; waiting"):  # grace: publish precedes exit
        read(client, jobName="a")
    client.jobs["a"] = body(600, ("Succeeded", "True", "Finished", "done"), completion_ago=120)
    with pytest.raises(
        planning.Refused,
        match=r"succeeded but .* no routing statistics; its trainer reported: "
        "routing statistics too large",
    ):
        read(client, jobName="a")


def test_config_map_name_source_and_bad_payloads():
    client = FakeClient(
        jobs={"b": body(10)},
        configmaps={"mine": {"binaryData": {"routing_stats.json.gz": "bm90IGd6"}}},
    )
    with pytest.raises(
        planning.SpecError, match=r"ConfigMap ns/mine: binaryData.routing_stats.json.gz is not gzip"
    ):
        read(client, configMapName="mine")
    client.configmaps["mine"] = {
        "data": {C.ROUTING_STATS_KEY: '{"kind": "RoutingStats", "version": 3}'}
    }
    with pytest.raises(planning.SpecError, match=r"ns/mine: .*version"):
        read(client, configMapName="mine")
    del client.configmaps["mine"]
    with pytest.raises(planning.NotYet, match=r"ConfigMap ns/mine has no routing_stats.json yet"):
        read(client, configMapName="mine")


# ---- cluster: A trains and publishes, B plans from it --------------------------------------
operator_proc = module_operator()


@pytest.mark.cluster
@pytest.mark.slow
def test_job_b_plans_from_job_a_statistics(
    kube, kubectl, namespace, operator_proc, wait_for, tmp_path
):
    from moe_contracts.routing import decode_configmap
    from operator_harness import apply_job, condition, example, get_job

    a = example(
        "tiny-cpu.yaml",
        checkpoint={"everySteps": 2, "volume": {"hostPath": {"path": str(tmp_path)}}},
    )
    a["metadata"]["name"] = "stats-a"
    a["spec"]["training"]["steps"] = 2
    apply_job(kube, namespace, a)
    out = kubectl.run(
        "wait",
        "--for=condition=Succeeded",
        "moejob/stats-a",
        "-n",
        namespace,
        "--timeout=400s",
        check=False,
        timeout=420,
    )
    assert out.returncode == 0, (
        f"{out.stderr}\n{get_job(kube, namespace, 'stats-a').get('status')}\n{operator_proc.logs()}"
    )
    cm = kube.core.read_namespaced_config_map("stats-a-routing-stats", namespace).to_dict()
    stats = decode_configmap({"data": cm.get("data"), "binaryData": cm.get("binary_data")})
    assert stats is not None, cm
    assert stats.steps == 2 and stats.num_experts == 8 and stats.tokens > 0
    progress = json.loads(
        kube.core.read_namespaced_config_map("stats-a-progress", namespace).data[C.PROGRESS_KEY]
    )
    assert progress["routingStats"]["published"] is True and progress["routingStats"]["step"] == 2

    b = example(
        "tiny-cpu.yaml",
        placement={
            "strategy": "TopologyAware",
            "expertParallelSize": 2,
            "routingStatsFrom": {"jobName": "stats-a"},
        },
    )
    b["metadata"]["name"] = "stats-b"
    b["spec"].setdefault("runPolicy", {})["suspend"] = True
    apply_job(kube, namespace, b)
    wait_for(
        lambda: (
            condition(get_job(kube, namespace, "stats-b"), C.COND_PLANNED).get("status") == "True"
        ),
        timeout=120,
        message="B planned\n" + operator_proc.logs(),
    )
    plan = json.loads(
        kube.core.read_namespaced_config_map("stats-b-plan", namespace).data[C.PLAN_KEY]
    )
    placement = plan["placement"]
    assert placement["routingStatsFrom"]["job"] == "stats-a"
    assert placement["routingStatsFrom"]["tokens"] == stats.tokens
    assert placement["quality"]["basis"] == "routingStats"
    contiguous = [list(range(8)) for _ in range(placement["numLayers"])]
    assert placement["permutation"] != contiguous
    assert get_job(kube, namespace, "stats-b")["status"]["plan"]["routingStatsFrom"] == "stats-a"
    pods = kube.core.list_namespaced_pod(
        namespace, label_selector=f"{C.LABEL_JOB}=stats-b,{C.LABEL_COMPONENT}=worker"
    ).items
    assert pods == []


@pytest.mark.cluster
def test_gzip_and_json_patches_with_the_worker_scoped_token(
    kube, namespace, control_plane, tmp_path, monkeypatch
):
    """The real API server takes both encodings (and the nulls that clear the other key) from a
    token that may only get/update/patch the ConfigMap; the operator's reader reads them back."""
    import base64
    from urllib.parse import urlparse

    from moe_contracts.env import ROUTING_STATS_GZ_KEY as GZ_KEY
    from moe_contracts.env import ROUTING_STATS_KEY as KEY
    from moe_contracts.routing import configmap_text
    from moe_trainer.telemetry import progress
    from moe_trainer.telemetry.routing_publish import RoutingStatsPublisher
    from test_trainer_routing_publish import stats_doc

    name = "a-routing-stats"
    kube.core.create_namespaced_config_map(namespace, {"metadata": {"name": name}, "data": {}})
    kube.rbac.create_namespaced_role(
        namespace,
        {
            "metadata": {"name": "stats"},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["configmaps"],
                    "resourceNames": [name],
                    "verbs": ["get", "update", "patch"],
                }
            ],
        },
    )
    kube.rbac.create_namespaced_role_binding(
        namespace,
        {
            "metadata": {"name": "stats"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "stats"},
            "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": namespace}],
        },
    )
    secret = kube.core.read_namespaced_service_account("default", namespace).secrets[0].name
    (tmp_path / "token").write_text(
        base64.b64decode(kube.core.read_namespaced_secret(secret, namespace).data["token"]).decode()
    )
    (tmp_path / "namespace").write_text(namespace)
    (tmp_path / "ca.crt").write_bytes(Path(control_plane.ca_path).read_bytes())
    url = urlparse(control_plane.server)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", url.hostname)
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(url.port))
    doc = stats_doc(experts=16)

    def stored():
        cm = kube.core.read_namespaced_config_map(name, namespace)
        return {"data": cm.data or {}, "binaryData": cm.binary_data or {}}

    for limit, key in ((1000, GZ_KEY), (10**6, KEY), (1000, GZ_KEY)):
        pub = RoutingStatsPublisher(progress.ConfigMapPublisher(name, sa_dir=tmp_path), limit=limit)
        status = pub.publish(doc, step=3, file_path=None)
        assert status["published"] and status["key"] == key, status
        cm = stored()
        assert set(cm["data"]) | set(cm["binaryData"]) == {key}  # the other key was cleared
        got = json.loads(configmap_text(cm))
        assert got == doc
