"""Pure reconcile decisions: gang policy, node choice, deadlines, progress, health, conditions."""

from __future__ import annotations

import datetime as dt

import pytest

from moe_contracts.errors import DocumentError
from moe_contracts.progress import parse_progress
from moejob_operator import constants as C
from moejob_operator.reconcile.machine import (
    PodView,
    candidate_nodes,
    decide_gang,
    excluded_nodes,
    health_findings,
    progress_status,
    seconds_left,
)
from moejob_operator.status import phase_of, set_condition


def pod(rank, phase="Running", attempt=0, code=None, deleting=False):
    return PodView(
        name=f"j-worker-{rank}",
        uid=f"u{rank}{attempt}",
        node_rank=rank,
        attempt=attempt,
        phase=phase,
        exit_code=code,
        deleting=deleting,
        node="n",
    )


def gang(pods, count=2, attempt=0, failed_restarts=0, backoff=2, complete=True):
    return decide_gang(
        pods,
        count=count,
        attempt=attempt,
        failed_restarts=failed_restarts,
        backoff_limit=backoff,
        gang_complete=complete,
    )


def test_fresh_job_creates_every_rank():
    d = gang([], complete=False)
    assert d.action == "create" and d.create_ranks == [0, 1]


def test_partial_launch_after_a_crash_creates_only_the_missing_rank():
    d = gang([pod(0, "Pending")], complete=False)
    assert d.action == "create" and d.create_ranks == [1]


def test_running_gang_waits_and_all_succeeded_succeeds():
    assert gang([pod(0), pod(1)]).action == "wait"
    assert gang([pod(0, "Succeeded", code=0), pod(1)]).action == "wait"
    assert gang([pod(0, "Succeeded", code=0), pod(1, "Succeeded", code=0)]).action == "succeed"


@pytest.mark.parametrize("code", [C.EXIT_RETRYABLE, 1, 137, None])
def test_retryable_failure_restarts_the_whole_gang(code):
    d = gang([pod(0), pod(1, "Failed", code=code)], failed_restarts=1, backoff=2)
    assert d.action == "restart" and d.counts_against_backoff
    assert {p.node_rank for p in d.delete} == {0, 1}
    assert "restart 2 of 2" in d.message


def test_backoff_limit_exceeded_fails():
    d = gang([pod(0), pod(1, "Failed", code=75)], failed_restarts=2, backoff=2)
    assert d.action == "fail" and d.reason == C.R_BACKOFF_LIMIT_EXCEEDED
    assert [p.node_rank for p in d.delete] == [0]


@pytest.mark.parametrize("code", sorted(C.PERMANENT_EXIT_CODES))
def test_permanent_exit_code_fails_at_once(code):
    d = gang([pod(0, "Failed", code=code), pod(1)], failed_restarts=0, backoff=5)
    assert d.action == "fail" and d.reason == C.R_PERMANENT_WORKER_FAILURE
    assert str(code) in d.message


def test_stale_attempt_is_deleted_before_the_new_gang_starts():
    d = gang([pod(0, attempt=0), pod(1, "Failed", attempt=0, code=75)], attempt=1)
    assert d.action == "delete" and len(d.delete) == 2
    # once they are terminating, nothing of attempt 1 is created under the same names
    d = gang(
        [pod(0, attempt=0, deleting=True), pod(1, "Failed", attempt=0, deleting=True)], attempt=1
    )
    assert d.action == "wait"
    d = gang([pod(0, attempt=0, deleting=True)], attempt=1, complete=False)
    assert d.action == "create" and d.create_ranks == [1]


def test_deleted_worker_restarts_gang_without_counting_against_backoff():
    d = gang([pod(0)], complete=True, failed_restarts=2, backoff=2)
    assert d.action == "restart" and not d.counts_against_backoff


def test_terminating_pods_are_not_failures():
    d = gang(
        [pod(0, "Failed", code=143, deleting=True), pod(1, "Failed", code=143, deleting=True)],
        complete=False,
    )
    assert d.action == "wait"


def test_candidate_nodes_filters_ready_and_labels():
    def node(name, ready=True, labels=None, unschedulable=False):
        return {
            "metadata": {"name": name, "labels": labels or {}},
            "spec": {"unschedulable": unschedulable},
            "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
        }

    nodes = [
        node("b", labels={"gpu": "h200"}),
        node("a", labels={"gpu": "h200"}),
        node("c", ready=False, labels={"gpu": "h200"}),
        node("d"),
        node("e", labels={"gpu": "h200"}, unschedulable=True),
    ]
    assert candidate_nodes(nodes, node_names=None, selectors=[{"gpu": "h200"}, None]) == ["a", "b"]
    assert candidate_nodes(nodes, node_names=None, selectors=[None]) == ["a", "b", "d"]
    assert candidate_nodes(nodes, node_names=["d", "c", "a"], selectors=[]) == ["d", "a"]

    # why: a job naming nodes its own selector excludes says which label each one lacks
    why = excluded_nodes(nodes, node_names=["d", "c", "x"], selectors=[{"gpu": "h200"}, None])
    assert why == ("node d lacks gpu=h200 (has no gpu); node c is not Ready; node x does not exist")
    assert excluded_nodes(nodes, node_names=None, selectors=[{"gpu": "h100"}], limit=2) == (
        "node a lacks gpu=h100 (has gpu=h200); node b lacks gpu=h100 (has gpu=h200), and 1 more"
    )
    assert excluded_nodes(nodes, node_names=["a"], selectors=[{"gpu": "h200"}]) == ""


