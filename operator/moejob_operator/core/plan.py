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

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field, replace
from typing import Any

import numpy as np

from moe_contracts.plan import PLAN_KIND, PLAN_VERSION, MoEPlan, PlanError, parse_plan, plan_json
from moe_contracts.routing import RoutingStats
from moe_contracts.topology import TopologyReport

from . import cost, dispatch, router_groups
from . import perf as perf_mod
from . import placement as placement_mod
from .dsconfig import CPU, GpuCaps, choose_ep_size, deepspeed_config
from .errors import DoesNotFit, FieldError
from .memory import (
    DEFAULT_CAPACITY_FACTOR,
    GiB,
    MemoryEstimate,
    estimate_memory,
    grad_handoff_applies,
)
from .models import FAMILIES, MoEModelSpec, ResolvedModel, spec_from_hf_config
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


@dataclass(frozen=True)
class TrainingOptions:
    """What the trainer needs besides the model and the DeepSpeed config (``training`` block)."""

    steps: int = 20
    lr: float = 1e-3
    warmup_steps: int = 2
    checkpoint_every_steps: int = 50  # the CRD's spec.checkpoint.everySteps default
    seed: int = 1234
    grad_clip: float = 1.0
    activation_checkpointing: bool = False
    balance_mode: str = "per_layer_aux"
    balance_coef: float = 0.01
    data: dict[str, Any] = field(default_factory=lambda: {"kind": "synthetic"})
    extra: dict[str, Any] = field(default_factory=dict)  # passed through (camelCase keys)


@dataclass(frozen=True)
class Plan:
    document: dict[str, Any]
    topology: ClusterTopology
    placement: placement_mod.Placement
    memory: MemoryEstimate
    warnings: tuple[str, ...]
    gpu: GpuCaps

    def summary(self) -> str:
        return summarize(self)


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


@dataclass(frozen=True)
class PlanRequest:
    """Everything :func:`build_plan` reads: the job, the model, where it runs and how it trains.

    ``topology``: the nodes' TopologyReports (or a ClusterTopology with ``gpu``); None on CPU.
    ``nodes``: the nodes to use (default all in ``topology``; CPU: ``["localhost"]``), with
    ``gpus_per_node`` GPUs each (default all). ``device``: ``"cuda"`` or ``"cpu"`` (then
    ``procs_per_node`` processes per node sharing ``cpu_memory_bytes`` each, 0: unchecked).
    ``performance``: let the planner pick the fast settings (:mod:`.perf`); False gives the
    stock configuration (HF blocks + AutoEP, HF's ZeRO-3 "auto" knobs, no performance block).
    ``dispatcher``: ``"autoep"`` or ``"dedup"`` (default: dedup when AutoEP runs with EP > 1)."""

    job_name: str
    namespace: str
    model: ResolvedModel
    topology: ClusterTopology | Sequence[TopologyReport] | None
    _: KW_ONLY
    global_batch: int
    seq_len: int
    nodes: Sequence[str] | None = None
    gpus_per_node: int | None = None
    strategy: str = "topology_aware"
    routing_stats: RoutingStats | None = None
    micro_batch: int | None = None
    ep_size: int | None = None
    gpu: GpuCaps | None = None
    device: str = "cuda"
    procs_per_node: int = 1
    cpu_memory_bytes: int = 0
    training: TrainingOptions = field(default_factory=TrainingOptions)
    autoep: bool = True
    ds_overrides: Mapping[str, Any] | None = None
    performance: bool = True
    dispatcher: str | None = None

    @property
    def cpu(self) -> bool:
        return self.device == "cpu"

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len


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
    mem = _fit_memory(req, topo, ep, ds, scored.capacity)
    warnings += mem.warnings
    doc = _document(req, topo, caps, pl, ep, dispatcher, scored.quality, mem, ds.perf, warnings)
    check_plan(doc)  # the document we hand out must pass the reader
    return Plan(doc, topo, pl, mem.estimate, tuple(warnings), caps)


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
            n_group=int((req.model.hf_config or {}).get("n_group") or 1),
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
    p = 2 if caps.supports_bf16 or (ds.get("fp16") or {}).get("enabled") else 4
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


def _fit_memory(
    req: PlanRequest, topo: ClusterTopology, ep: int, ds: _DeepSpeed, capacity: float
) -> _Memory:
    """The peak memory estimate; without a requested micro-batch, the largest one (fewest
    accumulation steps) that fits. Raises ``DoesNotFit`` with what to try instead."""
    spec, t, world = req.model.spec, req.training, topo.num_gpus
    perf_doc = dict(ds.perf.performance) if ds.perf and ds.perf.performance else {}
    config = ds.config

    def estimate(
        micro: int,
        *,
        activation_checkpointing: bool = t.activation_checkpointing,
        world_scale: int = 1,
    ) -> MemoryEstimate:
        return estimate_memory(
            spec,
            config,
            world_size=world * world_scale,
            ep_size=ep,
            seq_len=req.seq_len,
            micro_batch=micro,
            activation_checkpointing=activation_checkpointing,
            capacity_factor=capacity,
            device="cpu" if req.cpu else "gpu",
            fused_loss_chunk=perf_doc.get("lossChunkTokens", 8192)
            if perf_doc.get("fusedLoss")
            else None,
            grad_handoff=grad_handoff_applies(config, perf_doc),
            compiled_layers=bool(perf_doc.get("compileLayers")),
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
) -> dict[str, Any]:
    """The MoEPlan v1 document."""
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
        "placement": {**pl.to_json(), "dispatcher": dispatcher, "quality": quality},
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
    if family not in FAMILIES:
        raise PlanError(f"{PLAN_KIND} model.family: {family!r} is not one of {list(FAMILIES)}")
    spec = spec_from_hf_config(plan.model.hf_config or {}, f"{PLAN_KIND} model.hfConfig")
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


