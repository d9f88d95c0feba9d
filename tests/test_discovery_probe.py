"""moe-discover's NVML probe against recorded NVML answers (fake NVML): every recording gives back
the planning core's fixture document, and every failure mode has a defined result."""

from __future__ import annotations

import copy
import datetime as dt
import json
from pathlib import Path
from types import SimpleNamespace

import pynvml
import pytest

import moe_fake_nvml as fake_nvml
from moe_contracts.topology import parse_topology
from moe_fake_nvml import FakeNvml, load_recording
from moe_trainer.discovery import nvml_probe
from moe_trainer.discovery.nvml_probe import DiscoveryError, parse_bus_id, pci_address, probe
from moejob_operator.core.errors import DocumentError
from moejob_operator.core.topology import FIXTURE_DIR, nvlink_groups

REAL_DIR = Path(__file__).parent / "fixtures" / "topology"
PLANNING_FIXTURES = [
    "nvswitch-h100-8",
    "nvswitch-a100-8",
    "nvswitch-h200-8",
    "v100-hybrid-cube-mesh-8",
    "pcie-bridged-pairs-4",
    "pcie-only-4",
    "single-h200",
]
GROUPS = {
    "nvswitch-h100-8": [list(range(8))],
    "nvswitch-a100-8": [list(range(8))],
    "nvswitch-h200-8": [list(range(8))],
    "v100-hybrid-cube-mesh-8": [list(range(8))],
    "pcie-bridged-pairs-4": [[0, 1], [2, 3]],
    "pcie-only-4": [[0], [1], [2], [3]],
    "single-h200": [[0]],
}
NOW = dt.datetime(2026, 11, 29, 14, 0, tzinfo=dt.UTC)


def run_probe(recording: dict, fixture: str = "test") -> dict:
    report, _ = probe(
        FakeNvml(recording), node="node-x", source="fake-nvml", fixture=fixture, now=NOW
    )
    return report


def expected(name: str) -> dict:
    return json.loads((FIXTURE_DIR / f"{name}.json").read_text())


def without_node_time(doc: dict) -> dict:
    return {k: v for k, v in doc.items() if k not in ("node", "collectedAt")}


@pytest.mark.parametrize("name", PLANNING_FIXTURES)
def test_recording_reproduces_planning_fixture(name):
    recording, fixture = load_recording(name)
    report = run_probe(recording, fixture)
    assert without_node_time(report) == without_node_time(expected(name))
    assert report["node"] == "node-x" and report["collectedAt"] == "2026-11-29T14:00:00Z"
    assert nvlink_groups(parse_topology(report)) == GROUPS[name]


def test_every_recording_parses_with_planning_core():
    names = fake_nvml.available_fixtures()
    assert set(PLANNING_FIXTURES) | {"mig-a100-8", "legacy-busid-v100-8", "h200-vm-1gpu"} <= set(
        names
    )
    for name in names:
        recording, fixture = load_recording(name)
        parse_topology(run_probe(recording, fixture))


def test_nvswitch_remote_type_code_2_is_switch_and_one_group():
    recording, _ = load_recording("nvswitch-h100-8")
    report = run_probe(recording)
    assert {lk["remote"] for g in report["gpus"] for lk in g["nvlinks"]} == {"switch"}
    assert [len(g["nvlinks"]) for g in report["gpus"]] == [18] * 8
    assert all(g["nvlinkLinkGBps"] == 25.0 for g in report["gpus"])


def test_old_driver_without_remote_type_tells_switch_from_gpu_by_pci_id():
    # NVSwitch box: remote PCI ids are no GPU of this node -> switch.
    recording, _ = load_recording("nvswitch-a100-8")
    for gpu in recording["gpus"]:
        for link in gpu["nvlinks"].values():
            if isinstance(link, dict):
                link["nvmlDeviceGetNvLinkRemoteDeviceType"] = {"error": "FunctionNotFound"}
    assert without_node_time(run_probe(recording, "nvswitch-a100-8")) == without_node_time(
        expected("nvswitch-a100-8")
    )
    # GPU-GPU mesh on old stack (legacy bus ids, no RemoteDeviceType, no NumaNodeId binding).
    legacy, _ = load_recording("legacy-busid-v100-8")
    assert "nvmlDeviceGetNumaNodeId" in legacy["absentFunctions"]
    report = run_probe(legacy, "v100-hybrid-cube-mesh-8")
    assert without_node_time(report) == without_node_time(expected("v100-hybrid-cube-mesh-8"))


