"""The MoETrainingJob spec, parsed once at the boundary into frozen pydantic models.

Everything the CRD schema declares (types, bounds, enums, defaults) and every CEL rule it carries
is enforced here as well: the 1.20 API server drops CEL rules, and users can reach the operator
through servers that prune differently. :func:`parse_spec` raises one error type,
:class:`SpecError`, whose message names the field path (``spec.training.steps``) and the
offending value; the reconciler turns it into ``Failed`` with reason ``InvalidSpec``.

Field names mirror the CRD (camelCase aliases), so ``JobSpec.model_validate(cr["spec"])`` reads
what the API server stored. ``tests/test_spec.py`` checks the two stay in step (same fields, same
defaults).
"""

from __future__ import annotations

import hashlib
import json
import re
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from .core.errors import FieldError, field_path
from .core.placement.strategies import SPEC_DEFAULT, SpecStrategy
from .spec_json import DEEPSPEED_OVERRIDES_JSON_BYTES, HF_CONFIG_JSON_BYTES, fold_json

# Keys of the generated DeepSpeed config that the plan depends on: overriding them would make the
# placement and the memory estimate lie, so deepspeedOverrides may not touch them.
PROTECTED_DEEPSPEED_KEYS = (
    ("zero_optimization", "stage"),
    ("expert_parallel",),
    ("train_batch_size",),
    ("train_micro_batch_size_per_gpu",),
    ("gradient_accumulation_steps",),
)

# Top-level spec fields that may change after the workers were launched. Everything else is
# immutable then: the running gang, the plan and the checkpoints were built from it.
MUTABLE_AFTER_LAUNCH = frozenset({"runPolicy", "gate"})

# Sizing fields take an integer or ``Auto`` (the planner chooses: core.sizing, docs/planning.md)
AUTO: Final = "Auto"  # Final: `x == AUTO` narrows `int | Auto` to int for mypy
Auto = Literal["Auto"]
CHECKPOINTING = ("Enabled", "Disabled", "Auto")
DEFAULT_EXPERT_MEMORY_OVERHEAD = 25  # percent: spec.placement.maxExpertMemoryOverhead absent

_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_MAX_LR = Decimal(10)
_MIN_LR = Decimal("1e-12")  # smaller rounds to nothing in a float32 optimizer (1e-400 is 0.0)


class SpecError(FieldError):
    """The MoETrainingJob spec is invalid; ``field`` is its path (``spec.nodes.count``)."""


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Model(BaseModel):
    model_config = ConfigDict(
        frozen=True, extra="forbid", strict=True, alias_generator=to_camel, populate_by_name=True
    )


# ---- volumes -------------------------------------------------------------------------------
class ClaimSource(_Model):
    claim_name: str = Field(min_length=1, max_length=253)
    read_only: bool = True


class CheckpointClaimSource(_Model):
    claim_name: str = Field(min_length=1, max_length=253)


class HostPathSource(_Model):
    path: str = Field(pattern=r"^/", max_length=1024)
    # The allowed prefix ``path`` lies under, set by admission (``admission.bind_host_paths``),
    # never by the manifest: pods mount the prefix and reach ``path`` through a subPath, which the
    # kubelet refuses to resolve through a symlink that leaves the prefix.
    _allowed_prefix: str | None = PrivateAttr(default=None)

    @property
    def allowed_prefix(self) -> str | None:
        return self._allowed_prefix


class ConfigMapSource(_Model):
    name: str = Field(min_length=1, max_length=253)


def _exactly_one(obj: BaseModel, names: tuple[str, ...], what: str) -> None:
    given = [n for n in names if getattr(obj, n) is not None]
    if len(given) != 1:
        camel = [to_camel(n) for n in names]
        raise ValueError(f"set exactly one of {', '.join(camel)} ({what}; got {len(given)})")


class DataVolume(_Model):
    persistent_volume_claim: ClaimSource | None = None
    host_path: HostPathSource | None = None
    config_map: ConfigMapSource | None = None

    @model_validator(mode="after")
    def _one(self) -> DataVolume:
        _exactly_one(self, ("persistent_volume_claim", "host_path", "config_map"), "volume source")
        return self


