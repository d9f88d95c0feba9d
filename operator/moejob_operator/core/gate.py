"""The DeepSpeed upgrade gate, pure: what is verified, the verdicts, when they expire, what to do.

A job may launch only on an *identity* that passed the smoke test (`moe-smoke`, docs/gate.md) on
this cluster: the trainer image (its digest when the reference pins one), the DeepSpeed version the
spec declares, and the device kind (a CPU pass says nothing about CUDA kernels). Verdicts are
stored cluster-wide, one ConfigMap per identity in the operator's namespace, and expire (passes
after 7 days, failures after 1 hour by default). One smoke Job per identity and attempt, with a
name derived from the identity, so jobs asking at the same time share it.

The documents (SmokeVerdict, GateVerdict) are read by :mod:`moe_contracts.gate`. Everything
here works on plain dicts and dataclasses; :mod:`moejob_operator.reconcile.gate` does
the API calls around :func:`decide`.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from moe_contracts import env
from moe_contracts.errors import DocumentError
from moe_contracts.gate import (
    VERDICT_KIND,
    VERDICT_VERSION,
    expected_checks,
    parse_smoke_verdict,
    parse_time,
)

# Condition reasons of UpgradeVerified (besides GateSkipped / GateNotConfigured in constants.py)
R_SMOKE_TEST_RUNNING = "SmokeTestRunning"
R_SMOKE_TEST_PASSED = "SmokeTestPassed"
R_SMOKE_TEST_FAILED = "SmokeTestFailed"
R_CACHED_VERDICT = "CachedVerdict"
R_IMAGE_DIGEST_CHANGED = (
    "ImageDigestChanged"  # a tag-only image's pods run other bits than the verdict's
)

VERDICT_KEY = env.VERDICT_KEY  # ConfigMap data key of the stored verdict
STORE_PREFIX = "moe-gate-"  # ConfigMap moe-gate-<key>
SMOKE_JOB_PREFIX = "moe-smoke-"  # Job moe-smoke-<key>-<attempt>
LABEL_GATE_KEY = "moe-operator.io/gate-key"

DEFAULT_PASS_TTL_SECONDS = 7 * 24 * 3600
DEFAULT_FAIL_TTL_SECONDS = 3600
DEFAULT_SMOKE_DEADLINE_SECONDS = (
    1800  # the smoke Job's activeDeadlineSeconds (image pull + JIT + run)
)
WAIT_SECONDS = 5.0  # "not yet" delay while the smoke Job runs

_DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
_TRUE = ("1", "true", "yes", "on", "enabled")


class GateError(DocumentError):
    """A gate setting is invalid (the documents' errors are ``moe_contracts``' DocumentError)."""


# ---- settings ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class GateConfig:
    """Operator-wide gate settings (Helm values -> env of the operator pod)."""

    enabled: bool = True
    namespace: str = "default"  # where verdicts and smoke Jobs live
    pass_ttl_seconds: int = DEFAULT_PASS_TTL_SECONDS
    fail_ttl_seconds: int = DEFAULT_FAIL_TTL_SECONDS
    deadline_seconds: int = DEFAULT_SMOKE_DEADLINE_SECONDS
    command: tuple[str, ...] | None = None  # replaces `moe-smoke` (dev clusters, tests)
    extra_args: tuple[str, ...] = ()
    node_selector: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_env(cls, env: Mapping[str, str], *, default_namespace: str = "default") -> GateConfig:
        """MOE_GATE_ENABLED, MOE_OPERATOR_NAMESPACE (else POD_NAMESPACE), MOE_GATE_PASS_TTL_SECONDS,
        MOE_GATE_FAIL_TTL_SECONDS, MOE_GATE_DEADLINE_SECONDS, MOE_GATE_SMOKE_COMMAND (JSON list),
        MOE_GATE_SMOKE_EXTRA_ARGS (JSON list), MOE_GATE_NODE_SELECTOR (JSON object)."""

        def seconds(name: str, default: int) -> int:
            raw = env.get(name)
            if raw is None or raw == "":
                return default
            if not raw.isdigit() or int(raw) < 1:
                raise GateError(f"{name}: {raw!r} is not a positive number of seconds")
            return int(raw)

        def json_env(name: str, typ: type[list[Any]] | type[dict[str, Any]]) -> Any:
            raw = env.get(name)
            if not raw:
                return None
            try:
                value = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise GateError(f"{name}: {raw!r} is not JSON ({exc.msg})") from None
            ok = isinstance(value, typ) and all(
                isinstance(x, str) for x in (value.values() if isinstance(value, dict) else value)
            )
            if not ok:
                raise GateError(
                    f"{name}: {raw!r} is not a JSON {'object' if typ is dict else 'list'} of "
                    "strings"
                )
            return value

        command = json_env("MOE_GATE_SMOKE_COMMAND", list)
        if command is not None and not command:
            raise GateError("MOE_GATE_SMOKE_COMMAND: an empty command")
        return cls(
            enabled=env.get("MOE_GATE_ENABLED", "true").strip().lower() in _TRUE,
            namespace=env.get("MOE_OPERATOR_NAMESPACE")
            or env.get("POD_NAMESPACE")
            or default_namespace,
            pass_ttl_seconds=seconds("MOE_GATE_PASS_TTL_SECONDS", DEFAULT_PASS_TTL_SECONDS),
            fail_ttl_seconds=seconds("MOE_GATE_FAIL_TTL_SECONDS", DEFAULT_FAIL_TTL_SECONDS),
            deadline_seconds=seconds("MOE_GATE_DEADLINE_SECONDS", DEFAULT_SMOKE_DEADLINE_SECONDS),
            command=tuple(command) if command else None,
            extra_args=tuple(json_env("MOE_GATE_SMOKE_EXTRA_ARGS", list) or ()),
            node_selector=dict(json_env("MOE_GATE_NODE_SELECTOR", dict) or {}),
        )


# ---- identity ---------------------------------------------------------------------------------
def digest_of(reference: str | None) -> str | None:
    """The `sha256:<64 hex>` in an image reference or a pod's `imageID`
    (`docker-pullable://repo@sha256:...`, `repo@sha256:...`, `sha256:...`), else None."""
    m = _DIGEST_RE.search(reference or "")
    return m.group(0) if m else None


def repository_of(image: str) -> str:
    """`registry:5000/team/trainer:1.2@sha256:..` -> `registry:5000/team/trainer`."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    if ":" in last:
        name = name[: len(name) - len(last)] + last.split(":", 1)[0]
    return name


