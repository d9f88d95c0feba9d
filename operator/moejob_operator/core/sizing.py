"""Sizing: the job shape for the fields a job leaves ``Auto``.

The fields: ``nodes.count``, ``nodes.gpusPerNode``, ``placement.expertParallelSize``,
``training.microBatch`` (the global batch stays the user's), ``training.activationCheckpointing``
and the ZeRO-3 persistence threshold the planner sets (its own rule, or every parameter kept
whole) unless ``deepspeedOverrides`` sets it. A value the user gives is never changed.

:func:`size` enumerates the shapes on the discovered nodes, estimates each one's peak memory with
the planner's own steps (the DeepSpeed config and speed choices that shape's plan gets, the
memory model), drops those that do not fit with the planner's headroom, predicts the step time
of the rest (:mod:`.throughput`; all-to-all from the cost model on the link tiers) and ranks them
by it. Within one group of (nodes, GPUs per node, EP size, checkpointing, persistence) the
model's step time falls as the micro-batch grows (fewer micro-steps for the same FLOPs), so the
largest micro-batch that fits is the group's candidate and the next larger one is listed as
rejected with the memory it needs. When nothing fits, :func:`size` raises :class:`NoShapeFits`
naming the smallest shape that would (:mod:`.sizing_refusal`). :func:`plan_sized` builds the
plan of the best candidate and records the sizing in the document (``sizing``, docs/contracts.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from moe_contracts.topology import TopologyReport

from . import cost, throughput
from . import placement as placement_mod
from .dsconfig import GpuCaps, deep_merge
from .errors import DoesNotFit, FieldError
from .memory import DEFAULT_CAPACITY_FACTOR, GiB, precision_bytes
from .perf import largest_tensor
from .plan import Plan, build_plan, check_plan
from .plan_cluster import _cluster
from .plan_request import PlanRequest
from .plan_steps import HEADROOM, _deepspeed, _ep_size, memory_estimate
from .routing import synthetic_trace
from .topology import ClusterTopology

# AutoFields attribute -> the spec field it stands for
SIZING_FIELDS = {
    "nodes": "nodes.count",
    "gpus_per_node": "nodes.gpusPerNode",
    "ep_size": "placement.expertParallelSize",
    "micro_batch": "training.microBatch",
    "activation_checkpointing": "training.activationCheckpointing",
    "persistence": "zero_optimization.stage3_param_persistence_threshold",
}
TOP_CANDIDATES = 12  # ranked candidates (and rejected ones) kept in the plan document
TRACE_TOKENS = 1024  # uniform routing sample the all-to-all estimate is scored on


@dataclass(frozen=True)
class AutoFields:
    """Which sizing fields the job leaves to the planner."""

    nodes: bool = False
    gpus_per_node: bool = False
    ep_size: bool = False
    micro_batch: bool = False
    activation_checkpointing: bool = False
    persistence: bool = False

    @property
    def any(self) -> bool:
        return any(getattr(self, f) for f in SIZING_FIELDS)

    def fields(self) -> list[str]:
        return [spec for attr, spec in SIZING_FIELDS.items() if getattr(self, attr)]


@dataclass(frozen=True)
class Shape:
    """One candidate: where the job runs and how it batches."""

    nodes: tuple[str, ...]
    gpus_per_node: int
    ep_size: int
    micro_batch: int
    activation_checkpointing: bool
    persistent: bool  # every parameter persistent (else the planner's threshold)

    @property
    def world_size(self) -> int:
        return len(self.nodes) * self.gpus_per_node

    def describe(self, gpu: str) -> str:
        return (
            f"{len(self.nodes)} node{'s' if len(self.nodes) > 1 else ''} x {self.gpus_per_node} "
            f"{gpu}, EP {self.ep_size}, microBatch {self.micro_batch}, activation checkpointing "
            f"{'on' if self.activation_checkpointing else 'off'}"
            + (", every parameter persistent" if self.persistent else "")
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "nodes": list(self.nodes),
            "nodeCount": len(self.nodes),
            "gpusPerNode": self.gpus_per_node,
            "expertParallelSize": self.ep_size,
            "microBatch": self.micro_batch,
            "activationCheckpointing": self.activation_checkpointing,
            "persistence": "all" if self.persistent else "planner",
        }


@dataclass(frozen=True)
class Candidate:
    shape: Shape
    peak_bytes: int  # the memory model's estimate per GPU (0: not estimated)
    usable_bytes: int  # HEADROOM x the smallest GPU's memory
    step: throughput.StepTime | None = None  # None: rejected before a prediction
    rejected: str | None = None
    workload: throughput.Workload | None = None  # what the prediction was made from

    @property
    def tokens_per_second(self) -> float:
        return self.step.tokens_per_second if self.step else 0.0

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {**self.shape.to_json(), "peakBytes": self.peak_bytes}
        if self.step is not None:
            out["tokensPerSecond"] = round(self.step.tokens_per_second, 1)
            out["stepSeconds"] = round(self.step.seconds, 6)
            out["bound"] = self.step.bound
        if self.rejected:
            out["rejected"] = self.rejected
        return out


class NoShapeFits(DoesNotFit):
    """No candidate fits in memory; the message names the smallest shape that would."""


@dataclass(frozen=True)
class Sizing:
    """The ranked candidates (fitting, best first), the rejected ones and why."""

    auto: AutoFields
    gpu: str
    candidates: tuple[Candidate, ...]
    rejected: tuple[Candidate, ...]

    def record(self, chosen: Candidate, plan: Plan) -> dict[str, Any]:
        """The plan document's ``sizing`` block (docs/contracts.md)."""
        step = chosen.step
        assert step is not None
        cal = throughput.load_calibration()
        return {
            "auto": self.auto.fields(),
            "chosen": chosen.shape.to_json(),
            # 1 unless better-ranked shapes did not fit once placed (routing statistics)
            "chosenRank": self.candidates.index(chosen) + 1,
            "predictedTokensPerSecond": round(step.tokens_per_second, 1),
            "predictedStepSeconds": round(step.seconds, 6),
            "predictedPeakBytes": int(plan.memory.total),
            "bound": step.bound,
            "terms": {k: round(v, 6) for k, v in step.terms.items()},
            "calibration": {
                "gpu": cal.gpu,
                "calibrated": step.calibrated,
                "heldOutMeanAbsError": (cal.source.get("heldOut") or {}).get("meanAbsError"),
            },
            "candidates": [c.to_json() for c in self.candidates[:TOP_CANDIDATES]],
            "rejected": [c.to_json() for c in self.rejected[:TOP_CANDIDATES]],
            "candidatesConsidered": len(self.candidates) + len(self.rejected),
        }


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _gpu_counts(local: int) -> list[int]:
    """GPUs per node to try: powers of two up to the node's count, and the count itself."""
    out, g = [], 1
    while g < local:
        out.append(g)
        g *= 2
    return [*out, local]


