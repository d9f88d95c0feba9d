"""helm install / upgrade / uninstall against the test control plane, and the installed operator
run as a local process from the chart's rendered Deployment (its command, args and env) under
the chart's ServiceAccount token: it reconciles an example job through discovery and planning
(suspended, so no training here: that is the operator's own end-to-end test)."""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml
from kubernetes import client as k8s

from moe_localkube import procs
from moe_localkube.testing import create_namespace, delete_namespace, unique_name
from moejob_operator import constants as C
from operator_harness import condition, events_for, example, get_job, install_crd

pytestmark = pytest.mark.cluster

CHART = Path(__file__).resolve().parents[1] / "charts" / "moe-operator"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def helm(kubectl, *args: str) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [kubectl.helm, *args], env=kubectl.env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def rendered_deployment(kubectl, name: str, ns: str) -> dict:
    manifest = helm(kubectl, "get", "manifest", name, "-n", ns).stdout
    (dep,) = [d for d in yaml.safe_load_all(manifest) if d and d["kind"] == "Deployment"]
    return dep


def sa_token(kube, wait_for, ns: str, sa: str) -> str:
    """v1.20: the token controller writes a kubernetes.io/service-account-token Secret."""

    def secret():
        for s in kube.core.list_namespaced_secret(ns).items:
            ann = s.metadata.annotations or {}
            if (
                s.type == "kubernetes.io/service-account-token"
                and ann.get("kubernetes.io/service-account.name") == sa
                and (s.data or {}).get("token")
            ):
                return s
        return None

    return base64.b64decode(
        wait_for(secret, timeout=30, message="SA token secret").data["token"]
    ).decode()


def local_env(container: dict, pod_name: str, ns: str, kubeconfig: Path) -> dict[str, str]:
    """The container's env with the downward API resolved as the kubelet would."""
    fields = {"metadata.name": pod_name, "metadata.namespace": ns}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOE_", "KUBERNETES_"))}
    for e in container["env"]:
        env[e["name"]] = (
            e["value"] if "value" in e else fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        )
    env["KUBECONFIG"] = str(kubeconfig)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    return env


