"""Trust boundaries without a cluster (docs/security.md): how a hostPath is mounted, how the
node agent resolves a subPath the way the kubelet does, and which worker pods a job counts.
The same holes through the real API server and operator: test_trust_cluster.py."""

from __future__ import annotations

import datetime as dt
import json
import re

import pytest
import yaml

from moe_localkube.podfiles import ConfigError, container_mounts
from moejob_operator import admission
from moejob_operator import constants as C
from moejob_operator.builders import common, workers
from moejob_operator.reconcile import gang
from moejob_operator.reconcile import job as J
from moejob_operator.reconcile.client import Client, controller_uid
from moejob_operator.reconcile.settings import Settings
from moejob_operator.spec import parse_spec
from test_builders import ROOT

JOB = common.JobRef(namespace="ns", name="j", uid="job-uid")
NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def _spec(ckpt: str):
    raw = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())["spec"]
    raw["checkpoint"]["volume"] = {"hostPath": {"path": ckpt}}
    return parse_spec(raw)


def _checkpoint_mount(spec):
    pod = workers.worker_pod(JOB, spec, node_rank=0, node="n", attempt=0, spec_hash="h")
    vols = {v["name"]: v for v in pod["spec"]["volumes"]}
    mount = next(
        m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == "checkpoint"
    )
    return vols["checkpoint"]["hostPath"], mount


def test_a_host_path_is_its_allowed_prefix_plus_a_sub_path():
    """The kubelet resolves a subPath inside its volume and refuses one a symlink takes out, so
    the volume is the admin's prefix (the longest that applies), never the user's path."""
    spec = _spec("/srv/jobs/team-a/link/ckpt")
    policy = admission.Policy(host_path_prefixes=("/srv", "/srv/jobs"))
    admission.check("j", {}, spec, policy)
    host, mount = _checkpoint_mount(spec)
    assert host["path"] == "/srv/jobs"
    assert mount["subPath"] == "team-a/link/ckpt"

    exact = _spec("/srv/jobs")
    admission.bind_host_paths(exact, policy)
    host, mount = _checkpoint_mount(exact)
    assert host["path"] == "/srv/jobs" and "subPath" not in mount


def test_a_host_path_admission_did_not_bind_is_never_mounted():
    with pytest.raises(ValueError, match="not admitted"):
        _checkpoint_mount(_spec("/srv/jobs/x"))
    with pytest.raises(admission.SpecError, match=r"hostPathPolicy\.allowedPrefixes"):
        admission.bind_host_paths(_spec("/etc"), admission.Policy(host_path_prefixes=("/srv",)))


def test_the_node_agent_refuses_a_sub_path_a_symlink_takes_outside_its_volume(tmp_path):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "escape").symlink_to(outside)
    (allowed / "real").mkdir()
    (allowed / "inside").symlink_to(allowed / "real")
    container = {"name": "c", "volumeMounts": [{"name": "v", "mountPath": "/m", "subPath": ""}]}

    def mount(sub: str):
        container["volumeMounts"][0]["subPath"] = sub
        return container_mounts(container, {"v": allowed})

    with pytest.raises(ConfigError, match="not within volume path"):
        mount("escape/ckpt")
    with pytest.raises(ConfigError, match="not within volume path"):
        mount("escape")
    with pytest.raises(ConfigError, match="relative path"):
        mount("../outside")
    assert mount("inside/ckpt")[0].source == allowed / "inside" / "ckpt"
    assert list(outside.iterdir()) == []


class PodsClient:
    """Worker pods and the writes of one pass (no cluster)."""

    list_owned_pods = Client.list_owned_pods

    def __init__(self, pods):
        self.pods, self.patches, self.deleted, self.events = pods, [], [], []

    def list_pods(self, namespace, selector):
        return self.pods

    def list_nodes(self):
        return [{"metadata": {"name": "node-a"}}, {"metadata": {"name": "node-b"}}]

    def get_owned_configmap(self, namespace, name, uid):
        return None

    def patch_job_status(self, namespace, name, status):
        self.patches.append(status)

    def delete_pod(self, namespace, name, *, uid=None, **kw):
        self.deleted.append(name)

    def event(self, body, etype, reason, message):
        self.events.append((etype, reason, message))


