"""The Helm chart without a cluster: lint, render, schema refusals, CRD drift, restricted pod
security, the Deployment's arguments against the real ``moectl`` parser, and the dashboard's
metric names against what the operator and the trainer export."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

import plan_fixtures
from moe_localkube import binaries
from moejob_operator import metrics
from moejob_operator.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "moe-operator"
EXAMPLE_VALUES = CHART / "ci" / "example-values.yaml"


@pytest.fixture(scope="module")
def helm() -> str:
    return str(binaries.helm_binary())


def run_helm(helm: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=60)


def render(helm: str, *args: str) -> list[dict]:
    out = run_helm(helm, "template", "rel", str(CHART), "-n", "moe-system", *args)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


@pytest.mark.parametrize("values", [[], ["-f", str(EXAMPLE_VALUES)]], ids=["default", "example"])
def test_lint_strict_and_template_clean(helm, values):
    out = run_helm(helm, "lint", "--strict", str(CHART), *values)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 chart(s) failed" in out.stdout
    docs = render(helm, *values)
    kinds = {d["kind"] for d in docs}
    assert {"ServiceAccount", "ClusterRole", "Deployment", "Service"} <= kinds
    for d in docs:  # every object labelled by the release
        assert d["metadata"]["labels"]["app.kubernetes.io/instance"] == "rel", d["metadata"]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (["--set", "replicaCount=two"], "/replicaCount': got string, want integer"),
        (["--set", "replicaCount=5"], "/replicaCount': maximum"),
        (["--set", "image.pullPolicy=Sometimes"], "value must be one of"),
        (["--set", "metrics.port=70000"], "/metrics/port': maximum"),
        (["--set", "imagePort=1"], "additional properties 'imagePort' not allowed"),
        (["--set", "logging.format=xml"], "/logging/format'"),
        (["--set", "watchNamespaces={Team_A}"], "does not match pattern"),
        (["--set", "watchNamespaces={kube-system}"], "/watchNamespaces/0': 'not' failed"),
        (["--set-json", "watchNamespaces=[]"], "minItems: got 0, want 1"),
        (["--set", "podSecurityContext.runAsNonRoot=false"], "/podSecurityContext/runAsNonRoot'"),
        (
            ["--set", "containerSecurityContext.privileged=true"],
            "/containerSecurityContext/privileged'",
        ),
        (["--set", "containerSecurityContext.capabilities.add={NET_ADMIN}"], "capabilities/add'"),
        (["--set", "metrics.serviceMonitor.interval=often"], "does not match pattern"),
        # cross-field rules the schema cannot express fail in the templates
        (
            ["--set", "replicaCount=2", "--set", "leaderElection.enabled=false"],
            "needs leaderElection.enabled",
        ),
        (["--set", "leaderElection.renewDeadlineSeconds=20"], "must be smaller than"),
        (["--set", "serviceAccount.create=false"], "serviceAccount.name is required"),
        (["--set", "hostPathPolicy.allowedPrefixes={relative/dir}"], "does not match pattern"),
    ],
)
def test_bad_values_are_refused(helm, bad, message):
    out = run_helm(helm, "template", "rel", str(CHART), *bad)
    assert out.returncode != 0
    assert message in out.stderr, out.stderr
    if "needs" in message or "smaller" in message or "required" in message:
        # template `fail`/`required`: helm lint only logs them (by design), install/template refuse
        return
    lint = run_helm(helm, "lint", str(CHART), *bad)
    assert lint.returncode != 0 and message in lint.stdout + lint.stderr


def test_chart_crd_does_not_drift_from_crds_folder():
    ours = sorted(p.name for p in (CHART / "crds").iterdir())
    theirs = sorted(p.name for p in (ROOT / "crds").iterdir())
    assert ours == theirs
    for name in theirs:
        assert (CHART / "crds" / name).read_bytes() == (ROOT / "crds" / name).read_bytes(), (
            f"charts/moe-operator/crds/{name} differs from crds/{name}: cp crds/{name} "
            "charts/moe-operator/crds/"
        )


def _dockerfile_user() -> int:
    users = re.findall(r"^USER\s+(\d+)", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    return int(users[-1])


@pytest.mark.parametrize("values", [[], ["-f", str(EXAMPLE_VALUES)]], ids=["default", "example"])
def test_operator_pod_meets_the_restricted_profile(helm, values):
    (dep,) = by_kind(render(helm, *values), "Deployment")
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == _dockerfile_user() == 10001
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert not any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
    assert all("hostPath" not in v for v in pod.get("volumes", ()))
    (c,) = pod["containers"]
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert {m["mountPath"] for m in c["volumeMounts"]} == {"/tmp"}  # the only writable path


def test_deployment_arguments_are_what_moectl_operator_accepts(helm):
    docs = render(helm, "-f", str(EXAMPLE_VALUES))
    (dep,) = by_kind(docs, "Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["moectl", "operator"]
    args = build_parser().parse_args([*c["command"][1:], *c["args"]])
    assert args.namespace == ["ml-team-a", "ml-team-b"] and args.leader_election
    assert (args.lease_duration, args.renew_deadline, args.retry_period) == (20, 12.0, 3.0)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"health": args.health_port, "http-metrics": args.metrics_port}
    assert (
        c["livenessProbe"]["httpGet"]["port"] == c["readinessProbe"]["httpGet"]["port"] == "health"
    )
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"] if "valueFrom" in e}
    assert env == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    # one RoleBinding per watched namespace, no cluster-wide binding of the job permissions
    rbs = {(d["metadata"]["namespace"], d["roleRef"]["name"]) for d in by_kind(docs, "RoleBinding")}
    assert {("ml-team-a", "rel-moe-operator-jobs"), ("ml-team-b", "rel-moe-operator-jobs")} <= rbs
    assert [d["roleRef"]["name"] for d in by_kind(docs, "ClusterRoleBinding")] == [
        "rel-moe-operator-cluster"
    ]

    # least privilege by default: the default namespace only, bound there, nothing cluster-wide
    docs = render(helm)
    default = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    args = build_parser().parse_args([*default["command"][1:], *default["args"]])
    assert not args.all_namespaces and args.namespace == ["default"]
    rbs = {(d["metadata"]["namespace"], d["roleRef"]["name"]) for d in by_kind(docs, "RoleBinding")}
    assert ("default", "rel-moe-operator-jobs") in rbs
    assert [d["roleRef"]["name"] for d in by_kind(docs, "ClusterRoleBinding")] == [
        "rel-moe-operator-cluster"
    ]
    # every namespace only when asked, and then bound cluster-wide
    docs = render(helm, "--set", "watchAllNamespaces=true")
    every = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    args = build_parser().parse_args([*every["command"][1:], *every["args"]])
    assert args.all_namespaces and args.namespace == []
    assert sorted(d["roleRef"]["name"] for d in by_kind(docs, "ClusterRoleBinding")) == [
        "rel-moe-operator-cluster",
        "rel-moe-operator-jobs",
    ]


def test_host_path_policy_reaches_the_operator_and_defaults_to_none(helm):
    """The operator refuses every hostPath unless the chart lists allowed prefixes
    (admission.py)."""
    from moejob_operator.admission import Policy

    def policy(*args):
        (dep,) = by_kind(render(helm, *args), "Deployment")
        (c,) = dep["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
        assert "MOE_OPERATOR_TEST_MODE" not in env  # test hooks never on in a release
        return Policy.from_env(env)

    assert policy() == Policy()
    assert policy(
        "--set", "hostPathPolicy.allowedPrefixes={/mnt/shared,/data/ro}"
    ).host_path_prefixes == ("/mnt/shared", "/data/ro")


def test_service_and_monitors_point_at_the_metrics_port(helm):
    docs = render(helm, "-f", str(EXAMPLE_VALUES))
    (svc,) = by_kind(docs, "Service")
    (dep,) = by_kind(docs, "Deployment")
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert svc["spec"]["ports"][0]["targetPort"] == "http-metrics"
    (sm,) = by_kind(docs, "ServiceMonitor")
    assert sm["spec"]["endpoints"][0]["port"] == "http-metrics"
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (pm,) = by_kind(docs, "PodMonitor")
    assert pm["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/managed-by": "moe-operator",
        "moe-operator.io/component": "worker",
    }
    assert not by_kind(render(helm), "ServiceMonitor")  # optional: off by default


def _exported_names() -> set[str]:
    """Sample names the operator exports (after every call site fired) and the trainer's."""
    metrics.observe_job(
        "ns",
        "j",
        {
            "phase": "Running",
            "conditions": [{"type": "Planned", "status": "True"}],
            "plan": {
                "crossGroupVsContiguous": "0.5",
                "maxMeanLoad": "1.0",
                "estimatedPeakBytesPerGpu": 1,
                "fits": True,
            },
        },
    )
    metrics.observe_plan(
        "ns",
        "j",
        plan_fixtures.plan(quality={"crossGroupBytesPerStep": 1, "crossNodeBytesPerStep": 1}),
    )
    with pytest.raises(RuntimeError, match="x"), metrics.reconcile_timer():
        raise RuntimeError("x")
    metrics.record_smoke_verdict("img", "Passed")
    metrics.set_leader(True)
    try:
        names = {
            line.split("{")[0].split()[0]
            for line in metrics.render().decode().splitlines()
            if line and not line.startswith("#")
        }
    finally:
        metrics.forget_job("ns", "j")
    # the trainer's names, from its source (constructing Metrics would open a port)
    src = (ROOT / "trainer_image" / "moe_trainer" / "telemetry" / "progress.py").read_text()
    trainer = set(re.findall(r'(?:Gauge|Counter)\(\s*"(moe_trainer_\w+)"', src))
    assert len(trainer) >= 8
    counters = set(re.findall(r'Counter\(\s*"(moe_trainer_\w+)"', src))
    return names | (trainer - counters) | {f"{c}_total" for c in counters}


