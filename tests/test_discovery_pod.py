"""Discovery pod and RBAC builders: golden manifests, the properties a cluster admin relies on."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
from pathlib import Path

import pytest
import yaml

from moe_trainer.discovery import publish
from moejob_operator import constants as C
from moejob_operator.builders import discovery as D
from moejob_operator.builders.common import JobRef, owner_reference

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("MOE_UPDATE_GOLDEN") == "1"
JOB = JobRef(namespace="team-a", name="tiny", uid="0b7e6c1e-1111-2222-3333-444455556666")
IMAGE = "ghcr.io/example/moe-trainer:0.1.0"
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def _check_golden(name: str, docs: list[dict]) -> None:
    got = yaml.safe_dump_all(docs, sort_keys=False)
    path = GOLDEN / name
    if UPDATE:
        path.write_text(got)
    assert got == path.read_text(), f"{path} differs: rerun with MOE_UPDATE_GOLDEN=1 and review"


def test_golden_discovery_pod():
    pod = D.discovery_pod(
        "node-a",
        namespace=JOB.namespace,
        image=IMAGE,
        service_account="tiny-discovery",
        owner=owner_reference(JOB),
        job_name=JOB.name,
    )
    _check_golden("discovery_pod.yaml", [pod])


def test_golden_discovery_children_request_mode():
    docs = D.discovery_children(
        JOB.name,
        ["node-a", "node-b", "node-a"],
        namespace=JOB.namespace,
        image=IMAGE,
        owner=owner_reference(JOB),
        gpu_access="request",
        gpu_count=8,
        runtime_class_name="nvidia",
    )
    assert [d["kind"] for d in docs] == ["ServiceAccount", "Role", "RoleBinding", "Pod", "Pod"]
    _check_golden("discovery_pod_children.yaml", docs)


def test_pod_is_pinned_restricted_and_publishes_its_node_configmap():
    pod = D.discovery_pod(
        "gpu-7.example.internal",
        namespace="ns",
        image=IMAGE,
        service_account="sa",
        owner=owner_reference(JOB),
    )
    spec, ctr = pod["spec"], pod["spec"]["containers"][0]
    assert spec["nodeName"] == "gpu-7.example.internal" and "affinity" not in spec
    assert spec["restartPolicy"] == "Never"
    assert spec["activeDeadlineSeconds"] == C.DISCOVERY_TIMEOUT_SECONDS
    assert {"key": "nvidia.com/gpu", "operator": "Exists"} in spec["tolerations"]
    assert spec["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 65534,
        "runAsGroup": 65534,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    sc = ctr["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert ctr["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert ctr["args"] == [
        "--configmap",
        "moe-topology-gpu-7.example.internal",
        "--namespace",
        "ns",
    ]
    env = {e["name"]: e for e in ctr["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"]["value"] == "utility"
    assert C.GPU_RESOURCE not in ctr["resources"]["requests"]
    assert pod["metadata"]["labels"][C.LABEL_COMPONENT] == "discovery"
    assert pod["metadata"]["ownerReferences"][0]["uid"] == JOB.uid
    assert (
        DNS_LABEL.match(pod["metadata"]["name"])
        and pod["metadata"]["name"]
        == "moe-discovery-gpu-7-example-internal-" + pod["metadata"]["name"].rsplit("-", 1)[1]
    )


def test_pod_uses_a_projected_bound_token_not_the_legacy_automount():
    """1.20 admission refuses an automounting pod until the token controller has minted a Secret
    for the job's new ServiceAccount; a projected token needs no Secret."""
    pod = D.discovery_pod("n", namespace="ns", image=IMAGE, service_account="sa")
    assert pod["spec"]["automountServiceAccountToken"] is False
    (vol,) = pod["spec"]["volumes"]
    assert vol["projected"]["sources"][0]["serviceAccountToken"]["path"] == "token"
    (mount,) = pod["spec"]["containers"][0]["volumeMounts"]
    assert mount == {"name": vol["name"], "mountPath": publish.SA_DIR.as_posix(), "readOnly": True}


