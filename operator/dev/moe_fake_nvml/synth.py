"""Write a fake-NVML recording that reproduces a given TopologyReport, in NVML's own vocabulary.

Used to make recordings for machine shapes nobody here can record for real (8-GPU NVSwitch boxes,
a DGX-1): what NVML would answer on such a machine, per call: 8-hex upper-case `busId` plus the
legacy 4-hex field, CUDA version as an integer, remote device type codes, P2P status codes, the
links a GPU has but does not use (state 0) and links it does not have (`InvalidArgument`).
Running the probe on the result must give back the report (tests check this for every recording).

    python -m moe_fake_nvml.synth REPORT.json [--fixture NAME] > recording.json
"""

from __future__ import annotations

import argparse
import json
import sys

from moe_trainer.discovery.nvml_probe import parse_bus_id
from moe_trainer.discovery.nvml_record import RECORDING_KIND, RECORDING_VERSION

_P2P_OK, _P2P_NOT_SUPPORTED = 0, 5
_REMOTE_TYPE = {"gpu": 0, "switch": 2, "other": 255}
# Links per GPU by compute capability: V100 6, A100 12, H100/H200 18, GA102 4 (bridge pairs).
_LINKS_BY_CC = {"6.0": 4, "7.0": 6, "7.5": 2, "8.0": 12, "8.6": 4, "9.0": 18, "10.0": 18}


def nvml_pci(bus_id: str) -> dict:
    """'0000:1b:00.0' -> nvmlPciInfo_t fields as a driver of today fills them."""
    a = parse_bus_id(bus_id)
    return {
        "busId": f"{a.domain:08X}:{a.bus:02X}:{a.device:02X}.{a.function:X}",
        "busIdLegacy": f"{a.domain:04X}:{a.bus:02X}:{a.device:02X}.{a.function:X}",
        "domain": a.domain,
        "bus": a.bus,
        "device": a.device,
    }


def cuda_version_int(text: str) -> int:
    major, minor = (int(x) for x in text.split("."))
    return major * 1000 + minor * 10


def recording_from_report(
    report: dict, *, fixture: str | None = None, description: str = ""
) -> dict:
    gpus = []
    for gpu in report["gpus"]:
        entry: dict = {
            "index": gpu["index"],
            "nvmlDeviceGetUUID": gpu["uuid"],
            "nvmlDeviceGetName": gpu["name"],
            "nvmlDeviceGetMemoryInfo": {"total": gpu["memoryBytes"]},
            "nvmlDeviceGetPciInfo": nvml_pci(gpu["pciBusId"]),
            # x86: the GPU is no NUMA node itself; its CPU-side node is a memory-affinity bit.
            "nvmlDeviceGetNumaNodeId": {"error": "NotSupported"},
            "nvmlDeviceGetMemoryAffinity": (
                [1 << gpu["numaNode"]] if gpu["numaNode"] is not None else {"error": "NotSupported"}
            ),
            "nvmlDeviceGetCudaComputeCapability": [
                int(x) for x in gpu["computeCapability"].split(".")
            ],
            "nvmlDeviceGetMigMode": [int(gpu["migEnabled"])] * 2,
        }
        if gpu["nvlinks"]:
            links: dict = {
                "count": max(
                    _LINKS_BY_CC.get(gpu["computeCapability"], 18),
                    1 + max(lk["link"] for lk in gpu["nvlinks"]),
                ),
                "default": 0,
            }
            for lk in gpu["nvlinks"]:
                links[str(lk["link"])] = {
                    "nvmlDeviceGetNvLinkState": 1,
                    "nvmlDeviceGetNvLinkRemotePciInfo": nvml_pci(lk["remotePciBusId"]),
                    "nvmlDeviceGetNvLinkRemoteDeviceType": _REMOTE_TYPE[lk["remote"]],
                }
        else:  # what a GPU without NVLink (or one H200 in a VM) answers on every link
            links = {"default": {"error": "NotSupported"}}
        entry["nvlinks"] = links
        gpus.append(entry)
    return {
        "kind": RECORDING_KIND,
        "version": RECORDING_VERSION,
        "fixture": fixture or report.get("fixture"),
        "description": description or f"synthesised from TopologyReport of {report['node']!r}",
        "node": report["node"],
        "nvmlSystemGetDriverVersion": report["driverVersion"],
        "nvmlSystemGetCudaDriverVersion": cuda_version_int(report["cudaDriverVersion"]),
        "gpus": gpus,
        "nvmlDeviceGetP2PStatus": [
            [_P2P_OK if ok else _P2P_NOT_SUPPORTED for ok in row] for row in report["p2pNvlink"]
        ],
        "nvmlDeviceGetTopologyCommonAncestor": report["pcieLevel"],
    }


