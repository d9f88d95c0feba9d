"""The digest probe: a pod that only starts the job's image on one node, so that the node's
container runtime reports which build (``status.containerStatuses[].imageID``) the tag means there
before any worker runs it (pure builder; docs/gate.md, "A re-pushed tag")."""

from __future__ import annotations

from typing import Any

from ..spec import JobSpec
from .common import JobRef, child_metadata, pod_security_context, pull_secrets, resources

COMPONENT = "digest-probe"
PROBE_COMMAND = ("true",)  # coreutils: in every trainer image (and on every dev node)


def probe_name(job: JobRef, index: int) -> str:
    return f"{job.name}-digest-{index}"


def probe_pod(job: JobRef, spec: JobSpec, node: str, index: int) -> dict[str, Any]:
    """Node ``node`` (the gang's node rank ``index``) pulls ``spec.image`` as the workers would
    (same pull policy) and exits at once; bound to the node directly (no scheduling: it asks for
    no GPU and next to no memory)."""
    container: dict[str, Any] = {
        "name": "probe",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": list(PROBE_COMMAND),
        "resources": resources({"cpu": "10m", "memory": "16Mi"}, {"cpu": "100m", "memory": "64Mi"}),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "privileged": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
        },
    }
    pod_spec: dict[str, Any] = {
        "nodeName": node,
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 0,
        "securityContext": pod_security_context(fs_group=False),
        "containers": [container],
    }
    if spec.scheduling.tolerations:
        pod_spec["tolerations"] = [
            t.model_dump(by_alias=True, exclude_none=True) for t in spec.scheduling.tolerations
        ]
    meta = child_metadata(job, probe_name(job, index), COMPONENT)
    pod_spec.update(pull_secrets(spec))
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}
