"""Re-placement during a job (``spec.placement.replan``; docs/placement.md "Re-placement during a
job"): one step of the tracking pass.

State lives in the cluster, never in the operator: the generation and the last switch's step and
prediction are the ``<job>-placement`` ConfigMap's (PlacementUpdate), the last check is
``status.replan``, the switches ``status.placementHistory``. A pass

1. records a generation the ConfigMap holds and the history lacks (an operator that stopped
   between writing the ConfigMap and the status), with its Event;
2. copies the trainer's ``placement: {generation, appliedAtStep}`` (progress document) into the
   history;
3. waits while the trainer has not applied the ConfigMap's generation;
4. once the trainer's statistics are ``everySteps`` past the last decision (or check), decides
   (``core.replan.decide``) and on Switch writes generation + 1 (a replace at the read's
   resourceVersion: a concurrent write fails the pass, which runs again on fresh reads), then
   records it as in 1.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from moe_contracts import placement_update
from moe_contracts.errors import MAX_DOCUMENT_BYTES, DocumentError
from moe_contracts.plan import MoEPlan

from .. import constants as C
from ..builders import common
from ..core import replan as core
from ..spec import JobSpec
from ..status import now_iso
from .client import ChildConflict
from .jobpass import Pass

log = logging.getLogger("moejob_operator")


def step(p: Pass, spec: JobSpec, plan: MoEPlan, progress: dict[str, Any] | None) -> None:
    """The re-placement step of a tracking pass; ``progress``: the trainer's decoded (and
    checked) TrainerProgress document, None while there is none."""
    rp = spec.placement.replan
    if rp is None or progress is None:
        return
    cm = _owned(p, common.placement_configmap_name(p.job))
    text = ((cm or {}).get("data") or {}).get(placement_update.KEY)
    if cm is None or not text:
        return  # launched without it (an operator before re-placement): nothing to switch
    try:
        current = placement_update.loads(text)
        if plan.placement is not None:  # the layers, experts and copies fit the plan's
            pl = plan.placement
            current.check(pl.num_layers, pl.num_experts, ep_size=pl.ep_size)
    except DocumentError as exc:
        log.warning("%s/%s: %s: %s", p.job.namespace, p.job.name, cm["metadata"]["name"], exc)
        return
    _recorded(p, current)
    got = core.applied(progress)
    if got is not None:
        _set_history(p, core.mark_applied(_history(p), *got))
    running = got[0] if got is not None else 0
    last = _status_replan(p)
    if current.generation > running:
        said = (
            (progress.get("placement") or {}).get("message") if isinstance(progress, dict) else ""
        )
        p.status["replan"] = {
            **last,
            "generation": current.generation,
            "message": (
                f"waiting for the trainer to apply generation {current.generation} at its next "
                f"checkpoint (it runs generation {running})"
                + (f"; the trainer says: {said}" if isinstance(said, str) and said else "")
            )[:600],
        }
        return
    stats_step = _stats_step(progress)
    checked = last.get("checkedAtStep")
    since = max(current.decided_at_step, checked if isinstance(checked, int) else 0)
    if stats_step is None or not core.due(stats_step, since, rp.every_steps):
        return
    if not core.boundary_left(stats_step, spec.checkpoint.every_steps, spec.training.steps):
        return  # the trainer would apply it at its last step, where it buys nothing
    routing = _owned(p, common.routing_stats_configmap_name(p.job))
    try:
        stats, which = core.fresh_stats(routing)
    except DocumentError as exc:
        p.status["replan"] = {**last, "message": f"routing statistics unreadable: {exc}"[:600]}
        return
    if stats is None:
        return
    try:
        inputs = core.inputs_from_plan(plan)
    except (KeyError, TypeError, ValueError, DocumentError) as exc:  # a plan it cannot read
        p.status["replan"] = {**last, "message": f"the plan cannot be re-planned: {exc!r}"[:600]}
        return
    baseline = (
        current.predicted.cross_group_bytes_after
        if current.generation > 0 and current.predicted is not None
        else inputs.baseline
    )
    # the copies running: the last switch's, else the plan's (a seed before copies were written)
    seed = None if plan.placement is None else plan.placement.replicas
    reps = current.replicas if current.generation > 0 else seed
    d = core.decide(
        inputs, current.permutation, stats, rp.min_predicted_gain_percent, baseline, reps
    )
    p.status["replan"] = {
        "checkedAtStep": stats_step,
        "generation": current.generation,
        "decision": d.decision,
        "statistics": which,
        "predictedCrossGroupBytesBefore": d.before,
        "predictedCrossGroupBytesAfter": d.after,
        "message": d.message[:600],
    }
    if not d.switch:
        return
    update = placement_update.PlacementUpdate(
        generation=current.generation + 1,
        permutation=d.permutation,
        decided_at_step=stats_step,
        reason=d.message[:600],
        predicted=placement_update.Predicted(
            cross_group_bytes_before=float(d.before), cross_group_bytes_after=float(d.after)
        ),
        replicas=d.replicas,
    )
    body = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {**cm["metadata"]},
        "data": {**(cm.get("data") or {}), placement_update.KEY: placement_update.dumps(update)},
    }
    p.client.replace_configmap(p.job.namespace, body)
    p.status["replan"]["generation"] = update.generation
    _recorded(p, update)


def _owned(p: Pass, name: str) -> dict[str, Any] | None:
    try:
        return p.client.get_owned_configmap(p.job.namespace, name, p.job.uid)
    except ChildConflict:
        return None  # someone else's: no document of this job (the launch reports the conflict)


def _recorded(p: Pass, update: placement_update.PlacementUpdate) -> None:
    """Generation ``update.generation`` in ``status.placementHistory``, with its Event, once."""
    history = _history(p)
    if update.generation == 0 or any(h.get("generation") == update.generation for h in history):
        return
    before = after = None
    if update.predicted is not None:
        before = round(update.predicted.cross_group_bytes_before)
        after = round(update.predicted.cross_group_bytes_after)
    entry = {
        "generation": update.generation,
        "decidedAtStep": update.decided_at_step,
        "predictedCrossGroupBytesBefore": before,
        "predictedCrossGroupBytesAfter": after,
        "time": now_iso(p.now),
    }
    _set_history(p, core.record_switch(history, {k: v for k, v in entry.items() if v is not None}))
    gain = f" ({100 * (before - after) / before:.1f}% less)" if before and after is not None else ""
    p.event(
        "Normal",
        C.R_PLACEMENT_UPDATED,
        f"placement generation {update.generation} from the routing statistics of step "
        f"{update.decided_at_step}: predicted cross-group bytes per step {before} -> {after}{gain}"
        "; the trainer switches at its next checkpoint",
    )


def _history(p: Pass) -> list[dict[str, Any]]:
    raw = p.status.get("placementHistory")
    return [h for h in raw if isinstance(h, dict)] if isinstance(raw, list) else []


def _set_history(p: Pass, history: list[dict[str, Any]]) -> None:
    if history:
        p.status["placementHistory"] = history
    else:
        p.status.pop("placementHistory", None)


def _status_replan(p: Pass) -> dict[str, Any]:
    raw = p.status.get("replan")
    return dict(raw) if isinstance(raw, dict) else {}


def _stats_step(progress: dict[str, Any]) -> int | None:
    """The trainer step of the statistics in the routing ConfigMap: the progress document's last
    published ``routingStats.step``; without that section its ``step``; None when the last
    publish failed (the ConfigMap holds older statistics, or none)."""
    rs = progress.get("routingStats")
    if isinstance(rs, dict):
        s = rs.get("step")
        ok = rs.get("published") is True and isinstance(s, int) and not isinstance(s, bool)
        return s if ok else None
    s = progress.get("step")
    return s if isinstance(s, int) and not isinstance(s, bool) else None


def decoded(raw: str) -> dict[str, Any] | None:
    """The progress ConfigMap's text as a JSON object (None when it is not one): the document's
    ``placement`` section, which the typed reader does not keep."""
    if len(raw) > MAX_DOCUMENT_BYTES:
        return None  # the typed reader refuses it, naming the size
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None