def test_bindings_without_remote_type_function_fall_back_too():
    recording, _ = load_recording("pcie-bridged-pairs-4")
    recording["absentFunctions"] = ["nvmlDeviceGetNvLinkRemoteDeviceType"]
    report = run_probe(recording, "pcie-bridged-pairs-4")
    assert without_node_time(report) == without_node_time(expected("pcie-bridged-pairs-4"))


def test_mig_enabled_gpus_reported_and_mig_children_skipped():
    recording, _ = load_recording("mig-a100-8")
    report = run_probe(recording)
    assert [g["migEnabled"] for g in report["gpus"]] == [True] * 4 + [False] * 4
    assert report["p2pNvlink"][0] == [True] + [False] * 7
    # A MIG child handle among the devices (bindings that list them) is no GPU.
    recording["gpus"][7]["nvmlDeviceIsMigDeviceHandle"] = 1
    report = run_probe(recording)
    assert len(report["gpus"]) == 7 and len(report["p2pNvlink"]) == 7
    parse_topology(report)


def test_legacy_and_current_bus_id_formats_compare_as_numbers():
    assert (
        parse_bus_id("00000000:1B:00.0") == parse_bus_id("0000:1b:00.0") == parse_bus_id("1b:00.0")
    )
    assert str(parse_bus_id(b"00000001:C1:1F.7\x00")) == "0001:c1:1f.7"
    assert (
        parse_bus_id("0000:1b:00.0") < parse_bus_id("0000:1b:00.1") < parse_bus_id("0001:00:00.0")
    )
    with pytest.raises(ValueError, match="is not a PCI bus id"):
        parse_bus_id("GPU-1234")
    # A struct with empty busId and busIdLegacy falls back to the numeric fields.
    from types import SimpleNamespace

    assert (
        str(
            nvml_probe.pci_address(
                SimpleNamespace(busId=b"", busIdLegacy=b"", domain=0, bus=0x2A, device=0)
            )
        )
        == "0000:2a:00.0"
    )


def test_legacy_recording_emits_normalised_lowercase_bus_ids():
    recording, _ = load_recording("legacy-busid-v100-8")
    assert recording["gpus"][0]["nvmlDeviceGetPciInfo"]["busId"] == ""
    report = run_probe(recording)
    ids = [g["pciBusId"] for g in report["gpus"]] + [
        lk["remotePciBusId"] for g in report["gpus"] for lk in g["nvlinks"]
    ]
    assert all(i == i.lower() and len(i) == 12 for i in ids), ids


def test_single_h200_in_vm_link0_not_supported_gives_no_nvlinks():
    recording, _ = load_recording("single-h200")
    assert recording["gpus"][0]["nvlinks"] == {"default": {"error": "NotSupported"}}
    report = run_probe(recording)
    assert report["gpus"][0]["nvlinks"] == [] and report["gpus"][0]["nvlinkLinkGBps"] == 0.0
    assert report["p2pNvlink"] == [[True]] and report["pcieLevel"] == [[0]]


def test_not_supported_on_some_links_skips_them():
    recording, _ = load_recording("v100-hybrid-cube-mesh-8")
    recording["gpus"][0]["nvlinks"]["3"] = {"nvmlDeviceGetNvLinkState": {"error": "NotSupported"}}
    report = run_probe(recording)
    assert [lk["link"] for lk in report["gpus"][0]["nvlinks"]] == [0, 1, 2, 4, 5]


def _everything_not_supported(gpus: int) -> dict:
    """Only init, count and handles work; every other call raises NotSupported."""
    return {"kind": "NvmlRecording", "version": 1, "gpus": [{"index": i} for i in range(gpus)]}


def test_not_supported_everywhere_does_not_crash_and_records_nulls_and_defaults():
    report, failed = probe(FakeNvml(_everything_not_supported(2)), node="n", now=NOW)
    gpu = report["gpus"][0]
    assert gpu == {
        "index": 0,
        "uuid": None,
        "name": None,
        "memoryBytes": None,
        "pciBusId": None,
        "numaNode": None,
        "computeCapability": None,
        "migEnabled": False,
        "nvlinks": [],
        "nvlinkLinkGBps": 0.0,
    }
    assert report["driverVersion"] is None and report["cudaDriverVersion"] is None
    assert report["p2pNvlink"] == [[True, False], [False, True]]
    assert report["pcieLevel"] == [[0, 50], [50, 0]]  # unknown -> the farthest tier
    assert any("nvmlDeviceGetUUID" in line and "Not Supported" in line for line in failed)


