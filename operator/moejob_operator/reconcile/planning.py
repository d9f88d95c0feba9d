"""The plan stage: from the parsed spec and the nodes' TopologyReports to a MoEPlan v1 document,
through ``core.plan.build_plan``. It returns the parsed plan (``moe_contracts.plan.MoEPlan``: the
operator holds the contract's type from here on; ``.raw`` is the document the ConfigMap gets) or
raises (:mod:`.outcome`)
:class:`~.outcome.Refused` (``InvalidSpec`` naming the spec field a person has to change;
``InsufficientMemory``, ``PlanTooLarge``, ``PlanFailed``, ``RoutingStatsUnavailable``: the job
cannot run as asked) or :class:`~.outcome.NotYet` (too few nodes discovered, routing statistics
of an earlier job not there yet). Core errors carry their field (``core.errors.FieldError``);
:data:`SPEC_FIELD` maps it to the spec.
"""

from __future__ import annotations

import copy
import datetime as dt
import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from moe_contracts.plan import MoEPlan, parse_plan
from moe_contracts.progress import parse_progress
from moe_contracts.routing import RoutingStats, decode_configmap
from moe_contracts.topology import TopologyReport

from .. import admission
from .. import constants as C
from ..builders.common import JobRef
from ..core.errors import DocumentError, DoesNotFit, FieldError
from ..core.models import ResolvedModel, preset_hf_config, preset_names, spec_from_hf_config
from ..core.placement import strategies
from ..core.plan import PlanRequest, TrainingOptions, build_plan
from ..core.sizing import plan_sized
from ..spec import AUTO, JobSpec, RoutingStatsFrom, SpecError, parse_spec
from . import sizing
from .client import Client
from .outcome import NotYet, Refused

# The plan ConfigMap also carries the launched spec (admission.MAX_SPEC_BYTES); 1 MiB in all.
MAX_PLAN_BYTES = 800 * 1024

DISPATCHER = {"AutoEP": "autoep", "Dedup": "dedup", None: None}
REPLICAS: dict[Any, Any] = {"Auto": "auto", "None": None, None: None}

# the core's field (core.errors.FieldError.field) -> the spec field a person has to change;
# a core field not here (worldSize, deepspeed.*, nodes) is the plan's fault: PlanFailed
SPEC_FIELD = {
    "epSize": "spec.placement.expertParallelSize",
    "gpusPerNode": "spec.nodes.gpusPerNode",
    "routingStats": "spec.placement.routingStatsFrom",
    "globalBatch": "spec.training.globalBatch",
    "microBatch": "spec.training.microBatch",
    "strategy": "spec.placement.strategy",
    "dispatcher": "spec.placement.dispatcher",
    "replicas": "spec.placement.replicas",
    "placement": "spec.placement",
}


def resolve_model(spec: JobSpec) -> ResolvedModel | None:
    """The model of a preset or hfConfig; None for ``model.path`` (its inspection report
    gives it)."""
    m = spec.model
    try:
        if m.preset is not None:
            if m.preset not in preset_names():
                raise SpecError(
                    "spec.model.preset",
                    f"{m.preset!r} is not a known preset ({', '.join(preset_names())})",
                )
            cfg = preset_hf_config(m.preset)
            return ResolvedModel(
                spec=spec_from_hf_config(cfg, f"preset {m.preset}"),
                hf_config=cfg,
                preset=m.preset,
                path=None,
            )
        if m.hf_config is not None:
            cfg = dict(m.hf_config)
            return ResolvedModel(
                spec=spec_from_hf_config(cfg, "hfConfig"), hf_config=cfg, preset=None, path=None
            )
    except DocumentError as exc:
        if isinstance(exc, SpecError):
            raise
        raise SpecError(
            "spec.model.hfConfig" if m.hf_config is not None else "spec.model.preset", str(exc)
        ) from None
    return None  # model.path: the inspection pod reads it (reconcile/inspect.py)


