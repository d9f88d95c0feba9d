"""The node agent plays the kubelet: nodes, Jobs, exit codes, restarts, deletion, files, DNS."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import textwrap

import pytest
from kubernetes.client.exceptions import ApiException

from moe_localkube import procs
from moe_localkube.controlplane import free_ports
from moe_localkube.nodeagent import read_log
from moe_localkube.podfiles import memory_dir

pytestmark = pytest.mark.cluster


def _pod(name: str, script: str, *, restart: str = "Never", node: str = "node-a", **extra) -> dict:
    container = {
        "name": "main",
        "image": "ignored:latest",
        "command": ["python", "-c", textwrap.dedent(script)],
    }
    container.update(extra.pop("container", {}))
    spec = {
        "restartPolicy": restart,
        "nodeSelector": {"kubernetes.io/hostname": node},
        "terminationGracePeriodSeconds": 5,
        "containers": [container],
    }
    spec.update(extra)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def _phase(kube, ns, name, *phases):
    pod = kube.core.read_namespaced_pod(name, ns)
    return pod if pod.status.phase in phases else None


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


def test_job_with_configmap_and_downward_env_completes(
    kube, node_agent, namespace, wait_for, kubectl
):
    kube.core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "cfg"}, "data": {"greeting": "hello"}}
    )
    script = """
        import os
        greeting = open("/etc/cfg/greeting").read()
        env = os.environ
        line = (f"{greeting} from {env['POD_NAME']} on {env['NODE']} ip {env['POD_IP']} "
                f"fixture {env['MOE_FAKE_NVML_FIXTURE']}")
        print(line)
        open("/out/result.txt", "w").write(line)
    """
    out_dir = node_agent.run_dir / f"out-{namespace}"
    out_dir.mkdir()
    pod_spec = _pod(
        "x",
        script,
        restart="Never",
        node="node-b",
        container={
            "volumeMounts": [
                {"name": "cfg", "mountPath": "/etc/cfg"},
                {"name": "out", "mountPath": "/out"},
            ],
            "env": [
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            ],
        },
        volumes=[
            {"name": "cfg", "configMap": {"name": "cfg"}},
            {"name": "out", "hostPath": {"path": str(out_dir)}},
        ],
    )["spec"]
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "hello"},
        "spec": {
            "backoffLimit": 0,
            "template": {"metadata": {"labels": {"app": "hello"}}, "spec": pod_spec},
        },
    }
    kube.batch.create_namespaced_job(namespace, job)

    def complete():
        j = kube.batch.read_namespaced_job("hello", namespace)
        return any(c.type == "Complete" and c.status == "True" for c in j.status.conditions or [])

    wait_for(complete, timeout=60, message="Job Complete")
    pod = kube.core.list_namespaced_pod(namespace, label_selector="app=hello").items[0]
    assert pod.status.phase == "Succeeded"
    assert pod.spec.node_name == "node-b"
    assert pod.status.pod_ip.startswith("127.0.") and pod.status.pod_ip != "127.0.0.1"
    term = pod.status.container_statuses[0].state.terminated
    assert term.exit_code == 0 and term.reason == "Completed"
    expected = (
        f"hello from {pod.metadata.name} on node-b ip {pod.status.pod_ip} fixture nvswitch-h100-8"
    )
    assert (out_dir / "result.txt").read_text() == expected
    assert node_agent.read_log(namespace, pod.metadata.name).strip() == expected
    assert kubectl.run("logs", "-n", namespace, "job/hello").stdout.strip() == expected


def test_exit_code_and_termination_messages(kube, node_agent, namespace, wait_for):
    kube.core.create_namespaced_pod(
        namespace,
        _pod(
            "three",
            """
        open("/dev/termination-log", "w").write("bad plan: epSize 3")
        raise SystemExit(3)
    """,
        ),
    )
    kube.core.create_namespaced_pod(
        namespace,
        _pod(
            "logs",
            """
        print("line one"); print("final words", flush=True)
        raise SystemExit(78)
    """,
            container={"terminationMessagePolicy": "FallbackToLogsOnError"},
        ),
    )
    pod = wait_for(lambda: _phase(kube, namespace, "three", "Failed", "Succeeded"), timeout=40)
    assert pod.status.phase == "Failed"
    term = pod.status.container_statuses[0].state.terminated
    assert (term.exit_code, term.reason, term.message) == (3, "Error", "bad plan: epSize 3")
    assert pod.status.container_statuses[0].restart_count == 0
    pod = wait_for(lambda: _phase(kube, namespace, "logs", "Failed", "Succeeded"), timeout=40)
    term = pod.status.container_statuses[0].state.terminated
    assert term.exit_code == 78 and term.message.endswith("line one\nfinal words\n")


def test_on_failure_restarts_in_place_and_counts(kube, node_agent, namespace, wait_for, kubectl):
    kube.core.create_namespaced_pod(
        namespace,
        _pod(
            "flaky",
            """
        import os
        n = len(os.listdir("/scratch"))
        open(f"/scratch/try-{n}", "w").close()
        print(f"attempt {n}")
        raise SystemExit(0 if n >= 2 else 1)
    """,
            restart="OnFailure",
            container={"volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]},
            volumes=[{"name": "scratch", "emptyDir": {}}],
        ),
    )
    pod = wait_for(lambda: _phase(kube, namespace, "flaky", "Succeeded", "Failed"), timeout=60)
    cs = pod.status.container_statuses[0]
    assert pod.status.phase == "Succeeded"
    assert cs.restart_count == 2
    assert cs.last_state.terminated is None or cs.state.terminated.exit_code == 0
    assert node_agent.read_log(namespace, "flaky").strip() == "attempt 2"
    assert node_agent.read_log(namespace, "flaky", previous=True).strip() == "attempt 1"
    assert kubectl.run("logs", "-n", namespace, "flaky", "--previous").stdout.strip() == "attempt 1"
    events = kube.core.list_namespaced_event(
        namespace, field_selector="involvedObject.name=flaky"
    ).items
    reasons = [e.reason for e in events if e.source.component == "kubelet"]
    assert reasons.count("Started") == 3 and reasons.count("BackOff") == 2, reasons


def test_deleting_a_running_pod_kills_its_process(kube, node_agent, namespace, wait_for, kubectl):
    kube.core.create_namespaced_pod(
        namespace,
        _pod(
            "sleeper",
            """
        import time
        open("/dev/shm/marker", "w").write("in tmpfs")
        print("up", flush=True)
        time.sleep(600)
    """,
            container={"volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}]},
            volumes=[{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
        ),
    )
    pod = wait_for(lambda: _phase(kube, namespace, "sleeper", "Running"), timeout=40)
    shm = memory_dir(pod.metadata.uid)
    assert str(shm).startswith("/dev/shm/")
    wait_for(lambda: (shm / "dshm" / "marker").read_text() == "in tmpfs", timeout=10)
    assert not os.path.exists("/dev/shm/marker"), "the pod's /dev/shm is its own"
    follow_err = node_agent.run_dir / f"logs-f-{namespace}.err"
    with open(follow_err, "w") as err:
        follow = subprocess.Popen(
            [str(kubectl.path), "logs", "-f", "-n", namespace, "sleeper"],
            env=kubectl.env,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    # the stream is attached once its first line arrives (kubectl makes its discovery requests
    # first: on a loaded machine that takes seconds, and the pod must still exist when it asks)
    ready, _, _ = select.select([follow.stdout], [], [], 120)
    first = follow.stdout.readline() if ready else ""
    assert first == "up\n", f"kubectl logs -f printed {first!r}; stderr: {follow_err.read_text()}"
    cs = pod.status.container_statuses[0]
    assert cs.ready and cs.state.running is not None
    assert {c.type for c in pod.status.conditions if c.status == "True"} >= {
        "Ready",
        "ContainersReady",
        "Initialized",
        "PodScheduled",
    }
    pid = int(cs.container_id.rsplit("/", 1)[1])
    assert procs.group_alive(pid)
    kube.core.delete_namespaced_pod("sleeper", namespace)

    def gone():
        try:
            kube.core.read_namespaced_pod("sleeper", namespace)
            return False
        except ApiException as exc:
            return exc.status == 404

    wait_for(gone, timeout=30, message="pod removed")
    out, _ = follow.communicate(timeout=60)  # kubectl logs -f ends when the container does
    assert out == "" and follow.returncode == 0, (out, follow_err.read_text())
    assert not procs.group_alive(pid)
    wait_for(lambda: not shm.exists(), timeout=10, message="Memory emptyDir released")


def test_init_containers_deadline_and_hosts(kube, node_agent, namespace, wait_for):
    init = {
        "name": "init",
        "image": "x",
        "command": ["sh", "-c", "echo init > /w/init; hostname > /w/host"],
        "volumeMounts": [{"name": "w", "mountPath": "/w"}],
    }
    kube.core.create_namespaced_pod(
        namespace, _pod("peer", "import time; time.sleep(600)", hostname="peer", subdomain="grp")
    )
    kube.core.create_namespaced_pod(
        namespace,
        _pod(
            "inits",
            f"""
        import socket, time
        assert open("/w/init").read() == "init\\n"
        assert open("/w/host").read().strip() == "inits"
        print(socket.gethostbyname("peer.grp.{namespace}.svc.cluster.local"),
              socket.gethostbyname("peer.grp"), flush=True)
        time.sleep(600)
    """,
            initContainers=[init],
            activeDeadlineSeconds=8,
            container={"volumeMounts": [{"name": "w", "mountPath": "/w"}]},
            volumes=[{"name": "w", "emptyDir": {}}],
        ),
    )
    peer = wait_for(lambda: _phase(kube, namespace, "peer", "Running"), timeout=40)
    pod = wait_for(lambda: _phase(kube, namespace, "inits", "Failed"), timeout=60)
    assert pod.status.reason == "DeadlineExceeded"
    assert pod.status.init_container_statuses[0].state.terminated.exit_code == 0
    assert node_agent.read_log(namespace, "inits").split() == [peer.status.pod_ip] * 2
    assert peer.status.pod_ip != pod.status.pod_ip


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
        _pod(
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
    pod = wait_for(lambda: _phase(kube, namespace, "incluster", "Succeeded", "Failed"), timeout=60)
    out = node_agent.read_log(namespace, "incluster").split()
    assert out == ["v", "403", "2", "v", namespace], out  # a JWT has two dots
    assert pod.status.phase == "Succeeded"


def test_missing_configmap_waits_then_runs(kube, node_agent, namespace, wait_for):
    kube.core.create_namespaced_pod(
        namespace,
        _pod(
            "later",
            "import os; print(os.environ['V'])",
            container={
                "env": [
                    {"name": "V", "valueFrom": {"configMapKeyRef": {"name": "late", "key": "v"}}}
                ]
            },
        ),
    )

    def config_error():
        pod = kube.core.read_namespaced_pod("later", namespace)
        st = pod.status.container_statuses
        return (
            st
            and st[0].state.waiting
            and st[0].state.waiting.reason == "CreateContainerConfigError"
        )

    wait_for(config_error, timeout=30)
    kube.core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "late"}, "data": {"v": "now"}}
    )
    wait_for(lambda: _phase(kube, namespace, "later", "Succeeded"), timeout=30)
    assert node_agent.read_log(namespace, "later").strip() == "now"


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
            _pod(
                "cli",
                """
            import os, time
            print(os.environ["MOE_FAKE_NVML_FIXTURE"], flush=True)
            time.sleep(600)
        """,
                node="cli-node",
            ),
        )
        pod = wait_for(lambda: _phase(kube, namespace, "cli", "Running"), timeout=40)
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
            _pod(
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
            lambda: _phase(kube, namespace, f"w{rank}", "Succeeded", "Failed"), timeout=120
        )
        assert pod.status.phase == "Succeeded", node_agent.read_log(namespace, f"w{rank}")
        assert node_agent.read_log(namespace, f"w{rank}").split()[-2:] == [f"w{rank}", "3"]


def test_gpu_capacity_is_enforced_by_the_real_scheduler(kube, node_agent, namespace, wait_for):
    for name, gpus in (("fits", 8), ("too-big", 9)):
        kube.core.create_namespaced_pod(
            namespace,
            _pod(
                name,
                "print('ok')",
                node="node-a",
                container={"resources": {"limits": {"nvidia.com/gpu": str(gpus)}}},
            ),
        )
    wait_for(lambda: _phase(kube, namespace, "fits", "Succeeded"), timeout=40)

    def unschedulable():
        pod = kube.core.read_namespaced_pod("too-big", namespace)
        return any(
            c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable"
            for c in pod.status.conditions or []
        )

    wait_for(unschedulable, timeout=30, message="too-big marked Unschedulable")
    pod = kube.core.read_namespaced_pod("too-big", namespace)
    assert pod.spec.node_name is None and pod.status.phase == "Pending"


def test_kill_container_simulates_a_crash(kube, node_agent, namespace, wait_for):
    kube.core.create_namespaced_pod(namespace, _pod("victim", "import time; time.sleep(600)"))
    wait_for(lambda: _phase(kube, namespace, "victim", "Running"), timeout=40)
    pid = node_agent.kill_container(namespace, "victim")
    pod = wait_for(lambda: _phase(kube, namespace, "victim", "Failed"), timeout=20)
    assert pod.status.container_statuses[0].state.terminated.exit_code == 128 + signal.SIGKILL
    assert not procs.group_alive(pid)
    with pytest.raises(LookupError, match=f"no running container \\* in pod {namespace}/victim"):
        node_agent.kill_container(namespace, "victim")


def test_agent_binds_pods_no_scheduler_looks_at(kube, node_agent, namespace, wait_for):
    kube.core.create_namespaced_pod(
        namespace,
        _pod(
            "orphan",
            "print('bound by the agent')",
            node="node-b",
            schedulerName="no-such-scheduler",
        ),
    )
    pod = wait_for(lambda: _phase(kube, namespace, "orphan", "Succeeded"), timeout=40)
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
        return _pod(name, show.format(hold=hold), node="node-b", container={**limits, **extra})

    kube.core.create_namespaced_pod(namespace, gpu_pod("three", 3, True))
    wait_for(
        lambda: node_agent.read_log(namespace, "three").strip(), timeout=60, message="pod three"
    )
    kube.core.create_namespaced_pod(namespace, gpu_pod("two", 2, False))
    kube.core.create_namespaced_pod(namespace, gpu_pod("none", 0, False))
    env_all = {"env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}
    kube.core.create_namespaced_pod(namespace, gpu_pod("all", 0, False, **env_all))
    for name in ("two", "none", "all"):
        wait_for(lambda n=name: _phase(kube, namespace, n, "Succeeded"), timeout=60, message=name)

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
    wait_for(lambda: _phase(kube, namespace, "three", "Succeeded"), timeout=60, message="three")
    wait_for(
        lambda: not node_agent.gpus["node-b"].held_by(uid3), timeout=30, message="GPUs released"
    )

    too_many = gpu_pod("nine", 9, False)
    too_many["spec"].pop("nodeSelector")
    too_many["spec"]["nodeName"] = "node-b"  # past the scheduler, as a pinned pod would be
    kube.core.create_namespaced_pod(namespace, too_many)
    pod = wait_for(lambda: _phase(kube, namespace, "nine", "Failed"), timeout=60, message="nine")
    assert pod.status.reason == "UnexpectedAdmissionError"
    assert "Requested: 9" in pod.status.message
