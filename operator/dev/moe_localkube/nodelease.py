"""Keeping the node agent's Node objects alive as a kubelet does: register a node (create or
patch the Node, its status with the GPU capacity and the agent's kubelet endpoint, and drop the
``not-ready`` taint the node lifecycle controller put on it), renew its Lease in
``kube-node-lease``, and heartbeat its Ready condition until the agent stops."""

from __future__ import annotations

import logging
import threading
from datetime import UTC, datetime

from kubernetes.client import CoordinationV1Api, CoreV1Api
from kubernetes.client.exceptions import ApiException

from .gpus import Gpu
from .nodes import GpuShape, NodeSpec, node_manifest, node_status

log = logging.getLogger("moe_localkube.nodeagent")
LEASE_NS = "kube-node-lease"
MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"


def _micro_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def register_node(
    core: CoreV1Api,
    coordination: CoordinationV1Api,
    spec: NodeSpec,
    gpus: list[Gpu],
    host_ip: str,
    kubelet_port: int,
) -> None:
    """Create (or patch) the Node ``spec.name`` shaped after ``gpus``, Ready, with a Lease."""
    shape = GpuShape(
        product=gpus[0].name.replace(" ", "-") if gpus else "NVIDIA-GPU",
        count=len(gpus),
        memory_mib=(gpus[0].memory_bytes >> 20) if gpus else 0,
    )
    body = node_manifest(spec, shape)
    try:
        core.create_node(body)
    except ApiException as exc:
        if exc.status != 409:
            raise
        core.patch_node(spec.name, {"metadata": body["metadata"]}, _content_type=MERGE)
    core.patch_node_status(
        spec.name,
        {"status": node_status(spec, host_ip, kubelet_port, shape)},
        _content_type=MERGE,
    )
    # TaintNodesByCondition put node.kubernetes.io/not-ready on the new node; it is Ready now.
    core.patch_node(spec.name, {"spec": {"taints": None}}, _content_type=MERGE)
    renew_lease(coordination, spec.name)


def renew_lease(coordination: CoordinationV1Api, node: str) -> None:
    spec = {"holderIdentity": node, "leaseDurationSeconds": 40, "renewTime": _micro_now()}
    try:
        coordination.patch_namespaced_lease(node, LEASE_NS, {"spec": spec}, _content_type=MERGE)
    except ApiException as exc:
        if exc.status != 404:
            raise
        coordination.create_namespaced_lease(
            LEASE_NS, {"metadata": {"name": node, "namespace": LEASE_NS}, "spec": spec}
        )


def heartbeat_until(
    stop: threading.Event,
    period: float,
    core: CoreV1Api,
    coordination: CoordinationV1Api,
    nodes: list[str],
) -> None:
    """Every ``period`` seconds until ``stop``: each node's Lease and Ready condition; a failed
    beat is logged and the next one tried."""
    while not stop.wait(period):
        for name in nodes:
            try:
                renew_lease(coordination, name)
                now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
                core.patch_node_status(
                    name,
                    {
                        "status": {
                            "conditions": [
                                {
                                    "type": "Ready",
                                    "status": "True",
                                    "reason": "KubeletReady",
                                    "lastHeartbeatTime": now,
                                }
                            ]
                        }
                    },
                    _content_type=STRATEGIC,
                )
            except Exception as exc:  # noqa: BLE001 - keep beating
                log.warning("node %s: heartbeat failed: %s", name, exc)