def metric(port: int, name: str) -> float | None:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=3).read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(name + " ") or (not name.endswith("}") and line.startswith(name + "{")):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_install_run_upgrade_uninstall(
    kube, kubectl, control_plane, node_agent, namespace, wait_for, tmp_path
):
    install_crd(kube)  # as docs/install.md: the CRD first (Helm never upgrades crds/)
    rel_ns = create_namespace(kube, unique_name("moe-sys"))
    name = unique_name("mo", 16)
    hp, mp = _free_port(), _free_port()
    values = [
        "--set",
        "replicaCount=0",
        "--set",
        f"watchNamespaces={{{namespace}}}",
        "--set",
        "gate.enabled=false",
        "--set",
        f"health.port={hp}",
        "--set",
        f"metrics.port={mp}",
        "--set",
        "logging.format=plain",
        "--set",
        f"hostPathPolicy.allowedPrefixes={{{tmp_path}}}",
        "--server-side=false",
    ]
    proc = None
    try:
        helm(kubectl, "install", name, str(CHART), "-n", rel_ns, *values)
        sa = f"{name}-moe-operator"
        assert kube.core.read_namespaced_service_account(sa, rel_ns)
        assert kube.rbac.read_cluster_role(f"{name}-moe-operator-jobs")
        assert kube.rbac.read_namespaced_role_binding(f"{name}-moe-operator-jobs", namespace)

        # ---- the operator, as the Deployment would run it, under the chart's ServiceAccount
        dep = rendered_deployment(kubectl, name, rel_ns)
        (c,) = dep["spec"]["template"]["spec"]["containers"]
        token = sa_token(kube, wait_for, rel_ns, sa)
        kubeconfig = control_plane.token_kubeconfig(token, tmp_path / "sa-kubeconfig")
        env = local_env(c, f"{name}-local-0", rel_ns, kubeconfig)
        argv = [shutil.which(c["command"][0], path=env["PATH"]), *c["command"][1:], *c["args"]]
        argv = [a.replace("0.0.0.0", "127.0.0.1") for a in argv] + ["--bind-address", "127.0.0.1"]
        log = tmp_path / "operator.log"
        proc = procs.spawn(argv, log, env=env)
        logs = lambda: log.read_text(errors="replace")  # noqa: E731
        wait_for(lambda: metric(mp, "moe_operator_leader") == 1, timeout=60, message=logs())

        job = example(
            "tiny-cpu.yaml",
            checkpoint={"everySteps": 5, "volume": {"hostPath": {"path": str(tmp_path)}}},
        )
        job["spec"]["runPolicy"]["suspend"] = True
        kube.custom.create_namespaced_custom_object(C.GROUP, C.VERSION, namespace, C.PLURAL, job)
        jname = job["metadata"]["name"]
        wait_for(
            lambda: (
                condition(get_job(kube, namespace, jname), C.COND_PLANNED).get("status") == "True"
            ),
            timeout=120,
            message=logs() + json.dumps(get_job(kube, namespace, jname).get("status"), indent=1),
        )
        wait_for(
            lambda: (
                condition(get_job(kube, namespace, jname), C.COND_SUSPENDED).get("status") == "True"
            ),
            timeout=30,
            message=logs(),
        )
        status = get_job(kube, namespace, jname)["status"]
        assert condition(status and {"status": status}, C.COND_TOPOLOGY)["reason"] == C.R_DISCOVERED
        assert status["plan"]["worldSize"] == 2
        assert kube.core.read_namespaced_config_map(f"{jname}-plan", namespace).data[C.PLAN_KEY]
        assert not kube.core.list_namespaced_pod(
            namespace, label_selector=f"{C.LABEL_COMPONENT}=worker"
        ).items
        assert (
            kube.coordination.read_namespaced_lease(
                "moe-operator-leader", rel_ns
            ).spec.holder_identity
            == f"{name}-local-0"
        )

        # the reconcile loop's metrics, scraped from the running process
        assert metric(mp, 'moe_operator_jobs{condition="Planned",status="True"}') == 1
        assert (
            metric(mp, f'moe_operator_plan_world_size{{job="{jname}",namespace="{namespace}"}}')
            == 2
        )
        assert metric(mp, "moe_operator_plan_cross_group_vs_contiguous") is not None
        assert (metric(mp, "moe_operator_reconcile_duration_seconds_count") or 0) >= 2

        # nothing was refused (the chart's RBAC sufficed) and the token leaked nowhere
        text = logs()
        assert "403" not in text and "Forbidden" not in text and "forbidden" not in text, text[
            -3000:
        ]
        events = wait_for(
            lambda: (
                " ".join(f"{e.reason} {e.message}" for e in events_for(kube, namespace, jname))
                if C.R_PLAN_READY in {e.reason for e in events_for(kube, namespace, jname)}
                else None
            ),
            timeout=10,
            message="PlanReady event",
        )
        for where, blob in (("logs", text), ("events", events), ("status", json.dumps(status))):
            assert token not in blob and token[-24:] not in blob, (
                f"the SA token appears in the {where}"
            )
    finally:
        if proc is not None:
            procs.stop(proc, grace_seconds=15)

    try:
        # ---- upgrade: a changed value reaches the Deployment; revision 2
        helm(
            kubectl,
            "upgrade",
            name,
            str(CHART),
            "-n",
            rel_ns,
            *values,
            "--set",
            "logging.verbose=true",
        )
        dep = k8s.AppsV1Api(kube.api_client).read_namespaced_deployment(
            f"{name}-moe-operator", rel_ns
        )
        args = dep.spec.template.spec.containers[0].args
        assert "--verbose" in args
        hist = json.loads(helm(kubectl, "history", name, "-n", rel_ns, "-o", "json").stdout)
        assert [h["revision"] for h in hist] == [1, 2] and hist[-1]["status"] == "deployed"
    finally:
        # ---- uninstall: everything of the release goes, the CRD (and so users' jobs) stays
        helm(kubectl, "uninstall", name, "-n", rel_ns, "--wait")
        delete_namespace(kube, rel_ns)
    names = {r.metadata.name for r in kube.rbac.list_cluster_role().items}
    assert not {n for n in names if n.startswith(name)}
    assert kube.apiext.read_custom_resource_definition(f"{C.PLURAL}.{C.GROUP}")


def test_chart_pod_runs_under_the_node_agent(kube, kubectl, node_agent, wait_for):
    """The chart's Deployment as a pod (the node agent runs its command on this host): its /tmp
    emptyDir must not hide the volumes the agent binds from its run dir under /tmp (it did: mount
    exit 32, a crash loop, while `kubectl rollout status` said "successfully rolled out")."""
    install_crd(kube)
    rel_ns = create_namespace(kube, unique_name("moe-pod"))
    watched = create_namespace(kube, unique_name("moe-w"))
    name = unique_name("mp", 16)
    values = [
        "--set",
        f"watchNamespaces={{{watched}}}",
        "--set",
        "gate.enabled=false",
        "--set",
        f"health.port={_free_port()}",
        "--set",
        f"metrics.port={_free_port()}",
        "--set",
        "logging.format=plain",
        "--server-side=false",
    ]
    try:
        helm(kubectl, "install", name, str(CHART), "-n", rel_ns, *values)
        selector = "app.kubernetes.io/component=operator"

        def leading_pod():
            pods = kube.core.list_namespaced_pod(rel_ns, label_selector=selector).items
            lease = kube.coordination.read_namespaced_lease("moe-operator-leader", rel_ns)
            return pods and lease.spec.holder_identity == pods[0].metadata.name and pods[0]

        pod = wait_for(
            leading_pod,
            timeout=90,
            message=f"the chart's operator pod holding the lease in {rel_ns}",
        )
        (status,) = pod.status.container_statuses
        assert status.ready and status.restart_count == 0, status
    finally:
        helm(kubectl, "uninstall", name, "-n", rel_ns, "--wait")
        delete_namespace(kube, rel_ns)
        delete_namespace(kube, watched)
