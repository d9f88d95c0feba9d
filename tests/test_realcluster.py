"""The user's path on real nodes: images built from the repository's Dockerfiles, two kubelets on
containerd (``moe_localkube.realnodes``), ``helm install`` of the chart with the built operator
image, ``kubectl apply -f examples/tiny-cpu.yaml`` -> discovery pods, the smoke-test Job and the
worker pods as real containers of the built trainer image -> ``kubectl wait
--for=condition=Succeeded`` -> ``helm uninstall``. Security facts are read from inside the running
containers and compared with what their pod specs promise. Before the uninstall, a job whose
checkpoint hostPath is a symlink planted under the allowed prefix pointing outside it: the real
kubelet refuses the subPath (issue 31; the node agent's imitation is tests/test_trust_cluster.py).

Slow the first time on a machine (base image, both image builds: see docs/localkube.md), seconds
after that (content-addressed image cache). Stage timings go to
``$MOE_REALCLUSTER_RESULTS`` when set (``benchmarks/results/realcluster.json`` in the README).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from moe_localkube import binaries, procs
from moe_localkube.testing import Kube, create_namespace, wait_for
from moejob_operator import constants as C

pytestmark = [pytest.mark.realnodes, pytest.mark.timeout(3600)]

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "moe-operator"
EXAMPLE = ROOT / "examples" / "tiny-cpu.yaml"
NODES = ("gpu-node-a", "gpu-node-b")
RELEASE, RELEASE_NS = "moe", "moe-system"
TIMINGS: dict[str, float] = {}

# Reads the security facts of the process it runs as, from /proc/self/status and a write attempt.
PROBE = r"""
import json, os
st = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines() if ":" in l)
try:
    open("/moe-rootfs-probe", "w").close(); os.unlink("/moe-rootfs-probe"); ro = False
except OSError as exc:
    ro = exc.errno == 30     # EROFS
print(json.dumps({"uid": os.getuid(), "gid": os.getgid(), "readOnlyRoot": ro,
                  "noNewPrivs": int(st["NoNewPrivs"].strip()),
                  "capEff": int(st["CapEff"].strip(), 16),
                  "seccomp": int(st["Seccomp"].strip())}))
