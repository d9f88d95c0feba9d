"""The pods that run once before planning: model inspection (``moe-inspect``) and data
preparation (``moe-prepare-data``), with the ServiceAccount, Role and ConfigMaps they report
through.

Each pod writes one document into a ConfigMap the operator seeds empty (``<job>-model``:
ModelReport, ``<job>-data``: DataPrepReport); their ServiceAccount ``<job>-prepare`` may
get/update/patch exactly those two and nothing else. Both run as non-root with a read-only root
filesystem (the prepare pod gets an emptyDir for library caches), request no GPU, and go through
the scheduler with the job's node constraints. The model directory and the data are mounted
read-only; only the prepare pod's cache (the data cache volume, else the checkpoint volume) is
writable.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moe_contracts import env as E

from ..spec import JobSpec
from . import volumes
from .common import (
    JobRef,
    child_metadata,
    pod_security_context,
    pull_secrets,
    resources,
    token_mount,
    token_volume,
)

INSPECT_COMMAND = ("moe-inspect",)
PREPARE_COMMAND = ("moe-prepare-data",)
COMPONENT_INSPECT = "inspect"
COMPONENT_PREPARE = "prepare-data"
INSPECT_DEADLINE_SECONDS = 600
INSPECT_RESOURCES = ({"cpu": "100m", "memory": "256Mi"}, {"memory": "1Gi"})
PREPARE_RESOURCES = ({"cpu": "1", "memory": "2Gi"}, {"memory": "8Gi"})
SCRATCH = "/tmp"


def account_name(job: JobRef) -> str:
    return f"{job.name}-prepare"


def model_configmap_name(job: JobRef) -> str:
    return f"{job.name}-model"


def data_configmap_name(job: JobRef) -> str:
    return f"{job.name}-data"


def inspect_pod_name(job: JobRef, recheck: bool = False) -> str:
    """``<job>-inspect`` before planning, ``<job>-inspect-launch`` right before the launch."""
    return f"{job.name}-inspect" + ("-launch" if recheck else "")


def prepare_pod_name(job: JobRef) -> str:
    return f"{job.name}-prepare-data"


def report_configmap(job: JobRef, name: str, component: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_metadata(job, name, component),
        "data": {},
    }


def rbac_objects(job: JobRef) -> list[dict[str, Any]]:
    """ServiceAccount, Role, RoleBinding ``<job>-prepare``, in the order to create them."""
    name = account_name(job)
    meta = child_metadata(job, name, "prepare-rbac")
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": meta,
            "automountServiceAccountToken": False,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": meta,
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["configmaps"],
                    "resourceNames": [model_configmap_name(job), data_configmap_name(job)],
                    "verbs": ["get", "update", "patch"],
                }
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": job.namespace}],
        },
    ]


def _user_resources(
    spec: JobSpec, default: tuple[Mapping[str, str], Mapping[str, str]]
) -> dict[str, Any]:
    """The job's cpu/memory when it sets them (tokenizing is the workers' kind of work), else
    ``default``; never GPUs."""
    req = {k: v for k, v in (spec.resources.requests or {}).items() if k in ("cpu", "memory")}
    lim = {k: v for k, v in (spec.resources.limits or {}).items() if k in ("cpu", "memory")}
    return resources(req or default[0], lim or default[1])


def _pod(
    job: JobRef,
    spec: JobSpec,
    name: str,
    component: str,
    command: tuple[str, ...],
    args: list[str],
    pairs: list[tuple[dict[str, Any], dict[str, Any]] | None],
    res: dict[str, Any],
    env: dict[str, str],
    deadline: int | None,
) -> dict[str, Any]:
    vols = [token_volume(), {"name": "scratch", "emptyDir": {}}]
    mounts = [token_mount(), {"name": "scratch", "mountPath": SCRATCH}]
    for pair in pairs:
        if pair is not None:
            vols.append(pair[0])
            mounts.append(pair[1])
    container = {
        "name": component,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": list(command),
        "args": args,
        "env": [{"name": k, "value": v} for k, v in sorted(env.items())],
        "volumeMounts": mounts,
        "resources": res,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "privileged": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "serviceAccountName": account_name(job),
        "automountServiceAccountToken": False,  # bound token projected instead
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 10,
        "securityContext": pod_security_context(),
        "containers": [container],
        "volumes": vols,
    }
    if deadline:
        pod_spec["activeDeadlineSeconds"] = deadline
    pod_spec.update(pull_secrets(spec))
    selector = {**(spec.nodes.node_selector or {}), **(spec.scheduling.node_selector or {})}
    if selector:
        pod_spec["nodeSelector"] = dict(sorted(selector.items()))
    if spec.nodes.node_names:
        term = {"key": "metadata.name", "operator": "In", "values": list(spec.nodes.node_names)}
        pod_spec["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchFields": [term]}]
                }
            }
        }
    if spec.scheduling.tolerations:
        pod_spec["tolerations"] = [
            t.model_dump(by_alias=True, exclude_none=True) for t in spec.scheduling.tolerations
        ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": child_metadata(job, name, component),
        "spec": pod_spec,
    }


def _scratch_env() -> dict[str, str]:
    return {
        "HOME": SCRATCH,
        "HF_HOME": f"{SCRATCH}/hf",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": f"{SCRATCH}/hf/datasets",
    }


def inspect_pod(job: JobRef, spec: JobSpec, *, recheck: bool = False) -> dict[str, Any]:
    """The pod that inspects ``spec.model.path`` and publishes ModelReport v1 to ``<job>-model``
    (``recheck``: the pre-launch one, which publishes to the same ConfigMap under its own key)."""
    if spec.model.path is None:
        raise ValueError("inspect_pod: spec.model.path is not set")
    key = E.MODEL_REPORT_KEY if not recheck else f"launch-{E.MODEL_REPORT_KEY}"
    return _pod(
        job,
        spec,
        inspect_pod_name(job, recheck),
        COMPONENT_INSPECT,
        INSPECT_COMMAND,
        [spec.model.path, "--configmap", model_configmap_name(job), "--key", key],
        [volumes.model(spec)],
        resources(*INSPECT_RESOURCES),
        _scratch_env(),
        INSPECT_DEADLINE_SECONDS,
    )


def prepare_pod(
    job: JobRef, spec: JobSpec, *, tokenizer: str | None, vocab_size: int
) -> dict[str, Any]:
    """The pod that tokenizes ``spec.data`` once (``tokenizer``: the model directory, None for
    byte-level) and publishes DataPrepReport v1 to ``<job>-data``."""
    d = spec.data
    args = [
        "--source",
        d.kind.lower(),
        "--data",
        d.path,
        "--format",
        (d.format or "Text").lower(),
        "--field",
        d.field_name,
        "--seq-len",
        str(spec.training.seq_len),
        "--out-root",
        volumes.prepared_root(spec),
        "--vocab-size",
        str(vocab_size),
        "--configmap",
        data_configmap_name(job),
    ]
    if tokenizer:
        args += ["--tokenizer", tokenizer]
    writable = volumes.cache(spec, read_only=False) or volumes.checkpoint(spec)
    return _pod(
        job,
        spec,
        prepare_pod_name(job),
        COMPONENT_PREPARE,
        PREPARE_COMMAND,
        args,
        [volumes.model(spec), volumes.data(spec), writable],
        _user_resources(spec, PREPARE_RESOURCES),
        _scratch_env(),
        spec.run_policy.active_deadline_seconds,
    )