def _group_label(topo: ClusterTopology, grp: list[int]) -> str:
    """``node[0-7]`` / ``node[0,2]``: one NVLink group by node and local GPU indices."""
    node, local = topo.gpus[grp[0]][0], sorted(topo.gpus[g][1] for g in grp)
    if len(local) > 2 and local == list(range(local[0], local[-1] + 1)):
        return f"{node}[{local[0]}-{local[-1]}]"
    return f"{node}[{','.join(map(str, local))}]"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _strategy_line(plan: Plan) -> str:
    """The layout the plan has: a strategy that needed routing statistics and had none says so."""
    asked = str(plan.document["placement"]["strategy"])
    if plan.placement.fell_back:
        return (
            f"{plan.document['placement']['fellBackTo']} "
            f"({asked} without routing statistics: pass --stats)"
        )
    return asked


def _dispatch_line(pl: dict[str, Any]) -> str:
    """``dispatch   dedup; MiB/step fwd+bwd (..): dedup .. | AutoEP ..`` (core.dispatch)."""
    q = pl["quality"].get("dispatch") or {}
    chosen = pl.get("dispatcher", "autoep")
    if "dedup" not in q:
        return f"dispatch   {chosen} (bytes by tier: {q.get('basis', 'n/a')})"

    def fmt(d: dict[str, Any]) -> str:
        return (
            f"cross-group {d['crossGroupBytesPerStep'] / 2**20:.1f}, intra-group "
            f"{d['intraGroupBytesPerStep'] / 2**20:.1f}, cross-node "
            f"{d['crossNodeBytesPerStep'] / 2**20:.1f}"
        )

    return (
        f"dispatch   {chosen}; MiB/step fwd+bwd ({q['basis']}): dedup {fmt(q['dedup'])} | "
        f"AutoEP {fmt(q['autoep'])}"
    )


def summarize(plan: Plan) -> str:
    """A readable summary for ``moectl plan``."""
    d, topo = plan.document, plan.topology
    q = d["placement"]["quality"]
    groups = [_group_label(topo, grp) for grp in topo.groups()]
    lines = [
        (
            f"job        {d['job']['namespace']}/{d['job']['name']}  "
            f"model {d['model']['preset'] or d['model']['path']} ({d['model']['family']})"
        ),
        (
            f"device     {d['device']} ({plan.gpu.name}), world size {d['worldSize']}, "
            f"nodes {', '.join(topo.nodes)}"
        ),
        "NVLink     "
        + (
            " ".join(groups)
            if d["device"] == "cuda"
            else "n/a (CPU: one shared-memory group per node)"
        ),
        (
            f"EP size    {d['epSize']} "
            f"({_count(d['placement']['numExperts'] // d['epSize'], 'expert')} per "
            f"rank), AutoEP {'on' if d['deepspeed'].get('expert_parallel') else 'off'}"
        ),
        f"placement  {_strategy_line(plan)}: cross-group {q['crossGroupBytesPerStep'] / 2**20:.1f}"
        f" MiB/step ({q.get('crossGroupVsContiguous', 1.0):.2f}x contiguous"
        + (
            f", ~{q['crossGroupVsContiguousHeldOut']:.2f}x expected on new tokens"
            if q.get("crossGroupVsContiguousHeldOut", q.get("crossGroupVsContiguous"))
            != q.get("crossGroupVsContiguous")
            else ""
        )
        + "), cross-node "
        f"{q['crossNodeBytesPerStep'] / 2**20:.1f} MiB/step, max/mean load "
        f"{q['maxMeanLoad']:.2f} ({q['basis']} routing"
        + (
            ", LOWER BOUND: top-k > 2 scored without token samples)"
            if q.get("estimate") == "lowerBound"
            else ")"
        ),
        _dispatch_line(d["placement"]),
        (
            f"batch      global {d['deepspeed']['train_batch_size']} = micro "
            f"{d['training']['microBatch']} x accum {d['training']['gradAccum']} x {d['worldSize']}"
            f", seq {d['training']['seqLen']}"
        ),
        "memory per " + ("process" if d["device"] == "cpu" else "GPU") + ":",
        plan.memory.explain(d["memory"]["gpuMemoryBytes"] or None, HEADROOM),
    ]
    perf = d["training"].get("performance")
    lines.append(
        f"MoE impl   {d['training'].get('moeImpl', 'hf')}; performance options "
        + ("(planner's choice, why):" if perf else "off (stock configuration)")
    )
    lines += [f"  - {r}" for r in (perf or {}).get("reasons", [])]
    lines += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(lines)