def prevalidate(spec: JobSpec) -> ResolvedModel | None:
    """What can be checked without the cluster: the model resolves, EP divides its experts.
    Runs before discovery, so a bad spec creates no children at all (a model directory is
    checked once its inspection report is there)."""
    model = resolve_model(spec)
    sizing.check(spec)
    ep = spec.placement.expert_parallel_size
    if model is not None and isinstance(ep, int) and model.spec.num_experts % ep:
        raise SpecError(
            "spec.placement.expertParallelSize",
            f"{ep} does not divide the model's {model.spec.num_experts} experts",
        )
    return model


def accept(name: str, raw: Any, policy: admission.Policy) -> JobSpec:
    """The validate stage: the job's name and spec, as admission checks them under the
    operator's ``policy``, and :func:`prevalidate`. Raises ``Refused(InvalidSpec, field=...)``."""
    try:
        admission.check_job_name(name)
        spec = parse_spec(raw)
        admission.check(name, raw, spec, policy)
        prevalidate(spec)
    except SpecError as exc:
        raise Refused.invalid_spec(exc) from None
    return spec


def refusal(exc: DocumentError) -> Refused:
    """A core error of ``build_plan`` as the plan stage's refusal: ``InsufficientMemory`` when
    the job does not fit, ``InvalidSpec`` when its field is the user's (:data:`SPEC_FIELD`),
    else ``PlanFailed``."""
    if isinstance(exc, DoesNotFit):
        return Refused(C.R_INSUFFICIENT_MEMORY, str(exc))
    if isinstance(exc, FieldError) and exc.field in SPEC_FIELD:
        return Refused.invalid_spec(SpecError(SPEC_FIELD[exc.field], exc.detail))
    return Refused(C.R_PLAN_FAILED, str(exc))


# Routing statistics of an earlier job (docs/trainer.md, "Routing statistics hand-off"); the
# ConfigMap codec is the contract's (moe_contracts.routing).
# How long a job waits, counted from its creation, for statistics that are not there yet:
SOURCE_MISSING_WAIT_SECONDS = 15 * 60  # no such source job (a typo?) / configMapName never filled
SOURCE_ACTIVE_WAIT_SECONDS = 24 * 3600  # the source job is still pending or training
SOURCE_SUCCEEDED_GRACE_SECONDS = 60  # the trainer publishes before it exits: a little slack


def read_routing_stats(
    client: Client, job: JobRef, spec: JobSpec, now: dt.datetime | None = None
) -> RoutingStats | None:
    src = spec.placement.routing_stats_from
    if src is None:
        return None
    where = f"{job.namespace}/{src.config_map}"
    try:
        stats = decode_configmap(client.get_configmap(job.namespace, src.config_map))
    except DocumentError as exc:
        raise SpecError("spec.placement.routingStatsFrom", f"ConfigMap {where}: {exc}") from None
    if stats is None:
        raise _no_stats_yet(client, job, src, now or dt.datetime.now(dt.UTC))
    return stats


def _cond(obj: dict[str, Any] | None, ctype: str) -> dict[str, Any]:
    conds = ((obj or {}).get("status") or {}).get("conditions")
    for c in conds if isinstance(conds, list) else ():
        if isinstance(c, dict) and c.get("type") == ctype:  # another job's status: not trusted
            return c
    return {}


def _age(stamp: str | None, now: dt.datetime) -> float:
    if not stamp:
        return 0.0
    t = dt.datetime.fromisoformat(stamp)
    return (now - t).total_seconds()


def _source_progress_note(client: Client, namespace: str, source: str) -> str:
    """What the source trainer said about publishing (``routingStats.message`` of its progress)."""
    cm = client.get_configmap(namespace, f"{source}-progress") or {}
    try:
        prog = parse_progress((cm.get("data") or {}).get(C.PROGRESS_KEY) or "{}")
    except DocumentError:
        return ""
    msg = (prog.routing_stats or {}).get("message")
    return f"; its trainer reported: {msg}" if msg else ""