@dataclass(frozen=True)
class Identity:
    """What one verdict vouches for."""

    image: str  # the reference as the spec writes it
    digest: str | None  # pinned by the reference (`@sha256:`), else None
    deepspeed_version: str | None  # declared in the spec; None = whatever the image holds
    device: str  # "GPU" | "CPU"
    # GPU verdicts only, from the plan's `hardware` (discovery): what the kernels depend on
    gpu_model: str | None = None  # "NVIDIA H200"
    compute_capability: str | None = None  # "9.0"
    cuda_major: str | None = None  # major of the driver's CUDA version: "12"

    @property
    def subject(self) -> str:
        """What the key hashes: a pinned digest stands for the image whatever tag is written."""
        return f"{repository_of(self.image)}@{self.digest}" if self.digest else self.image

    @property
    def key(self) -> str:
        fields: dict[str, str | list[str]] = {
            "image": self.subject,
            "deepspeed": self.deepspeed_version or "",
            "device": self.device,
        }
        if self.device == "GPU":
            fields["gpu"] = [
                self.gpu_model or "",
                self.compute_capability or "",
                self.cuda_major or "",
            ]
        blob = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def describe(self) -> str:
        ds = (
            f"deepspeed {self.deepspeed_version}"
            if self.deepspeed_version
            else "deepspeed (undeclared)"
        )
        return f"image {self.image}, {ds}, {self.device}{self.hardware()}"

    def hardware(self) -> str:
        if self.device != "GPU" or not (
            self.gpu_model or self.compute_capability or self.cuda_major
        ):
            return ""
        parts = [
            p
            for p in (
                self.compute_capability and f"compute capability {self.compute_capability}",
                self.cuda_major and f"CUDA {self.cuda_major}",
            )
            if p
        ]
        return f" {self.gpu_model or 'unknown GPU'}" + (f" ({', '.join(parts)})" if parts else "")

    def to_doc(self) -> dict[str, Any]:
        doc = {
            "image": self.image,
            "digest": self.digest,
            "deepspeedVersion": self.deepspeed_version,
            "device": self.device,
            "key": self.key,
        }
        if self.device == "GPU":
            doc.update(
                gpuModel=self.gpu_model,
                computeCapability=self.compute_capability,
                cudaMajor=self.cuda_major,
            )
        return doc


def identity_for(
    image: str,
    deepspeed_version: str | None,
    device: str,
    hardware: Mapping[str, Any] | None = None,
) -> Identity:
    """``hardware``: the plan's `hardware` block (`gpu`, `computeCapability`, `cudaDriverVersion`),
    which GPU verdicts are keyed by; ignored for CPU."""
    if device not in ("GPU", "CPU"):
        raise GateError(f"device: {device!r} is not GPU or CPU")
    if not image:
        raise GateError("image: empty image reference")
    hw = dict(hardware or {}) if device == "GPU" else {}
    cuda = str(hw.get("cudaDriverVersion") or "").split(".")[0] or None
    return Identity(
        image=image,
        digest=digest_of(image),
        deepspeed_version=deepspeed_version,
        device=device,
        gpu_model=hw.get("gpu") or None,
        compute_capability=hw.get("computeCapability") or None,
        cuda_major=cuda,
    )


