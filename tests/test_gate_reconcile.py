"""reconcile.gate.check() paths that need no cluster: skip, disabled, launched jobs, API errors."""

from __future__ import annotations

import datetime as dt

import pytest
from kubernetes.client.rest import ApiException

import plan_fixtures
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
    plan = plan_fixtures.plan(nodes=("node-a",))
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


# ---- objects with the smoke test's names that the gate did not make ---------------------------
class _Resp:
    def __init__(self, doc):
        import json

        self.data = json.dumps(doc).encode()


class StoreClient:
    """A namespace holding ``jobs``, ``pods`` and ``configmaps``, as the Store reads them."""

    api = None

    def __init__(self, jobs=(), pods=(), configmaps=()):
        self.jobs = {j["metadata"]["name"]: j for j in jobs}
        self.pods, self.configmaps = list(pods), {c["metadata"]["name"]: c for c in configmaps}
        self.deleted = []

    # Client
    def list_pods(self, namespace, labels):
        return [p for p in self.pods if labels.items() <= p["metadata"]["labels"].items()]

    def get_configmap(self, namespace, name):
        return self.configmaps.get(name)

    def create(self, obj):
        name = obj["metadata"]["name"]
        if name in self.configmaps:
            return False
        self.configmaps[name] = obj
        return True

    def delete_configmap(self, namespace, name):
        self.deleted.append(("ConfigMap", name))

    # BatchV1Api
    def read_namespaced_job(self, name, namespace, _preload_content=False):
        if name not in self.jobs:
            raise ApiException(status=404, reason="Not Found")
        return _Resp(self.jobs[name])

    def list_namespaced_job(self, namespace, label_selector="", _preload_content=False):
        return _Resp({"items": list(self.jobs.values())})

    def delete_namespaced_job(self, name, namespace, **_):
        self.deleted.append(("Job", name))


def _store(client):
    from moejob_operator.reconcile.gate_store import Store

    store = Store(client, CFG.namespace)
    store.batch = client
    return store


def _smoke(identity, *, image=None, command=None, finished=True):
    from moejob_operator.builders.smoke import smoke_job

    job = smoke_job(identity, 1, CFG)
    job["metadata"]["uid"] = "job-uid"
    (c,) = job["spec"]["template"]["spec"]["containers"]
    c["image"] = image or c["image"]
    c["command"] = command or c["command"]
    if finished:
        job["status"] = {
            "completionTime": "2026-11-29T12:00:00Z",
            "conditions": [{"type": "Complete", "status": "True"}],
        }
    return job


def _pod(name, job_name, controller_uid, message):
    refs = [{"kind": "Job", "name": job_name, "uid": controller_uid, "controller": True}]
    return {
        "metadata": {
            "name": name,
            "labels": {"job-name": job_name},
            "ownerReferences": refs if controller_uid else [],
            "creationTimestamp": "2026-11-29T11:00:00Z" if controller_uid else "2026-11-29T11:59Z",
        },
        "status": {
            "phase": "Succeeded",
            "containerStatuses": [
                {"state": {"terminated": {"exitCode": 0, "message": message}}, "imageID": ""}
            ],
        },
    }


def test_a_job_with_the_smoke_tests_name_that_the_gate_did_not_make_is_a_conflict():
    from moejob_operator.reconcile.gate_store import GateConflict, sweep_smoke_jobs

    ident = G.identity_for("reg.io/trainer:1.0", "0.19.8", "CPU", None)
    name = G.smoke_job_name(ident, 1)
    for forged in (
        _smoke(ident, image="busybox:latest"),
        _smoke(ident, command=["sh", "-c", "echo passed"]),
    ):
        client = StoreClient(jobs=[forged])
        with pytest.raises(GateConflict, match=f"Job moe-system/{name} has the smoke test's name"):
            _store(client).observe(name, ident, CFG)
        # finished long ago, but not the gate's: the sweep never deletes it
        assert sweep_smoke_jobs(client, CFG, NOW, batch=client) == [] and not client.deleted
    # the gate's own Job: observed, and swept once finished and unrecorded past the keep time
    client = StoreClient(jobs=[_smoke(ident)])
    assert _store(client).observe(name, ident, CFG).name == name
    assert sweep_smoke_jobs(client, CFG, NOW, batch=client) == [name]


def test_only_pods_the_smoke_job_controls_are_its_result():
    ident = G.identity_for("reg.io/trainer:1.0", "0.19.8", "CPU", None)
    name = G.smoke_job_name(ident, 1)
    real = _pod("real", name, "job-uid", "the real verdict")
    forged = _pod("forged", name, None, "a forged verdict")  # the Job's labels, no controller
    obs = _store(StoreClient(jobs=[_smoke(ident)], pods=[real, forged])).observe(name, ident, CFG)
    assert obs.message == "the real verdict"


def test_plans_of_the_smoke_tests_name_that_are_not_the_gates_are_a_conflict():
    from moejob_operator.builders.smoke import PLANS_KEY, smoke_plans_configmap
    from moejob_operator.core import smoke_plans as SP
    from moejob_operator.reconcile.gate_store import GateConflict

    ident = G.identity_for("reg.io/trainer:1.0", "0.19.8", "CPU", None)
    plans = SP.smoke_plans("cpu")
    ours = smoke_plans_configmap(ident, 1, CFG, plans)
    _store(StoreClient(configmaps=[ours])).create_plans(ident, 1, CFG, plans)  # shared: fine
    forged = dict(ours, data={PLANS_KEY: '{"cases": []}'})
    with pytest.raises(GateConflict, match="not the plans this gate wrote"):
        _store(StoreClient(configmaps=[forged])).create_plans(ident, 1, CFG, plans)


def test_a_conflict_leaves_the_job_waiting_with_the_reason(monkeypatch):
    import moejob_operator.reconcile.gate_store as gs

    ident = gate.identity_of(body(), spec(), None)
    client = StoreClient(jobs=[_smoke(ident, image="busybox:latest", finished=False)])
    real_init = gs.Store.__init__

    def init(self, c, ns):
        real_init(self, c, ns)
        self.batch = c  # the fake namespace's Jobs

    monkeypatch.setattr(gs.Store, "__init__", init)
    # no verdict stored: the gate looks at attempt 1's Job, which is not its own
    with pytest.raises(NotYet) as exc:
        gate.check(client, body(), spec(), NOW, CFG)
    assert exc.value.reason == gate.R_SMOKE_JOB_CONFLICT and "busybox:latest" in exc.value.message
    assert not client.deleted
