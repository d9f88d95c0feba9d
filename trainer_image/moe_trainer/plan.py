"""Reader for the `MoEPlan` v1 document (docs/contracts.md), the trainer's side of the contract.

The trainer never imports operator code: this module parses the JSON the planning core wrote
into frozen dataclasses, checks the invariants the trainer relies on, and raises `PlanError`
(naming the field path and the offending value) for anything else. A bad plan is permanent:
the entry point maps `PlanError` to exit code 78.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PLAN_KIND = "MoEPlan"
PLAN_VERSION = 1
DEFAULT_PLAN_PATH = "/etc/moe/plan.json"

BALANCE_MODES = ("per_layer_aux", "global_aux", "none")
MOE_IMPLS = ("hf", "grouped")
DATA_KINDS = ("text", "tokens", "synthetic", "corpus")
DISPATCHERS = ("autoep", "dedup")


class PlanError(ValueError):
    """The plan document is missing, malformed, or violates an invariant."""


@dataclass(frozen=True)
class RankSpec:
    rank: int
    node: str
    node_rank: int
    local_rank: int
    gpu: int | None
    group: int | None = None     # NVLink group (CPU: node) index; None in plans written before it


@dataclass(frozen=True)
class Placement:
    strategy: str
    num_layers: int
    num_experts: int
    ep_size: int
    permutation: tuple[tuple[int, ...], ...]   # permutation[layer][slot] = original expert
    dispatcher: str = "autoep"                 # "autoep" (DeepSpeed's all-to-all) | "dedup" (dedup_ep)

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ep_size

    def experts_of_ep_rank(self, layer: int, ep_rank: int) -> tuple[int, ...]:
        """Original expert ids that EP rank `ep_rank` holds in `layer`, in local order."""
        n = self.experts_per_rank
        return self.permutation[layer][ep_rank * n:(ep_rank + 1) * n]

    def is_identity(self) -> bool:
        return all(list(row) == list(range(self.num_experts)) for row in self.permutation)


@dataclass(frozen=True)
class BalanceSpec:
    mode: str = "per_layer_aux"
    coef: float = 0.01


@dataclass(frozen=True)
class DataSpec:
    kind: str = "synthetic"
    path: str | None = None
    tokenizer: str | None = None    # local HF tokenizer path; None = byte-level


PERF_KEYS = ("compileLayers", "fusedLoss", "fusedOptimizer", "zeroLeafModules", "lossChunkTokens",
             "reasons")


@dataclass(frozen=True)
class PerfSpec:
    compile_layers: bool = False
    fused_loss: bool = False
    fused_optimizer: bool = False
    zero_leaf_modules: tuple[str, ...] = ()
    loss_chunk_tokens: int = 8192
    reasons: tuple[str, ...] = field(default=(), compare=False)

    @property
    def any(self) -> bool:
        return self.compile_layers or self.fused_loss or self.fused_optimizer or bool(self.zero_leaf_modules)


def parse_perf(doc, path: str = "training.performance") -> PerfSpec:
    """The `training.performance` object -> PerfSpec (absent: everything off)."""
    if doc is None:
        return PerfSpec()
    if not isinstance(doc, dict):
        raise PlanError(f"{path}: expected an object, got {type(doc).__name__}")
    unknown = sorted(set(doc) - set(PERF_KEYS))
    if unknown:
        raise PlanError(f"{path}: unknown keys {unknown} (known: {list(PERF_KEYS)})")
    for key in ("compileLayers", "fusedLoss", "fusedOptimizer"):
        if not isinstance(doc.get(key, False), bool):
            raise PlanError(f"{path}.{key}: {doc[key]!r} is not true/false")
    leaves = doc.get("zeroLeafModules", [])
    if not isinstance(leaves, list) or not all(isinstance(x, str) and x for x in leaves):
        raise PlanError(f"{path}.zeroLeafModules: {leaves!r} is not a list of class names")
    chunk = doc.get("lossChunkTokens", PerfSpec.loss_chunk_tokens)
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise PlanError(f"{path}.lossChunkTokens: {chunk!r} must be an integer >= 1")
    return PerfSpec(compile_layers=doc.get("compileLayers", False), fused_loss=doc.get("fusedLoss", False),
                    fused_optimizer=doc.get("fusedOptimizer", False), zero_leaf_modules=tuple(leaves),
                    loss_chunk_tokens=chunk, reasons=tuple(str(r) for r in doc.get("reasons", [])))


@dataclass(frozen=True)
class TrainingSpec:
    steps: int = 20
    seq_len: int = 128
    micro_batch: int = 2
    grad_accum: int = 1
    lr: float = 1e-3
    warmup_steps: int = 2
    min_lr_ratio: float = 0.1
    checkpoint_every_steps: int = 5
    seed: int = 1234
    grad_clip: float = 1.0
    moe_impl: str = "hf"
    balance: BalanceSpec = field(default_factory=BalanceSpec)
    data: DataSpec = field(default_factory=DataSpec)
    checkpoint_dir: str | None = None
    dead_expert_steps: int = 20
    dead_expert_fraction: float = 0.1
    router_logit_limit: float = 30.0
    straggler_factor: float = 2.0
    straggler_steps: int = 5
    fragmentation_limit: float = 0.3
    routing_sample_tokens: int = 65536     # token expert sets kept for exact placement scoring
    performance: PerfSpec = field(default_factory=PerfSpec)


@dataclass(frozen=True)
class ModelSpec:
    family: str
    preset: str | None
    path: str | None
    hf_config: dict[str, Any] | None


@dataclass(frozen=True)
class MoEPlan:
    job_namespace: str
    job_name: str
    model: ModelSpec
    world_size: int
    ep_size: int
    ranks: tuple[RankSpec, ...]
    placement: Placement | None
    deepspeed: dict[str, Any]
    training: TrainingSpec
    raw: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)

    @property
    def autoep_enabled(self) -> bool:
        ep = self.deepspeed.get("expert_parallel") or {}
        return bool(ep.get("enabled", False))


def _get(doc: dict, key: str, path: str, types: type | tuple, required: bool = True, default=None):
    if not isinstance(doc, dict):
        raise PlanError(f"{path or '<root>'}: expected an object, got {type(doc).__name__}")
    if key not in doc or doc[key] is None:
        if required:
            raise PlanError(f"{path + '.' if path else ''}{key}: required field is missing")
        return default
    value = doc[key]
    # bool is an int subclass; refuse it where a number is asked for.
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise PlanError(f"{path + '.' if path else ''}{key}: {value!r} is not a {_tname(types)}")
    if not isinstance(value, types):
        raise PlanError(f"{path + '.' if path else ''}{key}: {value!r} is not a {_tname(types)}")
    return value


def _tname(types) -> str:
    if isinstance(types, tuple):
        return " or ".join(t.__name__ for t in types)
    return types.__name__


def _positive(value: int, path: str) -> int:
    if value < 1:
        raise PlanError(f"{path}: {value!r} must be >= 1")
    return value


def _parse_placement(doc: dict) -> Placement:
    p = "placement"
    num_layers = _positive(_get(doc, "numLayers", p, int), f"{p}.numLayers")
    num_experts = _positive(_get(doc, "numExperts", p, int), f"{p}.numExperts")
    ep_size = _positive(_get(doc, "epSize", p, int), f"{p}.epSize")
    if num_experts % ep_size:
        raise PlanError(f"{p}.epSize: {ep_size} does not divide numExperts={num_experts}")
    perm = _get(doc, "permutation", p, list)
    if len(perm) != num_layers:
        raise PlanError(f"{p}.permutation: has {len(perm)} rows, numLayers is {num_layers}")
    rows = []
    for layer, row in enumerate(perm):
        if not isinstance(row, list) or sorted(row) != list(range(num_experts)) \
                or any(isinstance(x, bool) for x in row):
            raise PlanError(f"{p}.permutation[{layer}]: {row!r} is not a permutation of 0..{num_experts - 1}")
        rows.append(tuple(row))
    dispatcher = _get(doc, "dispatcher", p, str, required=False, default="autoep")
    if dispatcher not in DISPATCHERS:
        raise PlanError(f"{p}.dispatcher: {dispatcher!r} is not one of {list(DISPATCHERS)}")
    return Placement(strategy=str(doc.get("strategy", "unknown")), num_layers=num_layers,
                     num_experts=num_experts, ep_size=ep_size, permutation=tuple(rows), dispatcher=dispatcher)


def _parse_training(doc: dict | None) -> TrainingSpec:
    doc = doc or {}
    p = "training"
    d = TrainingSpec()
    balance_doc = _get(doc, "balance", p, dict, required=False, default={})
    mode = _get(balance_doc, "mode", f"{p}.balance", str, required=False, default=d.balance.mode)
    if mode not in BALANCE_MODES:
        raise PlanError(f"{p}.balance.mode: {mode!r} is not one of {list(BALANCE_MODES)}")
    coef = float(_get(balance_doc, "coef", f"{p}.balance", (int, float), required=False, default=d.balance.coef))
    if coef < 0:
        raise PlanError(f"{p}.balance.coef: {coef!r} must be >= 0")
    data_doc = _get(doc, "data", p, dict, required=False, default={})
    kind = _get(data_doc, "kind", f"{p}.data", str, required=False, default="synthetic")
    if kind not in DATA_KINDS:
        raise PlanError(f"{p}.data.kind: {kind!r} is not one of {list(DATA_KINDS)}")
    data_path = _get(data_doc, "path", f"{p}.data", str, required=False)
    if kind in ("text", "tokens") and not data_path:
        raise PlanError(f"{p}.data.path: required when data.kind is {kind!r}")
    moe_impl = _get(doc, "moeImpl", p, str, required=False, default=d.moe_impl)
    if moe_impl not in MOE_IMPLS:
        raise PlanError(f"{p}.moeImpl: {moe_impl!r} is not one of {list(MOE_IMPLS)}")

    def num(key, attr, types=int, positive=True):
        v = _get(doc, key, p, types, required=False, default=getattr(d, attr))
        if positive and v < (1 if types is int else 0):
            raise PlanError(f"{p}.{key}: {v!r} must be {'>= 1' if types is int else '>= 0'}")
        return float(v) if types != int else v

    warmup = _get(doc, "warmupSteps", p, int, required=False, default=d.warmup_steps)
    if warmup < 0:
        raise PlanError(f"{p}.warmupSteps: {warmup!r} must be >= 0")
    seed = _get(doc, "seed", p, int, required=False, default=d.seed)
    samples = _get(doc, "routingSampleTokens", p, int, required=False, default=d.routing_sample_tokens)
    if samples < 0:
        raise PlanError(f"{p}.routingSampleTokens: {samples!r} must be >= 0")
    return TrainingSpec(
        steps=num("steps", "steps"), seq_len=num("seqLen", "seq_len"),
        micro_batch=num("microBatch", "micro_batch"), grad_accum=num("gradAccum", "grad_accum"),
        lr=num("lr", "lr", (int, float)), warmup_steps=warmup,
        min_lr_ratio=num("minLrRatio", "min_lr_ratio", (int, float)),
        checkpoint_every_steps=num("checkpointEverySteps", "checkpoint_every_steps"),
        seed=seed, grad_clip=num("gradClip", "grad_clip", (int, float)), moe_impl=moe_impl,
        balance=BalanceSpec(mode=mode, coef=coef),
        data=DataSpec(kind=kind, path=data_path,
                      tokenizer=_get(data_doc, "tokenizer", f"{p}.data", str, required=False)),
        checkpoint_dir=_get(doc, "checkpointDir", p, str, required=False),
        dead_expert_steps=num("deadExpertSteps", "dead_expert_steps"),
        dead_expert_fraction=num("deadExpertFraction", "dead_expert_fraction", (int, float)),
        router_logit_limit=num("routerLogitLimit", "router_logit_limit", (int, float)),
        straggler_factor=num("stragglerFactor", "straggler_factor", (int, float)),
        straggler_steps=num("stragglerSteps", "straggler_steps"),
        fragmentation_limit=num("fragmentationLimit", "fragmentation_limit", (int, float)),
        routing_sample_tokens=samples,
        performance=parse_perf(doc.get("performance")),
    )


def parse_plan(doc: Any) -> MoEPlan:
    """Parse and check a MoEPlan v1 document (already decoded from JSON)."""
    if not isinstance(doc, dict):
        raise PlanError(f"<root>: expected a JSON object, got {type(doc).__name__}")
    kind = _get(doc, "kind", "", str)
    if kind != PLAN_KIND:
        raise PlanError(f"kind: {kind!r} is not {PLAN_KIND!r}")
    version = _get(doc, "version", "", int)
    if version != PLAN_VERSION:
        raise PlanError(f"version: {version!r} is not supported (this trainer reads version {PLAN_VERSION})")
    job = _get(doc, "job", "", dict, required=False, default={})
    mdoc = _get(doc, "model", "", dict)
    model = ModelSpec(family=_get(mdoc, "family", "model", str),
                      preset=_get(mdoc, "preset", "model", str, required=False),
                      path=_get(mdoc, "path", "model", str, required=False),
                      hf_config=_get(mdoc, "hfConfig", "model", dict, required=False))
    if model.path is None and model.hf_config is None:
        raise PlanError("model.hfConfig: required when model.path is null")
    if model.hf_config is not None and "model_type" not in model.hf_config:
        raise PlanError("model.hfConfig.model_type: required field is missing")
    world_size = _positive(_get(doc, "worldSize", "", int), "worldSize")
    ep_size = _positive(_get(doc, "epSize", "", int, required=False, default=1), "epSize")
    if world_size % ep_size:
        raise PlanError(f"epSize: {ep_size} does not divide worldSize={world_size}")
    ranks = []
    for i, r in enumerate(_get(doc, "ranks", "", list, required=False, default=[])):
        rp = f"ranks[{i}]"
        rank = _get(r, "rank", rp, int)
        if rank != i:
            raise PlanError(f"{rp}.rank: {rank!r} out of order (expected {i})")
        gpu = _get(r, "gpu", rp, int, required=False)
        group = _get(r, "group", rp, int, required=False)
        ranks.append(RankSpec(rank=rank, node=str(r.get("node", "")), node_rank=int(r.get("nodeRank", 0)),
                              local_rank=int(r.get("localRank", 0)), gpu=gpu, group=group))
    if ranks and len(ranks) != world_size:
        raise PlanError(f"ranks: has {len(ranks)} entries, worldSize is {world_size}")
    placement_doc = _get(doc, "placement", "", dict, required=False)
    placement = _parse_placement(placement_doc) if placement_doc else None
    if placement is not None and placement.ep_size != ep_size:
        raise PlanError(f"placement.epSize: {placement.ep_size} differs from epSize={ep_size}")
    ds = _get(doc, "deepspeed", "", dict)
    ep_cfg = ds.get("expert_parallel") or {}
    if ep_cfg.get("enabled") and int(ep_cfg.get("autoep_size", 1)) != ep_size:
        raise PlanError(f"deepspeed.expert_parallel.autoep_size: {ep_cfg.get('autoep_size')!r} "
                        f"differs from epSize={ep_size}")
    if placement is not None and placement.dispatcher == "dedup" and ep_size > 1 and not ep_cfg.get("enabled"):
        raise PlanError("placement.dispatcher: 'dedup' dispatches AutoEP layers; "
                        "deepspeed.expert_parallel.enabled is false")
    training = _parse_training(doc.get("training"))
    if training.moe_impl == "grouped" and ep_cfg.get("enabled"):
        raise PlanError("training.moeImpl: 'grouped' replaces the MoE blocks AutoEP would replace; "
                        "set deepspeed.expert_parallel.enabled=false or moeImpl='hf'")
    return MoEPlan(job_namespace=str(job.get("namespace", "default")), job_name=str(job.get("name", "local")),
                   model=model, world_size=world_size, ep_size=ep_size, ranks=tuple(ranks),
                   placement=placement, deepspeed=ds, training=training, raw=doc)


def resolve_plan_path(cli_path: str | None = None) -> Path:
    """`--plan`, else `$MOE_PLAN`, else /etc/moe/plan.json."""
    return Path(cli_path or os.environ.get("MOE_PLAN") or DEFAULT_PLAN_PATH)


def load_plan(path: str | os.PathLike) -> MoEPlan:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise PlanError(f"plan file {str(path)!r} does not exist (set --plan or MOE_PLAN)") from None
    except OSError as exc:
        raise PlanError(f"plan file {str(path)!r} cannot be read: {exc}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanError(f"plan file {str(path)!r} is not JSON: {exc}") from None
    return parse_plan(doc)
