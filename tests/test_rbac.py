"""The chart's RBAC is exactly what the code needs: derived from the source, not listed by hand.

Needs come from (1) every Kubernetes API method the operator's code references (AST of
``reconcile/*.py``, ``childwatch.py`` (list + watch) and ``run.py``:
``<api>.<verb>_[namespaced_]<resource>[_status]``), (2) what kopf watches and patches (the
decorators in ``handlers.py``), (3) the Roles the builders create for
worker and discovery pods (RBAC escalation prevention: the operator must hold what it grants),
(4) kopf's CRD observation. The rendered chart must grant every need, in the right scope, and
nothing beyond the needs plus a short list of documented extras. A new API call in the code
without a chart change fails here; so does a grant the code no longer needs.
"""

from __future__ import annotations

import ast
import re
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest
import yaml

from moe_localkube import binaries
from moejob_operator import constants as C
from moejob_operator.builders import discovery, rbac
from moejob_operator.builders.common import JobRef

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "operator" / "moejob_operator"
CHART = ROOT / "charts" / "moe-operator"

# kubernetes client method suffix -> (API group, resource). An unknown suffix fails the test:
# add the resource here and the grant to charts/moe-operator/templates/rbac.yaml.
RESOURCES = {
    "config_map": ("", "configmaps"),
    "pod": ("", "pods"),
    "pod_for_all_namespaces": ("", "pods"),
    "config_map_for_all_namespaces": ("", "configmaps"),
    "service": ("", "services"),
    "service_account": ("", "serviceaccounts"),
    "event": ("", "events"),
    "node": ("", "nodes"),
    "secret": ("", "secrets"),
    "namespace": ("", "namespaces"),
    "role": ("rbac.authorization.k8s.io", "roles"),
    "role_binding": ("rbac.authorization.k8s.io", "rolebindings"),
    "custom_object": (C.GROUP, C.PLURAL),
    "cluster_custom_object": (C.GROUP, C.PLURAL),
    "job": ("batch", "jobs"),
    "lease": ("coordination.k8s.io", "leases"),
    "pod_group": (C.VOLCANO_GROUP, C.VOLCANO_PODGROUPS),  # Client.volcano (PodGroupApi)
}
CLUSTER_SCOPED = {
    ("", "nodes"),
    ("", "namespaces"),
    ("apiextensions.k8s.io", "customresourcedefinitions"),
}
VERBS = {
    "create": "create",
    "read": "get",
    "get": "get",
    "replace": "update",
    "patch": "patch",
    "delete": "delete",
    "list": "list",
}
API_ATTRS = {"core", "custom", "rbac", "batch", "coordination", "api", "volcano"}
METHOD = re.compile(
    r"^(create|read|get|replace|patch|delete|list)_(namespaced_)?([a-z_]+?)(_status)?$"
)

# Granted without a call site, each for a stated reason.
EXTRAS = {
    # ownerReferences with blockOwnerDeletion: required where OwnerReferencesPermissionEnforcement
    # is on
    (C.GROUP, f"{C.PLURAL}/finalizers", "update"),
}
# kopf's resource observation: it lists and watches CRDs to notice ours being (re)installed.
KOPF_FRAMEWORK = {
    ("apiextensions.k8s.io", "customresourcedefinitions", v) for v in ("list", "watch")
}

Need = tuple[str, str, str]  # (group, resource, verb)


def api_calls(source: str) -> set[Need]:
    """(group, resource, verb) of every ``<...>.<api>.<method>`` reference in ``source``."""
    needs: set[Need] = set()
    for node in ast.walk(ast.parse(source)):
        if not (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr in API_ATTRS
        ):
            continue
        m = METHOD.match(node.attr)
        if not m:
            continue
        verb, _, suffix, status = m.groups()
        if suffix == "api_resources":  # API discovery: every authenticated user may read it
            continue
        if suffix not in RESOURCES:
            raise AssertionError(
                f"API method {node.attr}: resource {suffix!r} is not in RESOURCES; "
                "add it and grant it in the chart"
            )
        group, resource = RESOURCES[suffix]
        needs.add((group, resource + ("/status" if status else ""), VERBS[verb]))
    return needs