def as_old_stack(rec: dict) -> dict:
    """An old driver and old bindings, as on many DGX-1/V100 and early A100 nodes: the PCI struct
    fills only the legacy 4-hex `busIdLegacy` (the 8-hex `busId` field is reserved/empty), NVLink
    remote PCI info comes back lower-case and without domain, the driver lacks
    nvmlDeviceGetNvLinkRemoteDeviceType (FunctionNotFound: the probe must tell GPU peers from
    NVSwitches by PCI id) and the bindings lack nvmlDeviceGetNumaNodeId (the memory-affinity
    mask, there since r450, still gives the node)."""
    for gpu in rec["gpus"]:
        gpu["nvmlDeviceGetPciInfo"]["busId"] = ""
        gpu.pop("nvmlDeviceGetNumaNodeId", None)
        for link in gpu["nvlinks"].values():
            if not isinstance(link, dict) or "nvmlDeviceGetNvLinkRemotePciInfo" not in link:
                continue
            pci = link["nvmlDeviceGetNvLinkRemotePciInfo"]
            bus_id = pci["busIdLegacy"].lower().split(":", 1)[1]  # '1b:00.0'
            link["nvmlDeviceGetNvLinkRemotePciInfo"] = {
                "busIdLegacy": bus_id,
                "domain": pci["domain"],
                "bus": pci["bus"],
                "device": pci["device"],
            }
            link["nvmlDeviceGetNvLinkRemoteDeviceType"] = {"error": "FunctionNotFound"}
    rec["absentFunctions"] = ["nvmlDeviceGetNumaNodeId", "nvmlDeviceIsMigDeviceHandle"]
    return rec


def with_mig(rec: dict, gpu_indices: list[int]) -> dict:
    """MIG mode on for these GPUs: memory and NVLink state of the parent still answer; P2P over
    NVLink is not supported to or from a MIG-enabled GPU; the handle is no MIG child."""
    for i in gpu_indices:
        rec["gpus"][i]["nvmlDeviceGetMigMode"] = [1, 1]
        rec["gpus"][i]["nvmlDeviceIsMigDeviceHandle"] = 0
        p2p = rec["nvmlDeviceGetP2PStatus"]
        for j in range(len(p2p)):
            if j != i:
                p2p[i][j] = p2p[j][i] = _P2P_NOT_SUPPORTED
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m moe_fake_nvml.synth", description=__doc__.split("\n")[0]
    )
    p.add_argument("report")
    p.add_argument("--fixture")
    p.add_argument("--description", default="")
    p.add_argument("--old-stack", action="store_true", help="see as_old_stack()")
    p.add_argument("--mig", default="", help="comma-separated GPU indices with MIG enabled")
    args = p.parse_args(argv)
    with open(args.report) as fh:
        report = json.load(fh)
    rec = recording_from_report(report, fixture=args.fixture, description=args.description)
    if args.old_stack:
        rec = as_old_stack(rec)
    if args.mig:
        rec = with_mig(rec, [int(i) for i in args.mig.split(",")])
    sys.stdout.write(json.dumps(rec, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