def _no_stats_yet(
    client: Client, job: JobRef, src: RoutingStatsFrom, now: dt.datetime
) -> Exception:
    """No statistics in the ConfigMap: NotYet while they may still come (bounded), Refused when
    they never will (source job Failed, or Succeeded without publishing)."""
    field = "spec.placement.routingStatsFrom"
    where = f"ConfigMap {job.namespace}/{src.config_map}"
    limit = SOURCE_MISSING_WAIT_SECONDS
    if src.job_name is None:
        msg = f"{where} has no {C.ROUTING_STATS_KEY} yet ({field}.configMapName)"
    else:
        source = client.get_job(job.namespace, src.job_name)
        failed, succeeded = _cond(source, C.COND_FAILED), _cond(source, C.COND_SUCCEEDED)
        if source is None:
            msg = f"source job {src.job_name} ({field}.jobName) does not exist (yet)"
        elif failed.get("status") == "True":
            return Refused(
                C.R_ROUTING_STATS_UNAVAILABLE,
                f"source job {src.job_name} failed ({failed.get('reason')}: "
                f"{failed.get('message')}) and will never publish routing statistics; "
                f"use another job, or {field}.configMapName with a ConfigMap you fill",
            )
        elif succeeded.get("status") == "True":
            done = (source.get("status") or {}).get("completionTime") or succeeded.get(
                "lastTransitionTime"
            )
            if _age(done, now) > SOURCE_SUCCEEDED_GRACE_SECONDS:
                return Refused(
                    C.R_ROUTING_STATS_UNAVAILABLE,
                    f"source job {src.job_name} succeeded but {where} holds no routing "
                    f"statistics{_source_progress_note(client, job.namespace, src.job_name)}; "
                    f"the trainer also leaves routing_stats.json in its checkpoint dir "
                    f"(put it in a ConfigMap and use {field}.configMapName)",
                )
            return NotYet(
                C.R_ROUTING_STATS_UNAVAILABLE,
                f"source job {src.job_name} succeeded; waiting for {where}",
                5.0,
            )
        else:
            phase = (source.get("status") or {}).get("phase") or "Pending"
            msg = (
                f"waiting for source job {src.job_name} (phase {phase}) to publish its routing "
                f"statistics to {where} (at its first checkpoint or at the end)"
            )
            limit = SOURCE_ACTIVE_WAIT_SECONDS
    me = client.get_job(job.namespace, job.name) or {}
    waited = _age((me.get("metadata") or {}).get("creationTimestamp"), now)
    if waited > limit:
        return Refused(
            C.R_ROUTING_STATS_UNAVAILABLE, f"{msg}; gave up after {int(waited)} s (limit {limit} s)"
        )
    return NotYet(
        C.R_ROUTING_STATS_UNAVAILABLE, f"{msg}; waited {int(waited)} s of {limit} s", 30.0
    )


def stats_source(spec: JobSpec, stats: RoutingStats | None) -> dict[str, Any] | None:
    """``placement.routingStatsFrom`` of the plan: where the statistics came from (a note for
    people)."""
    src = spec.placement.routing_stats_from
    if src is None or stats is None:
        return None
    return {
        "job": src.job_name,
        "configMap": src.config_map,
        "tokens": int(stats.tokens),
        "steps": int(stats.steps),
        "numLayers": int(stats.num_layers),
        "numExperts": int(stats.num_experts),
    }


class PlanMemo:
    """Plans are pure functions of (spec, nodes, reports, routing stats, inputs): jobs with the
    same inputs (sweeps, retries, many small jobs at once) share one computation; only ``job``
    differs. The last ``size`` plan documents by input hash, thread-safe. The Controller owns one
    (runtime state lives there) and every pass plans through it."""

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self._docs: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> dict[str, Any] | None:
        """A copy of the document stored under ``key`` (None: none)."""
        with self._lock:
            hit = self._docs.get(key)
            if hit is None:
                return None
            self._docs.move_to_end(key)
        return copy.deepcopy(hit)

    def put(self, key: str, doc: dict[str, Any]) -> None:
        with self._lock:
            self._docs[key] = copy.deepcopy(doc)
            while len(self._docs) > self.size:
                self._docs.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._docs)


