"""Fake NVML driven by a recording: the GPU of machines without one (dev/test tooling).

Not in the images. `FakeNvml(recording)` has the call surface `moe_trainer.discovery.nvml_probe`
uses and replays a recording that `moe-discover --record` wrote on a real node (the format:
`moe_trainer.discovery.nvml_record`, docs/discovery.md) or that `moe_fake_nvml.synth` made for a
machine shape nobody here can record. `moe-discover` reaches this package only when
`$MOE_FAKE_NVML_FIXTURE` or `--fake-nvml` asks for a fixture; on the local cluster's nodes the
node provides it as the NVIDIA container runtime provides the driver: the node agent's pods run
from this venv, and the real nodes (`moe_localkube.realnodes`) mount this package into every
container of a GPU-like node and put it on `PYTHONPATH` (`runtime_mount()`).
"""

from __future__ import annotations

import json
import os
import shutil
from importlib import resources
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml  # pure ctypes bindings; importing them needs no driver

from moe_trainer.discovery.nvml_record import (
    CONSTANTS,
    FIXTURE_ENV,
    PCI_FIELDS,
    RECORDING_KIND,
    RECORDING_VERSION,
    RecordingNvml,
    error_name,
)

__all__ = [
    "FIXTURE_ENV",
    "RECORDING_KIND",
    "RECORDING_VERSION",
    "FakeNvml",
    "RecordingError",
    "RecordingNvml",
    "available_fixtures",
    "error_name",
    "fixture_from_env",
    "load_recording",
    "nvml_error",
    "recordings_dir",
    "runtime_mount",
]

# Where a container of a GPU-like real node finds this package (moe_localkube.realnodes).
CONTAINER_DIR = "/opt/moe-fake-nvml"


class RecordingError(ValueError):
    """A recording that cannot be found or read; names the file and the offending field."""


def nvml_error(name: str) -> pynvml.NVMLError:
    """'NotSupported' -> a pynvml.NVMLError_NotSupported instance (its `.value` is the code)."""
    cls = getattr(pynvml, f"NVMLError_{name}", None)
    if not (isinstance(cls, type) and issubclass(cls, pynvml.NVMLError)):
        raise RecordingError(f"unknown NVML error name {name!r} (want e.g. 'NotSupported')")
    return cls()


def recordings_dir() -> Path:
    return Path(str(resources.files(__package__) / "recordings"))


def available_fixtures() -> list[str]:
    return sorted(p.stem for p in recordings_dir().glob("*.json"))


def load_recording(name_or_path: str) -> tuple[dict, str]:
    """A fixture name (`recordings/<name>.json`) or a path -> (recording, fixture name)."""
    path = Path(name_or_path)
    if not (path.suffix == ".json" and path.exists()):
        path = recordings_dir() / f"{name_or_path}.json"
        if not path.exists():
            raise RecordingError(
                f"no fake-NVML recording {name_or_path!r}; known fixtures: "
                f"{', '.join(available_fixtures())}"
            )
    try:
        recording = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise RecordingError(f"{path}: unreadable recording: {err}") from err
    if recording.get("kind") != RECORDING_KIND:
        raise RecordingError(f"{path}: kind: {recording.get('kind')!r} is not {RECORDING_KIND!r}")
    if recording.get("version") != RECORDING_VERSION:
        raise RecordingError(
            f"{path}: version: {recording.get('version')!r} is not supported "
            f"(want {RECORDING_VERSION})"
        )
    if not isinstance(recording.get("gpus"), list):
        raise RecordingError(f"{path}: gpus: must be a list")
    return recording, recording.get("fixture") or path.stem


def fixture_from_env() -> str | None:
    return os.environ.get(FIXTURE_ENV) or None


class _Handle:
    def __init__(self, index: int):
        self.index = index

    def __repr__(self) -> str:
        return f"<fake nvml handle {self.index}>"


def _answer(value: Any) -> Any:
    """A recorded value, or raise the recorded error."""
    if isinstance(value, dict) and set(value) == {"error"}:
        raise nvml_error(value["error"])
    return value