class CheckpointVolume(_Model):
    persistent_volume_claim: CheckpointClaimSource | None = None
    host_path: HostPathSource | None = None

    @model_validator(mode="after")
    def _one(self) -> CheckpointVolume:
        _exactly_one(self, ("persistent_volume_claim", "host_path"), "volume source")
        return self


# ---- spec groups ---------------------------------------------------------------------------
# a path inside a volume (the kubelet refuses one that leaves it)
_SUB_PATH = r"^[^/]"


class ModelRef(_Model):
    preset: str | None = Field(default=None, max_length=63, pattern=r"^[a-z0-9][a-z0-9.-]*$")
    hf_config: dict[str, Any] | None = None
    # keys merged over hfConfig (top level), as JSON text
    hf_config_json: str | None = Field(
        default=None, alias="hfConfigJSON", max_length=HF_CONFIG_JSON_BYTES
    )
    path: str | None = Field(default=None, max_length=1024, pattern=r"^/")
    volume: CheckpointVolume | None = None  # mounted read-only at ``path``
    sub_path: str | None = Field(default=None, min_length=1, max_length=1024, pattern=_SUB_PATH)

    @model_validator(mode="before")
    @classmethod
    def _fold(cls, data: Any) -> Any:
        return fold_json(data, "hfConfigJSON", "hfConfig", HF_CONFIG_JSON_BYTES, deep=False)

    @model_validator(mode="after")
    def _one(self) -> ModelRef:
        _exactly_one(self, ("preset", "hf_config", "path"), "model")
        if self.path is None and self.volume is not None:
            raise ValueError("volume: only with model.path (the directory it holds)")
        if self.sub_path is not None and self.volume is None:
            raise ValueError("subPath: only with model.volume")
        return self


class DataCache(_Model):
    path: str = Field(default="/data-cache", max_length=1024, pattern=r"^/")
    volume: CheckpointVolume


# data kinds a data-prepare pod tokenizes once before the workers start
PREPARED_KINDS = ("JSONL", "Parquet")


class Data(_Model):
    kind: Literal["Text", "JSONL", "Parquet", "Tokenized", "Synthetic"] = "Synthetic"
    path: str = Field(default="/data", max_length=1024, pattern=r"^/")
    volume: DataVolume | None = None
    # None reads as Text (no default written: a job launched before this field keeps its hash)
    format: Literal["Text", "Chat"] | None = None
    field: str | None = Field(default=None, min_length=1, max_length=256)
    cache: DataCache | None = None
    order: Literal["Shuffled", "Sequential"] | None = None  # None reads as Shuffled

    @model_validator(mode="after")
    def _text_needs_volume(self) -> Data:
        if self.kind != "Synthetic" and self.volume is None:
            raise ValueError(f"volume: required when kind is {self.kind!r}")
        if self.kind == "Synthetic" and self.order is not None:
            raise ValueError("order: only with data from files, not 'Synthetic'")
        if self.kind not in PREPARED_KINDS:
            for name, value in (("format", self.format == "Chat"), ("field", self.field)):
                if value:
                    raise ValueError(f"{name}: only with kind JSONL or Parquet, not {self.kind!r}")
            if self.cache is not None:
                raise ValueError(f"cache: only with kind JSONL or Parquet, not {self.kind!r}")
        return self

    @property
    def field_name(self) -> str:
        """The column / key holding the text (``text``) or the conversation (``messages``)."""
        return self.field or ("messages" if self.format == "Chat" else "text")

    @property
    def prepared(self) -> bool:
        return self.kind in PREPARED_KINDS


class Output(_Model):
    path: str = Field(default="/output", max_length=1024, pattern=r"^/")
    volume: CheckpointVolume
    sub_path: str | None = Field(default=None, min_length=1, max_length=1024, pattern=_SUB_PATH)
    every_checkpoints: int | None = Field(default=None, ge=1, le=1_000_000)


class Checkpoint(_Model):
    every_steps: int = Field(default=50, ge=1, le=1_000_000)
    path: str = Field(default="/ckpt", max_length=1024, pattern=r"^/")
    volume: CheckpointVolume | None = None


