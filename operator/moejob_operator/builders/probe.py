"""Per-job topology discovery pods (``moe-discover``) and the RBAC they need to publish.

One pod per candidate node, ``<job>-discover-<n>``, pinned like the workers (required node
affinity on ``metadata.name``), writes ConfigMap ``moe-topology-<node>`` in the job's namespace
(docs/contracts.md). The ConfigMaps are a namespace-wide cache: they are not owned by the job and
later jobs reuse a fresh report without running discovery again.
"""

from __future__ import annotations

import hashlib
from typing import Any

from .. import constants as C
from .common import JobRef, child_metadata
from .workers import SA_TOKEN_DIR, TOKEN_VOLUME, token_volume


def discovery_account_name(job: JobRef) -> str:
    return f"{job.name}-discovery"


def discovery_pod_name(job: JobRef, node: str) -> str:
    # node names can be long (253): a short digest keeps the pod name a DNS label
    return f"{job.name}-discover-{hashlib.sha256(node.encode()).hexdigest()[:8]}"


def topology_configmap_name(node: str) -> str:
    return f"{C.TOPOLOGY_CONFIGMAP_PREFIX}{node}"


def discovery_rbac(job: JobRef, nodes: list[str]) -> list[dict[str, Any]]:
    name = discovery_account_name(job)
    meta = lambda: child_metadata(job, name, "discovery")  # noqa: E731
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta(),
         "automountServiceAccountToken": False},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta(),
         "rules": [
             # create cannot be limited by name (RBAC); updates only to the nodes' own reports
             {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create"]},
             {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "update", "patch"],
              "resourceNames": sorted(topology_configmap_name(n) for n in nodes)}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta(),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": job.namespace}]},
    ]


def discovery_pod(job: JobRef, node: str, image: str, image_pull_policy: str = "IfNotPresent",
                  tolerations: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "serviceAccountName": discovery_account_name(job),
        "automountServiceAccountToken": False,   # bound token projected below (no 1.20 admission wait)
        "enableServiceLinks": False,
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [node]}]}]}}},
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [{
            "name": "discover", "image": image, "imagePullPolicy": image_pull_policy,
            "command": ["moe-discover", "--no-stdout", "--configmap", topology_configmap_name(node),
                        "--node", node],
            "env": [{"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                    # NVML needs the driver libraries, not a GPU allocation: no nvidia.com/gpu request
                    {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}],
            "volumeMounts": [{"name": TOKEN_VOLUME, "mountPath": SA_TOKEN_DIR, "readOnly": True}],
            "resources": {"requests": {"cpu": "10m", "memory": "64Mi"},
                          "limits": {"memory": "256Mi"}},
            "securityContext": {"allowPrivilegeEscalation": False, "privileged": False,
                                "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}},
        }],
    }
    spec["volumes"] = [token_volume()]
    if tolerations:
        spec["tolerations"] = tolerations
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": child_metadata(job, discovery_pod_name(job, node), "discovery",
                                       annotations={f"{C.GROUP}/node": node}),
            "spec": spec}