def client_method_calls(source: str) -> dict[str, set[Need]]:
    """Client method name -> the API calls in its body (reconcile/client.py)."""
    tree = ast.parse(source)
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Client"]
    return {f.name: api_calls(ast.unparse(f)) for f in cls.body if isinstance(f, ast.FunctionDef)}


def kopf_needs(source: str) -> set[Need]:
    """What kopf does for each decorated resource: list + watch; patch where it keeps state on the
    object (create/update/resume/timer/delete handlers: annotations, finalizer) or may remove a
    finalizer it once added (``settings.persistence.finalizer`` named in handlers.py)."""
    consts = {f"C.{k}": v for k, v in vars(C).items() if isinstance(v, str)}
    needs: set[Need] = set()
    for node in ast.walk(ast.parse(source)):
        if not (
            isinstance(node, ast.Call)
            and ast.unparse(node.func).startswith(("kopf.on.", "kopf.timer"))
        ):
            continue
        args = [consts.get(ast.unparse(a), getattr(a, "value", None)) for a in node.args]
        if not args:
            continue  # kopf.on.startup() and friends
        if len(args) == 3:
            group, _, resource = args
        else:
            version, resource = args
            group = "" if version == "v1" else version.split("/")[0]
        needs |= {(group, resource, "list"), (group, resource, "watch")}
        if ast.unparse(node.func).split(".")[-1] in (
            "create",
            "update",
            "resume",
            "timer",
            "delete",
        ) or (group == C.GROUP and "settings.persistence.finalizer" in source):
            needs.add((group, resource, "patch"))
    return needs


def granted_roles(rules: list[Need]) -> set[Need]:
    return set(rules)


def role_needs(roles: list[dict]) -> set[Need]:
    return {
        (g, r, v)
        for role in roles
        if role["kind"] == "Role"
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }


def derived_needs() -> dict[str, set[Need]]:
    """Needs by where they must be granted: ``jobs`` (every watched namespace), ``cluster``,
    ``gate`` and ``lease`` (release namespace)."""
    client_src = (PKG / "reconcile" / "client.py").read_text()
    per_method = client_method_calls(client_src)
    job_side = api_calls(client_src)
    job_side |= kopf_needs((PKG / "handlers.py").read_text())
    # childwatch.py lists to start and then watches what it lists
    watched = api_calls((PKG / "childwatch.py").read_text())
    assert watched, "childwatch.py lists nothing? update derived_needs"
    job_side |= watched | {(g, r, "watch") for g, r, v in watched if v == "list"}
    for path in sorted((PKG / "reconcile").glob("*.py")):
        if path.name not in ("client.py", "gate.py", "gate_store.py"):
            job_side |= api_calls(path.read_text())
    job = JobRef(namespace="ns", name="job", uid="u")
    job_side |= role_needs(
        [
            rbac.role(job),
            *discovery.discovery_children(job.name, ["node-a"], namespace="ns", image="i"),
        ]
    )
    # the gate's calls: reconcile/gate.py and its store (both in the operator's namespace)
    gate_src = "\n".join(
        (PKG / "reconcile" / name).read_text() for name in ("gate.py", "gate_store.py")
    )
    gate = api_calls(gate_src)
    for name in set(re.findall(r"self\.client\.(\w+)\(", gate_src)) - {"create"}:
        gate |= per_method[name]
    gate |= _gate_creates(gate_src, client_src)
    lease = api_calls((PKG / "run.py").read_text())
    cluster = {n for n in job_side if n[:2] in CLUSTER_SCOPED} | KOPF_FRAMEWORK
    job_side -= cluster
    return {"jobs": job_side | EXTRAS, "cluster": cluster, "gate": gate, "lease": lease}


def _gate_creates(gate_src: str, client_src: str) -> set[Need]:
    """``client.create(B.<builder>(...))`` in gate.py: the kinds those smoke builders return,
    mapped through Client.create's kind -> method table."""
    table = {
        m.group(1): m.group(2) for m in re.finditer(r'"(\w+)": self\.\w+\.(create_\w+)', client_src)
    }
    smoke_src = (PKG / "builders" / "smoke.py").read_text()
    funcs = {
        f.name: ast.unparse(f) for f in ast.parse(smoke_src).body if isinstance(f, ast.FunctionDef)
    }
    needs: set[Need] = set()
    for builder in re.findall(r"self\.client\.create\(B\.(\w+)\(", gate_src):
        for kind in re.findall(r"'kind': '(\w+)'", funcs[builder]):
            needs |= api_calls(f"self.core.{table[kind]}()") if kind in table else set()
    assert needs, "gate.py creates nothing through Client.create? update _gate_creates"
    return needs


