"""The discovery pod (one per candidate GPU node) and the RBAC it needs to publish its report.

The pod runs `moe-discover`, which reads NVML and creates or replaces the ConfigMap
``moe-topology-<node>`` (key ``topology.json``, docs/contracts.md) in the job's namespace.

Decisions (docs/discovery.md has the long form):

- **Pinned with ``spec.nodeName``**, unlike the workers (node affinity). The pod requests no GPU,
  so the scheduler has nothing to account; it must run on *that* node even while all its GPUs are
  allocated, with no scheduler round trip (and on clusters or test control planes without one).
  The cost: NoSchedule taints and cordons are not checked (fine for a read-only probe of seconds),
  and if the node lacks the small CPU/memory the kubelet rejects the pod (``OutOfcpu``), which
  the operator sees as a failed discovery.
- **GPU access without a GPU request** (default, ``gpu_access="env"``):
``NVIDIA_VISIBLE_DEVICES=all``
  + ``NVIDIA_DRIVER_CAPABILITIES=utility`` make the NVIDIA container runtime mount the driver's
  NVML and every GPU device node, without taking GPUs away from running jobs, so discovery works
  on busy nodes. It needs the NVIDIA runtime for this pod (default runtime on GPU Operator nodes,
  or ``runtime_class_name="nvidia"``) and a device plugin that accepts the env variable from
  unprivileged pods. Where that is locked down (``ACCEPT_NVIDIA_VISIBLE_DEVICES_ENVVAR_WHEN_
  UNPRIVILEGED=false``), use ``gpu_access="request"`` with ``gpu_count`` = the node's GPUs: the
  pod then waits until every GPU of the node is free.
- **Restricted security**: uid/gid 65534 (nobody), non-root, no privilege escalation, all
  capabilities dropped, read-only root filesystem, seccomp RuntimeDefault. NVML needs none of it.
- **Projected, bound ServiceAccount token** (``common.token_volume``, as for the workers) instead
  of the legacy automount: on 1.20 the automount makes admission refuse the pod until the token
  controller has minted a Secret for the job's fresh ServiceAccount.
- **One pod per node and namespace**, not per job: two jobs that need the same node's report at
  once share the pod (the second one's create answers "already exists") and both read the one
  ConfigMap it publishes.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
from collections.abc import Iterable
from typing import Any, Literal, TypedDict

from .. import constants as C
from .common import pod_security_context, token_mount, token_volume
from .common import resources as quantities

COMPONENT = "discovery"
DISCOVERY_POD_PREFIX = "moe-discovery-"
DISCOVER_COMMAND = ("moe-discover",)
NOBODY = 65534
DEFAULT_REQUESTS = {"cpu": "50m", "memory": "64Mi"}
DEFAULT_LIMITS = {"memory": "256Mi"}
_DNS_LABEL_MAX = 63
_DNS_SUBDOMAIN_MAX = 253


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def _fit(prefix: str, node: str, limit: int, *, keep_dots: bool) -> str:
    """``prefix + node`` made DNS-safe and at most ``limit`` long; when anything had to change,
    a hash of the original node name keeps different nodes apart."""
    allowed = r"[^a-z0-9.-]" if keep_dots else r"[^a-z0-9-]"
    cleaned = re.sub(allowed, "-", node.lower())
    if cleaned == node and len(prefix) + len(node) <= limit:
        return prefix + node
    suffix = "-" + _digest(node)
    body = cleaned[: limit - len(prefix) - len(suffix)].strip(".-")
    return f"{prefix}{body}{suffix}"


def topology_configmap_name(node: str) -> str:
    """``moe-topology-<node>``: a DNS subdomain like the node name itself (hashed if too long)."""
    return _fit(C.TOPOLOGY_CONFIGMAP_PREFIX, node, _DNS_SUBDOMAIN_MAX, keep_dots=True)


def discovery_pod_name(node: str) -> str:
    """``moe-discovery-<node>`` as a DNS label (<= 63, no dots), deterministic per node."""
    return _fit(DISCOVERY_POD_PREFIX, node, _DNS_LABEL_MAX, keep_dots=False)


def node_label_value(node: str) -> str:
    """A node name as a label value (<= 63 chars); same rule as moe-discover's ConfigMap label."""
    cleaned = "".join(c if c.isalnum() or c in "-_." else "-" for c in node)
    if len(cleaned) > _DNS_LABEL_MAX:
        cleaned = cleaned[:54] + "-" + _digest(node)
    return cleaned.strip("-_.") or "unknown"


