"""The discovery pod on a real API server: the node agent runs it on node-a with the fake NVML
its node carries, `moe-discover` publishes with the pod's own (narrow) service account, and the
ConfigMap the operator will read parses with the planning core."""

from __future__ import annotations

import json

import pytest

from moe_contracts.topology import parse_topology
from moejob_operator.builders import discovery as D
from moejob_operator.core.topology import nvlink_groups

pytestmark = pytest.mark.cluster


def _create(kube, ns: str, doc: dict) -> None:
    kind = doc["kind"]
    if kind == "ServiceAccount":
        kube.core.create_namespaced_service_account(ns, doc)
    elif kind == "Role":
        kube.rbac.create_namespaced_role(ns, doc)
    elif kind == "RoleBinding":
        kube.rbac.create_namespaced_role_binding(ns, doc)
    elif kind == "Pod":
        kube.core.create_namespaced_pod(ns, doc)
    else:
        raise AssertionError(kind)


def _finished(kube, ns: str, name: str):
    pod = kube.core.read_namespaced_pod(name, ns)
    return pod if pod.status.phase in ("Succeeded", "Failed") else None


def _terminated(pod):
    return pod.status.container_statuses[0].state.terminated


def _create_rbac(kube, ns, wait_for, nodes):
    for doc in D.discovery_children("tiny", nodes, namespace=ns, image="ignored:latest")[:3]:
        _create(kube, ns, doc)
    # v1.20 admission refuses a pod (500, "retry after") until the token controller has given
    # the new ServiceAccount its token secret; the operator treats that as "not yet".
    wait_for(
        lambda: (
            kube.core.read_namespaced_service_account(D.discovery_account_name("tiny"), ns).secrets
        ),
        timeout=30,
        message="discovery ServiceAccount has its token",
    )


def _run_pod(kube, ns, wait_for, node, *, namespace_arg=True, **kwargs):
    pod = D.discovery_pod(
        node,
        namespace=ns,
        image="ignored:latest",
        service_account=D.discovery_account_name("tiny"),
        job_name="tiny",
        **kwargs,
    )
    if not namespace_arg:  # moe-discover then takes the pod's namespace from its token mount
        pod["spec"]["containers"][0]["args"] = ["--configmap", D.topology_configmap_name(node)]
    kube.core.create_namespaced_pod(ns, pod)
    return wait_for(
        lambda: _finished(kube, ns, pod["metadata"]["name"]),
        timeout=60,
        message=f"discovery pod on {node} finished",
    )


def test_discovery_pod_publishes_report_the_planner_reads(kube, node_agent, namespace, wait_for):
    _create_rbac(kube, namespace, wait_for, ["node-a"])
    pod = _run_pod(kube, namespace, wait_for, "node-a")
    assert pod.status.phase == "Succeeded", node_agent.read_log(namespace, pod.metadata.name)
    message = _terminated(pod).message
    assert message.startswith("node=node-a source=fake-nvml gpus=8 model=NVIDIA H100 80GB HBM3")
    assert message.endswith(f"configmap={namespace}/moe-topology-node-a")

    cm = kube.core.read_namespaced_config_map("moe-topology-node-a", namespace)
    assert cm.metadata.labels["moe-operator.io/component"] == "topology"
    assert cm.metadata.labels["moe-operator.io/node"] == "node-a"
    report = parse_topology(json.loads(cm.data["topology.json"]))
    assert (report.node, report.source, report.fixture) == (
        "node-a",
        "fake-nvml",
        "nvswitch-h100-8",
    )
    assert nvlink_groups(report) == [list(range(8))]

    # A second discovery of the same node replaces the (here: stale) report; update by name.
    kube.core.replace_namespaced_config_map(
        "moe-topology-node-a",
        namespace,
        {"metadata": {"name": "moe-topology-node-a"}, "data": {"topology.json": "{}"}},
    )
    kube.core.delete_namespaced_pod(pod.metadata.name, namespace, grace_period_seconds=0)
    wait_for(
        lambda: (
            not kube.core.list_namespaced_pod(
                namespace, field_selector=f"metadata.name={pod.metadata.name}"
            ).items
        ),
        timeout=30,
        message="old discovery pod gone",
    )
    pod = _run_pod(kube, namespace, wait_for, "node-a", namespace_arg=False)
    assert pod.status.phase == "Succeeded", node_agent.read_log(namespace, pod.metadata.name)
    cm = kube.core.read_namespaced_config_map("moe-topology-node-a", namespace)
    assert parse_topology(json.loads(cm.data["topology.json"])).node == "node-a"


def test_role_forbids_replacing_another_nodes_report(kube, node_agent, namespace, wait_for):
    """The Role names node-a only: node-b's existing report cannot be overwritten (exit 75)."""
    _create_rbac(kube, namespace, wait_for, ["node-a"])
    kube.core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "moe-topology-node-b"}, "data": {"topology.json": "{}"}}
    )
    pod = _run_pod(kube, namespace, wait_for, "node-b")
    assert pod.status.phase == "Failed"
    term = _terminated(pod)
    assert term.exit_code == 75, term.message
    assert "could not publish the report" in term.message and "HTTP 403" in term.message
    assert kube.core.read_namespaced_config_map("moe-topology-node-b", namespace).data == {
        "topology.json": "{}"
    }
