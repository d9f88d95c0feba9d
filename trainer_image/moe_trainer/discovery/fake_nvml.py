"""Fake NVML driven by a recording, and a recorder that writes recordings from the real one.

A recording (kind `NvmlRecording`, version 1; docs/discovery.md) holds, per GPU, what each NVML
call the probe makes returned, keyed by the NVML function name, or `{"error": "<Name>"}` for the
`pynvml.NVMLError_<Name>` it raised (`"NotSupported"`, `"FunctionNotFound"`, ...). Function names
listed in `absentFunctions` are missing from the fake module altogether (old `pynvml` bindings).

`FakeNvml(recording)` has the call surface `nvml_probe.probe` uses and replays it;
`RecordingNvml(pynvml)` wraps the real module, passes every call through and builds the same
structure, so a real node's answers can be replayed anywhere (`moe-discover --record FILE`).
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml  # pure ctypes bindings; importing them needs no driver

RECORDING_KIND = "NvmlRecording"
RECORDING_VERSION = 1
FIXTURE_ENV = "MOE_FAKE_NVML_FIXTURE"

_CONSTANTS = ("NVML_P2P_CAPS_INDEX_NVLINK", "NVML_AFFINITY_SCOPE_NODE", "NVML_P2P_STATUS_OK", "NVML_NVLINK_DEVICE_TYPE_GPU",
              "NVML_NVLINK_DEVICE_TYPE_SWITCH", "NVML_NVLINK_DEVICE_TYPE_IBMNPU",
              "NVML_NVLINK_DEVICE_TYPE_UNKNOWN")
_PCI_FIELDS = ("busId", "busIdLegacy", "domain", "bus", "device", "pciDeviceId", "pciSubSystemId")


class RecordingError(ValueError):
    """A recording that cannot be found or read; names the file and the offending field."""


def nvml_error(name: str) -> pynvml.NVMLError:
    """'NotSupported' -> a pynvml.NVMLError_NotSupported instance (its `.value` is the code)."""
    cls = getattr(pynvml, f"NVMLError_{name}", None)
    if not (isinstance(cls, type) and issubclass(cls, pynvml.NVMLError)):
        raise RecordingError(f"unknown NVML error name {name!r} (want e.g. 'NotSupported')")
    return cls()


def error_name(err: pynvml.NVMLError) -> str:
    return type(err).__name__.removeprefix("NVMLError_")


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
            raise RecordingError(f"no fake-NVML recording {name_or_path!r}; known fixtures: "
                                 f"{', '.join(available_fixtures())}")
    try:
        recording = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise RecordingError(f"{path}: unreadable recording: {err}") from err
    if recording.get("kind") != RECORDING_KIND:
        raise RecordingError(f"{path}: kind: {recording.get('kind')!r} is not {RECORDING_KIND!r}")
    if recording.get("version") != RECORDING_VERSION:
        raise RecordingError(f"{path}: version: {recording.get('version')!r} is not supported "
                             f"(want {RECORDING_VERSION})")
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
        for name in _CONSTANTS:
            setattr(self, name, getattr(pynvml, name))
        self.initialised = False
        self.shutdowns = 0
        for name in recording.get("absentFunctions", ()):
            setattr(self, name, None)   # old bindings: getattr(nvml, name, None) is None

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

    def nvmlDeviceGetMemoryAffinity(self, handle: _Handle, node_set_size: int,
                                    scope: int) -> list[int]:
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
        if entry is None:   # a link the recording does not list: the GPU-wide default
            return _answer(links.get("default", {"error": "NotSupported"})
                           if name == "nvmlDeviceGetNvLinkState" else {"error": "NotSupported"})
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
            raise nvml_error("NotSupported")   # only the NVLink capability is recorded
        return self._pair("nvmlDeviceGetP2PStatus", a, b)

    def nvmlDeviceGetTopologyCommonAncestor(self, a: _Handle, b: _Handle) -> int:
        return self._pair("nvmlDeviceGetTopologyCommonAncestor", a, b)


def _pci(fields: dict) -> SimpleNamespace:
    """Recorded PCI info -> an object like nvmlPciInfo_t (string fields as bytes, as ctypes
    gives them)."""
    values = {k: (v.encode() if isinstance(v, str) else v) for k, v in fields.items()}
    for key in _PCI_FIELDS:
        values.setdefault(key, b"" if key.startswith("busId") else 0)
    return SimpleNamespace(**values)


def _pci_record(info: Any) -> dict:
    out = {}
    for key in _PCI_FIELDS:
        value = getattr(info, key, None)
        if isinstance(value, bytes):
            value = value.decode("ascii", "replace").rstrip("\x00")
        if value is not None:
            out[key] = value
    return out


class RecordingNvml:
    """Wraps a real NVML module: every call the probe makes passes through and its answer (or
    error) lands in `self.recording`, in the format FakeNvml replays."""

    def __init__(self, real: Any, *, fixture: str, description: str = ""):
        self._real = real
        self.NVMLError = real.NVMLError
        self.NVML_NVLINK_MAX_LINKS = getattr(real, "NVML_NVLINK_MAX_LINKS", 18)
        for name in _CONSTANTS:
            if hasattr(real, name):
                setattr(self, name, getattr(real, name))
        self.recording: dict = {"kind": RECORDING_KIND, "version": RECORDING_VERSION,
                                "fixture": fixture, "description": description,
                                "gpus": []}
        self._handles: list[Any] = []
        absent = [n for n in ("nvmlDeviceGetNumaNodeId", "nvmlDeviceGetMemoryAffinity",
                              "nvmlDeviceGetNvLinkRemoteDeviceType",
                              "nvmlDeviceIsMigDeviceHandle") if not hasattr(real, n)]
        if absent:
            self.recording["absentFunctions"] = absent
        for name in absent:
            setattr(self, name, None)

    def _record(self, slot: dict, key: str, fn, *args, encode=lambda v: v) -> Any:
        try:
            value = fn(*args)
        except self._real.NVMLError as err:
            slot[key] = {"error": error_name(err)}
            raise
        slot[key] = encode(value)
        return value

    def _gpu(self, handle: Any) -> dict:
        return self.recording["gpus"][self._index(handle)]

    def _index(self, handle: Any) -> int:
        for i, h in enumerate(self._handles):
            if h is handle:
                return i
        raise KeyError("handle not obtained through nvmlDeviceGetHandleByIndex")

    def nvmlInit(self) -> None:
        try:
            self._real.nvmlInit()
        except self._real.NVMLError as err:
            self.recording["nvmlInit"] = {"error": error_name(err)}
            raise

    def nvmlShutdown(self) -> None:
        self._real.nvmlShutdown()

    def nvmlSystemGetDriverVersion(self) -> str:
        return self._record(self.recording, "nvmlSystemGetDriverVersion",
                            self._real.nvmlSystemGetDriverVersion)

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self._record(self.recording, "nvmlSystemGetCudaDriverVersion",
                            self._real.nvmlSystemGetCudaDriverVersion)

    def nvmlDeviceGetCount(self) -> int:
        return self._real.nvmlDeviceGetCount()

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        handle = self._real.nvmlDeviceGetHandleByIndex(index)
        self._handles.append(handle)
        self.recording["gpus"].append({"index": index})
        return handle

    def nvmlDeviceIsMigDeviceHandle(self, handle: Any) -> Any:
        value = self._real.nvmlDeviceIsMigDeviceHandle(handle)
        self._gpu(handle)["nvmlDeviceIsMigDeviceHandle"] = int(getattr(value, "value", value))
        return value

    def _dev(self, name: str, handle: Any, encode=lambda v: v) -> Any:
        return self._record(self._gpu(handle), name, getattr(self._real, name), handle,
                            encode=encode)

    def nvmlDeviceGetUUID(self, handle):
        return self._dev("nvmlDeviceGetUUID", handle)

    def nvmlDeviceGetName(self, handle):
        return self._dev("nvmlDeviceGetName", handle)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return self._dev("nvmlDeviceGetMemoryInfo", handle, encode=lambda m: {"total": m.total})

    def nvmlDeviceGetPciInfo(self, handle):
        return self._dev("nvmlDeviceGetPciInfo", handle, encode=_pci_record)

    def nvmlDeviceGetNumaNodeId(self, handle):
        return self._dev("nvmlDeviceGetNumaNodeId", handle)

    def nvmlDeviceGetMemoryAffinity(self, handle, node_set_size, scope):
        return self._record(self._gpu(handle), "nvmlDeviceGetMemoryAffinity",
                            self._real.nvmlDeviceGetMemoryAffinity, handle, node_set_size, scope,
                            encode=lambda words: [int(w) for w in words])

    def nvmlDeviceGetCudaComputeCapability(self, handle):
        return self._dev("nvmlDeviceGetCudaComputeCapability", handle, encode=list)

    def nvmlDeviceGetMigMode(self, handle):
        return self._dev("nvmlDeviceGetMigMode", handle, encode=list)

    def _lnk(self, name: str, handle: Any, link: int, encode=lambda v: v) -> Any:
        links = self._gpu(handle).setdefault("nvlinks", {})
        try:
            return self._record(links.setdefault(str(link), {}), name,
                                getattr(self._real, name), handle, link, encode=encode)
        finally:
            if name == "nvmlDeviceGetNvLinkState":
                links["count"] = max(int(links.get("count", 0)), link + 1)

    def nvmlDeviceGetNvLinkState(self, handle, link):
        return self._lnk("nvmlDeviceGetNvLinkState", handle, link)

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle, link):
        return self._lnk("nvmlDeviceGetNvLinkRemotePciInfo", handle, link, encode=_pci_record)

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle, link):
        return self._lnk("nvmlDeviceGetNvLinkRemoteDeviceType", handle, link)

    def _pairwise(self, name: str, a: Any, b: Any, *extra: Any) -> Any:
        n = len(self._handles)
        matrix = self.recording.setdefault(name, [])
        while len(matrix) < n:
            matrix.append([])
        for row in matrix:
            while len(row) < n:
                row.append({"error": "NotSupported"})
        i, j = self._index(a), self._index(b)
        try:
            value = getattr(self._real, name)(a, b, *extra)
        except self._real.NVMLError as err:
            matrix[i][j] = {"error": error_name(err)}
            raise
        matrix[i][j] = int(value)
        if name == "nvmlDeviceGetTopologyCommonAncestor":
            matrix[j][i] = int(value)
        return value

    def nvmlDeviceGetP2PStatus(self, a, b, caps_index):
        return self._pairwise("nvmlDeviceGetP2PStatus", a, b, caps_index)

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        return self._pairwise("nvmlDeviceGetTopologyCommonAncestor", a, b)
