"""The plan stage: from the parsed spec and the nodes' TopologyReports to a MoEPlan v1 document,
through ``core.plan.build_plan``. Core errors become :class:`SpecError` (the user's input is
wrong: ``InvalidSpec``), :class:`Refused` (the job cannot run as asked, e.g. does not fit in
memory) or :class:`NotYet` (routing statistics of an earlier job not there yet).
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import threading
from collections import OrderedDict
from typing import Any

from .. import constants as C
from ..builders.common import JobRef
from ..core.errors import DocumentError
from ..core.models import ResolvedModel, preset_hf_config, preset_names, spec_from_hf_config
from ..core.plan import TrainingOptions, build_plan
from ..core.routing import parse_routing_stats
from ..core.topology import TopologyReport
from ..spec import JobSpec, SpecError

STRATEGY = {"Contiguous": "contiguous", "RoundRobin": "round_robin", "Balanced": "balanced",
            "TopologyAware": "topology_aware"}

# core error prefix -> the spec field a person has to change
_FIELD_OF = {
    "epSize": "spec.placement.expertParallelSize",
    "gpusPerNode": "spec.nodes.gpusPerNode",
    "routingStats": "spec.placement.routingStatsFrom",
    "hfConfig": "spec.model.hfConfig",
    "global_batch": "spec.training.globalBatch",
    "globalBatch": "spec.training.globalBatch",
    "micro_batch": "spec.training.microBatch",
    "microBatch": "spec.training.microBatch",
    "overrides": "spec.deepspeedOverrides",
    "deepspeedOverrides": "spec.deepspeedOverrides",
    "strategy": "spec.placement.strategy",
    "placement": "spec.placement",
    "seqLen": "spec.training.seqLen",
}


class Refused(Exception):
    """The job cannot run as specified (permanent); ``reason`` is the condition reason."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class NotYet(Exception):
    """A precondition is missing but may appear (temporary)."""

    def __init__(self, reason: str, message: str, retry_seconds: float = 15.0):
        super().__init__(message)
        self.reason = reason
        self.retry_seconds = retry_seconds


def resolve_model(spec: JobSpec) -> ResolvedModel:
    m = spec.model
    try:
        if m.preset is not None:
            if m.preset not in preset_names():
                raise SpecError("spec.model.preset", f"{m.preset!r} is not a known preset "
                                f"({', '.join(preset_names())})")
            cfg = preset_hf_config(m.preset)
            return ResolvedModel(spec=spec_from_hf_config(cfg, f"preset {m.preset}"),
                                 hf_config=cfg, preset=m.preset, path=None)
        if m.hf_config is not None:
            cfg = dict(m.hf_config)
            return ResolvedModel(spec=spec_from_hf_config(cfg, "hfConfig"), hf_config=cfg,
                                 preset=None, path=None)
    except DocumentError as exc:
        if isinstance(exc, SpecError):
            raise
        raise SpecError("spec.model.hfConfig" if m.hf_config is not None else "spec.model.preset",
                        str(exc)) from None
    raise SpecError("spec.model.path", f"{m.path!r}: the operator plans from a preset or hfConfig; "
                    "a model directory is only readable inside the worker")


def prevalidate(spec: JobSpec) -> ResolvedModel:
    """What can be checked without the cluster: the model resolves, EP divides its experts.
    Runs before discovery, so a bad spec creates no children at all."""
    model = resolve_model(spec)
    ep = spec.placement.expert_parallel_size
    if ep is not None and model.spec.num_experts % ep:
        raise SpecError("spec.placement.expertParallelSize",
                        f"{ep} does not divide the model's {model.spec.num_experts} experts")
    return model


def _to_spec_error(exc: DocumentError) -> Exception:
    text = str(exc)
    if text.startswith("memory:"):
        return Refused(C.R_INSUFFICIENT_MEMORY, text)
    head = re.split(r"[:\s\[.]", text, maxsplit=1)[0]
    field = _FIELD_OF.get(head)
    if field is not None:
        return SpecError(field, text.split(":", 1)[1].strip() if ":" in text else text)
    return Refused(C.R_PLAN_FAILED, text)


def read_routing_stats(client, job: JobRef, spec: JobSpec):
    src = spec.placement.routing_stats_from
    if src is None:
        return None
    cm = client.get_configmap(job.namespace, src.config_map)
    raw = ((cm or {}).get("data") or {}).get(C.ROUTING_STATS_KEY)
    if not raw:
        raise NotYet(C.R_ROUTING_STATS_UNAVAILABLE,
                     f"ConfigMap {job.namespace}/{src.config_map} has no {C.ROUTING_STATS_KEY} yet "
                     "(spec.placement.routingStatsFrom)", 30.0)
    try:
        return parse_routing_stats(json.loads(raw))
    except (ValueError, DocumentError) as exc:
        raise SpecError("spec.placement.routingStatsFrom",
                        f"ConfigMap {src.config_map}: {exc}") from None


# Plans are pure functions of (spec, nodes, reports, routing stats): jobs with the same inputs
# (sweeps, retries, many small jobs at once) share one computation. Only ``job`` differs.
_MEMO: OrderedDict[str, dict[str, Any]] = OrderedDict()
_MEMO_SIZE = 64
_memo_lock = threading.Lock()