def _memo_key(
    spec: JobSpec,
    nodes: list[str],
    reports: dict[str, TopologyReport],
    stats_raw: str | None,
    cpu_memory_bytes: int,
) -> str:
    h = hashlib.sha256()
    h.update(spec.immutable_hash().encode())
    for n in nodes:
        h.update(n.encode())
        h.update(reports[n].model_dump_json(exclude={"collectedAt", "collected_at"}).encode())
    h.update((stats_raw or "").encode())
    h.update(str(cpu_memory_bytes).encode())
    return h.hexdigest()


def cpu_memory_per_process(spec: JobSpec, nodes: list[dict[str, Any]], names: list[str]) -> int:
    """CPU mode: the memory one trainer process may use, so that the plan's memory check has a
    limit (0: unknown, no check). The container's memory limit, else the smallest planned node's
    allocatable memory, shared by the pod's ``gpusPerNode`` processes."""
    from ..admission import parse_quantity

    limit = (spec.resources.limits or {}).get("memory")
    if limit is not None:
        try:
            total = int(parse_quantity(limit))
        except ValueError:
            total = 0
    else:
        sizes = []
        for node in nodes:
            if node["metadata"]["name"] in names:
                raw = ((node.get("status") or {}).get("allocatable") or {}).get("memory")
                try:
                    sizes.append(int(parse_quantity(raw)) if raw is not None else 0)
                except ValueError:
                    sizes.append(0)
        total = min(sizes) if sizes and all(sizes) else 0
    return total // int(spec.nodes.gpus_per_node)  # CPU mode: never Auto (sizing.check)


@dataclass(frozen=True)
class Inputs:
    """What the stages before planning found: the inspected model of ``spec.model.path`` (and
    its content hash) and the plan's ``training.data`` when a prepare pod made it."""

    model: ResolvedModel | None = None
    content_hash: str | None = None
    tokenizer: str | None = None  # the model directory, when it holds a tokenizer
    data: dict[str, Any] | None = None

    def key(self) -> str:
        return repr((self.content_hash, self.tokenizer, sorted((self.data or {}).items())))


def make_plan(
    client: Client,
    job: JobRef,
    spec: JobSpec,
    reports: dict[str, TopologyReport],
    cpu_memory_bytes: int = 0,
    inputs: Inputs | None = None,
    memo: PlanMemo | None = None,
) -> MoEPlan:
    """The plan stage: the MoEPlan v1 for ``spec`` on the first ``nodes.count`` discovered
    nodes, checked complete by the contract. Raises :class:`NotYet` or :class:`Refused` (module
    docstring). ``memo``: reuse (and keep) plans of the same inputs (the Controller's)."""
    try:
        doc = _plan_document(client, job, spec, reports, cpu_memory_bytes, inputs or Inputs(), memo)
    except SpecError as exc:
        raise Refused.invalid_spec(exc) from None
    try:
        plan = parse_plan(doc, complete=True)
        # the ConfigMap's text, serialised once here (memoised on the plan) for the size check
        size = len(plan.sorted_json())
    except DocumentError as exc:  # the planner wrote a plan its own contract refuses: a bug
        raise Refused(C.R_PLAN_FAILED, f"the planner's plan does not parse: {exc}") from None
    if size > MAX_PLAN_BYTES:
        raise Refused(
            C.R_PLAN_TOO_LARGE,
            f"the plan is {size} bytes; a ConfigMap holds at most "
            f"{MAX_PLAN_BYTES} (fewer nodes, experts or layers)",
        )
    return plan