def test_no_driver_is_a_clear_error_with_exit_code():
    for error in ("LibraryNotFound", "DriverNotLoaded"):
        rec = {"kind": "NvmlRecording", "version": 1, "gpus": [], "nvmlInit": {"error": error}}
        with pytest.raises(DiscoveryError, match="no NVIDIA driver on this node") as info:
            probe(FakeNvml(rec), node="n")
        assert info.value.exit_code == nvml_probe.EXIT_NO_DRIVER == 69


def test_other_init_failure_and_lost_gpu_are_nvml_errors():
    rec = {"kind": "NvmlRecording", "version": 1, "gpus": [], "nvmlInit": {"error": "NoPermission"}}
    with pytest.raises(DiscoveryError, match="NVML init failed: Insufficient Permissions") as info:
        probe(FakeNvml(rec), node="n")
    assert info.value.exit_code == nvml_probe.EXIT_NVML_ERROR
    rec = _everything_not_supported(1) | {"nvmlDeviceGetCount": {"error": "GpuIsLost"}}
    fake = FakeNvml(rec)
    with pytest.raises(DiscoveryError, match="nvmlDeviceGetCount failed: GPU is lost"):
        probe(fake, node="n")
    assert fake.shutdowns == 1  # nvmlShutdown even on failure


def test_zero_gpus_is_no_driver_error():
    with pytest.raises(DiscoveryError, match="sees no GPU") as info:
        probe(FakeNvml(_everything_not_supported(0)), node="n")
    assert info.value.exit_code == nvml_probe.EXIT_NO_DRIVER


def test_numa_node_from_gpu_numa_id_else_memory_affinity_mask():
    recording, _ = load_recording("pcie-only-4")
    gpus = recording["gpus"]
    gpus[0]["nvmlDeviceGetNumaNodeId"] = 4  # Grace Hopper style: the GPU is node 4
    gpus[1]["nvmlDeviceGetNumaNodeId"] = -1  # unknown -> try the affinity mask
    gpus[1]["nvmlDeviceGetMemoryAffinity"] = [0b100]
    gpus[2]["nvmlDeviceGetMemoryAffinity"] = [0b11]  # spans two nodes: none is closer
    gpus[3]["nvmlDeviceGetMemoryAffinity"] = {"error": "NotSupported"}
    recording["nvmlSystemGetCudaDriverVersion"] = 13000
    report = run_probe(recording)
    assert [g["numaNode"] for g in report["gpus"]] == [4, 2, None, None]
    assert report["cudaDriverVersion"] == "13.0"
    assert nvml_probe.cuda_version_string(12080) == "12.8"
    assert nvml_probe.cuda_version_string(11040) == "11.4"


def test_recording_nvml_captures_what_fake_replays():
    """Recorder over a (fake) module -> recording -> replay gives the same report."""
    source, _ = load_recording("pcie-bridged-pairs-4")
    source["gpus"][2]["nvmlDeviceGetNumaNodeId"] = {"error": "NotSupported"}
    recorder = fake_nvml.RecordingNvml(FakeNvml(copy.deepcopy(source)), fixture="rec")
    first, _ = probe(recorder, node="n", now=NOW)
    replay, _ = probe(FakeNvml(json.loads(json.dumps(recorder.recording))), node="n", now=NOW)
    assert replay == first
    assert recorder.recording["gpus"][2]["nvmlDeviceGetNumaNodeId"] == {"error": "NotSupported"}
    assert recorder.recording["gpus"][0]["nvmlDeviceGetPciInfo"]["busId"] == "00000000:01:00.0"


def test_fake_raises_real_pynvml_error_classes():
    fake = FakeNvml(_everything_not_supported(1))
    fake.nvmlInit()
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetUUID(fake.nvmlDeviceGetHandleByIndex(0))
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetHandleByIndex(1)


