"""reconcile.gate.check() paths that need no cluster: skip, disabled, launched jobs, API errors."""

from __future__ import annotations

import datetime as dt

import pytest
from kubernetes.client.rest import ApiException

from moejob_operator import constants as C
from moejob_operator.core import gate as G
from moejob_operator.reconcile import gate
from moejob_operator.reconcile.client import Client
from moejob_operator.reconcile.outcome import NotYet
from moejob_operator.reconcile.settings import Settings
from moejob_operator.spec import parse_spec

NOW = dt.datetime(2026, 11, 29, 14, 0, tzinfo=dt.UTC)
CFG = G.GateConfig(namespace="moe-system")


class ForbiddenClient:
    api = None

    def get_configmap(self, namespace, name):
        raise ApiException(status=403, reason="Forbidden")


def spec(**over):
    raw = {
        "image": "reg.io/trainer:1.0",
        "deepspeedVersion": "0.19.8",
        "model": {"preset": "tiny-mixtral"},
    }
    raw.update(over)
    return parse_spec(raw)


def body(status=None):
    return {"metadata": {"name": "j", "namespace": "ns", "uid": "u"}, "status": status or {}}


def test_api_errors_leave_the_job_waiting_with_the_reason():
    with pytest.raises(NotYet, match="namespace moe-system: 403 Forbidden") as exc:
        gate.check(ForbiddenClient(), body(), spec(), NOW, CFG)
    assert (exc.value.reason, exc.value.delay) == (C.R_GATE_PENDING, 30.0)


def test_skip_and_disabled_need_no_store():
    s = spec(gate={"skip": True, "skipReason": "hotfix"})
    v = gate.check(ForbiddenClient(), body(), s, NOW, CFG)
    assert v.reason == C.R_GATE_SKIPPED and "hotfix" in v.message
    off = gate.check(ForbiddenClient(), body(), spec(), NOW, G.GateConfig(enabled=False))
    assert off.reason == C.R_GATE_NOT_CONFIGURED


def test_a_launched_job_keeps_its_verdict():
    cond = {
        "type": C.COND_UPGRADE_VERIFIED,
        "status": "True",
        "reason": G.R_SMOKE_TEST_PASSED,
        "message": "m",
    }
    v = gate.check(
        ForbiddenClient(),
        body({"launchedSpec": {"image": "x"}, "conditions": [cond]}),
        spec(),
        NOW,
        CFG,
    )
    assert (v.reason, v.message) == (G.R_SMOKE_TEST_PASSED, "m")


def test_bad_settings_are_reported_not_raised():
    """Invalid gate settings (read once at start-up) do not stop the operator: jobs that need
    the gate wait, naming the setting."""
    settings = Settings.from_env({"MOE_GATE_PASS_TTL_SECONDS": "a week"})
    assert isinstance(settings.gate, G.GateError)
    with pytest.raises(NotYet, match="MOE_GATE_PASS_TTL_SECONDS: 'a week'") as exc:
        gate.check(ForbiddenClient(), body(), spec(), NOW, settings.gate)
    assert (exc.value.reason, exc.value.delay) == (gate.R_GATE_MISCONFIGURED, 60.0)


# ---- a re-pushed tag: the pods run other bits than the verdict vouches for ----------------------
class GangClient:
    """Nodes, worker pods and the writes of one pass (no cluster)."""

    # the real ownership filters, over this fake's list_pods / get_configmap
    list_owned_pods = Client.list_owned_pods
    get_owned_configmap = Client.get_owned_configmap

    def __init__(self, pods):
        self.pods, self.patches, self.deleted, self.events = pods, [], [], []

    def list_nodes(self):
        return [{"metadata": {"name": "node-a"}}]

    def list_pods(self, namespace, selector):
        return self.pods

    def get_configmap(self, namespace, name):
        return None

    def patch_job_status(self, namespace, name, status):
        self.patches.append(status)

    def delete_pod(self, namespace, name, *, uid=None, **kw):
        self.deleted.append(name)

    def event(self, body, etype, reason, message):
        self.events.append((etype, reason, message))


def test_a_repushed_tag_stops_the_gang_and_gates_the_digest_the_pods_ran():
    from moejob_operator.reconcile import job as J

    verified, pushed = "sha256:" + "ab" * 32, "sha256:" + "cd" * 32
    s = spec(image="reg.io/trainer:1.0")
    pod = {
        "metadata": {
            "name": "j-worker-0",
            "uid": "p0",
            "labels": {C.LABEL_NODE_RANK: "0", C.LABEL_ATTEMPT: "0"},
            "ownerReferences": [{"uid": "u", "controller": True}],
        },
        "spec": {"nodeName": "node-a"},
        "status": {
            "phase": "Running",
            "containerStatuses": [
                {
                    "image": "reg.io/trainer:1.0",
                    "imageID": f"docker-pullable://reg.io/trainer@{pushed}",
                }
            ],
        },
    }
    cond = {
        "type": C.COND_UPGRADE_VERIFIED,
        "status": "True",
        "reason": G.R_SMOKE_TEST_PASSED,
        "message": "m",
    }
    job = {
        "metadata": {"name": "j", "namespace": "ns", "uid": "u", "generation": 1},
        "spec": {},
        "status": {
            "launchedSpecHash": "h",
            "attempt": 0,
            "verifiedDigest": verified,
            "conditions": [cond],
        },
    }
    plan = {"ranks": [{"rank": 0, "node": "node-a", "nodeRank": 0}]}
    client = GangClient([pod])
    p = J.Pass(client, job, NOW, Settings())
    assert J._track(p, s, plan) == 1.0
    status = client.patches[-1]
    assert (
        status["gateDigest"] == pushed
        and status["verifiedDigest"] is None
        and status["attempt"] == 1
    )
    up = next(c for c in status["conditions"] if c["type"] == C.COND_UPGRADE_VERIFIED)
    assert (up["status"], up["reason"]) == ("Unknown", gate.R_IMAGE_DIGEST_CHANGED)
    assert pushed in up["message"] and verified in up["message"]
    assert client.deleted == ["j-worker-0"]
    assert [(e[0], e[1]) for e in client.events] == [("Warning", gate.R_IMAGE_DIGEST_CHANGED)]
    # the next gate check tests the pushed bits: the identity is pinned to that digest
    ident = gate.identity_of({"status": status}, s, None)
    assert (
        ident.image == f"reg.io/trainer@{pushed}"
        and ident.key != gate.identity_of(job, s, None).key
    )
    with pytest.raises(NotYet, match="403"):  # not the launched job's old True
        gate.check(ForbiddenClient(), {**job, "status": status}, s, NOW, CFG)
    # pods on the verified digest: nothing happens
    same = dict(
        pod,
        status={
            "phase": "Running",
            "containerStatuses": [{"imageID": f"reg.io/trainer@{verified}"}],
        },
    )
    quiet = GangClient([same])
    J._track(J.Pass(quiet, job, NOW, Settings()), s, plan)
    assert not quiet.deleted and not any(e[1] == gate.R_IMAGE_DIGEST_CHANGED for e in quiet.events)
