"""Acceptance checks beyond the spec's types (moejob_operator.admission): the host-path policy,
reserved keys, Kubernetes syntax, quantities, image references and sizes. No cluster; the
cluster tests (test_operator_badspecs.py, test_operator_hostile.py) run the same manifests
through the real API server and operator."""

from __future__ import annotations

from decimal import Decimal

import pytest

from moejob_operator import admission
from moejob_operator.admission import Policy, check, parse_quantity
from moejob_operator.spec import SpecError, parse_spec

BASE = {
    "image": "moe-trainer:local",
    "device": "CPU",
    "model": {"preset": "tiny-mixtral"},
    "nodes": {"count": 2},
    "training": {"steps": 5, "seqLen": 32, "globalBatch": 4, "microBatch": 2},
}
NONE = Policy()  # the chart's default: no host path
SHARED = Policy(host_path_prefixes=("/mnt/shared",))


def spec_with(**groups) -> dict:
    raw = {**BASE}
    for k, v in groups.items():
        raw[k] = (
            {**raw.get(k, {}), **v} if isinstance(v, dict) and isinstance(raw.get(k), dict) else v
        )
    return raw


def refuse(raw: dict, policy: Policy = NONE, name: str = "job") -> SpecError:
    with pytest.raises(SpecError) as err:
        check(name, raw, parse_spec(raw), policy)
    return err.value


def accept(raw: dict, policy: Policy = NONE, name: str = "job") -> None:
    check(name, raw, parse_spec(raw), policy)


def ckpt_host(path: str) -> dict:
    return spec_with(checkpoint={"volume": {"hostPath": {"path": path}}})


# ---- host paths ----------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/", "/etc", "/var/run/docker.sock", "/tmp", "/mnt/shared"])
def test_default_policy_refuses_every_host_path(path):
    err = refuse(ckpt_host(path))
    assert err.field == "spec.checkpoint.volume.hostPath.path"
    assert "no host path is allowed" in str(err) and "hostPathPolicy.allowedPrefixes" in str(err)


def test_allowed_prefix_and_below_are_accepted_and_nothing_else():
    accept(ckpt_host("/mnt/shared"), SHARED)
    accept(ckpt_host("/mnt/shared/team-a/ckpt"), SHARED)
    for path in ("/mnt/shared-other", "/mnt", "/", "/mnt/shared/../../etc", "/mnt/shared/./x"):
        err = refuse(ckpt_host(path), SHARED)
        assert err.field == "spec.checkpoint.volume.hostPath.path", path
    data = spec_with(
        data={
            "kind": "Text",
            "path": "/data",
            "volume": {"hostPath": {"path": "/var/run/docker.sock"}},
        }
    )
    assert refuse(data, SHARED).field == "spec.data.volume.hostPath.path"


def test_policy_from_env():
    assert Policy.from_env({}) == Policy()
    p = Policy.from_env(
        {admission.ENV_HOST_PATH_PREFIXES: " /mnt/a/ ,relative,, /b", admission.ENV_TEST_MODE: "1"}
    )
    assert p.host_path_prefixes == ("/mnt/a", "/b") and p.test_mode
    assert not Policy.from_env({admission.ENV_TEST_MODE: ""}).test_mode


# ---- names, labels, annotations -----------------------------------------------------------
@pytest.mark.parametrize("name", ["with.dot", "1st", "UPPER", "x" * 49, "-lead", "trail-"])
def test_job_names_that_children_could_not_carry(name):
    with pytest.raises(SpecError, match=r"metadata.name"):
        admission.check_job_name(name)


@pytest.mark.parametrize(
    "key",
    [
        "container.apparmor.security.beta.kubernetes.io/trainer",
        "seccomp.security.alpha.kubernetes.io/pod",
        "container.seccomp.security.alpha.kubernetes.io/trainer",
        "io.kubernetes.cri-o.Devices",
        "moe-operator.io/spec-hash",
    ],
)
def test_reserved_annotations(key):
    err = refuse(spec_with(scheduling={"podAnnotations": {key: "x"}}))
    assert err.field == "spec.scheduling.podAnnotations" and "reserved" in str(err)


