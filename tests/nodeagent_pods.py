"""Pods for the node-agent tests (test_localkube_nodeagent, test_localkube_nodes): a one-container
Pod running a Python script on a named node, and a phase probe for ``wait_for``."""

from __future__ import annotations

import textwrap


def pod_manifest(
    name: str, script: str, *, restart: str = "Never", node: str = "node-a", **extra
) -> dict:
    container = {
        "name": "main",
        "image": "ignored:latest",
        "command": ["python", "-c", textwrap.dedent(script)],
    }
    container.update(extra.pop("container", {}))
    spec = {
        "restartPolicy": restart,
        "nodeSelector": {"kubernetes.io/hostname": node},
        "terminationGracePeriodSeconds": 5,
        "containers": [container],
    }
    spec.update(extra)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def pod_phase(kube, ns, name, *phases):
    pod = kube.core.read_namespaced_pod(name, ns)
    return pod if pod.status.phase in phases else None
