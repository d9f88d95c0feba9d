"""Builders: golden manifests for the tiny CPU example and the GPU example, plus the invariants
every child must keep (owner reference, labels, names, pinning, env rendezvous)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

import plan_fixtures
from moejob_operator import admission
from moejob_operator import constants as C
from moejob_operator.builders import common, configmaps, rbac, workers
from moejob_operator.spec import JobSpec, parse_spec

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden"
UPDATE = os.environ.get("MOE_UPDATE_GOLDEN") == "1"
JOB = common.JobRef(namespace="team-a", name="tiny-cpu", uid="0b6f6c2e-6f1d-4f43-9d0e-3f5a1f1a9b11")
PLAN = plan_fixtures.plan()  # the plan ConfigMap's content: checked complete by the contract


# the examples' checkpoint hostPath is under /tmp; the pods mount /tmp and reach it by subPath
POLICY = admission.Policy(host_path_prefixes=("/tmp",))


def _admitted(raw) -> JobSpec:
    spec = parse_spec(raw)
    admission.bind_host_paths(spec, POLICY)
    return spec


def _example(name: str):
    return _admitted(yaml.safe_load((ROOT / "examples" / name).read_text())["spec"])


def _children(example: str) -> list[dict]:
    spec = _example(example)
    h = spec.immutable_hash()
    rank2node = [f"node-{chr(ord('a') + i)}" for i in range(spec.nodes.count)]
    return [
        configmaps.plan_configmap(JOB, PLAN, h),
        configmaps.progress_configmap(JOB),
        configmaps.routing_stats_configmap(JOB),
        rbac.service_account(JOB),
        rbac.role(JOB),
        rbac.role_binding(JOB),
        workers.headless_service(JOB),
        *workers.worker_pods(JOB, spec, rank2node, attempt=1, spec_hash=h),
    ]


@pytest.mark.parametrize("example", ["tiny-cpu.yaml", "gpu-h200.yaml"])
def test_golden(example):
    got = yaml.safe_dump_all(_children(example), sort_keys=False)
    path = GOLDEN / f"children-{example}"
    if UPDATE or not path.exists():
        path.write_text(got)
    assert got == path.read_text(), f"{path} differs: rerun with MOE_UPDATE_GOLDEN=1 and review"


@pytest.mark.parametrize("example", ["tiny-cpu.yaml", "gpu-h200.yaml"])
def test_every_child_is_owned_and_labelled(example):
    for obj in _children(example):
        meta = obj["metadata"]
        assert meta["namespace"] == JOB.namespace
        assert meta["ownerReferences"] == [common.owner_reference(JOB)]
        assert meta["ownerReferences"][0]["controller"] is True
        assert meta["labels"][C.LABEL_JOB] == JOB.name
        assert meta["labels"][C.LABEL_MANAGED_BY] == C.MANAGED_BY
        assert len(meta["name"]) <= 63


def _env(pod):
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}


def test_workers_rendezvous_and_pinning():
    spec = _example("gpu-h200.yaml")
    pods = workers.worker_pods(JOB, spec, ["gpu-7", "gpu-3"], attempt=0, spec_hash="h")
    assert [p["metadata"]["name"] for p in pods] == ["tiny-cpu-worker-0", "tiny-cpu-worker-1"]
    for rank, (pod, node) in enumerate(zip(pods, ["gpu-7", "gpu-3"], strict=True)):
        env = _env(pod)
        assert env["NODE_RANK"] == str(rank)
        # per-rank variables come from the pod's launcher, not from the pod's env
        assert not {"RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"} & set(env)
        assert env["WORLD_SIZE"] == "16" and env["NPROC_PER_NODE"] == "8" and env["NNODES"] == "2"
        assert env["MASTER_ADDR"] == "tiny-cpu-worker-0.tiny-cpu-workers.team-a.svc.cluster.local"
        rendezvous, metrics_port = common.job_ports(JOB)
        assert env["MASTER_PORT"] == str(rendezvous)
        assert env["MOE_METRICS_PORT"] == str(metrics_port)
        ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
        assert ports == {"rendezvous": rendezvous, "metrics": metrics_port}
        assert env["NCCL_NVLS_ENABLE"] == "0"
        assert env["MOE_PLAN"] == "/etc/moe/plan.json"
        assert env["MOE_CHECKPOINT_DIR"] == "/ckpt/tiny-cpu-0b6f6c2e"
        term = pod["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]
        assert term["nodeSelectorTerms"][0]["matchFields"][0]["values"] == [node]
        assert "nodeName" not in pod["spec"]
        assert pod["spec"]["hostname"] == f"tiny-cpu-worker-{rank}"
        assert pod["spec"]["subdomain"] == "tiny-cpu-workers"
        res = pod["spec"]["containers"][0]["resources"]
        assert res["limits"][C.GPU_RESOURCE] == res["requests"][C.GPU_RESOURCE] == "8"
        assert pod["spec"]["containers"][0]["command"] == ["moe-train"]
        assert pod["spec"]["containers"][0]["args"] == []
        # pass-through: user labels kept, ours win
        assert pod["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"
        assert pod["spec"]["priorityClassName"] == "training"


def test_worker_env_has_only_variables_something_reads():
    """Every env name of a worker pod is read by the trainer image (launcher, trainer,
    publisher)."""
    import re

    pod = workers.worker_pod(
        JOB, _example("tiny-cpu.yaml"), node_rank=0, node="n", attempt=0, spec_hash="h"
    )
    from moe_contracts import env as contract_env

    names = {e["name"] for e in pod["spec"]["containers"][0]["env"]}
    # the contract names each variable; the trainer reads it by that name (E.NODE_RANK) or literally
    attr = {v: k for k, v in vars(contract_env).items() if k.isupper() and isinstance(v, str)}
    assert not names - set(attr), (
        f"worker env outside moe_contracts.env: {sorted(names - set(attr))}"
    )
    source = "\n".join(
        p.read_text()
        for d in (ROOT / "trainer_image" / "moe_trainer", ROOT / "operator" / "moe_contracts")
        for p in d.rglob("*.py")
        if p.name != "env.py"
    )  # the trainer and the readers it calls
    # read by the libraries the trainer runs, not by its own code: the home directory's caches
    # (Triton, Hugging Face, pip) and DeepSpeed's JIT builds, under a read-only root filesystem
    by_libraries = {"HOME", "TORCH_EXTENSIONS_DIR"}
    unread = sorted(
        n for n in names - by_libraries if not re.search(rf"[\"']{n}[\"']|\.{attr[n]}\b", source)
    )
    assert not unread, f"worker env nobody reads: {unread}"


def test_cpu_workers_run_the_same_entry_point_with_cpu():
    pods = workers.worker_pods(
        JOB,
        _example("tiny-cpu.yaml"),
        ["node-a", "node-b"],
        attempt=0,
        spec_hash="h",
        node_ranks=[1],
    )
    assert [p["metadata"]["name"] for p in pods] == ["tiny-cpu-worker-1"]
    c = pods[0]["spec"]["containers"][0]
    assert (c["command"], c["args"]) == (["moe-train"], ["--cpu"])


def test_operator_labels_win_over_user_labels():
    raw = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())["spec"]
    raw["scheduling"] = {"podLabels": {C.LABEL_JOB: "someone-else", "team": "x"}}
    pod = workers.worker_pod(JOB, _admitted(raw), node_rank=0, node="n", attempt=0, spec_hash="h")
    assert pod["metadata"]["labels"][C.LABEL_JOB] == JOB.name
    assert pod["metadata"]["labels"]["team"] == "x"


def test_cpu_workers_request_no_gpu_and_keep_security_context():
    spec = _example("tiny-cpu.yaml")
    pod = workers.worker_pod(JOB, spec, node_rank=1, node="node-b", attempt=0, spec_hash="h")
    c = pod["spec"]["containers"][0]
    # not BestEffort: a core and DEFAULT_MEMORY_PER_RANK_GI per rank, no GPU, no limits
    ranks = spec.nodes.gpus_per_node
    assert c["resources"] == {
        "requests": {"cpu": str(ranks), "memory": f"{ranks * workers.DEFAULT_MEMORY_PER_RANK_GI}Gi"}
    }
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
    # read-only root: the caches and temporary files go to the scratch emptyDir
    assert sc["readOnlyRootFilesystem"] is True
    assert {"name": "scratch", "mountPath": workers.SCRATCH} in c["volumeMounts"]
    assert {"name": "scratch", "emptyDir": {}} in pod["spec"]["volumes"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["HOME"].startswith(workers.SCRATCH + "/")
    assert env["TORCH_EXTENSIONS_DIR"].startswith(workers.SCRATCH + "/")
    # what the user asks for is kept as it is
    user = spec.model_copy(
        update={"resources": spec.resources.model_copy(update={"requests": {"memory": "8Gi"}})}
    )
    pod = workers.worker_pod(JOB, user, node_rank=1, node="node-b", attempt=0, spec_hash="h")
    assert pod["spec"]["containers"][0]["resources"]["requests"] == {"cpu": "1", "memory": "8Gi"}
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}


def test_role_is_limited_to_own_configmaps():
    rules = rbac.role(JOB)["rules"]
    assert rules == [
        {
            "apiGroups": [""],
            "resources": ["configmaps"],
            "resourceNames": ["tiny-cpu-progress", "tiny-cpu-routing-stats"],
            "verbs": ["get", "update", "patch"],
        }
    ]


def test_worker_pods_refuse_wrong_rank_count():
    with pytest.raises(ValueError, match="plan has 1 node ranks"):
        workers.worker_pods(JOB, _example("tiny-cpu.yaml"), ["node-a"], attempt=0, spec_hash="h")


def test_workers_get_a_bound_token_not_the_legacy_automount():
    pod = workers.worker_pod(
        JOB, _example("tiny-cpu.yaml"), node_rank=0, node="n", attempt=0, spec_hash="h"
    )
    assert pod["spec"]["automountServiceAccountToken"] is False
    vol = next(v for v in pod["spec"]["volumes"] if v["name"] == common.TOKEN_VOLUME)
    kinds = [next(iter(src)) for src in vol["projected"]["sources"]]
    assert kinds == ["serviceAccountToken", "configMap", "downwardAPI"]
    mount = next(
        m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == common.TOKEN_VOLUME
    )
    assert mount == {
        "name": common.TOKEN_VOLUME,
        "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
        "readOnly": True,
    }


def test_job_ports_are_deterministic_distinct_and_outside_the_ephemeral_range():
    """Two jobs on one host network (the local node agent) must not both listen on one port."""
    ports = {}
    for ns in ("team-a", "team-b"):
        for i in range(200):
            job = common.JobRef(namespace=ns, name=f"job-{i}", uid=f"u{i}")
            rendezvous, metrics_port = common.job_ports(job)
            assert common.job_ports(common.JobRef(ns, f"job-{i}", "other-uid")) == (
                rendezvous,
                metrics_port,
            )
            assert (
                20000 <= rendezvous < 32000
                and rendezvous % 2 == 0
                and metrics_port == rendezvous + 1
            )
            ports[(ns, i)] = rendezvous
    assert common.job_ports(common.JobRef("team-a", "tiny", "u")) != common.job_ports(
        common.JobRef("team-b", "tiny", "u")
    )
    # 400 jobs over 6000 slots: a handful of shared slots at most (birthday bound ~13)
    assert len(set(ports.values())) >= 380


def test_service_port_matches_the_workers_rendezvous_port():
    svc = workers.headless_service(JOB)
    rendezvous, _ = common.job_ports(JOB)
    assert svc["spec"]["ports"] == [
        {"name": "rendezvous", "port": rendezvous, "targetPort": rendezvous, "protocol": "TCP"}
    ]
    pod = workers.worker_pods(
        JOB, _example("tiny-cpu.yaml"), ["node-a", "node-b"], attempt=0, spec_hash="h"
    )[1]
    assert _env(pod)["MASTER_PORT"] == str(rendezvous)


def _quantities(obj, path=""):
    """(path, value) of everything under a ``resources`` block, anywhere in ``obj``."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == "resources" and isinstance(v, dict) and set(v) <= {"requests", "limits"}:
                yield from (
                    (f"{path}.{k}.{part}.{n}", q) for part, qs in v.items() for n, q in qs.items()
                )
            else:
                yield from _quantities(v, f"{path}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _quantities(v, f"{path}[{i}]")


def test_every_quantity_is_a_string_the_api_client_accepts():
    """The pinned kubernetes client refuses integers under ``resources`` (pydantic): integer
    ``spec.resources`` (int-or-string in the CRD), GPU requests, smoke Job and discovery pod."""
    from moejob_operator.builders import discovery, smoke
    from moejob_operator.core import gate as G

    raw = yaml.safe_load((ROOT / "examples" / "gpu-h200.yaml").read_text())["spec"]
    raw["resources"] = {"requests": {"cpu": 32, "memory": "512Gi"}, "limits": {"cpu": 64}}
    spec = _admitted(raw)
    objs = [
        workers.worker_pod(JOB, spec, node_rank=0, node="n", attempt=0, spec_hash="h"),
        smoke.smoke_job(G.identity_for("img", None, "GPU"), 1, G.GateConfig(namespace="ns")),
        discovery.discovery_pod(
            "n",
            namespace="ns",
            image="img",
            service_account="sa",
            gpu_access="request",
            gpu_count=8,
        ),
    ]
    found = [q for obj in objs for q in _quantities(obj)]
    assert len(found) >= 10
    assert all(isinstance(v, str) for _, v in found), [
        x for x in found if not isinstance(x[1], str)
    ]
    pod_res = objs[0]["spec"]["containers"][0]["resources"]
    assert pod_res == {
        "requests": {"cpu": "32", "memory": "512Gi", C.GPU_RESOURCE: "8"},
        "limits": {"cpu": "64", C.GPU_RESOURCE: "8"},
    }
    assert objs[1]["spec"]["template"]["spec"]["containers"][0]["resources"] == {
        "requests": {C.GPU_RESOURCE: "1"},
        "limits": {C.GPU_RESOURCE: "1"},
    }


def _with_scheduling(**sched):
    raw = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())["spec"]
    raw["scheduling"] = sched
    return _admitted(raw)