def _memo_key(spec: JobSpec, nodes: list[str], reports: dict[str, TopologyReport],
              stats_raw: str | None, cpu_memory_bytes: int) -> str:
    h = hashlib.sha256()
    h.update(spec.immutable_hash().encode())
    for n in nodes:
        h.update(n.encode())
        h.update(reports[n].model_dump_json(exclude={"collectedAt", "collected_at"}).encode())
    h.update((stats_raw or "").encode())
    h.update(str(cpu_memory_bytes).encode())
    return h.hexdigest()


def make_plan(client, job: JobRef, spec: JobSpec, reports: dict[str, TopologyReport],
              cpu_memory_bytes: int = 0) -> dict[str, Any]:
    """The MoEPlan v1 document for ``spec`` on the first ``nodes.count`` discovered nodes."""
    nodes = list(reports)[: spec.nodes.count]
    if len(nodes) < spec.nodes.count:
        raise NotYet(C.R_NO_CANDIDATE_NODES, f"{len(nodes)} node(s) discovered, "
                     f"spec.nodes.count is {spec.nodes.count}", 15.0)
    stats = read_routing_stats(client, job, spec)
    stats_digest = None if stats is None else hashlib.sha256(
        stats.load.tobytes() + stats.coact.tobytes() + repr((stats.top_k, stats.tokens)).encode()).hexdigest()
    key = _memo_key(spec, nodes, reports, stats_digest, cpu_memory_bytes)
    with _memo_lock:
        hit = _MEMO.get(key)
        if hit is not None:
            _MEMO.move_to_end(key)
    if hit is not None:
        return {**copy.deepcopy(hit), "job": {"namespace": job.namespace, "name": job.name}}
    doc = _make_plan(job, spec, nodes, reports, stats, cpu_memory_bytes)
    with _memo_lock:
        _MEMO[key] = copy.deepcopy(doc)
        while len(_MEMO) > _MEMO_SIZE:
            _MEMO.popitem(last=False)
    return doc


def _make_plan(job: JobRef, spec: JobSpec, nodes: list[str], reports: dict[str, TopologyReport],
               stats, cpu_memory_bytes: int) -> dict[str, Any]:
    model = resolve_model(spec)
    t = spec.training
    opts = TrainingOptions(steps=t.steps, lr=t.lr, warmup_steps=t.warmup_steps,
                           checkpoint_every_steps=spec.checkpoint.every_steps, seed=t.seed,
                           data={"kind": spec.data.kind.lower(), "path": spec.data.path})
    cpu = spec.device == "CPU"
    try:
        plan = build_plan(
            job.name, job.namespace, model, None if cpu else [reports[n] for n in nodes],
            nodes=nodes, gpus_per_node=None if cpu else spec.nodes.gpus_per_node,
            strategy=STRATEGY[spec.placement.strategy], routing_stats=stats,
            global_batch=t.global_batch, micro_batch=t.micro_batch, seq_len=t.seq_len,
            ep_size=spec.placement.expert_parallel_size, device="cpu" if cpu else "cuda",
            procs_per_node=spec.nodes.gpus_per_node, cpu_memory_bytes=cpu_memory_bytes,
            training=opts, ds_overrides=spec.deepspeed_overrides)
    except DocumentError as exc:
        raise _to_spec_error(exc) from None
    return plan.document


def rank2node(plan: dict[str, Any]) -> list[str]:
    """``rank2node[node_rank]`` from the plan's rank table."""
    out: dict[int, str] = {}
    for r in plan["ranks"]:
        out.setdefault(int(r["nodeRank"]), r["node"])
    return [out[i] for i in range(len(out))]


def summary(plan: dict[str, Any]) -> dict[str, Any]:
    """``status.plan``: what a person wants to see about the plan (integers and strings)."""
    q = (plan.get("placement") or {}).get("quality") or {}
    mem = plan.get("memory") or {}
    out = {"worldSize": plan.get("worldSize"), "epSize": plan.get("epSize"),
           "nodes": rank2node(plan), "strategy": (plan.get("placement") or {}).get("strategy"),
           "device": plan.get("device"),
           "estimatedPeakBytesPerGpu": mem.get("estimatedPeakBytes"),
           "gpuMemoryBytes": mem.get("gpuMemoryBytes"), "fits": mem.get("fits")}
    if "crossGroupVsContiguous" in q:
        out["crossGroupVsContiguous"] = f"{float(q['crossGroupVsContiguous']):.3f}"
    if "maxMeanLoad" in q:
        out["maxMeanLoad"] = f"{float(q['maxMeanLoad']):.3f}"
    return {k: v for k, v in out.items() if v is not None}


def describe(s: dict[str, Any]) -> str:
    gib = (s.get("estimatedPeakBytesPerGpu") or 0) / 2**30
    return (f"{s.get('strategy')} placement on {', '.join(s.get('nodes', []))}: world size "
            f"{s.get('worldSize')}, EP size {s.get('epSize')}, cross-group traffic "
            f"{s.get('crossGroupVsContiguous', '?')}x contiguous, est. peak {gib:.2f} GiB per "
            f"{'process' if s.get('device') == 'cpu' else 'GPU'}")
