"""Hand-written MoEPlan documents for tests that need a plan the contract accepts without running
the planner (goldens, metrics, status): complete in the contract's sense (``parse_plan(...,
complete=True)``), every figure chosen by the test."""

from __future__ import annotations

import copy
from typing import Any

from moe_contracts.plan import MoEPlan, parse_plan


def plan_doc(
    *,
    nodes: tuple[str, ...] = ("node-a", "node-b"),
    gpus_per_node: int = 1,
    num_experts: int = 4,
    quality: dict[str, Any] | None = None,
    memory: dict[str, Any] | None = None,
    **top: Any,
) -> dict[str, Any]:
    """A complete MoEPlan v1 document: one rank per GPU, EP over the whole world, an identity
    placement of ``num_experts`` experts in 2 layers; ``top`` replaces top-level fields."""
    world = len(nodes) * gpus_per_node
    ranks = [
        {"rank": n * gpus_per_node + g, "node": node, "nodeRank": n, "localRank": g, "gpu": g}
        for n, node in enumerate(nodes)
        for g in range(gpus_per_node)
    ]
    placement: dict[str, Any] = {
        "strategy": "contiguous",
        "numLayers": 2,
        "numExperts": num_experts,
        "epSize": world,
        "permutation": [list(range(num_experts))] * 2,
    }
    if quality is not None:
        placement["quality"] = quality
    doc: dict[str, Any] = {
        "kind": "MoEPlan",
        "version": 1,
        "job": {"namespace": "team-a", "name": "tiny-cpu"},
        "model": {"family": "mixtral", "hfConfig": {"model_type": "mixtral"}},
        "worldSize": world,
        "epSize": world,
        "ranks": ranks,
        "placement": placement,
        "deepspeed": {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "train_batch_size": world,
            "expert_parallel": {"enabled": True, "autoep_size": world},
        },
        "memory": {
            "gpuMemoryBytes": 80 * 2**30,
            "estimatedPeakBytes": 2**30,
            "fits": True,
            "breakdown": {},
            **(memory or {}),
        },
        "training": {"steps": 10, "seqLen": 32, "microBatch": 1, "gradAccum": 1},
    }
    doc.update(copy.deepcopy(top))
    return doc


def plan(**kw: Any) -> MoEPlan:
    """:func:`plan_doc`, parsed as the operator holds it."""
    return parse_plan(plan_doc(**kw), complete=True)
