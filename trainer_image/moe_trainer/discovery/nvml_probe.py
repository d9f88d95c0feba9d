"""Read one node's GPU topology through NVML and build a TopologyReport v1 document.

The probe takes the NVML module as an argument (`pynvml`, or a fake with the same call surface),
so every branch below runs in tests without a GPU. Every per-device call may raise
`NVMLError_NotSupported` (or lack a binding/driver entry point on old stacks): such a value is
recorded as null/default and never stops the probe. Only a failing `nvmlInit`, `nvmlDeviceGetCount`
or `nvmlDeviceGetHandleByIndex` is fatal, because then there is nothing true to report.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

REPORT_KIND = "TopologyReport"
REPORT_VERSION = 1

# Exit codes of `moe-discover` (sysexits.h names); docs/discovery.md lists them.
EXIT_OK = 0
EXIT_USAGE = 64  # EX_USAGE: bad command line
EXIT_NO_DRIVER = 69  # EX_UNAVAILABLE: no NVML library / driver not loaded / no GPU visible
EXIT_NVML_ERROR = 70  # EX_SOFTWARE: NVML failed in a way that leaves nothing true to report
EXIT_PUBLISH_FAILED = 75  # EX_TEMPFAIL: report built but the ConfigMap write failed (retry)
EXIT_CONFIG = 78  # EX_CONFIG: unknown fake-NVML fixture, unreadable recording

# NVML constants (nvml.h); read from the module when it has them, these are the fallbacks.
_ERR_INVALID_ARGUMENT = 2
_ERR_DRIVER_NOT_LOADED = 9
_ERR_LIBRARY_NOT_FOUND = 12
_ERR_FUNCTION_NOT_FOUND = 13
_NVLINK_DEVICE_TYPE_GPU = 0
_NVLINK_DEVICE_TYPE_SWITCH = 2
_P2P_CAPS_INDEX_NVLINK = 2
_P2P_STATUS_OK = 0
_NVLINK_MAX_LINKS = 18  # NVLink 4 (H100/H200); newer bindings say 36, older ones 6 or 12

# GB/s per link and direction by compute capability (NVML reports no link bandwidth): P100 NVLink1
# 20; V100 NVLink2, Turing bridges, A100 NVLink3, H100/H200 NVLink4 25; GA102 bridges (RTX A6000,
# A40, RTX 3090: 112.5 GB/s both directions over 4 links) 14.0625; B200/B300 NVLink5 50.
_NVLINK_GBPS_BY_CC = {
    "6.0": 20.0,
    "7.0": 25.0,
    "7.5": 25.0,
    "8.0": 25.0,
    "8.6": 14.0625,
    "9.0": 25.0,
    "10.0": 50.0,
    "10.3": 50.0,
}
_NVLINK_GBPS_DEFAULT = 25.0
_PCIE_LEVEL_UNKNOWN = 50  # NVML_TOPOLOGY_SYSTEM: when NVML cannot say, assume the farthest tier

_BUS_ID_RE = re.compile(
    r"^\s*(?:(?P<domain>[0-9a-fA-F]{1,8}):)?(?P<bus>[0-9a-fA-F]{1,2}):"
    r"(?P<device>[0-9a-fA-F]{1,2})\.(?P<function>[0-7])\s*$"
)


class DiscoveryError(Exception):
    """A failure `moe-discover` reports as one line on stderr with `exit_code`."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True, order=True)
class PciAddress:
    """A PCI address compared as numbers: NVML's `busId` (8-hex domain) and `busIdLegacy`
    (4-hex domain) for the same device compare equal."""

    domain: int
    bus: int
    device: int
    function: int

    def __str__(self) -> str:
        return f"{self.domain:04x}:{self.bus:02x}:{self.device:02x}.{self.function:x}"


