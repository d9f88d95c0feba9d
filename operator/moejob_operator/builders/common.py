"""Names, labels and owner references shared by every child of a MoETrainingJob."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import constants as C

# <job>-worker-<rank> must be a DNS-1123 label (<= 63) because it is the pod's hostname, and the
# Service <job>-workers a DNS-1035 label: job names are limited so that every child name fits.
MAX_JOB_NAME = 48


@dataclass(frozen=True)
class JobRef:
    """Identity of the owning MoETrainingJob (everything a builder needs from metadata)."""

    namespace: str
    name: str
    uid: str

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> JobRef:
        meta = body["metadata"]
        return cls(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"])


def worker_name(job: JobRef, rank: int) -> str:
    return f"{job.name}-worker-{rank}"


def service_name(job: JobRef) -> str:
    return f"{job.name}-workers"


def plan_configmap_name(job: JobRef) -> str:
    return f"{job.name}-plan"


def progress_configmap_name(job: JobRef) -> str:
    return f"{job.name}-progress"


def routing_stats_configmap_name(job: JobRef) -> str:
    return f"{job.name}-routing-stats"


def worker_account_name(job: JobRef) -> str:
    return f"{job.name}-worker"


def master_addr(job: JobRef) -> str:
    """DNS name of node rank 0 through the headless Service (hostname + subdomain)."""
    return f"{worker_name(job, 0)}.{service_name(job)}.{job.namespace}.svc.cluster.local"


def checkpoint_dir(job: JobRef, mount_path: str) -> str:
    """Per-job directory under the checkpoint mount: a re-created job of the same name (new
    uid) starts fresh instead of resuming someone else's checkpoints."""
    return f"{mount_path.rstrip('/')}/{job.name}-{job.uid[:8]}"


def owner_reference(job: JobRef) -> dict[str, Any]:
    return {"apiVersion": C.API_VERSION, "kind": C.KIND, "name": job.name, "uid": job.uid,
            "controller": True, "blockOwnerDeletion": True}


def labels(job: JobRef, component: str, **extra: str) -> dict[str, str]:
    out = {C.LABEL_JOB: job.name, C.LABEL_COMPONENT: component, C.LABEL_MANAGED_BY: C.MANAGED_BY}
    out.update(extra)
    return out


def child_metadata(job: JobRef, name: str, component: str, *, extra_labels: dict[str, str] | None = None,
                   annotations: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": job.namespace,
                            "labels": labels(job, component, **(extra_labels or {})),
                            "ownerReferences": [owner_reference(job)]}
    if annotations:
        meta["annotations"] = dict(sorted(annotations.items()))
    return meta
