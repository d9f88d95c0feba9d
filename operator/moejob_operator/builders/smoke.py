"""The upgrade gate's children: the smoke-test Job and the verdict ConfigMap (pure builders).

Both live in the operator's namespace and belong to no MoETrainingJob: a verdict is shared by
every job that uses the same identity, so no single job owns it (docs/gate.md). They carry the
`moe-operator.io/component: smoke|gate` label and the identity key instead.
"""

from __future__ import annotations

import json
from typing import Any

from moe_contracts import env as E

from .. import constants as C
from ..core import gate as G
from ..core.gate import golden as GG
from .common import pod_security_context, resources

SMOKE_COMMAND = ("moe-smoke",)
SCRATCH = "/var/tmp/moe-smoke"  # emptyDir: checkpoints of the smoke run, JIT builds
PLANS_DIR = E.SMOKE_PLANS_PATH.rsplit("/", 1)[
    0
]  # the SmokePlans ConfigMap (as a job's plan at /etc/moe)
PLANS_KEY = E.SMOKE_PLANS_KEY
GOLDEN_KEY = GG.GOLDEN_DATA_KEY  # the last image's golden values, beside the plans


def _labels(component: str, identity: G.Identity) -> dict[str, str]:
    return {
        C.LABEL_COMPONENT: component,
        C.LABEL_MANAGED_BY: C.MANAGED_BY,
        G.LABEL_GATE_KEY: identity.key,
    }


def smoke_args(identity: G.Identity, golden: bool = False) -> list[str]:
    args = ["--workdir", f"{SCRATCH}/work", "--plans", f"{PLANS_DIR}/{PLANS_KEY}"]
    args.append("--cpu" if identity.device == "CPU" else "--gpu")
    if identity.deepspeed_version:
        args += ["--expect-deepspeed", identity.deepspeed_version]
    if golden:
        args += ["--golden", f"{PLANS_DIR}/{GOLDEN_KEY}"]
    return args


def smoke_plans_configmap(
    identity: G.Identity,
    attempt: int,
    config: G.GateConfig,
    plans: dict[str, Any],
    golden: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """ConfigMap moe-smoke-<key>-<attempt>: the SmokePlans document the smoke Job mounts, and the
    SmokeGolden of the last image that passed the same plans on the same hardware, if any."""
    data = {PLANS_KEY: json.dumps(plans, sort_keys=True, indent=1) + "\n"}
    if golden is not None:
        data[GOLDEN_KEY] = json.dumps(golden, sort_keys=True) + "\n"
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": G.smoke_job_name(identity, attempt),
            "namespace": config.namespace,
            "labels": _labels("smoke", identity),
        },
        "data": data,
    }


def smoke_job(
    identity: G.Identity,
    attempt: int,
    config: G.GateConfig,
    *,
    image_pull_policy: str = "IfNotPresent",
    node: str | None = None,
    golden: bool = False,
) -> dict[str, Any]:
    """batch/v1 Job running `moe-smoke` once in the trainer image (1 GPU, or CPU + gloo) on the
    plans of ConfigMap moe-smoke-<key>-<attempt> (:func:`smoke_plans_configmap`).

    backoffLimit 0: a failed smoke run is a verdict, not something to retry. The verdict comes
    back as the container's termination message (FallbackToLogsOnError keeps the log tail when
    the program dies before writing one). ``node``: a GPU identity's smoke pod runs on a node of
    the job that asked (its GPUs are free until the job launches, and they are the GPU model the
    identity names) unless MOE_GATE_NODE_SELECTOR chooses.
    """
    name = G.smoke_job_name(identity, attempt)
    command = list(config.command or SMOKE_COMMAND)
    args = ([] if config.command else smoke_args(identity, golden)) + list(config.extra_args)
    container: dict[str, Any] = {
        "name": "smoke",
        "image": identity.image,
        "imagePullPolicy": image_pull_policy,
        "command": command,
        "args": args,
        "env": [
            {"name": "TORCH_EXTENSIONS_DIR", "value": f"{SCRATCH}/torch_extensions"},
            {
                "name": "HOME",
                "value": f"{SCRATCH}/home",
            },  # caches (triton, HF) of a uid without a home
            {"name": "HF_HUB_OFFLINE", "value": "1"},
            {"name": "NCCL_NVLS_ENABLE", "value": "0"},
            {"name": "MOE_GATE_KEY", "value": identity.key},
            {"name": "MOE_GATE_IMAGE", "value": identity.image},
        ],
        "volumeMounts": [
            {"name": "scratch", "mountPath": SCRATCH},
            {"name": "plans", "mountPath": PLANS_DIR, "readOnly": True},
        ],
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "privileged": False,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    if identity.device == "GPU":
        container["resources"] = resources({C.GPU_RESOURCE: 1}, {C.GPU_RESOURCE: 1})
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "securityContext": pod_security_context(),
        "containers": [container],
        "volumes": [
            {"name": "scratch", "emptyDir": {}},
            {"name": "plans", "configMap": {"name": name}},
        ],
    }
    if identity.device == "GPU":
        pod_spec["tolerations"] = [
            {"key": C.GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
        ]
    if config.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in config.image_pull_secrets]
    if config.node_selector:
        pod_spec["nodeSelector"] = dict(sorted(config.node_selector.items()))
    elif node and identity.device == "GPU":
        pod_spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    labels = _labels("smoke", identity)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": name,
            "namespace": config.namespace,
            "labels": labels,
            "annotations": {
                f"{C.GROUP}/gate-image": identity.image,
                f"{C.GROUP}/gate-deepspeed-version": identity.deepspeed_version or "",
                f"{C.GROUP}/gate-attempt": str(attempt),
            },
        },
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": config.deadline_seconds,
            "template": {"metadata": {"labels": dict(labels)}, "spec": pod_spec},
        },
    }


def verdict_configmap(
    record: dict[str, Any],
    namespace: str,
    *,
    golden: dict[str, Any] | None = None,
    resource_version: str | None = None,
) -> dict[str, Any]:
    """ConfigMap moe-gate-<key> holding one GateVerdict (key `verdict.json`) and, for a pass with
    golden values, its SmokeGolden (key `golden.json`, label ``gate-golden-key``)."""
    ident = record["identity"]
    meta: dict[str, Any] = {
        "name": f"{G.STORE_PREFIX}{ident['key']}",
        "namespace": namespace,
        "labels": {
            C.LABEL_COMPONENT: "gate",
            C.LABEL_MANAGED_BY: C.MANAGED_BY,
            G.LABEL_GATE_KEY: ident["key"],
            f"{C.GROUP}/gate-passed": "true" if record["passed"] else "false",
        },
        "annotations": {
            f"{C.GROUP}/gate-image": ident["image"],
            f"{C.GROUP}/gate-expires-at": record["expiresAt"],
        },
    }
    if resource_version:
        meta["resourceVersion"] = resource_version
    data = {G.VERDICT_KEY: json.dumps(record, indent=1, sort_keys=True)}
    if golden is not None:
        meta["labels"][GG.LABEL_GOLDEN_KEY] = golden["goldenKey"]
        data[GG.GOLDEN_DATA_KEY] = json.dumps(golden, sort_keys=True)
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}