def parse_bus_id(text: str | bytes) -> PciAddress:
    """'00000000:18:00.0', '0000:18:00.0' or '18:00.0' -> PciAddress; ValueError otherwise."""
    if isinstance(text, bytes):
        text = text.decode("ascii", "replace")
    match = _BUS_ID_RE.match(text.rstrip("\x00"))
    if not match:
        raise ValueError(f"{text!r} is not a PCI bus id")
    return PciAddress(
        domain=int(match["domain"] or "0", 16),
        bus=int(match["bus"], 16),
        device=int(match["device"], 16),
        function=int(match["function"], 16),
    )


def pci_address(info: Any) -> PciAddress | None:
    """The address in an `nvmlPciInfo_t`-like object: `busId` first, then `busIdLegacy`, then the
    numeric domain/bus/device fields (function 0). None when none of them is usable, and for the
    all-ones placeholder `FFFFFFFF:FF:FF.0` NVML gives for a remote it cannot see (the NVSwitches
    of an HGX board passed through to a VM: recorded on the 2-GPU H200 device machine)."""
    address = None
    for field in ("busId", "busIdLegacy"):
        raw = getattr(info, field, None)
        if raw:
            try:
                address = parse_bus_id(raw)
                break
            except ValueError:
                continue
    if address is None:
        try:
            address = PciAddress(int(info.domain), int(info.bus), int(info.device), 0)
        except (AttributeError, TypeError, ValueError):
            return None
    if (
        address.bus == 0xFF
        and address.device == 0xFF
        and address.domain in (0xFFFF, 0xFFFFFFF, 0xFFFFFFFF)
    ):
        return None
    return address


def cuda_version_string(version: int | None) -> str | None:
    """nvmlSystemGetCudaDriverVersion's integer (12080) -> '12.8'."""
    if version is None:
        return None
    return f"{version // 1000}.{(version % 1000) // 10}"


def _text(value: Any) -> Any:
    return value.decode("utf-8", "replace").rstrip("\x00") if isinstance(value, bytes) else value


class _Nvml:
    """Thin adapter over an NVML module: `call` returns a value or `None` (NotSupported, missing
    binding, missing driver entry point, any other per-call NVMLError); `errors` keeps what failed
    so the report's caller can log it."""

    def __init__(self, nvml: Any):
        self.mod = nvml
        self.error_type: type[BaseException] = getattr(nvml, "NVMLError", Exception)
        self.errors: list[str] = []
        self.last_error: int | None = None  # NVML code of the last failed call

    def const(self, name: str, default: int) -> int:
        return int(getattr(self.mod, name, default))

    def has(self, name: str) -> bool:
        return callable(getattr(self.mod, name, None))

    def call(self, name: str, *args: Any, missing: Callable[[], Any] | None = None) -> Any:
        fn = getattr(self.mod, name, None)
        self.last_error = None
        if fn is None:
            self.errors.append(f"{name}: not in these NVML bindings")
            self.last_error = _ERR_FUNCTION_NOT_FOUND
            return missing() if missing else None
        try:
            return fn(*args)
        except self.error_type as err:
            self.errors.append(f"{name}{_args_text(args)}: {err}")
            self.last_error = getattr(err, "value", None)
            if getattr(err, "value", None) == _ERR_FUNCTION_NOT_FOUND and missing:
                return missing()
            return None

    def must(self, name: str, *args: Any) -> Any:
        try:
            return getattr(self.mod, name)(*args)
        except self.error_type as err:
            raise DiscoveryError(f"NVML {name} failed: {err}", EXIT_NVML_ERROR) from err


def _args_text(args: tuple) -> str:
    return "(" + ", ".join(str(a) if isinstance(a, int) else "h" for a in args) + ")"


def nvml_init(nvml: Any) -> None:
    """nvmlInit, turning 'no driver' into a DiscoveryError with EXIT_NO_DRIVER."""
    error_type = getattr(nvml, "NVMLError", Exception)
    try:
        nvml.nvmlInit()
    except error_type as err:
        code = getattr(err, "value", None)
        if code in (_ERR_LIBRARY_NOT_FOUND, _ERR_DRIVER_NOT_LOADED):
            raise DiscoveryError(
                f"no NVIDIA driver on this node: NVML says {err!s} (code {code}); is the pod on a "
                "GPU node with the NVIDIA container runtime?",
                EXIT_NO_DRIVER,
            ) from err
        raise DiscoveryError(f"NVML init failed: {err!s} (code {code})", EXIT_NVML_ERROR) from err


