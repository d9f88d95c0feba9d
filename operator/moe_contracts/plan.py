"""``MoEPlan`` v1 (docs/contracts.md): the planning core writes it, the trainer runs it.

:func:`parse_plan` is the one reader: the operator checks every plan it hands out with it
(``complete=True``: every field the planner writes must be there) and the trainer reads its
mounted plan with it (hand-written plans may leave out what has a default). A bad plan raises
:class:`PlanError` naming the field (``MoEPlan ranks[3].localRank: ...``); the trainer maps it to
exit code 78.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, PrivateAttr, model_validator

from . import env
from ._base import Bool, Doc, Float, Int, Str, validate
from .errors import DocumentError, check_kind_version

PLAN_KIND = "MoEPlan"
PLAN_VERSION = 1
DEVICES = ("cuda", "cpu")
BALANCE_MODES = ("per_layer_aux", "global_aux", "none")
MOE_IMPLS = ("hf", "grouped")
DATA_KINDS = ("text", "tokens", "synthetic", "corpus", "prepared")
DISPATCHERS = ("autoep", "dedup")
PERF_KEYS = (
    "compileLayers",
    "fusedLoss",
    "fusedOptimizer",
    "zeroLeafModules",
    "lossChunkTokens",
    "reasons",
)


class PlanError(DocumentError):
    """The plan document is missing, malformed, or violates an invariant."""


def _drop_nulls(value: Any) -> Any:
    """A null optional field reads as absent (its default)."""
    return {k: v for k, v in value.items() if v is not None} if isinstance(value, dict) else value


class JobName(Doc):
    namespace: Str = Field(default="default", min_length=1)
    name: Str = Field(default="local", min_length=1)


class ModelSpec(Doc):
    family: Str
    preset: Str | None = None
    path: Str | None = None
    hf_config: dict[str, Any] | None = None
    # ModelReport.contentHash of ``path`` when the plan was made (the trainer re-checks it)
    content_hash: Str | None = None


class OutputSpec(Doc):
    """Where the trainer writes the trained model as a Hugging Face directory (docs/contracts.md
    "Export"): at the end, and every ``everyCheckpoints`` checkpoints when that is > 0."""

    path: Str = Field(min_length=1)
    every_checkpoints: Int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _absolute(self) -> OutputSpec:
        if not self.path.startswith("/"):
            raise ValueError(f"path: {self.path!r} is not an absolute path")
        return self


class RankSpec(Doc):
    rank: Int = Field(ge=0)
    node: Str = Field(min_length=1)
    node_rank: Int = Field(ge=0)
    local_rank: Int = Field(ge=0)
    gpu: Int | None = Field(default=None, ge=0)  # null on CPU plans
    group: Int | None = Field(default=None, ge=0)  # NVLink group (CPU: node); absent in older plans


class LayerReplicas(Doc):
    """Extra copies of experts in one layer (docs/contracts.md, "Replicated experts").

    ``holders[e]``: the EP ranks that hold a copy of original expert ``e``; the first is its home
    (the rank ``permutation`` puts it on), further ones hold extra copies. ``serve[p][e]``: the EP
    rank that computes expert ``e`` for tokens of EP rank ``p`` (one of ``holders[e]``).
    """

    holders: tuple[tuple[Int, ...], ...]
    serve: tuple[tuple[Int, ...], ...]


class Placement(Doc):
    strategy: Str
    num_layers: Int = Field(ge=1)
    num_experts: Int = Field(ge=1)
    ep_size: Int = Field(ge=1)
    permutation: tuple[tuple[Int, ...], ...]  # permutation[layer][slot] = original expert
    dispatcher: Literal["autoep", "dedup"] = "autoep"
    replicas: tuple[LayerReplicas, ...] | None = None  # per layer; None: one copy per expert
    # what the planner reports (the trainer does not read these): the strategy it fell back to
    # (a statistics strategy without statistics), the statistics' source, and the figures table
    # (``quality``: cross-group bytes, loads, ``dispatch`` bytes by tier; docs/contracts.md)
    fell_back_to: Str | None = None
    routing_stats_from: dict[str, Any] | None = None
    quality: dict[str, Any] | None = None

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ep_size

    def experts_of_ep_rank(self, layer: int, ep_rank: int) -> tuple[int, ...]:
        """Original expert ids that EP rank ``ep_rank`` holds in ``layer``, in local order."""
        n = self.experts_per_rank
        return self.permutation[layer][ep_rank * n : (ep_rank + 1) * n]

    def is_identity(self) -> bool:
        return all(list(row) == list(range(self.num_experts)) for row in self.permutation)


class Memory(Doc):
    gpu_memory_bytes: Int = Field(ge=0)
    estimated_peak_bytes: Int = Field(ge=0)
    fits: Bool
    breakdown: dict[str, Int]

    @model_validator(mode="after")
    def _bytes(self) -> Memory:
        for key, value in self.breakdown.items():
            if value < 0:
                raise ValueError(f"breakdown.{key}: {value!r} is not a byte count")
        return self


class BalanceSpec(Doc):
    mode: Literal["per_layer_aux", "global_aux", "none"] = "per_layer_aux"
    coef: Float = Field(default=0.01, ge=0)

    _nulls = model_validator(mode="before")(_drop_nulls)


class DataSpec(Doc):
    kind: Literal["text", "tokens", "synthetic", "corpus", "prepared"] = "synthetic"
    path: Str | None = None
    tokenizer: Str | None = None  # local HF tokenizer path; None = byte-level
    # shuffled: a seeded permutation per epoch; sequential: in file order (spec.data.order)
    order: Literal["shuffled", "sequential"] = "shuffled"


class PerfSpec(Doc):
    """``training.performance``: speed options the planner picks (absent: everything off)."""

    compile_layers: Bool = False
    fused_loss: Bool = False
    fused_optimizer: Bool = False
    zero_leaf_modules: tuple[Str, ...] = ()
    loss_chunk_tokens: Int = Field(default=8192, ge=1)
    reasons: tuple[str, ...] = ()

    @model_validator(mode="before")
    @classmethod
    def _known(cls, value: Any) -> Any:
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(PERF_KEYS))
            if unknown:
                raise ValueError(f"unknown keys {unknown} (known: {list(PERF_KEYS)})")
            leaves = value.get("zeroLeafModules", [])
            if not isinstance(leaves, list) or not all(isinstance(x, str) and x for x in leaves):
                raise ValueError(f"zeroLeafModules: {leaves!r} is not a list of class names")
            if "reasons" in value and isinstance(value["reasons"], list):
                value = dict(value, reasons=[str(r) for r in value["reasons"]])
        return value

    @property
    def any(self) -> bool:
        return (
            self.compile_layers
            or self.fused_loss
            or self.fused_optimizer
            or bool(self.zero_leaf_modules)
        )


class TrainingSpec(Doc):
    steps: Int = Field(default=20, ge=1)
    seq_len: Int = Field(default=128, ge=1)
    micro_batch: Int = Field(default=2, ge=1)
    grad_accum: Int = Field(default=1, ge=1)
    lr: Float = Field(default=1e-3, ge=0)
    warmup_steps: Int = Field(default=2, ge=0)
    min_lr_ratio: Float = Field(default=0.1, ge=0)
    checkpoint_every_steps: Int = Field(default=5, ge=1)
    seed: Int = 1234
    grad_clip: Float = Field(default=1.0, ge=0)
    moe_impl: Literal["hf", "grouped"] = "hf"
    balance: BalanceSpec = BalanceSpec()
    data: DataSpec = DataSpec()
    checkpoint_dir: Str | None = None
    activation_checkpointing: Bool = False
    dead_expert_steps: Int = Field(default=20, ge=1)
    dead_expert_fraction: Float = Field(default=0.1, ge=0)
    router_logit_limit: Float = Field(default=30.0, ge=0)
    straggler_factor: Float = Field(default=2.0, ge=0)
    straggler_steps: Int = Field(default=5, ge=1)
    fragmentation_limit: Float = Field(default=0.3, ge=0)
    routing_sample_tokens: Int = Field(
        default=65536, ge=0
    )  # token expert sets kept for RoutingStats
    performance: PerfSpec = PerfSpec()

    _nulls = model_validator(mode="before")(_drop_nulls)


def _check_replicas(pl: Placement) -> None:
    """Every layer's holders start at the expert's home and serve only from holders."""
    if pl.dispatcher != "dedup":
        raise ValueError("placement.replicas: copies are served by the 'dedup' dispatcher only")
    if len(pl.replicas or ()) != pl.num_layers:
        raise ValueError(
            f"placement.replicas: has {len(pl.replicas or ())} layers, numLayers is {pl.num_layers}"
        )
    check_replicas(pl.replicas or (), pl.permutation, pl.ep_size, "placement.replicas")


def check_replicas(
    reps: Sequence[LayerReplicas],
    permutation: Sequence[Sequence[int]],
    ep_size: int,
    where: str,
) -> None:
    """``reps`` (one per layer) fit ``permutation`` over ``ep_size`` EP ranks: every expert's
    holders start at its home (the rank of its slot), are distinct ranks, and every ``serve``
    entry is a holder. Raises ValueError naming ``where``."""
    L, P = len(permutation), ep_size
    if len(reps) != L:
        raise ValueError(f"{where}: has {len(reps)} layers, the placement has {L}")
    for layer, rep in enumerate(reps):
        at, E = f"{where}[{layer}]", len(permutation[layer])
        n = E // P
        if len(rep.holders) != E:
            raise ValueError(f"{at}.holders: has {len(rep.holders)} rows, numExperts is {E}")
        home = {e: slot // n for slot, e in enumerate(permutation[layer])}
        for e, hs in enumerate(rep.holders):
            if not hs or hs[0] != home[e]:
                raise ValueError(
                    f"{at}.holders[{e}]: {list(hs)!r} must start with the home rank {home[e]}"
                )
            if len(set(hs)) != len(hs) or any(not 0 <= r < P for r in hs):
                raise ValueError(f"{at}.holders[{e}]: {list(hs)!r} are not distinct ranks < {P}")
        if len(rep.serve) != P or any(len(row) != E for row in rep.serve):
            raise ValueError(f"{at}.serve: must be {P} rows of {E} ranks")
        for p, row in enumerate(rep.serve):
            for e, r in enumerate(row):
                if r not in rep.holders[e]:
                    raise ValueError(f"{at}.serve[{p}][{e}]: rank {r} holds no copy of expert {e}")


class MoEPlan(Doc):
    """A parsed MoEPlan v1. Build with :func:`parse_plan`; ``raw`` is the document as read."""

    kind: Literal["MoEPlan"] = "MoEPlan"
    version: Literal[1] = 1
    job: JobName = JobName()
    device: Literal["cuda", "cpu"] = "cuda"
    model: ModelSpec
    world_size: Int = Field(ge=1)
    ep_size: Int = Field(default=1, ge=1)
    ranks: tuple[RankSpec, ...] = ()
    placement: Placement | None = None
    deepspeed: dict[str, Any]
    memory: Memory | None = None
    training: TrainingSpec = TrainingSpec()
    output: OutputSpec | None = None
    # the planner's records for the operator (the trainer does not read them): the GPU the plan
    # was made for (keys the upgrade gate's verdicts) and the Auto sizing decision
    hardware: dict[str, Any] | None = None
    sizing: dict[str, Any] | None = None
    _raw: dict[str, Any] = PrivateAttr(default_factory=dict)

    @property
    def raw(self) -> dict[str, Any]:
        return self._raw

    @property
    def node_names(self) -> list[str]:
        """The plan's nodes by node rank (``node_names[node_rank]``)."""
        out: dict[int, str] = {}
        for r in sorted(self.ranks, key=lambda r: r.node_rank):
            out.setdefault(r.node_rank, r.node)
        return [out[i] for i in sorted(out)]

    @property
    def job_namespace(self) -> str:
        return self.job.namespace

    @property
    def job_name(self) -> str:
        return self.job.name

    def sorted_json(self) -> str:
        """The serialised document, checked complete first, sorted keys: what goes into the
        ``<job>-plan`` ConfigMap, byte for byte what :func:`plan_json` with ``sort_keys`` writes.
        Serialised once per plan (memoised: a plan is immutable, ``raw`` is not to be edited
        after this is called)."""
        return self._sorted_json_text

    @functools.cached_property
    def _sorted_json_text(self) -> str:
        # a cached_property: not a pydantic private attribute, so equality and copies ignore it
        _check_complete(self._raw, self)
        return _dumps(self._raw, sort_keys=True)

    @property
    def autoep_enabled(self) -> bool:
        return bool(self._ep_cfg().get("enabled", False))

    def _ep_cfg(self) -> dict[str, Any]:
        ep = self.deepspeed.get("expert_parallel") or {}
        return ep if isinstance(ep, dict) else {}

    @model_validator(mode="after")
    def _consistent(self) -> MoEPlan:
        world, ep = self.world_size, self.ep_size
        m = self.model
        if m.path is None and m.hf_config is None:
            raise ValueError("model.hfConfig: required when model.path is null")
        # which model_type values a family reads is the families' knowledge (the planning
        # core's check_plan and the trainer check it), not the contract's
        if m.hf_config is not None and not isinstance(m.hf_config.get("model_type"), str):
            raise ValueError("model.hfConfig.model_type: required field is missing")
        if world % ep:
            raise ValueError(f"epSize: {ep} must divide worldSize {world}")
        if self.ranks:
            _check_ranks(self.ranks, world, self.device)
        pl = self.placement
        if pl is not None:
            if pl.num_experts % pl.ep_size:
                raise ValueError(
                    f"placement.epSize: {pl.ep_size} does not divide numExperts={pl.num_experts}"
                )
            if pl.ep_size != ep:
                raise ValueError(f"placement.epSize: {pl.ep_size} differs from epSize {ep}")
            if len(pl.permutation) != pl.num_layers:
                raise ValueError(
                    f"placement.permutation: has {len(pl.permutation)} rows, numLayers is "
                    f"{pl.num_layers}"
                )
            for layer, row in enumerate(pl.permutation):
                if sorted(row) != list(range(pl.num_experts)):
                    raise ValueError(
                        f"placement.permutation[{layer}]: {list(row)!r} is not a permutation "
                        f"of 0..{pl.num_experts - 1}"
                    )
            if pl.replicas is not None:
                _check_replicas(pl)
        ep_cfg = self._ep_cfg()
        if ep_cfg.get("enabled") and ep_cfg.get("autoep_size", 1) != ep:
            raise ValueError(
                f"deepspeed.expert_parallel.autoep_size: {ep_cfg.get('autoep_size')!r} "
                f"differs from epSize {ep}"
            )
        if pl is not None and pl.dispatcher == "dedup" and ep > 1 and not ep_cfg.get("enabled"):
            raise ValueError(
                "placement.dispatcher: 'dedup' dispatches AutoEP layers; "
                "deepspeed.expert_parallel.enabled is false"
            )
        ds, tr = self.deepspeed, self.training
        micro, accum = (
            ds.get("train_micro_batch_size_per_gpu"),
            ds.get("gradient_accumulation_steps"),
        )
        for key, value in (
            ("train_micro_batch_size_per_gpu", micro),
            ("gradient_accumulation_steps", accum),
            ("train_batch_size", ds.get("train_batch_size")),
        ):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"deepspeed.{key}: {value!r} is not an integer >= 1")
        if (
            micro is not None
            and accum is not None
            and ds.get("train_batch_size") is not None
            and ds["train_batch_size"] != micro * accum * world
        ):
            raise ValueError(
                f"deepspeed.train_batch_size: {ds['train_batch_size']} != {micro} x {accum} x "
                f"worldSize {world}"
            )
        # training's batch fields, when given, must agree with what DeepSpeed runs
        for name, field, ds_key, ds_value in (
            ("microBatch", "micro_batch", "train_micro_batch_size_per_gpu", micro),
            ("gradAccum", "grad_accum", "gradient_accumulation_steps", accum),
        ):
            ours = getattr(tr, field)
            if ds_value is not None and field in tr.model_fields_set and ours != ds_value:
                raise ValueError(
                    f"training.{name}: {ours} differs from deepspeed {ds_key} {ds_value}"
                )
        if tr.data.kind in ("text", "tokens", "prepared") and not tr.data.path:
            raise ValueError(f"training.data.path: required when data.kind is {tr.data.kind!r}")
        if tr.moe_impl == "grouped" and ep_cfg.get("enabled"):
            raise ValueError(
                "training.moeImpl: 'grouped' replaces the MoE blocks AutoEP would replace; "
                "set deepspeed.expert_parallel.enabled=false or moeImpl='hf'"
            )
        return self


