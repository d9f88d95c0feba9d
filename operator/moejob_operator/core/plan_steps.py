"""The steps of :func:`.plan.build_plan` after the GPUs (:mod:`.plan_cluster`), in the order it
runs them: the usable routing statistics, the EP size, the expert placement, the DeepSpeed
config, the dispatcher, the placement's score and the memory check (largest micro-batch that
fits).
Each takes the :class:`~.plan_request.PlanRequest` and what earlier steps returned; a bad input
raises ``FieldError`` naming it, a job that does not fit ``DoesNotFit``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from moe_contracts.routing import RoutingStats

from . import cost, dispatch, families, router_groups
from . import perf as perf_mod
from . import placement as placement_mod
from .dsconfig import GpuCaps, choose_ep_size, deepspeed_config
from .errors import DoesNotFit, FieldError
from .memory import (
    DEFAULT_CAPACITY_FACTOR,
    GiB,
    MemoryEstimate,
    estimate_memory,
    grad_handoff_applies,
)
from .models import MoEModelSpec
from .plan_cluster import _group_sizes
from .plan_request import PlanRequest
from .routing import synthetic_trace
from .topology import ClusterTopology

HEADROOM = 0.9  # usable share of GPU memory
UNIFORM_TRACE_TOKENS = 4096  # sampled tokens when scoring without routing statistics
# The MoE dispatch buffer is sized for the worst layer's max/mean GPU load on the recorded
# window plus this margin: on the next window of the same run the worst layer rose by up to
# 53.4 % (benchmarks/results/placement-heldout.json, maxWorstLayerLoadDrift, over every recording
# and non-contiguous placement; docs/placement.md).
CAPACITY_MARGIN = 0.55
MIN_TOKENS_PER_EXPERT = 16  # fewer recorded tokens than this per expert: figures unreliable


def _dispatch(
    pl: placement_mod.Placement,
    topo: ClusterTopology,
    trace: RoutingStats,
    spec: MoEModelSpec,
    job_tokens_per_step: int,
    p: int,
    chosen: str,
) -> dict[str, Any]:
    """``placement.quality.dispatch``: bytes per step by tier, forward + backward, for the chosen
    dispatcher and for AutoEP's, exact on the trace's sampled tokens (core.dispatch)."""
    if trace.token_experts is None:
        return {"dispatcher": chosen, "basis": "none (routing statistics without tokenSamples)"}
    te = trace.token_experts
    got = dispatch.dispatch_bytes(pl, topo, te, hidden_size=spec.hidden_size, bytes_per_elem=p)
    scale = job_tokens_per_step / max(te.shape[1], 1)
    return {
        "dispatcher": chosen,
        "basis": f"{te.shape[1]} sampled tokens",
        **dispatch.per_step(got, scale),
    }


def _score(
    pl: placement_mod.Placement,
    topo: ClusterTopology,
    trace: RoutingStats,
    spec: MoEModelSpec,
    job_tokens_per_step: int,
    p: int,
) -> tuple[cost.Score, dict[str, Any]]:
    """Score ``pl`` and contiguous on ``trace``; bytes rescaled to this job's tokens per step."""
    contiguous = placement_mod.solve(
        "contiguous",
        topo,
        None,
        ep_size=pl.ep_size,
        num_experts=pl.num_experts,
        num_layers=pl.num_layers,
    )
    ours = cost.score(pl, topo, trace, hidden_size=spec.hidden_size, bytes_per_elem=p)
    base = cost.score(contiguous, topo, trace, hidden_size=spec.hidden_size, bytes_per_elem=p)
    quality = ours.quality(base)
    if "crossGroupVsContiguous" in quality:
        quality["crossGroupVsContiguousHeldOut"] = round(
            placement_mod.heldout_estimate(pl, quality["crossGroupVsContiguous"], trace.top_k), 4
        )
    scale = job_tokens_per_step / max(trace.tokens / max(trace.steps, 1), 1)
    for key in ("crossGroupBytesPerStep", "crossNodeBytesPerStep"):
        quality[key] = round(quality[key] * scale)
    quality["allToAllSecondsPerStep"] = quality["allToAllSecondsPerStep"] * scale
    quality["contiguousCrossGroupBytesPerStep"] = round(base.cross_group_bytes_per_step * scale)
    quality["contiguousMaxMeanLoad"] = round(base.max_mean_load, 4)
    quality["autoEpMaxGpuBytesPerStep"] = round(quality["autoEpMaxGpuBytesPerStep"] * scale)
    return ours, quality


