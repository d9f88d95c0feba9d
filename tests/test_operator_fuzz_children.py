"""Seeded fuzzing of the trust boundaries of issue 31 through the real API server, operator and
node agent (docs/security.md): a namespace neighbour's objects with a job's child names or worker
labels, and hostile documents written into a job's progress / routing-statistics ConfigMaps with
the job's own worker token (what any code in the user's image can write).

For each of ``MOE_FUZZ_CHILD_JOBS`` jobs (seed ``MOE_FUZZ_SEED``) a random case:

- squatters: 1-2 of the job's child names (the plan, progress and routing-statistics
  ConfigMaps, the worker ServiceAccount, Role and RoleBinding, the headless Service, a worker
  pod's name) pre-created by the test, some with the job's labels; and/or a pod with the job's
  worker labels (Pending, or run by the node agent to a failure);
- documents: once the job has launched, its progress and routing-statistics ConfigMaps are
  written with the worker ServiceAccount's token: oversized, nested deeper than any parser, a
  valid document with thousands of distinct health findings (several times), the wrong kind or
  version, not JSON; a second job then takes its placement from the hostile routing statistics.

Worker pods name a scheduler that does not exist (as in test_operator_fuzz.py): they are created
but never run a trainer; "accepted" is a job launched with every child its own.

Tally per job: ``accepted`` (launched, every child owned by it, no conflict), ``refused``
(a ``ChildConflict`` condition naming the squatted object, or a terminal / explained state),
``stuck`` (neither within the bound), ``wronglyAccepted`` (worker pods created while a child's
name is a neighbour's, or the status shows a forged plan), ``leaked`` (an object the job owned
survives its deletion, or a squatter was deleted or modified), ``eventFloods`` (more Events than
the per-pass cap allows for the writes made). ``MOE_FUZZ_RESULTS=<file>`` writes the tally.
"""

from __future__ import annotations

import base64
import collections
import json
import os
import random
import time
from pathlib import Path

import pytest
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from moe_contracts.progress import HEALTH_TYPES
from moejob_operator import constants as C
from moejob_operator.reconcile.client import EVENT_MAX_DELAY_SECONDS
from moejob_operator.reconcile.gang import MAX_HEALTH_EVENTS
from operator_harness import Operator, apply_job, example, install_crd, seed_topology
from test_operator_fuzz import read, state

pytestmark = pytest.mark.cluster

SEED = int(os.environ.get("MOE_FUZZ_SEED", "31"))
JOBS = int(os.environ.get("MOE_FUZZ_CHILD_JOBS", "14"))
SETTLE_SECONDS = 90  # bound: every job accepted, refused or explained this long after apply
GONE_SECONDS = 90  # bound: the job's own children gone after it was deleted

SQUATS = ("plan", "progress", "routing-stats", "sa", "role", "rolebinding", "service", "pod")
DOCS = ("oversized", "deep", "findings", "wrong-kind", "wrong-version", "not-json", "valid")


@pytest.fixture(scope="module")
def allowed(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz-children-prefix")


@pytest.fixture(scope="module")
def children_operator(control_plane, kube, node_agent, tmp_path_factory, allowed):
    install_crd(kube)
    op = (
        Operator(control_plane, tmp_path_factory.mktemp("operator-fuzz-children"))
        .start(MOE_GATE_ENABLED="false", MOE_ALLOWED_HOST_PATH_PREFIXES=str(allowed))
        .wait_ready()
    )
    yield op
    op.stop()


def _job(name: str, allowed: Path, **placement) -> dict:
    job = example(
        "tiny-cpu.yaml",
        metadata={"name": name},
        checkpoint={"everySteps": 2, "volume": {"hostPath": {"path": str(allowed / name)}}},
        gate={"skip": True, "skipReason": "fuzz"},
        scheduling={"schedulerName": "none-such"},  # workers are created, never run
    )
    job["spec"]["training"].update(steps=2, seqLen=32)
    job["spec"]["placement"].update(placement)
    return job


# ---- squatters ----------------------------------------------------------------------------
def _squatter(kind: str, job: str, labelled: bool) -> tuple[str, str, dict]:
    """(API kind, name, body) of a neighbour's object with one of ``job``'s child names."""
    labels = {C.LABEL_JOB: job, C.LABEL_MANAGED_BY: C.MANAGED_BY} if labelled else {}
    ann = {C.ANNOTATION_SPEC_HASH: "forged"}
    if kind in ("plan", "progress", "routing-stats"):
        name = f"{job}-{kind}"
        key = {"plan": C.PLAN_KEY, "progress": C.PROGRESS_KEY}.get(kind, C.ROUTING_STATS_KEY)
        data = {key: json.dumps({"forged": True, "steps": 1})}
        return (
            "ConfigMap",
            name,
            {"metadata": {"name": name, "labels": labels, "annotations": ann}, "data": data},
        )
    if kind == "sa":
        return (
            "ServiceAccount",
            f"{job}-worker",
            {"metadata": {"name": f"{job}-worker", "labels": labels}},
        )
    if kind == "role":
        rule = {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}
        return (
            "Role",
            f"{job}-worker",
            {"metadata": {"name": f"{job}-worker", "labels": labels}, "rules": [rule]},
        )
    if kind == "rolebinding":
        return (
            "RoleBinding",
            f"{job}-worker",
            {
                "metadata": {"name": f"{job}-worker", "labels": labels},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": "view",
                },
                "subjects": [{"kind": "ServiceAccount", "name": "default"}],
            },
        )
    if kind == "service":
        return (
            "Service",
            f"{job}-workers",
            {
                "metadata": {"name": f"{job}-workers", "labels": labels},
                "spec": {
                    "clusterIP": "None",
                    "selector": {"neighbour": "yes"},
                    "ports": [{"name": "x", "port": 1}],
                },
            },
        )
    assert kind == "pod"
    return "Pod", f"{job}-worker-0", _pod(f"{job}-worker-0", labels, fail=False)


