"""The node agent plays the kubelet for pods: Jobs, exit codes, restarts, deletion, init containers,
files."""

from __future__ import annotations

import os
import select
import signal
import subprocess

import pytest
from kubernetes.client.exceptions import ApiException

from moe_localkube import procs
from moe_localkube.podfiles import memory_dir
from nodeagent_pods import pod_manifest, pod_phase

pytestmark = pytest.mark.cluster


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
    pod_spec = pod_manifest(
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
        pod_manifest(
            "three",
            """
        open("/dev/termination-log", "w").write("bad plan: epSize 3")
        raise SystemExit(3)
    """,
        ),
    )
    kube.core.create_namespaced_pod(
        namespace,
        pod_manifest(
            "logs",
            """
        print("line one"); print("final words", flush=True)
        raise SystemExit(78)
    """,
            container={"terminationMessagePolicy": "FallbackToLogsOnError"},
        ),
    )
    pod = wait_for(lambda: pod_phase(kube, namespace, "three", "Failed", "Succeeded"), timeout=40)
    assert pod.status.phase == "Failed"
    term = pod.status.container_statuses[0].state.terminated
    assert (term.exit_code, term.reason, term.message) == (3, "Error", "bad plan: epSize 3")
    assert pod.status.container_statuses[0].restart_count == 0
    pod = wait_for(lambda: pod_phase(kube, namespace, "logs", "Failed", "Succeeded"), timeout=40)
    term = pod.status.container_statuses[0].state.terminated
    assert term.exit_code == 78 and term.message.endswith("line one\nfinal words\n")


def test_on_failure_restarts_in_place_and_counts(kube, node_agent, namespace, wait_for, kubectl):
    kube.core.create_namespaced_pod(
        namespace,
        pod_manifest(
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
    pod = wait_for(lambda: pod_phase(kube, namespace, "flaky", "Succeeded", "Failed"), timeout=60)
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
        pod_manifest(
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
    pod = wait_for(lambda: pod_phase(kube, namespace, "sleeper", "Running"), timeout=40)
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
        namespace,
        pod_manifest("peer", "import time; time.sleep(600)", hostname="peer", subdomain="grp"),
    )
    kube.core.create_namespaced_pod(
        namespace,
        pod_manifest(
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
    peer = wait_for(lambda: pod_phase(kube, namespace, "peer", "Running"), timeout=40)
    pod = wait_for(lambda: pod_phase(kube, namespace, "inits", "Failed"), timeout=60)
    assert pod.status.reason == "DeadlineExceeded"
    assert pod.status.init_container_statuses[0].state.terminated.exit_code == 0
    assert node_agent.read_log(namespace, "inits").split() == [peer.status.pod_ip] * 2
    assert peer.status.pod_ip != pod.status.pod_ip


def test_missing_configmap_waits_then_runs(kube, node_agent, namespace, wait_for):
    kube.core.create_namespaced_pod(
        namespace,
        pod_manifest(
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
    wait_for(lambda: pod_phase(kube, namespace, "later", "Succeeded"), timeout=30)
    assert node_agent.read_log(namespace, "later").strip() == "now"


def test_kill_container_simulates_a_crash(kube, node_agent, namespace, wait_for):
    kube.core.create_namespaced_pod(
        namespace, pod_manifest("victim", "import time; time.sleep(600)")
    )
    wait_for(lambda: pod_phase(kube, namespace, "victim", "Running"), timeout=40)
    pid = node_agent.kill_container(namespace, "victim")
    pod = wait_for(lambda: pod_phase(kube, namespace, "victim", "Failed"), timeout=20)
    assert pod.status.container_statuses[0].state.terminated.exit_code == 128 + signal.SIGKILL
    assert not procs.group_alive(pid)
    with pytest.raises(LookupError, match=f"no running container \\* in pod {namespace}/victim"):
        node_agent.kill_container(namespace, "victim")
