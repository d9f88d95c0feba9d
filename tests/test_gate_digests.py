"""The gate's digest rules, pure (core.gate.digests, core.gate.golden) and the node agent's image
IDs: which build a gang runs, a re-pushed tag, different builds on the nodes, revocation."""

from __future__ import annotations

import datetime as dt

import pytest

from moe_contracts.gate import golden_drift, parse_gate_verdict, parse_smoke_golden
from moe_localkube.imageids import ImageIds
from moejob_operator.builders import digest_probe, smoke
from moejob_operator.builders.common import JobRef
from moejob_operator.core import gate as G
from moejob_operator.core.gate import digests as GD
from moejob_operator.core.gate import golden as GG
from moejob_operator.core.smoke_plans import smoke_plans
from moejob_operator.spec import parse_spec

D1, D2 = "sha256:" + "1" * 64, "sha256:" + "2" * 64
TAG = "reg.io/team/trainer:1.2"
NOW = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)


def test_workers_run_the_verified_digest_of_a_tag():
    assert GD.worker_image(TAG, D1) == f"reg.io/team/trainer@{D1}"
    assert GD.worker_image(TAG, None) == TAG  # the runtime reported no digest
    assert GD.worker_image(f"reg.io/team/trainer@{D2}", D1) == f"reg.io/team/trainer@{D2}"
    assert GD.worker_image("registry:5000/t:x", D1) == f"registry:5000/t@{D1}"


def test_resolve_each_situation():
    r = GD.resolve(TAG, D1, {"a": D1, "b": GD.PENDING})
    assert r.kind == "pending" and "node(s) b" in r.message
    assert GD.resolve(TAG, D1, {"a": None, "b": None}).kind == "unknown"
    assert GD.resolve(TAG, D1, {"a": D1, "b": D1}).kind == "same"
    moved = GD.resolve(TAG, D1, {"a": D2, "b": D2})
    assert (moved.kind, moved.digest) == ("moved", D2)
    assert f"now resolves to {D2}" in moved.message and f"verified {D1}" in moved.message
    mixed = GD.resolve(TAG, D1, {"a": D1, "b": D2})
    assert mixed.kind == "mixed" and mixed.digest is None
    assert "a sha256:1111" in mixed.message and "b sha256:2222" in mixed.message
    assert "pin spec.image" in mixed.message and "reg.io/team/trainer@sha256:" in mixed.message
    assert GD.resolve(TAG, D1, {"a": D1, "b": None}).kind == "mixed"  # one node cannot say


def _record(identity, passed=True, digest=D1, attempt=1):
    return {
        "kind": "GateVerdict",
        "version": 1,
        "identity": identity.to_doc(),
        "attempt": attempt,
        "passed": passed,
        "failedCheck": None if passed else "numerics",
        "failedCase": None if passed else "mixtral",
        "message": "all checks passed" if passed else "experts: gradient is zero",
        "observedDigest": digest,
        "smokeJob": f"moe-smoke-{identity.key}-{attempt}",
        "verifiedAt": "2026-12-01T11:00:00Z",
        "expiresAt": "2026-12-08T11:00:00Z",
    }


def test_a_tags_verdict_is_also_its_digests_and_follows_or_is_revoked():
    tag = G.identity_for(TAG, None, "CPU")
    rec = _record(tag)
    same = GD.digest_record(rec, tag)
    assert same["identity"]["key"] == G.pinned(tag, D1).key and same["passed"]
    assert same["identity"]["key"] == G.identity_for(f"reg.io/team/trainer@{D1}", None, "CPU").key
    assert GD.digest_record(dict(rec, observedDigest=None), tag) is None
    # the tag moved to D2, which passed: the tag's verdict follows it, next attempt
    d2 = _record(G.pinned(tag, D2), digest=D2)
    followed = GD.followed_record(tag, rec, d2)
    assert followed["identity"]["key"] == tag.key and followed["attempt"] == 2
    assert followed["passed"] and followed["observedDigest"] == D2
    # ... which failed: the tag's pass is revoked, for the fail TTL, naming the build
    bad = _record(G.pinned(tag, D2), passed=False, digest=D2)
    revoked = GD.revoked_record(tag, rec, bad, NOW, G.GateConfig(fail_ttl_seconds=600))
    parse_gate_verdict(revoked)
    assert not revoked["passed"] and revoked["attempt"] == 2 and revoked["revokedPass"] == D1
    assert revoked["message"].startswith(f"revoked: image {TAG} now resolves to {D2}")
    assert revoked["expiresAt"] == "2026-12-01T12:10:00Z"
    d = G.decide(tag, revoked, None, NOW, G.GateConfig())
    assert d.status == "False" and "revoked" in d.message and "check 'numerics'" in d.message
    # the message a later pass reads from the store ends as the revoking pass's did
    assert d.message.endswith(f"the cached pass of {TAG} is revoked")