def test_dashboard_uses_only_exported_metric_names_and_ships_in_the_configmap(helm):
    raw = (CHART / "dashboards" / "moe-operator.json").read_text()
    dash = json.loads(raw)
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", ())]
    used = {m for e in exprs for m in re.findall(r"\b(moe_(?:operator|trainer)_\w+)", e)}
    exported = _exported_names()
    missing = used - exported
    assert not missing, f"dashboard queries metrics nobody exports: {sorted(missing)}"
    assert any(m.startswith("moe_trainer_") for m in used) and any(
        m.startswith("moe_operator_") for m in used
    )
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    (cm,) = by_kind(render(helm, "--set", "dashboard.enabled=true"), "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["moe-operator.json"]) == dash


def test_notes_tell_what_to_do_next(helm):
    out = run_helm(helm, "install", "rel", str(CHART), "-n", "moe-system", "--dry-run=client")
    assert out.returncode == 0, out.stderr
    notes = out.stdout.split("NOTES:", 1)[1]
    for needle in (
        "kubectl apply -f examples/",
        "kubectl get moejob -w",
        "port-forward",
        "does NOT upgrade the MoETrainingJob CRD",
        "docs/troubleshooting.md",
    ):
        assert needle in notes


def test_gate_namespace_and_pull_secrets_reach_the_operator_and_its_role(helm):
    """``gate.namespace``: the operator's gate settings and its gate Role/RoleBinding name it
    (default: the release namespace); ``gate.imagePullSecrets`` reach the smoke Job's pods."""
    from moejob_operator.builders.smoke import smoke_job
    from moejob_operator.core import gate as G

    def gate(*args):
        docs = render(helm, *args)
        (dep,) = by_kind(docs, "Deployment")
        (c,) = dep["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
        env["POD_NAMESPACE"] = dep["metadata"].get("namespace") or "default"
        config = G.GateConfig.from_env(env)
        roles = {
            (d["kind"], d["metadata"]["namespace"])
            for d in docs
            if d["kind"] in ("Role", "RoleBinding") and d["metadata"]["name"].endswith("-gate")
        }
        return config, roles

    config, roles = gate()
    assert config.image_pull_secrets == ()
    assert roles == {("Role", config.namespace), ("RoleBinding", config.namespace)}
    config, roles = gate(
        "--set", "gate.namespace=moe-gate", "--set", "gate.imagePullSecrets={regcred,other}"
    )
    assert config.namespace == "moe-gate" and config.image_pull_secrets == ("regcred", "other")
    assert roles == {("Role", "moe-gate"), ("RoleBinding", "moe-gate")}
    job = smoke_job(G.identity_for("registry.example/team/trainer:1", None, "CPU", None), 1, config)
    assert job["metadata"]["namespace"] == "moe-gate"
    assert job["spec"]["template"]["spec"]["imagePullSecrets"] == [
        {"name": "regcred"},
        {"name": "other"},
    ]
    for bad in ("gate.namespace=kube-system", "gate.imagePullSecrets={Bad_Name}"):
        assert run_helm(helm, "template", "rel", str(CHART), "--set", bad).returncode != 0
