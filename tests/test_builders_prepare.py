"""The inspection and data-prepare pods and the job's new volumes (pure builders): read-only
model and data everywhere, only the prepare pod's cache writable, non-root, no GPU, least
privilege; the workers mount model, cache and output at the spec's paths."""

from __future__ import annotations

import pytest

from moejob_operator import constants as C
from moejob_operator.builders import prepare as B
from moejob_operator.builders import workers
from moejob_operator.builders.common import JobRef
from moejob_operator.spec import parse_spec

JOB = JobRef("team", "ft", "0b6f6c2e-6f1d-4f43-9d0e-3f5a1f1a9b11")
SPEC = {
    "image": "reg.io/trainer:1",
    "model": {
        "path": "/models/qwen",
        "volume": {"persistentVolumeClaim": {"claimName": "models"}},
        "subPath": "qwen3-30b-a3b",
    },
    "data": {
        "kind": "JSONL",
        "format": "Chat",
        "volume": {"persistentVolumeClaim": {"claimName": "corpus", "readOnly": False}},
        "cache": {"volume": {"persistentVolumeClaim": {"claimName": "cache"}}},
    },
    "output": {
        "volume": {"persistentVolumeClaim": {"claimName": "exports"}},
        "everyCheckpoints": 2,
    },
    "nodes": {"count": 2, "gpusPerNode": 8, "nodeNames": ["n1", "n2"]},
    "training": {"globalBatch": 16},
}


def _mounts(pod):
    c = pod["spec"]["containers"][0]
    vols = {v["name"]: v for v in pod["spec"]["volumes"]}
    return {m["mountPath"]: (m, vols[m["name"]]) for m in c["volumeMounts"]}


def test_inspect_pod_reads_the_model_read_only_as_non_root():
    spec = parse_spec(SPEC)
    pod = B.inspect_pod(JOB, spec)
    c = pod["spec"]["containers"][0]
    assert c["command"] == ["moe-inspect"]
    assert c["args"] == ["/models/qwen", "--configmap", "ft-model", "--key", "model_report.json"]
    m, v = _mounts(pod)["/models/qwen"]
    assert m["readOnly"] and m["subPath"] == "qwen3-30b-a3b"
    assert v["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert c["securityContext"]["readOnlyRootFilesystem"] and c["securityContext"]["runAsNonRoot"]
    assert pod["spec"]["securityContext"]["runAsUser"] != 0
    assert C.GPU_RESOURCE not in str(c["resources"])
    assert pod["metadata"]["ownerReferences"][0]["uid"] == JOB.uid
    term = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["nodeSelectorTerms"][0]["matchFields"][0]["values"] == ["n1", "n2"]
    assert B.inspect_pod(JOB, spec, recheck=True)["metadata"]["name"] == "ft-inspect-launch"


def test_prepare_pod_writes_only_the_cache():
    spec = parse_spec(SPEC)
    pod = B.prepare_pod(JOB, spec, tokenizer="/models/qwen", vocab_size=151936)
    c = pod["spec"]["containers"][0]
    args = c["args"]
    assert args[args.index("--format") + 1] == "chat"
    assert args[args.index("--field") + 1] == "messages"
    assert args[args.index("--out-root") + 1] == "/data-cache/prepared-data"
    assert args[args.index("--tokenizer") + 1] == "/models/qwen"
    mounts = _mounts(pod)
    assert mounts["/models/qwen"][0]["readOnly"] and mounts["/data"][0]["readOnly"]
    # the data claim says readOnly: false, the prepare pod still mounts it read-only
    assert mounts["/data"][1]["persistentVolumeClaim"]["readOnly"] is True
    assert not mounts["/data-cache"][0].get("readOnly")
    assert mounts["/tmp"][1] == {"name": "scratch", "emptyDir": {}}


def test_prepare_pod_without_cache_writes_under_the_checkpoint_volume():
    raw = {**SPEC, "data": {k: v for k, v in SPEC["data"].items() if k != "cache"}}
    raw["checkpoint"] = {"volume": {"persistentVolumeClaim": {"claimName": "ck"}}}
    pod = B.prepare_pod(JOB, parse_spec(raw), tokenizer=None, vocab_size=320)
    args = pod["spec"]["containers"][0]["args"]
    assert args[args.index("--out-root") + 1] == "/ckpt/prepared-data"
    assert "--tokenizer" not in args
    assert not _mounts(pod)["/ckpt"][0].get("readOnly")


def test_prepare_role_names_only_its_two_configmaps():
    sa, role, binding = B.rbac_objects(JOB)
    assert role["rules"] == [
        {
            "apiGroups": [""],
            "resources": ["configmaps"],
            "resourceNames": ["ft-model", "ft-data"],
            "verbs": ["get", "update", "patch"],
        }
    ]
    assert binding["subjects"][0]["name"] == sa["metadata"]["name"] == "ft-prepare"


def test_workers_mount_model_cache_and_output():
    spec = parse_spec(SPEC)
    pod = workers.worker_pod(JOB, spec, node_rank=0, node="n1", attempt=0, spec_hash="h")
    mounts = _mounts(pod)
    assert mounts["/models/qwen"][0]["readOnly"] and mounts["/data-cache"][0]["readOnly"]
    assert mounts["/data"][0]["readOnly"]
    out, vol = mounts["/output"]
    assert not out.get("readOnly") and vol["persistentVolumeClaim"] == {"claimName": "exports"}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (
            {"data": {"kind": "Text", "field": "body", "volume": {"configMap": {"name": "x"}}}},
            "spec.data.field",
        ),
        ({"model": {"preset": "tiny-mixtral", "subPath": "x"}}, "spec.model.subPath"),
    ],
)
def test_field_errors_name_the_field(change, field):
    from moejob_operator.spec import SpecError

    with pytest.raises(SpecError, match=rf"^{field}: "):
        parse_spec({**SPEC, **change})
