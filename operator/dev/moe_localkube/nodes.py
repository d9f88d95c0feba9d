"""GPU Node objects, shaped like what the kubelet, the NVIDIA device plugin and GPU Feature
Discovery would publish for a recorded machine (an NVML recording of ``moe_fake_nvml``) or, with
``fixture="nvml"``, for this machine's real GPUs (read with ``pynvml``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import moe_fake_nvml

from .gpus import REAL_NVML, read_gpus

RECORDINGS_DIR = moe_fake_nvml.recordings_dir()
FAKE_TOPOLOGY_ANNOTATION = "moe-operator.io/fake-topology"
FAKE_NVML_ENV = moe_fake_nvml.FIXTURE_ENV
GPU_RESOURCE = "nvidia.com/gpu"
MIB = 1 << 20


class FixtureError(ValueError):
    """Unknown or unreadable NVML recording."""


@dataclass(frozen=True)
class GpuShape:
    product: str  # GFD style: spaces -> dashes ("NVIDIA-H100-80GB-HBM3")
    count: int
    memory_mib: int


def known_fixtures(recordings_dir: Path = RECORDINGS_DIR) -> list[str]:
    return sorted(p.stem for p in recordings_dir.glob("*.json"))


def fixture_gpus(fixture: str, recordings_dir: Path = RECORDINGS_DIR) -> GpuShape:
    """Product, count and memory of the GPUs in the NVML recording ``fixture`` (``"nvml"``: of
    this machine's real GPUs)."""
    if fixture == REAL_NVML:
        gpus = read_gpus(REAL_NVML)
        if not gpus:
            raise FixtureError("nvml: this machine's NVML reports no GPU")
        return GpuShape(
            product=gpus[0].name.replace(" ", "-"),
            count=len(gpus),
            memory_mib=gpus[0].memory_bytes // MIB,
        )
    path = recordings_dir / f"{fixture}.json"
    if not path.is_file():
        raise FixtureError(
            f"unknown fake-topology fixture {fixture!r}; known: {known_fixtures(recordings_dir)}"
        )
    doc = json.loads(path.read_text())
    gpus = doc.get("gpus") or []
    if not gpus:
        raise FixtureError(f"{path}: no gpus")
    name = gpus[0].get("nvmlDeviceGetName", "NVIDIA-GPU")
    mem = int(gpus[0].get("nvmlDeviceGetMemoryInfo", {}).get("total", 0))
    return GpuShape(product=name.replace(" ", "-"), count=len(gpus), memory_mib=mem // MIB)


@dataclass(frozen=True)
class NodeSpec:
    """One node of the agent: its name and the recorded machine it pretends to be (``"nvml"``:
    this machine's real GPUs)."""

    name: str
    fixture: str = "nvswitch-h100-8"
    cpu: str = "64"
    memory: str = "512Gi"
    pods: int = 110
    extra_labels: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> NodeSpec:
        """``node-a:nvswitch-h100-8`` (fixture optional; ``gpu-0:nvml`` for the real GPUs)."""
        name, _, fixture = text.partition(":")
        if not name:
            raise ValueError(f"bad node spec {text!r}: want NAME[:FIXTURE]")
        return cls(name=name, fixture=fixture or cls.fixture)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def node_manifest(spec: NodeSpec, gpus: GpuShape | None = None) -> dict:
    gpus = gpus or fixture_gpus(spec.fixture)
    labels = {
        "kubernetes.io/hostname": spec.name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": gpus.product,
        "nvidia.com/gpu.count": str(gpus.count),
        "nvidia.com/gpu.memory": str(gpus.memory_mib),
        **spec.extra_labels,
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": spec.name,
            "labels": labels,
            "annotations": {
                **({} if spec.fixture == REAL_NVML else {FAKE_TOPOLOGY_ANNOTATION: spec.fixture}),
                "moe-operator.io/fake-node": "moe_localkube.nodeagent",
            },
        },
        "spec": {},
    }


def node_status(
    spec: NodeSpec,
    host_ip: str = "127.0.0.1",
    kubelet_port: int = 0,
    gpus: GpuShape | None = None,
) -> dict:
    gpus = gpus or fixture_gpus(spec.fixture)
    resources = {
        "cpu": spec.cpu,
        "memory": spec.memory,
        "pods": str(spec.pods),
        "ephemeral-storage": "1Ti",
        GPU_RESOURCE: str(gpus.count),
    }
    now = _now()
    return {
        "capacity": resources,
        "allocatable": resources,
        "addresses": [
            {"type": "InternalIP", "address": host_ip},
            {"type": "Hostname", "address": spec.name},
        ],
        "conditions": [
            {
                "type": t,
                "status": "False",
                "reason": r,
                "message": m,
                "lastHeartbeatTime": now,
                "lastTransitionTime": now,
            }
            for t, r, m in (
                ("MemoryPressure", "KubeletHasSufficientMemory", "fake node"),
                ("DiskPressure", "KubeletHasNoDiskPressure", "fake node"),
                ("PIDPressure", "KubeletHasSufficientPID", "fake node"),
            )
        ]
        + [
            {
                "type": "Ready",
                "status": "True",
                "reason": "KubeletReady",
                "message": "moe_localkube node agent is posting ready status",
                "lastHeartbeatTime": now,
                "lastTransitionTime": now,
            }
        ],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": kubelet_port}},
        "nodeInfo": {
            "architecture": "amd64",
            "bootID": "",
            "containerRuntimeVersion": "moe-localkube://0",
            "kernelVersion": "",
            "kubeProxyVersion": "v1.20.2",
            "kubeletVersion": "v1.20.2",
            "machineID": "",
            "operatingSystem": "linux",
            "osImage": "moe_localkube fake GPU node",
            "systemUUID": "",
        },
    }
