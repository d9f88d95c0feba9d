"""The upgrade gate's store: verdict ConfigMaps and smoke Jobs in the operator's namespace.

One ConfigMap ``moe-gate-<key>`` per identity (the GateVerdict, and for a pass with golden values
the SmokeGolden beside it); one smoke Job and plans ConfigMap per identity and attempt. Writes are
"create, else replace an older attempt", so jobs deciding at the same time write one verdict.
Finished smoke Jobs are swept an hour after they finished, recorded or orphaned
(:func:`sweep_smoke_jobs`).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from typing import Any, cast

import urllib3
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from moe_contracts.errors import DocumentError
from moe_contracts.gate import parse_gate_verdict, parse_smoke_golden

from .. import constants as C
from ..builders import smoke as B
from ..core import gate as G
from ..core.gate import digests as GD
from ..core.gate import golden as GG
from .client import Client, controller_uid

log = logging.getLogger("moejob_operator")


class GateConflict(Exception):
    """An object in the gate's namespace has a smoke Job's (or its plans') name but is not what
    this gate made: never observed, never deleted; the jobs waiting on it report it."""


def foreign_smoke_job(
    job: dict[str, Any], config: G.GateConfig, image: str | None = None
) -> str | None:
    """Why ``job`` (named like a smoke Job) is not one this gate made, or None: its gate-key
    label must match its name, its one container run the smoke command (``config.command`` or
    ``moe-smoke``) on the plans ConfigMap of its own name, and, when ``image`` is given, that
    image. Anyone who may create Jobs in the gate's namespace can still copy all of it (then it
    runs the real smoke test); the namespace's RBAC is the boundary (docs/security.md)."""
    meta = job.get("metadata") or {}
    name = meta.get("name", "")
    key = name.removeprefix(G.SMOKE_JOB_PREFIX).rpartition("-")[0]
    if (meta.get("labels") or {}).get(G.LABEL_GATE_KEY) != key:
        return "its gate-key label does not match its name"
    pod = (((job.get("spec") or {}).get("template") or {}).get("spec")) or {}
    containers = pod.get("containers") or []
    if len(containers) != 1:
        return f"it runs {len(containers)} containers, not the smoke container"
    c = containers[0]
    if list(c.get("command") or ()) != list(config.command or B.SMOKE_COMMAND):
        return f"its command is {c.get('command')}, not the smoke test's"
    if image is not None and c.get("image") != image:
        return f"it runs image {c.get('image')!r}, not {image!r}"
    plans = [v for v in pod.get("volumes") or () if v.get("name") == "plans"]
    if [(v.get("configMap") or {}).get("name") for v in plans] != [name]:
        return "it does not mount the gate's plans ConfigMap of its name"
    return None


def _json_body(resp: object) -> dict[str, Any]:
    """The JSON object in a ``_preload_content=False`` response: urllib3's, whatever model the
    generated method's annotation names."""
    doc: dict[str, Any] = json.loads(cast(urllib3.BaseHTTPResponse, resp).data)
    return doc