class FakeNvml:
    """Module-like NVML replaying a recording. Unrecorded per-device calls raise NotSupported,
    which is what a real driver says for a feature the GPU lacks."""

    NVMLError = pynvml.NVMLError
    NVML_NVLINK_MAX_LINKS = pynvml.NVML_NVLINK_MAX_LINKS

    def __init__(self, recording: dict):
        self._rec = recording
        self._gpus: list[dict] = recording["gpus"]
        for name in CONSTANTS:
            setattr(self, name, getattr(pynvml, name))
        self.initialised = False
        self.shutdowns = 0
        for name in recording.get("absentFunctions", ()):
            setattr(self, name, None)  # old bindings: getattr(nvml, name, None) is None

    # -- system --------------------------------------------------------------------------------
    def nvmlInit(self) -> None:
        _answer(self._rec.get("nvmlInit"))
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def _system(self, name: str) -> Any:
        self._check_init()
        return _answer(self._rec.get(name, {"error": "NotSupported"}))

    def nvmlSystemGetDriverVersion(self) -> str:
        return self._system("nvmlSystemGetDriverVersion")

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self._system("nvmlSystemGetCudaDriverVersion")

    def nvmlDeviceGetCount(self) -> int:
        self._check_init()
        return _answer(self._rec.get("nvmlDeviceGetCount", len(self._gpus)))

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._check_init()
        if not 0 <= index < len(self._gpus):
            raise nvml_error("InvalidArgument")
        return _Handle(index)

    def _check_init(self) -> None:
        if not self.initialised:
            raise nvml_error("Uninitialized")

    # -- per device ----------------------------------------------------------------------------
    def _device(self, handle: _Handle, name: str) -> Any:
        self._check_init()
        return _answer(self._gpus[handle.index].get(name, {"error": "NotSupported"}))

    def nvmlDeviceIsMigDeviceHandle(self, handle: _Handle) -> int:
        return int(self._gpus[handle.index].get("nvmlDeviceIsMigDeviceHandle", 0))

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:
        return self._device(handle, "nvmlDeviceGetUUID")

    def nvmlDeviceGetName(self, handle: _Handle) -> str:
        return self._device(handle, "nvmlDeviceGetName")

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle) -> SimpleNamespace:
        return SimpleNamespace(**self._device(handle, "nvmlDeviceGetMemoryInfo"))

    def nvmlDeviceGetPciInfo(self, handle: _Handle) -> SimpleNamespace:
        return _pci(self._device(handle, "nvmlDeviceGetPciInfo"))

    def nvmlDeviceGetNumaNodeId(self, handle: _Handle) -> int:
        return self._device(handle, "nvmlDeviceGetNumaNodeId")

    def nvmlDeviceGetMemoryAffinity(
        self, handle: _Handle, node_set_size: int, scope: int
    ) -> list[int]:
        words = list(self._device(handle, "nvmlDeviceGetMemoryAffinity"))
        return (words + [0] * node_set_size)[:node_set_size]

    def nvmlDeviceGetCudaComputeCapability(self, handle: _Handle) -> tuple[int, int]:
        return tuple(self._device(handle, "nvmlDeviceGetCudaComputeCapability"))

    def nvmlDeviceGetMigMode(self, handle: _Handle) -> list[int]:
        return list(self._device(handle, "nvmlDeviceGetMigMode"))

    def _link(self, handle: _Handle, link: int, name: str) -> Any:
        self._check_init()
        links = self._gpus[handle.index].get("nvlinks", {})
        if link >= int(links.get("count", pynvml.NVML_NVLINK_MAX_LINKS)):
            raise nvml_error("InvalidArgument")
        entry = links.get(str(link))
        if entry is None:  # a link the recording does not list: the GPU-wide default
            return _answer(
                links.get("default", {"error": "NotSupported"})
                if name == "nvmlDeviceGetNvLinkState"
                else {"error": "NotSupported"}
            )
        return _answer(entry.get(name, {"error": "NotSupported"}))

    def nvmlDeviceGetNvLinkState(self, handle: _Handle, link: int) -> int:
        return self._link(handle, link, "nvmlDeviceGetNvLinkState")

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: _Handle, link: int) -> SimpleNamespace:
        return _pci(self._link(handle, link, "nvmlDeviceGetNvLinkRemotePciInfo"))

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: _Handle, link: int) -> int:
        return self._link(handle, link, "nvmlDeviceGetNvLinkRemoteDeviceType")

    def _pair(self, name: str, a: _Handle, b: _Handle) -> Any:
        self._check_init()
        matrix = self._rec.get(name)
        if matrix is None:
            raise nvml_error("NotSupported")
        return _answer(matrix[a.index][b.index])

    def nvmlDeviceGetP2PStatus(self, a: _Handle, b: _Handle, caps_index: int) -> int:
        if caps_index != pynvml.NVML_P2P_CAPS_INDEX_NVLINK:
            raise nvml_error("NotSupported")  # only the NVLink capability is recorded
        return self._pair("nvmlDeviceGetP2PStatus", a, b)

    def nvmlDeviceGetTopologyCommonAncestor(self, a: _Handle, b: _Handle) -> int:
        return self._pair("nvmlDeviceGetTopologyCommonAncestor", a, b)


def _pci(fields: dict) -> SimpleNamespace:
    """Recorded PCI info -> an object like nvmlPciInfo_t (string fields as bytes, as ctypes
    gives them)."""
    values = {k: (v.encode() if isinstance(v, str) else v) for k, v in fields.items()}
    for key in PCI_FIELDS:
        values.setdefault(key, b"" if key.startswith("busId") else 0)
    return SimpleNamespace(**values)


def runtime_mount(dst: Path) -> Path:
    """Copy this package (code and recordings) to ``dst/moe_fake_nvml``, world-readable, for a
    read-only bind mount at ``CONTAINER_DIR`` (the directory to mount is returned: ``dst``)."""
    target = dst / "moe_fake_nvml"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(
        Path(__file__).parent, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
    )
    for root, _dirs, files in os.walk(dst):
        os.chmod(root, 0o755)
        for f in files:
            os.chmod(os.path.join(root, f), 0o644)
    return dst
