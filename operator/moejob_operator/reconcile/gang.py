"""Launch and track the worker gang: the children the workers need, the worker pods (only those
this job's controller ownerReference holds), restarts, progress and health from the trainer's
ConfigMap (read under limits), node loss and suspension."""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

from moe_contracts.errors import DocumentError
from moe_contracts.plan import MoEPlan
from moe_contracts.progress import HEALTH_TYPES, parse_progress

from .. import admission, metrics
from .. import constants as C
from ..builders import common, configmaps, rbac, workers
from ..spec import JobSpec, field_hashes
from ..status import FALSE, TRUE, UNKNOWN, now_iso, parse_time
from . import gate, inputs, machine, podgroups, replan, sizing
from .client import ChildConflict, NotReady, Rejected
from .jobpass import Pass, _conflict, _crashpoint, _finished, _status_int
from .specplan import _plan_written

log = logging.getLogger("moejob_operator")
MAX_FOREIGN_NAMES = 10  # pod names kept in status.foreignPods


def _worker_pods(p: Pass) -> list[dict[str, Any]]:
    """The job's worker pods: those its ownerReference controls. Pods that only carry its labels
    count for nothing (not tracked, not deleted); their names go to ``status.foreignPods`` with
    one Event whenever that list changes."""
    owned, foreign = p.client.list_owned_pods(
        p.job.namespace, {C.LABEL_JOB: p.job.name, C.LABEL_COMPONENT: "worker"}, p.job.uid
    )
    names = sorted(foreign)[:MAX_FOREIGN_NAMES]
    if names != (p.status.get("foreignPods") or []):
        if names:
            p.status["foreignPods"] = names
            p.event(
                "Warning",
                C.R_FOREIGN_PODS_IGNORED,
                f"{len(foreign)} pod(s) carry this job's worker labels but not its ownerReference "
                f"and are ignored: {', '.join(names)}",
            )
        else:
            p.status.pop("foreignPods", None)
    return owned


# ---- launch + track -----------------------------------------------------------------------
def _launch_children(p: Pass, spec: JobSpec, plan: MoEPlan) -> None:
    """What the worker pods need to exist and start, before them and at once (one round trip):
    pod admission looks the ServiceAccount up, the kubelet mounts the plan. Everything else
    follows the pods (_complete_launch), but its names are claimed here, in the same round trip:
    one a neighbour holds is a ChildConflict before any worker pod exists (the pods would run
    with its Service, or their Role would let them write its ConfigMaps)."""
    plan_cm = [p.new_plan_cm] if p.new_plan_cm is not None else []
    if spec.placement.replan is not None:
        assert plan.placement is not None, "the planner writes a placement (plan_json checks it)"
        p.placement_cm = configmaps.placement_configmap(
            p.job, plan.placement.permutation, plan.placement.replicas
        )
    created = p.client.create_all(
        [*plan_cm, rbac.service_account(p.job)], claim=_trainer_children(p)
    )
    if plan_cm:
        _plan_written(p, created[0])
    # a hash, not a copy: status stays small whatever the spec holds (the plan ConfigMap keeps
    # the launched values for an edit of an immutable field after launch)
    p.status.pop("launchedSpec", None)
    p.status["launchedSpecHash"] = spec.immutable_hash()
    p.status["launchedFields"] = field_hashes(spec.immutable_view())
    p.status.setdefault("startTime", now_iso(p.now))
    p.status.setdefault("attempt", 0)
    p.status.setdefault("restarts", 0)
    p.status.setdefault("failedRestarts", 0)


def _trainer_children(p: Pass) -> list[dict[str, Any]]:
    """The children only the running trainer uses, the Role first (_complete_launch); with
    ``spec.placement.replan`` the PlacementUpdate ConfigMap too."""
    placement = [p.placement_cm] if p.placement_cm is not None else []
    return [
        rbac.role(p.job, placement=bool(placement)),
        workers.headless_service(p.job),
        configmaps.progress_configmap(p.job),
        configmaps.routing_stats_configmap(p.job),
        *placement,
        rbac.role_binding(p.job),
    ]