def pinned(identity: Identity, digest: str) -> Identity:
    """The identity of the bits a pod actually ran: the image pinned to ``digest``."""
    return Identity(
        image=f"{repository_of(identity.image)}@{digest}",
        digest=digest,
        deepspeed_version=identity.deepspeed_version,
        device=identity.device,
        gpu_model=identity.gpu_model,
        compute_capability=identity.compute_capability,
        cuda_major=identity.cuda_major,
    )


def store_name(identity: Identity) -> str:
    return f"{STORE_PREFIX}{identity.key}"


def smoke_job_name(identity: Identity, attempt: int) -> str:
    """Deterministic: every job that needs this identity verified names the same Job."""
    return f"{SMOKE_JOB_PREFIX}{identity.key}-{attempt}"


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


def failure_text(doc: dict[str, Any]) -> str:
    """`check 'numerics' of case 'mixtral' failed: <message>; exception: <last line>`."""
    check, case = doc.get("failedCheck"), doc.get("failedCase")
    msg = doc.get("message") or next(
        (
            c["message"]
            for c in doc.get("checks") or ()
            if c.get("name") == check and c.get("case") == case
        ),
        "",
    )
    where = f"check '{check}'" + (f" of case '{case}'" if case else "")
    head = f"{where} failed: {msg}" if check else f"smoke test failed: {msg}"
    exc = (doc.get("exception") or "").strip().splitlines()
    if exc and exc[-1] not in msg:
        head += f"; exception: {exc[-1][:300]}"
    return head


def _hardware_mismatch(identity: Identity, versions: Mapping[str, Any]) -> str | None:
    """Why a GPU verdict does not vouch for ``identity``'s GPU (None: it does)."""
    ran = {
        "GPU model": versions.get("gpu"),
        "compute capability": versions.get("computeCapability"),
        "CUDA major": str(versions.get("cudaDriver") or "").split(".")[0] or None,
    }
    want = {
        "GPU model": identity.gpu_model,
        "compute capability": identity.compute_capability,
        "CUDA major": identity.cuda_major,
    }
    bad = [
        f"{k} {ran[k] or 'unknown'} (identity: {want[k]})"
        for k in want
        if want[k] and ran[k] != want[k] and (ran[k] is not None or k != "CUDA major")
    ]
    return f"the smoke test ran on other hardware: {', '.join(bad)}" if bad else None


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
        _hardware_mismatch(identity, smoke.get("versions") or {})
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
        "smokeJob": obs.name,
        "verifiedAt": _iso(verified),
        "expiresAt": _iso(verified + dt.timedelta(seconds=ttl)),
    }


def _from_record(
    rec: dict[str, Any], identity: Identity, *, fresh: bool, namespace: str
) -> tuple[str, str, str]:
    vs = rec.get("versions") or {}
    stack = ", ".join(
        f"{k} {vs[k]}" for k in ("deepspeed", "torch", "transformers", "cuda") if vs.get(k)
    )
    where = f"smoke Job {rec.get('smokeJob')} at {rec['verifiedAt']}"
    if rec["passed"]:
        reason = R_SMOKE_TEST_PASSED if fresh else R_CACHED_VERDICT
        digest = f" (digest {rec['observedDigest']})" if rec.get("observedDigest") else ""
        return (
            "True",
            reason,
            (
                f"{identity.describe()}{digest} passed the smoke test ({stack}; {where}; "
                f"valid until {rec['expiresAt']})"
            ),
        )
    return (
        "False",
        R_SMOKE_TEST_FAILED,
        (
            f"{identity.describe()}: {failure_text(rec)} ({where}"
            f"{'; cached' if not fresh else ''}; tested again after "
            f"{rec['expiresAt']}, or now after `kubectl -n {namespace} delete job "
            f"{rec.get('smokeJob')} configmap {store_name(identity)}`)"
        ),
    )


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
        status, reason, message = _from_record(
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
    status, reason, message = _from_record(rec, identity, fresh=True, namespace=config.namespace)
    return Decision("record", status, reason, message, job_name=job, record=rec)


# ---- skipping ----------------------------------------------------------------------------------
def skip_audit(body: dict[str, Any]) -> str:
    """Who set `spec.gate.skip` and when, from managedFields (the API server records the field
    manager of every field); '' when unknown."""
    found = []
    for entry in (body.get("metadata") or {}).get("managedFields") or ():
        fields = entry.get("fieldsV1") or {}
        if "f:skip" in ((fields.get("f:spec") or {}).get("f:gate") or {}):
            found.append(entry)
    if not found:
        return ""
    e = max(found, key=lambda x: x.get("time") or "")
    return (
        f"set by {e.get('manager', 'unknown')} ({e.get('operation', '?')}) at {e.get('time', '?')}"
    )


def skip_message(identity: Identity, reason: str, audit: str) -> str:
    return f"upgrade gate skipped for {identity.describe()}: {reason}" + (
        f" ({audit})" if audit else ""
    )
