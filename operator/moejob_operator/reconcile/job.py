"""One level-based reconcile pass over a MoETrainingJob.

validate -> discover topology -> plan -> gate -> launch -> track -> finish. Every pass reads the
job and its children fresh and moves as far as it can; it never sleeps. It returns the seconds
after which it wants to run again ("not yet"), or None when only a change (a pod, the progress
ConfigMap, the spec) can move the job on. All state lives in the cluster (children with
deterministic names, ``status``), so a restarted operator continues where the old one stopped.

A launching pass ends at the worker pods; the rest of it (the children only a running trainer
uses, then the status write) can be handed to ``defer`` (see :func:`reconcile`).

This module runs the stages and maps their outcomes; the pass state is ``jobpass``, validate and
the stored plan ``specplan``, launch and tracking ``gang``.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import urllib3
from kubernetes.client.exceptions import ApiException

from moe_contracts.plan import MoEPlan

from .. import constants as C
from .. import metrics
from ..spec import JobSpec
from ..status import FALSE, TRUE, UNKNOWN
from . import gate, inputs, machine, planning, sizing, topology
from .client import ChildConflict, Client, NotReady, Rejected, exceeded_quota, server_message
from .gang import (
    _complete_launch,
    _delete,
    _launch_children,
    _suspend,
    _track,
    _worker_pods,
)
from .jobpass import Pass, _conflict, _finished, _is_launched
from .outcome import NotYet, Refused
from .settings import Settings
from .specplan import _accept_spec, _new_plan, _persist_plan, _stored_plan

log = logging.getLogger("moejob_operator")


def reconcile(
    client: Client,
    namespace: str,
    name: str,
    now: dt.datetime | None = None,
    *,
    settings: Settings,
    body: dict[str, Any] | None = None,
    defer: Callable[[Callable[[], None]], None] | None = None,
    backoff: Callable[[], float] | None = None,
    plan_memo: planning.PlanMemo | None = None,
) -> float | None:
    """Run one pass; returns seconds until the next wanted pass, or None. ``body``: the job as a
    watch event just delivered it (a new job's first pass), instead of reading it. ``settings``:
    the operator's (admission policy, gate settings), read once when it started. ``plan_memo``:
    the Controller's plans by input, shared by its passes (None: every plan is computed).

    ``defer``: when this pass has launched the workers, it ends there and hands the rest (the
    children only the running trainer uses, then the status write: :func:`_complete_launch`) to
    ``defer`` as a callable, which the caller runs later, before the job's next pass (handlers:
    once a burst of new jobs has its pods). Without ``defer`` (or after an error) it runs now.

    Errors: a child the API server refuses for good (:class:`Rejected`) fails the job
    (``ChildRejected``, naming the object and the server's message); any other exception becomes
    ``Reconciled=False`` (``TransientError`` for 5xx / timeouts / conflicts, else
    ``ReconcileError``) plus an Event, and the pass asks to run again after ``backoff()``
    seconds (the caller's growing delay; without ``backoff`` the exception propagates)."""
    client.pass_started()
    with metrics.reconcile_timer():
        if body is None:
            body = client.get_job(namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            metrics.forget_job(namespace, name)
            return None
        p = Pass(client, body, now or dt.datetime.now(dt.UTC), settings, plan_memo)
        done = False
        try:
            try:
                delay = _run(p)
            except Rejected as exc:
                delay = _rejected(p, exc)
            except ChildConflict as exc:
                delay = _conflict(p, exc)
            except Exception as exc:  # reported on the job, retried with backoff
                if backoff is None:
                    raise
                delay = _pass_error(p, exc, backoff())
            else:
                if p.cond_status(C.COND_RECONCILED) == FALSE:
                    p.cond(C.COND_RECONCILED, TRUE, C.R_PASS_COMPLETED, "the last pass completed")
            done = True
            return delay
        finally:
            if done and p.launched and defer is not None:
                defer(lambda: _complete_launch(p))
            else:
                _complete_launch(p)


def _rejected(p: Pass, exc: Rejected) -> float | None:
    """A child the API server will never accept: the job cannot run as specified."""
    log.warning("%s/%s: %s", p.job.namespace, p.job.name, exc)
    if exc.kind == "Pod":
        pods = [machine.PodView.from_pod(x) for x in _worker_pods(p)]
        _delete(p, [x for x in pods if not x.deleting])
    p.launched = False  # nothing more to create
    p.fail(C.R_CHILD_REJECTED, str(exc))
    return _finished(p)


def _pass_error(p: Pass, exc: Exception, delay: float) -> float:
    """An unexpected error: on the job (condition + Event), then again after ``delay``."""
    if isinstance(exc, ApiException):
        transient = (
            exc.status in (409, 429) or exc.status == 0 or exc.status >= 500 or exceeded_quota(exc)
        )
        what = f"the API server answered {exc.status} {exc.reason}: {server_message(exc)}"
    else:
        # the client's socket errors: urllib3's timeouts and protocol errors are not builtins'
        transient = isinstance(
            exc, (TimeoutError, ConnectionError, NotReady, urllib3.exceptions.HTTPError)
        )
        what = f"{type(exc).__name__}: {exc}"
    reason = C.R_TRANSIENT_ERROR if transient else C.R_RECONCILE_ERROR
    (log.info if transient else log.exception)(
        "%s/%s: pass failed (%s); again in %.0f s", p.job.namespace, p.job.name, what, delay
    )
    p.cond(C.COND_RECONCILED, FALSE, reason, f"{what[:600]}; retrying in {delay:.0f} s")
    return delay


@dataclass(frozen=True)
class Stage:
    """A stage of the pass before launch, as its outcome shows on the job: ``condition`` is the
    condition it reports on; ``waiting`` that condition's status while the stage raises
    :class:`NotYet` (``False`` also when the NotYet says an attempt ``failed``);
    ``refusal_event``: a :class:`Refused` also gets the condition's own Event, not only the
    Failed one."""

    condition: str
    waiting: str
    refusal_event: bool = False


VALIDATE = Stage(C.COND_SPEC_ACCEPTED, FALSE)  # planning.accept: Refused only
INSPECT = Stage(C.COND_MODEL_INSPECTED, UNKNOWN)  # inspect.ensure_model / recheck
PREPARE = Stage(C.COND_DATA_PREPARED, UNKNOWN)  # dataprep.ensure_data
DISCOVER = Stage(C.COND_TOPOLOGY, UNKNOWN)  # topology.ensure_reports: NotYet only
PLAN = Stage(C.COND_PLANNED, FALSE)  # planning.make_plan
GATE = Stage(C.COND_UPGRADE_VERIFIED, UNKNOWN, refusal_event=True)  # gate.check


def _run(p: Pass) -> float | None:
    if p.finished and not _succeeded_claim_contradicted(p):
        return _finished(p)
    stage = VALIDATE
    try:
        spec = _accept_spec(p)
        if spec is None:
            return None
        stage = DISCOVER
        plan = _stored_plan(p, spec)
        if plan is None:
            stage = INSPECT
            model = inputs.inspected(p, spec)
            stage = PREPARE
            found = inputs.prepared(p, spec, model)
            stage = DISCOVER
            reports = topology.ensure_reports(p.client, p.body, spec, p.now)
            p.cond(C.COND_TOPOLOGY, TRUE, C.R_DISCOVERED, reports.message)
            stage = PLAN
            plan = _new_plan(p, spec, reports.reports, found)
        metrics.observe_plan(p.job.namespace, p.job.name, plan)
        sizing.status(p.status, plan)
        stage = GATE
        return _gate_launch_track(p, spec, plan)
    except (NotYet, Refused) as exc:
        return _settle(p, stage, exc)
    finally:
        _persist_plan(p)  # every path that did not launch still keeps the plan


def _settle(p: Pass, stage: Stage, exc: NotYet | Refused) -> float | None:
    """The one place a stage's outcome reaches the job: its condition (and Event), the job's
    failure, the delay of the next pass."""
    if isinstance(exc, NotYet):
        p.cond(stage.condition, FALSE if exc.failed else stage.waiting, exc.reason, exc.message)
        if exc.reason == C.R_NO_CANDIDATE_NODES:
            # waiting for nodes, not for discovery: nothing can be planned either
            p.cond(C.COND_PLANNED, FALSE, exc.reason, exc.message)
        return exc.delay
    # before launch the Failed Event carries the message; the stage's condition flips quietly
    p.cond(
        stage.condition,
        FALSE,
        exc.reason,
        exc.message,
        quiet=not stage.refusal_event,
        field=exc.field,
    )
    p.fail(exc.reason, exc.message, exc.field)
    return _finished(p)


def _gate_launch_track(p: Pass, spec: JobSpec, plan: MoEPlan) -> float | None:
    verified = gate.check(p.client, p.body, spec, config=p.settings.gate, plan=plan)
    p.cond(C.COND_UPGRADE_VERIFIED, TRUE, verified.reason, verified.message)
    if verified.digest:
        p.status["verifiedDigest"] = verified.digest

    if spec.run_policy.suspend:
        return _suspend(p)
    if p.cond_status(C.COND_SUSPENDED) == TRUE:
        p.cond(C.COND_SUSPENDED, FALSE, C.R_RESUMED, "resumed: relaunching the workers")
    elif p.cond_status(C.COND_SUSPENDED) is None:
        p.cond(C.COND_SUSPENDED, FALSE, C.R_NOT_SUSPENDED, "not suspended", quiet=True)

    launching = not _is_launched(p.status)
    if launching:
        try:
            inputs.recheck(p, spec, plan)
        except (NotYet, Refused) as exc:
            return _settle(p, INSPECT, exc)
    if not launching:
        _persist_plan(p)  # a re-plan (node lost): the plan before the pods
        return _track(p, spec, plan)
    _launch_children(p, spec, plan)
    p.launched = True  # also when creating the pods fails: the trainer's children follow
    return _track(p, spec, plan, launching=True)


# ---- status claims, checked against the cluster ---------------------------------------------


def _succeeded_claim_contradicted(p: Pass) -> bool:
    """``Succeeded=True`` while worker pods still run (a hand-patched status): the claim goes,
    the pass tracks the workers again."""
    if p.cond_status(C.COND_SUCCEEDED) != TRUE or p.cond_status(C.COND_FAILED) == TRUE:
        return False
    live = [
        x
        for x in _worker_pods(p)
        if (x.get("status") or {}).get("phase") in (None, "Pending", "Running")
        and not x["metadata"].get("deletionTimestamp")
    ]
    if not live:
        return False
    msg = f"status said Succeeded while {len(live)} worker pod(s) still run; tracking them again"
    p.cond(C.COND_SUCCEEDED, FALSE, C.R_STATUS_CORRECTED, msg)
    p.status.pop("completionTime", None)
    return True