def _complete_launch(p: Pass) -> None:
    """The end of every pass: on a launching pass first the children that only the running
    trainer uses, then the status (always written last, so an operator that stops before it
    launches again and finds everything "already exists").

    Trainer-only children: the headless Service (rendezvous DNS, looked up once rank 0's pod
    runs), the progress and routing-statistics ConfigMaps the trainer patches and the Role and
    RoleBinding that let it (it retries a failed publish at its next interval). Pod scheduling
    and start need none of them, so on the way from apply to worker pods they cost nothing; with
    ``reconcile(defer=...)`` they wait until a burst of new jobs has its pods (the effect on the
    100-job benchmark: docs/operator.md)."""
    try:
        if p.launched:
            p.launched = False
            try:
                # The Role before its binding: for an operator without system:masters (the chart's
                # ServiceAccount) the API server's RBAC escalation check resolves the bound Role,
                # and a binding created first (or concurrently) is refused with 404.
                role, *rest = _trainer_children(p)
                p.client.create(role)
                p.client.create_all(rest)
            except Rejected as exc:
                p.fail(C.R_CHILD_REJECTED, str(exc))
            except ChildConflict as exc:
                for key in ("launchedSpec", "launchedSpecHash", "launchedFields"):
                    p.status.pop(key, None)  # not launched completely: launch again
                _conflict(p, exc)
            except Exception:
                for key in ("launchedSpec", "launchedSpecHash", "launchedFields"):
                    p.status.pop(key, None)  # not launched completely: launch again
                raise
            _crashpoint(p, "after-rbac")
    finally:
        p.flush()
        metrics.observe_job(p.job.namespace, p.job.name, p.status)


def _fault_env(p: Pass) -> dict[str, str]:
    """Test hook (``moe_faults.trainer_env``, test mode only): fault annotations -> trainer env."""
    faults = admission.test_faults(p.settings.policy)
    return faults.trainer_env(p.body["metadata"].get("annotations")) if faults is not None else {}


def _regate(p: Pass, spec: JobSpec, pods: list[machine.PodView], digest: str) -> float:
    """A tag-only image whose pods run other bits than the smoke test verified: stop the gang and
    test those bits (the gate pins the identity to ``digest``); relaunch when they pass."""
    msg = (
        f"image {spec.image}: the job's pods run {digest}, the smoke test verified "
        f"{p.status.get('verifiedDigest')} (the tag was pushed again); stopping the workers and "
        f"testing {digest} before they run again"
    )
    p.status["gateDigest"] = digest
    p.status.pop("verifiedDigest", None)
    p.status["attempt"] = (_status_int(p, "attempt") or 0) + 1
    p.cond(C.COND_UPGRADE_VERIFIED, UNKNOWN, gate.R_IMAGE_DIGEST_CHANGED, msg, quiet=True)
    p.cond(C.COND_RUNNING, FALSE, gate.R_IMAGE_DIGEST_CHANGED, msg, quiet=True)
    p.event("Warning", gate.R_IMAGE_DIGEST_CHANGED, msg)
    p.flush()  # persist the pinned digest before deleting anything
    _delete(p, [x for x in pods if not x.deleting])
    return 1.0


