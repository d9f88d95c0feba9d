"""The headless Service and the worker pods: one pod per node rank, env rendezvous, no SSH.

Pinning: a worker goes to its planned node through a *required node affinity* on the node's
``metadata.name`` field (as the DaemonSet controller does), not through ``spec.nodeName``. With
``nodeName`` the pod skips the scheduler: no resource accounting for ``nvidia.com/gpu``, no taint
check, no priority/preemption, and a custom ``schedulerName`` (Volcano, coscheduling, Kueue) would
never see the pod. The affinity keeps all of that and still allows only the planned node.
"""

from __future__ import annotations

from typing import Any

from moe_contracts import env as E

from .. import constants as C
from ..spec import JobSpec
from . import volumes as volumes_mod
from .common import (
    JobRef,
    checkpoint_dir,
    child_metadata,
    job_ports,
    master_addr,
    placement_configmap_name,
    plan_configmap_name,
    pod_security_context,
    progress_configmap_name,
    pull_secrets,
    resources,
    routing_stats_configmap_name,
    service_name,
    token_mount,
    token_volume,
    worker_account_name,
    worker_name,
)
from .gang import Gang
from .gang import pod_fields as gang_fields
from .gang import resolve as resolve_gang

TRAINER_COMMAND = ("moe-train",)  # in a pod: the node launcher (moe_trainer.launch)
SCRATCH = "/tmp"  # the workers' writable emptyDir under a read-only root filesystem
DEFAULT_MEMORY_PER_RANK_GI = 2  # the memory request per rank when spec.resources has none


def trainer_args(spec: JobSpec) -> list[str]:
    """Arguments of every rank: ``--cpu`` on CPU (gloo even where a GPU is visible)."""
    return ["--cpu"] if spec.device == "CPU" else []


def headless_service(job: JobRef) -> dict[str, Any]:
    """Gives every worker a stable DNS name ``<pod>.<job>-workers.<ns>.svc.cluster.local``."""
    rendezvous, _ = job_ports(job)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(job, service_name(job), "worker"),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {C.LABEL_JOB: job.name, C.LABEL_COMPONENT: "worker"},
            "ports": [
                {
                    "name": "rendezvous",
                    "port": rendezvous,
                    "targetPort": rendezvous,
                    "protocol": "TCP",
                }
            ],
        },
    }