def plan_data(spec: JobSpec, inputs: Inputs) -> dict[str, Any]:
    """The plan's ``training.data``: prepared shards, text or token files, or synthetic, and the
    order to read them in (written only when not the default, shuffled)."""
    d = spec.data
    out: dict[str, Any]
    if inputs.data is not None:
        out = dict(inputs.data)
    elif d.kind == "Tokenized":
        out = {"kind": "tokens", "path": d.path}
    else:
        out = {"kind": d.kind.lower(), "path": d.path}
        if d.kind == "Text" and inputs.tokenizer:
            out["tokenizer"] = inputs.tokenizer
    if d.order == "Sequential":
        out["order"] = "sequential"
    return out


def output_section(spec: JobSpec) -> dict[str, Any] | None:
    """The plan's ``output`` (the trainer exports there): ``spec.output`` as the workers see it."""
    o = spec.output
    if o is None:
        return None
    out: dict[str, Any] = {"path": o.path}
    if o.every_checkpoints is not None:
        out["everyCheckpoints"] = o.every_checkpoints
    return out


def _plan_document(
    client: Client,
    job: JobRef,
    spec: JobSpec,
    reports: dict[str, TopologyReport],
    cpu_memory_bytes: int,
    inputs: Inputs,
    memo: PlanMemo | None,
) -> dict[str, Any]:
    count = spec.nodes.count
    # count Auto: every discovered candidate is the sizing's to choose from
    nodes = list(reports) if count == AUTO else list(reports)[:count]
    if count != AUTO and len(nodes) < count:
        raise NotYet(
            C.R_NO_CANDIDATE_NODES,
            f"{len(nodes)} node(s) discovered, spec.nodes.count is {spec.nodes.count}",
            15.0,
        )
    stats = read_routing_stats(client, job, spec)
    stats_digest = (
        None
        if stats is None
        else hashlib.sha256(
            stats.load.tobytes()
            + stats.coact.tobytes()
            + repr((stats.top_k, stats.tokens)).encode()
        ).hexdigest()
    )
    key = _memo_key(spec, nodes, reports, f"{stats_digest}|{inputs.key()}", cpu_memory_bytes)
    hit = memo.get(key) if memo is not None else None
    if hit is not None:
        doc = {**hit, "job": {"namespace": job.namespace, "name": job.name}}
    else:
        doc = _make_plan(job, spec, nodes, reports, stats, cpu_memory_bytes, inputs)
        if memo is not None:
            memo.put(key, doc)
    source = stats_source(spec, stats)
    if source is not None and isinstance(doc.get("placement"), dict):
        doc["placement"]["routingStatsFrom"] = source
    if inputs.content_hash is not None:
        doc["model"]["contentHash"] = inputs.content_hash
    output = output_section(spec)
    if output is not None:
        doc["output"] = output
    return doc


def plan_request(
    job: JobRef,
    spec: JobSpec,
    nodes: list[str],
    reports: dict[str, TopologyReport],
    stats: RoutingStats | None,
    cpu_memory_bytes: int,
    inputs: Inputs | None = None,
) -> PlanRequest:
    """The core's request for ``spec`` on ``nodes``: where spec fields become planner inputs
    (:data:`SPEC_FIELD` maps the planner's errors back)."""
    inputs = inputs or Inputs()
    model = inputs.model or resolve_model(spec)
    if model is None:
        raise SpecError("spec.model.path", "no inspection report of the model directory yet")
    t = spec.training
    opts = TrainingOptions(
        steps=t.steps,
        lr=t.lr,
        warmup_steps=t.warmup_steps,
        checkpoint_every_steps=spec.checkpoint.every_steps,
        seed=t.seed,
        data=plan_data(spec, inputs),
        activation_checkpointing=t.activation_checkpointing == "Enabled",
    )
    cpu = spec.device == "CPU"
    gpus, ep = spec.nodes.gpus_per_node, spec.placement.expert_parallel_size
    return PlanRequest(
        job.name,
        job.namespace,
        model,
        None if cpu else [reports[n] for n in nodes],
        nodes=nodes,
        gpus_per_node=None if cpu or gpus == AUTO else gpus,
        strategy=strategies.BY_SPEC_NAME[spec.placement.strategy].name,
        routing_stats=stats,
        global_batch=t.global_batch,
        micro_batch=None if t.micro_batch == AUTO else t.micro_batch,
        seq_len=t.seq_len,
        ep_size=ep if isinstance(ep, int) else None,
        device="cpu" if cpu else "cuda",
        procs_per_node=gpus if isinstance(gpus, int) else 1,
        cpu_memory_bytes=cpu_memory_bytes,
        training=opts,
        ds_overrides=spec.deepspeed_overrides,
        dispatcher=DISPATCHER[spec.placement.dispatcher],
        replicas=REPLICAS.get(spec.placement.replicas, spec.placement.replicas),
        max_expert_memory_overhead=spec.placement.overhead_percent,
    )