def test_kueue_gang_puts_every_worker_of_an_attempt_in_one_pod_group():
    queue = {"kueue.x-k8s.io/queue-name": "gpu-queue"}
    for spec in (
        _with_scheduling(podLabels=queue),
        _with_scheduling(podLabels=queue, gang="Kueue"),
    ):
        pods = workers.worker_pods(JOB, spec, ["node-a", "node-b"], attempt=3, spec_hash="h")
        groups = {p["metadata"]["labels"][C.KUEUE_POD_GROUP_LABEL] for p in pods}
        assert groups == {"tiny-cpu-0b6f6c2e-a3"}
        assert [p["metadata"]["annotations"][C.KUEUE_TOTAL_COUNT_ANNOTATION] for p in pods] == [
            "2",
            "2",
        ]
        assert all(p["metadata"]["labels"][C.KUEUE_QUEUE_LABEL] == "gpu-queue" for p in pods)
    # the next attempt is a new group: Kueue admits the restarted gang as a whole again
    again = workers.worker_pod(
        JOB, _with_scheduling(podLabels=queue), node_rank=0, node="n", attempt=4, spec_hash="h"
    )
    assert again["metadata"]["labels"][C.KUEUE_POD_GROUP_LABEL] == "tiny-cpu-0b6f6c2e-a4"