def _fit_advice(
    est: MemoryEstimate,
    micro: int,
    limit: int,
    checkpointing: bool,
    estimate: Callable[..., MemoryEstimate],
) -> str:
    """What to try when the job does not fit, each with its re-estimated peak."""
    options = []
    if not checkpointing:
        options.append(("activation checkpointing", estimate(micro, activation_checkpointing=True)))
    if micro > 1:
        options.append((f"micro-batch {micro // 2}", estimate(micro // 2)))
    options.append(("twice the GPUs", estimate(micro, world_scale=2)))
    tips = [
        f"{label}: {other.total / GiB:.1f} GiB" + (" (fits)" if other.total <= limit else "")
        for label, other in options
        if other.total < est.total
    ]
    return "; ".join(tips) or "a smaller model or sequence length"


def _usable_stats(req: PlanRequest) -> tuple[RoutingStats | None, list[str]]:
    """The routing statistics to plan with (None: plan without), and what to say about them."""
    stats, spec = req.routing_stats, req.model.spec
    if stats is not None and stats.tokens == 0:
        return None, [
            (
                "routingStats: the document records 0 tokens (an empty run?); "
                "planned as without routing statistics"
            )
        ]
    shape = (spec.num_moe_layers, spec.num_experts)
    if stats is not None and (stats.num_layers, stats.num_experts) != shape:
        raise FieldError(
            "routingStats",
            f"{stats.num_layers} layers x {stats.num_experts} "
            f"experts, the model has {shape[0]} MoE layers x {shape[1]} experts",
        )
    return stats, []


def _ep_size(req: PlanRequest, topo: ClusterTopology) -> tuple[int, int]:
    """``(ep, auto_ep)``: the EP size to use (asked for, else ``auto_ep``) and the largest one
    that keeps EP groups inside NVLink groups."""
    E, world = req.model.spec.num_experts, topo.num_gpus
    order = topo.gpu_order() if req.strategy != "contiguous" else np.arange(world)
    auto_ep = choose_ep_size(_group_sizes(topo, order), E, world)
    if not req.autoep or families.get(req.model.spec.family).autoep_preset is None:
        auto_ep = 1  # no AutoEP: experts are ordinary ZeRO-3 parameters, nothing to split
    ep = auto_ep if req.ep_size is None else req.ep_size
    if ep < 1 or E % ep:
        raise FieldError("epSize", f"{ep} does not divide the number of experts {E}")
    if world % ep:
        raise FieldError("epSize", f"{ep} does not divide the world size {world}")
    return ep, auto_ep


def _place(
    req: PlanRequest, topo: ClusterTopology, stats: RoutingStats | None, ep: int
) -> placement_mod.Placement:
    """The expert placement (router groups kept whole)."""
    spec = req.model.spec
    try:
        return router_groups.solve(
            req.strategy,
            topo,
            stats,
            ep_size=ep,
            num_experts=spec.num_experts,
            num_layers=spec.num_moe_layers,
            seed=req.training.seed,
            n_group=spec.router_groups,
        )
    except ValueError as exc:
        raise FieldError("placement", str(exc)) from None


@dataclass(frozen=True)
class _DeepSpeed:
    """The DeepSpeed config at the requested micro-batch and how to render it at another."""

    config: dict[str, Any]
    warnings: list[str]
    perf: perf_mod.PerfChoice | None
    req: PlanRequest
    world: int
    ep: int
    gpu: GpuCaps
    autoep: bool

    def render(self, micro_batch: int | None) -> tuple[dict[str, Any], list[str]]:
        t = self.req.training
        cfg, warnings = deepspeed_config(
            self.req.model.spec,
            micro_batch=micro_batch,
            world_size=self.world,
            ep_size=self.ep,
            global_batch=self.req.global_batch,
            gpu=self.gpu,
            autoep=self.autoep,
            overrides=dict(self.req.ds_overrides or {}) or None,
            gradient_clipping=t.grad_clip,
            lr=t.lr,
            warmup_steps=t.warmup_steps,
        )
        if self.perf is not None and self.perf.zero_overrides:
            cfg["zero_optimization"].update(self.perf.zero_overrides)
        if self.perf is not None and self.perf.data_types:
            cfg.setdefault("data_types", {}).update(self.perf.data_types)
        return cfg, warnings


def _deepspeed(req: PlanRequest, world: int, ep: int, caps: GpuCaps) -> _DeepSpeed:
    """The planner's performance choice (:mod:`.perf`) and the DeepSpeed config."""
    overrides = dict(req.ds_overrides or {})
    choice, autoep = None, req.autoep
    if req.performance:
        user_zero = overrides.get("zero_optimization") or {}
        choice = perf_mod.choose(
            req.model.spec,
            world_size=world,
            ep_size=ep,
            gpu=caps,
            autoep=autoep,
            has_optimizer="optimizer" in overrides,
            zero_stage=user_zero.get("stage", 3),
            user_perf=req.training.extra.get("performance"),
            user_zero=user_zero,
            user_data_types=overrides.get("data_types") or {},
        )
        autoep = choice.autoep
    unrendered = _DeepSpeed({}, [], choice, req, world, ep, caps, autoep)
    config, warnings = unrendered.render(req.micro_batch)
    return replace(unrendered, config=config, warnings=warnings)


def _dispatcher(req: PlanRequest, ds: dict[str, Any], ep: int) -> str:
    uses_autoep = bool((ds.get("expert_parallel") or {}).get("enabled"))
    dispatcher = req.dispatcher
    if dispatcher is None:
        dispatcher = "dedup" if uses_autoep and ep > 1 else "autoep"
    if dispatcher not in dispatch.DISPATCHERS:
        raise FieldError("dispatcher", f"{dispatcher!r} is not one of {list(dispatch.DISPATCHERS)}")
    if dispatcher == "dedup" and not uses_autoep:
        raise FieldError(
            "dispatcher", "'dedup' dispatches AutoEP layers, and this plan has no AutoEP"
        )
    return dispatcher


@dataclass(frozen=True)
class _Scored:
    quality: dict[str, Any]  # placement.quality of the document
    capacity: float  # the MoE dispatch buffer's capacity factor
    warnings: list[str]


def _elem_bytes(caps: GpuCaps, ds: dict[str, Any]) -> int:
    """Bytes per element of a dispatched hidden row."""
    return 2 if caps.supports_bf16 or (ds.get("fp16") or {}).get("enabled") else 4


def _score_placement(
    req: PlanRequest,
    pl: placement_mod.Placement,
    topo: ClusterTopology,
    stats: RoutingStats | None,
    ds: dict[str, Any],
    caps: GpuCaps,
    dispatcher: str,
) -> _Scored:
    """The placement against contiguous on the routing statistics (else a uniform trace)."""
    spec = req.model.spec
    p = _elem_bytes(caps, ds)
    trace = stats or synthetic_trace(
        spec.num_moe_layers,
        spec.num_experts,
        spec.top_k,
        UNIFORM_TRACE_TOKENS,
        zipf_s=0.0,
        cluster_affinity=0.0,
        seed=0,
    )
    ours, quality = _score(pl, topo, trace, spec, req.tokens_per_step, p)
    quality["basis"] = "routingStats" if stats is not None else "uniform"
    quality["dispatch"] = _dispatch(pl, topo, trace, spec, req.tokens_per_step, p, dispatcher)
    quality["estimate"] = "exact" if trace.exact else "lowerBound"
    warnings = []
    if not trace.exact:
        warnings.append(
            f"placement.quality: top-{trace.top_k} scored from pair counts (the "
            "routing statistics carry no tokenSamples): bytes are lower bounds, the "
            "ratio an estimate"
        )
    capacity = (
        max(1.0, ours.worst_layer_max_mean_load * (1 + CAPACITY_MARGIN))
        if stats is not None
        else DEFAULT_CAPACITY_FACTOR
    )
    return _Scored(quality, capacity, warnings)


@dataclass(frozen=True)
class _Memory:
    estimate: MemoryEstimate
    micro_batch: int
    deepspeed: dict[str, Any]  # rendered at ``micro_batch``
    memory_bytes: int  # per GPU (per process on CPU); 0: unknown, unchecked
    fits: bool
    warnings: list[str]


def memory_estimate(
    req: PlanRequest,
    world: int,
    ep: int,
    ds: _DeepSpeed,
    capacity: float,
    micro: int,
    *,
    activation_checkpointing: bool | None = None,
    world_scale: int = 1,
    expert_copies: int = 0,
) -> MemoryEstimate:
    """The memory model's peak for ``req`` on ``world`` ranks at ``micro`` sequences per rank,
    with the DeepSpeed config and the speed choices of ``ds`` (the sizing asks it for every
    candidate shape; :func:`_fit_memory` for the plan)."""
    t = req.training
    perf_doc = dict(ds.perf.performance) if ds.perf and ds.perf.performance else {}
    config = ds.config
    return estimate_memory(
        req.model.spec,
        config,
        world_size=world * world_scale,
        ep_size=ep,
        seq_len=req.seq_len,
        micro_batch=micro,
        activation_checkpointing=t.activation_checkpointing
        if activation_checkpointing is None
        else activation_checkpointing,
        capacity_factor=capacity,
        device="cpu" if req.cpu else "gpu",
        fused_loss_chunk=perf_doc.get("lossChunkTokens", 8192)
        if perf_doc.get("fusedLoss")
        else None,
        grad_handoff=grad_handoff_applies(config, perf_doc),
        compiled_layers=bool(perf_doc.get("compileLayers")),
        pretrained=req.model.path is not None,
        expert_copies=expert_copies,
    )


def _fit_memory(
    req: PlanRequest,
    topo: ClusterTopology,
    ep: int,
    ds: _DeepSpeed,
    capacity: float,
    expert_copies: int = 0,
) -> _Memory:
    """The peak memory estimate; without a requested micro-batch, the largest one (fewest
    accumulation steps) that fits. Raises ``DoesNotFit`` with what to try instead."""
    t, world = req.training, topo.num_gpus
    config = ds.config

    def estimate(
        micro: int, *, activation_checkpointing: bool | None = None, world_scale: int = 1
    ) -> MemoryEstimate:
        return memory_estimate(
            req,
            world,
            ep,
            ds,
            capacity,
            micro,
            activation_checkpointing=activation_checkpointing,
            world_scale=world_scale,
            expert_copies=expert_copies,
        )

    warnings = []
    mem_bytes = min(topo.memory_bytes) if topo.memory_bytes else 0
    micro = int(config["train_micro_batch_size_per_gpu"])
    est = estimate(micro)
    if req.micro_batch is None and mem_bytes:
        per_rank = req.global_batch // world
        for m in sorted((d for d in range(1, micro + 1) if per_rank % d == 0), reverse=True):
            est = estimate(m)
            if est.fits(mem_bytes, HEADROOM):
                if m != micro:
                    config = ds.render(m)[0]
                    warnings.append(f"microBatch {m}: the largest that fits ({micro} does not)")
                    micro = m
                break
        else:
            micro = m  # nothing fits: report the smallest micro-batch tried
    fits = est.fits(mem_bytes, HEADROOM) if mem_bytes else True
    if not fits:
        limit = int(HEADROOM * mem_bytes)
        raise DoesNotFit(
            f"the job needs {est.total / GiB:.1f} GiB per "
            f"{'process' if req.cpu else 'GPU'} but {limit / GiB:.1f} GiB are usable "
            f"({HEADROOM:.0%} of {mem_bytes / GiB:.1f} GiB) at micro-batch {micro}: short by "
            f"{est.shortfall(mem_bytes, HEADROOM) / GiB:.1f} GiB. Try "
            + _fit_advice(est, micro, limit, t.activation_checkpointing, estimate)
        )
    return _Memory(est, micro, config, int(mem_bytes), fits, warnings)