def _node_counts(pool: int) -> list[int]:
    """Node counts to try: every count up to 8, then powers of two, and the whole pool."""
    out = list(range(1, min(pool, 8) + 1))
    n = 16
    while n < pool:
        out.append(n)
        n *= 2
    return sorted({*out, pool})


@lru_cache(maxsize=256)
def _uniform_trace(num_layers: int, num_experts: int, top_k: int) -> Any:
    return synthetic_trace(
        num_layers, num_experts, top_k, TRACE_TOKENS, zipf_s=0.0, cluster_affinity=0.0, seed=0
    )


def all_to_all_seconds(
    req: PlanRequest, topo: ClusterTopology, ep: int, dispatcher: str, p: int
) -> float:
    """The MoE all-to-all per step (forward + backward) of DeepSpeed's contiguous layout, from
    the cost model on uniform routing at the link tiers' nominal bandwidth (:mod:`.cost`)."""
    spec = req.model.spec
    pl = placement_mod.solve(
        "contiguous",
        topo,
        None,
        ep_size=ep,
        num_experts=spec.num_experts,
        num_layers=spec.num_moe_layers,
    )
    trace = _uniform_trace(spec.num_moe_layers, spec.num_experts, spec.top_k)
    score = cost.score(pl, topo, trace, hidden_size=spec.hidden_size, bytes_per_elem=p)
    scale = req.tokens_per_step / max(trace.tokens / max(trace.steps, 1), 1)
    if dispatcher == "dedup":
        return float(2 * score.all_to_all_seconds_per_step * scale)
    nv = float(topo.nvlink_gbps.min()) if float(topo.nvlink_gbps.min()) > 0 else topo.pcie_gbps
    return float(2 * score.autoep_max_gpu_bytes_per_step * scale / (nv * 1e9))


def data_parallel_gbps(topo: ClusterTopology) -> float:
    """The slowest link the ZeRO-3 collectives over all ranks cross (GB/s per GPU)."""
    if topo.num_gpus == 1:
        return 0.0
    if len(topo.nodes) > 1:
        return topo.network_gbps
    if topo.num_groups == 1 and float(topo.nvlink_gbps.min()) > 0:
        return float(topo.nvlink_gbps.min())
    return topo.pcie_gbps


