"""The node agent as the nodes of a cluster: GPU node objects and capacity, binding, device-plugin
GPU grants, in-cluster config, pod DNS, the standalone agent CLI."""

from __future__ import annotations

import contextlib
import json
import signal
import sys

import pytest
from kubernetes.client.exceptions import ApiException

from moe_localkube import procs
from moe_localkube.controlplane import free_ports
from moe_localkube.podlogs import read_log
from nodeagent_pods import pod_manifest, pod_phase

pytestmark = pytest.mark.cluster


def test_nodes_look_like_gpu_nodes(kube, node_agent, wait_for):
    for name in ("node-a", "node-b"):
        node = kube.core.read_node(name)
        labels = node.metadata.labels
        assert labels["kubernetes.io/hostname"] == name
        assert labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
        assert labels["nvidia.com/gpu.count"] == "8"
        assert int(labels["nvidia.com/gpu.memory"]) > 80000
        assert node.metadata.annotations["moe-operator.io/fake-topology"] == "nvswitch-h100-8"
        assert node.status.allocatable["nvidia.com/gpu"] == "8"
        assert any(c.type == "Ready" and c.status == "True" for c in node.status.conditions)
        wait_for(
            lambda: not kube.core.read_node(name).spec.taints,
            timeout=20,
            message="no not-ready taint",
        )
        lease = kube.coordination.read_namespaced_lease(name, "kube-node-lease")
        assert lease.spec.holder_identity == name


def test_in_cluster_config_with_service_account(kube, node_agent, namespace, wait_for):
    kube.core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "probe"}, "data": {"k": "v"}}
    )
    kube.rbac.create_namespaced_role(
        namespace,
        {
            "metadata": {"name": "cm-reader"},
            "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"]}],
        },
    )
    kube.rbac.create_namespaced_role_binding(
        namespace,
        {
            "metadata": {"name": "cm-reader"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": "cm-reader",
            },
            "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": namespace}],
        },
    )
    kube.core.create_namespaced_pod(
        namespace,
        pod_manifest(
            "incluster",
            f"""
        from kubernetes import client, config
        config.load_incluster_config()
        v1 = client.CoreV1Api()
        print(v1.read_namespaced_config_map("probe", "{namespace}").data["k"])
        try:
            v1.list_namespaced_secret("{namespace}")
        except client.exceptions.ApiException as exc:
            print(exc.status)
        token = open("/var/run/projected/token").read()
        print(token.count("."), open("/var/run/projected/cfg/k").read(),
              open("/var/run/projected/ns").read())
    """,
            container={
                "volumeMounts": [
                    {"name": "proj", "mountPath": "/var/run/projected", "readOnly": True}
                ]
            },
            volumes=[
                {
                    "name": "proj",
                    "projected": {
                        "sources": [
                            {"serviceAccountToken": {"path": "token", "expirationSeconds": 3600}},
                            {
                                "configMap": {
                                    "name": "probe",
                                    "items": [{"key": "k", "path": "cfg/k"}],
                                }
                            },
                            {
                                "downwardAPI": {
                                    "items": [
                                        {
                                            "path": "ns",
                                            "fieldRef": {"fieldPath": "metadata.namespace"},
                                        }
                                    ]
                                }
                            },
                        ]
                    },
                }
            ],
        ),
    )
    pod = wait_for(
        lambda: pod_phase(kube, namespace, "incluster", "Succeeded", "Failed"), timeout=60
    )
    out = node_agent.read_log(namespace, "incluster").split()
    assert out == ["v", "403", "2", "v", namespace], out  # a JWT has two dots
    assert pod.status.phase == "Succeeded"


