"""Property-based fuzzing of the operator through the real API server: MoETrainingJob manifests
generated from the CRD schema (tests/crd_fuzz.py), in batches, applied to the local control plane
with one operator running. For every manifest:

- the API server refuses it (schema), or the job reaches a terminal or explained state within
  a bound: observedGeneration caught up, a phase, every condition with a reason and a message,
  no ``Reconciled=False`` (no pass stuck in an error loop);
- the same again after a fuzzed edit of one spec field (mutable or not, before or after launch);
- deleting it leaves no child behind (pods, ConfigMaps, Services, ServiceAccounts);

and for the run: the operator process never exits or restarts and logs no traceback.

Worker pods of accepted jobs name a scheduler that does not exist: they are created (so every
child the API server could refuse is tried) but never run a trainer, which keeps the cost to a
few minutes. ``MOE_FUZZ_RESULTS=<file>`` writes the counts (docs/operator.md "Fuzzing").
"""

from __future__ import annotations

import collections
import json
import os
import re
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from kubernetes.client.rest import ApiException

from crd_fuzz import edits, manifests
from moejob_operator import constants as C
from operator_harness import Operator, children, get_job, install_crd, seed_topology

pytestmark = pytest.mark.cluster

BATCHES = int(os.environ.get("MOE_FUZZ_BATCHES", "8"))
BATCH_SIZE = 10
SETTLE_SECONDS = 90  # bound: every job terminal or explained this long after its batch applied
GONE_SECONDS = 90  # bound: children gone after the jobs were deleted


@pytest.fixture(scope="module")
def fuzz_operator(control_plane, kube, node_agent, tmp_path_factory):
    install_crd(kube)
    op = (
        Operator(control_plane, tmp_path_factory.mktemp("operator-fuzz"))
        .start(MOE_GATE_ENABLED="false")
        .wait_ready()
    )  # SETTLE_SECONDS times the operator's work, not its start
    yield op
    op.stop()


def state(job: dict | None) -> tuple[str, str] | None:
    """(kind, detail) once the job is terminal or explained, else None."""
    if job is None:
        return "terminal", "DeletedByTTL"
    meta, status = job["metadata"], job.get("status") or {}
    conds = status.get("conditions") or []
    if (
        status.get("observedGeneration") != meta.get("generation")
        or not status.get("phase")
        or not conds
    ):
        return None
    if any(not c.get("reason") or not c.get("message") for c in conds):
        return None
    by_type = {c["type"]: c for c in conds}
    if by_type.get(C.COND_RECONCILED, {}).get("status") == "False":
        return None
    if by_type.get(C.COND_FAILED, {}).get("status") == "True":
        return "terminal", by_type[C.COND_FAILED]["reason"]
    if by_type.get(C.COND_SUSPENDED, {}).get("status") == "True":
        return "explained", "Suspended"
    for ctype in (
        C.COND_RUNNING,
        C.COND_UPGRADE_VERIFIED,
        C.COND_PLANNED,
        C.COND_TOPOLOGY,
        C.COND_DATA_PREPARED,
        C.COND_MODEL_INSPECTED,
    ):
        c = by_type.get(ctype)
        if c and c["status"] != "True":
            return "explained", f"{status['phase']}/{c['reason']}"
    return "explained", status["phase"]