def discovery_account_name(job_name: str) -> str:
    return f"{job_name}-discovery"


def _metadata(
    name: str,
    namespace: str,
    owner: dict[str, Any] | None,
    job_name: str | None,
    extra_labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    labels = {C.LABEL_COMPONENT: COMPONENT, C.LABEL_MANAGED_BY: C.MANAGED_BY}
    if job_name:
        labels[C.LABEL_JOB] = job_name
    labels.update(extra_labels or {})
    meta: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "labels": dict(sorted(labels.items())),
    }
    if owner is not None:
        meta["ownerReferences"] = [dict(owner)]
    return meta


def discovery_pod(
    node: str,
    *,
    namespace: str,
    image: str,
    service_account: str,
    owner: dict[str, Any] | None = None,
    job_name: str | None = None,
    image_pull_policy: str = "IfNotPresent",
    gpu_access: Literal["env", "request"] = "env",
    gpu_count: int = 0,
    runtime_class_name: str | None = None,
    active_deadline_seconds: int = C.DISCOVERY_TIMEOUT_SECONDS,
    tolerations: Iterable[dict[str, Any]] = (),
    extra_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The Pod that discovers ``node`` and publishes ``moe-topology-<node>`` in ``namespace``.

    ``owner`` is the ownerReference to set (the operator passes its job's); ``extra_env`` is for
    dev clusters (``MOE_FAKE_NVML_FIXTURE``). Raises ValueError on inconsistent GPU access.
    """
    if gpu_access not in ("env", "request"):
        raise ValueError(f"gpu_access: {gpu_access!r} is not 'env' or 'request'")
    if gpu_access == "request" and gpu_count < 1:
        raise ValueError(
            f"gpu_count: {gpu_count} must be >= 1 with gpu_access='request' "
            "(the node's GPU count: the pod waits for all of them)"
        )
    if active_deadline_seconds < 1:
        raise ValueError(f"active_deadline_seconds: {active_deadline_seconds} must be >= 1")

    env: list[dict[str, Any]] = [
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "utility"},  # NVML only, no CUDA libs
    ]
    requests: dict[str, int | str] = dict(DEFAULT_REQUESTS)
    limits: dict[str, int | str] = dict(DEFAULT_LIMITS)
    if gpu_access == "env":
        env.append({"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"})
    else:
        requests[C.GPU_RESOURCE] = gpu_count
        limits[C.GPU_RESOURCE] = gpu_count
    env += [{"name": k, "value": v} for k, v in sorted((extra_env or {}).items())]

    container = {
        "name": "discover",
        "image": image,
        "imagePullPolicy": image_pull_policy,
        "command": list(DISCOVER_COMMAND),
        "args": ["--configmap", topology_configmap_name(node), "--namespace", namespace],
        "env": env,
        "volumeMounts": [token_mount()],
        "resources": quantities(requests, limits),
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "privileged": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    spec: dict[str, Any] = {
        "nodeName": node,
        "restartPolicy": "Never",
        "activeDeadlineSeconds": active_deadline_seconds,
        "serviceAccountName": service_account,
        "automountServiceAccountToken": False,  # bound token projected instead (see above)
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 5,
        "securityContext": pod_security_context(NOBODY, fs_group=False),
        "tolerations": [{"key": C.GPU_RESOURCE, "operator": "Exists"}, *map(dict, tolerations)],
        "containers": [container],
        "volumes": [token_volume()],
    }
    if runtime_class_name:
        spec["runtimeClassName"] = runtime_class_name
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": _metadata(
            discovery_pod_name(node),
            namespace,
            owner,
            job_name,
            {C.LABEL_NODE: node_label_value(node)},
        ),
        "spec": spec,
    }


def discovery_service_account(
    name: str, *, namespace: str, owner: dict[str, Any] | None = None, job_name: str | None = None
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _metadata(name, namespace, owner, job_name),
        "automountServiceAccountToken": False,
    }  # pods get a projected token (common.token_volume)


def discovery_role(
    name: str,
    nodes: Iterable[str],
    *,
    namespace: str,
    owner: dict[str, Any] | None = None,
    job_name: str | None = None,
) -> dict[str, Any]:
    """What `moe-discover` does and nothing more: POST a ConfigMap, then PUT it when it exists.

    RBAC cannot narrow ``create`` by ``resourceNames`` (the authorizer does not see the new
    object's name), so ``create`` covers every ConfigMap of the namespace; ``update`` is limited to
    the candidate nodes' ``moe-topology-<node>``. No get/list/watch/patch/delete: the pod never
    reads, and cannot alter any other ConfigMap (plans, progress).
    """
    names = sorted({topology_configmap_name(n) for n in nodes})
    if not names:
        raise ValueError("nodes: at least one candidate node is needed")
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _metadata(name, namespace, owner, job_name),
        "rules": [
            {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create"]},
            {
                "apiGroups": [""],
                "resources": ["configmaps"],
                "resourceNames": names,
                "verbs": ["update"],
            },
        ],
    }


def discovery_role_binding(
    name: str,
    *,
    namespace: str,
    service_account: str,
    owner: dict[str, Any] | None = None,
    job_name: str | None = None,
) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _metadata(name, namespace, owner, job_name),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": service_account, "namespace": namespace}],
    }


class _ChildKeywords(TypedDict):
    """The keywords every discovery child builder takes, so ``**`` stays type-checked."""

    namespace: str
    owner: dict[str, Any] | None
    job_name: str | None


def discovery_children(
    job_name: str,
    nodes: Iterable[str],
    *,
    namespace: str,
    image: str,
    owner: dict[str, Any] | None = None,
    **pod_options: Any,
) -> list[dict[str, Any]]:
    """ServiceAccount, Role, RoleBinding (``<job>-discovery``) and one pod per node, in the order
    to create them."""
    nodes = list(dict.fromkeys(nodes))
    account = discovery_account_name(job_name)
    common: _ChildKeywords = {"namespace": namespace, "owner": owner, "job_name": job_name}
    return [
        discovery_service_account(account, **common),
        discovery_role(account, nodes, **common),
        discovery_role_binding(account, service_account=account, **common),
        *(
            discovery_pod(n, image=image, service_account=account, **common, **pod_options)
            for n in nodes
        ),
    ]


def cached_report_is_current(
    configmap: dict[str, Any] | None,
    node: dict[str, Any],
    *,
    now: dt.datetime,
    max_age_seconds: int = C.TOPOLOGY_REPORT_MAX_AGE_SECONDS,
) -> tuple[bool, str]:
    """May a job reuse ``moe-topology-<node>`` instead of running discovery? (yes/no, why).

    Current = has a report, was collected less than ``max_age_seconds`` ago, and (when both sides
    say) since the node's last boot: its ``moe-operator.io/boot-id`` annotation equals the Node's
    ``status.nodeInfo.bootID``. GPUs are not swapped without a reboot, so the GPU UUID set of a
    report from this boot is still the node's. Pure: ``configmap``/``node`` are API dicts.
    """
    if not configmap:
        return False, "no report"
    raw = (configmap.get("data") or {}).get(C.TOPOLOGY_KEY)
    try:
        collected = dt.datetime.fromisoformat(str(json.loads(raw or "{}").get("collectedAt", "")))
    except ValueError:
        return False, "report has no readable collectedAt"
    age = (now - collected).total_seconds()
    if age > max_age_seconds:
        return False, f"report is {int(age)}s old (max {max_age_seconds}s)"
    cached_boot = ((configmap.get("metadata") or {}).get("annotations") or {}).get(
        C.ANNOTATION_BOOT_ID
    )
    node_boot = ((node.get("status") or {}).get("nodeInfo") or {}).get("bootID")
    if cached_boot and node_boot and cached_boot != node_boot:
        return False, "node rebooted since the report was collected"
    return True, f"report from {int(age)}s ago, same boot"
