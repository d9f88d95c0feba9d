"""The DeepSpeed upgrade gate, as seen by the reconcile loop: read the verdict store and the
smoke-test Job, decide (:func:`moejob_operator.core.gate.decide`), then create the Job or store
the verdict. The reconcile loop calls :func:`check` before launching workers: it returns
:class:`Verified` (``UpgradeVerified=True``) or raises :class:`~.outcome.NotYet` (``Unknown``:
a smoke test to wait for, with a delay) or :class:`~.outcome.Refused` (``False``: the launch is
blocked).

Concurrency: the Job name and the ConfigMap name derive from the identity, so two jobs asking at
once create one Job ("already exists" = share it) and write the same verdict (create, or replace
an older attempt under its resourceVersion; a conflict means someone else just wrote it).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from dataclasses import dataclass
from typing import Any

from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from moe_contracts.errors import DocumentError
from moe_contracts.gate import parse_gate_verdict

from .. import constants as C
from .. import metrics
from ..builders import smoke as B
from ..core import gate as G
from ..core import smoke_plans as SP
from ..core.dsconfig import GpuCaps
from ..spec import JobSpec
from .outcome import NotYet, Refused

log = logging.getLogger("moejob_operator")

R_GATE_MISCONFIGURED = "GateMisconfigured"
R_IMAGE_DIGEST_CHANGED = G.R_IMAGE_DIGEST_CHANGED


DEFAULT_WAIT_SECONDS = 10.0  # a smoke test to wait for, when the decision names no delay


@dataclass(frozen=True)
class Verified:
    """``UpgradeVerified=True``: the job may launch."""

    reason: str
    message: str
    digest: str | None = None  # the digest the verdict's smoke pod ran (tag-only images)


def _previous(job: dict[str, Any]) -> dict[str, Any]:
    for c in (job.get("status") or {}).get("conditions") or ():
        if c.get("type") == C.COND_UPGRADE_VERIFIED:
            return c
    return {}


def identity_of(job: dict[str, Any], spec: JobSpec, plan: dict[str, Any] | None) -> G.Identity:
    """The job's gate identity: image, declared DeepSpeed, device, and for GPUs the hardware of
    its plan; pinned to the digest its pods ran when that differed from a verdict's
    (``status.gateDigest``, set by :func:`digest_changed`)."""
    identity = G.identity_for(
        spec.image, spec.deepspeed_version, spec.device, (plan or {}).get("hardware")
    )
    pin = (job.get("status") or {}).get("gateDigest")
    return G.pinned(identity, pin) if pin and not identity.digest else identity


def check(
    client,
    job: dict[str, Any],
    spec: JobSpec,
    now: dt.datetime | None = None,
    config: G.GateConfig | G.GateError | None = None,
    plan: dict[str, Any] | None = None,
) -> Verified:
    """The gate stage: :class:`Verified`, else raises :class:`NotYet` / :class:`Refused`.
    ``config``: the operator's gate settings (:class:`~.settings.Settings`, read at start-up),
    or the error that made them invalid; None: the defaults. ``plan``: the job's MoEPlan (its
    `hardware` keys GPU verdicts; a GPU smoke Job runs on its first node)."""
    now = now or dt.datetime.now(dt.UTC)
    prev = _previous(job)
    status = job.get("status") or {}
    if (status.get("launchedSpecHash") or status.get("launchedSpec")) and prev.get(
        "status"
    ) == "True":
        # the gate guards launches: a running job keeps its verdict even when it expires meanwhile
        return Verified(
            prev.get("reason", ""), prev.get("message", ""), digest=status.get("verifiedDigest")
        )
    identity = identity_of(job, spec, plan)
    if spec.gate.skip:
        return Verified(
            C.R_GATE_SKIPPED,
            G.skip_message(identity, spec.gate.skip_reason or "", G.skip_audit(job)),
        )
    if config is None:
        config = G.GateConfig()
    if isinstance(config, G.GateError):
        raise NotYet(R_GATE_MISCONFIGURED, f"upgrade gate settings are invalid: {config}", 60.0)
    if not config.enabled:
        return Verified(
            C.R_GATE_NOT_CONFIGURED,
            f"the upgrade gate is disabled (MOE_GATE_ENABLED); "
            f"{identity.describe()} launches unverified",
        )
    try:
        return _decide_and_act(client, job, spec, identity, prev, now, config, plan)
    except ApiException as exc:
        raise NotYet(
            C.R_GATE_PENDING,
            f"cannot use the verdict store / smoke Jobs in namespace "
            f"{config.namespace}: {exc.status} {exc.reason}",
            30.0,
        ) from None


def _smoke_plans(identity: G.Identity, plan: dict[str, Any] | None) -> dict[str, Any]:
    """The SmokePlans for ``identity``: CPU, or the identity's GPU (bf16 from compute capability
    8.0)."""
    if identity.device == "CPU":
        return SP.smoke_plans("cpu")
    mem = int(((plan or {}).get("memory") or {}).get("gpuMemoryBytes") or 0)
    return SP.smoke_plans(
        "cuda", GpuCaps(identity.gpu_model or "gpu", mem, identity.compute_capability or "8.0")
    )


def _case_names(identity: G.Identity) -> list[str]:
    return [c.name for c in (SP.CPU_CASES if identity.device == "CPU" else SP.GPU_CASES)]


def _decide_and_act(
    client,
    job,
    spec: JobSpec,
    identity: G.Identity,
    prev: dict[str, Any],
    now: dt.datetime,
    config: G.GateConfig,
    plan: dict[str, Any] | None = None,
) -> Verified:
    store = Store(client, config.namespace)
    stored = store.read(identity)
    obs = None
    if not G.is_current(stored, identity, now):
        attempt = (
            int(stored["attempt"]) + 1
            if stored and stored["identity"].get("key") == identity.key
            else 1
        )
        obs = store.observe(G.smoke_job_name(identity, attempt))
    d = G.decide(
        identity,
        stored,
        obs,
        now,
        config,
        waited=prev.get("reason") in (G.R_SMOKE_TEST_RUNNING, G.R_IMAGE_DIGEST_CHANGED),
        cases=_case_names(identity),
    )
    if d.action == "create_job":
        if d.record:
            store.write(d.record)
        if d.stale_job:
            store.delete_job(d.stale_job)
        attempt = int(d.job_name.rsplit("-", 1)[1])
        store.create_plans(identity, attempt, config, _smoke_plans(identity, plan))
        node = ((plan or {}).get("ranks") or [{}])[0].get("node")
        created = store.create_job(
            B.smoke_job(
                identity, attempt, config, node=node, image_pull_policy=spec.image_pull_policy
            )
        )
        if not created:
            d = G.Decision(
                "wait",
                d.status,
                d.reason,
                d.message.replace("started", "sharing", 1),
                job_name=d.job_name,
                retry_seconds=d.retry_seconds,
            )
        log.info(
            "gate %s: %s smoke Job %s/%s",
            identity.key,
            "created" if created else "shares",
            config.namespace,
            d.job_name,
        )
    elif d.action == "record":
        store.write(d.record)
    if d.action in ("record", "none") and (prev.get("status"), prev.get("reason")) != (
        d.status,
        d.reason,
    ):
        metrics.record_smoke_verdict(
            identity.image,
            "Passed" if d.status == "True" else "Failed",
            cached=d.reason == G.R_CACHED_VERDICT or d.action == "none",
        )
    if d.status == "False":
        raise Refused(d.reason, d.message)
    if d.status != "True":
        raise NotYet(d.reason, d.message, d.retry_seconds or DEFAULT_WAIT_SECONDS)
    rec = d.record or stored or {}
    return Verified(d.reason, d.message, digest=identity.digest or rec.get("observedDigest"))


class Store:
    """Verdict ConfigMaps and smoke Jobs in the operator's namespace."""

    def __init__(self, client, namespace: str):
        self.client, self.namespace = client, namespace
        self.batch = k8s.BatchV1Api(client.api)

    def read(self, identity: G.Identity) -> dict[str, Any] | None:
        cm = self.client.get_configmap(self.namespace, G.store_name(identity))
        raw = ((cm or {}).get("data") or {}).get(G.VERDICT_KEY)
        if raw is None:
            return None
        try:
            doc = parse_gate_verdict(raw)
        except DocumentError as exc:
            log.warning(
                "ignoring unreadable verdict %s/%s: %s", self.namespace, G.store_name(identity), exc
            )
            return None
        doc["_resourceVersion"] = cm["metadata"].get("resourceVersion")
        return doc

    def write(self, record: dict[str, Any]) -> None:
        """Create, or replace a verdict of an older attempt; a newer/equal one already there
        wins."""
        if self.client.create(B.verdict_configmap(record, self.namespace)):
            return
        name = f"{G.STORE_PREFIX}{record['identity']['key']}"
        cm = self.client.get_configmap(self.namespace, name)
        try:
            old = parse_gate_verdict((cm or {}).get("data", {}).get(G.VERDICT_KEY, ""))
            if old["attempt"] >= record["attempt"]:
                return
        except DocumentError:
            pass
        body = B.verdict_configmap(
            record,
            self.namespace,
            resource_version=(cm or {}).get("metadata", {}).get("resourceVersion"),
        )
        try:
            self.client.core.replace_namespaced_config_map(
                name, self.namespace, body, _preload_content=False
            )
        except ApiException as exc:
            if exc.status not in (404, 409):  # someone else wrote it first: theirs is as good
                raise

    def observe(self, job_name: str) -> G.SmokeObservation | None:
        try:
            job = json.loads(
                self.batch.read_namespaced_job(
                    job_name, self.namespace, _preload_content=False
                ).data
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        pods = self.client.list_pods(self.namespace, {"job-name": job_name})
        return G.observe(job, pods)

    def create_plans(
        self, identity: G.Identity, attempt: int, config: G.GateConfig, plans: dict[str, Any]
    ) -> None:
        """Before the Job: its pod mounts them ("already exists": another job made the same
        ones)."""
        self.client.create(B.smoke_plans_configmap(identity, attempt, config, plans))

    def create_job(self, job: dict[str, Any]) -> bool:
        try:
            self.batch.create_namespaced_job(self.namespace, job, _preload_content=False)
            return True
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise

    def delete_job(self, name: str) -> None:
        """The Job of an earlier attempt and its plans ConfigMap."""
        try:
            self.batch.delete_namespaced_job(
                name, self.namespace, propagation_policy="Background", _preload_content=False
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
        self.client.delete_configmap(self.namespace, name)


# ---- the digest a job's pods run --------------------------------------------------------------
def pod_digests(pods: list[dict[str, Any]]) -> set[str]:
    """Digests (``status.containerStatuses[].imageID``) the worker pods' containers run."""
    return {
        d
        for pod in pods
        for cs in (pod.get("status") or {}).get("containerStatuses") or ()
        if (d := G.digest_of(cs.get("imageID")))
    }


def digest_changed(job: dict[str, Any], spec: JobSpec, pods: list[dict[str, Any]]) -> str | None:
    """For a tag-only image: the digest the job's pods report when it is not the one the verdict
    vouches for (``status.verifiedDigest``), else None. The caller re-gates on it."""
    if G.digest_of(spec.image):
        return None  # pinned: the runtime cannot run other bits
    verified = (job.get("status") or {}).get("verifiedDigest")
    if not verified:
        return None  # the smoke pod's runtime reported no digest
    other = sorted(pod_digests(pods) - {verified})
    return other[0] if other else None


# ---- cleanup of finished smoke Jobs --------------------------------------------------------
# batch/v1 Jobs on 1.20 have no ttlSecondsAfterFinished (alpha, off): the operator deletes the
# finished smoke Jobs whose verdict is stored, after this long (their pod's logs stay readable
# for a while; the verdict keeps the failing check's message and the exception).
SMOKE_JOB_KEEP_SECONDS = 3600.0


def _finished_at(job: dict[str, Any]) -> dt.datetime | None:
    status = job.get("status") or {}
    for c in status.get("conditions") or ():
        if c.get("type") in ("Complete", "Failed") and c.get("status") == "True":
            stamp = status.get("completionTime") or c.get("lastTransitionTime")
            return dt.datetime.fromisoformat(stamp) if stamp else None
    return None


def sweep_smoke_jobs(
    client,
    config: G.GateConfig | G.GateError,
    now: dt.datetime | None = None,
    *,
    keep_seconds: float | None = None,
    batch=None,
) -> list[str]:
    """Delete finished smoke Jobs whose verdict is in the store (or superseded by a later
    attempt) and that finished more than ``keep_seconds`` ago; returns their names. ``config``:
    the operator's gate settings (nothing to do when they are invalid or the gate is off)."""
    if isinstance(config, G.GateError) or not config.enabled:
        return []
    now = now or dt.datetime.now(dt.UTC)
    keep = SMOKE_JOB_KEEP_SECONDS if keep_seconds is None else keep_seconds
    store = Store(client, config.namespace)
    if batch is not None:
        store.batch = batch
    resp = store.batch.list_namespaced_job(
        config.namespace, label_selector=f"{C.LABEL_COMPONENT}=smoke", _preload_content=False
    )
    deleted = []
    for job in json.loads(resp.data)["items"]:
        name = job["metadata"]["name"]
        done = _finished_at(job)
        if done is None or (now - done).total_seconds() < keep:
            continue
        key, _, attempt = name.removeprefix(G.SMOKE_JOB_PREFIX).rpartition("-")
        if not (key and attempt.isdigit()):
            continue
        cm = client.get_configmap(config.namespace, f"{G.STORE_PREFIX}{key}")
        try:
            stored = parse_gate_verdict(((cm or {}).get("data") or {}).get(G.VERDICT_KEY, ""))
        except DocumentError:
            continue  # no verdict yet: the next job that asks records this one's
        if stored.get("smokeJob") == name or int(stored.get("attempt", 0)) > int(attempt):
            store.delete_job(name)
            deleted.append(name)
    if deleted:
        log.info(
            "gate: deleted %d finished smoke Job(s) in %s: %s",
            len(deleted),
            config.namespace,
            ", ".join(deleted),
        )
    return deleted