def _track(p: Pass, spec: JobSpec, plan: MoEPlan, *, launching: bool = False) -> float | None:
    """``launching``: this pass has just created the job's other children (first launch). The
    plan's nodes were read a moment ago and no worker pod can exist yet, except after an operator
    crash mid-launch, where creating them again answers "already exists": the node and pod
    listings and the (just seeded, empty) progress read are skipped, three round trips fewer on
    the path from apply to worker pods."""
    rank2node = plan.node_names
    count = len(rank2node)  # spec.nodes.count, or what the sizing chose for Auto
    lost = [] if launching else _lost_nodes(p, rank2node)
    if lost:
        return _node_lost(p, spec, lost)

    raw = [] if launching else _worker_pods(p)
    pods = [machine.PodView.from_pod(x) for x in raw]
    digest = gate.digest_changed({"status": p.status}, spec, raw)
    if digest:
        return _regate(p, spec, pods, digest)
    attempt = _status_int(p, "attempt")
    if attempt is None:  # not a count (hand-patched): the newest gang's pods say it
        attempt = max((x.attempt for x in pods), default=0)
        p.status["attempt"] = attempt
    for key in ("restarts", "failedRestarts"):
        if _status_int(p, key) is None:
            p.status[key] = 0
    d = machine.decide_gang(
        pods,
        count=count,
        attempt=attempt,
        failed_restarts=int(p.status.get("failedRestarts", 0)),
        backoff_limit=spec.run_policy.backoff_limit,
        gang_complete=p.status.get("gangComplete") == attempt,
    )
    p.status["workers"] = {"total": count, **d.counts}
    progress = None
    if launching:
        _no_progress_yet(p)
    else:
        progress = _progress(p)
        sizing.status(p.status, plan)  # measured vs predicted tokens/s

    left = machine.seconds_left(
        parse_time(p.status.get("startTime")), p.now, spec.run_policy.active_deadline_seconds
    )
    if left is not None and left <= 0 and d.action != "succeed":
        _delete(p, [x for x in pods if not x.deleting])
        podgroups.finished(p, attempt)
        p.fail(
            C.R_DEADLINE_EXCEEDED,
            f"the job was active longer than activeDeadlineSeconds="
            f"{spec.run_policy.active_deadline_seconds}",
        )
        return _finished(p)

    if d.action == "fail":
        _delete(p, d.delete)
        podgroups.finished(p, attempt)
        p.fail(d.reason, d.message)
        return _finished(p)
    if d.action == "succeed":
        podgroups.finished(p, attempt)
        p.cond(C.COND_SUCCEEDED, TRUE, C.R_TRAINING_FINISHED, d.message)
        p.cond(C.COND_RUNNING, FALSE, C.R_FINISHED, "training finished", quiet=True)
        p.status["completionTime"] = now_iso(p.now)
        return _finished(p)
    if d.action == "restart":
        p.status["attempt"] = attempt + 1
        p.status["restarts"] = int(p.status.get("restarts", 0)) + 1
        if d.counts_against_backoff:
            p.status["failedRestarts"] = int(p.status.get("failedRestarts", 0)) + 1
        p.cond(C.COND_RUNNING, FALSE, C.R_RESTARTING, d.message)
        p.flush()  # persist the new attempt before deleting anything
        _crashpoint(p, "after-restart-status")
        _delete(p, d.delete)
        return 1.0
    if d.action == "delete":
        _delete(p, d.delete)
        return 1.0
    if d.action == "create":
        extra_env = _fault_env(p)
        h = spec.immutable_hash()
        gang = podgroups.scheduler(p, spec)
        try:  # Volcano: the attempt's PodGroup before its pods
            podgroups.before_pods(p, spec, gang, attempt, count)
        except Rejected as exc:
            p.fail(C.R_CHILD_REJECTED, f"{exc} (gang: Volcano needs Volcano's PodGroup CRD)")
            return _finished(p)
        pods_to_create = workers.worker_pods(
            p.job,
            sizing.sized_spec(spec, plan),
            rank2node,
            attempt=attempt,
            spec_hash=h,
            extra_env=extra_env,
            node_ranks=list(d.create_ranks),
            image=gate.worker_image(spec, p.status),  # the verified digest: no tag drift
            gang=gang,
        )
        faults = admission.test_faults(p.settings.policy)
        if faults is not None and faults.crash_at() == "after-first-worker":
            pods_to_create = pods_to_create[:1]  # the crash test wants a partial gang
        try:
            p.client.create_all(
                pods_to_create
            )  # the gang at once: one round trip, not one per rank
        except NotReady as exc:
            log.info("%s/%s: %s; retrying", p.job.namespace, p.job.name, exc)
            return 1.0
        _crashpoint(p, "after-first-worker")
        if (
            p.status.get("gangComplete") != attempt
            and len(d.create_ranks) + sum(d.counts.values()) >= count
        ):
            p.status["gangComplete"] = attempt
            p.event(
                "Normal",
                "WorkersCreated",
                f"created {len(d.create_ranks)} worker pod(s), attempt {attempt}, on "
                f"{', '.join(rank2node)}",
            )
    running, succeeded = d.counts.get("running", 0), d.counts.get("succeeded", 0)
    if running == count:
        p.cond(C.COND_RUNNING, TRUE, C.R_WORKERS_RUNNING, f"{count} worker pod(s) running")
    elif succeeded and running + succeeded == count:
        pass  # ranks finishing one by one: still Running until the gang has Succeeded
    elif p.cond_status(C.COND_RUNNING) != FALSE or d.action == "create":
        # on the first launch the WorkersCreated Event says it: no second Event for "pending"
        p.cond(
            C.COND_RUNNING,
            FALSE,
            C.R_WORKERS_PENDING,
            f"{d.counts.get('running', 0)} of {count} worker pods running",
            quiet=launching and p.cond_status(C.COND_RUNNING) is None,
        )
    replan.step(p, spec, plan, progress)  # spec.placement.replan: after the gang's own work
    return min(left, 60.0) if left is not None else None