def _pod(name: str, labels: dict, *, fail: bool) -> dict:
    spec: dict = {
        "restartPolicy": "Never",
        "containers": [{"name": "c", "image": "busybox", "command": ["false"]}],
    }
    if fail:
        spec["nodeName"] = "node-a"  # the node agent runs it: it exits 1
    else:
        spec["schedulerName"] = "none-such"
    return {"metadata": {"name": name, "labels": labels}, "spec": spec}


def _api(kube, kind: str):
    core, rbac = kube.core, kube.rbac
    return {
        "ConfigMap": (core.create_namespaced_config_map, core.read_namespaced_config_map),
        "ServiceAccount": (
            core.create_namespaced_service_account,
            core.read_namespaced_service_account,
        ),
        "Role": (rbac.create_namespaced_role, rbac.read_namespaced_role),
        "RoleBinding": (rbac.create_namespaced_role_binding, rbac.read_namespaced_role_binding),
        "Service": (core.create_namespaced_service, core.read_namespaced_service),
        "Pod": (core.create_namespaced_pod, core.read_namespaced_pod),
    }[kind]


def _fingerprint(kube, ns: str, kind: str, name: str) -> tuple | None:
    """What must not change: uid, deletion, owners, labels, and the content (ConfigMap data,
    rules, roleRef, subjects, Service selector; a pod's status is its own to change)."""
    try:
        obj = _api(kube, kind)[1](name, ns)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    m = obj.metadata
    body = kube.api_client.sanitize_for_serialization(obj)
    content = {k: body.get(k) for k in ("data", "rules", "roleRef", "subjects")}
    if kind == "Service":
        content["selector"] = body["spec"].get("selector")
    return (
        m.uid,
        m.deletion_timestamp,
        json.dumps(m.owner_references and [r.uid for r in m.owner_references]),
        json.dumps(m.labels, sort_keys=True),
        json.dumps(content, sort_keys=True, default=str),
    )


# ---- trainer-written documents --------------------------------------------------------------
def _worker_api(kube, control_plane, ns: str, job: str, wait_for):
    """A client with ``<job>-worker``'s token: what code in the job's image holds."""

    def token():
        sa = kube.core.read_namespaced_service_account(f"{job}-worker", ns)
        if not sa.secrets:
            return None
        data = kube.core.read_namespaced_secret(sa.secrets[0].name, ns).data or {}
        return data.get("token")

    raw = wait_for(token, timeout=60, message=f"{job}-worker's token")
    cfg = k8s.Configuration()
    cfg.host = control_plane.server
    cfg.ssl_ca_cert = str(control_plane.ca_path)
    cfg.api_key = {"authorization": "Bearer " + base64.b64decode(raw).decode()}
    return k8s.CoreV1Api(k8s.ApiClient(cfg))


def _progress(health: list[dict], **over) -> str:
    doc = {
        "kind": "TrainerProgress",
        "version": 1,
        "phase": "Training",
        "step": 1,
        "totalSteps": 2,
        "loss": 3.0,
        "tokensPerSecond": 10.0,
        "etaSeconds": 1.0,
        "updatedAt": "2026-01-01T00:00:00Z",
        "checkpoint": None,
        "moe": {},
        "health": health,
    }
    doc.update(over)
    return json.dumps(doc)


