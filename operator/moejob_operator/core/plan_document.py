"""The ``MoEPlan`` v1 document the planning core hands out, and its reader.

The document's one reader is :mod:`moe_contracts.plan` (the trainer reads plans with it too);
:func:`check_plan` adds what only the planning core knows (the model family's layer counts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from moe_contracts.plan import PLAN_KIND, PLAN_VERSION, MoEPlan, PlanError, parse_plan, plan_json
from moe_contracts.topology import TopologyReport

from . import families
from . import perf as perf_mod
from . import placement as placement_mod
from .dsconfig import GpuCaps
from .memory import MemoryEstimate
from .models import spec_from_hf_config
from .plan_request import PlanRequest
from .plan_steps import _Memory
from .topology import ClusterTopology


@dataclass(frozen=True)
class Plan:
    document: dict[str, Any]
    topology: ClusterTopology
    placement: placement_mod.Placement
    memory: MemoryEstimate
    warnings: tuple[str, ...]
    gpu: GpuCaps
    sizing: Any = None  # core.sizing.Sizing when Auto fields chose the shape

    def summary(self) -> str:
        from .plan_text import summarize

        return summarize(self)


def _ranks(topo: ClusterTopology, rank2gpu: np.ndarray, cpu: bool) -> list[dict[str, Any]]:
    """The rank table. ``gpu`` counts the node's *selected* GPUs in NVML (PCI bus) order: the
    worker pod requests ``nvidia.com/gpu: gpusPerNode`` and the device plugin hands the container
    that many GPUs, renumbered from 0 (with the whole node selected it is the NVML index)."""
    visible: dict[str, list[int]] = {}
    for node, local in topo.gpus:
        visible.setdefault(node, []).append(int(local))
    out: list[dict[str, Any]] = []
    node_rank: dict[str, int] = {}
    first: dict[str, int] = {}
    for r, g in enumerate(rank2gpu.tolist()):
        node, local = topo.gpus[g]
        node_rank.setdefault(node, len(node_rank))
        first.setdefault(node, r)
        out.append(
            {
                "rank": r,
                "node": node,
                "nodeRank": node_rank[node],
                "localRank": r - first[node],
                "gpu": None if cpu else sorted(visible[node]).index(int(local)),
                "group": int(topo.group_of[g]),
            }
        )
    return out


def _hardware(
    caps: GpuCaps, topo: ClusterTopology, reports: Sequence[TopologyReport] | None
) -> dict[str, Any]:
    """What the job's kernels depend on (the upgrade gate keys GPU verdicts by it): GPU model,
    compute capability, driver and its CUDA version (of the first node; None when unknown)."""
    if caps.is_cpu:
        return {
            "gpu": None,
            "computeCapability": None,
            "driverVersion": None,
            "cudaDriverVersion": None,
        }
    first = next((r for r in reports or () if r.node in topo.nodes), None)
    return {
        "gpu": caps.name,
        "computeCapability": caps.compute_capability,
        "driverVersion": first.driver_version if first else None,
        "cudaDriverVersion": first.cuda_driver_version if first else None,
    }


def _document(
    req: PlanRequest,
    topo: ClusterTopology,
    caps: GpuCaps,
    pl: placement_mod.Placement,
    ep: int,
    dispatcher: str,
    quality: dict[str, Any],
    mem: _Memory,
    choice: perf_mod.PerfChoice | None,
    warnings: list[str],
    *,
    replicas: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The MoEPlan v1 document (``placement.replicas`` only when copies were chosen)."""
    spec, model, t, ds = req.model.spec, req.model, req.training, mem.deepspeed
    reports = None if req.cpu or isinstance(req.topology, ClusterTopology) else req.topology
    doc: dict[str, Any] = {
        "kind": PLAN_KIND,
        "version": PLAN_VERSION,
        "job": {"namespace": req.namespace, "name": req.job_name},
        "device": "cpu" if req.cpu else "cuda",
        "distBackend": "gloo" if req.cpu else "nccl",
        "model": {
            "family": spec.family,
            "preset": model.preset,
            "path": model.path,
            "hfConfig": model.hf_config,
        },
        "worldSize": topo.num_gpus,
        "epSize": ep,
        "ranks": _ranks(topo, pl.rank2gpu, req.cpu),
        "placement": {
            **pl.to_json(),
            "dispatcher": dispatcher,
            **({"replicas": replicas} if replicas is not None else {}),
            "quality": quality,
        },
        "deepspeed": ds,
        "memory": {
            "gpuMemoryBytes": mem.memory_bytes,
            "estimatedPeakBytes": mem.estimate.total,
            "fits": mem.fits,
            "breakdown": mem.estimate.breakdown,
        },
        "training": {
            "steps": t.steps,
            "seqLen": req.seq_len,
            "microBatch": mem.micro_batch,
            "gradAccum": ds["gradient_accumulation_steps"],
            "lr": t.lr,
            "warmupSteps": t.warmup_steps,
            "checkpointEverySteps": t.checkpoint_every_steps,
            "seed": t.seed,
            "gradClip": t.grad_clip,
            "activationCheckpointing": t.activation_checkpointing,
            "balance": {"mode": t.balance_mode, "coef": t.balance_coef},
            "data": dict(t.data),
            **t.extra,
        },
        "warnings": list(warnings),
        "hardware": _hardware(caps, topo, reports),
    }
    if choice is not None:
        doc["training"]["moeImpl"] = t.extra.get("moeImpl", choice.moe_impl)
        if choice.performance:
            doc["training"]["performance"] = dict(choice.performance)
    return doc


def check_plan(doc: dict[str, Any]) -> MoEPlan:
    """A plan as the planning core hands it out: every field it writes (the contract's reader,
    ``complete``), and the model family's MoE layers and experts matching the placement."""
    plan = parse_plan(doc, complete=True)
    family = plan.model.family
    if family not in families.NAMES:
        raise PlanError(
            f"{PLAN_KIND} model.family: {family!r} is not one of {list(families.NAMES)}"
        )
    spec = spec_from_hf_config(plan.model.hf_config or {}, f"{PLAN_KIND} model.hfConfig")
    if spec.family != family:
        raise PlanError(
            f"{PLAN_KIND} model.hfConfig.model_type: "
            f"{(plan.model.hf_config or {}).get('model_type')!r} differs from model.family "
            f"{family!r} (it is a {spec.family} model)"
        )
    if spec.num_experts % plan.ep_size:
        raise PlanError(
            f"{PLAN_KIND} epSize: {plan.ep_size} must divide the number of experts "
            f"{spec.num_experts}"
        )
    pl = plan.placement
    if pl is not None and (pl.num_layers, pl.num_experts) != (
        spec.num_moe_layers,
        spec.num_experts,
    ):
        raise PlanError(
            f"{PLAN_KIND} placement: {pl.num_layers} layers x {pl.num_experts} experts, the "
            f"model has {spec.num_moe_layers} MoE layers x {spec.num_experts} experts"
        )
    return plan


def write_plan(result: Plan | dict[str, Any], path: str) -> None:
    """Check (:func:`check_plan`) and write a plan document (or a ``Plan``'s) to ``path``."""
    doc = result.document if isinstance(result, Plan) else result
    check_plan(doc)
    with open(path, "w") as f:
        f.write(plan_json(doc))
