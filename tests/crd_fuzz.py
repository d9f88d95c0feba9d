"""Hypothesis strategies for MoETrainingJob manifests, derived from the CRD's openAPIV3Schema.

A manifest is a small valid job (CPU, tiny preset) with one to three fields replaced: half the
time by a plausible value the acceptance checks let through but the cluster or the planner must
cope with (a PriorityClass or PVC that does not exist, a deadline of 1 s, a TTL of 0, a model too
big for CPU memory, ...), half the time by a value drawn from the schema at a random path:
in-schema values (enums, patterns, bounds, nested objects), hostile strings and numbers that the
schema admits (paths, annotation keys, quantities), and now and then a value of the wrong type or
out of bounds (the API server must refuse those).
``hfConfig`` and ``deepspeedOverrides`` (typed key by key in the schema, from transformers and
DeepSpeed) get a preset's config with a perturbed key, and DeepSpeed sections of any type.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from hypothesis import strategies as st

from moejob_operator.core.models import preset_hf_config

CRD = Path(__file__).resolve().parents[1] / "crds" / "moetrainingjob.yaml"

HOSTILE_STRINGS = [
    "/",
    "/etc",
    "/var/run/docker.sock",
    "/tmp/../etc",
    "/ckpt",
    "/etc/moe",
    "/data",
    "a b",
    "a.b",
    "1x",
    "x" * 80,
    "",
    " ",
    "\n",
    "x;rm -rf /",
    "UPPER",
    "-x",
    "x-",
    "container.apparmor.security.beta.kubernetes.io/trainer",
    "seccomp.security.alpha.kubernetes.io/pod",
    "moe-operator.io/job",
    "app.kubernetes.io/managed-by",
    "system-node-critical",
    "nvidia.com/gpu",
    "1e308",
    "1e-400",
    "-1",
    "0",
    "500m",
    "16Gi",
    "lots",
    "none-such",
    "kueue.x-k8s.io/queue-name",
    "node-a",
    "node-b",
    "moe-trainer:local",
]
HOSTILE_INTS = [0, -1, 1, 2, 3, 7, 8, 2**31, 2**63 - 1, 10**12]
WRONG_TYPE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-10, 10**6),
    st.text(max_size=6),
    st.just([]),
    st.just({}),
    st.just([1, "a"]),
)
DS_SECTIONS = [
    "zero_optimization",
    "bf16",
    "fp16",
    "optimizer",
    "scheduler",
    "expert_parallel",
    "train_batch_size",
    "gradient_clipping",
    "steps_per_print",
    "wall_clock_breakdown",
]
PRESET = "tiny-mixtral"


# Values the schema and the acceptance checks let through but that the cluster, the planner or
# the gang logic must cope with: missing objects, odd scheduling, deadlines, TTLs, big models.
PLAUSIBLE: list[tuple[tuple[str, ...], Any]] = [
    (("scheduling", "priorityClassName"), "does-not-exist"),
    (("scheduling", "podLabels"), {"team": "a", "kueue.x-k8s.io/queue-name": "q"}),
    (("scheduling", "podAnnotations"), {"example.com/note": "free text"}),
    (("scheduling", "tolerations"), [{"operator": "Exists"}]),
    (
        ("scheduling", "tolerations"),
        [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    ),
    (
        ("resources",),
        {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": "2", "memory": "2Gi"}},
    ),
    (("resources",), {"requests": {"example.com/fpga": 1}, "limits": {"example.com/fpga": 1}}),
    (("resources",), {"limits": {"memory": "16Mi"}}),
    (("nodes", "nodeSelector"), {"kubernetes.io/os": "linux"}),
    (("nodes", "nodeNames"), ["node-b", "node-a"]),
    (("nodes", "nodeNames"), ["node-a", "node-x"]),
    (("nodes", "count"), 1),
    (("nodes", "count"), 3),
    (("runPolicy", "suspend"), True),
    (("runPolicy", "activeDeadlineSeconds"), 1),
    (("runPolicy", "ttlSecondsAfterFinished"), 0),
    (("device",), "GPU"),
    (("placement", "strategy"), "Balanced"),
    (("placement", "expertParallelSize"), 2),
    (("placement", "routingStatsFrom"), {"jobName": "nope"}),
    (("checkpoint", "volume"), {"persistentVolumeClaim": {"claimName": "missing-claim"}}),
    (("data",), {"kind": "Text", "path": "/data", "volume": {"configMap": {"name": "missing"}}}),
    (("model",), {"preset": "deepseek-v3"}),
    (
        ("model",),
        {"path": "/model", "volume": {"persistentVolumeClaim": {"claimName": "missing-models"}}},
    ),
    (("model",), {"path": "/no/such/model"}),
    (
        ("data",),
        {
            "kind": "JSONL",
            "volume": {"persistentVolumeClaim": {"claimName": "missing-corpus"}},
            "cache": {"volume": {"persistentVolumeClaim": {"claimName": "missing-cache"}}},
        },
    ),
    (("output",), {"volume": {"persistentVolumeClaim": {"claimName": "missing-exports"}}}),
    (("model",), {"preset": "tiny-qwen3-moe"}),
    (("training", "globalBatch"), 6),
    (("deepspeedOverrides",), {"zero_optimization": {"overlap_comm": False}}),
    (("imagePullPolicy",), "Never"),
    (("image",), "registry.example.com:5000/team/moe-trainer@sha256:" + "ab" * 32),
]


def spec_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def base_spec() -> dict[str, Any]:
    return {
        "image": "moe-trainer:local",
        "device": "CPU",
        "model": {"preset": PRESET},
        "nodes": {"count": 2},
        "training": {"steps": 5, "seqLen": 32, "globalBatch": 4, "microBatch": 2},
        "gate": {"skip": True, "skipReason": "fuzz"},
    }


def _string(s: dict[str, Any]) -> st.SearchStrategy:
    if "enum" in s:
        return st.sampled_from(s["enum"])
    limit = s.get("maxLength", 100)
    parts = [st.sampled_from(HOSTILE_STRINGS), st.text(max_size=min(limit, 30))]
    if "pattern" in s:
        parts.append(
            st.from_regex(s["pattern"], fullmatch="$" in s["pattern"]).filter(
                lambda x: len(x) <= limit
            )
        )
    return st.one_of(*parts)


def _integer(s: dict[str, Any]) -> st.SearchStrategy:
    lo, hi = s.get("minimum"), s.get("maximum")
    inside = st.integers(min_value=lo, max_value=hi)
    edges = [v for v in (lo, hi) if v is not None] + [
        v for v in HOSTILE_INTS if (lo is None or v >= lo) and (hi is None or v <= hi)
    ]
    return st.one_of(inside, st.sampled_from(edges)) if edges else inside


def _free_form(path: tuple[str, ...]) -> st.SearchStrategy:
    if path[-1] == "hfConfig":
        cfg = preset_hf_config(PRESET)
        keys = sorted(k for k, v in cfg.items() if isinstance(v, (int, str, bool)))
        return st.tuples(
            st.sampled_from(keys),
            st.one_of(st.sampled_from([*HOSTILE_INTS, 65536, 4096]), WRONG_TYPE),
        ).map(lambda kv: {**cfg, kv[0]: kv[1]})
    json_leaf = st.one_of(
        st.none(), st.booleans(), st.integers(-5, 10**9), st.sampled_from(HOSTILE_STRINGS)
    )
    value = st.recursive(
        json_leaf,
        lambda kids: st.dictionaries(
            st.sampled_from(["stage", "enabled", "type", "params", "lr", "overlap_comm", "x"]),
            kids,
            max_size=3,
        ),
        max_leaves=6,
    )
    return st.dictionaries(st.sampled_from(DS_SECTIONS), value, max_size=3)


def from_schema(s: dict[str, Any], path: tuple[str, ...] = (), depth: int = 0) -> st.SearchStrategy:
    """Values the schema ``s`` admits (mostly), hostile ones among them."""
    if path[-1:] in (("hfConfig",), ("deepspeedOverrides",)):
        return _free_form(path)  # typed key by key (crdgen): a preset's config, perturbed
    if s.get("x-kubernetes-int-or-string") or "anyOf" in s:
        return st.one_of(
            st.integers(-1, 10**6),
            st.sampled_from(["500m", "1Gi", "1e308", "2", "lots", "8Gi", "4Gi"]),
        )
    t = s.get("type")
    if t == "string":
        return _string(s)
    if t == "integer":
        return _integer(s)
    if t == "boolean":
        return st.booleans()
    if t == "number":
        return st.one_of(st.floats(-1e3, 1e9, allow_nan=False), st.sampled_from([0, 1e308]))
    if t == "array":
        return st.lists(
            from_schema(s.get("items") or {}, (*path, "[]"), depth + 1),
            max_size=min(s.get("maxItems", 3), 3),
        )
    if t == "object":
        if s.get("properties") and depth < 4:
            props = {k: from_schema(v, (*path, k), depth + 1) for k, v in s["properties"].items()}
            req = {k: props.pop(k) for k in s.get("required", []) if k in props}
            return st.fixed_dictionaries(req, optional=props)
        extra = s.get("additionalProperties")
        if isinstance(extra, dict):
            keys = st.one_of(
                st.sampled_from(HOSTILE_STRINGS),
                st.from_regex(r"[a-z][a-z0-9.-]{0,12}(/[a-z]{1,8})?", fullmatch=True),
            )
            return st.dictionaries(keys, from_schema(extra, (*path, "*"), depth + 1), max_size=3)
        return st.just({})
    return WRONG_TYPE


def _paths(s: dict[str, Any], path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], dict]]:
    out = [(path, s)] if path else []
    for k, v in (s.get("properties") or {}).items():
        out += _paths(v, (*path, k))
    return out


SCHEMA = spec_schema()
PATHS = _paths(SCHEMA)


def _set(doc: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    node = doc
    for key in path[:-1]:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[path[-1]] = value


@st.composite
def replacement(draw) -> tuple[tuple[str, ...], Any]:
    """(path, value): half plausible values, half drawn from the schema at a random path (about
    one in fifteen of those of the wrong type)."""
    if draw(st.booleans()):
        return draw(st.sampled_from(PLAUSIBLE))
    path, schema = draw(st.sampled_from(PATHS))
    wrong = draw(st.integers(0, 14)) == 0
    return path, draw(WRONG_TYPE if wrong else from_schema(schema, path))


@st.composite
def edits(draw) -> dict[str, Any]:
    """A merge patch of ``spec`` replacing one field (an edit after the job was accepted)."""
    path, value = draw(replacement())
    patch: dict[str, Any] = {}
    _set(patch, path, copy.deepcopy(value))
    return patch


@st.composite
def manifests(draw, index: int, prefix: str) -> dict[str, Any]:
    """One MoETrainingJob: the base job with 1-3 fields replaced; a unique name (sometimes one the
    API server or the operator must refuse)."""
    spec = base_spec()
    for _ in range(draw(st.integers(1, 3))):
        path, value = draw(replacement())
        _set(spec, path, copy.deepcopy(value))
    # pods never run a trainer here: no scheduler by this name, they stay Pending
    if isinstance(spec.get("scheduling"), dict):
        spec["scheduling"]["schedulerName"] = "none-such"
    elif "scheduling" not in spec:
        spec["scheduling"] = {"schedulerName": "none-such"}
    name = draw(st.sampled_from(["{p}-{i}"] * 6 + ["{p}.{i}", "{i}{p}", "{p}-{i}-" + "x" * 44]))
    return {
        "apiVersion": "moe-operator.io/v1alpha1",
        "kind": "MoETrainingJob",
        "metadata": {"name": name.format(p=prefix, i=index)},
        "spec": spec,
    }