def _document(kind: str, round_: int) -> str:
    if kind == "oversized":
        return '{"kind": "TrainerProgress", "pad": "' + "x" * 1_000_000 + '"}'
    if kind == "deep":
        return "[" * 200_000 + "]" * 200_000
    if kind == "findings":  # the same set each time it is written (a trainer republishing)
        types = ["DeadExpert", "NonFiniteLoss", "Made-Up Type!", "x" * 300]
        return _progress(
            [
                {"type": types[i % 4], "severity": "Warning", "message": f"finding {i}"}
                for i in range(3000)
            ],
            step=1 + round_,
        )
    if kind == "wrong-kind":
        return _progress([], kind="Something")
    if kind == "wrong-version":
        return _progress([], version=99)
    if kind == "not-json":
        return "{not json" + "\x00" * 10
    assert kind == "valid"
    return _progress([])


def _write(api, ns: str, name: str, key: str, text: str) -> bool:
    """Patch ``name``'s ``key`` as the worker does; False when the API server refuses it (too
    large: the server's limit, not the operator's, bounds that one)."""
    try:
        api.patch_namespaced_config_map(name, ns, {"data": {key: text}})
        return True
    except ApiException as exc:
        assert exc.status in (413, 422, 500), f"{exc.status} {exc.body[:200]}"
        return False


# ---- observation --------------------------------------------------------------------------
def _conditions(job: dict | None) -> dict[str, dict]:
    return {c["type"]: c for c in ((job or {}).get("status") or {}).get("conditions") or ()}


def _owned_pods(kube, ns: str, name: str, uid: str) -> list[str]:
    pods = kube.core.list_namespaced_pod(ns, label_selector=f"{C.LABEL_JOB}={name}").items
    return [
        p.metadata.name
        for p in pods
        if any(r.uid == uid and r.controller for r in p.metadata.owner_references or ())
    ]


def _owned(kube, ns: str, uid: str) -> list[str]:
    """Everything in ``ns`` whose ownerReferences name ``uid``."""
    out = []
    for kind, items in (
        ("pod", kube.core.list_namespaced_pod(ns).items),
        ("cm", kube.core.list_namespaced_config_map(ns).items),
        ("svc", kube.core.list_namespaced_service(ns).items),
        ("sa", kube.core.list_namespaced_service_account(ns).items),
        ("role", kube.rbac.list_namespaced_role(ns).items),
        ("rb", kube.rbac.list_namespaced_role_binding(ns).items),
    ):
        out += [
            f"{kind}/{o.metadata.name}"
            for o in items
            if any(r.uid == uid for r in o.metadata.owner_references or ())
        ]
    return out


def _health_event_count(kube, ns: str, name: str) -> int:
    evs = kube.core.list_namespaced_event(ns, field_selector=f"involvedObject.name={name}").items
    reasons = {*HEALTH_TYPES, C.R_HEALTH_FINDINGS}
    return sum(1 for e in evs if e.reason in reasons)


def _read_step(kube, ns: str, name: str, step: int, wait_for) -> None:
    """Wait until the operator has read the progress document of ``step``."""

    def read_it():
        status = (read(kube, ns, name) or {}).get("status") or {}
        return (status.get("progress") or {}).get("step") == step

    wait_for(read_it, timeout=SETTLE_SECONDS, message=f"{name} reads progress step {step}")


# what a launched job owns: (kind in _owned, name after "<job>-")
_CHILDREN = (
    ("pod", "worker-0"),
    ("pod", "worker-1"),
    ("cm", "plan"),
    ("cm", "progress"),
    ("cm", "routing-stats"),
    ("svc", "workers"),
    ("sa", "worker"),
    ("role", "worker"),
    ("rb", "worker"),
)


# ---- the cases ----------------------------------------------------------------------------
def _cases(rng: random.Random) -> list[dict]:
    """Every squat kind and every document kind at least once, the rest drawn from ``rng``."""
    cases = []
    squats = list(SQUATS)
    docs = list(DOCS)
    rng.shuffle(squats)
    rng.shuffle(docs)
    for i in range(JOBS):
        case: dict = {"name": f"fc{SEED % 1000}-{i}", "squats": [], "docs": [], "foreign": None}
        if i % 2 == 0:
            case["squats"] = [squats.pop() if squats else rng.choice(SQUATS)]
            if rng.random() < 0.3:
                extra = rng.choice(SQUATS)
                case["squats"] += [extra] if extra not in case["squats"] else []
        else:
            first = docs.pop() if docs else rng.choice(DOCS)
            case["docs"] = [first, *rng.sample(DOCS, 2)]
            case["docsTarget"] = rng.choice(("progress", "routing-stats"))
        if rng.random() < 0.3:
            case["foreign"] = rng.choice(("pending", "failed"))
        case["labelled"] = rng.random() < 0.5
        cases.append(case)
    return cases


