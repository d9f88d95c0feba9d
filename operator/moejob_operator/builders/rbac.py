"""Per-job ServiceAccount, Role and RoleBinding for the worker pods.

Least privilege: the trainer may read and update exactly two ConfigMaps of its own job (progress
and routing statistics), nothing else; the operator seeds both so no ``create`` is needed. With
``spec.placement.replan`` it may also read (only) the job's ``<job>-placement``.
"""

from __future__ import annotations

from typing import Any

from .common import (
    JobRef,
    child_metadata,
    placement_configmap_name,
    progress_configmap_name,
    routing_stats_configmap_name,
    worker_account_name,
)


def service_account(job: JobRef) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": child_metadata(job, worker_account_name(job), "worker-rbac"),
        "automountServiceAccountToken": False,
    }


def role(job: JobRef, *, placement: bool = False) -> dict[str, Any]:
    """``placement``: the job re-places (``spec.placement.replan``): its PlacementUpdate is read."""
    rules: list[dict[str, Any]] = [
        {
            "apiGroups": [""],
            "resources": ["configmaps"],
            "resourceNames": [progress_configmap_name(job), routing_stats_configmap_name(job)],
            "verbs": ["get", "update", "patch"],
        }
    ]
    if placement:
        rules.append(
            {
                "apiGroups": [""],
                "resources": ["configmaps"],
                "resourceNames": [placement_configmap_name(job)],
                "verbs": ["get"],
            }
        )
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": child_metadata(job, worker_account_name(job), "worker-rbac"),
        "rules": rules,
    }


def role_binding(job: JobRef) -> dict[str, Any]:
    name = worker_account_name(job)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": child_metadata(job, name, "worker-rbac"),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": job.namespace}],
    }
