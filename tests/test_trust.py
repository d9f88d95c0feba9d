"""Trust boundaries without a cluster (docs/security.md): how a hostPath is mounted, how the
node agent resolves a subPath the way the kubelet does, and which worker pods a job counts.
The same holes through the real API server and operator: test_trust_cluster.py."""

from __future__ import annotations

import datetime as dt
import json
import re

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import plan_fixtures
from moe_contracts.errors import DocumentError
from moe_contracts.progress import HEALTH_TYPES
from moe_contracts.routing import decode_configmap
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
    plan = plan_fixtures.plan(nodes=("node-a", "node-b"))
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


def test_the_same_findings_published_again_post_no_events_again():
    """The trainer republishes its progress every interval with the same findings: each set is
    announced once (status.healthDigest), not once a pass; a changed set is announced again."""
    findings = [{"type": "DeadExpert", "message": f"finding {i}"} for i in range(3000)]
    doc = {"kind": "TrainerProgress", "version": 1, "phase": "Training", "step": 1}
    doc.update(totalSteps=2, health=findings)
    client, p = _progress_pass(json.dumps(doc))
    gang._progress(p)
    p.flush()
    first = len(client.events)
    assert first == gang.MAX_HEALTH_EVENTS + 2  # + the Healthy=False transition
    status = client.patches[-1]
    for step, extra in ((2, []), (3, [{"type": "DeadExpert", "message": "a new one"}])):
        doc.update(step=step, health=extra + findings)  # only the first 1000 are read
        client.progress = json.dumps(doc)
        p = J.Pass(client, {**p.body, "status": status}, NOW, Settings())
        gang._progress(p)
        p.flush()
        status = client.patches[-1]
        if not extra:
            assert len(client.events) == first, client.events[first:]
    assert 1 <= len(client.events) - first <= gang.MAX_HEALTH_EVENTS + 1


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


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=30,
)
_progress_docs = st.fixed_dictionaries(
    {"kind": st.just("TrainerProgress"), "version": st.just(1)},
    optional={
        "phase": st.sampled_from(["Training", "Finished", "x"]) | _json,
        "step": st.integers(-1, 10) | _json,
        "totalSteps": st.integers(0, 10) | _json,
        "health": st.lists(
            st.fixed_dictionaries(
                {"type": st.text(max_size=12) | _json},
                optional={"severity": st.sampled_from(["Warning", "Info"]), "message": _json},
            ),
            max_size=40,
        )
        | _json,
        "moe": _json,
        "checkpoint": _json,
        "routingStats": _json,
        "output": _json,
    },
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=_progress_docs | _json)
def test_fuzzed_progress_documents_never_break_a_pass_or_flood_events(doc):
    """Whatever the trainer's code writes, the progress read neither raises nor posts more than
    the per-pass cap (+ the aggregate and the Healthy transition), and every reason is known."""
    client, p = _progress_pass(json.dumps(doc))
    gang._progress(p)
    p.flush()
    assert len(client.events) <= gang.MAX_HEALTH_EVENTS + 2
    known = {*HEALTH_TYPES, C.R_HEALTH_FINDINGS, C.R_NO_FINDINGS, C.R_NO_PROGRESS_YET}
    assert {e[1] for e in client.events} <= known


@settings(max_examples=100, deadline=None)
@given(owners=st.lists(st.sampled_from([None, JOB.uid, "other-uid"]), min_size=1, max_size=6))
def test_only_pods_the_job_controls_are_counted_or_deleted(owners):
    """Pods with the worker labels and any mix of owners: the job's decision depends only on its
    own pods (every foreign one is named, none deleted)."""
    pods = [_worker(f"p{i}", i % 2, "Failed", owner) for i, owner in enumerate(owners)]
    client = PodsClient(pods)
    owned, foreign = client.list_owned_pods("ns", {}, JOB.uid)
    assert [x["metadata"]["name"] for x in owned] == [
        f"p{i}" for i, o in enumerate(owners) if o == JOB.uid
    ]
    assert sorted(foreign) == sorted(f"p{i}" for i, o in enumerate(owners) if o != JOB.uid)


def test_image_pull_secrets_reach_every_pod_that_runs_the_image_in_the_jobs_namespace():
    from moejob_operator.builders import digest_probe, prepare

    raw = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())["spec"]
    raw.pop("checkpoint")
    raw["imagePullSecrets"] = [{"name": "registry-creds"}]
    spec = parse_spec(raw)
    admission.check("j", raw, spec, admission.Policy())
    pods = [
        workers.worker_pod(JOB, spec, node_rank=0, node="n", attempt=0, spec_hash="h"),
        prepare.prepare_pod(JOB, spec, tokenizer=None, vocab_size=320),
        digest_probe.probe_pod(JOB, spec, "n", 0),
    ]
    for pod in pods:
        assert pod["spec"]["imagePullSecrets"] == [{"name": "registry-creds"}], pod["metadata"]
    raw["imagePullSecrets"] = [{"name": "Not_A_Name"}]
    with pytest.raises(admission.SpecError, match=r"spec\.imagePullSecrets\[0\]\.name"):
        admission.check("j", raw, parse_spec(raw), admission.Policy())


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, "{not json"], ids=["deep", "bad"])
def test_hostile_routing_statistics_are_a_document_error_not_a_crash(text):
    """The routing-statistics ConfigMap is the trainer's to write: a document nested past the
    parser is refused like any malformed one (a RecursionError was a pass error, retried
    forever, for every job planning from it)."""
    with pytest.raises(DocumentError, match="RoutingStats"):
        decode_configmap({"data": {C.ROUTING_STATS_KEY: text}})