def _probe_gpu(nv: _Nvml, index: int, handle: Any) -> dict:
    pci = nv.call("nvmlDeviceGetPciInfo", handle)
    addr = pci_address(pci) if pci is not None else None
    memory = nv.call("nvmlDeviceGetMemoryInfo", handle)
    cc = nv.call("nvmlDeviceGetCudaComputeCapability", handle)
    mig = nv.call("nvmlDeviceGetMigMode", handle)
    return {
        "index": index,
        "uuid": _text(nv.call("nvmlDeviceGetUUID", handle)),
        "name": _text(nv.call("nvmlDeviceGetName", handle)),
        "memoryBytes": int(memory.total) if memory is not None else None,
        "pciBusId": str(addr) if addr else None,
        "numaNode": _numa_node(nv, handle),
        "computeCapability": f"{cc[0]}.{cc[1]}" if cc else None,
        "migEnabled": bool(mig is not None and int(mig[0]) == 1),
        "nvlinks": [],
        "nvlinkLinkGBps": 0.0,
    }


def _numa_node(nv: _Nvml, handle: Any) -> int | None:
    """The NUMA node the GPU is closest to, or None.

    nvmlDeviceGetNumaNodeId answers only where the GPU's memory is itself a NUMA node (Grace
    Hopper, POWER9); on x86 servers and VMs it says NotSupported (seen on the H200 VM). Then the
    CPU-side affinity nvidia-smi shows as 'NUMA Affinity' comes from nvmlDeviceGetMemoryAffinity:
    a bit mask of nodes; exactly one bit set names the node, several mean none is closer.
    """
    node = nv.call("nvmlDeviceGetNumaNodeId", handle)
    if node is not None and int(node) >= 0:
        return int(node)
    scope = nv.const("NVML_AFFINITY_SCOPE_NODE", 0)
    mask_words = nv.call("nvmlDeviceGetMemoryAffinity", handle, 1, scope)
    if mask_words is None:
        return None
    mask = sum(int(word) << (64 * i) for i, word in enumerate(mask_words))
    if mask and mask & (mask - 1) == 0:
        return mask.bit_length() - 1
    return None


def _remote_kind(
    nv: _Nvml, handle: Any, link: int, remote: PciAddress | None, gpu_addresses: set[PciAddress]
) -> str:
    """'gpu' | 'switch' | 'other'. Drivers older than the RemoteDeviceType call: a remote that is
    one of this node's GPUs is 'gpu', anything else behind an NVLink is taken as an NVSwitch."""

    def by_pci() -> int:
        return _NVLINK_DEVICE_TYPE_GPU if remote in gpu_addresses else _NVLINK_DEVICE_TYPE_SWITCH

    kind = nv.call("nvmlDeviceGetNvLinkRemoteDeviceType", handle, link, missing=by_pci)
    if kind is None:
        kind = by_pci()
    kind = int(kind)
    if kind == nv.const("NVML_NVLINK_DEVICE_TYPE_GPU", _NVLINK_DEVICE_TYPE_GPU):
        return "gpu"
    if kind == nv.const("NVML_NVLINK_DEVICE_TYPE_SWITCH", _NVLINK_DEVICE_TYPE_SWITCH):
        return "switch"
    return "other"


def _probe_links(nv: _Nvml, handle: Any, gpu_addresses: set[PciAddress]) -> list[dict]:
    links = []
    for link in range(nv.const("NVML_NVLINK_MAX_LINKS", _NVLINK_MAX_LINKS)):
        state = nv.call("nvmlDeviceGetNvLinkState", handle, link)
        if state is None and (link == 0 or nv.last_error == _ERR_INVALID_ARGUMENT):
            break  # "Not Supported" on link 0: no NVLink (one H200 in a VM); past the last link
        if not state:
            continue
        info = nv.call("nvmlDeviceGetNvLinkRemotePciInfo", handle, link)
        remote = pci_address(info) if info is not None else None
        links.append(
            {
                "link": link,
                "remote": _remote_kind(nv, handle, link, remote, gpu_addresses),
                "remotePciBusId": str(remote) if remote else None,
            }
        )
    return links


