"""Recorder of real NVML answers: `moe-discover --record FILE` writes what the driver said.

A recording (kind `NvmlRecording`, version 1; docs/discovery.md) holds, per GPU, what each NVML
call the probe makes returned, keyed by the NVML function name, or `{"error": "<Name>"}` for the
`pynvml.NVMLError_<Name>` it raised (`"NotSupported"`, `"FunctionNotFound"`, ...). Function names
listed in `absentFunctions` are missing from the module altogether (old `pynvml` bindings).

`RecordingNvml(pynvml)` wraps the real module, passes every call through and builds that
structure. Replaying a recording (the fake NVML of GPU-less test machines) is dev tooling, not in
the images: `moe_fake_nvml` in the dev package (operator/dev), reached only through
`discovery.main._fake_nvml`.
"""

from __future__ import annotations

from typing import Any

RECORDING_KIND = "NvmlRecording"
RECORDING_VERSION = 1
FIXTURE_ENV = "MOE_FAKE_NVML_FIXTURE"

CONSTANTS = (
    "NVML_P2P_CAPS_INDEX_NVLINK",
    "NVML_AFFINITY_SCOPE_NODE",
    "NVML_P2P_STATUS_OK",
    "NVML_NVLINK_DEVICE_TYPE_GPU",
    "NVML_NVLINK_DEVICE_TYPE_SWITCH",
    "NVML_NVLINK_DEVICE_TYPE_IBMNPU",
    "NVML_NVLINK_DEVICE_TYPE_UNKNOWN",
)
PCI_FIELDS = ("busId", "busIdLegacy", "domain", "bus", "device", "pciDeviceId", "pciSubSystemId")


def error_name(err: Exception) -> str:
    return type(err).__name__.removeprefix("NVMLError_")


def _pci_record(info: Any) -> dict:
    out = {}
    for key in PCI_FIELDS:
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
        for name in CONSTANTS:
            if hasattr(real, name):
                setattr(self, name, getattr(real, name))
        self.recording: dict = {
            "kind": RECORDING_KIND,
            "version": RECORDING_VERSION,
            "fixture": fixture,
            "description": description,
            "gpus": [],
        }
        self._handles: list[Any] = []
        absent = [
            n
            for n in (
                "nvmlDeviceGetNumaNodeId",
                "nvmlDeviceGetMemoryAffinity",
                "nvmlDeviceGetNvLinkRemoteDeviceType",
                "nvmlDeviceIsMigDeviceHandle",
            )
            if not hasattr(real, n)
        ]
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
        return self._record(
            self.recording, "nvmlSystemGetDriverVersion", self._real.nvmlSystemGetDriverVersion
        )

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self._record(
            self.recording,
            "nvmlSystemGetCudaDriverVersion",
            self._real.nvmlSystemGetCudaDriverVersion,
        )

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
        return self._record(
            self._gpu(handle), name, getattr(self._real, name), handle, encode=encode
        )

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
        return self._record(
            self._gpu(handle),
            "nvmlDeviceGetMemoryAffinity",
            self._real.nvmlDeviceGetMemoryAffinity,
            handle,
            node_set_size,
            scope,
            encode=lambda words: [int(w) for w in words],
        )

    def nvmlDeviceGetCudaComputeCapability(self, handle):
        return self._dev("nvmlDeviceGetCudaComputeCapability", handle, encode=list)

    def nvmlDeviceGetMigMode(self, handle):
        return self._dev("nvmlDeviceGetMigMode", handle, encode=list)

    def _lnk(self, name: str, handle: Any, link: int, encode=lambda v: v) -> Any:
        links = self._gpu(handle).setdefault("nvlinks", {})
        try:
            return self._record(
                links.setdefault(str(link), {}),
                name,
                getattr(self._real, name),
                handle,
                link,
                encode=encode,
            )
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