def _worker(name: str, rank: int, phase: str, owner: str | None) -> dict:
    meta = {
        "name": name,
        "uid": f"uid-{name}",
        "labels": {
            C.LABEL_JOB: JOB.name,
            C.LABEL_COMPONENT: "worker",
            C.LABEL_NODE_RANK: str(rank),
            C.LABEL_ATTEMPT: "0",
        },
    }
    if owner:
        meta["ownerReferences"] = [{"uid": owner, "controller": True}]
    state = {"terminated": {"exitCode": 1}} if phase == "Failed" else {"running": {}}
    return {
        "metadata": meta,
        "spec": {"nodeName": f"node-{'ab'[rank]}"},
        "status": {"phase": phase, "containerStatuses": [{"name": "trainer", "state": state}]},
    }


def test_a_pod_with_the_workers_labels_but_not_the_jobs_owner_reference_counts_for_nothing():
    """A neighbour's failed pod labelled like rank 0 neither fails the job nor gets deleted, and
    the job says it ignored it."""
    spec = _spec("/tmp/x")
    admission.bind_host_paths(spec, admission.Policy(host_path_prefixes=("/tmp",)))
    pods = [
        _worker("a-intruder", 0, "Failed", None),
        _worker("j-worker-0", 0, "Running", JOB.uid),
        _worker("j-worker-1", 1, "Running", JOB.uid),
    ]
    job = {
        "metadata": {"name": JOB.name, "namespace": JOB.namespace, "uid": JOB.uid},
        "spec": {},
        "status": {"attempt": 0, "gangComplete": 0, "launchedSpecHash": "h"},
    }
    plan = {
        "ranks": [
            {"rank": 0, "node": "node-a", "nodeRank": 0},
            {"rank": 1, "node": "node-b", "nodeRank": 1},
        ]
    }
    client = PodsClient(pods)
    p = J.Pass(client, job, NOW, Settings())
    J._track(p, spec, plan)
    p.flush()
    status = client.patches[-1]
    assert client.deleted == []
    assert status["workers"]["running"] == 2 and not status["workers"].get("failed")
    assert status["foreignPods"] == ["a-intruder"]
    assert C.R_FOREIGN_PODS_IGNORED in [e[1] for e in client.events]
    failed = [c for c in status["conditions"] if c["type"] == C.COND_FAILED]
    assert not failed or failed[0]["status"] != "True"


def test_controller_uid_reads_only_the_controller_reference():
    assert controller_uid({"metadata": {"ownerReferences": [{"uid": "x"}]}}) is None
    refs = [{"uid": "x"}, {"uid": "y", "controller": True}]
    assert controller_uid({"metadata": {"ownerReferences": refs}}) == "y"
    assert controller_uid(None) is None


class ProgressClient(PodsClient):
    def __init__(self, progress: str):
        super().__init__([])
        self.progress = progress

    def get_owned_configmap(self, namespace, name, uid):
        return {"data": {C.PROGRESS_KEY: self.progress}}


def _progress_pass(progress: str):
    job = {"metadata": {"name": JOB.name, "namespace": JOB.namespace, "uid": JOB.uid}}
    client = ProgressClient(progress)
    return client, J.Pass(client, job, NOW, Settings())


def test_a_flood_of_health_findings_posts_a_bounded_number_of_events():
    """Code in the user's image can write any progress document: thousands of findings (and
    unknown types) become at most a few Events a pass plus one aggregate, each reason one the
    operator knows."""
    findings = [
        {"type": "DeadExpert" if i % 2 else "Made-Up Reason!", "message": f"finding {i}"}
        for i in range(5000)
    ]
    findings += findings[:100]  # duplicates
    doc = {"kind": "TrainerProgress", "version": 1, "phase": "Training", "step": 1}
    doc.update(totalSteps=2, health=findings)
    client, p = _progress_pass(json.dumps(doc))
    gang._progress(p)
    p.flush()
    one_each = [e for e in client.events if re.fullmatch(r"finding \d+", e[2])]
    aggregate = [e for e in client.events if "more new health finding" in e[2]]
    assert len(one_each) == gang.MAX_HEALTH_EVENTS and len(aggregate) == 1, client.events
    assert len(client.events) <= gang.MAX_HEALTH_EVENTS + 2  # + the Healthy=False transition
    assert {e[1] for e in client.events} <= {"DeadExpert", C.R_HEALTH_FINDINGS}
    assert len(client.patches[-1]["health"]) <= 20


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000 + "]" * 100_000,  # nested past the parser's recursion
        json.dumps({"kind": "TrainerProgress", "version": 1, "pad": "x" * (2 << 20)}),
    ],
    ids=["deep", "large"],
)
def test_a_hostile_progress_document_is_ignored_not_a_crash(text):
    client, p = _progress_pass(text)
    gang._progress(p)
    p.flush()
    assert "progress" not in (client.patches[-1] if client.patches else {})