def rendered(*args: str) -> list[dict]:
    out = subprocess.run(
        [str(binaries.helm_binary()), "template", "rel", str(CHART), "-n", "moe-system", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def grants(doc: dict) -> set[Need]:
    out = set()
    for rule in doc["rules"]:
        assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"], rule
        out |= {
            (g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]
        }
    return out


def chart_grants(docs: list[dict]) -> dict[str, set[Need]]:
    by_name = {d["metadata"]["name"]: d for d in docs if d["kind"] in ("Role", "ClusterRole")}
    return {
        "jobs": grants(by_name["rel-moe-operator-jobs"]),
        "cluster": grants(by_name["rel-moe-operator-cluster"]),
        "gate": grants(by_name["rel-moe-operator-gate"]),
        "lease": grants(by_name["rel-moe-operator-leader-election"]),
    }


def test_derivation_sees_the_calls_it_must():
    """The parser is not vacuous: known calls are found, a new one is reported."""
    needs = derived_needs()
    assert ("", "pods", "create") in needs["jobs"]
    assert (C.GROUP, f"{C.PLURAL}/status", "patch") in needs["jobs"]
    assert (C.GROUP, C.PLURAL, "watch") in needs["jobs"]  # from the kopf decorators
    assert ("", "configmaps", "update") in needs["jobs"]  # from the builders' Roles
    assert ("", "nodes", "list") in needs["cluster"]
    assert ("batch", "jobs", "create") in needs["gate"]
    assert ("coordination.k8s.io", "leases", "update") in needs["lease"]
    assert api_calls("self.core.read_namespaced_secret(n, ns)") == {("", "secrets", "get")}
    with pytest.raises(AssertionError, match="'persistent_volume_claim' is not in RESOURCES"):
        api_calls("self.core.create_namespaced_persistent_volume_claim(ns, body)")


@pytest.mark.parametrize(
    "values", [[], ["-f", str(CHART / "ci" / "example-values.yaml")]], ids=["default", "example"]
)
def test_chart_grants_exactly_what_the_code_needs(values):
    needs, have = derived_needs(), chart_grants(rendered(*values))
    problems = []
    for scope in needs:
        problems += [
            f"{scope}: code needs {n} but the chart does not grant it"
            for n in sorted(needs[scope] - have[scope])
        ]
        problems += [
            f"{scope}: chart grants {n} that no code needs (least privilege)"
            for n in sorted(have[scope] - needs[scope])
        ]
    assert not problems, "\n".join(problems)


def test_no_grant_reaches_secrets_nodes_write_or_rbac_escalation():
    docs = rendered()
    everything = set().union(*(grants(d) for d in docs if d["kind"] in ("Role", "ClusterRole")))
    assert not {
        n
        for n in everything
        if n[1] in ("secrets", "namespaces", "clusterroles", "clusterrolebindings", "pods/exec")
    }
    assert not {n for n in everything if n[1] == "nodes" and n[2] not in ("list", "watch")}
    assert not {
        n for n in everything if n[2] in ("escalate", "bind", "impersonate", "deletecollection")
    }
    # the lease update is pinned to the one Lease by name
    (le,) = [
        d
        for d in docs
        if d["metadata"]["name"] == "rel-moe-operator-leader-election" and d["kind"] == "Role"
    ]
    assert [r.get("resourceNames") for r in le["rules"] if "update" in r["verbs"]] == [
        ["moe-operator-leader"]
    ]
    # by default the job permissions are bound in the watched namespace only (never kube-system);
    # cluster-wide only with watchAllNamespaces
    for args, kinds in (
        ((), [("RoleBinding", "default")]),
        (("--set", "watchAllNamespaces=true"), [("ClusterRoleBinding", None)]),
    ):
        binds = defaultdict(list)
        for d in rendered(*args):
            if d["kind"] in ("ClusterRoleBinding", "RoleBinding"):
                binds[d["roleRef"]["name"]].append((d["kind"], d["metadata"].get("namespace")))
        assert binds["rel-moe-operator-jobs"] == kinds, args
