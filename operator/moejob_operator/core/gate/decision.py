"""The gate's decision for one job, pure: the smoke Job as observed, the verdict to store, what to
do next (:func:`decide`); :mod:`moejob_operator.reconcile.gate` does the API calls around it.

Verdicts are stored cluster-wide, one ConfigMap per identity in the operator's namespace, and
expire (passes after 7 days, failures after 1 hour by default). One smoke Job per identity and
attempt, with a name derived from the identity, so jobs asking at the same time share it.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any, TypeGuard

from moe_contracts.errors import DocumentError
from moe_contracts.gate import (
    VERDICT_KIND,
    VERDICT_VERSION,
    expected_checks,
    parse_smoke_verdict,
    parse_time,
)

from .config import GateConfig
from .identity import Identity, digest_of, smoke_job_name
from .messages import (
    R_SMOKE_TEST_RUNNING,
    from_record,
    hardware_mismatch,
)

WAIT_SECONDS = 5.0  # "not yet" delay while the smoke Job runs


# ---- the smoke Job as observed ----------------------------------------------------------------
@dataclass(frozen=True)
class SmokeObservation:
    """The smoke Job and its pod, reduced to what the decision needs."""

    name: str
    finished: bool  # the Job is Complete/Failed, or its pod terminated
    exit_code: int | None = None
    message: str | None = None  # the container's termination message (the compact verdict)
    reason: str | None = None  # pod/Job failure reason (OOMKilled, DeadlineExceeded, ...)
    image_id: str | None = None  # containerStatuses[].imageID: the digest actually run
    pod_phase: str | None = None
    finished_at: str | None = None  # when the smoke run ended (the verdict's age counts from here)


def observe(job: dict[str, Any] | None, pods: list[dict[str, Any]]) -> SmokeObservation | None:
    """From a batch/v1 Job and its pods (newest last wins); None when there is no Job."""
    if job is None:
        return None
    status = job.get("status") or {}
    conds = {c.get("type"): c for c in status.get("conditions") or () if c.get("status") == "True"}
    obs = {"name": job["metadata"]["name"], "finished": "Complete" in conds or "Failed" in conds}
    if "Failed" in conds:
        obs["reason"] = conds["Failed"].get("reason") or "Failed"
        obs["message"] = conds["Failed"].get("message")
    for c in conds.values():
        obs["finished_at"] = c.get("lastTransitionTime") or obs.get("finished_at")
    obs["finished_at"] = status.get("completionTime") or obs.get("finished_at")
    for pod in sorted(pods, key=lambda p: p["metadata"].get("creationTimestamp") or ""):
        pst = pod.get("status") or {}
        for cs in pst.get("containerStatuses") or ():
            term = (cs.get("state") or {}).get("terminated")
            obs["image_id"] = cs.get("imageID") or obs.get("image_id")
            obs["pod_phase"] = pst.get("phase")
            if term is not None:
                obs.update(
                    finished=True,
                    exit_code=term.get("exitCode"),
                    message=term.get("message"),
                    reason=term.get("reason") or obs.get("reason"),
                    finished_at=term.get("finishedAt") or obs.get("finished_at"),
                )
    return SmokeObservation(**obs)


# ---- decisions ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Decision:
    """`action`: none (use the status) | create_job (start `job_name`, wait) | wait | record
    (store `record`, then use the status). `status`/`reason`/`message` go into UpgradeVerified."""

    action: str
    status: str
    reason: str
    message: str
    job_name: str | None = None
    record: dict[str, Any] | None = None
    retry_seconds: float | None = None
    stale_job: str | None = None  # the previous attempt's Job, to delete when starting anew


def _iso(t: dt.datetime) -> str:
    return t.astimezone(dt.UTC).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def is_current(
    stored: dict[str, Any] | None, identity: Identity, now: dt.datetime
) -> TypeGuard[dict[str, Any]]:
    """A stored verdict counts when it is about this identity and has not expired."""
    return (
        stored is not None
        and stored.get("identity", {}).get("key") == identity.key
        and parse_time(stored["expiresAt"]) > now
    )


def verdict_from_observation(
    identity: Identity,
    obs: SmokeObservation,
    attempt: int,
    now: dt.datetime,
    config: GateConfig,
    cases: list[str] | None = None,
) -> dict[str, Any]:
    """The GateVerdict to store for a finished smoke Job; ``cases``: the names of the plans the
    Job was given (a pass must report every check of every one of them)."""
    smoke = None
    problem = None
    if obs.message:
        try:
            smoke = parse_smoke_verdict(obs.message)
        except DocumentError as exc:
            problem = str(exc)
    if smoke is None:
        why = [f"exit code {obs.exit_code}" if obs.exit_code is not None else "no exit code"]
        if obs.reason:
            why.append(f"reason {obs.reason}")
        tail = (obs.message or "").strip()[-300:]
        failed = None
        text = (
            f"the smoke pod left no verdict ({', '.join(why)})"
            + (f": {problem}" if problem else "")
            + (f"; last output: {tail}" if tail and not problem else "")
        )
        smoke = {
            "passed": False,
            "failedCheck": None,
            "checks": [],
            "exception": None,
            "versions": {},
            "durationSeconds": None,
            "message": text,
        }
    else:
        failed = smoke["failedCheck"]
        smoke = dict(
            smoke,
            message=next(
                (
                    c["message"]
                    for c in smoke["checks"]
                    if c["name"] == failed and c.get("case") == smoke.get("failedCase")
                ),
                None,
            )
            if failed
            else "all checks passed",
        )
    passed = bool(smoke["passed"]) and obs.exit_code in (0, None)
    if smoke["passed"] and obs.exit_code not in (0, None):
        smoke["message"] = (
            f"the verdict says passed but the smoke pod exited with code {obs.exit_code}"
        )
    reported = (smoke.get("versions") or {}).get("deepspeed")
    if passed and identity.deepspeed_version and reported != identity.deepspeed_version:
        passed = False
        smoke["failedCheck"] = "imports"
        smoke["message"] = (
            f"the image reports deepspeed {reported}, the spec declares "
            f"{identity.deepspeed_version}"
        )
    ran_on = (smoke.get("versions") or {}).get("device")
    if passed and identity.device == "GPU" and ran_on != "cuda":
        passed = False
        smoke["failedCheck"] = "imports"
        smoke["message"] = (
            f"a GPU identity was tested on {ran_on or 'an unknown device'}, not on a GPU"
        )
    mismatch = (
        hardware_mismatch(identity, smoke.get("versions") or {})
        if identity.device == "GPU"
        else None
    )
    if passed and mismatch:
        passed = False
        smoke["failedCheck"] = "imports"
        smoke["message"] = mismatch
    want = expected_checks(list(cases)) if cases else None
    got = [(c["name"], c.get("case")) for c in smoke.get("checks") or ()]
    if passed and want is not None and got != want:
        passed = False
        missing = [f"{n}[{c}]" if c else n for n, c in want if (n, c) not in got]
        smoke["message"] = f"the verdict does not report every check of the cases {cases}" + (
            f" (missing {missing[:6]})" if missing else f": reported {len(got)} of {len(want)}"
        )
    ttl = config.pass_ttl_seconds if passed else config.fail_ttl_seconds
    verified = min(now, parse_time(obs.finished_at)) if obs.finished_at else now
    return {
        "kind": VERDICT_KIND,
        "version": VERDICT_VERSION,
        "identity": identity.to_doc(),
        "attempt": attempt,
        "passed": passed,
        "failedCheck": None if passed else smoke.get("failedCheck"),
        "failedCase": None if passed else smoke.get("failedCase"),
        "message": smoke["message"],
        "exception": None if passed else smoke.get("exception"),
        "versions": smoke.get("versions") or {},
        "durationSeconds": smoke.get("durationSeconds"),
        "observedDigest": digest_of(obs.image_id),
        "golden": smoke.get("golden") if passed else None,
        "goldenDrift": smoke.get("goldenDrift"),
        "smokeJob": obs.name,
        "verifiedAt": _iso(verified),
        "expiresAt": _iso(verified + dt.timedelta(seconds=ttl)),
    }


def decide(
    identity: Identity,
    stored: dict[str, Any] | None,
    obs: SmokeObservation | None,
    now: dt.datetime,
    config: GateConfig,
    *,
    waited: bool = False,
    cases: list[str] | None = None,
) -> Decision:
    """One gate decision for one job.

    stored: the current GateVerdict in the store (None: none, or unreadable); obs: the smoke Job
    of attempt `stored.attempt + 1` (the one this identity would run next), None when absent;
    waited: this job was waiting for a smoke test (its condition said SmokeTestRunning), so a
    verdict now is the one it waited for (SmokeTestPassed), not an earlier one (CachedVerdict);
    cases: the names of the smoke plans the Job runs (:mod:`.smoke_plans`).
    """
    if is_current(stored, identity, now):
        status, reason, message = from_record(
            stored, identity, fresh=waited, namespace=config.namespace
        )
        return Decision("none", status, reason, message)
    attempt = (
        int(stored["attempt"]) + 1
        if stored and stored.get("identity", {}).get("key") == identity.key
        else 1
    )
    job = smoke_job_name(identity, attempt)
    if obs is None:
        return Decision(
            "create_job",
            "Unknown",
            R_SMOKE_TEST_RUNNING,
            f"started smoke-test Job {config.namespace}/{job} for {identity.describe()}; "
            "the job launches when it passes",
            job_name=job,
            retry_seconds=WAIT_SECONDS,
            stale_job=smoke_job_name(identity, attempt - 1) if attempt > 1 else None,
        )
    if not obs.finished:
        return Decision(
            "wait",
            "Unknown",
            R_SMOKE_TEST_RUNNING,
            f"waiting for smoke-test Job {config.namespace}/{job} ({identity.describe()}"
            f"{'; pod ' + obs.pod_phase if obs.pod_phase else ''})",
            job_name=job,
            retry_seconds=WAIT_SECONDS,
        )
    rec = verdict_from_observation(identity, obs, attempt, now, config, cases)
    if parse_time(rec["expiresAt"]) <= now:
        # a Job left from an expired verdict (the ConfigMap was deleted): store it to remember the
        # attempt, and test again under the next attempt's name
        nxt = smoke_job_name(identity, attempt + 1)
        return Decision(
            "create_job",
            "Unknown",
            R_SMOKE_TEST_RUNNING,
            f"started smoke-test Job {config.namespace}/{nxt} for {identity.describe()} (the "
            f"verdict of {job} expired); the job launches when it passes",
            job_name=nxt,
            record=rec,
            retry_seconds=WAIT_SECONDS,
            stale_job=job,
        )
    status, reason, message = from_record(rec, identity, fresh=True, namespace=config.namespace)
    return Decision("record", status, reason, message, job_name=job, record=rec)
