"""Names, labels, owner references and the pod security context shared by every child of a
MoETrainingJob."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
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


# The workers' user and group; the prepare, smoke and digest-probe pods run as it too, so the files
# one child writes on a shared volume are the others' to read.
RUN_AS_USER = 1000


def pod_security_context(user: int = RUN_AS_USER, *, fs_group: bool = True) -> dict[str, Any]:
    """A child pod's ``securityContext``: not root, as ``user`` (uid and gid), RuntimeDefault
    seccomp; ``fs_group`` also gives mounted volumes to that group (pods without volumes skip it).
    """
    ctx: dict[str, Any] = {"runAsNonRoot": True, "runAsUser": user, "runAsGroup": user}
    if fs_group:
        ctx["fsGroup"] = user
    ctx["seccompProfile"] = {"type": "RuntimeDefault"}
    return ctx


def quantity(value: int | str) -> str:
    """A resource quantity as the API expects it: a string (``2`` -> ``"2"``). The pinned
    kubernetes client validates request bodies and refuses integers under ``resources``; the
    CRD allows either (int-or-string), so every builder goes through here."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"{value!r} is not a resource quantity")
    return str(value)


def resources(
    requests: Mapping[str, int | str] | None = None, limits: Mapping[str, int | str] | None = None
) -> dict[str, Any]:
    """A container's ``resources`` block, quantities as strings, keys sorted; empty parts left
    out."""
    out: dict[str, Any] = {}
    for part, values in (("requests", requests), ("limits", limits)):
        if values:
            out[part] = {k: quantity(v) for k, v in sorted(values.items())}
    return out


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


def placement_configmap_name(job: JobRef) -> str:
    """The PlacementUpdate ConfigMap (``spec.placement.replan`` only)."""
    return f"{job.name}-placement"


def worker_account_name(job: JobRef) -> str:
    return f"{job.name}-worker"


def master_addr(job: JobRef) -> str:
    """DNS name of node rank 0 through the headless Service (hostname + subdomain)."""
    return f"{worker_name(job, 0)}.{service_name(job)}.{job.namespace}.svc.cluster.local"


def job_ports(job: JobRef) -> tuple[int, int]:
    """(rendezvous port, metrics port) of ``job``: deterministic, different for most pairs of jobs.

    Pods on one host network (the local node agent runs every pod that way; ``hostNetwork`` on a
    cluster) would otherwise collide on a fixed 29500 as soon as two jobs run at once. On a
    cluster each pod has its own network namespace and any port works. The hash is of
    ``namespace/name`` (not the uid): a re-created job keeps its ports. Two jobs share a port
    pair with probability 1/PORT_SLOTS; rendezvous ports are even and metrics ports odd, so one
    job's metrics port is never another's rendezvous port.
    """
    digest = hashlib.sha256(f"{job.namespace}/{job.name}".encode()).digest()
    slot = int.from_bytes(digest[:8], "big") % C.PORT_SLOTS
    rendezvous = C.PORT_BASE + 2 * slot
    return rendezvous, rendezvous + 1


def checkpoint_dir(job: JobRef, mount_path: str) -> str:
    """Per-job directory under the checkpoint mount: a re-created job of the same name (new
    uid) starts fresh instead of resuming someone else's checkpoints."""
    return f"{mount_path.rstrip('/')}/{job.name}-{job.uid[:8]}"


def owner_reference(job: JobRef) -> dict[str, Any]:
    return {
        "apiVersion": C.API_VERSION,
        "kind": C.KIND,
        "name": job.name,
        "uid": job.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def labels(job: JobRef, component: str, **extra: str) -> dict[str, str]:
    out = {C.LABEL_JOB: job.name, C.LABEL_COMPONENT: component, C.LABEL_MANAGED_BY: C.MANAGED_BY}
    out.update(extra)
    return out


def child_metadata(
    job: JobRef,
    name: str,
    component: str,
    *,
    extra_labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": job.namespace,
        "labels": labels(job, component, **(extra_labels or {})),
        "ownerReferences": [owner_reference(job)],
    }
    if annotations:
        meta["annotations"] = dict(sorted(annotations.items()))
    return meta


# The API credentials of pods that talk to the API server (workers, discovery): a bound, expiring
# ServiceAccount token with the cluster CA and the namespace, the volume 1.21+ injects by default,
# written out so that 1.20's admission does not wait for the token controller to mint a Secret for
# a freshly created ServiceAccount (the legacy automount does).
TOKEN_VOLUME = "api-token"
SA_TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def token_volume() -> dict[str, Any]:
    return {
        "name": TOKEN_VOLUME,
        "projected": {
            "defaultMode": 0o444,
            "sources": [
                {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
                {
                    "configMap": {
                        "name": "kube-root-ca.crt",
                        "items": [{"key": "ca.crt", "path": "ca.crt"}],
                    }
                },
                {
                    "downwardAPI": {
                        "items": [
                            {"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}
                        ]
                    }
                },
            ],
        },
    }


def token_mount() -> dict[str, Any]:
    return {"name": TOKEN_VOLUME, "mountPath": SA_TOKEN_DIR, "readOnly": True}


def pull_secrets(spec: Any) -> dict[str, Any]:
    """``imagePullSecrets`` for a pod running the job's image (empty: none given)."""
    refs = [{"name": r.name} for r in spec.image_pull_secrets or ()]
    return {"imagePullSecrets": refs} if refs else {}