def _volumes(job: JobRef, spec: JobSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes: list[dict[str, Any]] = [
        {"name": C.PLAN_VOLUME, "configMap": {"name": plan_configmap_name(job)}}
    ]
    mounts: list[dict[str, Any]] = [
        {"name": C.PLAN_VOLUME, "mountPath": C.PLAN_MOUNT_DIR, "readOnly": True}
    ]

    pairs = [
        volumes_mod.checkpoint(spec),
        volumes_mod.data(spec),
        volumes_mod.model(spec),
        volumes_mod.cache(spec, read_only=True),
        volumes_mod.output(spec),
    ]
    for pair in pairs:
        if pair is not None:
            volumes.append(pair[0])
            mounts.append(pair[1])

    # The trainer's API credentials: a bound, expiring ServiceAccount token (what 1.21+ injects by
    # default), projected explicitly. Unlike the legacy automount it does not make admission wait
    # for the token controller to mint a Secret for the new per-job ServiceAccount (1.20).
    volumes.append(token_volume())
    mounts.append(token_mount())

    # The root filesystem is read-only: what the trainer writes besides its volumes (DeepSpeed's
    # and Triton's JIT builds, Hugging Face caches, temporary files) goes to this emptyDir.
    volumes.append({"name": "scratch", "emptyDir": {}})
    mounts.append({"name": "scratch", "mountPath": SCRATCH})

    if spec.device == "GPU":
        # NCCL needs more shared memory than the container default (64 MiB).
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    return volumes, mounts


def _env(
    job: JobRef, spec: JobSpec, node_rank: int, extra_env: dict[str, str]
) -> list[dict[str, Any]]:
    """The pod's env. Per-rank variables (``RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``) are not
    here: the pod's entry point (``moe-train`` as node launcher, ``moe_trainer.launch``) starts
    ``NPROC_PER_NODE`` ranks and gives each its own, ``RANK = NODE_RANK x NPROC_PER_NODE +
    LOCAL_RANK``."""
    rendezvous, metrics_port = job_ports(job)
    env = {
        E.NODE_RANK: str(node_rank),
        E.NNODES: str(spec.nodes.count),
        E.NPROC_PER_NODE: str(spec.nodes.gpus_per_node),
        E.WORLD_SIZE: str(spec.nodes.world_size),
        E.MASTER_ADDR: master_addr(job),
        E.MASTER_PORT: str(rendezvous),  # per job: pods on one host network must not collide
        # NVLink SHARP multicast: off (needs fabric manager support we cannot assume).
        E.NCCL_NVLS_ENABLE: "0",
        E.PLAN: E.DEFAULT_PLAN_PATH,
        E.CHECKPOINT_DIR: checkpoint_dir(job, spec.checkpoint.path),
        E.PROGRESS_CONFIGMAP: progress_configmap_name(job),
        E.ROUTING_STATS_CONFIGMAP: routing_stats_configmap_name(job),
        # Prometheus endpoint (the trainer serves it on rank 0 only; every pod gets the same env
        # and port so that any pod can be rank 0 and the PodMonitor's `port: metrics` finds it)
        E.METRICS_PORT: str(metrics_port),
        # caches of a read-only root filesystem: the scratch emptyDir (_volumes)
        E.HOME: f"{SCRATCH}/home",
        E.TORCH_EXTENSIONS_DIR: f"{SCRATCH}/torch_extensions",
    }
    if spec.placement.replan is not None:  # the trainer reads it at its checkpoints
        env[E.PLACEMENT_CONFIGMAP] = placement_configmap_name(job)
    env.update(extra_env)
    out: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in env.items()]
    # the launcher checks it against the plan's node for this node rank
    out.append({"name": E.NODE_NAME, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}})
    return out


def _resources(spec: JobSpec) -> dict[str, Any]:
    """``spec.resources`` plus, on GPUs, ``nvidia.com/gpu: gpusPerNode`` (request = limit, as
    extended resources require). With the NVIDIA device plugin the container then sees exactly
    these GPUs, renumbered 0..gpusPerNode-1: the plan's ``ranks[].gpu`` indexes that list."""
    requests = dict(spec.resources.requests or {})
    limits = dict(spec.resources.limits or {})
    # Without requests a worker is BestEffort, the first pod the kubelet evicts under memory
    # pressure: each rank asks for at least a core and DEFAULT_MEMORY_PER_RANK unless the spec
    # says otherwise (Burstable; no limits added).
    ranks = spec.nodes.gpus_per_node
    for key, default in (
        ("cpu", str(ranks)),
        ("memory", f"{ranks * DEFAULT_MEMORY_PER_RANK_GI}Gi"),
    ):
        if key not in requests and key not in limits:
            requests[key] = default
    if spec.device == "GPU":
        limits[C.GPU_RESOURCE] = spec.nodes.gpus_per_node
        requests[C.GPU_RESOURCE] = spec.nodes.gpus_per_node
    return resources(requests, limits)