def shape_request(req: PlanRequest, shape: Shape) -> PlanRequest:
    """``req`` with the shape's values (what ``build_plan`` gets for this candidate)."""
    overrides = dict(req.ds_overrides or {})
    if shape.persistent:
        keep_all = largest_tensor(req.model.spec) + 1
        overrides = deep_merge(
            overrides, {"zero_optimization": {"stage3_param_persistence_threshold": keep_all}}
        )
    return replace(
        req,
        nodes=list(shape.nodes),
        gpus_per_node=shape.gpus_per_node,
        ep_size=shape.ep_size,
        micro_batch=shape.micro_batch,
        training=replace(req.training, activation_checkpointing=shape.activation_checkpointing),
        ds_overrides=overrides or None,
    )


def _evaluate(
    req: PlanRequest, shape: Shape, topo: ClusterTopology, caps: GpuCaps, a2a: float
) -> Candidate:
    """Memory and step time of one shape (no placement solve: the plan's own steps otherwise)."""
    sreq = shape_request(req, shape)
    usable = int(HEADROOM * min(topo.memory_bytes or (caps.memory_bytes,)))
    try:
        ds = _deepspeed(sreq, topo.num_gpus, shape.ep_size, caps)
    except FieldError as exc:
        return Candidate(shape, 0, usable, rejected=str(exc))
    est = memory_estimate(
        sreq, topo.num_gpus, shape.ep_size, ds, DEFAULT_CAPACITY_FACTOR, shape.micro_batch
    )
    if est.total > usable:
        return Candidate(
            shape,
            est.total,
            usable,
            rejected=f"needs {est.total / GiB:.1f} GiB per GPU, {usable / GiB:.1f} GiB usable",
        )
    cfg, perf = ds.config, (ds.perf.performance if ds.perf else {}) or {}
    autoep = bool((cfg.get("expert_parallel") or {}).get("enabled"))
    zero = cfg.get("zero_optimization") or {}
    w = throughput.workload(
        req.model.spec,
        seq_len=req.seq_len,
        micro_batch=shape.micro_batch,
        grad_accum=req.global_batch // (topo.num_gpus * shape.micro_batch),
        world_size=topo.num_gpus,
        ep_size=shape.ep_size,
        autoep=autoep,
        activation_checkpointing=shape.activation_checkpointing,
        compiled=bool(perf.get("compileLayers")),
        fused_optimizer=bool(perf.get("fusedOptimizer")),
        persistence_threshold=int(
            zero.get("stage3_param_persistence_threshold", throughput.DEFAULT_PERSISTENCE_THRESHOLD)
        ),
        bytes_per_elem=precision_bytes(cfg),
        all_to_all_seconds=a2a if autoep and shape.ep_size > 1 else 0.0,
        data_parallel_gbps=data_parallel_gbps(topo),
    )
    return Candidate(shape, est.total, usable, throughput.predict(w, caps.name), workload=w)


def _largest_fitting(candidates: list[Candidate]) -> tuple[Candidate | None, Candidate | None]:
    """(the largest micro-batch that fits, the next larger one that does not) of one group."""
    fits = [c for c in candidates if c.rejected is None]
    best = max(fits, key=lambda c: c.shape.micro_batch, default=None)
    top = best.shape.micro_batch if best else 0
    over = [c for c in candidates if c.rejected and c.shape.micro_batch > top]
    return best, min(over, key=lambda c: c.shape.micro_batch, default=None)


def _full_topology(req: PlanRequest) -> ClusterTopology:
    """Every discovered GPU (the search picks nodes and GPUs from it)."""
    if req.cpu:
        raise FieldError(
            "device", "Auto sizing plans GPU jobs (its throughput model is of GPUs); give values"
        )
    if req.topology is None:
        raise FieldError("topology", "required on GPUs (no TopologyReport given)")
    if isinstance(req.topology, ClusterTopology):
        return req.topology
    reports: list[TopologyReport] = list(req.topology)
    return ClusterTopology.from_reports(reports)


