"""The spec's ``Auto`` fields, between the spec and the sizing core (``core.sizing``).

* :func:`auto_fields`: which sizing fields the planner chooses (the ZeRO-3 persistence threshold
  too, whenever another field is ``Auto`` and ``deepspeedOverrides`` does not set it);
* :func:`check`: what can be refused before discovery (``Auto`` sizes GPU jobs only);
* :func:`sized_spec`: the spec with the plan's values in place of ``Auto``, for the worker pods
  (node count, GPUs per pod, world size); the job's hashes stay those of the spec as written;
* :func:`status`: ``status.sizing``: the chosen values, the predicted tokens/s and peak memory
  per GPU, the measured tokens/s (``status.progress``) and measured / predicted.
"""

from __future__ import annotations

from typing import Any

from moe_contracts.plan import MoEPlan

from ..core.sizing import AutoFields
from ..spec import AUTO, JobSpec, SpecError


def auto_fields(spec: JobSpec) -> AutoFields:
    n, t, pl = spec.nodes, spec.training, spec.placement
    auto = AutoFields(
        nodes=n.count == AUTO,
        gpus_per_node=n.gpus_per_node == AUTO,
        ep_size=pl.expert_parallel_size == AUTO,
        micro_batch=t.micro_batch == AUTO,
        activation_checkpointing=t.activation_checkpointing == AUTO,
    )
    zero = (spec.deepspeed_overrides or {}).get("zero_optimization") or {}
    user_threshold = isinstance(zero, dict) and "stage3_param_persistence_threshold" in zero
    if auto.any and not user_threshold:
        auto = AutoFields(**{**auto.__dict__, "persistence": True})
    return auto


def check(spec: JobSpec) -> None:
    """``Auto`` needs GPUs: the throughput model that ranks the shapes is of GPUs."""
    if spec.device == "CPU" and spec.auto_fields:
        raise SpecError(
            spec.auto_fields[0],
            f"Auto sizes GPU jobs (device GPU); with device CPU give a value "
            f"({', '.join(spec.auto_fields)} are Auto)",
        )


def sized_spec(spec: JobSpec, plan: MoEPlan) -> JobSpec:
    """``spec`` with the plan's node count, GPUs per node and micro-batch where it says Auto."""
    if not spec.auto_fields:
        return spec
    nodes = len({r.node for r in plan.ranks})
    gpus = plan.world_size // max(nodes, 1)
    micro = plan.training.micro_batch
    return spec.model_copy(
        update={
            "nodes": spec.nodes.model_copy(update={"count": nodes, "gpus_per_node": gpus}),
            "training": spec.training.model_copy(update={"micro_batch": micro}),
        }
    )


def status(current: dict[str, Any], plan: MoEPlan) -> None:
    """Set ``current["sizing"]`` from the plan's sizing record and ``current["progress"]``."""
    rec = plan.sizing
    if rec is None:
        current.pop("sizing", None)
        return
    chosen = rec.get("chosen") or {}
    out: dict[str, Any] = {
        "auto": list(rec.get("auto") or []),
        "nodeCount": chosen.get("nodeCount"),
        "gpusPerNode": chosen.get("gpusPerNode"),
        "expertParallelSize": chosen.get("expertParallelSize"),
        "microBatch": chosen.get("microBatch"),
        "activationCheckpointing": chosen.get("activationCheckpointing"),
        "persistence": chosen.get("persistence"),
        "predictedTokensPerSecond": round(float(rec.get("predictedTokensPerSecond") or 0)),
        "predictedPeakBytesPerGpu": rec.get("predictedPeakBytes"),
    }
    measured = (current.get("progress") or {}).get("tokensPerSecond")
    predicted = out["predictedTokensPerSecond"]
    if isinstance(measured, (int, float)) and measured > 0 and predicted:
        out["measuredTokensPerSecond"] = round(float(measured))
        out["measuredVsPredicted"] = f"{float(measured) / predicted:.3f}"
    current["sizing"] = {k: v for k, v in out.items() if v is not None}


def describe(rec: dict[str, Any]) -> str:
    """One line for the Planned condition and Event."""
    c = rec.get("chosen") or {}
    return (
        f"sized ({', '.join(rec.get('auto') or [])} Auto): {c.get('nodeCount')} node(s) x "
        f"{c.get('gpusPerNode')} GPU(s), EP {c.get('expertParallelSize')}, microBatch "
        f"{c.get('microBatch')}, activation checkpointing "
        f"{'on' if c.get('activationCheckpointing') else 'off'}; predicted "
        f"{float(rec.get('predictedTokensPerSecond') or 0):,.0f} tokens/s"
    )
