"""The installed chart's ServiceAccount against the real authorizer (SubjectAccessReview):
every (group, resource, verb) the code needs is allowed where it is needed, and a list of
things the operator must never do is denied."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from kubernetes import client as k8s

from moe_localkube.testing import create_namespace, delete_namespace, unique_name
from moejob_operator import constants as C
from test_rbac import derived_needs

pytestmark = pytest.mark.cluster

CHART = Path(__file__).resolve().parents[1] / "charts" / "moe-operator"


@pytest.fixture(scope="module")
def release(kube, kubectl):
    ns = create_namespace(kube, unique_name("moe-sys"))
    jobs_ns = create_namespace(kube, unique_name("moe-jobs"))  # the one namespace it reconciles
    name = unique_name("rb", 20)
    out = subprocess.run(
        [
            kubectl.helm,
            "install",
            name,
            str(CHART),
            "-n",
            ns,
            "--set",
            "replicaCount=0",
            "--set",
            f"watchNamespaces={{{jobs_ns}}}",
            # v1.20 does not know the CRD's CEL rules: server-side apply refuses them
            "--server-side=false",
        ],
        env=kubectl.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    try:
        yield name, ns, f"system:serviceaccount:{ns}:{name}-moe-operator", jobs_ns
    finally:
        subprocess.run(
            [kubectl.helm, "uninstall", name, "-n", ns],
            env=kubectl.env,
            capture_output=True,
            timeout=120,
        )
        delete_namespace(kube, ns)
        delete_namespace(kube, jobs_ns)


def allowed(
    kube,
    user: str,
    verb: str,
    group: str,
    resource: str,
    namespace: str | None = None,
    name: str | None = None,
) -> bool:
    res, _, sub = resource.partition("/")
    attrs = k8s.V1ResourceAttributes(
        verb=verb,
        group=group,
        resource=res,
        subresource=sub or None,
        namespace=namespace,
        name=name,
    )
    body = k8s.V1SubjectAccessReview(
        spec=k8s.V1SubjectAccessReviewSpec(
            user=user,
            groups=[
                "system:serviceaccounts",
                f"system:serviceaccounts:{user.split(':')[2]}",
                "system:authenticated",
            ],
            resource_attributes=attrs,
        )
    )
    return k8s.AuthorizationV1Api(kube.api_client).create_subject_access_review(body).status.allowed


def test_every_needed_verb_is_allowed(kube, release):
    _, rel_ns, user, namespace = release
    needs = derived_needs()
    denied = []
    for scope, where in (
        ("jobs", namespace),
        ("cluster", None),
        ("gate", rel_ns),
        ("lease", rel_ns),
    ):
        for group, resource, verb in sorted(needs[scope]):
            name = "moe-operator-leader" if scope == "lease" and verb != "create" else None
            if not allowed(kube, user, verb, group, resource, where, name):
                denied.append((scope, group, resource, verb, where))
    assert not denied, f"the chart's ServiceAccount is denied: {denied}"
    assert len(needs["jobs"]) >= 20


@pytest.mark.parametrize(
    ("verb", "group", "resource", "where"),
    [
        ("get", "", "secrets", "other"),
        ("list", "", "secrets", "other"),
        ("get", "", "secrets", "kube-system"),
        ("list", "", "secrets", None),
        ("update", "", "nodes", None),
        ("patch", "", "nodes", None),
        ("delete", "", "nodes", None),
        ("delete", "", "namespaces", None),
        ("create", "", "namespaces", None),
        ("*", "*", "*", None),  # cluster-admin
        ("create", "rbac.authorization.k8s.io", "clusterrolebindings", None),
        ("create", "rbac.authorization.k8s.io", "clusterroles", None),
        ("escalate", "rbac.authorization.k8s.io", "roles", "other"),
        ("bind", "rbac.authorization.k8s.io", "clusterroles", None),
        ("impersonate", "", "serviceaccounts", "other"),
        ("create", "", "pods/exec", "other"),
        ("create", "", "serviceaccounts/token", "other"),
        ("update", "coordination.k8s.io", "leases", "kube-system"),
        ("create", "batch", "jobs", "other"),  # smoke Jobs only in its own namespace
        # job permissions only in the watched namespace (watchNamespaces), never kube-system
        ("create", "", "pods", "other"),
        ("create", "", "configmaps", "other"),
        ("create", "", "pods", "kube-system"),
        ("update", "", "configmaps", "kube-system"),
        ("create", "apps", "deployments", "other"),
        ("delete", "apiextensions.k8s.io", "customresourcedefinitions", None),
    ],
)
def test_forbidden_things_are_denied(kube, release, verb, group, resource, where):
    _, _rel_ns, user, _ = release
    namespace = {"other": "default", "kube-system": "kube-system", None: None}[where]
    assert not allowed(kube, user, verb, group, resource, namespace)


def test_lease_update_only_for_its_own_lease(kube, release):
    _, rel_ns, user, _ = release
    assert allowed(
        kube, user, "update", "coordination.k8s.io", "leases", rel_ns, "moe-operator-leader"
    )
    assert not allowed(
        kube, user, "update", "coordination.k8s.io", "leases", rel_ns, "someone-else"
    )


def test_api_discovery_needs_no_grant(kube, release):
    """``gang: Auto`` asks API discovery whether Volcano's PodGroups are served
    (Client.serves): every authenticated user may (system:discovery), so the chart grants
    nothing for it. A URL outside discovery is denied: the review is not vacuous."""
    _, _rel_ns, user, _ = release

    def url_allowed(path: str) -> bool:
        body = k8s.V1SubjectAccessReview(
            spec=k8s.V1SubjectAccessReviewSpec(
                user=user,
                groups=["system:serviceaccounts", "system:authenticated"],
                non_resource_attributes=k8s.V1NonResourceAttributes(path=path, verb="get"),
            )
        )
        api = k8s.AuthorizationV1Api(kube.api_client)
        return api.create_subject_access_review(body).status.allowed

    assert url_allowed(f"/apis/{C.VOLCANO_GROUP}/{C.VOLCANO_VERSION}")
    assert not url_allowed("/metrics")