def search(
    req: PlanRequest, auto: AutoFields, *, memory_only: bool = False
) -> tuple[list[Candidate], list[Candidate], str]:
    """Every shape the Auto fields allow on the discovered nodes: (fitting, rejected, GPU).
    ``memory_only``: skip the all-to-all estimate (the refusal's search over more nodes)."""
    full = _full_topology(req)
    pool = list(req.nodes or full.nodes)
    spec = req.model.spec
    fits: list[Candidate] = []
    rejected: list[Candidate] = []
    gpu = ""
    for n in _node_counts(len(pool)) if auto.nodes else [len(pool)]:
        nodes = tuple(pool[:n])
        local = min(int((full.node_of == full.nodes.index(x)).sum()) for x in nodes)
        fixed_g = req.gpus_per_node or local
        for g in _gpu_counts(local) if auto.gpus_per_node else [fixed_g]:
            base = replace(req, nodes=list(nodes), gpus_per_node=g)
            try:
                topo, caps = _cluster(base)
            except FieldError as exc:
                shape = Shape(nodes, g, 0, 0, False, False)
                rejected.append(Candidate(shape, 0, 0, rejected=str(exc)))
                continue
            gpu = gpu or caps.name
            world = topo.num_gpus
            if req.global_batch % world:
                why = f"globalBatch {req.global_batch} is not a multiple of the world size {world}"
                rejected.append(Candidate(Shape(nodes, g, 0, 0, False, False), 0, 0, rejected=why))
                continue
            per_rank = req.global_batch // world
            if auto.ep_size:
                eps = [d for d in _divisors(spec.num_experts) if world % d == 0]
                eps = eps if req.autoep else [1]
            else:
                try:
                    eps = [_ep_size(base, topo)[0]]
                except FieldError as exc:
                    shape = Shape(nodes, g, req.ep_size or 0, 0, False, False)
                    rejected.append(Candidate(shape, 0, 0, rejected=str(exc)))
                    continue
            micros = (
                _divisors(per_rank)
                if auto.micro_batch or req.micro_batch is None
                else [req.micro_batch]
            )
            ckpts = (
                [False, True]
                if auto.activation_checkpointing
                else [req.training.activation_checkpointing]
            )
            persists = [False, True] if auto.persistence and world > 1 else [False]
            for ep in eps:
                p = 2 if caps.supports_bf16 else 4
                dispatcher = req.dispatcher or "dedup"
                a2a = (
                    all_to_all_seconds(base, topo, ep, dispatcher, p)
                    if ep > 1 and not memory_only
                    else 0.0
                )
                for ck in ckpts:
                    for persistent in persists:
                        group = [
                            _evaluate(req, Shape(nodes, g, ep, m, ck, persistent), topo, caps, a2a)
                            for m in micros
                            if per_rank % m == 0
                        ]
                        if not group:
                            why = f"microBatch {req.micro_batch} does not divide {per_rank}"
                            shape = Shape(nodes, g, ep, req.micro_batch or 0, ck, persistent)
                            rejected.append(Candidate(shape, 0, 0, rejected=why))
                            continue
                        best, over = _largest_fitting(group)
                        if best is not None:
                            fits.append(best)
                        if over is not None:
                            rejected.append(over)
    # ties (a host-bound step does not shorten with more GPUs): fewer GPUs, no recompute, the
    # planner's persistence, less memory
    fits.sort(
        key=lambda c: (
            c.step.seconds if c.step else 0.0,
            c.shape.world_size,
            c.shape.activation_checkpointing,
            c.shape.persistent,
            c.peak_bytes,
        )
    )
    rejected.sort(key=lambda c: c.peak_bytes - c.usable_bytes if c.peak_bytes else 1 << 62)
    return fits, rejected, gpu


def size(req: PlanRequest, auto: AutoFields) -> Sizing:
    """The ranked shapes; raises :class:`NoShapeFits` when none fits (docstring above)."""
    fits, rejected, gpu = search(req, auto)
    if not fits:
        from .sizing_refusal import refusal

        raise NoShapeFits(refusal(req, auto, rejected, gpu))
    return Sizing(auto, gpu, tuple(fits), tuple(rejected))


def evaluate(req: PlanRequest) -> Candidate:
    """The memory estimate and predicted step time of the one shape ``req`` gives (every sizing
    field fixed; GPUs per node and micro-batch must be given): what the sweep benchmark sets
    beside its measurements."""
    if req.micro_batch is None:
        raise FieldError("microBatch", "evaluate needs a micro-batch")
    fits, rejected, _ = search(req, AutoFields())
    return (fits or rejected)[0]


def plan_sized(req: PlanRequest, auto: AutoFields) -> Plan:
    """The plan of the best candidate that also fits once placed (``build_plan``), with the
    sizing recorded in the document; raises :class:`NoShapeFits` when none does."""
    sizing = size(req, auto)
    last: DoesNotFit | None = None
    for chosen in sizing.candidates:
        try:
            plan = build_plan(shape_request(req, chosen.shape))
        except DoesNotFit as exc:  # the placed plan's dispatch buffer is larger (statistics)
            last = exc
            continue
        doc = {**plan.document, "sizing": sizing.record(chosen, plan)}
        check_plan(doc)
        return replace(plan, document=doc, sizing=sizing)
    raise NoShapeFits(f"no candidate fits once placed: {last}")


__all__ = [
    "SIZING_FIELDS",
    "AutoFields",
    "Candidate",
    "NoShapeFits",
    "Shape",
    "Sizing",
    "plan_sized",
    "search",
    "shape_request",
    "size",
]