def test_request_mode_asks_for_all_gpus_and_no_env_devices():
    pod = D.discovery_pod(
        "n", namespace="ns", image=IMAGE, service_account="sa", gpu_access="request", gpu_count=4
    )
    ctr = pod["spec"]["containers"][0]
    assert ctr["resources"]["limits"][C.GPU_RESOURCE] == "4"
    assert "NVIDIA_VISIBLE_DEVICES" not in {e["name"] for e in ctr["env"]}
    with pytest.raises(ValueError, match="gpu_count: 0 must be >= 1 with gpu_access='request'"):
        D.discovery_pod(
            "n", namespace="ns", image=IMAGE, service_account="sa", gpu_access="request"
        )
    with pytest.raises(ValueError, match="gpu_access: 'all' is not 'env' or 'request'"):
        D.discovery_pod("n", namespace="ns", image=IMAGE, service_account="sa", gpu_access="all")


def test_names_are_deterministic_dns_safe_and_distinct_when_truncated():
    assert D.discovery_pod_name("node-a") == "moe-discovery-node-a"
    assert D.topology_configmap_name("node-a") == "moe-topology-node-a"
    assert (
        D.topology_configmap_name("ip-10-0-1-7.ec2.internal")
        == "moe-topology-ip-10-0-1-7.ec2.internal"
    )
    long_a, long_b = "gpu-" + "a" * 70 + "-1", "gpu-" + "a" * 70 + "-2"
    names = {D.discovery_pod_name(n) for n in (long_a, long_b)}
    assert len(names) == 2 and all(len(n) <= 63 and DNS_LABEL.match(n) for n in names)
    assert D.discovery_pod_name(long_a) == D.discovery_pod_name(long_a)
    huge = "n" * 250
    assert len(D.topology_configmap_name(huge)) <= 253
    assert D.topology_configmap_name(huge) != D.topology_configmap_name(huge + "x")


def test_node_label_matches_what_moe_discover_writes():
    for node in ("node-a", "ip-10-0-1-7.ec2.internal", "x" * 90, "Weird_Node.1"):
        assert D.node_label_value(node) == publish.label_value(node)


def test_role_is_narrow():
    role = D.discovery_role("tiny-discovery", ["node-b", "node-a"], namespace="ns")
    create, update = role["rules"]
    assert create == {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create"]}
    assert update["verbs"] == ["update"]
    assert update["resourceNames"] == ["moe-topology-node-a", "moe-topology-node-b"]
    verbs = {v for r in role["rules"] for v in r["verbs"]}
    assert not verbs & {"get", "list", "watch", "delete", "deletecollection", "patch"}
    with pytest.raises(ValueError, match="at least one candidate node"):
        D.discovery_role("r", [], namespace="ns")


def test_cached_report_is_current_by_age_and_boot_id():
    now = dt.datetime(2026, 11, 29, 14, 0, tzinfo=dt.UTC)

    def cm(collected: str, boot: str | None = "boot-1") -> dict:
        meta = {"annotations": {publish.ANNOTATION_BOOT_ID: boot}} if boot else {}
        return {"metadata": meta, "data": {"topology.json": json.dumps({"collectedAt": collected})}}

    node = {"status": {"nodeInfo": {"bootID": "boot-1"}}}
    assert C.ANNOTATION_BOOT_ID == publish.ANNOTATION_BOOT_ID  # both sides agree on the key
    assert C.LABEL_NODE == publish.LABEL_NODE
    assert D.cached_report_is_current(cm("2026-11-29T13:00:00Z"), node, now=now)[0] is True
    ok, why = D.cached_report_is_current(cm("2026-11-27T13:00:00Z"), node, now=now)
    assert not ok and why == "report is 176400s old (max 86400s)"
    ok, why = D.cached_report_is_current(cm("2026-11-29T13:00:00Z", "boot-0"), node, now=now)
    assert not ok and why == "node rebooted since the report was collected"
    # no boot id on either side (older report, node without nodeInfo): age alone decides
    assert D.cached_report_is_current(cm("2026-11-29T13:00:00Z", None), node, now=now)[0]
    assert D.cached_report_is_current(cm("2026-11-29T13:00:00Z"), {}, now=now)[0]
    assert D.cached_report_is_current(None, node, now=now) == (False, "no report")
    assert D.cached_report_is_current({"data": {"topology.json": "{}"}}, node, now=now) == (
        False,
        "report has no readable collectedAt",
    )