"""


@pytest.fixture(scope="module")
def images():
    from moe_localkube.images import ImageBuilder

    with ImageBuilder() as builder:
        built = builder.build_all()
        builder.prune()
    TIMINGS.update({f"{k} (s)": v for k, v in builder.report.timings.items()})
    TIMINGS["images cached"] = all(i.cached for i in built.values())
    return built


@pytest.fixture(scope="module")
def cluster(images, tmp_path_factory):
    from moe_localkube.controlplane import ControlPlane
    from moe_localkube.realnode import RealNodeSpec
    from moe_localkube.realnodes import RealNodes, host_leftovers

    t0 = time.monotonic()
    cp = ControlPlane(tmp_path_factory.mktemp("realcp")).start()
    nodes = RealNodes(
        cp,
        [RealNodeSpec(n) for n in NODES],
        images=list(images.values()),
        run_dir=tmp_path_factory.mktemp("realnodes"),
    )
    try:
        nodes.start()
        TIMINGS["cluster up (s)"] = round(time.monotonic() - t0, 2)
        TIMINGS.update({f"cluster: {k} (s)": v for k, v in nodes.timings.items()})
        yield cp, nodes
    finally:
        t0 = time.monotonic()
        try:
            nodes.stop()
        finally:
            cp.stop()
        TIMINGS["teardown (s)"] = round(time.monotonic() - t0, 2)
        left = host_leftovers(nodes) + [f"process group {p}" for p in procs.survivors(cp.pids)]
        _write_results()
        assert not left, f"the real cluster left these behind: {left}"


def _write_results() -> None:
    dst = os.environ.get("MOE_REALCLUSTER_RESULTS")
    if not dst:
        return
    path = Path(dst)
    doc = json.loads(path.read_text()) if path.exists() else {}
    # warm: every image cached; code change: images rebuilt on a cached base (docker's layer
    # cache keeps the dependency layers); cold: the base image too (an empty cache)
    kind = (
        "warm"
        if TIMINGS.get("images cached")
        else "cold"
        if TIMINGS.get("base image (s)", 0) > 1
        else "code change"
    )
    doc[kind] = {
        "command": f"MOE_REALCLUSTER_RESULTS={dst} python -m pytest -m realnodes "
        "tests/test_realcluster.py",
        "cpus": os.cpu_count(),
        "measuredAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "timings": dict(TIMINGS),
    }
    path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


class Cli:
    def __init__(self, cp):
        self.env = cp.kubectl_env()
        self.kubectl, self.helm = str(binaries.kubectl_binary()), str(binaries.helm_binary())

    def run(
        self,
        tool: str,
        *args: str,
        input: str | None = None,
        timeout: float = 120,
        check: bool = True,
    ) -> subprocess.CompletedProcess:
        exe = self.helm if tool == "helm" else self.kubectl
        res = subprocess.run(
            [exe, *args], env=self.env, input=input, text=True, capture_output=True, timeout=timeout
        )
        if check and res.returncode != 0:
            raise AssertionError(
                f"{tool} {' '.join(args)} exited {res.returncode}:\n{res.stdout}\n{res.stderr}"
            )
        return res


def _security_facts(cli: Cli, ns: str, pod: str, container: str) -> dict:
    """Run PROBE inside the running container (kubectl exec: API server -> kubelet ->
    containerd)."""
    out = cli.run(
        "kubectl", "exec", "-n", ns, pod, "-c", container, "--", "python3", "-c", PROBE, timeout=60
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def _promised(pod) -> dict:
    """What the pod spec promises for its first container (pod + container securityContext)."""
    psc, c = pod.spec.security_context, pod.spec.containers[0]
    csc = c.security_context
    return {
        "uid": (csc and csc.run_as_user) or (psc and psc.run_as_user),
        "gid": (csc and csc.run_as_group) or (psc and psc.run_as_group),
        "nonRoot": bool((csc and csc.run_as_non_root) or (psc and psc.run_as_non_root)),
        "readOnlyRoot": bool(csc and csc.read_only_root_filesystem),
        "noNewPrivs": csc is not None and csc.allow_privilege_escalation is False,
        "dropAll": bool(csc and csc.capabilities and "ALL" in (csc.capabilities.drop or [])),
        "seccompDefault": bool(
            psc and psc.seccomp_profile and psc.seccomp_profile.type == "RuntimeDefault"
        ),
    }


def _check_security(facts: dict, promised: dict, what: str) -> None:
    if promised["uid"] is not None:
        assert facts["uid"] == promised["uid"], (what, facts, promised)
    if promised["gid"] is not None:
        assert facts["gid"] == promised["gid"], (what, facts, promised)
    if promised["nonRoot"]:
        assert facts["uid"] != 0, (what, facts)
    assert facts["readOnlyRoot"] == promised["readOnlyRoot"], (what, facts, promised)
    if promised["noNewPrivs"]:
        assert facts["noNewPrivs"] == 1, (what, facts)
    if promised["dropAll"]:
        assert facts["capEff"] == 0, (what, facts)
    if promised["seccompDefault"]:
        assert facts["seccomp"] == 2, (what, facts)  # SECCOMP_MODE_FILTER


# What the dev package (operator/dev) and the old in-product test tooling would put in an image.
DEV_PATHS = (
    "site-packages/moe_localkube/",
    "site-packages/moe_fake_nvml/",
    "site-packages/moe_faults.py",
    "site-packages/moejob_operator/demo.py",
    "site-packages/moe_trainer/discovery/fake_nvml.py",
    "site-packages/moe_trainer/discovery/synth.py",
    "site-packages/moe_trainer/discovery/recordings/",
    "site-packages/moe_operator_dev",
)


def test_images_hold_the_product_only(images):
    """The images built from the Dockerfiles have the product and none of the dev tooling (local
    cluster, demo, fake NVML and its recordings, fault hooks): read from the image archives."""
    from moe_localkube.images import archive_paths

    for name, img in images.items():
        paths = archive_paths(img.tar)
        site = [p for p in paths if "site-packages/" in p]
        assert any(p.endswith("site-packages/moejob_operator/handlers.py") for p in site), name
        assert any(p.endswith("site-packages/moe_trainer/discovery/main.py") for p in site), name
        assert any(
            p.endswith("site-packages/moe_trainer/discovery/nvml_record.py") for p in site
        ), name
        assert any(p.endswith("site-packages/moe_contracts/plan.py") for p in site), name
        dev = sorted(p for p in site if any(d in p for d in DEV_PATHS))
        assert not dev, (name, dev[:20])


def test_users_path_on_real_nodes(cluster, images, tmp_path):
    cp, _nodes = cluster
    kube = Kube.from_api_client(cp.api_client())
    cli = Cli(cp)
    op_image = images["operator"].ref  # moe-operator:<content key>

    # ---- real nodes, GPU-like: labels, nvidia.com/gpu capacity, kubectl logs through the kubelet
    for name in NODES:
        node = kube.core.read_node(name)
        assert node.metadata.labels["nvidia.com/gpu.present"] == "true"
        assert node.status.allocatable[C.GPU_RESOURCE] == "8"
        assert node.status.node_info.container_runtime_version.startswith("containerd://")
        assert node.status.node_info.kubelet_version == "v1.20.2"

    # the example's checkpoints go to a hostPath under a prefix the chart must allow
    # (hostPathPolicy; every hostPath is refused by default): the pod mounts the prefix and reaches
    # the job's folder (one the workers, non-root, may write) by subPath through the real kubelet
    ckpt = Path(tempfile.mkdtemp(prefix="moe-e2e-ckpt-"))
    ckpt.chmod(0o1777)
    (ckpt / "tiny-cpu").mkdir(mode=0o1777)
    (ckpt / "tiny-cpu").chmod(0o1777)  # mkdir's mode is masked by the umask

    # ---- helm install with the built operator image; Ready through its probes; lease taken.
    # The operator reconciles (and holds write permissions in) the listed namespaces only.
    ns = create_namespace(kube, "moe-e2e")
    t0 = time.monotonic()
    repo, tag = op_image.rsplit(":", 1)
    cli.run(
        "helm",
        "install",
        RELEASE,
        str(CHART),
        "-n",
        RELEASE_NS,
        "--create-namespace",
        "--server-side=false",
        "--set",
        f"image.repository={repo}",
        "--set",
        f"image.tag={tag}",
        "--set",
        "image.pullPolicy=Never",
        "--set",
        f"hostPathPolicy.allowedPrefixes={{{ckpt}}}",
        "--set",
        f"watchNamespaces={{{ns}}}",
        "--wait",
        "--timeout",
        "5m",
        timeout=360,
    )
    cli.run(
        "kubectl",
        "rollout",
        "status",
        "-n",
        RELEASE_NS,
        f"deployment/{RELEASE}-moe-operator",
        "--timeout=120s",
        timeout=150,
    )
    (op_pod,) = kube.core.list_namespaced_pod(
        RELEASE_NS, label_selector="app.kubernetes.io/component=operator"
    ).items
    (st,) = op_pod.status.container_statuses
    assert st.ready and st.restart_count == 0 and st.image.endswith(op_image), st
    assert op_pod.spec.containers[0].readiness_probe.http_get.path == "/readyz"
    wait_for(
        lambda: (
            kube.coordination.read_namespaced_lease(
                "moe-operator-leader", RELEASE_NS
            ).spec.holder_identity
            == op_pod.metadata.name
        ),
        timeout=60,
        message="operator lease",
    )
    TIMINGS["install: helm install -> Ready + lease (s)"] = round(time.monotonic() - t0, 2)
    logs = cli.run("kubectl", "logs", "-n", RELEASE_NS, op_pod.metadata.name).stdout
    assert logs.strip(), "kubectl logs of the operator pod is empty"
    _check_security(
        _security_facts(cli, RELEASE_NS, op_pod.metadata.name, "operator"),
        _promised(op_pod),
        "operator",
    )

    # ---- kubectl apply -f examples/tiny-cpu.yaml (checkpoints on a hostPath the workers may write)
    t0 = time.monotonic()
    job = yaml.safe_load(EXAMPLE.read_text())
    job["spec"]["checkpoint"]["volume"]["hostPath"]["path"] = str(ckpt / "tiny-cpu")
    assert (
        job["spec"]["image"] == "moe-trainer:local"
        and "moe-trainer:local" in images["trainer"].tags
    )
    try:
        # as JSON: a YAML dump would turn the quoted learningRate "1e-3" into a number
        cli.run("kubectl", "apply", "-n", ns, "-f", "-", input=json.dumps(job))
        name = job["metadata"]["name"]
        worker_seen: dict[str, dict] = {}

        def workers_checked():
            pods = kube.core.list_namespaced_pod(
                ns, label_selector=f"{C.LABEL_COMPONENT}=worker"
            ).items
            for p in pods:
                if p.metadata.name in worker_seen or p.status.phase != "Running":
                    continue
                if any(s.state.running for s in p.status.container_statuses or ()):
                    # AssertionError: it just exited; the next running one, or the gang's retry
                    with contextlib.suppress(AssertionError):
                        worker_seen[p.metadata.name] = {
                            "facts": _security_facts(cli, ns, p.metadata.name, "trainer"),
                            "promised": _promised(p),
                            "node": p.spec.node_name,
                        }
            return len(worker_seen) >= 1 and len(pods) >= 2

        try:
            wait_for(
                workers_checked, timeout=900, interval=0.5, message=f"worker pods running in {ns}"
            )
        except AssertionError as exc:
            raise AssertionError(
                f"{exc}\njob conditions: {_job_status(kube, ns, name)}\n"
                f"operator log:\n{_operator_log(cli)}"
            ) from None
        for pod_name, seen in worker_seen.items():
            _check_security(seen["facts"], seen["promised"], f"worker {pod_name}")
        res = cli.run(
            "kubectl",
            "wait",
            "-n",
            ns,
            f"{C.PLURAL}/{name}",
            "--for=condition=Succeeded",
            "--timeout=900s",
            timeout=960,
            check=False,
        )
        assert res.returncode == 0, (res.stderr, _job_status(kube, ns, name), _operator_log(cli))
        TIMINGS["job: apply -> Succeeded (s)"] = round(time.monotonic() - t0, 2)

        # every step ran in real containers of the built trainer image, on the real nodes
        for node in NODES:
            cm = kube.core.read_namespaced_config_map(f"moe-topology-{node}", ns)
            report = json.loads(cm.data[C.TOPOLOGY_KEY])
            assert len(report["gpus"]) == 8, report  # moe-discover read the node's (recorded) NVML
            # ... through the fake driver the node mounted (the image has no fake NVML)
            assert (report["source"], report["fixture"]) == ("fake-nvml", "nvswitch-h100-8"), report
        smoke = [
            j
            for j in kube.batch.list_namespaced_job(RELEASE_NS).items
            if (j.metadata.labels or {}).get(C.LABEL_COMPONENT) == "smoke"
        ]
        assert smoke and smoke[0].status.succeeded == 1, [j.status for j in smoke]
        workers = kube.core.list_namespaced_pod(
            ns, label_selector=f"{C.LABEL_COMPONENT}=worker"
        ).items
        assert {p.spec.node_name for p in workers} == set(NODES)
        for p in workers:
            (cs,) = p.status.container_statuses
            assert cs.state.terminated and cs.state.terminated.exit_code == 0, cs
            assert cs.image_id and "moe-trainer" in cs.image, cs
        out = cli.run("kubectl", "logs", "-n", ns, workers[0].metadata.name).stdout
        assert out.strip(), "kubectl logs of a worker is empty"
        assert any((ckpt / "tiny-cpu").rglob("*")), "the workers wrote no checkpoint (subPath)"
    finally:
        cli.run("kubectl", "delete", "-n", ns, f"{C.PLURAL}", "--all", "--wait=false", check=False)

    # ---- a symlink planted under the allowed prefix: the real kubelet refuses the subPath
    t0 = time.monotonic()
    _symlink_out_of_the_prefix_is_refused(kube, cli, _nodes, ns, ckpt)
    TIMINGS["symlink: apply -> kubelet refused -> children gone (s)"] = round(
        time.monotonic() - t0, 2
    )

    # ---- helm uninstall: no operator objects left (the CRD stays, as docs/install.md says)
    t0 = time.monotonic()
    cli.run(
        "helm", "uninstall", RELEASE, "-n", RELEASE_NS, "--wait", "--timeout", "3m", timeout=240
    )
    inst = f"app.kubernetes.io/instance={RELEASE}"
    from kubernetes import client as k8s

    apps = k8s.AppsV1Api(kube.api_client)
    left = [
        d.metadata.name for d in apps.list_deployment_for_all_namespaces(label_selector=inst).items
    ]
    left += [
        s.metadata.name
        for s in kube.core.list_service_account_for_all_namespaces(label_selector=inst).items
    ]
    left += [
        s.metadata.name
        for s in kube.core.list_service_for_all_namespaces(label_selector=inst).items
    ]
    left += [r.metadata.name for r in kube.rbac.list_cluster_role(label_selector=inst).items]
    left += [
        r.metadata.name for r in kube.rbac.list_cluster_role_binding(label_selector=inst).items
    ]
    left += [
        r.metadata.name
        for r in kube.rbac.list_role_binding_for_all_namespaces(label_selector=inst).items
    ]
    assert not left, f"helm uninstall left {left}"
    wait_for(
        lambda: (
            not kube.core.list_namespaced_pod(
                RELEASE_NS, label_selector="app.kubernetes.io/component=operator"
            ).items
        ),
        timeout=120,
        message="the operator pod to go",
    )
    assert kube.apiext.read_custom_resource_definition(f"{C.PLURAL}.{C.GROUP}")
    TIMINGS["uninstall (s)"] = round(time.monotonic() - t0, 2)
    shutil.rmtree(ckpt, ignore_errors=True)


# The kubelet's answer (v1.20 pkg/kubelet/kubelet_pods.go makeMounts) in the container status:
# the detail, kept out of the status so as not to describe the host, goes to the kubelet's log
# (pkg/volume/util/subpath/subpath_linux.go: 'subpath "<resolved>" not within volume path "<vol>"').
SUBPATH_REFUSED = 'failed to prepare subPath for volumeMount "checkpoint" of container "trainer"'


def _symlink_out_of_the_prefix_is_refused(kube, cli: Cli, nodes, ns: str, ckpt: Path) -> None:
    """Issue 31: a job whose checkpoint hostPath is ``<allowed prefix>/escape``, ``escape`` a
    symlink to a folder outside the prefix that the workers could write (1777). The pod mounts the
    prefix and reaches ``escape`` by subPath; the real kubelet resolves it, finds it outside its
    volume and does not create the container. Nothing is written outside, the job does not
    succeed, and deleting it removes its children."""
    outside = Path(tempfile.mkdtemp(prefix="moe-e2e-outside-"))
    outside.chmod(0o1777)
    (ckpt / "escape").symlink_to(outside)
    name = "escape"
    job = yaml.safe_load(EXAMPLE.read_text())
    job["metadata"]["name"] = name
    job["spec"]["checkpoint"] = {
        "everySteps": 1,
        "volume": {"hostPath": {"path": str(ckpt / name)}},
    }
    job["spec"]["training"].update(steps=2)
    job["spec"]["gate"] = {"skip": True, "skipReason": "the image passed the gate above"}
    try:
        cli.run("kubectl", "apply", "-n", ns, "-f", "-", input=json.dumps(job))
        sel = f"{C.LABEL_JOB}={name},{C.LABEL_COMPONENT}=worker"

        def refused_or_ran():
            # a refused worker, or the hole: a trainer container that started, or files outside
            for p in kube.core.list_namespaced_pod(ns, label_selector=sel).items:
                for cs in p.status.container_statuses or ():
                    w = cs.state.waiting if cs.state else None
                    if (
                        w
                        and w.reason == "CreateContainerConfigError"
                        and w.message == SUBPATH_REFUSED
                    ):
                        return p
                    if cs.state and (cs.state.running or cs.state.terminated):
                        return "ran"
            return "ran" if any(outside.iterdir()) else None

        try:
            pod = wait_for(refused_or_ran, timeout=600, interval=1, message="a refused worker")
            assert pod != "ran", "a worker's container started with the escaping checkpoint"
        except AssertionError as exc:  # what happened instead: the evidence for a real hole
            pods = [
                (p.metadata.name, p.status.phase, p.status.container_statuses)
                for p in kube.core.list_namespaced_pod(ns, label_selector=sel).items
            ]
            raise AssertionError(
                f"{exc}\nworkers: {pods}"
                f"\noutside: {sorted(str(x) for x in outside.rglob('*'))}"
                f"\njob: {_job_status(kube, ns, name)}\noperator log:\n{_operator_log(cli)}"
            ) from None
        vols = {v.name: v for v in pod.spec.volumes}
        assert vols["checkpoint"].host_path.path == str(ckpt), vols["checkpoint"]
        (vm,) = [m for m in pod.spec.containers[0].volume_mounts if m.name == "checkpoint"]
        assert vm.sub_path == "escape", vm
        # the detail in the node's kubelet log: the symlink resolved outside the volume
        line = wait_for(
            lambda: next(
                (
                    ln
                    for ln in nodes.kubelet_log(pod.spec.node_name).splitlines()
                    if SUBPATH_REFUSED in ln and "not within volume path" in ln
                ),
                None,
            ),
            timeout=60,
            interval=1,
            message="the kubelet's log names the refusal",
        )
        assert str(outside) in line, line
        assert list(outside.iterdir()) == [], "a worker wrote outside the allowed prefix"
        status = kube.custom.get_namespaced_custom_object(C.GROUP, C.VERSION, ns, C.PLURAL, name)
        assert status.get("status", {}).get("phase") != "Succeeded", status.get("status")
        uid = status["metadata"]["uid"]
    finally:
        cli.run("kubectl", "delete", "-n", ns, f"{C.PLURAL}/{name}", "--wait=false", check=False)
    wait_for(
        lambda: not _children(kube, ns, name, uid),
        timeout=300,
        interval=1,
        message=f"the children of {name} to go",
    )
    assert list(outside.iterdir()) == [], "a worker wrote outside the allowed prefix"
    (ckpt / "escape").unlink()
    shutil.rmtree(outside, ignore_errors=True)


def _children(kube, ns: str, name: str, uid: str) -> list[str]:
    """The job's objects still there: itself, pods with its label, anything it owns."""
    left = [
        f"pod {p.metadata.name}"
        for p in kube.core.list_namespaced_pod(ns, label_selector=f"{C.LABEL_JOB}={name}").items
    ]
    listers = {
        "ConfigMap": kube.core.list_namespaced_config_map,
        "Service": kube.core.list_namespaced_service,
        "ServiceAccount": kube.core.list_namespaced_service_account,
        "Pod": kube.core.list_namespaced_pod,
        "Role": kube.rbac.list_namespaced_role,
        "RoleBinding": kube.rbac.list_namespaced_role_binding,
    }
    for kind, lister in listers.items():
        left += [
            f"{kind} {o.metadata.name}"
            for o in lister(ns).items
            if any(r.uid == uid for r in o.metadata.owner_references or ())
        ]
    jobs = kube.custom.list_namespaced_custom_object(C.GROUP, C.VERSION, ns, C.PLURAL)["items"]
    left += [f"job {j['metadata']['name']}" for j in jobs if j["metadata"]["uid"] == uid]
    return left


def _operator_log(cli: Cli) -> str:
    res = cli.run(
        "kubectl",
        "logs",
        "-n",
        RELEASE_NS,
        f"deployment/{RELEASE}-moe-operator",
        "--tail=60",
        check=False,
    )
    return res.stdout + res.stderr


def _job_status(kube, ns, name) -> str:
    try:
        obj = kube.custom.get_namespaced_custom_object(C.GROUP, C.VERSION, ns, C.PLURAL, name)
        return json.dumps(
            [
                (c["type"], c["status"], c.get("reason"), c.get("message", "")[:200])
                for c in obj.get("status", {}).get("conditions", [])
            ]
        )
    except Exception as exc:  # noqa: BLE001 - diagnostics only
        return repr(exc)