def worker_pod(
    job: JobRef,
    spec: JobSpec,
    *,
    node_rank: int,
    node: str,
    attempt: int,
    spec_hash: str,
    extra_env: dict[str, str] | None = None,
    image: str | None = None,
    gang: Gang | None = None,
) -> dict[str, Any]:
    """Node rank ``node_rank`` of gang attempt ``attempt``, required to run on ``node``;
    ``gang``: the resolved gang scheduler (None: what the spec alone says, :func:`gang.resolve`)."""
    sched = spec.scheduling
    count = spec.nodes.count
    if not isinstance(count, int):  # sizing replaces Auto before any pod is built
        raise ValueError("nodes.count: Auto must be resolved by the plan before worker pods")
    gang_labels, gang_annotations, scheduler = gang_fields(
        job, sched, gang or resolve_gang(sched), attempt, count
    )
    annotations = dict(sched.pod_annotations or {})
    annotations.update(gang_annotations)
    annotations[C.ANNOTATION_SPEC_HASH] = spec_hash
    extra = {C.LABEL_NODE_RANK: str(node_rank), C.LABEL_ATTEMPT: str(attempt), **gang_labels}
    meta = child_metadata(
        job, worker_name(job, node_rank), "worker", annotations=annotations, extra_labels=extra
    )
    # pass-through labels (Kueue queue name, ...) first: the operator's own labels win
    meta["labels"] = dict(sorted({**(sched.pod_labels or {}), **meta["labels"]}.items()))

    volumes, mounts = _volumes(job, spec)
    rendezvous, metrics_port = job_ports(job)
    container: dict[str, Any] = {
        "name": "trainer",
        "image": image or spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": list(TRAINER_COMMAND),
        "args": trainer_args(spec),
        "env": _env(job, spec, node_rank, extra_env or {}),
        "ports": [
            {"name": "rendezvous", "containerPort": rendezvous, "protocol": "TCP"},
            {"name": "metrics", "containerPort": metrics_port, "protocol": "TCP"},
        ],
        "volumeMounts": mounts,
        # the launcher writes one message for the pod (which rank failed first, its last lines)
        "terminationMessagePolicy": "FallbackToLogsOnError",
        # The restricted profile and a read-only root filesystem (writable: the volumes, the
        # scratch emptyDir at SCRATCH, /dev/shm).
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "privileged": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
        },
    }
    res = _resources(spec)
    if res:
        container["resources"] = res

    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "hostname": worker_name(job, node_rank),
        "subdomain": service_name(job),
        "serviceAccountName": worker_account_name(job),
        "automountServiceAccountToken": False,  # bound token projected instead (_volumes)
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 30,
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchFields": [
                                {"key": "metadata.name", "operator": "In", "values": [node]}
                            ]
                        }
                    ]
                }
            }
        },
        "securityContext": pod_security_context(),
        "containers": [container],
        "volumes": volumes,
        **pull_secrets(spec),
    }
    if sched.node_selector:
        pod_spec["nodeSelector"] = dict(sorted(sched.node_selector.items()))
    if sched.tolerations:
        pod_spec["tolerations"] = [
            t.model_dump(by_alias=True, exclude_none=True) for t in sched.tolerations
        ]
    if sched.priority_class_name:
        pod_spec["priorityClassName"] = sched.priority_class_name
    if scheduler:
        pod_spec["schedulerName"] = scheduler
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


def worker_pods(
    job: JobRef,
    spec: JobSpec,
    rank2node: list[str],
    *,
    attempt: int,
    spec_hash: str,
    extra_env: dict[str, str] | None = None,
    node_ranks: list[int] | None = None,
    image: str | None = None,
    gang: Gang | None = None,
) -> list[dict[str, Any]]:
    """The gang's pods (``node_ranks``: only these, e.g. the ones a restart must recreate);
    ``rank2node[node_rank]`` is the node the plan chose; ``image``: the reference to run instead
    of ``spec.image`` (the gate's verified digest of it). The operator creates pods only through
    this function."""
    if len(rank2node) != spec.nodes.count:
        raise ValueError(
            f"plan has {len(rank2node)} node ranks, spec.nodes.count is {spec.nodes.count}"
        )
    ranks = range(spec.nodes.count) if node_ranks is None else node_ranks
    return [
        worker_pod(
            job,
            spec,
            node_rank=r,
            node=rank2node[r],
            attempt=attempt,
            spec_hash=spec_hash,
            extra_env=extra_env,
            image=image,
            gang=gang,
        )
        for r in ranks
    ]
