"""The plan: from model, topology and routing statistics to the ``MoEPlan`` v1 document.

``build_plan`` picks the GPUs (whole NVLink groups first), the EP size (largest that keeps EP
groups inside NVLink groups), solves the expert placement (``placement.solve``), scores it
against DeepSpeed's contiguous default (``cost.score``), writes the DeepSpeed config
(``dsconfig``) and refuses, before any pod starts, a job that does not fit in GPU memory
(``memory``). CPU mode (no GPUs, the local demo): ``device: "cpu"``, ``distBackend: "gloo"``,
``worldSize = nodes x processes per node``, fp32, every rank ``gpu: null``.

The document's one reader is :mod:`moe_contracts.plan` (the trainer reads plans with it too);
:func:`check_plan` adds what only the planning core knows (the model family's layer counts).
"""

from __future__ import annotations

from . import placement as placement_mod
from .errors import FieldError
from .plan_cluster import _cluster, cpu_topology, gpu_caps, select_gpus, subset
from .plan_document import Plan, _document, _ranks, check_plan, write_plan
from .plan_replicas import plan_replicas
from .plan_request import PlanRequest, TrainingOptions
from .plan_steps import (
    CAPACITY_MARGIN,
    HEADROOM,
    MIN_TOKENS_PER_EXPERT,
    UNIFORM_TRACE_TOKENS,
    _deepspeed,
    _dispatcher,
    _elem_bytes,
    _ep_size,
    _fit_memory,
    _place,
    _score_placement,
    _usable_stats,
)
from .plan_text import summarize

__all__ = [
    "CAPACITY_MARGIN",
    "HEADROOM",
    "MIN_TOKENS_PER_EXPERT",
    "UNIFORM_TRACE_TOKENS",
    "Plan",
    "PlanRequest",
    "TrainingOptions",
    "_ranks",
    "build_plan",
    "check_plan",
    "cpu_topology",
    "gpu_caps",
    "select_gpus",
    "subset",
    "summarize",
    "write_plan",
]


def build_plan(request: PlanRequest) -> Plan:
    """Build (and validate) the MoEPlan v1 document; raises ``FieldError`` naming the input
    (``DoesNotFit`` when the job does not fit in memory). The steps, in order: the GPUs
    (:func:`_cluster`), the usable routing statistics, the EP size, the expert placement, the
    DeepSpeed config, the dispatcher, the placement's score, the memory check (largest
    micro-batch that fits), the document."""
    req = request
    if req.strategy not in placement_mod.STRATEGIES:
        raise FieldError(
            "strategy", f"{req.strategy!r} is not one of {list(placement_mod.STRATEGIES)}"
        )
    if req.device not in ("cpu", "cuda"):
        raise FieldError("device", f"{req.device!r} is not 'cuda' or 'cpu'")
    topo, caps = _cluster(req)
    stats, stats_warnings = _usable_stats(req)
    ep, auto_ep = _ep_size(req, topo)
    pl = _place(req, topo, stats, ep)
    ds = _deepspeed(req, topo.num_gpus, ep, caps)
    dispatcher = _dispatcher(req, ds.config, ep)

    warnings = list(ds.warnings)
    if req.ep_size is not None and req.ep_size > auto_ep:
        warnings.append(
            f"epSize {req.ep_size} spans NVLink groups (the largest that stays inside is {auto_ep})"
        )
    warnings += list(pl.notes) + stats_warnings
    E = req.model.spec.num_experts
    if stats is not None and stats.tokens < MIN_TOKENS_PER_EXPERT * E:
        warnings.append(
            f"routingStats: only {stats.tokens} tokens for {E} experts "
            f"(< {MIN_TOKENS_PER_EXPERT} per expert): placement and load figures are "
            "unreliable"
        )
    scored = _score_placement(req, pl, topo, stats, ds.config, caps, dispatcher)
    warnings += scored.warnings
    replicas = plan_replicas(
        req.replicas,
        req.max_expert_memory_overhead,
        pl,
        topo,
        stats,
        dispatcher,
        hidden_bytes=req.model.spec.hidden_size * _elem_bytes(caps, ds.config),
        tokens_per_step=req.tokens_per_step,
        expert_bytes=req.model.spec.expert_params() * _elem_bytes(caps, ds.config),
        micro_steps=int(ds.config.get("gradient_accumulation_steps") or 1),
    )
    if replicas.quality is not None:
        scored.quality["replicas"] = replicas.quality
    if replicas.dedup_per_step is not None and "dedup" in scored.quality.get("dispatch", {}):
        scored.quality["dispatch"]["dedup"] = replicas.dedup_per_step
    mem = _fit_memory(req, topo, ep, ds, scored.capacity, replicas.copies_per_rank)
    warnings += mem.warnings
    doc = _document(
        req,
        topo,
        caps,
        pl,
        ep,
        dispatcher,
        scored.quality,
        mem,
        ds.perf,
        warnings,
        replicas=replicas.to_json(),
    )
    check_plan(doc)  # the document we hand out must pass the reader
    return Plan(doc, topo, pl, mem.estimate, tuple(warnings), caps)
