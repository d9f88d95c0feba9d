"""Pure parts of the node agent: env resolution, volumes, mounts, node shapes, hosts names."""

from __future__ import annotations

import base64
from types import SimpleNamespace

import pytest
from kubernetes.client.exceptions import ApiException

from moe_localkube.nodes import FixtureError, NodeSpec, fixture_gpus, node_manifest
from moe_localkube.podfiles import ConfigError, PodFiles, container_mounts, expand, field_value
from moe_localkube.podnet import HostsFile, pod_hostnames

POD = {
    "metadata": {
        "name": "w-0",
        "namespace": "ml",
        "uid": "u-1",
        "labels": {"app": "moe", "rank": "0"},
        "annotations": {"a": "b"},
    },
    "spec": {
        "nodeName": "node-a",
        "serviceAccountName": "trainer",
        "hostname": "w-0",
        "subdomain": "job",
        "containers": [{"name": "main", "resources": {"limits": {"cpu": "2"}}}],
    },
    "status": {"podIP": "127.0.0.7", "hostIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.7"}]},
}


class FakeCore:
    """Answers read_namespaced_config_map / read_namespaced_secret from dicts (404 otherwise)."""

    def __init__(self, configmaps=None, secrets=None):
        self.cms, self.secrets = configmaps or {}, secrets or {}

    def read_namespaced_config_map(self, name, ns):
        if name not in self.cms:
            raise ApiException(status=404, reason="Not Found")
        return SimpleNamespace(data=self.cms[name], binary_data=None)

    def read_namespaced_secret(self, name, ns):
        if name not in self.secrets:
            raise ApiException(status=404, reason="Not Found")
        return SimpleNamespace(
            data={k: base64.b64encode(v.encode()).decode() for k, v in self.secrets[name].items()}
        )


def test_expand_follows_kubernetes_rules():
    env = {"A": "1", "B": "two"}
    assert expand("$(A)-$(B)-$(C)", env) == "1-two-$(C)"
    assert expand("$$(A) costs $$5", env) == "$(A) costs $5"


def test_field_values():
    assert field_value(POD, "metadata.labels['rank']") == "0"
    assert field_value(POD, "metadata.annotations['a']") == "b"
    assert field_value(POD, "status.podIP") == "127.0.0.7"
    assert field_value(POD, "spec.serviceAccountName") == "trainer"
    assert field_value(POD, "metadata.labels") == 'app="moe"\nrank="0"'
    with pytest.raises(ConfigError, match=r"fieldRef 'spec.priority' is not supported"):
        field_value(POD, "spec.priority")


def test_env_order_sources_and_missing_refs(tmp_path):
    core = FakeCore(
        configmaps={"cm": {"k": "from-cm", "x": "1"}}, secrets={"sec": {"pw": "s3cret"}}
    )
    files = PodFiles(core, POD, tmp_path, tmp_path)
    container = {
        "name": "main",
        "resources": {"limits": {"cpu": "2"}},
        "envFrom": [{"configMapRef": {"name": "cm"}, "prefix": "CM_"}],
        "env": [
            {"name": "BASE", "value": "$(PATH_X)/bin"},
            {"name": "K", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "k"}}},
            {"name": "PW", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "pw"}}},
            {
                "name": "OPT",
                "valueFrom": {"configMapKeyRef": {"name": "nope", "key": "k", "optional": True}},
            },
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "CPU", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
        ],
    }
    env = files.env(container, {"PATH_X": "/opt"})
    assert env == {
        "PATH_X": "/opt",
        "CM_k": "from-cm",
        "CM_x": "1",
        "BASE": "/opt/bin",
        "K": "from-cm",
        "PW": "s3cret",
        "IP": "127.0.0.7",
        "CPU": "2",
    }
    with pytest.raises(ConfigError, match='configmap "gone" not found'):
        files.env(
            {
                "name": "c",
                "env": [
                    {"name": "G", "valueFrom": {"configMapKeyRef": {"name": "gone", "key": "k"}}}
                ],
            },
            {},
        )
    with pytest.raises(ConfigError, match="couldn't find key zz in configmap ml/cm"):
        files.env(
            {
                "name": "c",
                "env": [
                    {"name": "G", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "zz"}}}
                ],
            },
            {},
        )