def _delete(p: Pass, pods: list[machine.PodView]) -> None:
    for pod in pods:
        p.client.delete_pod(p.job.namespace, pod.name, uid=pod.uid)


def _progress(p: Pass) -> dict[str, Any] | None:
    """Read the trainer's progress into status; returns the document (decoded JSON), None while
    there is none or it does not parse."""
    try:
        cm = p.client.get_owned_configmap(
            p.job.namespace, common.progress_configmap_name(p.job), p.job.uid
        )
    except ChildConflict:
        cm = None  # a squatted progress ConfigMap is no report (the launch reports the conflict)
    raw = ((cm or {}).get("data") or {}).get(C.PROGRESS_KEY)
    if not raw:
        _no_progress_yet(p)
        return None
    obj = replan.decoded(raw)
    try:
        doc = parse_progress(obj if obj is not None else raw)
    except DocumentError:
        return None
    p.status["progress"] = machine.progress_status(doc)
    inputs.exported(p, doc)
    # the document is the trainer's, i.e. any code in the user's image: bounded before use
    findings = machine.health_findings(doc)[:MAX_HEALTH_FINDINGS]
    warnings = [
        {**f, "type": _health_reason(f["type"])} for f in findings if f["severity"] == "Warning"
    ]
    _health_events(p, warnings)
    p.status["health"] = warnings[:20]
    if warnings:
        kinds = sorted({f["type"] for f in warnings})
        p.cond(
            C.COND_HEALTHY,
            FALSE,
            kinds[0] if len(kinds) == 1 else C.R_HEALTH_FINDINGS,
            "; ".join(f["message"] for f in warnings[:3]),
        )
    else:
        p.cond(C.COND_HEALTHY, TRUE, C.R_NO_FINDINGS, "no trainer health findings")
    return obj


MAX_HEALTH_FINDINGS = 1000  # read from one progress document; the rest is not looked at
MAX_HEALTH_EVENTS = 5  # Events per pass, one per new finding; the rest are one aggregate Event


def _health_reason(kind: str) -> str:
    """A finding's type as an Event / condition reason: the known types, else the generic one
    (the trainer's string is not a reason the operator vouches for)."""
    return kind if kind in HEALTH_TYPES else C.R_HEALTH_FINDINGS