def test_the_probe_pod_pulls_the_tag_on_its_node_and_asks_for_nothing():
    spec = parse_spec(
        {
            "image": TAG,
            "imagePullPolicy": "Always",
            "device": "CPU",
            "model": {"preset": "tiny-mixtral"},
            "nodes": {"count": 2},
            "scheduling": {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]},
        }
    )
    pod = digest_probe.probe_pod(JobRef("ns", "job", "uid"), spec, "node-b", 1)
    c = pod["spec"]["containers"][0]
    assert pod["metadata"]["name"] == "job-digest-1" and pod["spec"]["nodeName"] == "node-b"
    assert (c["image"], c["imagePullPolicy"], c["command"]) == (TAG, "Always", ["true"])
    assert "nvidia.com/gpu" not in str(c["resources"])
    assert pod["spec"]["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists"}]
    assert pod["metadata"]["ownerReferences"][0]["uid"] == "uid"


def test_golden_values_are_kept_per_plans_and_hardware():
    cpu = G.identity_for(TAG, None, "CPU")
    plans = smoke_plans("cpu")
    key = GG.golden_key(plans, cpu)
    assert key == GG.golden_key(plans, G.identity_for("other:image", "0.19.8", "CPU"))
    assert key != GG.golden_key(smoke_plans("cpu", seed=7), cpu)
    values = {
        "mixtral": {"loss": [5.0, 4.5], "gradNorm": [2.0, 1.9], "update": {"experts": [0.5, 0.4]}}
    }
    rec = dict(_record(cpu), golden=values, goldenKey=key)
    doc = parse_smoke_golden(GG.golden_doc(rec))
    assert doc["goldenKey"] == key and doc["against"]["digest"] == D1 and doc["cases"] == values
    assert GG.golden_doc(dict(rec, passed=False)) is None
    cm = smoke.verdict_configmap(rec, "ops", golden=GG.golden_doc(rec))
    assert cm["metadata"]["labels"][GG.LABEL_GOLDEN_KEY] == key and GG.GOLDEN_DATA_KEY in cm["data"]
    plans_cm = smoke.smoke_plans_configmap(cpu, 1, G.GateConfig(), plans, doc)
    assert set(plans_cm["data"]) == {smoke.PLANS_KEY, smoke.GOLDEN_KEY}
    args = smoke.smoke_job(cpu, 1, G.GateConfig(), golden=True)["spec"]["template"]["spec"][
        "containers"
    ][0]["args"]
    assert args[-2:] == ["--golden", f"{smoke.PLANS_DIR}/{smoke.GOLDEN_KEY}"]
    now = {
        "mixtral": {"loss": [5.0, 4.95], "gradNorm": [2.0, 1.9], "update": {"experts": [0.5, 0.44]}}
    }
    drift = golden_drift(now, values)["mixtral"]
    assert drift == {"loss": pytest.approx(0.1), "gradNorm": 0.0, "update": pytest.approx(0.1)}


def test_node_agent_image_ids_per_node_and_a_re_push():
    ids = ImageIds({"node-a": {TAG: D1}})
    assert ids.image_id("node-a", TAG) == f"reg.io/team/trainer@{D1}"
    assert ids.image_id("node-b", TAG) == ""  # unmapped: no digest, as before
    assert ids.image_id("node-b", f"reg.io/team/trainer@{D2}") == f"reg.io/team/trainer@{D2}"
    ids.set("node-a", TAG, D2)
    assert ids.image_id("node-a", TAG).endswith(D2)
    ids.set("node-a", TAG, None)
    assert ids.image_id("node-a", TAG) == ""
    with pytest.raises(ValueError, match="not a sha256"):
        ids.set("node-a", TAG, "latest")
