"""The GPUs a plan runs on: the named nodes, GPUs per node (whole NVLink groups first), the
weakest GPU's capabilities; on CPU one shared-memory group of processes per node. The first step
of :func:`.plan.build_plan`; the sizing asks it for every candidate shape."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from moe_contracts.topology import TopologyReport

from .dsconfig import CPU, GpuCaps
from .errors import FieldError
from .plan_request import PlanRequest
from .topology import ClusterTopology


def gpu_caps(reports: Sequence[TopologyReport]) -> GpuCaps:
    """The weakest GPU of the reports: the config and the memory check must hold on all."""
    gpus = [g for r in reports for g in r.gpus]
    weakest_cc = min(gpus, key=lambda g: tuple(int(x) for x in g.compute_capability.split(".")))
    smallest = min(gpus, key=lambda g: g.memory_bytes)
    return GpuCaps(
        name=smallest.name,
        memory_bytes=smallest.memory_bytes,
        compute_capability=weakest_cc.compute_capability,
    )


def select_gpus(
    topo: ClusterTopology, nodes: Sequence[str] | None, gpus_per_node: int | None
) -> ClusterTopology:
    """The sub-cluster the job runs on: the named nodes (default all), ``gpus_per_node`` GPUs on
    each (default all), taking the largest NVLink groups first so EP groups can stay inside."""
    names = list(nodes) if nodes else list(topo.nodes)
    unknown = [n for n in names if n not in topo.nodes]
    if unknown:
        raise FieldError("nodes", f"{unknown} not discovered (topology has {list(topo.nodes)})")
    if len(set(names)) != len(names):
        raise FieldError("nodes", f"{names} lists a node twice")
    picked: list[int] = []
    for name in names:
        n = topo.nodes.index(name)
        local = np.flatnonzero(topo.node_of == n)
        want = len(local) if gpus_per_node is None else gpus_per_node
        if want < 1 or want > len(local):
            raise FieldError(
                "gpusPerNode",
                f"{want} requested but node {name!r} has {len(local)} GPU(s) discovered",
            )
        size = {int(g): int((topo.group_of == topo.group_of[g]).sum()) for g in local}
        order = sorted((int(g) for g in local), key=lambda g: (-size[g], int(topo.group_of[g]), g))
        picked += sorted(order[:want])
    return subset(topo, picked)


def subset(topo: ClusterTopology, gpus: Sequence[int]) -> ClusterTopology:
    """``topo`` restricted to global GPUs ``gpus`` (nodes and groups renumbered, order kept)."""
    idx = np.asarray(sorted(gpus))
    kept_nodes = sorted(set(topo.node_of[idx].tolist()))
    node_map = {n: i for i, n in enumerate(kept_nodes)}
    group_map = {g: i for i, g in enumerate(sorted(set(topo.group_of[idx].tolist())))}
    memory = tuple(topo.memory_bytes[i] for i in idx) if topo.memory_bytes else ()
    return ClusterTopology(
        nodes=tuple(topo.nodes[n] for n in kept_nodes),
        gpus=tuple(topo.gpus[i] for i in idx),
        node_of=np.array([node_map[n] for n in topo.node_of[idx]]),
        group_of=np.array([group_map[g] for g in topo.group_of[idx]]),
        nvlink_gbps=topo.nvlink_gbps[idx].copy(),
        pcie_gbps=topo.pcie_gbps,
        network_gbps=topo.network_gbps,
        memory_bytes=memory,
    )


def cpu_topology(nodes: Sequence[str], procs_per_node: int, memory_bytes: int) -> ClusterTopology:
    """CPU mode: each node is one shared-memory "group" of ``procs_per_node`` processes."""
    if not nodes or procs_per_node < 1:
        raise FieldError(
            "nodes/procsPerNode",
            f"need at least one node and one process (got {list(nodes)}, {procs_per_node})",
        )
    node_of = np.repeat(np.arange(len(nodes)), procs_per_node)
    return ClusterTopology(
        tuple(nodes),
        tuple((n, i) for n in nodes for i in range(procs_per_node)),
        node_of,
        node_of.copy(),
        np.zeros(len(node_of)),
        memory_bytes=(memory_bytes,) * len(node_of),
    )


def _group_sizes(topo: ClusterTopology, rank2gpu: np.ndarray) -> list[int]:
    """Sizes of the runs of consecutive ranks that share an NVLink group (CPU: a node)."""
    groups = topo.group_of[rank2gpu]
    sizes, run = [], 1
    for a, b in itertools.pairwise(groups):
        if a == b:
            run += 1
        else:
            sizes.append(run)
            run = 1
    return [*sizes, run]


def _cluster(req: PlanRequest) -> tuple[ClusterTopology, GpuCaps]:
    """The sub-cluster the job runs on and its weakest GPU (CPU: one group per node)."""
    if req.cpu:
        return cpu_topology(
            list(req.nodes or ["localhost"]), req.procs_per_node, req.cpu_memory_bytes
        ), CPU
    if req.topology is None:
        raise FieldError("topology", "required on GPUs (no TopologyReport given)")
    if isinstance(req.topology, ClusterTopology):
        if req.gpu is None:
            raise FieldError(
                "gpu",
                "GPU capabilities are required with a ClusterTopology "
                "(pass the TopologyReports instead)",
            )
        topo = select_gpus(req.topology, req.nodes, req.gpus_per_node)
        caps = req.gpu
    else:
        reports = list(req.topology)
        topo = select_gpus(ClusterTopology.from_reports(reports), req.nodes, req.gpus_per_node)
        caps = req.gpu or gpu_caps([r for r in reports if r.node in topo.nodes])
    return topo, GpuCaps(
        caps.name, min(topo.memory_bytes or (caps.memory_bytes,)), caps.compute_capability
    )