def _check_ranks(ranks: tuple[RankSpec, ...], world: int, device: str) -> None:
    if len(ranks) != world:
        raise ValueError(f"ranks: has {len(ranks)} entries, worldSize is {world}")
    seen_gpu: dict[tuple[str, int], int] = {}
    node_rank: dict[str, int] = {}
    locals_: dict[str, list[int]] = {}
    for i, r in enumerate(ranks):
        p = f"ranks[{i}]"
        if r.rank != i:
            raise ValueError(f"{p}.rank: {r.rank} out of order (expected {i})")
        if node_rank.setdefault(r.node, r.node_rank) != r.node_rank:
            raise ValueError(
                f"{p}.nodeRank: {r.node_rank} but node {r.node!r} has nodeRank {node_rank[r.node]}"
            )
        locals_.setdefault(r.node, []).append(r.local_rank)
        if r.gpu is None:
            continue
        if device == "cpu":
            raise ValueError(f"{p}.gpu: {r.gpu!r} on a CPU plan (must be null)")
        if (r.node, r.gpu) in seen_gpu:
            raise ValueError(
                f"{p}.gpu: {r.node}:{r.gpu} is already used by rank {seen_gpu[r.node, r.gpu]} "
                "(ranks must map one-to-one onto GPUs)"
            )
        seen_gpu[r.node, r.gpu] = i
    if sorted(node_rank.values()) != list(range(len(node_rank))):
        raise ValueError(
            f"ranks: nodeRanks {sorted(node_rank.values())} are not 0..{len(node_rank) - 1}"
        )
    for node, lrs in locals_.items():
        if sorted(lrs) != list(range(len(lrs))):
            raise ValueError(
                f"ranks: localRanks of node {node!r} are {sorted(lrs)}, not 0..{len(lrs) - 1}"
            )