def test_volumes_are_materialised(tmp_path):
    core = FakeCore(
        configmaps={"plan": {"plan.json": "{}", "other": "x"}}, secrets={"tok": {"token": "abc"}}
    )
    pod = {
        **POD,
        "spec": {
            **POD["spec"],
            "volumes": [
                {
                    "name": "plan",
                    "configMap": {
                        "name": "plan",
                        "items": [{"key": "plan.json", "path": "p/plan.json"}],
                    },
                },
                {"name": "tok", "secret": {"secretName": "tok", "defaultMode": 0o600}},
                {
                    "name": "info",
                    "downwardAPI": {
                        "items": [{"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]
                    },
                },
                {"name": "scratch", "emptyDir": {}},
                {"name": "ck", "persistentVolumeClaim": {"claimName": "ckpt"}},
            ],
        },
    }
    vols = PodFiles(core, pod, tmp_path / "pod", tmp_path / "shared").volumes()
    assert (vols["plan"] / "p" / "plan.json").read_text() == "{}"
    assert not (vols["plan"] / "other").exists(), "items select keys"
    assert (vols["tok"] / "token").read_text() == "abc"
    assert (vols["tok"] / "token").stat().st_mode & 0o777 == 0o600
    assert (vols["info"] / "labels").read_text() == 'app="moe"\nrank="0"'
    assert vols["scratch"].is_dir() and not any(vols["scratch"].iterdir())
    assert vols["ck"] == tmp_path / "shared" / "pvc" / "ml" / "ckpt"
    with pytest.raises(
        ConfigError, match=r"volume g: type \['gcePersistentDisk'\] is not supported"
    ):
        PodFiles(core, pod, tmp_path, tmp_path).volume({"name": "g", "gcePersistentDisk": {}})


def test_mounts_parents_first_and_subpath(tmp_path):
    vols = {"a": tmp_path / "a", "b": tmp_path / "b"}
    container = {
        "name": "c",
        "volumeMounts": [
            {"name": "b", "mountPath": "/data/sub/", "subPath": "x"},
            {"name": "a", "mountPath": "/data", "readOnly": True},
        ],
    }
    mounts = container_mounts(container, vols)
    assert [m.target for m in mounts] == ["/data", "/data/sub"]
    assert (
        mounts[0].read_only
        and mounts[1].source == tmp_path / "b" / "x"
        and mounts[1].source.is_dir()
    )
    with pytest.raises(ConfigError, match="volumeMount 'zz' names no volume"):
        container_mounts({"name": "c", "volumeMounts": [{"name": "zz", "mountPath": "/z"}]}, vols)


def test_node_shapes_come_from_the_recordings():
    h100 = fixture_gpus("nvswitch-h100-8")
    assert (h100.product, h100.count) == ("NVIDIA-H100-80GB-HBM3", 8)
    assert fixture_gpus("single-h200").count == 1
    manifest = node_manifest(NodeSpec.parse("gpu-1:nvswitch-h100-8"))
    assert manifest["metadata"]["labels"]["nvidia.com/gpu.count"] == "8"
    assert manifest["metadata"]["annotations"]["moe-operator.io/fake-topology"] == "nvswitch-h100-8"
    assert NodeSpec.parse("n").fixture == "nvswitch-h100-8"
    with pytest.raises(
        FixtureError, match=r"unknown fake-topology fixture 'dgx-z'.*nvswitch-h100-8"
    ):
        fixture_gpus("dgx-z")


def test_hosts_names_and_in_place_rewrite(tmp_path):
    assert pod_hostnames(POD) == [
        "w-0.job.ml.svc.cluster.local",
        "w-0.job.ml.svc",
        "w-0.job",
        "w-0",
    ]
    bare = {"metadata": {"name": "p", "namespace": "ml"}, "spec": {}}
    assert pod_hostnames(bare) == ["p"]
    hosts = HostsFile(tmp_path / "hosts")
    inode = (tmp_path / "hosts").stat().st_ino
    hosts.set("u1", "127.0.0.7", pod_hostnames(POD))
    text = (tmp_path / "hosts").read_text()
    assert "127.0.0.7 w-0.job.ml.svc.cluster.local w-0.job.ml.svc w-0.job w-0\n" in text
    assert "127.0.0.1 kubernetes kubernetes.default kubernetes.default.svc" in text
    hosts.remove("u1")
    assert "w-0" not in (tmp_path / "hosts").read_text()
    assert (tmp_path / "hosts").stat().st_ino == inode, (
        "bind mounts pin the inode: rewrite in place"
    )


def test_gpu_allocator_grants_disjoint_sets_all_or_nothing():
    from moe_localkube.gpus import GpuAdmissionError, GpuAllocator, read_gpus, visible_env

    gpus = read_gpus("nvswitch-h100-8")
    assert [g.index for g in gpus] == list(range(8)) and len({g.uuid for g in gpus}) == 8
    alloc = GpuAllocator(gpus)

    def c(name, n):
        return {"name": name, "resources": {"limits": {"nvidia.com/gpu": n}}}

    a = alloc.allocate("pod-a", [c("init", 1), c("main", 4)])
    assert [g.index for g in a["init"]] == [0] and [g.index for g in a["main"]] == [1, 2, 3, 4]
    assert alloc.allocate("pod-a", [c("init", 1), c("main", 4)]) == a  # retried: same grant
    with pytest.raises(GpuAdmissionError, match="Requested: 4, Available: 3"):
        alloc.allocate("pod-b", [c("main", 4)])
    assert alloc.held_by("pod-b") == []  # all or nothing
    alloc.release("pod-a")
    b = alloc.allocate("pod-b", [c("main", 8), {"name": "side"}])
    assert [g.index for g in b["main"]] == list(range(8)) and b["side"] == []
    env = visible_env(b["main"][2:4], {}, gpus)
    assert env["CUDA_VISIBLE_DEVICES"] == f"{gpus[2].uuid},{gpus[3].uuid}"
    assert visible_env([], {}, gpus) == {"CUDA_VISIBLE_DEVICES": ""}
    picked = visible_env([], {"NVIDIA_VISIBLE_DEVICES": f"5,{gpus[1].uuid}"}, gpus)
    assert picked == {"CUDA_VISIBLE_DEVICES": f"{gpus[1].uuid},{gpus[5].uuid}"}


class _Worker:
    def __init__(self, alive):
        self.alive, self.reports, self.deletes = alive, 0, []

    def is_alive(self):
        return self.alive

    def report(self):
        self.reports += 1

    def request_delete(self, grace):
        self.deletes.append(grace)


def _agent_with(worker):
    import threading

    from moe_localkube.nodeagent import NodeAgent

    forced = []
    agent = SimpleNamespace(
        nodes={"node-a"},
        _stop=threading.Event(),
        _lock=threading.Lock(),
        _workers={"u1": worker},
        force_delete=lambda ns, name, uid: forced.append(name),
    )
    return (lambda pod: NodeAgent._sync(agent, pod)), forced


def _pod(**meta):
    return {
        "metadata": {"name": "p", "namespace": "ns", "uid": "u1", **meta},
        "spec": {"nodeName": "node-a"},
        "status": {"phase": "Running"},  # what the API still says after a lost final report
    }


def test_a_finished_pod_whose_final_status_was_lost_is_reported_again_on_resync():
    """After an API outage the agent's resync sees the pod again: a worker that finished here
    re-sends its final status (the kubelet does the same), nothing is deleted or restarted."""
    done = _Worker(alive=False)
    sync, forced = _agent_with(done)
    sync(_pod())
    assert done.reports == 1 and forced == [] and done.deletes == []
    running = _Worker(alive=True)
    sync, forced = _agent_with(running)
    sync(_pod())
    assert running.reports == 0 and forced == []  # a running worker reports by itself
    # a finished pod being deleted is force-deleted, not reported
    sync, forced = _agent_with(_Worker(alive=False))
    sync(_pod(deletionTimestamp="2026-12-02T14:00:00Z"))
    assert forced == ["p"]