def test_standalone_agent_cli(control_plane, kube, namespace, wait_for, tmp_path):
    """``python -m moe_localkube.nodeagent`` (the demo path) runs pods and kills them on SIGTERM."""
    agent = procs.spawn(
        [
            sys.executable,
            "-m",
            "moe_localkube.nodeagent",
            "--kubeconfig",
            str(control_plane.kubeconfig),
            "--nodes",
            "cli-node:single-h200",
            "--run-dir",
            str(tmp_path),
        ],
        tmp_path / "agent.log",
    )
    try:
        node = wait_for(
            lambda: kube.core.read_node("cli-node"), timeout=30, message="cli-node registered"
        )
        assert node.metadata.labels["nvidia.com/gpu.count"] == "1"
        assert node.metadata.annotations["moe-operator.io/fake-topology"] == "single-h200"
        kube.core.create_namespaced_pod(
            namespace,
            pod_manifest(
                "cli",
                """
            import os, time
            print(os.environ["MOE_FAKE_NVML_FIXTURE"], flush=True)
            time.sleep(600)
        """,
                node="cli-node",
            ),
        )
        pod = wait_for(lambda: pod_phase(kube, namespace, "cli", "Running"), timeout=40)
        assert pod.spec.node_name == "cli-node"
        pid = int(pod.status.container_statuses[0].container_id.rsplit("/", 1)[1])
        wait_for(lambda: read_log(tmp_path, namespace, "cli").strip() == "single-h200", timeout=10)
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=30) == 0, (tmp_path / "agent.log").read_text()
        assert not procs.group_alive(pid), "the agent's pod process survived its shutdown"
    finally:
        procs.stop(agent)
        with contextlib.suppress(ApiException):
            kube.core.delete_node("cli-node")


def test_two_pods_rendezvous_over_gloo_by_pod_hostname(kube, node_agent, namespace, wait_for):
    """torchrun-style env rendezvous across the two fake nodes, MASTER_ADDR = rank 0's pod DNS
    name."""
    script = """
        import os, socket, torch, torch.distributed as dist
        dist.init_process_group("gloo")
        t = torch.tensor([float(os.environ["RANK"]) + 1])
        dist.all_reduce(t)
        print(socket.gethostname(), int(t.item()), flush=True)
        dist.destroy_process_group()
    """
    port = str(
        free_ports(1)[0]
    )  # pods share the host network: a fixed port collides with parallel runs
    for rank, node in enumerate(("node-a", "node-b")):
        env = {
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": f"w0.job.{namespace}.svc",
            "MASTER_PORT": port,
        }
        kube.core.create_namespaced_pod(
            namespace,
            pod_manifest(
                f"w{rank}",
                script,
                node=node,
                hostname=f"w{rank}",
                subdomain="job",
                container={"env": [{"name": k, "value": v} for k, v in env.items()]},
            ),
        )
    for rank in range(2):
        pod = wait_for(
            lambda: pod_phase(kube, namespace, f"w{rank}", "Succeeded", "Failed"), timeout=120
        )
        assert pod.status.phase == "Succeeded", node_agent.read_log(namespace, f"w{rank}")
        assert node_agent.read_log(namespace, f"w{rank}").split()[-2:] == [f"w{rank}", "3"]


def test_gpu_capacity_is_enforced_by_the_real_scheduler(kube, node_agent, namespace, wait_for):
    for name, gpus in (("fits", 8), ("too-big", 9)):
        kube.core.create_namespaced_pod(
            namespace,
            pod_manifest(
                name,
                "print('ok')",
                node="node-a",
                container={"resources": {"limits": {"nvidia.com/gpu": str(gpus)}}},
            ),
        )
    wait_for(lambda: pod_phase(kube, namespace, "fits", "Succeeded"), timeout=40)

    def unschedulable():
        pod = kube.core.read_namespaced_pod("too-big", namespace)
        return any(
            c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable"
            for c in pod.status.conditions or []
        )

    wait_for(unschedulable, timeout=30, message="too-big marked Unschedulable")
    pod = kube.core.read_namespaced_pod("too-big", namespace)
    assert pod.spec.node_name is None and pod.status.phase == "Pending"