def _check_complete(doc: dict[str, Any], plan: MoEPlan) -> None:
    """What the planning core always writes (a plan it hands out must have all of it)."""
    for key in ("job", "placement", "memory", "training"):
        if not isinstance(doc.get(key), dict):
            raise PlanError(f"{PLAN_KIND} {key}: required object is missing")
    if len(plan.ranks) != plan.world_size:
        n = len(doc["ranks"]) if isinstance(doc.get("ranks"), list) else None
        raise PlanError(f"{PLAN_KIND} ranks: has {n} entries, worldSize is {plan.world_size}")
    if plan.device == "cuda":
        for i, r in enumerate(plan.ranks):
            if r.gpu is None:
                raise PlanError(f"{PLAN_KIND} ranks[{i}].gpu: None is not a GPU index")
    for key in (
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "train_batch_size",
    ):
        if key not in plan.deepspeed:
            raise PlanError(f"{PLAN_KIND} deepspeed.{key}: required field is missing")
    for key in ("steps", "seqLen", "microBatch", "gradAccum"):
        if key not in doc["training"]:
            raise PlanError(f"{PLAN_KIND} training.{key}: required field is missing")


def parse_plan(doc: Any, *, complete: bool = False) -> MoEPlan:
    """Parse and check a decoded MoEPlan v1 document; raises :class:`PlanError`.
    ``complete``: also require every field the planning core writes."""
    try:
        check_kind_version(PLAN_KIND, doc, (PLAN_VERSION,))
        plan = validate(PLAN_KIND, MoEPlan, doc)
    except PlanError:
        raise
    except DocumentError as exc:
        raise PlanError(str(exc)) from None
    if complete:
        _check_complete(doc, plan)
    plan._raw = doc
    return plan