def test_no_kueue_group_without_a_queue_or_when_turned_off():
    queue = {"kueue.x-k8s.io/queue-name": "gpu-queue"}
    for spec in (_with_scheduling(), _with_scheduling(podLabels=queue, gang="None")):
        pod = workers.worker_pod(JOB, spec, node_rank=0, node="n", attempt=0, spec_hash="h")
        assert C.KUEUE_POD_GROUP_LABEL not in pod["metadata"]["labels"]
        assert C.KUEUE_TOTAL_COUNT_ANNOTATION not in pod["metadata"]["annotations"]
    with pytest.raises(Exception, match=r"gang: Kueue needs podLabels"):
        _with_scheduling(gang="Kueue")
    # an absent gang changes no job's immutable hash (jobs launched before the field existed)
    assert "gang" not in _with_scheduling(podLabels=queue).immutable_view()["scheduling"]


def test_replan_adds_the_placement_configmap_env_and_read_only_grant():
    """spec.placement.replan: the PlacementUpdate ConfigMap (generation 0 = the plan's
    permutation), its name in the worker env, and a get-only grant on it; without replan none
    of it (the goldens above)."""
    from moe_contracts import env as contract_env
    from moe_contracts import placement_update

    raw = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())["spec"]
    raw["placement"]["replan"] = {"everySteps": 10}
    spec = _admitted(raw)
    perm = [[1, 0, 3, 2, 5, 4, 7, 6]] * 4
    cm = configmaps.placement_configmap(JOB, perm)
    assert cm["metadata"]["name"] == "tiny-cpu-placement"
    assert cm["metadata"]["ownerReferences"][0]["uid"] == JOB.uid
    doc = placement_update.loads(cm["data"][placement_update.KEY])
    assert (doc.generation, doc.permutation, doc.decided_at_step) == (0, perm, 0)
    doc.check(4, 8, ep_size=2)
    env = {
        e["name"]: e.get("value")
        for e in workers.worker_pod(JOB, spec, node_rank=0, node="n", attempt=0, spec_hash="h")[
            "spec"
        ]["containers"][0]["env"]
    }
    assert env[contract_env.PLACEMENT_CONFIGMAP] == "tiny-cpu-placement"
    plain = workers.worker_pod(
        JOB, _example("tiny-cpu.yaml"), node_rank=0, node="n", attempt=0, spec_hash="h"
    )
    assert contract_env.PLACEMENT_CONFIGMAP not in {
        e["name"] for e in plain["spec"]["containers"][0]["env"]
    }
    rules = rbac.role(JOB, placement=True)["rules"]
    assert rules[0] == rbac.role(JOB)["rules"][0]
    assert rules[1] == {
        "apiGroups": [""],
        "resources": ["configmaps"],
        "resourceNames": ["tiny-cpu-placement"],
        "verbs": ["get"],
    }