class Nodes(_Model):
    count: Annotated[int, Field(ge=1, le=512)] | Auto = 1
    gpus_per_node: Annotated[int, Field(ge=1, le=16)] | Auto = 1
    node_selector: dict[str, str] | None = None
    node_names: list[str] | None = Field(default=None, max_length=512)

    @model_validator(mode="after")
    def _names(self) -> Nodes:
        if self.node_names is not None:
            if len(set(self.node_names)) != len(self.node_names):
                raise ValueError(f"nodeNames: {list(self.node_names)!r} lists a node twice")
            # with count Auto, nodeNames are the nodes the planner chooses among
            if self.count != AUTO and len(self.node_names) != self.count:
                raise ValueError(
                    f"nodeNames: {len(self.node_names)} names given, count is {self.count}"
                )
            for n in self.node_names:
                if not _NAME_RE.match(n) or len(n) > 253:
                    raise ValueError(f"nodeNames: {n!r} is not a node name")
        return self

    @property
    def world_size(self) -> int | None:
        """Ranks of the job; None while a count is ``Auto`` (the plan's ``worldSize`` says)."""
        if self.count == AUTO or self.gpus_per_node == AUTO:
            return None
        return self.count * self.gpus_per_node


class RoutingStatsFrom(_Model):
    job_name: str | None = Field(default=None, min_length=1, max_length=253)
    config_map_name: str | None = Field(default=None, min_length=1, max_length=253)

    @model_validator(mode="after")
    def _one(self) -> RoutingStatsFrom:
        _exactly_one(self, ("job_name", "config_map_name"), "routingStatsFrom")
        return self

    @property
    def config_map(self) -> str:
        """The ConfigMap holding ``routing_stats.json`` (docs/contracts.md)."""
        return self.config_map_name or f"{self.job_name}-routing-stats"


class Replan(_Model):
    """Re-placement during the job (docs/placement.md): re-plan every ``everySteps`` steps of
    fresh routing statistics; switch when the predicted cross-group bytes fall by
    ``minPredictedGainPercent``."""

    every_steps: int = Field(ge=1, le=10_000_000)
    min_predicted_gain_percent: int = Field(default=10, ge=1, le=100)


class Placement(_Model):
    strategy: SpecStrategy = SPEC_DEFAULT
    dispatcher: Literal["AutoEP", "Dedup"] | None = None  # None: Dedup when EP > 1 (planner)
    # None: the largest EP size inside an NVLink group; Auto: chosen by predicted speed
    expert_parallel_size: Annotated[int, Field(ge=1, le=8192)] | Auto | None = None
    routing_stats_from: RoutingStatsFrom | None = None
    # replicated experts (docs/placement.md "Replicated experts"); absent = "None": one copy each.
    # Auto: copies within maxExpertMemoryOverhead when the routing statistics carry token samples
    # and the dispatcher is Dedup over EP > 1; an integer: that many extra copies per layer.
    replicas: Literal["Auto", "None"] | Annotated[int, Field(ge=0, le=1_048_576)] | None = None
    # absent: "25%" (no CRD default, so existing jobs' launched-spec hash does not change)
    max_expert_memory_overhead: str | None = Field(default=None, max_length=8)
    replan: Replan | None = None  # absent: the placement of the plan for the whole run

    @model_validator(mode="after")
    def _overhead(self) -> Placement:
        v = self.max_expert_memory_overhead
        if v is not None and not re.fullmatch(r"[0-9]{1,3}%", v):
            raise ValueError(
                f"placement.maxExpertMemoryOverhead: {v!r} is not a percentage like '25%'"
            )
        if v is not None and int(v[:-1]) > 100:
            raise ValueError(f"placement.maxExpertMemoryOverhead: {v!r} is above '100%'")
        if self.replicas not in (None, "None") and self.dispatcher == "AutoEP":
            raise ValueError(
                f"placement.replicas: {self.replicas!r} needs dispatcher Dedup (AutoEP's "
                "all-to-all serves one copy per expert)"
            )
        return self

    @property
    def overhead_percent(self) -> int:
        """``maxExpertMemoryOverhead`` as a whole percent (absent: 25)."""
        v = self.max_expert_memory_overhead
        return DEFAULT_EXPERT_MEMORY_OVERHEAD if v is None else int(v[:-1])


