"""Volcano gang admission (issue 37): the exact PodGroup of each gang attempt, the worker pods'
group annotation and scheduler name, how Auto chooses, and the specs refused as inconsistent.
No cluster (test_gang_cluster.py does this through the real operator and API server)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from moejob_operator import admission
from moejob_operator import constants as C
from moejob_operator.builders import common, workers
from moejob_operator.builders import gang as G
from moejob_operator.spec import JobSpec, SpecError, parse_spec

ROOT = Path(__file__).resolve().parents[1]
JOB = common.JobRef(namespace="team-a", name="tiny-cpu", uid="0b6f6c2e-6f1d-4f43-9d0e-3f5a1f1a9b11")
QUEUE = {"kueue.x-k8s.io/queue-name": "gpu-queue"}


def _spec(**sched) -> JobSpec:
    raw = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())["spec"]
    raw["scheduling"] = sched
    spec = parse_spec(raw)
    admission.bind_host_paths(spec, admission.Policy(host_path_prefixes=("/tmp",)))
    return spec


def test_volcano_pod_group_of_each_attempt_is_exact():
    spec = _spec(gang="Volcano")
    assert G.volcano_pod_group(JOB, spec.scheduling, 2, 4) == {
        "apiVersion": "scheduling.volcano.sh/v1beta1",
        "kind": "PodGroup",
        "metadata": {
            "name": "tiny-cpu-0b6f6c2e-a2",
            "namespace": "team-a",
            "labels": {
                C.LABEL_ATTEMPT: "2",
                C.LABEL_COMPONENT: "podgroup",
                C.LABEL_JOB: "tiny-cpu",
                C.LABEL_MANAGED_BY: C.MANAGED_BY,
            },
            "ownerReferences": [common.owner_reference(JOB)],
        },
        "spec": {"minMember": 4},
    }
    ref = common.owner_reference(JOB)
    assert (ref["kind"], ref["uid"], ref["controller"]) == (C.KIND, JOB.uid, True)
    # the queue (Volcano's pod annotation) and the priority class go onto the group
    queued = _spec(
        gang="Volcano",
        priorityClassName="train-high",
        podAnnotations={C.VOLCANO_QUEUE_ANNOTATION: "research"},
    )
    pg = G.volcano_pod_group(JOB, queued.scheduling, 0, 2)
    assert pg["spec"] == {"minMember": 2, "queue": "research", "priorityClassName": "train-high"}
    assert pg["metadata"]["name"] == "tiny-cpu-0b6f6c2e-a0"


def test_volcano_workers_name_their_attempts_group_and_the_volcano_scheduler():
    spec = _spec(gang="Volcano")
    for attempt in (0, 1):
        pods = workers.worker_pods(
            JOB, spec, ["node-a", "node-b"], attempt=attempt, spec_hash="h", gang="Volcano"
        )
        assert [p["metadata"]["annotations"][C.VOLCANO_GROUP_NAME_ANNOTATION] for p in pods] == [
            f"tiny-cpu-0b6f6c2e-a{attempt}"
        ] * 2
        assert [p["spec"]["schedulerName"] for p in pods] == ["volcano", "volcano"]
        for p in pods:  # no Kueue group fields on a Volcano gang
            assert C.KUEUE_POD_GROUP_LABEL not in p["metadata"]["labels"]
            assert C.KUEUE_TOTAL_COUNT_ANNOTATION not in p["metadata"]["annotations"]
    # the user's scheduler name is kept (a Volcano scheduler under another name)
    own = _spec(gang="Volcano", schedulerName="volcano-gpu")
    pod = workers.worker_pod(
        JOB, own, node_rank=0, node="n", attempt=0, spec_hash="h", gang="Volcano"
    )
    assert pod["spec"]["schedulerName"] == "volcano-gpu"
    # without a gang: no group annotation and no scheduler name
    plain = workers.worker_pod(JOB, _spec(), node_rank=0, node="n", attempt=0, spec_hash="h")
    assert C.VOLCANO_GROUP_NAME_ANNOTATION not in plain["metadata"]["annotations"]
    assert "schedulerName" not in plain["spec"]


def test_auto_picks_kueue_then_volcano_then_none():
    asked: list[int] = []

    def installed(answer: bool):
        def ask() -> bool:
            asked.append(1)
            return answer

        return ask

    assert G.resolve(_spec(podLabels=QUEUE).scheduling, installed(True)) == "Kueue"
    assert G.resolve(_spec(gang="Auto").scheduling, installed(True)) == "Volcano"
    assert G.resolve(_spec().scheduling, installed(True)) == "Volcano"
    assert G.resolve(_spec().scheduling, installed(False)) == "None"
    assert G.resolve(_spec().scheduling) == "None"  # spec alone (no cluster to ask)
    # the user's own PodGroup named in podAnnotations: Auto leaves the pods alone
    own = _spec(podAnnotations={C.VOLCANO_GROUP_NAME_ANNOTATION: "mine"})
    assert G.resolve(own.scheduling, installed(True)) == "None"
    n = len(asked)
    # an explicit choice never asks the cluster
    for gang in ("Volcano", "None"):
        assert G.resolve(_spec(gang=gang).scheduling, installed(False)) == gang
    assert G.resolve(_spec(gang="Kueue", podLabels=QUEUE).scheduling, installed(True)) == "Kueue"
    assert len(asked) == n
    # the user's annotation stays on the pod when Auto chose None
    pod = workers.worker_pod(JOB, own, node_rank=0, node="n", attempt=0, spec_hash="h", gang="None")
    assert pod["metadata"]["annotations"][C.VOLCANO_GROUP_NAME_ANNOTATION] == "mine"


def test_inconsistent_volcano_specs_are_refused():
    with pytest.raises(
        SpecError, match=r"gang: Volcano conflicts with podLabels\['kueue.x-k8s.io/queue-name'\]"
    ):
        _spec(gang="Volcano", podLabels=QUEUE)
    with pytest.raises(SpecError, match=r"drop podAnnotations\['scheduling.k8s.io/group-name'\]"):
        _spec(gang="Volcano", podAnnotations={C.VOLCANO_GROUP_NAME_ANNOTATION: "mine"})
    with pytest.raises(SpecError, match=r"gang"):
        _spec(gang="KAI")
    # an absent gang changes no launched job's immutable hash; a set one is part of it
    assert "gang" not in _spec().immutable_view()["scheduling"]
    assert _spec(gang="Volcano").immutable_hash() != _spec().immutable_hash()
