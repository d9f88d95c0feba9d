"""The GPUs of a node agent's node, and handing them to containers as the NVIDIA device plugin and
container runtime do.

A node is either a recorded machine (``NodeSpec.fixture`` names an NVML recording of
``moe_fake_nvml``) or the real GPUs of this machine (``fixture == "nvml"``, read with ``pynvml``).
Both are read through the same NVML calls, so the fake nodes of the tests exercise the code a real
GPU node runs.

Device plugin semantics (what a worker pod sees on a real GPU node):
- a container with ``resources.limits["nvidia.com/gpu"] = n`` is granted n GPUs of the node that
  no running container holds; it sees only those, renumbered 0..n-1 in PCI bus order. Here that is
  ``CUDA_VISIBLE_DEVICES`` / ``NVIDIA_VISIBLE_DEVICES`` = the granted UUIDs in PCI bus order
  (CUDA numbers the devices in the order of the list). A pod whose GPUs are not free is refused
  at admission (the kubelet's ``UnexpectedAdmissionError``), not queued;
- a container without a GPU limit sees no GPU unless its env sets ``NVIDIA_VISIBLE_DEVICES``
  (``all`` or a list of UUIDs/indices; the discovery pod's GPU access without a request), then
  exactly those.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

GPU_RESOURCE = "nvidia.com/gpu"
REAL_NVML = "nvml"  # NodeSpec.fixture for the real GPUs of this machine


class GpuAdmissionError(RuntimeError):
    """The node has fewer free GPUs than the pod's containers ask for."""


@dataclass(frozen=True)
class Gpu:
    index: int  # NVML index on the node (PCI bus order)
    uuid: str
    name: str
    memory_bytes: int


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def nvml_module(fixture: str) -> Any:
    """``pynvml`` for the real GPUs, else a FakeNvml replaying the recording ``fixture``."""
    if fixture == REAL_NVML:
        import pynvml

        return pynvml
    import moe_fake_nvml

    recording, _ = moe_fake_nvml.load_recording(fixture)
    return moe_fake_nvml.FakeNvml(recording)


def read_gpus(fixture: str) -> list[Gpu]:
    """The node's GPUs in NVML index order (NVML enumerates by PCI bus id)."""
    nvml = nvml_module(fixture)
    nvml.nvmlInit()
    try:
        gpus = []
        for i in range(int(nvml.nvmlDeviceGetCount())):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            gpus.append(
                Gpu(
                    index=i,
                    uuid=_text(nvml.nvmlDeviceGetUUID(h)),
                    name=_text(nvml.nvmlDeviceGetName(h)),
                    memory_bytes=int(nvml.nvmlDeviceGetMemoryInfo(h).total),
                )
            )
        return gpus
    finally:
        nvml.nvmlShutdown()


def gpu_limit(container: dict) -> int:
    """The container's ``nvidia.com/gpu`` limit (extended resources: request = limit)."""
    res = container.get("resources") or {}
    value = (res.get("limits") or {}).get(GPU_RESOURCE) or (res.get("requests") or {}).get(
        GPU_RESOURCE
    )
    return int(value or 0)


class GpuAllocator:
    """Which container of which pod holds which GPU of one node."""

    def __init__(self, gpus: list[Gpu]):
        self.gpus = list(gpus)
        self._held: dict[int, tuple[str, str]] = {}  # GPU index -> (pod uid, container)
        self._lock = threading.Lock()

    def allocate(self, uid: str, containers: list[dict]) -> dict[str, list[Gpu]]:
        """Grant every container of pod ``uid`` its GPUs at once (all or nothing); a container
        that already holds GPUs keeps them (restarts, retried preparation)."""
        with self._lock:
            grants: dict[str, list[Gpu]] = {}
            free = [g for g in self.gpus if g.index not in self._held]
            for c in containers:
                name, want = c["name"], gpu_limit(c)
                mine = [g for g in self.gpus if self._held.get(g.index) == (uid, name)]
                if len(mine) < want:
                    extra = want - len(mine)
                    if extra > len(free):
                        raise GpuAdmissionError(
                            f"Allocate failed due to requested number of devices unavailable for "
                            f"{GPU_RESOURCE}. Requested: {want}, Available: "
                            f"{len(free) + len(mine)}"
                        )
                    mine, free = mine + free[:extra], free[extra:]
                grants[name] = sorted(mine[:want], key=lambda g: g.index)
            for name, gs in grants.items():
                for g in gs:
                    self._held[g.index] = (uid, name)
            return grants

    def release(self, uid: str) -> None:
        with self._lock:
            for idx in [i for i, (u, _) in self._held.items() if u == uid]:
                del self._held[idx]

    def held_by(self, uid: str) -> list[int]:
        with self._lock:
            return sorted(i for i, (u, _) in self._held.items() if u == uid)


def visible_env(granted: list[Gpu], env: dict[str, str], gpus: list[Gpu]) -> dict[str, str]:
    """The env the runtime gives a container: the granted GPUs, else what its own
    ``NVIDIA_VISIBLE_DEVICES`` asks for, else none (``CUDA_VISIBLE_DEVICES`` empty)."""
    if granted:
        ids = ",".join(g.uuid for g in granted)
        return {"NVIDIA_VISIBLE_DEVICES": ids, "CUDA_VISIBLE_DEVICES": ids}
    asked = (env.get("NVIDIA_VISIBLE_DEVICES") or "").strip()
    if asked in ("", "void", "none"):
        return {"CUDA_VISIBLE_DEVICES": ""}
    if asked == "all":
        chosen = gpus
    else:
        by_key = {g.uuid: g for g in gpus} | {str(g.index): g for g in gpus}
        chosen = sorted(
            {by_key[k.strip()] for k in asked.split(",") if k.strip() in by_key},
            key=lambda g: g.index,
        )
    return {"CUDA_VISIBLE_DEVICES": ",".join(g.uuid for g in chosen)}
