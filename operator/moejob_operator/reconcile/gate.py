"""The DeepSpeed upgrade gate, as seen by the reconcile loop: read the verdict store and the
smoke-test Job, decide (:func:`moejob_operator.core.gate.decide`), then create the Job or store
the verdict. The reconcile loop calls :func:`check` before launching workers: it returns
:class:`Verified` (``UpgradeVerified=True``) or raises :class:`~.outcome.NotYet` (``Unknown``:
a smoke test to wait for, with a delay) or :class:`~.outcome.Refused` (``False``: the launch is
blocked).

For a tag-only image whose runtime reports digests, a pass also names the build: before launch
:func:`check` resolves the tag on the gang's nodes (:mod:`.digests`), gates a digest the tag moved
to, lets the tag's verdict follow a pass or revokes it on a failure, and stops at different
builds on different nodes (:mod:`moejob_operator.core.gate.digests`); the workers then run
``repo@digest`` (:func:`worker_image`).

Concurrency: the Job name and the ConfigMap name derive from the identity, so two jobs asking at
once create one Job ("already exists" = share it) and write the same verdict (create, or replace
an older attempt under its resourceVersion; a conflict means someone else just wrote it).
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass
from typing import Any

from kubernetes.client.exceptions import ApiException

from moe_contracts.plan import MoEPlan

from .. import constants as C
from .. import metrics
from ..builders import smoke as B
from ..core import gate as G
from ..core import smoke_plans as SP
from ..core.dsconfig import GpuCaps
from ..core.gate import digests as GD
from ..core.gate import golden as GG
from ..spec import JobSpec
from ..status import get_condition
from . import digests as probes
from .client import Client
from .gate_store import SMOKE_JOB_KEEP_SECONDS, GateConflict, Store, sweep_smoke_jobs
from .outcome import NotYet, Refused

__all__ = ["SMOKE_JOB_KEEP_SECONDS", "Store", "Verified", "check", "sweep_smoke_jobs"]

log = logging.getLogger("moejob_operator")

R_GATE_MISCONFIGURED = "GateMisconfigured"
R_IMAGE_DIGEST_CHANGED = G.R_IMAGE_DIGEST_CHANGED
R_RESOLVING_IMAGE = "ResolvingImageDigest"  # the probe pods have not all reported yet
R_SMOKE_JOB_CONFLICT = "SmokeJobConflict"  # a Job / plans of the smoke test's name not the gate's


DEFAULT_WAIT_SECONDS = 10.0  # a smoke test to wait for, when the decision names no delay


@dataclass(frozen=True)
class Verified:
    """``UpgradeVerified=True``: the job may launch."""

    reason: str
    message: str
    digest: str | None = None  # the digest the verdict's smoke pod ran (tag-only images)


def _previous(job: dict[str, Any]) -> dict[str, Any]:
    conditions = (job.get("status") or {}).get("conditions")
    return get_condition(conditions, C.COND_UPGRADE_VERIFIED) or {}


def identity_of(job: dict[str, Any], spec: JobSpec, plan: MoEPlan | None) -> G.Identity:
    """The job's gate identity: image, declared DeepSpeed, device, and for GPUs the hardware of
    its plan; pinned to the digest its pods ran when that differed from a verdict's
    (``status.gateDigest``, set by :func:`digest_changed`)."""
    identity = G.identity_for(
        spec.image, spec.deepspeed_version, spec.device, plan.hardware if plan else None
    )
    pin = (job.get("status") or {}).get("gateDigest")
    return G.pinned(identity, pin) if pin and not identity.digest else identity


def check(
    client: Client,
    job: dict[str, Any],
    spec: JobSpec,
    now: dt.datetime | None = None,
    config: G.GateConfig | G.GateError | None = None,
    plan: MoEPlan | None = None,
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
    store = Store(client, config.namespace)
    tag = identity_of({}, spec, plan)
    try:
        try:
            verified = _decide_and_act(store, job, spec, identity, prev, now, config, plan)
        except Refused:
            if identity.key != tag.key:  # a digest the tag's pods ran failed: revoke the tag's pass
                store.revoke(tag, store.read(identity), now, config)
            raise
        if identity.key != tag.key:
            store.follow(tag, store.read(identity))
            return verified
        if identity.digest or not verified.digest or not plan:
            return verified
        return _resolve_tag(store, job, spec, tag, verified, prev, now, config, plan)
    except GateConflict as exc:
        raise NotYet(R_SMOKE_JOB_CONFLICT, str(exc), 30.0) from None
    except ApiException as exc:
        raise NotYet(
            C.R_GATE_PENDING,
            f"cannot use the verdict store / smoke Jobs in namespace "
            f"{config.namespace}: {exc.status} {exc.reason}",
            30.0,
        ) from None


def _smoke_plans(identity: G.Identity, plan: MoEPlan | None) -> dict[str, Any]:
    """The SmokePlans for ``identity``: CPU, or the identity's GPU (bf16 from compute capability
    8.0)."""
    if identity.device == "CPU":
        return SP.smoke_plans("cpu")
    mem = plan.memory.gpu_memory_bytes if plan is not None and plan.memory is not None else 0
    return SP.smoke_plans(
        "cuda", GpuCaps(identity.gpu_model or "gpu", mem, identity.compute_capability or "8.0")
    )


def _case_names(identity: G.Identity) -> list[str]:
    return [c.name for c in (SP.CPU_CASES if identity.device == "CPU" else SP.GPU_CASES)]


def _resolve_tag(
    store: Store,
    job: dict[str, Any],
    spec: JobSpec,
    tag: G.Identity,
    verified: Verified,
    prev: dict[str, Any],
    now: dt.datetime,
    config: G.GateConfig,
    plan: MoEPlan,
) -> Verified:
    """Before launch: the build the tag means on every node of the gang (probe pods), gated."""
    nodes = plan.node_names
    r = GD.resolve(spec.image, verified.digest, probes.node_digests(store.client, job, spec, nodes))
    if r.kind == "pending":
        raise NotYet(R_RESOLVING_IMAGE, r.message, 1.0)
    if r.kind in ("unknown", "same"):
        probes.delete_probes(store.client, job)
        return verified
    if r.kind == "mixed":
        probes.delete_probes(store.client, job)
        raise NotYet(G.R_IMAGE_DIGESTS_DIFFER, r.message, GD.MIXED_RETRY_SECONDS, failed=True)
    assert r.digest is not None
    target = G.pinned(tag, r.digest)
    try:
        v = _decide_and_act(store, job, spec, target, prev, now, config, plan)
    except Refused as exc:
        store.revoke(tag, store.read(target), now, config)
        probes.delete_probes(store.client, job)
        raise Refused(
            exc.reason,
            f"{r.message}; {exc.message}; the cached pass of {spec.image} is revoked",
            exc.field,
        ) from None
    except NotYet as exc:
        raise NotYet(exc.reason, f"{r.message}: {exc.message}", exc.delay) from None
    store.follow(tag, store.read(target))
    probes.delete_probes(store.client, job)
    return Verified(v.reason, f"{r.message}; {v.message}", digest=r.digest)


def worker_image(spec: JobSpec, status: dict[str, Any]) -> str:
    """The image the workers run: ``repo@<verified digest>`` for a tag-only image whose smoke pod
    reported one (no tag drift during a gang), else ``spec.image``."""
    return GD.worker_image(spec.image, status.get("verifiedDigest"))


def _decide_and_act(
    store: Store,
    job: dict[str, Any],
    spec: JobSpec,
    identity: G.Identity,
    prev: dict[str, Any],
    now: dt.datetime,
    config: G.GateConfig,
    plan: MoEPlan | None = None,
) -> Verified:
    plans = _smoke_plans(identity, plan)
    golden_key = GG.golden_key(plans, identity)
    stored = store.read(identity)
    obs = None
    if not G.is_current(stored, identity, now):
        attempt = (
            int(stored["attempt"]) + 1
            if stored and stored["identity"].get("key") == identity.key
            else 1
        )
        obs = store.observe(G.smoke_job_name(identity, attempt), identity, config)
    d = G.decide(
        identity,
        stored,
        obs,
        now,
        config,
        waited=prev.get("reason")
        in (G.R_SMOKE_TEST_RUNNING, G.R_IMAGE_DIGEST_CHANGED, R_RESOLVING_IMAGE),
        cases=_case_names(identity),
    )
    if d.action == "create_job":
        assert d.job_name is not None, "a create_job decision names its Job"
        if d.record:
            store.write(d.record)
        if d.stale_job:
            store.delete_job(d.stale_job)
        attempt = int(d.job_name.rsplit("-", 1)[1])
        golden = store.latest_golden(golden_key, exclude=identity.key)
        store.create_plans(identity, attempt, config, plans, golden)
        node = plan.ranks[0].node if plan is not None and plan.ranks else None
        created = store.create_job(
            B.smoke_job(
                identity,
                attempt,
                config,
                node=node,
                image_pull_policy=spec.image_pull_policy,
                golden=golden is not None,
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
        assert d.record is not None, "a record decision carries its record"
        record = dict(d.record, goldenKey=golden_key)
        store.write(record)
        same_bits = GD.digest_record(record, identity)
        if same_bits is not None:  # each digest is tested once, whatever tag names it
            store.write(same_bits)
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
