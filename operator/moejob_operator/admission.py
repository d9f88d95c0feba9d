"""Acceptance checks beyond the spec's types: what the cluster admin allows (host paths), what
the API server would refuse later on a child (names, label and annotation syntax, duplicate mount
paths, quantities, image references, sizes) and what no user may set (security annotations).

:func:`check` runs on every pass right after :func:`moejob_operator.spec.parse_spec`, before any
child exists, and raises the same :class:`SpecError` (the field path and the value): a job the
API server would refuse a worker pod for fails ``InvalidSpec`` at acceptance instead of retrying
a create that can never succeed.

The :class:`Policy` comes from the operator's environment (the chart sets it), read once when
``moectl operator`` starts (:meth:`Policy.from_env`) and passed to every pass:
``MOE_ALLOWED_HOST_PATH_PREFIXES`` lists the host directories jobs may mount (comma-separated;
empty, the default: no ``hostPath`` at all). ``MOE_OPERATOR_TEST_MODE=1`` turns on the test-only
hooks (fault-injection annotations, ``MOE_OPERATOR_CRASH_AT``: :func:`test_faults`).
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from types import ModuleType
from typing import Any

from . import constants as C
from .builders.common import MAX_JOB_NAME, SA_TOKEN_DIR
from .spec import HostPathSource, JobSpec, SpecError

ENV_HOST_PATH_PREFIXES = "MOE_ALLOWED_HOST_PATH_PREFIXES"
ENV_TEST_MODE = "MOE_OPERATOR_TEST_MODE"

MAX_SPEC_BYTES = 128 * 1024  # the spec as JSON; children copy parts of it (pods, plan)
MAX_POD_METADATA_BYTES = 64 * 1024  # podAnnotations + podLabels, copied onto every worker pod

# Pod annotations that change the pod's security profile or the container runtime's behaviour:
# AppArmor off, a seccomp profile fighting the pod's own, CRI-O / Kata / containerd runtime knobs
# (devices, user namespaces, ...), and the operator's own keys.
RESERVED_ANNOTATION_PREFIXES = (
    "container.apparmor.security.beta.kubernetes.io/",
    "seccomp.security.alpha.kubernetes.io/",
    "container.seccomp.security.alpha.kubernetes.io/",
    "io.kubernetes.cri-o.",
    "io.katacontainers.",
    "io.containerd.",
    "kubernetes.io/psp",
    f"{C.GROUP}/",
)
RESERVED_LABEL_PREFIXES = (f"{C.GROUP}/", C.LABEL_MANAGED_BY)
# PriorityClasses only the cluster's own components should use (they preempt everything else).
RESERVED_PRIORITY_PREFIX = "system-"
# Where the operator mounts its own volumes in the worker container, and kernel filesystems.
RESERVED_MOUNTS = (C.PLAN_MOUNT_DIR, "/dev/shm", SA_TOKEN_DIR)
FORBIDDEN_MOUNT_ROOTS = ("/proc", "/sys", "/dev")

# Upper bounds of resource quantities (a typo's 1e308 is refused, a real machine fits).
QUANTITY_LIMITS = {
    "cpu": Decimal(100_000),
    "memory": Decimal(2) ** 50,
    "ephemeral-storage": Decimal(2) ** 60,
}
DEFAULT_QUANTITY_LIMIT = Decimal(2) ** 50

_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = re.compile(rf"^{_DNS1123_LABEL}(\.{_DNS1123_LABEL})*$")
_NAME_PART = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_RESOURCE_STANDARD = re.compile(r"^(cpu|memory|ephemeral-storage|hugepages-[0-9]+[KMGTPE]i?)$")

# The image reference grammar of distribution/reference (what the kubelet pulls).
_ALNUM = r"[a-z0-9]+"
_COMPONENT = rf"{_ALNUM}(?:(?:[._]|__|-+){_ALNUM})*"
_DOMAIN_PART = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"(?:{_DOMAIN_PART}(?:\.{_DOMAIN_PART})*(?::[0-9]+)?)"
_IMAGE = re.compile(
    rf"^(?:{_DOMAIN}/)?{_COMPONENT}(?:/{_COMPONENT})*"
    r"(?::[\w][\w.-]{0,127})?"
    r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?$"
)

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")

_SUFFIX: dict[str, int | Decimal] = {
    "": 1,
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}
_QUANTITY = re.compile(
    r"^\+?([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:([eE][-+]?[0-9]+)|(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]))?$"
)


@dataclass(frozen=True)
class Policy:
    """What the cluster admin allows (from the operator's environment, set by the chart)."""

    host_path_prefixes: tuple[str, ...] = ()
    test_mode: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Policy:
        raw = env.get(ENV_HOST_PATH_PREFIXES, "")
        prefixes = tuple(
            posixpath.normpath(p.strip()) for p in raw.split(",") if p.strip().startswith("/")
        )
        return cls(
            host_path_prefixes=prefixes,
            test_mode=env.get(ENV_TEST_MODE, "").lower() in ("1", "true", "yes"),
        )


def test_faults(policy: Policy) -> ModuleType | None:
    """The fault-injection hooks when ``policy`` is in test mode, else None: the dev package's
    ``moe_faults`` (operator/dev; the images do not install it). The only way product code
    reaches them."""
    if not policy.test_mode:
        return None
    try:
        import moe_faults
    except ImportError:
        return None
    hooks: ModuleType = moe_faults
    return hooks


# ---- names --------------------------------------------------------------------------------
def check_job_name(name: str) -> None:
    """The Service ``<name>-workers`` must be a DNS-1035 label and ``<name>-worker-<rank>`` a
    pod hostname: no dots, a letter first, at most MAX_JOB_NAME characters."""
    if len(name) > MAX_JOB_NAME:
        raise SpecError(
            "metadata.name",
            f"{name!r} is longer than {MAX_JOB_NAME} characters "
            "(worker pod hostnames must fit in 63)",
        )
    if not _DNS1035.match(name):
        raise SpecError(
            "metadata.name",
            f"{name!r} must start with a lowercase letter and hold only "
            "lowercase letters, digits and '-' (no dots): the job's Service name "
            f"{name}-workers must be a DNS-1035 label",
        )


def _qualified_name(field: str, key: str) -> None:
    """A label / annotation / nodeSelector key: ``[prefix/]name`` as Kubernetes validates it."""
    prefix, sep, name = key.rpartition("/")
    if sep and (not prefix or len(prefix) > 253 or not _DNS1123_SUBDOMAIN.match(prefix)):
        raise SpecError(field, f"key {key!r}: the prefix must be a DNS subdomain (lowercase, dots)")
    if not name or len(name) > 63 or not _NAME_PART.match(name):
        raise SpecError(
            field,
            f"key {key!r}: the name must be 1-63 characters of [A-Za-z0-9-_.], "
            "beginning and ending with a letter or digit",
        )


def _label_value(field: str, key: str, value: str) -> None:
    if value and (len(value) > 63 or not _NAME_PART.match(value)):
        raise SpecError(
            f"{field}.{key}",
            f"{value!r} is not a label value (at most 63 characters "
            "of [A-Za-z0-9-_.], beginning and ending with a letter or digit)",
        )


def _labels(field: str, labels: dict[str, str] | None) -> None:
    for key, value in (labels or {}).items():
        _qualified_name(field, key)
        _label_value(field, key, value)


def _object_name(field: str, name: str) -> None:
    if not _DNS1123_SUBDOMAIN.match(name):
        raise SpecError(
            field, f"{name!r} is not an object name (lowercase letters, digits, '-', '.')"
        )


def _starts(key: str, prefixes: tuple[str, ...]) -> str | None:
    return next((p for p in prefixes if key.startswith(p)), None)


def _scheduling(spec: JobSpec) -> None:
    s = spec.scheduling
    _labels("spec.nodes.nodeSelector", spec.nodes.node_selector)
    _labels("spec.scheduling.nodeSelector", s.node_selector)
    for key, value in (spec.nodes.node_selector or {}).items():
        other = (s.node_selector or {}).get(key)
        if other is not None and other != value:
            raise SpecError(
                f"spec.scheduling.nodeSelector.{key}",
                f"{other!r} contradicts "
                f"spec.nodes.nodeSelector.{key} = {value!r}: no node can match both",
            )
    _labels("spec.scheduling.podLabels", s.pod_labels)
    for key in s.pod_labels or {}:
        if _starts(key, RESERVED_LABEL_PREFIXES):
            raise SpecError(
                "spec.scheduling.podLabels", f"key {key!r} is reserved for the operator"
            )
    for key in s.pod_annotations or {}:
        _qualified_name("spec.scheduling.podAnnotations", key)
        if _starts(key, RESERVED_ANNOTATION_PREFIXES):
            raise SpecError(
                "spec.scheduling.podAnnotations",
                f"key {key!r} is reserved: it changes "
                "the pod's security profile or runtime (or belongs to the operator)",
            )
    size = len(json.dumps([s.pod_annotations or {}, s.pod_labels or {}]))
    if size > MAX_POD_METADATA_BYTES:
        raise SpecError(
            "spec.scheduling.podAnnotations",
            f"podAnnotations and podLabels take "
            f"{size} bytes; at most {MAX_POD_METADATA_BYTES} are copied onto pods",
        )
    for i, t in enumerate(s.tolerations or ()):
        where = f"spec.scheduling.tolerations[{i}]"
        if t.key:
            _qualified_name(f"{where}.key", t.key)
        elif t.operator != "Exists":
            raise SpecError(f"{where}.operator", "must be 'Exists' when the key is empty")
        if t.operator == "Exists" and t.value:
            raise SpecError(
                f"{where}.value", f"{t.value!r}: must be empty when operator is 'Exists'"
            )
        if t.value:
            _label_value(where, "value", t.value)
        if t.toleration_seconds is not None and t.effect != "NoExecute":
            raise SpecError(f"{where}.tolerationSeconds", "only allowed with effect 'NoExecute'")
    if s.priority_class_name is not None:
        _object_name("spec.scheduling.priorityClassName", s.priority_class_name)
        if s.priority_class_name.startswith(RESERVED_PRIORITY_PREFIX):
            raise SpecError(
                "spec.scheduling.priorityClassName",
                f"{s.priority_class_name!r}: "
                "the system-* classes are reserved for cluster components",
            )
    if s.scheduler_name is not None:
        _object_name("spec.scheduling.schedulerName", s.scheduler_name)


# ---- volumes and mounts -------------------------------------------------------------------
def _host_path(field: str, path: str, policy: Policy) -> str:
    """The longest allowed prefix ``path`` lies under (lexically: the pods mount that prefix and
    reach ``path`` through a subPath, so the kubelet resolves symlinks inside it)."""
    norm = posixpath.normpath(path)
    if ".." in path.split("/") or (norm != path.rstrip("/") and path != "/"):
        raise SpecError(field, f"{path!r} is not a normalised absolute path")
    allowed = [
        p for p in policy.host_path_prefixes if norm == p or norm.startswith(p.rstrip("/") + "/")
    ]
    if not allowed:
        where = (
            f"allowed prefixes: {', '.join(policy.host_path_prefixes)}"
            if policy.host_path_prefixes
            else "no host path is allowed on this cluster"
        )
        raise SpecError(
            field,
            f"{path!r}: hostPath volumes are refused by the operator's policy "
            f"({where}; the chart value hostPathPolicy.allowedPrefixes, the operator's "
            f"${ENV_HOST_PATH_PREFIXES})",
        )
    return max(allowed, key=len)


def _mount_path(field: str, path: str) -> str:
    norm = posixpath.normpath(path)
    if ".." in path.split("/") or ":" in path:
        raise SpecError(field, f"{path!r} may not contain '..' or ':'")
    if norm == "/":
        raise SpecError(field, f"{path!r}: cannot mount over the container's root")
    for root in FORBIDDEN_MOUNT_ROOTS + RESERVED_MOUNTS:
        if norm == root or norm.startswith(root + "/") or root.startswith(norm + "/"):
            raise SpecError(field, f"{path!r} overlaps {root} (reserved in the worker container)")
    return norm


def host_path_sources(spec: JobSpec) -> list[tuple[str, HostPathSource]]:
    """Every hostPath in ``spec`` with its field path."""
    vols = [
        ("spec.checkpoint", spec.checkpoint.volume),
        ("spec.data", spec.data.volume),
        ("spec.model", spec.model.volume if spec.model.path is not None else None),
        ("spec.data.cache", spec.data.cache.volume if spec.data.cache is not None else None),
        ("spec.output", spec.output.volume if spec.output is not None else None),
    ]
    return [
        (f"{field}.volume.hostPath.path", vol.host_path)
        for field, vol in vols
        if vol is not None and vol.host_path is not None
    ]


def bind_host_paths(spec: JobSpec, policy: Policy) -> None:
    """Record on each hostPath of ``spec`` the allowed prefix it lies under (raises
    :class:`SpecError` for one under none). The builders mount only bound prefixes."""
    for field, hp in host_path_sources(spec):
        hp._allowed_prefix = _host_path(field, hp.path, policy)


def _volumes(spec: JobSpec, policy: Policy) -> None:
    ck, dv = spec.checkpoint.volume, spec.data.volume
    if ck is not None and ck.host_path is not None:
        _host_path("spec.checkpoint.volume.hostPath.path", ck.host_path.path, policy)
    if ck is not None and ck.persistent_volume_claim is not None:
        _object_name(
            "spec.checkpoint.volume.persistentVolumeClaim.claimName",
            ck.persistent_volume_claim.claim_name,
        )
    if dv is not None:
        if dv.host_path is not None:
            _host_path("spec.data.volume.hostPath.path", dv.host_path.path, policy)
        if dv.persistent_volume_claim is not None:
            _object_name(
                "spec.data.volume.persistentVolumeClaim.claimName",
                dv.persistent_volume_claim.claim_name,
            )
        if dv.config_map is not None:
            _object_name("spec.data.volume.configMap.name", dv.config_map.name)
    ckpt = _mount_path("spec.checkpoint.path", spec.checkpoint.path)
    if dv is not None:
        data = _mount_path("spec.data.path", spec.data.path)
        if data == ckpt:
            raise SpecError(
                "spec.data.path",
                f"{spec.data.path!r} is also spec.checkpoint.path: "
                "two volumes cannot be mounted at one path",
            )
    _job_input_volumes(spec, policy)


def _job_input_volumes(spec: JobSpec, policy: Policy) -> None:
    """The model, data-cache and output volumes: allowed host paths, claim names, and mount
    paths apart from each other and from the checkpoint and data mounts (none inside another:
    the prepare pod and the workers mount them together)."""
    mounts = [("spec.checkpoint.path", spec.checkpoint.path)]
    if spec.data.volume is not None:
        mounts.append(("spec.data.path", spec.data.path))
    extra = []
    if spec.model.path is not None and spec.model.volume is not None:
        extra.append(("spec.model", spec.model.volume, spec.model.path))
    if spec.data.cache is not None:
        extra.append(("spec.data.cache", spec.data.cache.volume, spec.data.cache.path))
    if spec.output is not None:
        extra.append(("spec.output", spec.output.volume, spec.output.path))
    for field, vol, path in extra:
        if vol.host_path is not None:
            _host_path(f"{field}.volume.hostPath.path", vol.host_path.path, policy)
        if vol.persistent_volume_claim is not None:
            _object_name(
                f"{field}.volume.persistentVolumeClaim.claimName",
                vol.persistent_volume_claim.claim_name,
            )
        norm = _mount_path(f"{field}.path", path)
        for other_field, other in mounts:
            o = posixpath.normpath(other)
            if norm == o or norm.startswith(o + "/") or o.startswith(norm + "/"):
                raise SpecError(
                    f"{field}.path",
                    f"{path!r} overlaps {other_field} {other!r}: each volume needs a mount "
                    "path of its own",
                )
        mounts.append((f"{field}.path", path))


# ---- quantities ---------------------------------------------------------------------------
def parse_quantity(q: int | str) -> Decimal:
    """A Kubernetes quantity (``500m``, ``16Gi``, ``1e3``) as a number; ValueError if it is none."""
    if isinstance(q, bool):
        raise ValueError(f"{q!r} is not a quantity")
    if isinstance(q, int):
        return Decimal(q)
    m = _QUANTITY.match(q)
    if not m:
        raise ValueError(f"{q!r} is not a quantity")
    try:
        number = Decimal(m.group(1))
        if m.group(2):
            return number * Decimal(10) ** int(m.group(2)[1:])
    except (InvalidOperation, ValueError, OverflowError):
        raise ValueError(f"{q!r} is not a quantity") from None
    return number * Decimal(_SUFFIX[m.group(3) or ""])


def _resources(spec: JobSpec) -> None:
    parsed: dict[str, dict[str, Decimal]] = {}
    for group in ("requests", "limits"):
        parsed[group] = {}
        for name, q in (getattr(spec.resources, group) or {}).items():
            field = f"spec.resources.{group}.{name}"
            if name == C.GPU_RESOURCE:
                raise SpecError(field, "set by the operator from spec.nodes.gpusPerNode")
            standard = bool(_RESOURCE_STANDARD.match(name))
            if not standard:
                if "/" not in name:
                    raise SpecError(
                        field,
                        f"{name!r} is neither cpu, memory, ephemeral-storage, "
                        "hugepages-<size> nor a domain-qualified extended resource",
                    )
                _qualified_name(field, name)
            try:
                value = parse_quantity(q)
            except ValueError as exc:
                raise SpecError(field, str(exc)) from None
            limit = QUANTITY_LIMITS.get(name, DEFAULT_QUANTITY_LIMIT)
            if value > limit:
                raise SpecError(field, f"{q!r} exceeds {limit:.3g}")
            if not standard and value != value.to_integral_value():
                raise SpecError(field, f"{q!r}: extended resources are whole numbers")
            parsed[group][name] = value
    for name, req in parsed["requests"].items():
        lim = parsed["limits"].get(name)
        if lim is not None and req > lim:
            # both groups name ``name``: neither is None here
            requests, limits = spec.resources.requests or {}, spec.resources.limits or {}
            raise SpecError(
                f"spec.resources.requests.{name}",
                f"{requests[name]!r} is larger than the limit {limits[name]!r}",
            )
        if lim is not None and not _RESOURCE_STANDARD.match(name) and req != lim:
            raise SpecError(
                f"spec.resources.requests.{name}",
                "an extended resource's request must equal its limit",
            )


# ---- the rest -----------------------------------------------------------------------------
def _image(spec: JobSpec) -> None:
    if not _IMAGE.match(spec.image) or len(spec.image) > 512:
        raise SpecError(
            "spec.image",
            f"{spec.image[:80]!r} is not an image reference "
            "([registry/]repository[:tag][@digest], lowercase repository)",
        )
    for i, ref in enumerate(spec.image_pull_secrets or ()):
        _object_name(f"spec.imagePullSecrets[{i}].name", ref.name)
    algo, sep, hexpart = spec.image.partition("@")[2].partition(":")
    if sep and algo == "sha256" and not _SHA256_HEX.fullmatch(hexpart):
        raise SpecError(
            "spec.image",
            f"{spec.image[:120]!r}: a sha256 digest is exactly 64 lowercase hex characters "
            f"(got {len(hexpart)})",
        )


def _size(raw: Any) -> None:
    size = len(json.dumps(raw, separators=(",", ":")))
    if size > MAX_SPEC_BYTES:
        raise SpecError(
            "spec",
            f"is {size} bytes as JSON; at most {MAX_SPEC_BYTES} are accepted "
            "(the plan and every worker pod copy parts of it)",
        )


def _overrides(spec: JobSpec) -> None:
    """deepspeedOverrides are deep-merged into the generated config: a section the config has as
    an object must stay one, and an explicit null on a protected key is an override too."""
    from .spec import PROTECTED_DEEPSPEED_KEYS

    ov = spec.deepspeed_overrides or {}
    for path in PROTECTED_DEEPSPEED_KEYS:
        node: Any = ov
        for key in path[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict) and path[-1] in node:
            raise SpecError(
                f"spec.deepspeedOverrides.{'.'.join(path)}",
                "the plan sets this key; it cannot be overridden (not even with null)",
            )
    for key in SECTIONS:
        if key in ov and not isinstance(ov[key], dict):
            raise SpecError(
                f"spec.deepspeedOverrides.{key}",
                f"{_short(ov[key])} must be an object (the generated config has {key} as one)",
            )


# Sections of the generated DeepSpeed config that are objects (core/dsconfig.py).
SECTIONS = (
    "zero_optimization",
    "expert_parallel",
    "bf16",
    "fp16",
    "optimizer",
    "scheduler",
    "gradient_clipping_config",
    "activation_checkpointing",
    "comms_logger",
    "flops_profiler",
    "wall_clock_breakdown_config",
    "data_types",
    "checkpoint",
    "aio",
    "moe",
)


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check(name: str, raw: Any, spec: JobSpec, policy: Policy) -> None:
    """Everything above; raises :class:`SpecError` naming the first offending field."""
    check_job_name(name)
    _size(raw)
    _image(spec)
    _scheduling(spec)
    _volumes(spec, policy)
    bind_host_paths(spec, policy)
    _resources(spec)
    _overrides(spec)
