"""The state of one reconcile pass over a MoETrainingJob (:class:`Pass`: the job, its status
being rewritten, the Events to post) and the steps every stage shares: test crash points, the
launch markers in status, a child-name conflict, the finished job's TTL."""

from __future__ import annotations

import copy
import datetime as dt
import logging
from typing import TYPE_CHECKING, Any

from .. import admission
from .. import constants as C
from ..builders import common
from ..spec import SpecError, parse_spec
from ..status import FALSE, TRUE, event_type_for, now_iso, parse_time, phase_of, set_condition
from . import machine
from .client import ChildConflict, Client
from .settings import Settings

if TYPE_CHECKING:
    from .planning import PlanMemo

log = logging.getLogger("moejob_operator")


def _crashpoint(p: Pass, point: str) -> None:
    """Test hook (``moe_faults.crashpoint``, test mode only): the operator process may exit here."""
    faults = admission.test_faults(p.settings.policy)
    if faults is not None:
        faults.crashpoint(point)


class Pass:
    """The status being built during one pass; flushed once at the end."""

    def __init__(
        self,
        client: Client,
        body: dict[str, Any],
        now: dt.datetime,
        settings: Settings,
        plan_memo: PlanMemo | None = None,
    ):
        self.client, self.body, self.now = client, body, now
        self.settings = settings
        self.plan_memo = plan_memo  # the Controller's plans by input (None: plan every time)
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
        # spec.placement.replan: the PlacementUpdate ConfigMap a launch seeds (generation 0)
        self.placement_cm: dict[str, Any] | None = None

    def cond(
        self,
        ctype: str,
        status: str,
        reason: str,
        message: str,
        *,
        quiet: bool = False,
        field: str | None = None,
    ) -> None:
        conds, transition = set_condition(
            self.status.get("conditions"),
            ctype,
            status,
            reason,
            message,
            generation=self.generation,
            now=now_iso(self.now),
            field=field,
        )
        self.status["conditions"] = conds
        if transition is not None and not quiet:
            self.events.append((event_type_for(transition), reason, message))

    def cond_status(self, ctype: str) -> str | None:
        for c in self.status.get("conditions") or ():
            if c.get("type") == ctype:
                status: str | None = c.get("status")
                return status
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

    def fail(self, reason: str, message: str, field: str | None = None) -> None:
        """Failed=True (``field``: the spec field to change, when one is to blame)."""
        self.cond(C.COND_FAILED, TRUE, reason, message, field=field)
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
        ("foreignPods", list),
        ("healthDigest", str),
        ("launchedFields", dict),
        ("model", dict),
        ("data", dict),
        ("output", dict),
        ("replan", dict),
        ("placementHistory", list),
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


def _is_launched(status: dict[str, Any]) -> bool:
    """The workers were launched: ``launchedSpecHash`` (or, from operators before it, a
    ``launchedSpec`` copy of the spec; anything else there is not trusted)."""
    return isinstance(status.get("launchedSpecHash"), str) or (
        isinstance(status.get("launchedSpec"), dict) and bool(status["launchedSpec"])
    )


def _status_int(p: Pass, key: str) -> int | None:
    value = p.status.get(key, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


CONFLICT_RETRY_SECONDS = 30.0


def _conflict(p: Pass, exc: ChildConflict) -> float:
    """A child's name taken by an object this job does not control: reported, never used or
    deleted; the pass runs again later (its owner may remove it)."""
    log.warning("%s/%s: %s", p.job.namespace, p.job.name, exc)
    p.launched = False  # nothing more to create this pass
    p.cond(C.COND_RECONCILED, FALSE, C.R_CHILD_CONFLICT, str(exc))
    return CONFLICT_RETRY_SECONDS


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
