"""TopologyReport parsing, NVLink groups on recorded machine shapes, and the cluster view."""

import copy
import json

import numpy as np
import pytest

from moe_contracts.topology import normalize_pci_bus_id, parse_topology, report_to_json
from moejob_operator.core.errors import DocumentError
from moejob_operator.core.topology import (
    ClusterTopology,
    list_fixtures,
    load_topology,
    nvlink_bandwidth_gbps,
    nvlink_groups,
    nvlink_links,
)

EXPECTED_GROUPS = {
    "nvswitch-h100-8": [list(range(8))],
    "nvswitch-a100-8": [list(range(8))],
    "nvswitch-h200-8": [list(range(8))],
    "v100-hybrid-cube-mesh-8": [list(range(8))],
    "pcie-bridged-pairs-4": [[0, 1], [2, 3]],
    "pcie-only-4": [[0], [1], [2], [3]],
    "single-h200": [[0]],
}


def _doc(name="pcie-bridged-pairs-4"):
    return report_to_json(load_topology(name))


def test_all_fixtures_listed():
    assert list_fixtures() == sorted(EXPECTED_GROUPS)


@pytest.mark.parametrize("name", sorted(EXPECTED_GROUPS))
def test_fixture_groups(name):
    report = load_topology(name)
    assert report.source == "fake-nvml" and report.fixture == name
    assert nvlink_groups(report) == EXPECTED_GROUPS[name]
    # round trip through JSON keeps the document identical
    assert parse_topology(json.loads(json.dumps(report_to_json(report)))) == report


def test_nvswitch_link_counts_and_bandwidth():
    h100 = load_topology("nvswitch-h100-8")
    assert all(
        len(g.nvlinks) == 18 and {lk.remote for lk in g.nvlinks} == {"switch"} for g in h100.gpus
    )
    assert nvlink_bandwidth_gbps(h100, 0, 7) == 450.0
    a100 = load_topology("nvswitch-a100-8")
    assert all(len(g.nvlinks) == 12 for g in a100.gpus)
    assert len({lk.remote_pci_bus_id for lk in a100.gpus[0].nvlinks}) == 6
    assert nvlink_bandwidth_gbps(a100, 2, 5) == 300.0


def test_cube_mesh_is_connected_but_not_uniform():
    v100 = load_topology("v100-hybrid-cube-mesh-8")
    counts = {nvlink_links(v100, 0, j) for j in range(1, 8)}
    assert counts == {0, 1, 2}  # no link to 5,6,7; single and double links otherwise
    assert nvlink_links(v100, 0, 3) == 2 and nvlink_links(v100, 0, 1) == 1
    assert all(len(g.nvlinks) == 6 for g in v100.gpus)
    p2p = np.array(v100.p2p_nvlink)
    assert (p2p == p2p.T).all() and not p2p[0, 5]


def test_bridged_pairs_and_single():
    pairs = load_topology("pcie-bridged-pairs-4")
    assert nvlink_bandwidth_gbps(pairs, 0, 1) == pytest.approx(56.25)
    assert nvlink_bandwidth_gbps(pairs, 1, 2) == 0.0
    single = load_topology("single-h200")
    assert single.gpus[0].nvlinks == () and single.gpus[0].numa_node is None


