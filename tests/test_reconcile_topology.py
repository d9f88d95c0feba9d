"""reconcile.topology.ensure_reports against a small in-memory client (no cluster): the decisions
about discovery pods that a cluster test can only hit by timing."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest

from moejob_operator import constants as C
from moejob_operator.builders import discovery as D
from moejob_operator.reconcile.outcome import NotYet
from moejob_operator.reconcile.topology import ensure_reports
from moejob_operator.spec import parse_spec

FIXTURE = (
    Path(__file__).parents[1]
    / "operator/moejob_operator/core/fixtures/topology/nvswitch-h100-8.json"
)
NOW = dt.datetime(2026, 11, 29, 12, 0, tzinfo=dt.UTC)


def node(name: str) -> dict:
    return {
        "metadata": {"name": name, "labels": {}},
        "status": {"conditions": [{"type": "Ready", "status": "True"}], "nodeInfo": {}},
    }


def report_cm(name: str) -> dict:
    doc = json.loads(FIXTURE.read_text())
    doc.update(
        node=name, collectedAt=(NOW - dt.timedelta(seconds=5)).isoformat().replace("+00:00", "Z")
    )
    return {
        "metadata": {"name": D.topology_configmap_name(name)},
        "data": {C.TOPOLOGY_KEY: json.dumps(doc)},
    }


class Client:
    """What ensure_reports calls; ``cached`` answers the cached read (possibly stale)."""

    def __init__(self, cached: dict, fresh: dict, pods: list[dict]):
        self.cached, self.fresh, self.pods = cached, fresh, pods
        self.created, self.deleted = [], []

    def list_nodes(self):
        return [node("node-a"), node("node-b")]

    def get_configmap_cached(self, namespace, name):
        return self.cached.get(name)

    def get_configmap(self, namespace, name):
        return self.fresh.get(name)

    def list_pods(self, namespace, selector):
        return self.pods

    def create(self, obj):
        self.created.append(obj)
        return True

    def delete_pod(self, namespace, name, *, uid=None, **_):
        self.deleted.append(name)


def job_body() -> dict:
    spec = {
        "image": "img",
        "device": "CPU",
        "model": {"preset": "tiny-mixtral"},
        "nodes": {"count": 2, "gpusPerNode": 1},
    }
    return {
        "apiVersion": C.API_VERSION,
        "kind": C.KIND,
        "metadata": {"name": "j", "namespace": "ns", "uid": "u-1"},
        "spec": spec,
    }


def succeeded_pod(name: str) -> dict:
    return {
        "metadata": {"name": D.discovery_pod_name(name), "uid": f"uid-{name}"},
        "status": {
            "phase": "Succeeded",
            "containerStatuses": [{"state": {"terminated": {"exitCode": 0}}}],
        },
    }


def test_a_succeeded_pod_whose_report_the_cache_has_not_seen_is_not_rerun():
    """Discovery publishes, then exits: a pass may see the pod Succeeded while its cached read of
    the report is older. The report is re-read; the pod is neither deleted nor re-created."""
    names = [D.topology_configmap_name(n) for n in ("node-a", "node-b")]
    fresh = {names[0]: report_cm("node-a"), names[1]: report_cm("node-b")}
    client = Client(cached={names[1]: fresh[names[1]]}, fresh=fresh, pods=[succeeded_pod("node-a")])
    body = job_body()
    found = ensure_reports(client, body, parse_spec(body["spec"]), NOW)
    assert set(found.reports) == {"node-a", "node-b"}
    assert client.deleted == []
    assert not [o for o in client.created if o["kind"] == "Pod"]


def test_a_succeeded_pod_without_any_report_is_rerun():
    names = [D.topology_configmap_name(n) for n in ("node-a", "node-b")]
    fresh = {names[1]: report_cm("node-b")}
    client = Client(cached=dict(fresh), fresh=fresh, pods=[succeeded_pod("node-a")])
    body = job_body()
    with pytest.raises(NotYet, match=r"discovery running on node-a") as exc:
        ensure_reports(client, body, parse_spec(body["spec"]), NOW)
    assert (exc.value.reason, exc.value.delay, exc.value.failed) == (
        C.R_DISCOVERY_PENDING,
        1.0,
        False,
    )
    assert client.deleted == [D.discovery_pod_name("node-a")]


def test_reports_are_parsed_once_per_configmap_version(monkeypatch):
    """Every pass reads the same reports: parse each (uid, resourceVersion) once."""
    import json as _json

    from moejob_operator.core.topology import load_topology
    from moejob_operator.reconcile import topology as T

    calls = []
    real = T.parse_topology
    monkeypatch.setattr(T, "parse_topology", lambda doc: calls.append(1) or real(doc))
    monkeypatch.setattr(T, "_parsed", {})
    doc = load_topology("nvswitch-h100-8").model_dump(mode="json", by_alias=True)
    cm = {
        "metadata": {"uid": "u1", "resourceVersion": "7"},
        "data": {C.TOPOLOGY_KEY: _json.dumps(doc)},
    }
    first = T._parse_cached(cm)
    assert T._parse_cached(cm) is first and len(calls) == 1
    cm2 = {**cm, "metadata": {"uid": "u1", "resourceVersion": "8"}}
    assert T._parse_cached(cm2) == first and len(calls) == 2
    bad = {"metadata": {"uid": "u2", "resourceVersion": "1"}, "data": {C.TOPOLOGY_KEY: "{nope"}}
    assert T._parse_cached(bad) is None and T._parse_cached(bad) is None and len(calls) == 2