def _make_plan(
    job: JobRef,
    spec: JobSpec,
    nodes: list[str],
    reports: dict[str, TopologyReport],
    stats: RoutingStats | None,
    cpu_memory_bytes: int,
    inputs: Inputs,
) -> dict[str, Any]:
    request = plan_request(job, spec, nodes, reports, stats, cpu_memory_bytes, inputs)
    auto = sizing.auto_fields(spec)
    try:
        plan = plan_sized(request, auto) if auto.any else build_plan(request)
    except DocumentError as exc:
        raise refusal(exc) from None
    except (TypeError, AttributeError, ValueError) as exc:
        if not spec.deepspeed_overrides:
            raise
        # the core reads the merged DeepSpeed config: a wrong type deep in an override lands here
        raise SpecError(
            "spec.deepspeedOverrides",
            f"a value has the wrong type for the DeepSpeed config ({type(exc).__name__}: {exc})",
        ) from None
    return plan.document


def summary(plan: MoEPlan) -> dict[str, Any]:
    """``status.plan``: what a person wants to see about the plan (integers and strings)."""
    pl, mem = plan.placement, plan.memory
    q = (pl.quality if pl is not None else None) or {}
    # strategy: the layout the plan has (a strategy that needed routing statistics and had none
    # fell back to contiguous: requestedStrategy then says what the spec asked for)
    fell_back = pl.fell_back_to if pl is not None else None
    out = {
        "worldSize": plan.world_size,
        "epSize": plan.ep_size,
        "nodes": plan.node_names,
        "strategy": fell_back or (pl.strategy if pl is not None else None),
        "requestedStrategy": pl.strategy if pl is not None and fell_back else None,
        "device": plan.device,
        "estimatedPeakBytesPerGpu": mem.estimated_peak_bytes if mem is not None else None,
        "gpuMemoryBytes": mem.gpu_memory_bytes if mem is not None else None,
        "fits": mem.fits if mem is not None else None,
    }
    if "crossGroupVsContiguous" in q:
        out["crossGroupVsContiguous"] = f"{float(q['crossGroupVsContiguous']):.3f}"
    if "maxMeanLoad" in q:
        out["maxMeanLoad"] = f"{float(q['maxMeanLoad']):.3f}"
    src = pl.routing_stats_from if pl is not None else None
    if src:
        out["routingStatsFrom"] = src.get("job") or src.get("configMap")
    if plan.sizing is not None:
        out["sized"] = sizing.describe(plan.sizing)
    return {k: v for k, v in out.items() if v is not None}


def describe(s: dict[str, Any]) -> str:
    gib = (s.get("estimatedPeakBytesPerGpu") or 0) / 2**30
    asked = (
        f" ({s['requestedStrategy']} asked, no routing statistics)"
        if s.get("requestedStrategy")
        else ""
    )
    return (
        f"{s.get('strategy')} placement{asked} on {', '.join(s.get('nodes', []))}: world size "
        f"{s.get('worldSize')}, EP size {s.get('epSize')}, cross-group traffic "
        f"{s.get('crossGroupVsContiguous', '?')}x contiguous, est. peak {gib:.2f} GiB per "
        f"{'process' if s.get('device') == 'cpu' else 'GPU'}"
        + (f"; {s['sized']}" if s.get("sized") else "")
    )