def read(kube, ns: str, name: str) -> dict | None:
    try:
        return get_job(kube, ns, name)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def test_fuzzed_manifests_end_explained_and_leave_nothing(kube, namespace, fuzz_operator, wait_for):
    seed_topology(kube, namespace)
    tally = {
        "manifests": 0,
        "refusedBySchema": 0,
        "refusedByOperator": collections.Counter(),
        "otherTerminal": collections.Counter(),
        "explainedWaiting": collections.Counter(),
        "stuck": [],
        "leaked": [],
        "unnamed": [],
    }
    tally.update(edits=0, editsRefusedBySchema=0)
    batch_no = [0]
    started = time.monotonic()

    def settle(names: list[str]) -> dict[str, tuple[str, str] | None]:
        states: dict[str, tuple[str, str] | None] = {}
        deadline = time.monotonic() + SETTLE_SECONDS
        while time.monotonic() < deadline:
            states = {n: state(read(kube, namespace, n)) for n in names}
            if all(states.values()):
                break
            time.sleep(0.5)
        return states

    @settings(
        max_examples=BATCHES,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(st.data())
    def batch(data):
        b = batch_no[0]
        batch_no[0] += 1
        docs = [data.draw(manifests(i, f"fz{b}"), label=f"manifest {i}") for i in range(BATCH_SIZE)]
        created = []
        for doc in docs:
            tally["manifests"] += 1
            try:
                kube.custom.create_namespaced_custom_object(
                    C.GROUP, C.VERSION, namespace, C.PLURAL, doc
                )
            except ApiException as exc:
                assert exc.status in (400, 422), f"{exc.status} {exc.body[:300]}"
                tally["refusedBySchema"] += 1
                continue
            created.append(doc["metadata"]["name"])

        states = settle(created)
        for name in created:  # an edit of one field, then settled again
            if read(kube, namespace, name) is None:
                continue
            tally["edits"] += 1
            try:
                kube.custom.patch_namespaced_custom_object(
                    C.GROUP,
                    C.VERSION,
                    namespace,
                    C.PLURAL,
                    name,
                    {"spec": data.draw(edits(), label=f"edit {name}")},
                )
            except ApiException as exc:
                assert exc.status in (400, 422), f"{exc.status} {exc.body[:300]}"
                tally["editsRefusedBySchema"] += 1
        states = settle(created)
        for name, st_ in states.items():
            job = read(kube, namespace, name)
            refusals = [
                c["message"]
                for c in ((job or {}).get("status") or {}).get("conditions") or ()
                if c.get("reason") == C.R_INVALID_SPEC
            ]
            tally["unnamed"] += [m for m in refusals if not re.match(r"^(spec|metadata)[.:]", m)]
            if st_ is None:
                tally["stuck"].append({"name": name, "status": (job or {}).get("status")})
            elif st_[0] == "terminal" and st_[1] in (
                C.R_INVALID_SPEC,
                C.R_CHILD_REJECTED,
                C.R_PLAN_TOO_LARGE,
                C.R_INSUFFICIENT_MEMORY,
                C.R_PLAN_FAILED,
            ):
                tally["refusedByOperator"][st_[1]] += 1
            elif st_[0] == "terminal":
                tally["otherTerminal"][st_[1]] += 1
            else:
                tally["explainedWaiting"][st_[1]] += 1

        for name in created:
            try:
                kube.custom.delete_namespaced_custom_object(
                    C.GROUP, C.VERSION, namespace, C.PLURAL, name, propagation_policy="Background"
                )
            except ApiException as exc:
                if exc.status != 404:
                    raise
        deadline = time.monotonic() + GONE_SECONDS
        left = created
        while left and time.monotonic() < deadline:
            left = [
                n
                for n in created
                if read(kube, namespace, n) is not None or children(kube, namespace, n)
            ]
            time.sleep(0.5)
        tally["leaked"] += [{"name": n, "children": children(kube, namespace, n)} for n in left]

    batch()
    seconds = time.monotonic() - started
    logs = fuzz_operator.logs()
    restarts = fuzz_operator.starts - 1 + (0 if fuzz_operator.proc.poll() is None else 1)
    result = {
        "command": "MOE_FUZZ_RESULTS=benchmarks/results/fuzz.json "
        "python -m pytest -q tests/test_operator_fuzz.py",
        "batches": BATCHES,
        "batchSize": BATCH_SIZE,
        "seconds": round(seconds, 1),
        "manifests": tally["manifests"],
        "refusedBySchema": tally["refusedBySchema"],
        "edits": tally["edits"],
        "editsRefusedBySchema": tally["editsRefusedBySchema"],
        "refusedByOperator": dict(sorted(tally["refusedByOperator"].items())),
        "otherTerminal": dict(sorted(tally["otherTerminal"].items())),
        "explainedWaiting": dict(sorted(tally["explainedWaiting"].items())),
        "stuck": len(tally["stuck"]),
        "leakedAfterDelete": len(tally["leaked"]),
        "invalidSpecNamingNoField": len(tally["unnamed"]),
        "operatorRestarts": restarts,
        "operatorTracebacks": logs.count("Traceback"),
    }
    if os.environ.get("MOE_FUZZ_RESULTS"):
        Path(os.environ["MOE_FUZZ_RESULTS"]).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    assert tally["manifests"] == BATCHES * BATCH_SIZE
    assert not tally["stuck"], json.dumps(tally["stuck"], indent=1)[:4000] + "\n" + logs[-4000:]
    assert not tally["leaked"], tally["leaked"]
    assert not tally["unnamed"], f"InvalidSpec messages that name no field: {tally['unnamed']}"
    assert restarts == 0 and result["operatorTracebacks"] == 0, logs[-6000:]
    # the run exercised both sides of the boundary
    assert (
        result["refusedBySchema"] and result["refusedByOperator"] and result["explainedWaiting"]
    ), result