def test_agent_binds_pods_no_scheduler_looks_at(kube, node_agent, namespace, wait_for):
    kube.core.create_namespaced_pod(
        namespace,
        pod_manifest(
            "orphan",
            "print('bound by the agent')",
            node="node-b",
            schedulerName="no-such-scheduler",
        ),
    )
    pod = wait_for(lambda: pod_phase(kube, namespace, "orphan", "Succeeded"), timeout=40)
    assert pod.spec.node_name == "node-b"


def test_gpus_granted_like_the_device_plugin(kube, node_agent, namespace, wait_for, tmp_path):
    """Each container sees exactly the GPUs it was granted, as UUIDs in PCI bus order (what the
    NVIDIA device plugin + runtime give it: container-relative numbering 0..n-1); two running pods
    hold disjoint GPUs; no request -> no GPU unless NVIDIA_VISIBLE_DEVICES asks; a pod asking for
    more GPUs than the node has is refused at admission; GPUs are released when a pod ends."""
    from moe_localkube.gpus import read_gpus

    uuids = [g.uuid for g in read_gpus(node_agent.nodes["node-b"].fixture)]
    gate = tmp_path / "release"
    show = f"""
        import json, os, pathlib, time
        print(json.dumps([os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES",
                                                      "NVIDIA_VISIBLE_DEVICES")]))
        while {{hold}} and not pathlib.Path({str(gate)!r}).exists():
            time.sleep(0.1)
    """

    def gpu_pod(name: str, n: int, hold: bool, **extra) -> dict:
        limits = {"resources": {"limits": {"nvidia.com/gpu": str(n)}}} if n else {}
        return pod_manifest(
            name, show.format(hold=hold), node="node-b", container={**limits, **extra}
        )

    kube.core.create_namespaced_pod(namespace, gpu_pod("three", 3, True))
    wait_for(
        lambda: node_agent.read_log(namespace, "three").strip(), timeout=60, message="pod three"
    )
    kube.core.create_namespaced_pod(namespace, gpu_pod("two", 2, False))
    kube.core.create_namespaced_pod(namespace, gpu_pod("none", 0, False))
    env_all = {"env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}
    kube.core.create_namespaced_pod(namespace, gpu_pod("all", 0, False, **env_all))
    for name in ("two", "none", "all"):
        wait_for(
            lambda n=name: pod_phase(kube, namespace, n, "Succeeded"), timeout=60, message=name
        )

    def seen(name: str) -> tuple[list[str], str | None]:
        cuda, nvidia = json.loads(node_agent.read_log(namespace, name))
        return [u for u in cuda.split(",") if u], nvidia

    three, two = seen("three")[0], seen("two")[0]
    assert len(three) == 3 and len(two) == 2 and not set(three) & set(two)
    for got in (three, two):
        assert got == sorted(got, key=uuids.index)  # PCI bus order: container index = position
        assert set(got) <= set(uuids)
    assert seen("three")[1] == ",".join(three)
    assert seen("none") == ([], None)
    assert seen("all")[0] == uuids

    uid3 = kube.core.read_namespaced_pod("three", namespace).metadata.uid
    assert len(node_agent.gpus["node-b"].held_by(uid3)) == 3
    gate.write_text("go")
    wait_for(lambda: pod_phase(kube, namespace, "three", "Succeeded"), timeout=60, message="three")
    wait_for(
        lambda: not node_agent.gpus["node-b"].held_by(uid3), timeout=30, message="GPUs released"
    )

    too_many = gpu_pod("nine", 9, False)
    too_many["spec"].pop("nodeSelector")
    too_many["spec"]["nodeName"] = "node-b"  # past the scheduler, as a pinned pod would be
    kube.core.create_namespaced_pod(namespace, too_many)
    pod = wait_for(lambda: pod_phase(kube, namespace, "nine", "Failed"), timeout=60, message="nine")
    assert pod.status.reason == "UnexpectedAdmissionError"
    assert "Requested: 9" in pod.status.message