class Training(_Model):
    steps: int = Field(default=100, ge=1, le=10_000_000)
    seq_len: int = Field(default=512, ge=8, le=1_048_576)
    global_batch: int = Field(default=8, ge=1, le=1_048_576)
    micro_batch: Annotated[int, Field(ge=1, le=65_536)] | Auto = 1
    learning_rate: str = Field(
        default="0.0003", max_length=32, pattern=r"^[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?$"
    )
    warmup_steps: int = Field(default=0, ge=0, le=10_000_000)
    seed: int = Field(default=1234, ge=0, le=4_294_967_295)
    # absent: Disabled (no default in the CRD, so the launched-spec hash of a job that does not
    # set it stays what it was before the field existed)
    activation_checkpointing: Literal["Enabled", "Disabled", "Auto"] | None = None

    @model_validator(mode="after")
    def _lr(self) -> Training:
        try:
            lr = Decimal(self.learning_rate)
        except InvalidOperation:  # pattern already refuses these; keep the message clear anyway
            raise ValueError(f"learningRate: {self.learning_rate!r} is not a number") from None
        if not (_MIN_LR <= lr <= _MAX_LR):
            raise ValueError(
                f"learningRate: {self.learning_rate!r} must be >= {_MIN_LR} and <= {_MAX_LR}"
            )
        if self.micro_batch != AUTO and self.micro_batch > self.global_batch:
            raise ValueError(
                f"microBatch: {self.micro_batch} is larger than globalBatch {self.global_batch}"
            )
        return self

    @property
    def lr(self) -> float:
        return float(Decimal(self.learning_rate))


class RunPolicy(_Model):
    backoff_limit: int = Field(default=3, ge=0, le=100)
    active_deadline_seconds: int | None = Field(default=None, ge=1, le=31_536_000)
    ttl_seconds_after_finished: int | None = Field(default=None, ge=0, le=31_536_000)
    suspend: bool = False
    allow_replan_on_node_loss: bool = False


class Toleration(_Model):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class Scheduling(_Model):
    node_selector: dict[str, str] | None = None
    tolerations: list[Toleration] | None = Field(default=None, max_length=64)
    priority_class_name: str | None = Field(default=None, max_length=253)
    scheduler_name: str | None = Field(default=None, max_length=253)
    pod_annotations: dict[str, str] | None = None
    pod_labels: dict[str, str] | None = None
    # absent = Auto (no default filled in: the launched jobs' immutable hash stays as it was);
    # Auto's choice depends on the cluster too: builders/gang.py resolves it
    gang: Literal["Auto", "Kueue", "Volcano", "None"] | None = None

    @model_validator(mode="after")
    def _gang_consistent(self) -> Scheduling:
        queued = "kueue.x-k8s.io/queue-name" in (self.pod_labels or {})
        if self.gang == "Kueue" and not queued:
            raise ValueError(
                "gang: Kueue needs podLabels['kueue.x-k8s.io/queue-name'] (the LocalQueue)"
            )
        if self.gang == "Volcano" and queued:  # Kueue would admit the pods one by one
            raise ValueError(
                "gang: Volcano conflicts with podLabels['kueue.x-k8s.io/queue-name'] (Kueue "
                "would admit the pods one by one): use gang: Kueue, or drop the label"
            )
        if self.gang == "Volcano" and "scheduling.k8s.io/group-name" in (
            self.pod_annotations or {}
        ):
            raise ValueError(
                "gang: Volcano names each attempt's PodGroup itself: drop "
                "podAnnotations['scheduling.k8s.io/group-name'] (or use gang: None)"
            )
        return self


_QUANTITY_RE = re.compile(r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][-+]?[0-9]+|[numkMGTPE]i?|Ki)?$")


class Resources(_Model):
    requests: dict[str, int | str] | None = None
    limits: dict[str, int | str] | None = None

    @model_validator(mode="after")
    def _quantities(self) -> Resources:
        for group in ("requests", "limits"):
            for name, q in (getattr(self, group) or {}).items():
                if isinstance(q, bool) or (isinstance(q, int) and q < 0):
                    raise ValueError(f"{group}.{name}: {q!r} is not a quantity")
                if isinstance(q, str) and not _QUANTITY_RE.match(q):
                    raise ValueError(f"{group}.{name}: {q!r} is not a quantity")
        return self