def _health_events(p: Pass, warnings: list[dict[str, str]]) -> None:
    """One Event per finding not already in ``status.health``, de-duplicated, at most
    :data:`MAX_HEALTH_EVENTS` a pass; the others are counted in one aggregate Event. The set of
    findings last announced is remembered by its digest (``status.healthDigest``): a trainer
    that publishes the same findings again (every progress interval) posts nothing again,
    however many more there are than ``status.health`` keeps."""
    keys = sorted({(f["type"], f["message"]) for f in warnings})
    digest = hashlib.sha256(json.dumps(keys).encode()).hexdigest()[:16] if keys else None
    announced = p.status.get("healthDigest")
    if digest is None:
        p.status.pop("healthDigest", None)
    else:
        p.status["healthDigest"] = digest
    if digest is None or digest == announced:
        return
    seen = {(f["type"], f["message"]) for f in p.status.get("health") or ()}
    new = []
    for f in warnings:
        key = (f["type"], f["message"])
        if key not in seen:
            seen.add(key)
            new.append(f)
    for f in new[:MAX_HEALTH_EVENTS]:
        p.event("Warning", f["type"], f["message"])
    rest = new[MAX_HEALTH_EVENTS:]
    if rest:
        kinds = sorted({f["type"] for f in rest})
        p.event(
            "Warning",
            C.R_HEALTH_FINDINGS,
            f"{len(rest)} more new health finding(s) of type(s) {', '.join(kinds)} "
            "(not posted one by one; status.health and the progress ConfigMap list them)",
        )


def _no_progress_yet(p: Pass) -> None:
    if p.cond_status(C.COND_HEALTHY) is None:
        p.cond(
            C.COND_HEALTHY,
            UNKNOWN,
            C.R_NO_PROGRESS_YET,
            "the trainer has not reported yet",
            quiet=True,
        )


def _lost_nodes(p: Pass, rank2node: list[str]) -> list[str]:
    names = {n["metadata"]["name"] for n in p.client.list_nodes()}
    return sorted(set(rank2node) - names)


def _node_lost(p: Pass, spec: JobSpec, lost: list[str]) -> float | None:
    msg = f"planned node(s) {', '.join(lost)} no longer exist"
    pods = [machine.PodView.from_pod(x) for x in _worker_pods(p)]
    live = [x for x in pods if not x.deleting]
    if not spec.run_policy.allow_replan_on_node_loss:
        _delete(p, live)
        p.fail(C.R_NODE_LOST, msg + " (runPolicy.allowReplanOnNodeLoss is false)")
        return _finished(p)
    p.status["attempt"] = (_status_int(p, "attempt") or 0) + 1
    p.status["restarts"] = (_status_int(p, "restarts") or 0) + 1
    p.cond(C.COND_RUNNING, FALSE, C.R_RESTARTING, msg + "; planning again")
    p.cond(C.COND_PLANNED, UNKNOWN, C.R_NODE_LOST, msg + "; planning again")
    p.flush()
    _delete(p, live)
    p.client.delete_configmap(p.job.namespace, common.plan_configmap_name(p.job))
    return 1.0


def _suspend(p: Pass) -> float | None:
    pods = [machine.PodView.from_pod(x) for x in _worker_pods(p)]
    _delete(p, [x for x in pods if not x.deleting])
    podgroups.finished(p, _status_int(p, "attempt"))  # made again on resume, before the pods
    p.status.pop("gangComplete", None)
    p.cond(
        C.COND_SUSPENDED,
        TRUE,
        C.R_SUSPENDED,
        "runPolicy.suspend is true: worker pods deleted, checkpoints kept",
    )
    if p.cond_status(C.COND_RUNNING) is not None:
        p.cond(C.COND_RUNNING, FALSE, C.R_SUSPENDED, "suspended")
    return None
