"""Volcano gang admission through the real operator and API server (issue 37): with Volcano's
PodGroup CRD installed (a minimal copy: the schema is not Volcano's, the API is), a job with
``gang: Volcano`` and one with ``gang`` absent (Auto) get a PodGroup per gang attempt
(``minMember`` = the pod count, controlled by the job) created before their worker pods, which
name it (``scheduling.k8s.io/group-name``) and ask for the ``volcano`` scheduler; deleting the job
deletes the PodGroup (garbage collection through the ownerReference).

What this cannot show: the gang scheduling itself. No Volcano scheduler runs here, and the local
kube-scheduler only schedules pods naming ``default-scheduler``, so the worker pods stay Pending
and unbound (asserted); binding all of a PodGroup's pods or none is Volcano's part.
"""

from __future__ import annotations

import time

import pytest
from kubernetes import watch
from kubernetes.client.rest import ApiException

from moejob_operator import constants as C
from operator_harness import (
    Operator,
    apply_job,
    example,
    get_job,
    install_crd,
    seed_topology,
)

pytestmark = pytest.mark.cluster

PODGROUP_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": f"{C.VOLCANO_PODGROUPS}.{C.VOLCANO_GROUP}"},
    "spec": {
        "group": C.VOLCANO_GROUP,
        "scope": "Namespaced",
        "names": {
            "kind": "PodGroup",
            "listKind": "PodGroupList",
            "plural": C.VOLCANO_PODGROUPS,
            "singular": "podgroup",
            "shortNames": ["pg"],
        },
        "versions": [
            {
                "name": C.VOLCANO_VERSION,
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "x-kubernetes-preserve-unknown-fields": True,
                    }
                },
            }
        ],
    },
}


def _served(kube) -> bool:
    try:
        doc = kube.custom.get_api_resources(C.VOLCANO_GROUP, C.VOLCANO_VERSION)
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return any(r.name == C.VOLCANO_PODGROUPS for r in doc.resources)


@pytest.fixture(scope="module")
def podgroup_crd(kube):
    """Volcano's PodGroup API, served for this module only: the other modules' jobs (gang
    absent = Auto) must not see it, so it is deleted and gone from discovery afterwards."""
    name = PODGROUP_CRD["metadata"]["name"]
    try:
        kube.apiext.create_custom_resource_definition(PODGROUP_CRD)
    except ApiException as exc:
        if exc.status != 409:
            raise
    deadline = time.monotonic() + 120  # deadlines for failing, not measurements
    while not _served(kube):
        assert time.monotonic() < deadline, "PodGroup CRD not served"
        time.sleep(0.2)
    yield name
    kube.apiext.delete_custom_resource_definition(name)
    deadline = time.monotonic() + 120
    while _served(kube):
        assert time.monotonic() < deadline, "PodGroup CRD still served after its deletion"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def operator_proc(control_plane, kube, node_agent, podgroup_crd, tmp_path_factory):
    install_crd(kube)
    op = Operator(control_plane, tmp_path_factory.mktemp("gang-operator")).start().wait_ready()
    yield op
    op.stop()


def _job(name: str, tmp_path, scheduling: dict) -> dict:
    return example(
        "tiny-cpu.yaml",
        metadata={"name": name},
        checkpoint={"everySteps": 5, "volume": {"hostPath": {"path": str(tmp_path)}}},
        scheduling=scheduling,
        gate={"skip": True, "skipReason": "the gate's own tests run the smoke Job"},
    )


def _pod_groups(kube, namespace) -> list[dict]:
    return kube.custom.list_namespaced_custom_object(
        C.VOLCANO_GROUP, C.VOLCANO_VERSION, namespace, C.VOLCANO_PODGROUPS
    )["items"]


def _workers(kube, namespace, job: str) -> list:
    sel = f"{C.LABEL_JOB}={job},{C.LABEL_COMPONENT}=worker"
    return kube.core.list_namespaced_pod(namespace, label_selector=sel).items


def _created_at(list_fn, *args, since: str, count: int) -> dict[str, int]:
    """name -> resourceVersion of its creation, for the first ``count`` objects created after
    resourceVersion ``since``, replayed by a watch from ``since`` (ADDED events carry the object
    as created). On this control plane a resourceVersion is etcd's revision of the write, one
    counter for all objects (opaque to clients in general): creation order."""
    out: dict[str, int] = {}
    w = watch.Watch()
    for ev in w.stream(list_fn, *args, resource_version=since, timeout_seconds=30):
        meta = ev["object"]["metadata"] if isinstance(ev["object"], dict) else None
        meta = meta or ev["raw_object"]["metadata"]
        if ev["type"] == "ADDED":
            out[meta["name"]] = int(meta["resourceVersion"])
        if len(out) >= count:
            w.stop()
    return out


@pytest.mark.parametrize("gang", ["Volcano", None])  # None: absent, i.e. Auto
def test_volcano_gang_gets_its_podgroup_before_its_pods(
    kube, namespace, operator_proc, wait_for, tmp_path, gang
):
    seed_topology(kube, namespace)
    name = "gang-volcano" if gang else "gang-auto"
    since = kube.core.list_namespaced_pod(namespace).metadata.resource_version
    pg_since = kube.custom.list_namespaced_custom_object(
        C.VOLCANO_GROUP, C.VOLCANO_VERSION, namespace, C.VOLCANO_PODGROUPS
    )["metadata"]["resourceVersion"]
    apply_job(kube, namespace, _job(name, tmp_path, {"gang": gang} if gang else {}))
    pods = wait_for(
        lambda: len(_workers(kube, namespace, name)) == 2 and _workers(kube, namespace, name),
        timeout=90,
        message="2 worker pods",
    )
    job = get_job(kube, namespace, name)
    (pg,) = _pod_groups(kube, namespace)
    group = f"{name}-{job['metadata']['uid'][:8]}-a0"
    assert pg["metadata"]["name"] == group
    assert pg["spec"] == {"minMember": 2}
    (owner,) = pg["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
        C.KIND,
        name,
        job["metadata"]["uid"],
        True,
    )
    # created before the pods
    (pg_created,) = _created_at(
        kube.custom.list_namespaced_custom_object,
        C.VOLCANO_GROUP,
        C.VOLCANO_VERSION,
        namespace,
        C.VOLCANO_PODGROUPS,
        since=pg_since,
        count=1,
    ).values()
    pods_created = _created_at(kube.core.list_namespaced_pod, namespace, since=since, count=2)
    assert sorted(pods_created) == sorted(p.metadata.name for p in pods)
    assert pg_created < min(pods_created.values()), (pg_created, pods_created)
    for p in pods:
        assert p.metadata.annotations[C.VOLCANO_GROUP_NAME_ANNOTATION] == group
        assert p.spec.scheduler_name == C.VOLCANO_SCHEDULER
        # no Volcano scheduler here: nothing binds them (the gang scheduling is not shown here)
        assert not p.spec.node_name and p.status.phase == "Pending"
    # the pass that launched the pods writes its status after them
    wait_for(
        lambda: (
            (get_job(kube, namespace, name).get("status") or {}).get("gangScheduler") == "Volcano"
        ),
        timeout=60,
        message="status.gangScheduler",
    )

    # the PodGroup goes with the job
    kube.custom.delete_namespaced_custom_object(C.GROUP, C.VERSION, namespace, C.PLURAL, name)
    wait_for(
        lambda: not _pod_groups(kube, namespace), timeout=90, message="PodGroup garbage-collected"
    )