def test_seconds_left():
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    assert seconds_left(t0, t0 + dt.timedelta(seconds=30), 100) == 70
    assert seconds_left(t0, t0 + dt.timedelta(seconds=130), 100) == -30
    assert seconds_left(t0, t0, None) is None and seconds_left(None, t0, 5) is None


def test_progress_and_health_from_trainer_document():
    doc = {
        "kind": "TrainerProgress",
        "version": 1,
        "phase": "Training",
        "step": 12,
        "totalSteps": 20,
        "loss": 3.212345678,
        "tokensPerSecond": 5120.0,
        "etaSeconds": 9.5,
        "checkpoint": {"step": 10, "path": "/ckpt/step-10"},
        "health": [
            {"type": "Straggler", "severity": "Info", "message": "rank 1 slow"},
            {"type": "DeadExpert", "severity": "Warning", "message": "layer 1 expert 5"},
        ],
    }
    prog = progress_status(parse_progress(doc))
    assert prog["step"] == 12 and prog["totalSteps"] == 20 and prog["loss"] == 3.2123
    assert prog["checkpointStep"] == 10
    assert [f["type"] for f in health_findings(parse_progress(doc))] == ["DeadExpert", "Straggler"]
    with pytest.raises(DocumentError, match=r"TrainerProgress version: 2 is not a known version"):
        parse_progress({**doc, "version": 2})
    with pytest.raises(DocumentError, match=r"TrainerProgress kind: 'Other'"):
        parse_progress({"kind": "Other"})
    with pytest.raises(DocumentError, match=r"TrainerProgress step: 'x' is invalid"):
        parse_progress({**doc, "step": "x"})


def test_conditions_keep_transition_time_unless_status_flips():
    conds, t = set_condition(
        [],
        C.COND_RUNNING,
        "False",
        C.R_WORKERS_PENDING,
        "0 of 2",
        generation=1,
        now="2026-01-01T00:00:00Z",
    )
    assert t is not None and t.previous is None
    conds, t = set_condition(
        conds,
        C.COND_RUNNING,
        "False",
        C.R_WORKERS_PENDING,
        "1 of 2",
        generation=1,
        now="2026-01-01T00:00:05Z",
    )
    assert t is None and conds[0]["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    assert conds[0]["message"] == "1 of 2"
    conds, t = set_condition(
        conds,
        C.COND_RUNNING,
        "True",
        C.R_WORKERS_RUNNING,
        "2 running",
        generation=2,
        now="2026-01-01T00:00:09Z",
    )
    assert t.previous == "False" and conds[0]["lastTransitionTime"] == "2026-01-01T00:00:09Z"
    assert conds[0]["observedGeneration"] == 2
    with pytest.raises(ValueError, match="True/False/Unknown"):
        set_condition(conds, C.COND_RUNNING, "yes", "X", "", generation=1, now="x")


def test_phase_is_derived_from_conditions():
    def c(t, s, r="R"):
        return {"type": t, "status": s, "reason": r}

    assert phase_of([]) == "Pending"
    assert phase_of([c(C.COND_TOPOLOGY, "Unknown")]) == "Discovering"
    assert phase_of([c(C.COND_TOPOLOGY, "True"), c(C.COND_PLANNED, "False")]) == "Planning"
    assert phase_of([c(C.COND_RUNNING, "False", C.R_RESTARTING)]) == "Restarting"
    assert phase_of([c(C.COND_RUNNING, "True"), c(C.COND_FAILED, "True")]) == "Failed"
    assert phase_of([c(C.COND_SUCCEEDED, "True")]) == "Succeeded"
    assert phase_of([c(C.COND_SUSPENDED, "True")]) == "Suspended"


def test_failure_message_carries_the_launchers_termination_message():
    """The node launcher's one termination message (a TrainerExit document naming the rank that
    failed first) reaches the Restarting condition."""
    import json

    doc = {
        "kind": "TrainerExit",
        "version": 1,
        "cause": "Signalled",
        "exitCode": 137,
        "rank": 3,
        "nodeRank": 1,
        "message": "node rank 1: rank3 exited with code 137 first; "
        "exit codes {'rank2': 143, 'rank3': 137}: ",
    }
    pod = {
        "metadata": {
            "name": "j-worker-1",
            "uid": "u",
            "labels": {C.LABEL_NODE_RANK: "1", C.LABEL_ATTEMPT: "0"},
        },
        "status": {
            "phase": "Failed",
            "containerStatuses": [
                {"state": {"terminated": {"exitCode": 137, "message": json.dumps(doc)}}}
            ],
        },
    }
    d = decide_gang(
        [PodView.from_pod(pod)],
        count=2,
        attempt=0,
        failed_restarts=0,
        backoff_limit=2,
        gang_complete=True,
    )
    assert d.action == "restart"
    assert (
        "failed (exit code 137, Signalled: node rank 1: rank3 exited with code 137 first"
        in d.message
    )


def test_a_failed_gate_is_a_warning_event():
    from moejob_operator.status import Transition, event_type_for

    def etype(ctype: str, status: str, reason: str) -> str:
        return event_type_for(Transition(ctype, status, reason, "m", previous=None))

    # a person must look at a blocked image (kubectl get events --field-selector type=Warning)
    assert etype(C.COND_UPGRADE_VERIFIED, "False", "SmokeTestFailed") == "Warning"
    assert etype(C.COND_UPGRADE_VERIFIED, "False", "ImageDigestsDiffer") == "Warning"
    assert etype(C.COND_UPGRADE_VERIFIED, "True", "SmokeTestPassed") == "Normal"
    assert etype(C.COND_UPGRADE_VERIFIED, "Unknown", "SmokeTestRunning") == "Normal"