class Gate(_Model):
    skip: bool = False
    skip_reason: str | None = Field(default=None, max_length=1024)

    @model_validator(mode="after")
    def _audited(self) -> Gate:
        if self.skip and not (self.skip_reason or "").strip():
            raise ValueError("skipReason: required when skip is true (skipping is audited)")
        return self


class LocalObjectReference(_Model):
    name: str = Field(min_length=1, max_length=253)


class JobSpec(_Model):
    """``MoETrainingJob.spec``; see crds/moetrainingjob.yaml and docs/crd.md."""

    image: str = Field(min_length=1, max_length=512)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    # Secrets in the job's namespace the kubelet pulls ``image`` with (worker, inspect, prepare
    # and digest-probe pods; the gate's smoke pods run in the operator's namespace)
    image_pull_secrets: list[LocalObjectReference] | None = Field(default=None, max_length=8)
    deepspeed_version: str | None = Field(
        default=None, max_length=64, pattern=r"^[0-9]+\.[0-9]+(\.[0-9]+)?([a-z0-9.+-]*)$"
    )
    device: Literal["GPU", "CPU"] = "GPU"
    model: ModelRef
    data: Data = Data()
    checkpoint: Checkpoint = Checkpoint()
    output: Output | None = None
    nodes: Nodes = Nodes()
    placement: Placement = Placement()
    training: Training = Training()
    deepspeed_overrides: dict[str, Any] | None = None
    # deep-merged over deepspeedOverrides, as JSON text
    deepspeed_overrides_json: str | None = Field(
        default=None, alias="deepspeedOverridesJSON", max_length=DEEPSPEED_OVERRIDES_JSON_BYTES
    )
    run_policy: RunPolicy = RunPolicy()
    scheduling: Scheduling = Scheduling()
    resources: Resources = Resources()
    gate: Gate = Gate()

    @model_validator(mode="before")
    @classmethod
    def _fold(cls, data: Any) -> Any:
        return fold_json(
            data,
            "deepspeedOverridesJSON",
            "deepspeedOverrides",
            DEEPSPEED_OVERRIDES_JSON_BYTES,
            deep=True,
        )

    @model_validator(mode="after")
    def _cross_field(self) -> JobSpec:
        world = self.nodes.world_size
        micro = self.training.micro_batch
        if world is not None and micro != AUTO and self.training.global_batch % (micro * world):
            raise ValueError(
                f"training.globalBatch: {self.training.global_batch} is not a multiple of "
                f"microBatch * world size = {micro} * {world}"
            )
        if world is not None and self.training.global_batch % world:
            raise ValueError(
                f"training.globalBatch: {self.training.global_batch} is not a multiple of "
                f"the world size {world}"
            )
        ep = self.placement.expert_parallel_size
        if world is not None and isinstance(ep, int) and world % ep:
            raise ValueError(
                f"placement.expertParallelSize: {ep} does not divide the world size "
                f"{world} (nodes.count * nodes.gpusPerNode)"
            )
        for path in PROTECTED_DEEPSPEED_KEYS:
            node: Any = self.deepspeed_overrides or {}
            for key in path:
                node = node.get(key) if isinstance(node, dict) else None
            if node is not None:
                raise ValueError(
                    f"deepspeedOverrides.{'.'.join(path)}: the plan sets this key; "
                    "it cannot be overridden"
                )
        if self.data.prepared and self.data.cache is None and self.checkpoint.volume is None:
            raise ValueError(
                f"data.cache: required for kind {self.data.kind!r} when checkpoint.volume is "
                "not set (the prepared shards must outlive the prepare pod: they go to "
                "data.cache.volume, else under checkpoint.path)"
            )
        if self.training.warmup_steps > self.training.steps:
            raise ValueError(
                f"training.warmupSteps: {self.training.warmup_steps} exceeds "
                f"steps {self.training.steps}"
            )
        return self

    # ---- derived -----------------------------------------------------------------------
    @property
    def grad_accum(self) -> int | None:
        """Accumulation steps; None while a sizing field is ``Auto`` (the plan says)."""
        world, micro = self.nodes.world_size, self.training.micro_batch
        if world is None or micro == AUTO:
            return None
        return self.training.global_batch // (micro * world)

    @property
    def auto_fields(self) -> tuple[str, ...]:
        """The sizing fields left to the planner (``spec.nodes.count``, ...), in spec order."""
        values = {
            "spec.nodes.count": self.nodes.count,
            "spec.nodes.gpusPerNode": self.nodes.gpus_per_node,
            "spec.placement.expertParallelSize": self.placement.expert_parallel_size,
            "spec.training.microBatch": self.training.micro_batch,
            "spec.training.activationCheckpointing": self.training.activation_checkpointing,
        }
        return tuple(k for k, v in values.items() if v == AUTO)

    def immutable_view(self) -> dict[str, Any]:
        """The launch-relevant part of the spec, as plain JSON (camelCase, defaults filled)."""
        full = self.model_dump(mode="json", by_alias=True, exclude_none=True)
        return {k: v for k, v in full.items() if k not in MUTABLE_AFTER_LAUNCH}

    def immutable_hash(self) -> str:
        blob = json.dumps(self.immutable_view(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def field_hashes(view: dict[str, Any]) -> dict[str, str]:
    """A short hash per top-level field of an ``immutable_view()``: ``status.launchedFields``,
    which says which fields changed after launch without copying the spec into status."""
    return {
        k: hashlib.sha256(
            json.dumps(v, sort_keys=True, separators=(",", ":")).encode()
        ).hexdigest()[:12]
        for k, v in view.items()
    }


def changed_immutable_fields(launched: dict[str, Any], current: JobSpec) -> list[str]:
    """Top-level fields whose value differs from the snapshot taken at launch (sorted)."""
    now = current.immutable_view()
    return sorted(k for k in set(launched) | set(now) if launched.get(k) != now.get(k))


def _value_at(obj: Any, loc: tuple[Any, ...]) -> Any:
    for part in loc:
        if (isinstance(obj, dict) and part in obj) or (
            isinstance(obj, list) and isinstance(part, int) and 0 <= part < len(obj)
        ):
            obj = obj[part]
        else:
            return None
    return obj


def _to_spec_error(raw: Any, exc: ValidationError) -> SpecError:
    err = exc.errors(include_url=False)[0]
    loc = tuple(
        p
        for p in err.get("loc", ())
        if not (isinstance(p, str) and p.startswith(("function-", "json-", "tagged-")))
    )
    # pydantic reports union branches as extra loc parts ('int', 'str', "literal['Auto']",
    # 'constrained-int'): drop them from the path.
    loc = tuple(
        p
        for p in loc
        if p not in ("int", "str", "bool", "float")
        and not (isinstance(p, str) and p.startswith(("literal[", "constrained-")))
    )
    msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
    etype = err.get("type", "")
    if etype == "value_error":
        # Model-level validators name their sub-field first ("nodeNames: ..."): fold it in.
        head, sep, rest = msg.partition(": ")
        if sep and re.fullmatch(r"[A-Za-z][A-Za-z0-9_.\[\]]*", head):
            field = "spec." + field_path(loc + tuple(head.split("."))) if loc else f"spec.{head}"
            return SpecError(field, rest)
        return SpecError("spec" + ("." + field_path(loc) if loc else ""), msg)
    field = "spec" + ("." + field_path(loc) if loc else "")
    if etype == "missing":
        return SpecError(field, "required field is missing")
    if etype == "extra_forbidden":
        return SpecError(field, "unknown field")
    value = err.get("input", _value_at(raw, loc))
    if any(f"literal['{AUTO}']" in map(str, e.get("loc", ())) for e in exc.errors()):
        msg += f", or '{AUTO}'"  # a sizing field: an integer or Auto
    return SpecError(field, f"{_short(value)} is invalid ({msg})")


def parse_spec(raw: Any) -> JobSpec:
    """Parse and validate ``MoETrainingJob.spec``; raises :class:`SpecError`."""
    if not isinstance(raw, dict):
        raise SpecError("spec", f"expected an object, got {type(raw).__name__}")
    try:
        return JobSpec.model_validate(raw)
    except ValidationError as exc:
        raise _to_spec_error(raw, exc) from None
