"""The validate and plan stages of a pass: the spec accepted (or the launched values kept when an
immutable field changed after launch), the stored plan ConfigMap read back (only this job's:
controller ownerReference), a new plan written."""

from __future__ import annotations

import json
from typing import Any

from moe_contracts.errors import DocumentError
from moe_contracts.plan import MoEPlan, parse_plan

from .. import admission
from .. import constants as C
from ..builders import common, configmaps
from ..spec import AUTO, JobSpec, SpecError, changed_immutable_fields, field_hashes, parse_spec
from ..status import FALSE, TRUE
from . import planning
from .jobpass import Pass, _crashpoint, _is_launched
from .outcome import Refused


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
        p.cond(C.COND_SPEC_ACCEPTED, FALSE, exc.reason, exc.message, field=exc.field)
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
def _stored_plan(p: Pass, spec: JobSpec) -> MoEPlan | None:
    """The job's plan from its ConfigMap (None: none, or one of an edited spec or one that no
    longer parses before the launch, deleted here; after the launch an unreadable plan fails
    the job: its workers run it)."""
    name = common.plan_configmap_name(p.job)
    # A job that never recorded a plan has none unless an operator crashed between creating it
    # and writing status: skip the read (writing the new one answers "already exists" then).
    fresh = not p.status.get("plan") and not _is_launched(p.status)
    cm = None if fresh else p.client.get_owned_configmap(p.job.namespace, name, p.job.uid)
    if cm is None:
        return None
    if _spec_hash_of(cm) == spec.immutable_hash() or _is_launched(p.status):
        try:
            plan = parse_plan(json.loads((cm.get("data") or {}).get(C.PLAN_KEY) or "null"))
        except (ValueError, DocumentError) as exc:
            if _is_launched(p.status):
                raise Refused(
                    C.R_PLAN_FAILED, f"plan ConfigMap {name} no longer parses: {exc}"
                ) from None
            p.client.delete_configmap(p.job.namespace, name)  # plan again
            return None
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


def _new_plan(p: Pass, spec: JobSpec, reports: dict[str, Any], found: planning.Inputs) -> MoEPlan:
    """The plan stage (raises NotYet / Refused); the ConfigMap is written later in this pass."""
    cpu_memory = 0
    if spec.device == "CPU":
        count = spec.nodes.count
        assert count != AUTO, "sizing.check refuses Auto with device CPU (validate stage)"
        cpu_memory = planning.cpu_memory_per_process(
            spec, p.client.list_nodes(), list(reports)[:count]
        )
    plan = planning.make_plan(
        p.client, p.job, spec, reports, cpu_memory_bytes=cpu_memory, inputs=found, memo=p.plan_memo
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
    assert cm is not None, "called after writing the plan ConfigMap"
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
