"""One level-based reconcile pass over a MoETrainingJob.

validate -> discover topology -> plan -> gate -> launch -> track -> finish. Every pass reads the
job and its children fresh and moves as far as it can; it never sleeps. It returns the seconds
after which it wants to run again ("not yet"), or None when only a change (a pod, the progress
ConfigMap, the spec) can move the job on. All state lives in the cluster (children with
deterministic names, ``status``), so a restarted operator continues where the old one stopped.

A launching pass ends at the worker pods; the rest of it (the children only a running trainer
uses, then the status write) can be handed to ``defer`` (see :func:`reconcile`).
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import urllib3
from kubernetes.client.rest import ApiException

from moe_contracts.errors import DocumentError
from moe_contracts.progress import parse_progress

from .. import admission, metrics
from .. import constants as C
from ..builders import common, configmaps, rbac, workers
from ..spec import JobSpec, SpecError, changed_immutable_fields, field_hashes, parse_spec
from ..status import (
    FALSE,
    TRUE,
    UNKNOWN,
    event_type_for,
    now_iso,
    parse_time,
    phase_of,
    set_condition,
)
from . import gate, inputs, machine, planning, sizing, topology
from .client import (
    ChildConflict,
    Client,
    NotReady,
    Rejected,
    exceeded_quota,
    server_message,
)
from .outcome import NotYet, Refused
from .settings import Settings

log = logging.getLogger("moejob_operator")


def _crashpoint(p: Pass, point: str) -> None:
    """Test hook (``moe_faults.crashpoint``, test mode only): the operator process may exit here."""
    faults = admission.test_faults(p.settings.policy)
    if faults is not None:
        faults.crashpoint(point)


class Pass:
    """The status being built during one pass; flushed once at the end."""

    def __init__(self, client: Client, body: dict[str, Any], now: dt.datetime, settings: Settings):
        self.client, self.body, self.now = client, body, now
        self.settings = settings
        self.job = common.JobRef.from_body(body)
        self.generation = body["metadata"].get("generation", 0)
        raw = body.get("status")
        self.old = copy.deepcopy(raw) if isinstance(raw, dict) else {}
        self.status: dict[str, Any] = _sane_status(copy.deepcopy(self.old), now)
        if self.status != self.old:  # readers of the body (the gate) see the sane status too
            self.body = {**body, "status": copy.deepcopy(self.status)}
        self.events: list[tuple[str, str, str]] = []
        # a plan made in this pass, written with the launch batch (or before any other return)
        self.new_plan_cm: dict[str, Any] | None = None
        # this pass created the worker pods of a first launch: the trainer's other children follow
        self.launched = False

    def cond(
        self, ctype: str, status: str, reason: str, message: str, *, quiet: bool = False
    ) -> None:
        conds, transition = set_condition(
            self.status.get("conditions"),
            ctype,
            status,
            reason,
            message,
            generation=self.generation,
            now=now_iso(self.now),
        )
        self.status["conditions"] = conds
        if transition is not None and not quiet:
            self.events.append((event_type_for(transition), reason, message))

    def cond_status(self, ctype: str) -> str | None:
        for c in self.status.get("conditions") or ():
            if c.get("type") == ctype:
                return c.get("status")
        return None

    def event(self, etype: str, reason: str, message: str) -> None:
        self.events.append((etype, reason, message))

    def flush(self) -> None:
        self.status["observedGeneration"] = self.generation
        self.status["phase"] = phase_of(self.status.get("conditions"))
        if self.status != self.old:
            patch = dict(self.status)
            for key in self.old:  # merge patch: removed keys become null
                patch.setdefault(key, None)
            self.client.patch_job_status(self.job.namespace, self.job.name, patch)
            self.old = copy.deepcopy(self.status)
        for etype, reason, message in self.events:
            self.client.event(self.body, etype, reason, message)
        self.events = []

    @property
    def finished(self) -> bool:
        return self.cond_status(C.COND_SUCCEEDED) == TRUE or self.cond_status(C.COND_FAILED) == TRUE

    def fail(self, reason: str, message: str) -> None:
        self.cond(C.COND_FAILED, TRUE, reason, message)
        # the Failed event says it all: the companion conditions flip quietly
        self.cond(C.COND_SUCCEEDED, FALSE, reason, message, quiet=True)
        if self.cond_status(C.COND_RUNNING) is not None:
            self.cond(C.COND_RUNNING, FALSE, C.R_FINISHED, "the job has failed", quiet=True)
        self.status.setdefault("completionTime", now_iso(self.now))


def _sane_status(status: dict[str, Any], now: dt.datetime) -> dict[str, Any]:
    """``status`` with the shapes the pass relies on (someone may have patched it by hand): only
    well-formed conditions, times that parse (else now), lists and objects where they belong.
    What the pass derives from the cluster (plan, workers, progress) it writes again anyway."""
    conds = status.get("conditions")
    status["conditions"] = (
        [
            c
            for c in conds
            if isinstance(c, dict)
            and isinstance(c.get("type"), str)
            and isinstance(c.get("status"), str)
        ]
        if isinstance(conds, list)
        else []
    )
    if not status["conditions"]:
        status.pop("conditions")
    for key in ("startTime", "completionTime"):
        if key in status:
            try:
                if parse_time(status[key]) is None:
                    raise ValueError
            except (TypeError, ValueError, AttributeError):
                status[key] = now_iso(now)
    for key, kind in (
        ("plan", dict),
        ("workers", dict),
        ("progress", dict),
        ("health", list),
        ("launchedFields", dict),
        ("model", dict),
        ("data", dict),
        ("output", dict),
    ):
        if key in status and not isinstance(status[key], kind):
            status.pop(key)
    if isinstance(status.get("health"), list):
        status["health"] = [
            f
            for f in status["health"]
            if isinstance(f, dict)
            and isinstance(f.get("type"), str)
            and isinstance(f.get("message"), str)
        ]
    return status


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
) -> float | None:
    """Run one pass; returns seconds until the next wanted pass, or None. ``body``: the job as a
    watch event just delivered it (a new job's first pass), instead of reading it. ``settings``:
    the operator's (admission policy, gate settings), read once when it started.

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
        p = Pass(client, body, now or dt.datetime.now(dt.UTC), settings)
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


CONFLICT_RETRY_SECONDS = 30.0


def _conflict(p: Pass, exc: ChildConflict) -> float:
    """A child's name taken by an object this job does not control: reported, never used or
    deleted; the pass runs again later (its owner may remove it)."""
    log.warning("%s/%s: %s", p.job.namespace, p.job.name, exc)
    p.launched = False  # nothing more to create this pass
    p.cond(C.COND_RECONCILED, FALSE, C.R_CHILD_CONFLICT, str(exc))
    return CONFLICT_RETRY_SECONDS


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


MAX_FOREIGN_NAMES = 10


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
    p.cond(stage.condition, FALSE, exc.reason, exc.message, quiet=not stage.refusal_event)
    p.fail(exc.reason, exc.message)
    return _finished(p)


def _gate_launch_track(p: Pass, spec: JobSpec, plan: dict[str, Any]) -> float | None:
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
    _launch_children(p, spec)
    p.launched = True  # also when creating the pods fails: the trainer's children follow
    return _track(p, spec, plan, launching=True)


# ---- status claims, checked against the cluster ---------------------------------------------
def _is_launched(status: dict[str, Any]) -> bool:
    """The workers were launched: ``launchedSpecHash`` (or, from operators before it, a
    ``launchedSpec`` copy of the spec; anything else there is not trusted)."""
    return isinstance(status.get("launchedSpecHash"), str) or (
        isinstance(status.get("launchedSpec"), dict) and bool(status["launchedSpec"])
    )


def _status_int(p: Pass, key: str) -> int | None:
    value = p.status.get(key, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


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


def _launched_view(p: Pass) -> dict[str, Any] | None:
    """The immutable spec the workers were launched with: the plan ConfigMap keeps it (status
    keeps only its hash), older operators kept it in ``status.launchedSpec``."""
    legacy = p.status.get("launchedSpec")
    if isinstance(legacy, dict) and legacy:
        return legacy
    cm = p.client.get_owned_configmap(p.job.namespace, common.plan_configmap_name(p.job), p.job.uid)
    try:
        view = json.loads(((cm or {}).get("data") or {})[C.LAUNCHED_SPEC_KEY])
    except (KeyError, TypeError, ValueError):
        return None
    return view if isinstance(view, dict) else None


def _changed_since_launch(p: Pass, spec: JobSpec) -> list[str]:
    legacy = p.status.get("launchedSpec")
    if isinstance(legacy, dict) and legacy:
        return changed_immutable_fields(legacy, spec)
    if spec.immutable_hash() == p.status.get("launchedSpecHash"):
        return []
    old = p.status.get("launchedFields")
    now = field_hashes(spec.immutable_view())
    if not isinstance(old, dict):
        return sorted(now)
    return sorted(k for k in set(old) | set(now) if old.get(k) != now.get(k))


def _launched_spec(p: Pass, raw: Any) -> JobSpec | None:
    """The spec the workers run with: the launched values, and the current mutable fields
    (runPolicy, gate) when they are valid. None only when the launched values are gone."""
    view = _launched_view(p)
    if view is None:
        return None  # nothing to relaunch from; the running pods are tracked no more
    mutable = {k: v for k, v in (raw if isinstance(raw, dict) else {}).items() if k not in view}
    for extra in (mutable, {}):
        try:
            spec = parse_spec({**view, **extra})
            admission.bind_host_paths(spec, p.settings.policy)
            return spec
        except SpecError:
            continue
    return None


# ---- validate -----------------------------------------------------------------------------
def _accept_spec(p: Pass) -> JobSpec | None:
    """The validate stage; raises :class:`Refused` before launch. A launched job outlives a
    refused spec: it keeps running (and being tracked) with the launched values until the user
    fixes the spec, so then the refusal is only a condition (None: the launched values are gone)."""
    raw = p.body.get("spec")
    launched = _is_launched(p.status)
    try:
        spec = planning.accept(p.job.name, raw, p.settings.policy)
    except Refused as exc:
        if not launched:
            raise
        p.cond(C.COND_SPEC_ACCEPTED, FALSE, exc.reason, exc.message)
        return _launched_spec(p, raw)
    if launched:
        changed = _changed_since_launch(p, spec)
        if changed:
            p.cond(
                C.COND_SPEC_ACCEPTED,
                FALSE,
                C.R_IMMUTABLE_FIELD_CHANGED,
                f"spec fields {', '.join(changed)} cannot change after launch; the job keeps "
                "running with the launched values (revert the change, or create a new job)",
            )
            return _launched_spec(p, raw)
    # the first acceptance is no news (no Event); re-acceptance after a refusal is
    p.cond(
        C.COND_SPEC_ACCEPTED,
        TRUE,
        C.R_ACCEPTED,
        "spec is valid",
        quiet=p.cond_status(C.COND_SPEC_ACCEPTED) is None,
    )
    return spec


# ---- discover + plan ----------------------------------------------------------------------
def _stored_plan(p: Pass, spec: JobSpec) -> dict[str, Any] | None:
    """The job's plan from its ConfigMap (None: none, or one of an edited spec, deleted here)."""
    name = common.plan_configmap_name(p.job)
    # A job that never recorded a plan has none unless an operator crashed between creating it
    # and writing status: skip the read (writing the new one answers "already exists" then).
    fresh = not p.status.get("plan") and not _is_launched(p.status)
    cm = None if fresh else p.client.get_owned_configmap(p.job.namespace, name, p.job.uid)
    if cm is None:
        return None
    if _spec_hash_of(cm) == spec.immutable_hash() or _is_launched(p.status):
        plan: dict[str, Any] = json.loads(cm["data"][C.PLAN_KEY])
        summary = planning.summary(plan)
        p.status["plan"] = summary
        # level-based: the plan's existence is the truth, whatever the status says
        if p.cond_status(C.COND_TOPOLOGY) != TRUE:
            p.cond(
                C.COND_TOPOLOGY,
                TRUE,
                C.R_DISCOVERED,
                f"topology reports used for the plan: {', '.join(summary.get('nodes', []))}",
            )
        if p.cond_status(C.COND_PLANNED) != TRUE:
            p.cond(C.COND_PLANNED, TRUE, C.R_PLAN_READY, planning.describe(summary))
        return plan
    # spec edited before launch: plan again
    p.client.delete_configmap(p.job.namespace, name)
    return None


def _new_plan(
    p: Pass, spec: JobSpec, reports: dict[str, Any], found: planning.Inputs
) -> dict[str, Any]:
    """The plan stage (raises NotYet / Refused); the ConfigMap is written later in this pass."""
    cpu_memory = (
        0
        if spec.device != "CPU"
        else planning.cpu_memory_per_process(
            spec, p.client.list_nodes(), list(reports)[: spec.nodes.count]
        )
    )
    plan = planning.make_plan(
        p.client, p.job, spec, reports, cpu_memory_bytes=cpu_memory, inputs=found
    )
    # Written later in this pass: with the launch batch (one round trip fewer on the way to the
    # workers), else before the pass returns (_persist_plan).
    p.new_plan_cm = configmaps.plan_configmap(
        p.job, plan, spec.immutable_hash(), launched_spec=spec.immutable_view()
    )
    summary = planning.summary(plan)
    p.status["plan"] = summary
    p.cond(C.COND_PLANNED, TRUE, C.R_PLAN_READY, planning.describe(summary))
    return plan


def _plan_written(p: Pass, created: bool) -> None:
    """After writing ``p.new_plan_cm``: "already exists" is a plan a crashed pass wrote; the
    workers read the ConfigMap, so it must be this spec's (else it is replaced)."""
    cm, p.new_plan_cm = p.new_plan_cm, None
    if not created:
        name = cm["metadata"]["name"]
        have = p.client.get_owned_configmap(p.job.namespace, name, p.job.uid)
        if _spec_hash_of(have) != _spec_hash_of(cm):
            p.client.delete_configmap(p.job.namespace, name)
            if not p.client.create(cm):
                raise RuntimeError(f"plan ConfigMap {name} keeps reappearing while being replaced")
    _crashpoint(p, "after-plan")


def _spec_hash_of(cm: dict[str, Any] | None) -> str | None:
    """The immutable-spec hash a plan ConfigMap was made from (None: no ConfigMap or no hash)."""
    return (((cm or {}).get("metadata") or {}).get("annotations") or {}).get(C.ANNOTATION_SPEC_HASH)


def _persist_plan(p: Pass) -> None:
    if p.new_plan_cm is not None:
        _plan_written(p, p.client.create(p.new_plan_cm))


# ---- launch + track -----------------------------------------------------------------------
def _launch_children(p: Pass, spec: JobSpec) -> None:
    """What the worker pods need to exist and start, before them and at once (one round trip):
    pod admission looks the ServiceAccount up, the kubelet mounts the plan. Everything else
    follows the pods (_complete_launch)."""
    plan_cm = [p.new_plan_cm] if p.new_plan_cm is not None else []
    created = p.client.create_all([*plan_cm, rbac.service_account(p.job)])
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
                p.client.create(rbac.role(p.job))
                p.client.create_all(
                    [
                        workers.headless_service(p.job),
                        configmaps.progress_configmap(p.job),
                        configmaps.routing_stats_configmap(p.job),
                        rbac.role_binding(p.job),
                    ]
                )
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


def _regate(p: Pass, spec: JobSpec, pods: list, digest: str) -> float:
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


def _track(
    p: Pass, spec: JobSpec, plan: dict[str, Any], *, launching: bool = False
) -> float | None:
    """``launching``: this pass has just created the job's other children (first launch). The
    plan's nodes were read a moment ago and no worker pod can exist yet, except after an operator
    crash mid-launch, where creating them again answers "already exists": the node and pod
    listings and the (just seeded, empty) progress read are skipped, three round trips fewer on
    the path from apply to worker pods."""
    rank2node = planning.rank2node(plan)
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
    if launching:
        _no_progress_yet(p)
    else:
        _progress(p)
        sizing.status(p.status, plan)  # measured vs predicted tokens/s

    left = machine.seconds_left(
        parse_time(p.status.get("startTime")), p.now, spec.run_policy.active_deadline_seconds
    )
    if left is not None and left <= 0 and d.action != "succeed":
        _delete(p, [x for x in pods if not x.deleting])
        p.fail(
            C.R_DEADLINE_EXCEEDED,
            f"the job was active longer than activeDeadlineSeconds="
            f"{spec.run_policy.active_deadline_seconds}",
        )
        return _finished(p)

    if d.action == "fail":
        _delete(p, d.delete)
        p.fail(d.reason, d.message)
        return _finished(p)
    if d.action == "succeed":
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
        pods_to_create = workers.worker_pods(
            p.job,
            sizing.sized_spec(spec, plan),
            rank2node,
            attempt=attempt,
            spec_hash=h,
            extra_env=extra_env,
            node_ranks=list(d.create_ranks),
            image=gate.worker_image(spec, p.status),  # the verified digest: no tag drift
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
    return min(left, 60.0) if left is not None else None


def _delete(p: Pass, pods: list[machine.PodView]) -> None:
    for pod in pods:
        p.client.delete_pod(p.job.namespace, pod.name, uid=pod.uid)


def _progress(p: Pass) -> None:
    try:
        cm = p.client.get_owned_configmap(
            p.job.namespace, common.progress_configmap_name(p.job), p.job.uid
        )
    except ChildConflict:
        cm = None  # a squatted progress ConfigMap is no report (the launch reports the conflict)
    raw = ((cm or {}).get("data") or {}).get(C.PROGRESS_KEY)
    if not raw:
        _no_progress_yet(p)
        return
    try:
        doc = parse_progress(raw)
    except DocumentError:
        return
    p.status["progress"] = machine.progress_status(doc)
    inputs.exported(p, doc)
    findings = machine.health_findings(doc)
    warnings = [f for f in findings if f["severity"] == "Warning"]
    old = {(f["type"], f["message"]) for f in p.status.get("health") or ()}
    for f in warnings:
        if (f["type"], f["message"]) not in old:
            p.event("Warning", f["type"], f["message"])
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


# ---- finish -------------------------------------------------------------------------------
def _finished(p: Pass) -> float | None:
    try:
        ttl = parse_spec(p.body.get("spec")).run_policy.ttl_seconds_after_finished
    except SpecError:
        ttl = None
    left = machine.seconds_left(parse_time(p.status.get("completionTime")), p.now, ttl)
    if left is None:
        return None
    if left <= 0:
        p.event("Normal", "TTLExpired", f"deleting the job {ttl}s after it finished")
        p.flush()
        p.client.delete_job(p.job.namespace, p.job.name)
        return None
    return left