def test_ordinary_pass_through_is_accepted():
    accept(
        spec_with(
            scheduling={
                "podAnnotations": {
                    "cluster-autoscaler.kubernetes.io/safe-to-evict": "false",
                    "note": "free text ok",
                },
                "podLabels": {"kueue.x-k8s.io/queue-name": "gpu-queue", "team": ""},
                "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
                "tolerations": [
                    {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                    {"operator": "Exists"},
                ],
                "priorityClassName": "ml-high",
            }
        )
    )


@pytest.mark.parametrize(
    ("sched", "field"),
    [
        ({"podLabels": {"team": "ml platform"}}, "spec.scheduling.podLabels.team"),
        ({"podLabels": {"x": "a" * 64}}, "spec.scheduling.podLabels.x"),
        ({"podLabels": {"app.kubernetes.io/managed-by": "me"}}, "spec.scheduling.podLabels"),
        ({"podAnnotations": {"a b": "x"}}, "spec.scheduling.podAnnotations"),
        ({"podAnnotations": {"Example.COM/x": "x"}}, "spec.scheduling.podAnnotations"),
        ({"nodeSelector": {"pool": "a b"}}, "spec.scheduling.nodeSelector.pool"),
        (
            {"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]},
            "spec.scheduling.tolerations[0].value",
        ),
        (
            {"tolerations": [{"key": "k", "tolerationSeconds": 5, "effect": "NoSchedule"}]},
            "spec.scheduling.tolerations[0].tolerationSeconds",
        ),
        ({"priorityClassName": "system-cluster-critical"}, "spec.scheduling.priorityClassName"),
        ({"schedulerName": "Not_A_Name"}, "spec.scheduling.schedulerName"),
    ],
)
def test_scheduling_refusals_name_their_field(sched, field):
    assert refuse(spec_with(scheduling=sched)).field == field


def test_pod_metadata_size_is_bounded():
    big = {f"k{i}": "v" * 60 for i in range(1200)}
    assert (
        refuse(spec_with(scheduling={"podLabels": big})).field == "spec.scheduling.podAnnotations"
    )


def test_spec_size_is_bounded():
    raw = spec_with(scheduling={"podAnnotations": {"note": "x" * (admission.MAX_SPEC_BYTES + 1)}})
    err = refuse(raw)
    assert err.field == "spec" and "bytes" in str(err)


# ---- mounts, quantities, images, overrides ------------------------------------------------
@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (spec_with(checkpoint={"path": "/etc/moe"}), "spec.checkpoint.path"),
        (spec_with(checkpoint={"path": "/dev/shm/x"}), "spec.checkpoint.path"),
        (spec_with(checkpoint={"path": "/"}), "spec.checkpoint.path"),
        (spec_with(checkpoint={"path": "/a/../b"}), "spec.checkpoint.path"),
        (
            spec_with(
                data={"kind": "Text", "path": "/ckpt/", "volume": {"configMap": {"name": "c"}}}
            ),
            "spec.data.path",
        ),
    ],
)
def test_mount_paths(raw, field):
    assert refuse(raw).field == field


def test_quantities():
    assert parse_quantity("500m") == Decimal("0.5")
    assert parse_quantity("16Gi") == 16 * 2**30
    assert parse_quantity("1e3") == 1000 and parse_quantity(4) == 4
    for bad in ("lots", "1.5.2", "Gi", "1e", True):
        with pytest.raises(ValueError):  # noqa: PT011 - each bad value has its own message
            parse_quantity(bad)


@pytest.mark.parametrize(
    ("res", "field"),
    [
        (
            {"requests": {"memory": "8Gi"}, "limits": {"memory": "4Gi"}},
            "spec.resources.requests.memory",
        ),
        ({"requests": {"cpu": "2"}, "limits": {"cpu": "1500m"}}, "spec.resources.requests.cpu"),
        ({"requests": {"memory": "1e308"}}, "spec.resources.requests.memory"),
        ({"limits": {"cpu": "1e9"}}, "spec.resources.limits.cpu"),
        ({"limits": {"gpus": 1}}, "spec.resources.limits.gpus"),
        ({"limits": {"nvidia.com/gpu": 1}}, "spec.resources.limits.nvidia.com/gpu"),
        ({"limits": {"rdma/hca": "500m"}}, "spec.resources.limits.rdma/hca"),
        (
            {"requests": {"rdma/hca": 1}, "limits": {"rdma/hca": 2}},
            "spec.resources.requests.rdma/hca",
        ),
    ],
)
def test_resource_refusals(res, field):
    assert refuse(spec_with(resources=res)).field == field


def test_request_over_limit_names_both_as_written():
    err = refuse(spec_with(resources={"requests": {"cpu": "2"}, "limits": {"cpu": "1500m"}}))
    assert "'2' is larger than the limit '1500m'" in str(err)


def test_sane_resources_are_accepted():
    accept(
        spec_with(
            resources={
                "requests": {"cpu": "500m", "memory": "1Gi", "hugepages-2Mi": "1Gi"},
                "limits": {"cpu": 2, "memory": "2Gi", "rdma/hca": 1, "hugepages-2Mi": "1Gi"},
            }
        )
    )


@pytest.mark.parametrize(
    "image",
    [
        "moe-trainer:local",
        "ghcr.io/org/moe-trainer:0.19.8-cu12",
        "localhost:5000/a/b",
        "nvcr.io/nvidia/pytorch:24.01-py3",
        "repo/img@sha256:" + "a" * 64,
        "busybox",
    ],
)
def test_image_references_accepted(image):
    accept(spec_with(image=image))


@pytest.mark.parametrize(
    "image",
    [
        "moe-trainer:local;rm -rf /",
        "moe trainer",
        "img\n:x",
        "x/UPPER",
        "a:b:c",
        "-x",
        "x:" + "t" * 200,
        "repo/img@sha256:" + "a" * 40,  # a sha1-length digest under the sha256 name
        "repo/img@sha256:" + "a" * 65,
        "repo/img@sha256:" + "A" * 64,
    ],
)
def test_image_references_refused(image):
    assert refuse(spec_with(image=image)).field == "spec.image"


@pytest.mark.parametrize(
    ("ov", "field"),
    [
        ({"bf16": True}, "spec.deepspeedOverrides.bf16"),
        ({"zero_optimization": "disabled"}, "spec.deepspeedOverrides.zero_optimization"),
        ({"zero_optimization": {"stage": None}}, "spec.deepspeedOverrides.zero_optimization.stage"),
        ({"train_batch_size": None}, "spec.deepspeedOverrides.train_batch_size"),
    ],
)
def test_override_types_and_null_protected_keys(ov, field):
    assert refuse(spec_with(deepspeedOverrides=ov)).field == field


def test_learning_rate_that_underflows_is_refused():
    with pytest.raises(SpecError, match=r"spec.training.learningRate"):
        parse_spec(spec_with(training={**BASE["training"], "learningRate": "1e-400"}))