def parse_perf(doc: Any) -> PerfSpec:
    """The ``training.performance`` object alone (absent: everything off)."""
    if doc is None:
        return PerfSpec()
    if not isinstance(doc, dict):
        raise PlanError(
            f"{PLAN_KIND} training.performance: expected an object, got {type(doc).__name__}"
        )
    try:
        return validate(
            PLAN_KIND, _PerfOnly, {"training": {"performance": doc}}
        ).training.performance
    except DocumentError as exc:
        raise PlanError(str(exc)) from None


class _PerfTraining(Doc):
    performance: PerfSpec


class _PerfOnly(Doc):
    training: _PerfTraining


def resolve_plan_path(cli_path: str | None = None) -> Path:
    """``--plan``, else ``$MOE_PLAN``, else /etc/moe/plan.json."""
    return Path(cli_path or os.environ.get(env.PLAN) or env.DEFAULT_PLAN_PATH)


def load_plan(path: str | os.PathLike[str], *, complete: bool = False) -> MoEPlan:
    """Read and parse a plan file; a missing or non-JSON file is a PlanError too."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise PlanError(
            f"{PLAN_KIND}: plan file {str(path)!r} does not exist (set --plan or {env.PLAN})"
        ) from None
    except OSError as exc:
        raise PlanError(f"{PLAN_KIND}: plan file {str(path)!r} cannot be read: {exc}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanError(f"{PLAN_KIND}: plan file {str(path)!r} is not JSON: {exc}") from None
    return parse_plan(doc, complete=complete)


def plan_json(doc: dict[str, Any], *, sort_keys: bool = False) -> str:
    """The serialised document, checked complete first: what goes into the ``<job>-plan`` ConfigMap
    (``sort_keys``: the same plan is the same bytes) and what ``moectl plan -o`` writes."""
    parse_plan(doc, complete=True)
    return _dumps(doc, sort_keys=sort_keys)


def _dumps(doc: dict[str, Any], *, sort_keys: bool) -> str:
    return json.dumps(doc, indent=1, sort_keys=sort_keys) + "\n"