def test_fuzzed_squatters_and_trainer_documents(
    kube, namespace, control_plane, children_operator, wait_for, allowed
):
    ns = namespace
    seed_topology(kube, ns)
    rng = random.Random(SEED)
    cases = _cases(rng)
    started = time.monotonic()
    squatters: dict[tuple[str, str], tuple] = {}  # (kind, name) -> fingerprint at creation

    for case in cases:
        for kind in case["squats"]:
            api_kind, name, body = _squatter(kind, case["name"], case["labelled"])
            _api(kube, api_kind)[0](ns, body)
            case.setdefault("held", []).append(f"{api_kind} {name}")
            squatters[(api_kind, name)] = ()
        if case["foreign"]:
            labels = {
                C.LABEL_JOB: case["name"],
                C.LABEL_COMPONENT: "worker",
                C.LABEL_NODE_RANK: "0",
                C.LABEL_ATTEMPT: "0",
            }
            name = f"{case['name']}-intruder"
            kube.core.create_namespaced_pod(
                ns, _pod(name, labels, fail=case["foreign"] == "failed")
            )
            squatters[("Pod", name)] = ()
    for kind, name in squatters:
        squatters[(kind, name)] = _fingerprint(kube, ns, kind, name)

    for case in cases:
        case["uid"] = apply_job(kube, ns, _job(case["name"], allowed))["metadata"]["uid"]

    def outcome(case: dict) -> str | None:
        job = read(kube, ns, case["name"])
        conds = _conditions(job)
        status = (job or {}).get("status") or {}
        pods = _owned_pods(kube, ns, case["name"], case["uid"])
        if case.get("held"):
            rank0 = any(h.startswith("Pod ") for h in case["held"])
            if rank0 and (
                status.get("gangComplete") == 0
                or conds.get(C.COND_RUNNING, {}).get("status") == "True"
            ):
                return "wronglyAccepted"
            if pods and not rank0:
                case["pods"] = pods
                return "wronglyAccepted"
            c = conds.get(C.COND_RECONCILED, {})
            if c.get("reason") == C.R_CHILD_CONFLICT and any(
                h in c.get("message", "") for h in case["held"]
            ):
                case["reason"] = C.R_CHILD_CONFLICT
                return "refused"
            return None
        if conds.get(C.COND_RECONCILED, {}).get("status") == "False":
            return None
        if status.get("gangComplete") == 0:
            want = {f"{k}/{case['name']}-{n}" for k, n in _CHILDREN}
            intruder = f"{case['name']}-intruder"
            if want <= set(_owned(kube, ns, case["uid"])) and (
                not case["foreign"] or intruder in (status.get("foreignPods") or ())
            ):
                return "accepted"
            return None
        st_ = state(job)
        if st_ is None or st_[0] == "explained":
            return None
        case["reason"] = st_[1]
        return "refused"

    def settle(todo: list[dict], key: str) -> None:
        deadline = time.monotonic() + SETTLE_SECONDS
        while todo and time.monotonic() < deadline:
            for case in list(todo):
                case[key] = outcome(case)
                if case[key]:
                    todo.remove(case)
            time.sleep(0.5)

    settle(list(cases), "outcome")

    # trainer-written documents, with the worker's own token, into launched jobs
    consumers = []
    last_findings = [time.monotonic()]
    for case in cases:
        if not case["docs"] or case["outcome"] != "accepted":
            continue
        api = _worker_api(kube, control_plane, ns, case["name"], wait_for)
        target = f"{case['name']}-{case['docsTarget']}"
        key = C.PROGRESS_KEY if case["docsTarget"] == "progress" else C.ROUTING_STATS_KEY
        case["written"] = collections.Counter()
        for kind in case["docs"]:
            for round_ in range(2 if kind == "findings" else 1):
                if _write(api, ns, target, key, _document(kind, round_)):
                    case["written"][kind] += 1
                    last_findings[0] = time.monotonic()
                if kind == "findings" and case["docsTarget"] == "progress":
                    _read_step(kube, ns, case["name"], 1 + round_, wait_for)
            if case["docsTarget"] == "progress":
                # the pass after it still works: a valid document is read
                step = 100 + sum(case["written"].values())
                _write(api, ns, target, key, _progress([], step=step, totalSteps=1000))
                _read_step(kube, ns, case["name"], step, wait_for)
        if case["docsTarget"] == "routing-stats":  # a job that plans from them
            consumer = {"name": f"{case['name']}-c", "squats": [], "foreign": None}
            consumer["docs"] = case["docs"]  # what its source's statistics were
            doc = _job(consumer["name"], allowed, routingStatsFrom={"jobName": case["name"]})
            consumer["uid"] = apply_job(kube, ns, doc)["metadata"]["uid"]
            consumers.append(consumer)
    settle(list(consumers), "outcome")
    for case in consumers:  # accepted means planned from hostile statistics
        if case["outcome"] == "accepted":
            case["outcome"] = "wronglyAccepted"
    everyone = cases + consumers
    bad = [c for c in everyone if c["outcome"] in (None, "wronglyAccepted")]
    detail = json.dumps(
        [
            {k: c.get(k) for k in ("name", "held", "docs", "outcome", "pods")}
            | {"status": ((read(kube, ns, c["name"]) or {}).get("status"))}
            for c in bad
        ],
        indent=1,
        default=str,
    )[:6000]
    # delete everything; what the jobs owned goes, the squatters stay as they were
    for case in everyone:
        try:
            kube.custom.delete_namespaced_custom_object(
                C.GROUP, C.VERSION, ns, C.PLURAL, case["name"], propagation_policy="Background"
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
    deadline = time.monotonic() + GONE_SECONDS
    left = everyone
    while left and time.monotonic() < deadline:
        left = [c for c in everyone if read(kube, ns, c["name"]) or _owned(kube, ns, c["uid"])]
        time.sleep(0.5)
    leaked = [{"name": c["name"], "owned": _owned(kube, ns, c["uid"])} for c in left]
    # Events: the operator posts each at most EVENT_MAX_DELAY_SECONDS after its pass raised it
    # (a deadline, not a measurement); the findings were read before the check above ended
    left_s = EVENT_MAX_DELAY_SECONDS + 5 - (time.monotonic() - last_findings[0])
    if left_s > 0:
        time.sleep(left_s)
    floods = []
    for case in cases:
        if case.get("written", {}).get("findings"):
            n = _health_event_count(kube, ns, case["name"])
            # one set of findings, read twice: one Event each for MAX_HEALTH_EVENTS of them, one
            # for the rest, one for the Healthy condition's transition
            if n > MAX_HEALTH_EVENTS + 2:
                floods.append({"name": case["name"], "events": n})
    for (kind, name), before in squatters.items():
        after = _fingerprint(kube, ns, kind, name)
        if after != before:
            leaked.append({"squatter": f"{kind} {name}", "before": before, "after": after})

    tally = collections.Counter(c["outcome"] or "stuck" for c in everyone)
    logs = children_operator.logs()
    restarts = children_operator.starts - 1 + (0 if children_operator.proc.poll() is None else 1)
    result = {
        "command": " ".join(
            f"{k}={os.environ[k]}"
            for k in ("MOE_FUZZ_SEED", "MOE_FUZZ_CHILD_JOBS", "MOE_FUZZ_RESULTS")
            if os.environ.get(k)
        )
        + " python -m pytest -q tests/test_operator_fuzz_children.py",
        "seed": SEED,
        "jobs": len(cases),
        "consumerJobs": len(consumers),
        "seconds": round(time.monotonic() - started, 1),
        "squatters": dict(
            sorted(collections.Counter(k for c in cases for k in c["squats"]).items())
        ),
        "foreignPods": sum(1 for c in cases if c["foreign"]),
        "documentsWritten": dict(
            sorted(
                sum(
                    (c.get("written", collections.Counter()) for c in cases), collections.Counter()
                ).items()
            )
        ),
        "accepted": tally["accepted"],
        "refused": tally["refused"],
        "refusedReasons": dict(
            sorted(collections.Counter(c["reason"] for c in everyone if c.get("reason")).items())
        ),
        "stuck": tally["stuck"],
        "wronglyAccepted": tally["wronglyAccepted"],
        "leaked": len(leaked),
        "eventFloods": len(floods),
        "operatorRestarts": restarts,
        "operatorTracebacks": logs.count("Traceback"),
    }
    if os.environ.get("MOE_FUZZ_RESULTS"):
        Path(os.environ["MOE_FUZZ_RESULTS"]).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    assert result["stuck"] == 0 and result["wronglyAccepted"] == 0, detail + logs[-3000:]
    assert not leaked, leaked
    assert not floods, floods
    assert restarts == 0 and result["operatorTracebacks"] == 0, logs[-6000:]
    # both sides of the boundary were exercised
    assert result["accepted"] and result["refused"], result
