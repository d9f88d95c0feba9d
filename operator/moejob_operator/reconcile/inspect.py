"""The inspection stage: before planning a job whose model is ``spec.model.path``, one short pod
reads the directory (read-only) and publishes a ModelReport into ConfigMap ``<job>-model``; the
planner then plans from the report's config as from ``spec.model.hfConfig``.

:func:`ensure_model` returns :class:`Inspected` or raises :class:`~.outcome.NotYet`
(``InspectionPending``; ``InspectionFailed`` with ``failed`` while a crashed pod is retried) or
:class:`~.outcome.Refused` (``core.model_report.REASONS``: no config.json, not an MoE, an
unsupported architecture, missing or truncated shards, a dtype the trainer cannot train, a
tokenizer with more ids than the model's vocabulary; ``InspectionFailed`` after
:data:`MAX_ATTEMPTS` crashed pods). :func:`recheck` runs right before the first launch: a second
pod hashes the directory again, and a hash that differs from the plan's ``model.contentHash``
refuses the launch (``ModelChanged``) instead of training a model nobody planned for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moe_contracts import env as E
from moe_contracts.errors import DocumentError
from moe_contracts.model import ModelReport, parse_model_report
from moe_contracts.plan import MoEPlan

from .. import constants as C
from ..builders import prepare as B
from ..builders.common import JobRef
from ..core.model_report import ModelRefused, resolve_report
from ..core.models import ResolvedModel
from ..spec import JobSpec
from . import machine
from .client import Client
from .outcome import NotYet, Refused

MAX_ATTEMPTS = 3
FIELD = "spec.model.path"


@dataclass(frozen=True)
class Inspected:
    model: ResolvedModel
    report: ModelReport
    message: str  # for the ModelInspected condition


def model_status(report: ModelReport, model: ResolvedModel) -> dict[str, Any]:
    """``status.model``: what a person wants to know about the inspected directory."""
    return {
        "path": report.path,
        "family": model.spec.family,
        "architectures": list(report.architectures),
        "parameters": report.parameters,
        "dtypes": sorted(report.dtypes),
        "shards": len(report.shards),
        "bytes": report.total_bytes,
        "tokenizer": report.tokenizer.present,
        "vocabSize": model.spec.vocab_size,
        "contentHash": report.content_hash,
    }


def ensure_children(
    client: Client, job: JobRef, spec: JobSpec, cm_name: str, component: str
) -> dict[str, Any]:
    """The report ConfigMap (seeded empty, annotated with the spec it is for; created with the
    prepare ServiceAccount, Role and binding the pods write it with). A ConfigMap of an earlier
    spec (edited before launch) and its pods go. Returns the ConfigMap as read."""
    want = spec.immutable_hash()
    cm = client.get_owned_configmap(job.namespace, cm_name, job.uid)
    have = (((cm or {}).get("metadata") or {}).get("annotations") or {}).get(C.ANNOTATION_SPEC_HASH)
    if cm is not None and have == want:
        return cm
    if cm is not None:
        selector = {C.LABEL_JOB: job.name, C.LABEL_COMPONENT: component}
        for pod in client.list_owned_pods(job.namespace, selector, job.uid)[0]:
            meta = pod["metadata"]
            client.delete_pod(job.namespace, meta["name"], uid=meta.get("uid"))
        client.delete_configmap(job.namespace, cm_name)
    for obj in B.rbac_objects(job):
        client.create(obj)
    seeded = B.report_configmap(job, cm_name, component)
    seeded["metadata"]["annotations"] = {C.ANNOTATION_SPEC_HASH: want}
    client.create(seeded)
    return seeded


def find_pod(client: Client, job: JobRef, name: str, component: str) -> dict[str, Any] | None:
    selector = {C.LABEL_JOB: job.name, C.LABEL_COMPONENT: component}
    for pod in client.list_owned_pods(job.namespace, selector, job.uid)[0]:
        if pod["metadata"]["name"] == name:
            return pod
    return None


def run_pod(
    client: Client,
    job: JobRef,
    pod_manifest: dict[str, Any],
    component: str,
    status: dict[str, Any],
    what: str,
    reasons: tuple[str, str] = (C.R_INSPECTION_PENDING, C.R_INSPECTION_FAILED),
) -> NotYet:
    """Create the pod when it is not there, replace a failed one (at most MAX_ATTEMPTS times):
    the NotYet (or Refused) to raise while its report is missing."""
    name = pod_manifest["metadata"]["name"]
    pod = find_pod(client, job, name, component)
    attempts_key = "failedPods"
    if pod is None:
        client.create(pod_manifest)
        return NotYet(reasons[0], f"{what} in pod {name}", 2.0)
    phase = (pod.get("status") or {}).get("phase")
    if phase == "Failed" or phase == "Succeeded":
        view = machine.PodView.from_pod(pod)
        attempts = int(status.get(attempts_key, 0)) + 1
        status[attempts_key] = attempts
        why = _tail(pod)
        msg = f"pod {name} ended {phase} without a report (exit code {view.exit_code}{why})"
        if attempts >= MAX_ATTEMPTS:
            raise Refused(reasons[1], f"{what}: {msg}; gave up after {attempts} pods")
        if not view.deleting:
            client.delete_pod(job.namespace, name, uid=view.uid)
        return NotYet(reasons[1], f"{what}: {msg}; retrying", 3.0, failed=True)
    return NotYet(reasons[0], f"{what} in pod {name} ({phase or 'Pending'})", 5.0)


def _tail(pod: dict[str, Any]) -> str:
    for cs in (pod.get("status") or {}).get("containerStatuses") or ():
        term = (cs.get("state") or {}).get("terminated") or {}
        if term.get("message"):
            return ": " + " ".join(term["message"].split())[-200:]
    return ""


def _report(cm: dict[str, Any], key: str) -> ModelReport | None:
    raw = (cm.get("data") or {}).get(key)
    if not raw:
        return None
    try:
        return parse_model_report(raw)
    except DocumentError as exc:
        raise Refused(
            C.R_INSPECTION_FAILED,
            f"{FIELD}: the inspection pod's report is not a ModelReport v1 ({exc}); is the "
            "image's moe-inspect from this operator's release?",
            FIELD,
        ) from None


def ensure_model(
    client: Client, job: JobRef, spec: JobSpec, status: dict[str, Any]
) -> Inspected | None:
    """The inspected model (None: the spec names a preset or hfConfig)."""
    if spec.model.path is None:
        return None
    name = B.model_configmap_name(job)
    cm = ensure_children(client, job, spec, name, B.COMPONENT_INSPECT)
    report = _report(cm, E.MODEL_REPORT_KEY)
    if report is None:
        # the pod publishes, then exits: a finished pod's report may be newer than our read
        pod = find_pod(client, job, B.inspect_pod_name(job), B.COMPONENT_INSPECT)
        if pod is not None and (pod.get("status") or {}).get("phase") == "Succeeded":
            report = _report(
                client.get_owned_configmap(job.namespace, name, job.uid) or {}, E.MODEL_REPORT_KEY
            )
    if report is None:
        state = status.setdefault("model", {})
        raise run_pod(
            client,
            job,
            B.inspect_pod(job, spec),
            B.COMPONENT_INSPECT,
            state,
            f"inspecting {spec.model.path}",
        )
    try:
        model = resolve_report(report, spec.model.path)
    except ModelRefused as exc:
        raise Refused(exc.reason, str(exc), FIELD) from None
    status["model"] = model_status(report, model)
    s = model.spec
    msg = (
        f"{spec.model.path}: {s.family}, {report.parameters} parameters "
        f"({', '.join(sorted(report.dtypes))}), {s.num_moe_layers} MoE layers x "
        f"{s.num_experts} experts top-{s.top_k}, {len(report.shards)} shard(s), "
        f"tokenizer {'yes' if report.tokenizer.present else 'no'}; {report.content_hash[:19]}"
    )
    return Inspected(model, report, msg)


def recheck(
    client: Client, job: JobRef, spec: JobSpec, plan: MoEPlan, status: dict[str, Any]
) -> str | None:
    """Before the first launch: the directory must still hash to the plan's contentHash.
    Returns a message when this call found it unchanged (None: nothing to check)."""
    planned = plan.model.content_hash
    if spec.model.path is None or not planned:
        return None
    state = status.setdefault("model", {})
    if state.get("launchHash") == planned:
        return None
    name = B.model_configmap_name(job)
    key = f"launch-{E.MODEL_REPORT_KEY}"
    cm = ensure_children(client, job, spec, name, B.COMPONENT_INSPECT)
    report = _report(cm, key)
    if report is None:
        pod = find_pod(client, job, B.inspect_pod_name(job, True), B.COMPONENT_INSPECT)
        if pod is not None and (pod.get("status") or {}).get("phase") == "Succeeded":
            report = _report(client.get_owned_configmap(job.namespace, name, job.uid) or {}, key)
    if report is None:
        raise run_pod(
            client,
            job,
            B.inspect_pod(job, spec, recheck=True),
            B.COMPONENT_INSPECT,
            state,
            f"checking {spec.model.path} again before the launch",
        )
    if report.content_hash != planned:
        raise Refused(
            C.R_MODEL_CHANGED,
            f"{FIELD}: {spec.model.path} changed after the plan was made (content hash "
            f"{planned[:19]} at planning, {report.content_hash[:19]} before the launch: "
            "config.json, the safetensors index or shard headers, or the tokenizer files "
            "differ); the job does not train a model it did not plan for. Restore the "
            "directory, or create a new job",
            FIELD,
        )
    state["launchHash"] = report.content_hash
    return f"{spec.model.path} is unchanged since planning ({planned[:19]})"
