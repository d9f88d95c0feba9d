"""What a job that fits nowhere is told: the smallest shape that would fit.

Two ways out, each re-estimated with the planner's memory model (:func:`.sizing.search`):

* more nodes like the discovered ones (the node with the most GPUs, its NVLink groups, memory and
  links), every sizing field free, from one node more than there are, doubling, then the
  smallest count in between that fits; the global batch rounded up to a multiple of the world
  size when it is smaller (each rank needs a sequence);
* on the discovered nodes, the values the user gave (``microBatch``, activation checkpointing,
  GPUs per node, EP size) changed: said only when that alone makes it fit.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .dsconfig import GpuCaps
from .memory import GiB
from .plan_cluster import _cluster
from .plan_request import PlanRequest
from .plan_steps import HEADROOM
from .sizing import AutoFields, Candidate, Shape, search
from .topology import ClusterTopology

MAX_NODES = 512  # spec.nodes.count's bound
EVERYTHING = AutoFields(True, True, True, True, True, True)
LEAN = AutoFields(False, False, True, True, True, False)  # what saves memory on given nodes


def _template(topo: ClusterTopology) -> tuple[int, int, float, int]:
    """(GPUs, largest NVLink group, NVLink GB/s, smallest GPU memory) of the node with the most
    GPUs: the node more of which would be bought."""
    counts = np.bincount(topo.node_of)
    node = int(np.argmax(counts))
    local = np.flatnonzero(topo.node_of == node)
    group = max(int((topo.group_of == topo.group_of[g]).sum()) for g in local)
    memory = min(topo.memory_bytes[g] for g in local) if topo.memory_bytes else 0
    return int(counts[node]), group, float(topo.nvlink_gbps[local].min()), int(memory)


def _more_nodes(
    req: PlanRequest, auto: AutoFields, full: ClusterTopology
) -> tuple[int, Candidate] | None:
    """The fewest nodes like the discovered ones on which a shape fits with the sizing fields
    ``auto`` leaves free (the others at the user's values)."""
    gpus, group, nvlink, memory = _template(full)
    gpn = gpus if auto.gpus_per_node or req.gpus_per_node is None else req.gpus_per_node
    if gpn % group or gpus % group:
        group = 1
    caps = _caps(req)

    def fits(n: int) -> Candidate | None:
        topo = ClusterTopology.synthetic(
            n,
            gpn,
            min(group, gpn),
            nvlink_gbps=nvlink,
            pcie_gbps=full.pcie_gbps,
            network_gbps=full.network_gbps,
            memory_bytes=memory,
        )
        step = topo.num_gpus * (req.micro_batch if not auto.micro_batch and req.micro_batch else 1)
        batch = max(req.global_batch, step)
        batch += -batch % step  # each rank needs its micro-batch
        hypo = replace(
            req, topology=topo, nodes=None, gpus_per_node=gpn, global_batch=batch, gpu=caps
        )
        free = replace(auto, nodes=False, gpus_per_node=False)
        found, _, _ = search(hypo, free, memory_only=True)
        return min(found, key=lambda c: c.peak_bytes) if found else None

    lo, n = len(full.nodes), len(full.nodes) + 1
    while n <= MAX_NODES:
        got = fits(n)
        if got is not None:
            while n - lo > 1:  # the smallest count in (lo, n] that fits
                mid = (lo + n) // 2
                mid_fit = fits(mid)
                if mid_fit is not None:
                    n, got = mid, mid_fit
                else:
                    lo = mid
            return n, got
        lo, n = n, (min(2 * n, MAX_NODES) if n < MAX_NODES else MAX_NODES + 1)
    return None


def _caps(req: PlanRequest) -> GpuCaps:
    """The GPU the discovered nodes have (the weakest of them)."""
    return _cluster(replace(req, gpus_per_node=None, micro_batch=None, ep_size=None))[1]


def _user_changes(req: PlanRequest, auto: AutoFields, shape: Shape) -> str:
    """The user-given values ``shape`` changes, as the spec names them."""
    t = req.training
    parts = []
    if not auto.gpus_per_node and req.gpus_per_node not in (None, shape.gpus_per_node):
        parts.append(f"gpusPerNode {shape.gpus_per_node}")
    if not auto.ep_size and req.ep_size is not None and req.ep_size != shape.ep_size:
        parts.append(f"expertParallelSize {shape.ep_size}")
    if not auto.micro_batch and req.micro_batch not in (None, shape.micro_batch):
        parts.append(f"microBatch {shape.micro_batch}")
    if not auto.activation_checkpointing and shape.activation_checkpointing != (
        t.activation_checkpointing
    ):
        parts.append(
            "activation checkpointing" if shape.activation_checkpointing else "no checkpointing"
        )
    return " and ".join(parts)


def refusal(req: PlanRequest, auto: AutoFields, rejected: list[Candidate], gpu: str) -> str:
    """The message of a job no shape fits (module docstring)."""
    from .sizing import _full_topology

    full = _full_topology(req)
    pool = list(req.nodes or full.nodes)
    usable = int(HEADROOM * min(full.memory_bytes)) if full.memory_bytes else 0
    closest = next((c for c in rejected if c.peak_bytes), None)
    head = (
        f"no shape fits in GPU memory on {', '.join(pool)} ({gpu}, {usable / GiB:.1f} GiB usable "
        "per GPU)"
    )
    if closest is not None:
        head += (
            f"; the closest, {closest.shape.describe(gpu)}, needs "
            f"{closest.peak_bytes / GiB:.1f} GiB per GPU"
        )
    elif rejected:
        head += f"; {rejected[0].rejected}"
    ways = []
    for free in (auto, LEAN):  # the user's values first, then micro-batch and checkpointing too
        more = _more_nodes(req, free, full)
        if more is None:
            continue
        n, c = more
        s = c.shape
        change = _user_changes(req, auto, s)
        ways.append(
            f"{n} nodes x {s.gpus_per_node} {gpu}"
            + (f" with {change}" if change else "")
            + f" (EP {s.ep_size}, microBatch {s.micro_batch}, activation checkpointing "
            f"{'on' if s.activation_checkpointing else 'off'}: {c.peak_bytes / GiB:.1f} GiB per GPU"
            + (
                f"; globalBatch a multiple of {n * s.gpus_per_node * s.micro_batch})"
                if req.global_batch % (n * s.gpus_per_node * s.micro_batch)
                else ")"
            )
        )
        break
    here, _, _ = search(replace(req, nodes=pool), EVERYTHING, memory_only=True)
    if here:
        best = min(here, key=lambda c: (c.shape.world_size, c.peak_bytes))
        change = _user_changes(req, auto, best.shape)
        if change:
            ways.append(f"{change} on the discovered nodes ({best.peak_bytes / GiB:.1f} GiB)")
    if not ways:
        return head + ": a smaller model or sequence length"
    return head + ". It needs " + ", or ".join(ways)