def test_pci_normalisation():
    assert normalize_pci_bus_id("00000000:18:00.0") == "0000:18:00.0"
    assert normalize_pci_bus_id("0000:1A:00.0") == "0000:1a:00.0"
    doc = _doc()
    doc["gpus"][0]["pciBusId"] = "00000000:01:00.0"  # NVML 8-hex form
    doc["gpus"][1]["nvlinks"][0]["remotePciBusId"] = "00000000:01:00.0"
    report = parse_topology(doc)
    assert report.gpus[0].pci_bus_id == "0000:01:00.0"
    assert nvlink_groups(report) == [[0, 1], [2, 3]]


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda d: d.update(kind="Topology"), r"TopologyReport kind: 'Topology' is not"),
        (lambda d: d.update(version=2), r"TopologyReport version: 2 is not a known version"),
        (lambda d: d.pop("gpus"), r"TopologyReport gpus: required field is missing"),
        (lambda d: d.update(gpus=[]), r"TopologyReport gpus: \[\] is invalid"),
        (
            lambda d: d["gpus"][3].update(pciBusId="18:00"),
            r"TopologyReport gpus\[3\]\.pciBusId: '18:00' is not a PCI bus id",
        ),
        (
            lambda d: d["gpus"][0]["nvlinks"][1].update(remotePciBusId="0000:99:00.0"),
            r"gpus\[0\]\.nvlinks\[1\]\.remotePciBusId: '0000:99:00.0' is not another GPU",
        ),
        (lambda d: d["pcieLevel"].pop(), r"pcieLevel: matrix is 3x4/4/4, expected 4x4"),
        (lambda d: d["p2pNvlink"][1].pop(), r"p2pNvlink: matrix is 4x4/3/4/4, expected 4x4"),
        (lambda d: d["gpus"][2].update(index=7), r"gpus\[2\]\.index: 7 != position 2"),
        (
            lambda d: d["gpus"][1]["nvlinks"][0].update(remote="bridge"),
            r"gpus\[1\]\.nvlinks\[0\]\.remote: 'bridge' is invalid",
        ),
        (lambda d: d["gpus"][1].update(memoryBytes=-1), r"gpus\[1\]\.memoryBytes: -1 is invalid"),
    ],
)
def test_bad_documents_name_the_field(mutate, match):
    doc = copy.deepcopy(_doc())
    mutate(doc)
    with pytest.raises(DocumentError, match=match):
        parse_topology(doc)


def test_not_an_object_and_missing_file(tmp_path):
    with pytest.raises(DocumentError, match="expected a JSON object, got list"):
        parse_topology([])
    with pytest.raises(DocumentError, match="no such file or fixture 'nope'"):
        load_topology("nope")
    bad = tmp_path / "t.json"
    bad.write_text("{")
    with pytest.raises(DocumentError, match="not JSON"):
        load_topology(bad)


def test_cluster_from_reports_tiers():
    a = parse_topology({**_doc(), "node": "a"})
    b = parse_topology({**_doc("nvswitch-h100-8"), "node": "b"})
    topo = ClusterTopology.from_reports([a, b], network_gbps=50.0)
    assert topo.num_gpus == 12 and topo.gpus[4] == ("b", 0)
    assert topo.group_of.tolist() == [0, 0, 1, 1] + [2] * 8
    assert topo.tier(0, 0) == "same_gpu" and topo.tier(0, 1) == "nvlink"
    assert (
        topo.tier(1, 2) == "node" and topo.tier(3, 4) == "network" and topo.tier(5, 11) == "nvlink"
    )
    assert topo.bandwidth_gbps(4, "nvlink") == 450.0 and topo.bandwidth_gbps(0, "network") == 50.0
    with pytest.raises(DocumentError, match="node names repeat"):
        ClusterTopology.from_reports([a, a])


def test_cluster_pcie_only_has_no_nvlink_tier():
    topo = ClusterTopology.from_reports([load_topology("pcie-only-4")])
    assert topo.num_groups == 4 and topo.tier(0, 1) == "node"


def test_synthetic_cluster_and_gpu_order():
    topo = ClusterTopology.synthetic(nodes=2, gpus_per_node=8, group_size=4)
    assert topo.num_groups == 4 and topo.node_of.tolist() == [0] * 8 + [1] * 8
    assert (
        topo.tier(0, 3) == "nvlink" and topo.tier(0, 4) == "node" and topo.tier(0, 8) == "network"
    )
    assert topo.gpu_order().tolist() == list(range(16))
    with pytest.raises(ValueError, match="multiple of group_size"):
        ClusterTopology.synthetic(nodes=1, gpus_per_node=6, group_size=4)