class Store:
    """Verdict ConfigMaps and smoke Jobs in the operator's namespace."""

    def __init__(self, client: Client, namespace: str):
        self.client, self.namespace = client, namespace
        self.batch = k8s.BatchV1Api(client.api)

    def read(self, identity: G.Identity) -> dict[str, Any] | None:
        cm = self.client.get_configmap(self.namespace, G.store_name(identity))
        if cm is None:
            return None
        raw = (cm.get("data") or {}).get(G.VERDICT_KEY)
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
        wins. A pass with golden values keeps them beside it (``golden.json``)."""
        golden = GG.golden_doc(record)
        record = {k: v for k, v in record.items() if k != "golden" and not k.startswith("_")}
        if self.client.create(B.verdict_configmap(record, self.namespace, golden=golden)):
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
            golden=golden,
            resource_version=(cm or {}).get("metadata", {}).get("resourceVersion"),
        )
        try:
            # the body is a dict: validate_call parses it into V1ConfigMap
            self.client.core.replace_namespaced_config_map(
                name,
                self.namespace,
                body,  # type: ignore[arg-type]
                _preload_content=False,
            )
        except ApiException as exc:
            if exc.status not in (404, 409):  # someone else wrote it first: theirs is as good
                raise

    def follow(self, tag: G.Identity, digest_rec: dict[str, Any] | None) -> None:
        """The tag moved to a digest that passed: the tag's verdict follows it (once)."""
        old = self.read(tag)
        if digest_rec is None or not digest_rec.get("passed"):
            return
        if (
            old
            and old.get("passed")
            and old.get("observedDigest") == digest_rec.get("observedDigest")
        ):
            return
        self.write(GD.followed_record(tag, old, digest_rec))

    def revoke(
        self,
        tag: G.Identity,
        digest_rec: dict[str, Any] | None,
        now: dt.datetime,
        config: G.GateConfig,
    ) -> None:
        """The tag moved to a digest that failed: its cached pass no longer vouches (once)."""
        old = self.read(tag)
        if (
            digest_rec is None
            or digest_rec.get("passed")
            or (old is not None and not old.get("passed"))
        ):
            return
        self.write(GD.revoked_record(tag, old, digest_rec, now, config))

    def latest_golden(self, key: str, exclude: str) -> dict[str, Any] | None:
        """The SmokeGolden of the newest pass with golden key ``key`` (another identity's)."""
        resp = self.client.core.list_namespaced_config_map(
            self.namespace,
            label_selector=f"{GG.LABEL_GOLDEN_KEY}={key},{C.GROUP}/gate-passed=true",
            _preload_content=False,
        )
        best = None
        for cm in _json_body(resp)["items"]:
            data = cm.get("data") or {}
            if (cm["metadata"].get("labels") or {}).get(G.LABEL_GATE_KEY) == exclude:
                continue
            try:
                doc = parse_smoke_golden(data.get(GG.GOLDEN_DATA_KEY, ""))
                when = parse_gate_verdict(data.get(G.VERDICT_KEY, ""))["verifiedAt"]
            except DocumentError:
                continue
            if best is None or when > best[0]:
                best = (when, doc)
        return best[1] if best else None

    def observe(
        self, job_name: str, identity: G.Identity, config: G.GateConfig
    ) -> G.SmokeObservation | None:
        """The smoke Job ``job_name`` of ``identity`` and the pods its controller made (a pod
        with its labels that it does not control is not its result); None: no such Job. Raises
        :class:`GateConflict` for a Job of that name this gate did not make."""
        try:
            job = _json_body(
                self.batch.read_namespaced_job(job_name, self.namespace, _preload_content=False)
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        why = foreign_smoke_job(job, config, identity.image)
        if why is not None:
            raise GateConflict(
                f"Job {self.namespace}/{job_name} has the smoke test's name but {why}: the gate "
                "neither uses nor deletes it (delete it to let the smoke test run)"
            )
        uid = job["metadata"].get("uid")
        pods = [
            p
            for p in self.client.list_pods(self.namespace, {"job-name": job_name})
            if controller_uid(p) == uid
        ]
        return G.observe(job, pods)

    def create_plans(
        self,
        identity: G.Identity,
        attempt: int,
        config: G.GateConfig,
        plans: dict[str, Any],
        golden: dict[str, Any] | None = None,
    ) -> None:
        """Before the Job: its pod mounts them ("already exists": another job made the same
        ones, checked: plans that are not these raise :class:`GateConflict`)."""
        body = B.smoke_plans_configmap(identity, attempt, config, plans, golden)
        if self.client.create(body):
            return
        name = body["metadata"]["name"]
        have = self.client.get_configmap(self.namespace, name)
        if (
            have is not None
            and (have.get("data") or {}).get(B.PLANS_KEY) != body["data"][B.PLANS_KEY]
        ):
            raise GateConflict(
                f"ConfigMap {self.namespace}/{name} has the smoke plans' name but not the plans "
                "this gate wrote: the gate neither uses nor deletes it (delete it to let the "
                "smoke test run)"
            )

    def create_job(self, job: dict[str, Any]) -> bool:
        try:
            # the body is a dict: validate_call parses it into V1Job (the annotation names only
            # the model)
            self.batch.create_namespaced_job(
                self.namespace,
                job,  # type: ignore[arg-type]
                _preload_content=False,
            )
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
    client: Client,
    config: G.GateConfig | G.GateError,
    now: dt.datetime | None = None,
    *,
    keep_seconds: float | None = None,
    batch: k8s.BatchV1Api | None = None,
) -> list[str]:
    """Delete smoke Jobs that finished more than ``keep_seconds`` ago: those whose verdict is
    in the store (or superseded by a later attempt), and orphans whose verdict nobody recorded
    (a job waiting on a smoke Job records its verdict on its next pass, seconds after it ends;
    one still unrecorded after the keep time lost its last waiting job, and a later job on the
    identity tests again). Returns their names. ``config``: the operator's gate settings (nothing
    to do when they are invalid or the gate is off)."""
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
    for job in _json_body(resp)["items"]:
        name = job["metadata"]["name"]
        done = _finished_at(job)
        if done is None or (now - done).total_seconds() < keep:
            continue
        image = (job["metadata"].get("annotations") or {}).get(f"{C.GROUP}/gate-image", "")
        if foreign_smoke_job(job, config, image) is not None:
            continue  # not the gate's: never deleted
        key, _, attempt = name.removeprefix(G.SMOKE_JOB_PREFIX).rpartition("-")
        if not (key and attempt.isdigit()):
            continue
        cm = client.get_configmap(config.namespace, f"{G.STORE_PREFIX}{key}")
        try:
            stored = parse_gate_verdict(((cm or {}).get("data") or {}).get(G.VERDICT_KEY, ""))
        except DocumentError:
            stored = None  # unrecorded past the keep time: an orphan
        if (
            stored is None
            or stored.get("smokeJob") == name
            or int(stored.get("attempt", 0)) > int(attempt)
        ):
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
