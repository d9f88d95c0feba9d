"""Topology model: the cluster view built from per-node ``TopologyReport`` v1 documents.

A report (``moe_contracts.topology``, docs/contracts.md) is what the discovery pod read from NVML
on one node. From it we derive NVLink groups: GPUs attached to NVSwitch form one group, GPU-GPU
links form connected
components, a GPU without NVLink is its own group. ``ClusterTopology`` joins the reports of
several nodes into one global GPU list and answers "which tier connects GPU a and GPU b"
(``same_gpu`` < ``nvlink`` < ``node`` (PCIe / host bridge) < ``network``), which is all the
placement solvers and the cost model need.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moe_contracts.topology import DOCUMENT, Gpu, TopologyReport, parse_topology

from .errors import DocumentError, read_json_document

FIXTURE_DIR = Path(__file__).parent / "fixtures" / "topology"

TIERS = ("same_gpu", "nvlink", "node", "network")
TIER_SAME_GPU, TIER_NVLINK, TIER_NODE, TIER_NETWORK = range(4)
DEFAULT_PCIE_GBPS = 25.0  # PCIe 4.0/5.0 x16 effective, per direction
DEFAULT_NETWORK_GBPS = 25.0  # one 200 Gb/s NIC per GPU


def list_fixtures() -> list[str]:
    """Names of the recorded machine shapes shipped with the package."""
    return sorted(p.stem for p in FIXTURE_DIR.glob("*.json"))


def load_topology(path_or_fixture: str | Path) -> TopologyReport:
    """Read a report from a file, or a shipped fixture by name (``'nvswitch-h100-8'``)."""
    path = Path(path_or_fixture)
    if not path.exists() and str(path_or_fixture) in list_fixtures():
        path = FIXTURE_DIR / f"{path_or_fixture}.json"
    return parse_topology(
        read_json_document(
            DOCUMENT,
            path,
            what="file or fixture",
            hint=f" (fixtures: {', '.join(list_fixtures())})",
        )
    )


# ---------------------------------------------------------------- derived: NVLink groups


def _switch_attached(gpu: Gpu) -> bool:
    return any(lk.remote == "switch" for lk in gpu.nvlinks)


def nvlink_groups(report: TopologyReport) -> list[list[int]]:
    """GPU indices grouped by NVLink reachability, each group sorted, groups by first GPU."""
    n = len(report.gpus)
    parent = list(range(n))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def union(a: int, b: int) -> None:
        parent[find(a)] = find(b)

    on_switch = [g.index for g in report.gpus if _switch_attached(g)]
    for a, b in itertools.pairwise(on_switch):
        union(a, b)
    for gpu in report.gpus:
        for lk in gpu.nvlinks:
            # parse_topology checked that a GPU link names a GPU of the report
            peer = report.index_of_pci(lk.remote_pci_bus_id) if lk.remote_pci_bus_id else None
            if lk.remote == "gpu" and peer is not None:
                union(gpu.index, peer)
    groups: dict[int, list[int]] = {}
    for i in range(n):
        groups.setdefault(find(i), []).append(i)
    return sorted(groups.values(), key=lambda g: g[0])


def nvlink_links(report: TopologyReport, a: int, b: int) -> int:
    """Number of NVLink lanes usable between GPUs a and b (direct links, or through NVSwitch)."""
    ga, gb = report.gpus[a], report.gpus[b]
    direct = sum(
        1 for lk in ga.nvlinks if lk.remote == "gpu" and lk.remote_pci_bus_id == gb.pci_bus_id
    )
    if a != b and _switch_attached(ga) and _switch_attached(gb):
        via = min(sum(lk.remote == "switch" for lk in g.nvlinks) for g in (ga, gb))
        return direct + via
    return direct


def nvlink_bandwidth_gbps(report: TopologyReport, a: int, b: int) -> float:
    """NVLink bandwidth between GPUs a and b, per direction; 0.0 when they share no NVLink."""
    per_link = min(report.gpus[a].nvlink_link_g_bps, report.gpus[b].nvlink_link_g_bps)
    return nvlink_links(report, a, b) * per_link


# ---------------------------------------------------------------- cluster view


@dataclass(frozen=True)
class ClusterTopology:
    """Global GPU view over several nodes. GPU ``g`` is ``gpus[g] = (node, local_index)``.

    Arrays: ``node_of[num_gpus]`` (node position in ``nodes``), ``group_of[num_gpus]`` (global
    NVLink group id, groups never span nodes), ``nvlink_gbps[num_gpus]`` (per-GPU NVLink
    bandwidth out, per direction; 0 without NVLink).
    """

    nodes: tuple[str, ...]
    gpus: tuple[tuple[str, int], ...]
    node_of: np.ndarray
    group_of: np.ndarray
    nvlink_gbps: np.ndarray
    pcie_gbps: float = DEFAULT_PCIE_GBPS
    network_gbps: float = DEFAULT_NETWORK_GBPS
    memory_bytes: tuple[int, ...] = field(default=())

    @classmethod
    def from_reports(
        cls,
        reports: list[TopologyReport],
        *,
        pcie_gbps: float = DEFAULT_PCIE_GBPS,
        network_gbps: float = DEFAULT_NETWORK_GBPS,
    ) -> ClusterTopology:
        if not reports:
            raise DocumentError("ClusterTopology: no topology reports")
        names = [r.node for r in reports]
        if len(set(names)) != len(names):
            raise DocumentError(f"ClusterTopology: node names repeat {names}")
        gpus, node_of, group_of, bw, mem = [], [], [], [], []
        next_group = 0
        for n, report in enumerate(reports):
            local_group = {}
            for grp in nvlink_groups(report):
                for i in grp:
                    local_group[i] = next_group
                next_group += 1
            for gpu in report.gpus:
                gpus.append((report.node, gpu.index))
                node_of.append(n)
                group_of.append(local_group[gpu.index])
                bw.append(gpu.nvlink_gbps)
                mem.append(gpu.memory_bytes)
        return cls(
            tuple(names),
            tuple(gpus),
            np.array(node_of),
            np.array(group_of),
            np.array(bw, dtype=float),
            pcie_gbps,
            network_gbps,
            tuple(mem),
        )

    @classmethod
    def synthetic(
        cls,
        nodes: int = 8,
        gpus_per_node: int = 4,
        group_size: int = 4,
        *,
        nvlink_gbps: float = 450.0,
        pcie_gbps: float = DEFAULT_PCIE_GBPS,
        network_gbps: float = DEFAULT_NETWORK_GBPS,
        memory_bytes: int = 150754820096,
    ) -> ClusterTopology:
        """``nodes`` x ``gpus_per_node`` GPUs, consecutive local GPUs form NVLink groups of
        ``group_size``."""
        if nodes < 1 or gpus_per_node < 1 or group_size < 1 or gpus_per_node % group_size:
            raise ValueError(
                f"synthetic cluster: gpus_per_node={gpus_per_node} must be a positive "
                f"multiple of group_size={group_size}"
            )
        g = np.arange(nodes * gpus_per_node)
        has_nvlink = group_size > 1
        return cls(
            tuple(f"node-{n}" for n in range(nodes)),
            tuple((f"node-{i // gpus_per_node}", i % gpus_per_node) for i in range(len(g))),
            g // gpus_per_node,
            g // group_size,
            np.full(len(g), nvlink_gbps if has_nvlink else 0.0),
            pcie_gbps,
            network_gbps,
            (memory_bytes,) * len(g),
        )

    @property
    def num_gpus(self) -> int:
        return len(self.gpus)

    @property
    def num_groups(self) -> int:
        return int(self.group_of.max()) + 1

    def groups(self) -> list[list[int]]:
        """Global GPU indices per NVLink group."""
        return [np.flatnonzero(self.group_of == k).tolist() for k in range(self.num_groups)]

    def tier(self, a: int, b: int) -> str:
        return TIERS[int(self.tier_matrix()[a, b])]

    def tier_matrix(self) -> np.ndarray:
        """``tier[num_gpus, num_gpus]`` of TIER_* codes."""
        same_node = self.node_of[:, None] == self.node_of[None, :]
        same_group = self.group_of[:, None] == self.group_of[None, :]
        t = np.where(same_node, TIER_NODE, TIER_NETWORK)
        t = np.where(same_group & (self.nvlink_gbps[:, None] > 0), TIER_NVLINK, t)
        np.fill_diagonal(t, TIER_SAME_GPU)
        return t

    def bandwidth_gbps(self, gpu: int, tier: str) -> float:
        """Bandwidth GPU ``gpu`` sends at over ``tier``, per direction (inf for ``same_gpu``)."""
        if tier == "same_gpu":
            return float("inf")
        if tier == "nvlink":
            return float(self.nvlink_gbps[gpu])
        return self.pcie_gbps if tier == "node" else self.network_gbps

    def gpu_order(self) -> np.ndarray:
        """GPUs sorted by (node, NVLink group, GPU): filling a group, then a node, then the next
        node."""
        return np.lexsort((np.arange(self.num_gpus), self.group_of, self.node_of))