def probe(
    nvml: Any,
    *,
    node: str,
    source: str = "nvml",
    fixture: str | None = None,
    now: _dt.datetime | None = None,
) -> tuple[dict, list[str]]:
    """Run NVML discovery; returns (TopologyReport v1 dict, NVML calls that failed).

    Raises DiscoveryError when NVML is absent or cannot list the GPUs. Calls nvmlShutdown.
    """
    nvml_init(nvml)
    nv = _Nvml(nvml)
    try:
        count = int(nv.must("nvmlDeviceGetCount"))
        handles = []
        for index in range(count):
            handle = nv.must("nvmlDeviceGetHandleByIndex", index)
            # A MIG child handle is not a GPU (nvmlDeviceGetCount should not list them; be sure).
            if nv.has("nvmlDeviceIsMigDeviceHandle"):
                is_mig = nv.call("nvmlDeviceIsMigDeviceHandle", handle)
                if is_mig is not None and int(getattr(is_mig, "value", is_mig)):
                    continue
            handles.append(handle)
        if not handles:
            raise DiscoveryError(
                "NVML is loaded but sees no GPU: is NVIDIA_VISIBLE_DEVICES set "
                "and the NVIDIA runtime in use?",
                EXIT_NO_DRIVER,
            )
        gpus = [_probe_gpu(nv, i, h) for i, h in enumerate(handles)]
        addresses = {parse_bus_id(g["pciBusId"]) for g in gpus if g["pciBusId"]}
        for gpu, handle in zip(gpus, handles, strict=True):
            gpu["nvlinks"] = _probe_links(nv, handle, addresses)
            if gpu["nvlinks"]:
                gpu["nvlinkLinkGBps"] = _NVLINK_GBPS_BY_CC.get(
                    gpu["computeCapability"], _NVLINK_GBPS_DEFAULT
                )
        report = {
            "kind": REPORT_KIND,
            "version": REPORT_VERSION,
            "node": node,
            "source": source,
            "fixture": fixture,
            "collectedAt": (now or _dt.datetime.now(_dt.UTC))
            .astimezone(_dt.UTC)
            .strftime("%Y-%m-%dT%H:%M:%SZ"),
            "driverVersion": _text(nv.call("nvmlSystemGetDriverVersion")),
            "cudaDriverVersion": cuda_version_string(nv.call("nvmlSystemGetCudaDriverVersion")),
            "gpus": gpus,
            "p2pNvlink": _p2p_matrix(nv, handles),
            "pcieLevel": _pcie_matrix(nv, handles),
        }
    finally:
        with contextlib.suppress(Exception):  # a failed shutdown changes nothing we report
            nvml.nvmlShutdown()
    return report, nv.errors


def _p2p_matrix(nv: _Nvml, handles: list) -> list[list[bool]]:
    caps = nv.const("NVML_P2P_CAPS_INDEX_NVLINK", _P2P_CAPS_INDEX_NVLINK)
    ok = nv.const("NVML_P2P_STATUS_OK", _P2P_STATUS_OK)
    n = len(handles)
    return [
        [
            i == j or nv.call("nvmlDeviceGetP2PStatus", handles[i], handles[j], caps) == ok
            for j in range(n)
        ]
        for i in range(n)
    ]


def _pcie_matrix(nv: _Nvml, handles: list) -> list[list[int]]:
    n = len(handles)
    matrix = [[0] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            level = nv.call("nvmlDeviceGetTopologyCommonAncestor", handles[i], handles[j])
            matrix[i][j] = matrix[j][i] = int(level) if level is not None else _PCIE_LEVEL_UNKNOWN
    return matrix