def test_bad_recordings_are_refused_with_the_reason(tmp_path):
    with pytest.raises(
        fake_nvml.RecordingError,
        match=r"no fake-NVML recording 'nope'; known fixtures: .*single-h200",
    ):
        load_recording("nope")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"kind": "TopologyReport", "version": 1, "gpus": []}))
    with pytest.raises(
        fake_nvml.RecordingError, match="kind: 'TopologyReport' is not 'NvmlRecording'"
    ):
        load_recording(str(bad))
    bad.write_text(json.dumps({"kind": "NvmlRecording", "version": 7, "gpus": []}))
    with pytest.raises(fake_nvml.RecordingError, match="version: 7 is not supported"):
        load_recording(str(bad))
    with pytest.raises(fake_nvml.RecordingError, match="unknown NVML error name 'Nope'"):
        fake_nvml.nvml_error("Nope")


def test_real_h200_recording_reproduces_the_real_report():
    """The run on a real H200 (docs/discovery.md): its recording replays to the same report."""
    real = json.loads((REAL_DIR / "h200-vm-1gpu.json").read_text())
    assert real["source"] == "nvml"
    recording, _ = load_recording("h200-vm-1gpu")
    replay, _ = probe(FakeNvml(recording), node=real["node"], source="nvml")
    assert without_node_time(replay) == without_node_time(real) | {"fixture": None}
    assert nvlink_groups(parse_topology(real)) == [[0]]


def test_real_h200x2_nvswitch_recording_reproduces_the_real_report():
    """The 2-GPU H200 device machine (HGX board passed through to a VM): 18 active links per GPU to
    NVSwitches NVML cannot show (remote PCI FFFFFFFF:FF:FF.0 -> null). The first discovery run there
    wrote the placeholder as a bus id and the planner refused the report; now: one NVLink group."""
    real = json.loads((REAL_DIR / "h200x2-vm-nvswitch.json").read_text())
    assert real["source"] == "nvml" and len(real["gpus"]) == 2
    recording, _ = load_recording("h200x2-vm-nvswitch")
    replay, _ = probe(FakeNvml(recording), node=real["node"], source="nvml")
    assert without_node_time(replay) == without_node_time(real) | {"fixture": None}
    for gpu in real["gpus"]:
        assert len(gpu["nvlinks"]) == 18
        assert all(
            lk["remote"] == "switch" and lk["remotePciBusId"] is None for lk in gpu["nvlinks"]
        )
    report = parse_topology(real)
    assert nvlink_groups(report) == [[0, 1]]
    from moejob_operator.core.topology import ClusterTopology

    topo = ClusterTopology.from_reports([report])
    assert topo.tier(0, 1) == "nvlink" and topo.nvlink_gbps.tolist() == [450.0, 450.0]


def test_placeholder_remote_pci_ids_read_as_unknown():
    """Reports written before the fix carry 'ffffffff:ff:ff.0'; the parser reads it as null, and a
    GPU-to-GPU link must still name a real GPU."""
    real = json.loads((REAL_DIR / "h200x2-vm-nvswitch.json").read_text())
    for gpu in real["gpus"]:
        for lk in gpu["nvlinks"]:
            lk["remotePciBusId"] = "ffffffff:ff:ff.0"
    assert nvlink_groups(parse_topology(real)) == [[0, 1]]
    real["gpus"][0]["nvlinks"][0]["remote"] = "gpu"
    with pytest.raises(DocumentError, match=r"gpus\[0\]\.nvlinks\[0\]\.remotePciBusId"):
        parse_topology(real)
    assert (
        pci_address(SimpleNamespace(busId="FFFFFFFF:FF:FF.0", busIdLegacy="FFFFFFF:FF:FF.0"))
        is None
    )
    assert str(pci_address(SimpleNamespace(busId="00000000:18:00.0"))) == "0000:18:00.0"


def test_h200_discovery_pod_report_matches_the_direct_run():
    """The report the discovery *pod* wrote on the real H200 (benchmarks/gpu_e2e.sh: the node
    agent as a GPU node, the pod reading the real NVML) describes the same machine as the direct
    `moe-discover` run recorded earlier: same GPU, bus id, links and tiers (another VM, so another
    GPU UUID and node name), and it plans as one NVLink group."""
    pod = json.loads((REAL_DIR / "h200-vm-1gpu-pod.json").read_text())
    direct = json.loads((REAL_DIR / "h200-vm-1gpu.json").read_text())
    assert pod["source"] == "nvml" and pod["fixture"] is None

    def machine(doc):
        doc = without_node_time(doc)
        return doc | {"gpus": [{k: v for k, v in g.items() if k != "uuid"} for g in doc["gpus"]]}

    assert machine(pod) == machine(direct)
    assert nvlink_groups(parse_topology(pod)) == [[0]]
